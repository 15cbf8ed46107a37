#!/usr/bin/env python3
"""Bad input against `spade serve`: every request gets its own 4xx (or its own error), the
server stays up and keeps answering, and its memory stays near its idle level.

  python3 tests/e2e/test_server_hardening.py --spade build/spade [--only NAME]

The reproductions of the server-hardening issue, one test each: sparse options that used to
overflow a buffer or fail a whole batch, chunked and gzip bodies over the limit, header
floods, slow connections, oversized prompts, a Content-Length without a body, half-closed
clients, the connection cap, and the CLI's bad values. Python stdlib only; every socket is
on 127.0.0.1 and every loop is bounded in count and time.
"""
import argparse
import gzip
import json
import os
import socket
import subprocess
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spade_client import Server, repo_root, rss_env, rss_mb, time_scale  # noqa: E402

ROOT = repo_root()
STORIES = os.path.join(ROOT, "tests/fixtures/models/stories260k-hf")
TOKENIZER = os.path.join(STORIES, "tokenizer.model")
MIB = 1 << 20
# Time limits below are for the normal build; under the sanitizers they stretch by this.
SCALE = time_scale()
TESTS = []


def test(fn):
    TESTS.append(fn)
    return fn


def check(cond, msg="check failed"):
    if not cond:
        raise AssertionError(msg)


def connect(srv, timeout=10):
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def read_response(sock, timeout=10):
    """Reads one HTTP response (skipping 1xx) -> (status, headers dict, body bytes)."""
    timeout *= SCALE
    sock.settimeout(timeout)
    buf = b""
    deadline = time.time() + timeout
    while True:
        while b"\r\n\r\n" not in buf:
            if time.time() > deadline:
                raise TimeoutError("no response head")
            d = sock.recv(65536)
            if not d:
                raise ConnectionError("closed before a response head: %r" % buf[:200])
            buf += d
        head, _, rest = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        if 100 <= status < 200:
            buf = rest
            continue
        hdrs = {}
        for ln in lines[1:]:
            k, _, v = ln.partition(":")
            hdrs[k.strip().lower()] = v.strip()
        body = rest
        if "content-length" in hdrs:
            n = int(hdrs["content-length"])
            while len(body) < n and time.time() < deadline:
                d = sock.recv(65536)
                if not d:
                    break
                body += d
            body = body[:n]
        return status, hdrs, body


def send_in_background(sock, chunks):
    """Sends `chunks` (an iterable of bytes) on a thread; stops quietly when the server
    closes. Returns the thread."""
    def run():
        try:
            for c in chunks:
                sock.sendall(c)
        except OSError:
            pass
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def error_of(body):
    j = json.loads(body.decode("utf-8"))
    check("error" in j and j["error"]["message"], "no error object: %r" % (j,))
    return j["error"]


def health_ok(srv, within=1.0):
    within *= SCALE
    t0 = time.time()
    s, b, _ = srv.get("/health", timeout=within + 1)
    dt = time.time() - t0
    check(s == 200 and b["status"] == "ok", "health: %s %r" % (s, b))
    check(dt <= within, "/health took %.2f s (limit %.1f s)" % (dt, within))
    return dt


# ------------------------------------------------------------------ sparse options

@test
def sparse_option_out_of_range(srv):
    huge = 288230376151711744
    bodies = [
        {"sparse": {"method": "blasst", "tile": huge}},
        {"sparse": {"method": "blasst", "tile": 2 ** 31}},
        {"sparse": "blasst:tile=%d" % huge},
        {"sparse": {"method": "quest+twilight+blasst", "tile": huge}},
        {"sparse": {"method": "quest", "budget": -5}},
        {"sparse": {"method": "oracle-topp", "p": "nan"}},
        {"sparse": {"method": "blasst", "config": "/etc/passwd"}},
    ]
    for extra in bodies:
        req = {"prompt": "Hello there", "max_tokens": 3}
        req.update(extra)
        s, b, _ = srv.post("/v1/completions", req)
        check(s == 400, "%r: status %s %r" % (extra, s, b))
        check(b["error"]["param"] == "sparse", b)
    health_ok(srv)


@test
def bad_method_beside_good_requests(srv):
    """A request with a bad layer schedule sent with four good ones: it alone is refused."""
    bad_specs = [
        {"method": "tidal", "selection_layers": 1},
        {"method": "lessismore", "selection_layers": 0},
        {"method": "lessismore", "selection_layers": 1},
        {"method": "lessismore", "selection_layers": 2 ** 40},
        {"method": "lessismore", "dense_layers": 3},
    ]
    for spec in bad_specs:
        out = {}

        def run(i, sp):
            req = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
            if sp is not None:
                req["sparse"] = sp
            out[i] = srv.post("/v1/completions", req)

        ts = [threading.Thread(target=run, args=(i, spec if i == 0 else None)) for i in range(5)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        s, b, _ = out[0]
        check(s == 400 and b["error"]["param"] == "sparse", "%r: %s %r" % (spec, s, b))
        for i in range(1, 5):
            s, b, _ = out[i]
            check(s == 200 and b["usage"]["completion_tokens"] == 24, "neighbour %d: %s %r" % (i, s, b))
    health_ok(srv)


# ------------------------------------------------------------------ bodies

@test
def chunked_body_over_the_limit(srv):
    """40 MiB in chunks: 413 once the decoded body passes 16 MiB, not 200."""
    sk = connect(srv)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b"%x\r\n" % MIB + b"a" * MIB + b"\r\n"
    t0 = time.time()
    send_in_background(sk, [head] + [piece] * 40 + [b"0\r\n\r\n"])
    status, _, body = read_response(sk, timeout=30)
    sk.close()
    check(status == 413, "status %s: %r" % (status, body[:200]))
    error_of(body)
    check(time.time() - t0 < 20 * SCALE, "413 took %.1f s" % (time.time() - t0))
    health_ok(srv)


@test
def gzip_bomb(srv):
    """99 KiB of gzip that inflates to 100 MiB: 413. A small gzip body works; br gets 415."""
    bomb = gzip.compress(b"\0" * (100 * MIB), 9)
    check(len(bomb) < 200 * 1024, "bomb is %d bytes" % len(bomb))
    s, b, _ = srv.post("/v1/completions", bomb, headers={"Content-Encoding": "gzip"})
    check(s == 413, "bomb: %s %r" % (s, b))
    ok = gzip.compress(json.dumps({"prompt": "Once upon a time", "max_tokens": 4}).encode())
    s, b, _ = srv.post("/v1/completions", ok, headers={"Content-Encoding": "gzip"})
    check(s == 200 and b["usage"]["completion_tokens"] == 4, "gzip body: %s %r" % (s, b))
    s, b, _ = srv.post("/v1/completions", b"{}", headers={"Content-Encoding": "br"})
    check(s == 415, "br: %s %r" % (s, b))
    s, b, _ = srv.post("/v1/completions", b"not gzip", headers={"Content-Encoding": "gzip"})
    check(s == 400, "corrupt gzip: %s %r" % (s, b))
    health_ok(srv)


@test
def content_length_without_body(srv):
    """Content-Length: 1e12 and no body: 413 at once, not after a 30 s wait."""
    sk = connect(srv)
    t0 = time.time()
    sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n")
    status, _, body = read_response(sk, timeout=10)
    dt = time.time() - t0
    sk.close()
    check(status == 413 and dt < 1.0 * SCALE, "status %s after %.2f s" % (status, dt))
    error_of(body)


@test
def huge_prompt_under_the_body_limit(srv):
    """A 15 MiB prompt cannot fit the context: 400 before tokenizing, quickly."""
    for path, req in (("/v1/completions", {"prompt": "a" * (15 * MIB), "max_tokens": 2}),
                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b" * (15 * MIB)}]}),
                      ("/tokenize", {"prompt": "c" * (15 * MIB)})):
        t0 = time.time()
        s, b, _ = srv.post(path, req)
        dt = time.time() - t0
        check(s == 400 and b["error"]["code"] == "context_length_exceeded", "%s: %s %r" % (path, s, str(b)[:300]))
        check(dt < 2.0 * SCALE, "%s: the 400 took %.2f s" % (path, dt))
    health_ok(srv)


# ------------------------------------------------------------------ headers and connections

@test
def header_flood(srv):
    """A million header lines: 431 after the header limit, not 107 MB kept per connection."""
    sk = connect(srv)
    line = b"X-Flood: 0123456789\r\n"
    send_in_background(sk, [b"GET /health HTTP/1.1\r\nHost: x\r\n"] + [line * 10000] * 100 + [b"\r\n"])
    status, _, body = read_response(sk, timeout=20)
    sk.close()
    check(status == 431, "flood: status %s" % status)
    # Many small fields under the byte limit: the field count limit.
    sk = connect(srv)
    sk.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(150)) + b"\r\n")
    status, _, body = read_response(sk)
    sk.close()
    check(status == 431, "150 fields: status %s" % status)
    health_ok(srv)


@test
def slow_connections(srv, args):
    """100 slowloris connections: /health answers within 1 s throughout, and the server
    closes them (408) once the header deadline (--header-timeout 3) passes."""
    socks = []
    for _ in range(100):
        s = connect(srv)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    t0 = time.time()
    worst = 0.0
    while time.time() - t0 < 2.0:
        for s in socks:
            try:
                s.sendall(b"X")  # one more header byte now and then
            except OSError:
                pass
        worst = max(worst, health_ok(srv, within=1.0))
        time.sleep(0.2)
    print("    slow: /health worst %.3f s with 100 slow connections" % worst)
    # The header deadline (3 s in this server) ends them.
    time.sleep(max(0.0, 4.0 - (time.time() - t0)))
    ended = 0
    for s in socks:
        s.settimeout(2)
        try:
            d = s.recv(4096)
            if d == b"" or d.startswith(b"HTTP/1.1 408"):
                ended += 1
        except OSError:
            ended += 1
        s.close()
    check(ended == 100, "only %d of 100 slow connections were ended by the deadline" % ended)


@test
def half_closed_client_gets_its_answer(srv):
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}).encode()
    sk = connect(srv)
    sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body) + body)
    sk.shutdown(socket.SHUT_WR)
    status, _, resp = read_response(sk, timeout=30)
    sk.close()
    check(status == 200, "half-closed: %s %r" % (status, resp[:200]))
    j = json.loads(resp)
    check(j["usage"]["completion_tokens"] == 16, j)


@test
def connection_cap(srv, args):
    cap = Server(args.spade, STORIES, ["--max-connections", "8", "--max-batch", "2"], tokenizer=TOKENIZER)
    try:
        held = [connect(cap) for _ in range(8)]
        time.sleep(0.2)
        extra = connect(cap)
        status, _, body = read_response(extra)
        check(status == 503, "9th connection: %s" % status)
        check("too many open connections" in error_of(body)["message"], body)
        extra.close()
        for s in held:
            s.close()
        time.sleep(0.3)
        s, b, _ = cap.get("/health")
        check(s == 200, "health after the cap: %s" % s)
    finally:
        cap.stop()


# ------------------------------------------------------------------ CLI

@test
def cli_bad_values(srv, args):
    fifo = os.path.join("/tmp", "spade_fifo_%d.gguf" % os.getpid())
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    try:
        cases = [
            (["--model", STORIES, "--tokenizer", TOKENIZER, "--threads", "100000"], "--threads must be in [1, 1024]"),
            (["--model", fifo], "is not a regular file (a FIFO)"),
            (["--model", STORIES, "--tokenizer", TOKENIZER, "--kv-pages", "2000000000"], "more than this machine"),
            (["--model", STORIES, "--tokenizer", TOKENIZER, "--max-batch", "4294967297"], "--max-batch must be in"),
            (["--model", STORIES, "--tokenizer", TOKENIZER, "--max-connections", "0"], "--max-connections must be in"),
        ]
        for extra, want in cases:
            t0 = time.time()
            p = subprocess.run([args.spade, "serve", "--port", "0"] + extra, capture_output=True, timeout=30 * SCALE)
            err = p.stderr.decode("utf-8", "replace")
            check(p.returncode == 1 and want in err and time.time() - t0 < 20 * SCALE,
                  "%r: rc %s, %.1f s, stderr %r" % (extra, p.returncode, time.time() - t0, err[-300:]))
    finally:
        os.unlink(fifo)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spade", default=os.path.join(ROOT, "build/spade"))
    ap.add_argument("--only", default=None)
    args = ap.parse_args()
    args.spade = os.path.abspath(args.spade)
    t0 = time.time()
    # rss_env(): under ASan a small quarantine, so that the 100 MB bound below holds as is.
    srv = Server(args.spade, STORIES, ["--max-batch", "8", "--header-timeout", "3"], tokenizer=TOKENIZER,
                 env=rss_env())
    failed = []
    try:
        # Idle level: after a first request has sized the workspaces.
        srv.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8})
        idle = rss_mb(srv.proc.pid)
        peak = idle
        for fn in TESTS:
            if args.only and args.only not in fn.__name__:
                continue
            t = time.time()
            try:
                if fn.__code__.co_argcount == 2:
                    fn(srv, args)
                else:
                    fn(srv)
                peak = max(peak, rss_mb(srv.proc.pid))
                print("ok    %-36s %.1fs  rss %.0f MB" % (fn.__name__, time.time() - t, rss_mb(srv.proc.pid)),
                      flush=True)
            except Exception:  # noqa: BLE001
                failed.append(fn.__name__)
                print("FAIL  %s\n%s" % (fn.__name__, traceback.format_exc()), flush=True)
            if srv.proc.poll() is not None:
                failed.append("server exited with %s after %s" % (srv.proc.returncode, fn.__name__))
                break
        final = rss_mb(srv.proc.pid) if srv.proc.poll() is None else 0
        print("    rss: idle %.0f MB, after the sweep %.0f MB (peak seen %.0f MB)" % (idle, final, peak))
        if not args.only and final - idle > 100:
            failed.append("rss grew %.0f MB over its idle level (limit 100)" % (final - idle))
    finally:
        rc = srv.stop()
        if rc not in (0, None):
            failed.append("server exit code %s" % rc)
    print("%d passed, %d failed" % (len([f for f in TESTS if not args.only or args.only in f.__name__]) - len(
        [f for f in failed if not f.startswith(("rss", "server"))]), len(failed)))
    print("%s in %.1fs" % ("FAILED" if failed else "PASSED", time.time() - t0))
    if failed:
        print("failed: %s\nserver log tail:\n%s" % (failed, "".join(srv.log[-20:])))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
