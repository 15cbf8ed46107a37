#!/usr/bin/env python3
"""End-to-end tests of `spade serve` over real HTTP (Python stdlib only).

  python3 tests/e2e/test_server.py --spade build/spade [--only NAME] [--skip-smollm]

Runs against the tiny stories260k model (tests/fixtures/models/stories260k-hf) and, when
models/SmolLM2-135M-Instruct.Q4_1.gguf is present, a couple of checks with its real chat
template and UTF-8 output. Covers: completions and chat, streaming chunk format, stop
strings, per-request sparse methods, logprobs, tokenize/detokenize, a negative suite of
malformed requests, API keys, client disconnects, a concurrent load test (KV pages all
returned, checked through /metrics) and graceful shutdown on SIGTERM.
"""
import argparse
import json
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spade_client import Server, Stream, stream_all, wait_idle, repo_root  # noqa: E402

ROOT = repo_root()
STORIES = os.path.join(ROOT, "tests/fixtures/models/stories260k-hf")
SMOLLM = os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf")
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside "
         "in the park with her friends. ")

TESTS = []


def test(fn):
    TESTS.append(fn)
    return fn


def check(cond, msg="check failed"):
    if not cond:
        raise AssertionError(msg)


def check_error(status, body, want_status, param=None):
    check(status == want_status, "status %s, want %s: %s" % (status, want_status, body))
    check(isinstance(body, dict) and "error" in body, "no error object: %r" % (body,))
    e = body["error"]
    for k in ("message", "type", "code"):
        check(k in e, "error lacks %r: %r" % (k, e))
    check(isinstance(e["message"], str) and e["message"], "empty message")
    if param is not None:
        check(e.get("param") == param, "param %r, want %r" % (e.get("param"), param))


# ---------------------------------------------------------------- basic endpoints

@test
def health_models(srv):
    s, b, _ = srv.get("/health")
    check(s == 200 and b["status"] == "ok", b)
    s, b, _ = srv.get("/v1/models")
    check(s == 200 and b["object"] == "list" and b["data"][0]["id"] == "stories260k-hf", b)


@test
def completion(srv):
    req = {"model": "x", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    s, b, _ = srv.post("/v1/completions", req)
    check(s == 200, b)
    check(b["object"] == "text_completion" and b["id"].startswith("cmpl-"), b)
    ch = b["choices"][0]
    check(ch["index"] == 0 and ch["finish_reason"] == "length" and ch["text"], b)
    u = b["usage"]
    check(u["completion_tokens"] == 24 and u["total_tokens"] == u["prompt_tokens"] + 24, u)
    check("Lily" in ch["text"] or "girl" in ch["text"], "unexpected greedy text: %r" % ch["text"])
    s, b2, _ = srv.post("/v1/completions", req)
    check(b2["choices"][0]["text"] == ch["text"], "greedy output differs between calls")
    # Token-id prompts and echo.
    s, t, _ = srv.post("/tokenize", {"prompt": "Once upon a time"})
    s, b3, _ = srv.post("/v1/completions", dict(req, prompt=t["tokens"]))
    check(s == 200 and b3["choices"][0]["text"] == ch["text"], b3)
    s, b4, _ = srv.post("/v1/completions", dict(req, echo=True))
    check(b4["choices"][0]["text"] == "Once upon a time" + ch["text"], b4)
    # Default max_tokens is 16 for completions.
    s, b5, _ = srv.post("/v1/completions", {"prompt": "Once", "temperature": 0})
    check(b5["usage"]["completion_tokens"] == 16, b5["usage"])


@test
def completion_stream(srv):
    req = {"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0}
    s, whole, _ = srv.post("/v1/completions", req)
    text, events, finish, usage = stream_all(
        srv, "/v1/completions", dict(req, stream=True, stream_options={"include_usage": True}))
    check(events[-1] == "[DONE]", "stream does not end with [DONE]")
    check(text == whole["choices"][0]["text"], "stream %r != whole %r" % (text, whole["choices"][0]["text"]))
    check(finish == "length", finish)
    check(usage == whole["usage"], (usage, whole["usage"]))
    body = [e for e in events[:-1]]
    check(all(e["object"] == "text_completion" and e["id"] == body[0]["id"] for e in body), body[0])
    check(body[-1]["choices"] == [] and body[-1]["usage"], "last event before [DONE] is not usage")
    check(body[-2]["choices"][0]["finish_reason"] == "length", body[-2])
    check(all(e["choices"][0]["finish_reason"] is None for e in body[:-2]), "early finish_reason")
    # Tokens produced between two wake-ups of the handler share a chunk; at least one
    # content chunk precedes the final one.
    check(len(body) >= 3, "expected content chunks, got %d events" % len(body))
    # Without include_usage: no usage event.
    text2, events2, _, usage2 = stream_all(srv, "/v1/completions", dict(req, stream=True))
    check(text2 == text and usage2 is None and events2[-1] == "[DONE]", "stream without usage")


@test
def chat(srv):
    req = {"model": "x", "messages": [{"role": "system", "content": "Tell a story."},
                                      {"role": "user", "content": "A girl and a dog"}],
           "max_tokens": 20, "temperature": 0}
    s, b, _ = srv.post("/v1/chat/completions", req)
    check(s == 200, b)
    check(b["object"] == "chat.completion" and b["id"].startswith("chatcmpl-"), b)
    m = b["choices"][0]["message"]
    check(m["role"] == "assistant" and isinstance(m["content"], str), m)
    text, events, finish, _ = stream_all(srv, "/v1/chat/completions", dict(req, stream=True))
    check(text == m["content"], "chat stream %r != %r" % (text, m["content"]))
    first = events[0]["choices"][0]
    check(events[0]["object"] == "chat.completion.chunk", events[0])
    check(first["delta"].get("role") == "assistant", first)
    check(finish == b["choices"][0]["finish_reason"], finish)
    check(events[-1] == "[DONE]", events[-1])


@test
def stop_strings(srv):
    base = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0}
    s, b, _ = srv.post("/v1/completions", base)
    full = b["choices"][0]["text"]
    stop = full[12:16]
    check(len(stop) == 4, full)
    want = full[:full.index(stop)]
    s, b, _ = srv.post("/v1/completions", dict(base, stop=["@@never@@", stop]))
    check(b["choices"][0]["text"] == want, "stop: %r != %r" % (b["choices"][0]["text"], want))
    check(b["choices"][0]["finish_reason"] == "stop", b)
    text, _, finish, _ = stream_all(srv, "/v1/completions", dict(base, stream=True, stop=stop))
    check(text == want and finish == "stop", "stream stop: %r %r" % (text, finish))
    # A stop string that never occurs leaves the text alone.
    s, b, _ = srv.post("/v1/completions", dict(base, stop="@@"))
    check(b["choices"][0]["text"] == full and b["choices"][0]["finish_reason"] == "length", b)


@test
def sparse_per_request(srv):
    before = srv.metrics()
    prompt = STORY * 3
    for sp in ({"method": "streaming", "budget": 16}, {"method": "quest", "budget": 32}, "full"):
        s, b, _ = srv.post("/v1/completions", {"prompt": prompt, "max_tokens": 40, "temperature": 0,
                                               "sparse": sp})
        check(s == 200 and b["usage"]["completion_tokens"] == 40, (sp, b))
    m = srv.metrics()
    for name in ("streaming", "quest", "full"):
        k = 'spade_sparse_requests_total{method="%s"}' % name
        check(m.get(k, 0) >= before.get(k, 0) + 1, "no %s in metrics" % name)
    d = m['spade_sparse_density{method="streaming"}']
    check(0 < d < 0.5, "streaming density %s" % d)
    check(m['spade_sparse_density{method="full"}'] == 1.0, "full density")
    s, b, _ = srv.post("/v1/completions", {"prompt": "x", "sparse": {"method": "no-such"}})
    check_error(s, b, 400, "sparse")
    check("streaming" in b["error"]["message"], b)
    s, b, _ = srv.post("/v1/completions", {"prompt": "x", "sparse": {"method": "streaming", "bogus": 3}})
    check_error(s, b, 400, "sparse")


@test
def mixed_methods_in_one_batch(srv):
    results = {}

    def run(i, sp):
        body = {"prompt": STORY * 2, "max_tokens": 60, "temperature": 0, "stream": True}
        if sp:
            body["sparse"] = sp
        results[i] = stream_all(srv, "/v1/completions", body)

    methods = [None, {"method": "streaming", "budget": 16}, {"method": "quest", "budget": 32},
               {"method": "tidal", "budget": 32}, None, {"method": "streaming", "budget": 24}]
    ts = [threading.Thread(target=run, args=(i, sp)) for i, sp in enumerate(methods)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for i in range(len(methods)):
        text, events, finish, _ = results[i]
        check(finish == "length" and events[-1] == "[DONE]", (i, finish))
    # (Outputs are not compared across requests here: batch composition changes float
    # rounding; tests/test_scheduler.cpp checks batched outputs against a reference.)


@test
def logprobs(srv):
    s, b, _ = srv.post("/v1/completions", {"prompt": "Once", "max_tokens": 5, "temperature": 0, "logprobs": 2})
    lp = b["choices"][0]["logprobs"]
    check(len(lp["tokens"]) == 5 and len(lp["token_logprobs"]) == 5 and len(lp["top_logprobs"]) == 5, lp)
    check(all(x <= 0 for x in lp["token_logprobs"]), lp)
    check("".join(lp["tokens"]) == b["choices"][0]["text"], (lp["tokens"], b["choices"][0]["text"]))
    s, b, _ = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 4, "logprobs": True, "top_logprobs": 2})
    c = b["choices"][0]["logprobs"]["content"]
    check(len(c) == 4 and all(len(t["top_logprobs"]) == 2 and "bytes" in t for t in c), c)


@test
def tokenize_roundtrip(srv):
    s, b, _ = srv.post("/tokenize", {"prompt": "Once upon a time"})
    check(s == 200 and b["count"] == len(b["tokens"]) > 2 and b["max_model_len"] == 512, b)
    s, d, _ = srv.post("/detokenize", {"tokens": b["tokens"]})
    check(s == 200 and d["prompt"].strip().endswith("Once upon a time"), d)
    s, c, _ = srv.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    check(s == 200 and c["count"] > 0, c)
    s, e, _ = srv.post("/detokenize", {"tokens": [1, 99999]})
    check_error(s, e, 400, "tokens")


# ---------------------------------------------------------------- negative suite

@test
def malformed_requests(srv):
    bad = [
        (b"", 400), (b"{", 400), (b"null", 400), (b"[1,2]", 400), (b"\xff\xfe\xfd", 400),
        (b'{"prompt": "\xff"}', 400), (b'{"prompt": "\\ud800"}', 400), (b'{"prompt": 12}', 400),
        (b'{"prompt": "x", "max_tokens": "10"}', 400), (b'{"prompt": "x", "max_tokens": -5}', 400),
        (b'{"prompt": "x", "max_tokens": 1e400}', 400),
        (b'{"prompt": "x", "max_tokens": 123456789012345678901234567890}', 400),
        (b'{"prompt": "x", "max_tokens": 100000}', 400),  # beyond the context
        (b'{"prompt": "x", "temperature": 1e308}', 400), (b'{"prompt": "x", "top_p": -1}', 400),
        (b'{"prompt": "x", "n": 3}', 400), (b'{"prompt": "x", "stop": [1, 2]}', 400),
        (b'{"prompt": "x", "stream": "true"}', 400), (b'{"prompt": [1, 2, 999999]}', 400),
        (b'{"prompt": [-3]}', 400), (b'{"prompt": ["a", "b"]}', 400), (b'{"prompt": []}', 400),
        (b'{"prompt": "x", "sparse": 7}', 400), (b'{"prompt": "x", "logprobs": 99}', 400),
        (b'{"prompt": "x", "stop_token_ids": [100000]}', 400),
        (b'{"prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
        (b'{"prompt": "x", "extra": ' + b"[" * 200000 + b"}", 400),
        (b'{"prompt": "x"' + b" " * 100000 + b"", 400),
    ]
    for body, want in bad:
        s, b, _ = srv.post("/v1/completions", body)
        check_error(s, b, want)
    chat_bad = [b'{"messages": "hi"}', b'{"messages": []}', b'{"messages": [{"role": "user"}], "n": 2}',
                b'{"messages": [{"role": "user", "content": 5}]}', b'{"prompt": "x"}',
                b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}']
    for body in chat_bad:
        s, b, _ = srv.post("/v1/chat/completions", body)
        check_error(s, b, 400)
    # The prompt longer than the context: 400 with the lengths.
    s, b, _ = srv.post("/v1/completions", {"prompt": STORY * 40, "max_tokens": 5})
    check_error(s, b, 400)
    msg = b["error"]["message"]
    check("512" in msg and "prompt" in msg, msg)
    check(b["error"]["code"] == "context_length_exceeded", b)
    # Routing and method errors are JSON too.
    s, b, _ = srv.get("/v1/nothing")
    check_error(s, b, 404)
    s, b, _ = srv.get("/v1/completions")
    check(s in (404, 405), s)
    # A body over the limit.
    s, b, _ = srv.post("/v1/completions", b'{"prompt": "' + b"a" * (17 << 20) + b'"}')
    check_error(s, b, 413)
    # Garbage on the socket, then a half-written request, then a valid one still works.
    for junk in (b"\x00\x01\x02garbage\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"):
        sk = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        sk.sendall(junk)
        sk.close()
    s, b, _ = srv.get("/health")
    check(s == 200, "server unhealthy after malformed input")


@test
def api_key(srv, args):
    key_srv = Server(args.spade, STORIES, ["--api-key", "s3cret", "--max-batch", "2"], tokenizer=args.tokenizer)
    try:
        body = {"prompt": "Once", "max_tokens": 2}
        s, b, _ = key_srv.post("/v1/completions", body)
        check_error(s, b, 401)
        s, b, _ = key_srv.post("/v1/completions", body, headers={"Authorization": "Bearer wrong"})
        check_error(s, b, 401)
        s, b, _ = key_srv.post("/v1/completions", body, headers={"Authorization": "Bearer s3cret"})
        check(s == 200, b)
        # The scheme is case-insensitive (RFC 9110), the key is not.
        s, b, _ = key_srv.post("/v1/completions", body, headers={"Authorization": "bearer s3cret"})
        check(s == 200, b)
        s, b, _ = key_srv.post("/v1/completions", body, headers={"Authorization": "BEARER  s3cret"})
        check(s == 200, b)
        s, b, _ = key_srv.post("/v1/completions", body, headers={"Authorization": "bearer S3CRET"})
        check_error(s, b, 401)
        s, b, _ = key_srv.get("/health")
        check(s == 200, "health needs no key")
    finally:
        key_srv.stop()


# ---------------------------------------------------------------- disconnects and load

@test
def disconnect_frees_pages(srv):
    m0 = wait_idle(srv)
    c0 = m0['spade_requests_finished_total{reason="cancelled"}']
    # A stream closed after its first chunks.
    st = Stream(srv, "/v1/completions", {"prompt": STORY, "max_tokens": 450, "stream": True,
                                           "ignore_eos": True})
    it = st.events()
    next(it)
    next(it)
    st.close()
    # A non-streaming request whose client gives up. The client waits 20 ms: stories260k can
    # generate the 450 tokens in ~100 ms on an idle machine, so a 0.1 s wait raced the answer.
    c = srv.conn(timeout=0.02)
    t0 = time.time()
    c.request("POST", "/v1/completions", body=json.dumps({"prompt": STORY, "max_tokens": 450,
                                                         "ignore_eos": True}))
    try:
        r = c.getresponse()
        raise AssertionError("expected a client timeout, got HTTP %d after %.3f s: %r"
                             % (r.status, time.time() - t0, r.read()[:200]))
    except (socket.timeout, TimeoutError):
        pass
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    deadline = time.time() + 10
    while time.time() < deadline:
        m = wait_idle(srv)
        if m['spade_requests_finished_total{reason="cancelled"}'] >= c0 + 2:
            break
        time.sleep(0.05)
    check(m['spade_requests_finished_total{reason="cancelled"}'] >= c0 + 2, "disconnects not cancelled")
    check(m["spade_kv_pages_used"] == 0, "pages in use after disconnects: %s" % m["spade_kv_pages_used"])


@test
def load(srv, args):
    """>= 16 concurrent clients, a few hundred mixed requests, some disconnecting."""
    load_srv = Server(args.spade, STORIES, ["--max-batch", "8", "--max-queue", "6", "--kv-pages", "64",
                                            "--max-step-tokens", "256"], tokenizer=args.tokenizer)
    rng = random.Random(1234)
    n_clients, n_requests = args.clients, args.requests
    jobs = []
    for i in range(n_requests):
        words = STORY.split()
        plen = rng.choice([1, 3, 10, 30, 80, 150])
        prompt = " ".join((words * 20)[:plen])
        jobs.append({
            "chat": rng.random() < 0.3, "stream": rng.random() < 0.5,
            "disconnect": rng.random() < 0.1, "prompt": prompt,
            "max_tokens": rng.choice([1, 4, 16, 32, 64, 96]),
            "sparse": rng.choice([None, None, {"method": "streaming", "budget": 16},
                                  {"method": "quest", "budget": 32}]),
            "temperature": rng.choice([0, 0.8]), "seed": i,
        })
    statuses, failures, rejected = {}, [], [0]
    lock = threading.Lock()
    jitter = random.Random(99)

    def rng_lock_random():
        with lock:
            return jitter.random()

    queue = list(range(n_requests))

    def one(job):
        if job["chat"]:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": job["prompt"]}]}
        else:
            path, body = "/v1/completions", {"prompt": job["prompt"]}
        body.update(max_tokens=job["max_tokens"], temperature=job["temperature"], seed=job["seed"])
        if job["sparse"]:
            body["sparse"] = job["sparse"]
        if job["stream"]:
            body["stream"] = True
            st = Stream(load_srv, path, body, timeout=120)
            if st.status != 200:
                ev = next(st.events())
                check("error" in ev, ev)
                st.close()
                return st.status
            n = 0
            finish = None
            for ev in st.events():
                n += 1
                if job["disconnect"] and n == 2:
                    st.close()
                    return "disconnected"
                if ev != "[DONE]":
                    check("error" not in ev, ev)
                    for ch in ev["choices"]:
                        finish = ch.get("finish_reason") or finish
            st.close()
            check(finish in ("stop", "length"), "no finish_reason")
            return 200
        if job["disconnect"]:
            c = load_srv.conn(timeout=0.05)
            try:
                c.request("POST", path, body=json.dumps(body))
                r = c.getresponse()
                r.read()
                c.close()
                return r.status
            except (socket.timeout, TimeoutError):
                c.close()
                return "disconnected"
        s, b, _ = load_srv.post(path, body)
        if s == 200:
            ch = b["choices"][0]
            check(ch["finish_reason"] in ("stop", "length"), b)
            check(b["usage"]["completion_tokens"] <= job["max_tokens"], b)
        else:
            check_error(s, b, s)
        return s

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop()
            try:
                # 429 is the server's answer to a full queue: back off and retry, as
                # OpenAI clients do.
                give_up = time.time() + 60
                while True:
                    s = one(jobs[i])
                    if s != 429 or time.time() > give_up:
                        break
                    with lock:
                        rejected[0] += 1
                    time.sleep(0.02 + 0.1 * rng_lock_random())
            except Exception as e:  # noqa: BLE001
                with lock:
                    failures.append("request %d: %s" % (i, e))
                continue
            with lock:
                statuses[s] = statuses.get(s, 0) + 1

    t0 = time.time()
    ts = [threading.Thread(target=worker) for _ in range(n_clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    elapsed = time.time() - t0
    try:
        m = wait_idle(load_srv, 60)
        print("    load: %d requests from %d clients in %.1f s: %s, %d answers 429 (retried)" % (
            n_requests, n_clients, elapsed, statuses, rejected[0]))
        print("    load: finished %s, rejected %s, preemptions %d, kv pages in use %d" % (
            {k.split('"')[1]: int(v) for k, v in m.items() if k.startswith("spade_requests_finished_total")},
            {k.split('"')[1]: int(v) for k, v in m.items() if k.startswith("spade_requests_rejected_total")},
            m["spade_preemptions_total"], m["spade_kv_pages_used"]))
        check(not failures, "%d failures, first: %s" % (len(failures), failures[:3]))
        check(set(statuses) <= {200, 429, "disconnected"}, "unexpected statuses %s" % statuses)
        check(rejected[0] > 0, "the queue never filled: no 429 seen")
        check(sum(statuses.values()) == n_requests, "some requests unanswered")
        check(statuses.get(200, 0) > n_requests // 2, "too few successes %s" % statuses)
        check(m["spade_kv_pages_used"] == 0, "KV pages not returned: %s" % m["spade_kv_pages_used"])
        done = sum(v for k, v in m.items() if k.startswith("spade_requests_finished_total"))
        check(done == m["spade_requests_submitted_total"], "finished %s != submitted %s" % (
            done, m["spade_requests_submitted_total"]))
        s, b, _ = load_srv.get("/health")
        check(s == 200 and load_srv.proc.poll() is None, "server down after load")
    finally:
        rc = load_srv.stop()
        check(rc == 0, "exit code %s after SIGTERM" % rc)


@test
def graceful_shutdown(srv, args):
    sd = Server(args.spade, STORIES, ["--max-batch", "4"], tokenizer=args.tokenizer)
    results = {}

    ended = {}

    def run(i):
        results[i] = stream_all(sd, "/v1/completions", {"prompt": STORY, "max_tokens": 450, "stream": True,
                                                        "ignore_eos": True, "temperature": 0})
        ended[i] = time.time()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    time.sleep(0.15)
    t_signal = time.time()
    sd.proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    try:
        s, b, _ = sd.post("/v1/completions", {"prompt": "x", "max_tokens": 2}, timeout=5)
        check(s == 503, "new request while draining: %s %s" % (s, b))
    except (ConnectionError, OSError):
        pass  # already closed: also fine
    for t in ts:
        t.join(60)
    for i in range(3):
        text, events, finish, _ = results[i]
        check(finish == "length" and events[-1] == "[DONE]", "in-flight request %d cut: %s" % (i, finish))
    check(max(ended.values()) > t_signal, "requests ended before the signal: drain not exercised")
    sd.proc.wait(30)
    check(sd.proc.returncode == 0, "exit code %s" % sd.proc.returncode)
    check(any("draining" in line for line in sd.log), "no drain message")


# ---------------------------------------------------------------- real model

def smollm_checks(args):
    srv = Server(args.spade, SMOLLM, ["--max-batch", "4", "--kv-pages", "256"])
    try:
        req = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
               "max_tokens": 16, "temperature": 0}
        s, b, _ = srv.post("/v1/chat/completions", req)
        check(s == 200, b)
        ans = b["choices"][0]["message"]["content"]
        check("Paris" in ans, "SmolLM2 answer: %r" % ans)
        # UTF-8 across token boundaries: every SSE event decodes on its own (checked in
        # Stream) and the stream equals the whole response.
        req = {"messages": [{"role": "user", "content": "Écris une phrase en japonais avec des emojis 🎉: "
                             "こんにちは、元気ですか？"}], "max_tokens": 40, "temperature": 0}
        s, b, _ = srv.post("/v1/chat/completions", req)
        whole = b["choices"][0]["message"]["content"]
        text, events, _, _ = stream_all(srv, "/v1/chat/completions", dict(req, stream=True))
        check(text == whole, "stream %r != whole %r" % (text, whole))
        check("\ufffd" not in text, "replacement character in %r" % text)
        check(any(ord(c) > 127 for c in text), "expected non-ASCII output, got %r" % text)
        print("    smollm2: %r / %r" % (ans, text[:60]))
    finally:
        srv.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spade", default=os.path.join(ROOT, "build/spade"))
    ap.add_argument("--only", default=None, help="run only tests whose name contains this")
    ap.add_argument("--skip-smollm", action="store_true")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--requests", type=int, default=300)
    args = ap.parse_args()
    args.spade = os.path.abspath(args.spade)
    # The stories fixture's SentencePiece model (the same vocabulary as its tokenizer.json,
    # which tests/test_tokenizer_parity.cpp covers).
    args.tokenizer = os.path.join(STORIES, "tokenizer.model")
    t0 = time.time()
    srv = Server(args.spade, STORIES, ["--max-batch", "8"], tokenizer=args.tokenizer)
    failed = []
    try:
        for fn in TESTS:
            if args.only and args.only not in fn.__name__:
                continue
            t = time.time()
            try:
                if fn.__code__.co_argcount == 2:
                    fn(srv, args)
                else:
                    fn(srv)
                print("ok    %-28s %.1fs" % (fn.__name__, time.time() - t), flush=True)
            except Exception:  # noqa: BLE001
                failed.append(fn.__name__)
                print("FAIL  %s\n%s" % (fn.__name__, traceback.format_exc()), flush=True)
        if srv.proc.poll() is not None:
            failed.append("server exited with %s" % srv.proc.returncode)
    finally:
        rc = srv.stop()
        if rc not in (0, None):
            failed.append("main server exit code %s" % rc)
    if not args.only and not args.skip_smollm:
        if os.path.exists(SMOLLM):
            t = time.time()
            try:
                smollm_checks(args)
                print("ok    %-28s %.1fs" % ("smollm2", time.time() - t))
            except Exception:  # noqa: BLE001
                failed.append("smollm2")
                print("FAIL  smollm2\n%s" % traceback.format_exc())
        else:
            print("skip  smollm2 (no %s; run scripts/fetch_model.sh)" % SMOLLM)
    print("%s: %d failed, %.1fs" % ("FAILED" if failed else "PASSED", len(failed), time.time() - t0))
    if failed:
        print("server log tail:\n" + "".join(srv.log[-20:]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
