#!/usr/bin/env python3
"""End-to-end tests of `spade serve` over real HTTP (Python stdlib only).

  python3 tests/e2e/test_server.py --spade build/spade [--only NAME] [--skip-smollm]

Runs against the tiny stories260k model (tests/fixtures/models/stories260k-hf) and, when
models/SmolLM2-135M-Instruct.Q4_1.gguf is present, a couple of checks with its real chat
template and UTF-8 output. Covers: completions and chat, streaming chunk format, stop
strings, per-request sparse methods, logprobs, n choices, echo / prompt logprobs with
max_tokens 0, the 404 for an unknown model, the request log, tokenize/detokenize, a negative suite of
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
from spade_client import Server, Stream, stream_all, wait_idle, repo_root, time_scale  # noqa: E402

ROOT = repo_root()
STORIES = os.path.join(ROOT, "tests/fixtures/models/stories260k-hf")
SMOLLM = os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf")
SCALE = time_scale()  # 1, or more under the sanitizers: stretches the waits below
MODEL = "stories260k-hf"  # the name the server answers to (/v1/models; other names: 404)
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
    req = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
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
    req = {"model": MODEL, "messages": [{"role": "system", "content": "Tell a story."},
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
    for sp in ({"method": "streaming", "budget": 16}, {"method": "quest", "budget": 32}, "full",
               "streaming:budget=16"):
        s, b, _ = srv.post("/v1/completions", {"prompt": prompt, "max_tokens": 40, "temperature": 0,
                                               "sparse": sp})
        check(s == 200 and b["usage"]["completion_tokens"] == 40, (sp, b))
        # usage.sparse: the method, its options as given, its description, the density reached
        u = b["usage"]["sparse"]
        name = sp if isinstance(sp, str) and ":" not in sp else (sp["method"] if isinstance(sp, dict) else "streaming")
        check(u["method"] == name, (sp, u))
        if isinstance(sp, dict):
            check(u["options"] == {"budget": str(sp["budget"])}, (sp, u))
        check(name in u["description"], (sp, u))
        if name == "full":
            check(u["density"] == 1.0, u)
        else:
            check(0 < u["density"] < 0.9, (sp, u))
    # the string form gives the same answer as the object
    bodies = [srv.post("/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0, "sparse": sp})[1]
              for sp in ({"method": "streaming", "budget": 16}, "streaming:budget=16")]
    check(bodies[0]["choices"][0]["text"] == bodies[1]["choices"][0]["text"], bodies)
    check(bodies[0]["usage"]["sparse"]["density"] == bodies[1]["usage"]["sparse"]["density"], bodies)
    _, _, _, usage = stream_all(srv, "/v1/completions", {
        "prompt": prompt, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
        "sparse": "streaming:budget=16"})
    check(usage["sparse"]["method"] == "streaming" and usage["sparse"]["options"] == {"budget": "16"}, usage)
    check(0 < usage["sparse"]["density"] < 0.9, usage)
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


# ---------------------------------------------------------------- n, echo, prompt logprobs, model

@test
def n_choices(srv):
    req = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.5, "seed": 7,
           "n": 3, "ignore_eos": True}
    s, b, _ = srv.post("/v1/completions", req)
    check(s == 200, b)
    chs = b["choices"]
    check([c["index"] for c in chs] == [0, 1, 2], chs)
    check(all(c["finish_reason"] == "length" and c["text"] for c in chs), chs)
    s, t, _ = srv.post("/tokenize", {"prompt": "Once upon a time"})
    u = b["usage"]
    check(u["prompt_tokens"] == t["count"], u)  # the prompt counted once
    check(u["completion_tokens"] == 36 and u["total_tokens"] == t["count"] + 36, u)
    # Independent samples: choice i is the request with seed + i.
    texts = [c["text"] for c in chs]
    check(len(set(texts)) > 1, "three seeded samples at temperature 1.5 all equal: %r" % texts)
    for i in range(3):
        s, single, _ = srv.post("/v1/completions", dict(req, n=1, seed=7 + i))
        check(single["choices"][0]["text"] == texts[i], (i, single["choices"][0]["text"], texts[i]))
    # Streaming: every chunk names its choice; the per-choice texts equal the whole response.
    _, events, _, usage = stream_all(srv, "/v1/completions",
                                     dict(req, stream=True, stream_options={"include_usage": True}))
    check(events[-1] == "[DONE]", events[-1])
    per, finish = {}, {}
    for ev in events[:-1]:
        for c in ev["choices"]:
            per[c["index"]] = per.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                check(c["index"] not in finish, "two finish_reasons for choice %d" % c["index"])
                finish[c["index"]] = c["finish_reason"]
    check(per == {i: texts[i] for i in range(3)}, (per, texts))
    check(finish == {0: "length", 1: "length", 2: "length"}, finish)
    check(usage == u, (usage, u))
    # Chat, greedy: n equal choices, streamed with a role chunk each.
    creq = {"messages": [{"role": "user", "content": "A girl and a dog"}], "max_tokens": 8,
            "temperature": 0, "n": 3}
    s, c, _ = srv.post("/v1/chat/completions", creq)
    check(s == 200 and len(c["choices"]) == 3, c)
    contents = [x["message"]["content"] for x in c["choices"]]
    check(len(set(contents)) == 1, contents)
    _, events, _, _ = stream_all(srv, "/v1/chat/completions", dict(creq, stream=True))
    roles = [x["index"] for ev in events[:-1] for x in ev["choices"] if x["delta"].get("role")]
    check(sorted(roles) == [0, 1, 2], roles)
    per = {}
    for ev in events[:-1]:
        for x in ev["choices"]:
            per[x["index"]] = per.get(x["index"], "") + (x["delta"].get("content") or "")
    check(per == {0: contents[0], 1: contents[0], 2: contents[0]}, per)
    # Out of range: 400 naming n.
    for n in (0, 17, -1):
        s, e, _ = srv.post("/v1/completions", dict(req, n=n))
        check_error(s, e, 400, "n")
    s, e, _ = srv.post("/v1/chat/completions", dict(creq, n=0))
    check_error(s, e, 400, "n")


@test
def echo_logprobs(srv):
    """What lm-eval-harness's loglikelihood requests send: echo + logprobs + max_tokens 0."""
    s, t, _ = srv.post("/tokenize", {"prompt": STORY})
    ids = t["tokens"]
    P = len(ids)
    s, d, _ = srv.post("/detokenize", {"tokens": ids})  # token ids echo as they decode
    for prompt, want_text in ((ids, d["prompt"]), ([ids], d["prompt"]), (STORY, STORY)):
        s, b, _ = srv.post("/v1/completions", {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 2,
                                               "max_tokens": 0, "temperature": 0})
        check(s == 200, b)
        ch = b["choices"][0]
        check(ch["finish_reason"] == "length", ch)
        check(ch["text"] == want_text, (ch["text"], want_text))
        lp = ch["logprobs"]
        for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            check(len(lp[k]) == P, "%s has %d entries, want %d (the prompt's tokens)" % (k, len(lp[k]), P))
        check(lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None, lp["token_logprobs"][:2])
        check(all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:]), lp["token_logprobs"])
        check(all(len(x) == 2 for x in lp["top_logprobs"][1:]), lp["top_logprobs"][:3])
        # The best alternative is at least as likely as the prompt's token.
        check(all(max(alt.values()) >= l - 1e-5 for alt, l in zip(lp["top_logprobs"][1:], lp["token_logprobs"][1:])),
              "top_logprobs below the token's own")
        check(lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] < len(ch["text"]),
              lp["text_offset"])
        # Each token (after the first word) sits at its text_offset in the echoed text.
        text, off = ch["text"], lp["text_offset"]
        check(all(text[off[i]:off[i] + len(lp["tokens"][i])] == lp["tokens"][i] for i in range(2, P)),
              [(lp["tokens"][i], text[off[i]:off[i] + len(lp["tokens"][i])]) for i in range(P)][:6])
        check(b["usage"]["prompt_tokens"] == P and b["usage"]["completion_tokens"] == 0, b["usage"])
        # A well-trained story model finds its own story likely.
        check(sum(lp["token_logprobs"][1:]) / (P - 1) > -3.0, "mean prompt logprob %f" %
              (sum(lp["token_logprobs"][1:]) / (P - 1)))
    scores = lp["token_logprobs"]
    # echo with max_tokens > 0: the prompt, then the completion, in text and logprobs alike.
    s, g, _ = srv.post("/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 1})
    s, b, _ = srv.post("/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 1,
                                           "echo": True})
    ch = b["choices"][0]
    check(ch["text"] == d["prompt"] + g["choices"][0]["text"], (ch["text"], g["choices"][0]["text"]))
    lp = ch["logprobs"]
    check(len(lp["tokens"]) == P + 6 and lp["token_logprobs"][0] is None, len(lp["tokens"]))
    check(lp["tokens"][P:] == g["choices"][0]["logprobs"]["tokens"], lp["tokens"][P:])
    check(all(abs(a - b_) < 1e-4 for a, b_ in zip(lp["token_logprobs"][1:P], scores[1:])), "prompt scores differ")
    check(lp["text_offset"][P] == len(ch["text"]) - len(g["choices"][0]["text"]), lp["text_offset"][P - 1:])
    # Streamed: the echoed prompt with its scores first, then the completion.
    text, events, finish, _ = stream_all(srv, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 0,
                                                                  "max_tokens": 0, "stream": True})
    first = events[0]["choices"][0]
    check(first["logprobs"]["token_logprobs"][0] is None and len(first["logprobs"]["tokens"]) == P, first)
    check(text == d["prompt"] and finish == "length", (text, finish))
    # Without echo, max_tokens 0 stays a 400.
    s, e, _ = srv.post("/v1/completions", {"prompt": ids, "logprobs": 1, "max_tokens": 0})
    check_error(s, e, 400, "max_tokens")


@test
def prompt_logprobs(srv):
    s, t, _ = srv.post("/tokenize", {"prompt": "Once upon a time, there was a little girl"})
    ids = t["tokens"]
    s, b, _ = srv.post("/v1/completions", {"prompt": ids, "prompt_logprobs": 3, "max_tokens": 4, "temperature": 0})
    check(s == 200, b)
    ch = b["choices"][0]
    pl = ch["prompt_logprobs"]
    check(len(pl) == len(ids) and pl[0] is None, pl[:2])
    s, e, _ = srv.post("/v1/completions", {"prompt": ids, "echo": True, "logprobs": 3, "max_tokens": 0})
    echoed = e["choices"][0]["logprobs"]
    for i in range(1, len(ids)):
        entry = pl[i]
        own = entry[str(ids[i])]
        check(abs(own["logprob"] - echoed["token_logprobs"][i]) < 1e-4, (i, own, echoed["token_logprobs"][i]))
        check(own["rank"] >= 1 and isinstance(own["decoded_token"], str), own)
        # The prompt's token and the top 3 (ranks 1-3), the token listed once.
        check(len(entry) == (3 if own["rank"] <= 3 else 4), entry)
        check(sorted(v["rank"] for v in entry.values())[:3] == [1, 2, 3], entry)
    check(ch["logprobs"] is None and b["usage"]["completion_tokens"] == 4, ch)
    # Chat has no prompt_logprobs.
    s, e, _ = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1})
    check_error(s, e, 400, "prompt_logprobs")


@test
def unknown_model(srv):
    for path, body in (("/v1/completions", {"model": "gpt-4", "prompt": "Once"}),
                       ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})):
        s, b, _ = srv.post(path, body)
        check(s == 404, (s, b))
        check(b == {"error": {"message": b["error"]["message"], "type": "invalid_request_error", "param": "model",
                              "code": "model_not_found"}}, b)
        check("gpt-4" in b["error"]["message"] and MODEL in b["error"]["message"], b)
    s, b, _ = srv.post("/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 2})
    check(s == 200, b)
    s, b, _ = srv.post("/v1/completions", {"prompt": "Once", "max_tokens": 2})  # no model: the served one
    check(s == 200 and b["model"] == MODEL, b)


@test
def request_log(srv, args):
    """One stderr line per finished generation request; --quiet turns them off."""
    s, b, _ = srv.post("/v1/completions", {"prompt": "Once", "max_tokens": 3, "temperature": 0, "n": 2})
    rid = b["id"]
    s, e, _ = srv.post("/v1/completions", {"prompt": "Once", "model": "nope"})
    deadline = time.time() + 5 * SCALE
    lines = []
    while time.time() < deadline:
        lines = [l for l in srv.log if "[spade] request " in l]
        if any("id=%s " % rid in l for l in lines) and any("status=404" in l for l in lines):
            break
        time.sleep(0.05)
    mine = [l for l in lines if "id=%s " % rid in l]
    check(len(mine) == 1, "log lines for %s: %r" % (rid, mine))
    f = dict(kv.split("=", 1) for kv in mine[0].split()[2:])
    check(f["method"] == "POST" and f["path"] == "/v1/completions" and f["status"] == "200", f)
    check(f["finish"] == "length,length" and f["prompt_tokens"] == str(b["usage"]["prompt_tokens"]), f)
    check(f["completion_tokens"] == "6" and float(f["latency_ms"]) >= 0 and f["n"] == "2", f)
    check(any("status=404" in l and "finish=model_not_found" in l for l in lines), lines[-3:])
    quiet = Server(args.spade, STORIES, ["--quiet", "--max-batch", "2"], tokenizer=args.tokenizer)
    try:
        s, b, _ = quiet.post("/v1/completions", {"prompt": "Once", "max_tokens": 2})
        check(s == 200, b)
    finally:
        quiet.stop()
    check(not any("[spade] request " in l for l in quiet.log), "--quiet still logs requests")


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
        (b'{"prompt": "x", "n": 0}', 400), (b'{"prompt": "x", "n": 17}', 400),
        (b'{"prompt": "x", "max_tokens": 0}', 400),  # 0 only with echo
        (b'{"prompt": "x", "prompt_logprobs": 21}', 400), (b'{"prompt": "x", "stop": [1, 2]}', 400),
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
    chat_bad = [b'{"messages": "hi"}', b'{"messages": []}', b'{"messages": [{"role": "user"}], "n": 0}',
                b'{"messages": [{"role": "user", "content": "x"}], "echo": true}',
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
    deadline = time.time() + 10 * SCALE
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
                give_up = time.time() + 60 * SCALE
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
    # The signal goes once every request has streamed its first token (provably in flight), not
    # after a fixed sleep: the CPU decodes stories260k at ~10K tokens/s, so 450 tokens can end
    # well within 0.15 s.
    started = [threading.Event() for _ in range(3)]

    def run(i):
        s = Stream(sd, "/v1/completions", {"prompt": STORY, "max_tokens": 450, "stream": True,
                                           "ignore_eos": True, "temperature": 0})
        events, finish = [], None
        for ev in s.events():
            started[i].set()
            events.append(ev)
            if ev != "[DONE]":
                for ch in ev.get("choices", []):
                    finish = ch.get("finish_reason") or finish
        s.close()
        started[i].set()
        results[i] = ("", events, finish, None)
        ended[i] = time.time()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for e in started:
        e.wait(60)
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
