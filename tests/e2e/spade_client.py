"""Minimal stdlib client for `spade serve` (used by the e2e tests and the load benchmark).

Starts a server process on a free port, sends JSON requests with http.client, parses
Server-Sent Events streams, and reads /metrics. No third-party packages.
"""
import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time


class Server:
    """A `spade serve` process; the port is taken from its start-up line."""

    def __init__(self, spade, model, extra=(), tokenizer=None, env=None, start_timeout=120):
        cmd = [spade, "serve", "--model", model, "--port", "0", "--host", "127.0.0.1"]
        if tokenizer:
            cmd += ["--tokenizer", tokenizer]
        cmd += list(extra)
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=env)
        self.log = []
        self.port = None
        deadline = time.time() + start_timeout
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            line = line.decode("utf-8", "replace")
            self.log.append(line)
            m = re.search(r"on http://[^:]+:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        if self.port is None:
            self.proc.kill()
            raise RuntimeError("server did not start: " + " ".join(cmd) + "\n" + "".join(self.log))
        self._drain = threading.Thread(target=self._drain_stderr, daemon=True)
        self._drain.start()

    def _drain_stderr(self):
        for line in self.proc.stderr:
            self.log.append(line.decode("utf-8", "replace"))

    def conn(self, timeout=120):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method, path, body=None, headers=None, timeout=120, raw=False):
        """Returns (status, parsed JSON or text, headers)."""
        c = self.conn(timeout)
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        if body is not None and not isinstance(body, (bytes, str)):
            body = json.dumps(body)
        c.request(method, path, body=body, headers=h)
        r = c.getresponse()
        data = r.read()
        c.close()
        if raw:
            return r.status, data, dict(r.getheaders())
        try:
            return r.status, json.loads(data.decode("utf-8")), dict(r.getheaders())
        except ValueError:
            return r.status, data.decode("utf-8", "replace"), dict(r.getheaders())

    def post(self, path, body, **kw):
        return self.request("POST", path, body, **kw)

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def metrics(self):
        status, text, _ = self.request("GET", "/metrics")
        assert status == 200, status
        return parse_metrics(text)

    def stop(self, sig=signal.SIGTERM, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def parse_metrics(text):
    """Prometheus text -> {'name{labels}': value} (and bare names)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out


class Stream:
    """A streaming request: iterate events (parsed JSON, or the string '[DONE]')."""

    def __init__(self, server, path, body, headers=None, timeout=120):
        self.c = server.conn(timeout)
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        self.c.request("POST", path, body=json.dumps(body), headers=h)
        self.resp = self.c.getresponse()
        self.status = self.resp.status
        self.headers = dict(self.resp.getheaders())
        self.buf = b""
        self.raw_events = []

    def events(self):
        if self.status != 200:
            yield json.loads(self.resp.read().decode("utf-8"))
            return
        while True:
            while b"\n\n" not in self.buf:
                chunk = self.resp.read1(65536)
                if not chunk:
                    if self.buf.strip():
                        raise AssertionError("stream ended inside an event: %r" % self.buf[:200])
                    return
                self.buf += chunk
            event, self.buf = self.buf.split(b"\n\n", 1)
            self.raw_events.append(event)
            # Every event must be valid UTF-8 on its own: no character split across events.
            text = event.decode("utf-8")
            assert text.startswith("data: "), "not an SSE data event: %r" % text[:200]
            payload = text[len("data: "):]
            if payload == "[DONE]":
                yield "[DONE]"
                continue
            yield json.loads(payload)

    def close(self):
        try:
            self.c.sock.shutdown(2)
        except Exception:
            pass
        self.c.close()


def stream_all(server, path, body, **kw):
    """Runs a stream to the end; returns (text, events, finish_reason, usage)."""
    s = Stream(server, path, body, **kw)
    text, events, finish, usage = "", [], None, None
    for ev in s.events():
        events.append(ev)
        if ev == "[DONE]" or "error" in ev:
            continue
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices", []):
            if "delta" in ch:
                text += ch["delta"].get("content") or ""
            else:
                text += ch.get("text", "")
            if ch.get("finish_reason"):
                finish = ch["finish_reason"]
    s.close()
    return text, events, finish, usage


def wait_idle(server, timeout=60):
    """Polls /metrics until nothing runs or waits; returns the last metrics."""
    deadline = time.time() + timeout * time_scale()
    m = server.metrics()
    while time.time() < deadline:
        m = server.metrics()
        if m.get("spade_requests_running", 1) == 0 and m.get("spade_requests_waiting", 1) == 0:
            return m
        time.sleep(0.05)
    return m


def sanitized():
    """True when `spade` is the ASan + UBSan build (scripts/run_sanitized_tests.sh sets
    SPADE_SANITIZED=1)."""
    return os.environ.get("SPADE_SANITIZED") == "1"


def time_scale():
    """The factor of the e2e tests' time limits: 1 for the normal build, 4 under the
    sanitizers (ASan + UBSan at -O1 run the server 2-5x slower); SPADE_TIME_SCALE overrides."""
    v = os.environ.get("SPADE_TIME_SCALE")
    return float(v) if v else (4.0 if sanitized() else 1.0)


# ASan keeps freed memory in a quarantine (256 MB by default) to catch uses after free, and
# that memory stays resident; with detect_stack_use_after_return each thread's frames live on
# a "fake stack" that only grows (hundreds of MB over the soak's 160 HTTP workers). A server
# whose RSS a test bounds runs with a small quarantine, without fake stacks, and with free
# pages handed back to the OS every 100 ms, so that its RSS is the program's, not ASan's.
# The other sanitized servers and the unit tests keep every check.
RSS_ASAN_OPTIONS = ("quarantine_size_mb=16:thread_local_quarantine_size_kb=64:"
                    "allocator_release_to_os_interval_ms=100:detect_stack_use_after_return=0")


def rss_env():
    """Environment for a server whose RSS a test measures (None = inherit unchanged)."""
    if not sanitized():
        return None
    env = dict(os.environ)
    env["ASAN_OPTIONS"] = ":".join(x for x in (env.get("ASAN_OPTIONS", ""), RSS_ASAN_OPTIONS) if x)
    return env


def rss_mb(pid):
    """Resident set size of process `pid` in MiB (VmRSS)."""
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def repo_root():
    return os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
