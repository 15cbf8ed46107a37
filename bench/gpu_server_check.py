#!/usr/bin/env python3
"""Smoke checks of `spade serve --device cuda` on the GPU machine (run by bench/run_gpu_server.sh):
a greedy completion equals `spade generate --device cuda` on the same prompt, streaming
works, a request naming another sparse method gets a 400 naming the server's method, and the
KV pages are all back at the end. With --sparse M (and --budget N, --prompt-file F: a long
prompt) the server and generate both run M on the GPU, and a request naming M with the same
budget is served too. Exits non-zero on a failure."""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "e2e"))
from spade_client import Server, stream_all, wait_idle  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spade", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--sparse", default="full")
    ap.add_argument("--budget", type=int, default=0)
    ap.add_argument("--prompt-file", default="")
    a = ap.parse_args()
    method = ["--sparse", a.sparse] + (["--budget", str(a.budget)] if a.budget else [])
    bad = 0

    def check(ok, what):
        nonlocal bad
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        bad += 0 if ok else 1

    prompt = open(a.prompt_file).read() if a.prompt_file else "The capital of France is"
    gen = subprocess.run([a.spade, "generate", "--model", a.model, "--device", "cuda", "--prompt", prompt,
                          "-n", "24", "--ignore-eos"] + method, capture_output=True, text=True, timeout=300)
    srv = Server(a.spade, a.model, ["--device", "cuda", "--max-batch", "8"] + method)
    try:
        st, body, _ = srv.post("/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                                   "ignore_eos": True})
        text = body["choices"][0]["text"] if st == 200 else body
        check(st == 200 and text.strip() == gen.stdout.strip(),
              "completion equals generate --device cuda: %r vs %r" % (text, gen.stdout.strip()))
        text2, events, finish, _ = stream_all(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 24,
                                                                       "temperature": 0, "stream": True,
                                                                       "ignore_eos": True})
        check(finish == "length" and events[-1] == "[DONE]" and text2 == text, "streaming: same text, [DONE]")
        other = "streaming" if a.sparse == "quest" else "quest"
        st, body, _ = srv.post("/v1/completions", {"prompt": prompt, "max_tokens": 4,
                                                   "sparse": {"method": other, "budget": 64}})
        msg = body.get("error", {}).get("message", "") if isinstance(body, dict) else str(body)
        check(st == 400 and ("runs every request with '%s'" % a.sparse) in msg,
              "another sparse method on the GPU: 400 (%s)" % msg)
        if a.sparse != "full":
            same = {"method": a.sparse, **({"budget": a.budget} if a.budget else {})}
            st, body, _ = srv.post("/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                                       "ignore_eos": True, "sparse": same})
            check(st == 200 and body["choices"][0]["text"] == text,
                  "a request naming the server's method: 200, same text (%s)" % st)
        wait_idle(srv)
        m = srv.metrics()
        check(m.get("spade_kv_pages_used", -1) == 0, "KV pages returned: %s" % m.get("spade_kv_pages_used"))
    finally:
        srv.proc.terminate()
        srv.proc.wait(30)
    print("%d failure(s)" % bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
