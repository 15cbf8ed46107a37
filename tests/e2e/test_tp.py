#!/usr/bin/env python3
"""`--tp N` on the CPU (issue 39): rank 0 starts N-1 follower processes of the same binary.

- generate --tp 2 on stories260k prints exactly the greedy text of --tp 1 (and a chat-style
  SmolLM2 prompt at --tp 3, its 3 KV heads, when models/SmolLM2-135M-Instruct.Q4_1.gguf is
  present); no rank is left behind.
- every CPU sparse method: generate --tp 2 --sparse M on stories260k (4 KV heads, budgets below
  its 60-token context) prints exactly --tp 1 --sparse M's greedy text (LessIsMore's one set
  gathered across the ranks, LycheeDecode's roles sliced to each rank's heads); SmolLM2 at
  --tp 3 with lessismore and lycheedecode (its trained roles) when the model is present.
- clear errors before any rank starts: --tp 2 on SmolLM2 (3 KV heads), --tp 0, --tp-rank
  without --dist-init, --recall under --tp.
- serve --tp 2: a completion equals generate's text, and one with a per-request sparse method
  equals generate --sparse's; a per-request recall is refused with a 400; a follower killed
  while the server idles makes rank 0 exit non-zero with a message naming the rank, within
  seconds.
- a follower killed during a long generation (SmolLM2) makes rank 0 exit non-zero with a
  message within seconds, and the other follower exits too.
"""
import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STORIES = os.path.join(ROOT, "tests/fixtures/models/stories260k-hf")
SMOLLM = os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spade_client import time_scale  # noqa: E402

failures = 0
SCALE = time_scale()


def check(cond, what):
    global failures
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    failures += 0 if cond else 1


def run(*args, timeout=60):
    return subprocess.run([SPADE, *args], capture_output=True, text=True, timeout=timeout * SCALE)


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def wait_exit(p, limit):
    t0 = time.monotonic()
    try:
        p.wait(timeout=limit * SCALE)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return None, time.monotonic() - t0
    return p.returncode, time.monotonic() - t0


def greedy(model, prompt, n, tp, *extra):
    return run("generate", "-m", model, "-p", prompt, "-n", str(n), "--threads", "1",
               "--tp", str(tp), *extra)


def test_generate_equal():
    one = greedy(STORIES, "Once upon a time", 40, 1)
    two = greedy(STORIES, "Once upon a time", 40, 2)
    check(one.returncode == 0 and two.returncode == 0, f"stories260k --tp 1 / 2 run ({two.stderr.strip()})")
    check(one.stdout == two.stdout and len(one.stdout) > 20,
          f"stories260k --tp 2 prints --tp 1's greedy text: {two.stdout.strip()!r}")
    # Ranks started by hand (several hosts): rank 0 listens on --dist-init, rank 1 joins it.
    import socket
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    addr = f"127.0.0.1:{port}"
    args = ["generate", "-m", STORIES, "-p", "Once upon a time", "-n", "40", "--threads", "1", "--tp", "2"]
    r0 = subprocess.Popen([SPADE, *args, "--dist-init", addr], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    r1 = subprocess.Popen([SPADE, *args, "--tp-rank", "1", "--dist-init", addr],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out0, err0 = r0.communicate(timeout=60 * SCALE)
    out1, err1 = r1.communicate(timeout=60 * SCALE)
    check(r0.returncode == 0 and r1.returncode == 0 and out0 == one.stdout and out1 == "",
          f"--dist-init by hand: rank 0 prints --tp 1's text, rank 1 nothing ({err0.strip()} {err1.strip()})")
    if os.path.exists(SMOLLM):
        one = greedy(SMOLLM, "The capital of France is", 24, 1, "--ignore-eos")
        three = greedy(SMOLLM, "The capital of France is", 24, 3, "--ignore-eos")
        check(three.returncode == 0 and one.stdout == three.stdout and len(one.stdout) > 20,
              f"SmolLM2 --tp 3 prints --tp 1's greedy text: {three.stdout.strip()!r} ({three.stderr.strip()})")
    else:
        print("skip SmolLM2 --tp 3 (no models/SmolLM2-135M-Instruct.Q4_1.gguf)")


# One spec per CPU method, sized for stories260k (5 layers, 4 KV heads) at ~60 tokens.
METHODS = [
    ("streaming", "budget=24"),
    ("quest", "budget=32"),
    ("tidal", "budget=24"),
    ("lessismore", "budget=32"),
    ("oracle-topk", "budget=24"),
    ("oracle-topp", "p=0.8"),
    ("lycheecluster", "budget=32"),
    ("lycheedecode", "roles=RRRR/SRSR/RSRS/SSRR/RSSR,budget=24"),
    ("twilight", "budget=32"),
    ("blasst", "lambda=0.5,tile=8,prefill_tile=8,q_block=8"),
]


def test_sparse_methods_equal():
    prompt = "Once upon a time, there was a little girl named Lily. She"
    for method, opts in METHODS:
        flags = ("--sparse", method, "--sparse-opt", opts, "--ignore-eos")
        one = greedy(STORIES, prompt, 48, 1, *flags)
        two = greedy(STORIES, prompt, 48, 2, *flags)
        check(one.returncode == 0 and two.returncode == 0 and one.stdout == two.stdout
              and len(one.stdout) > 20,
              f"--tp 2 --sparse {method} prints --tp 1's text: {two.stdout.strip()[-40:]!r} "
              f"({one.stderr.strip()[-200:]} {two.stderr.strip()[-200:]})")
    # SmolLM2 at --tp 3 (one KV head per rank): LessIsMore's set gathered over 3 ranks, and
    # LycheeDecode's trained roles (roles=auto) sliced to each rank's head.
    if not os.path.exists(SMOLLM):
        print("skip SmolLM2 --tp 3 sparse (no models/SmolLM2-135M-Instruct.Q4_1.gguf)")
        return
    with open(os.path.join(ROOT, "README.md")) as f:
        long_prompt = f.read(1500)
    for method in ("lessismore", "lycheedecode"):
        flags = ("--sparse", method, "--sparse-opt", "budget=64", "--ignore-eos")
        one = greedy(SMOLLM, long_prompt, 24, 1, *flags)
        three = greedy(SMOLLM, long_prompt, 24, 3, *flags)
        check(one.returncode == 0 and three.returncode == 0 and one.stdout == three.stdout
              and len(one.stdout) > 20,
              f"SmolLM2 --tp 3 --sparse {method} prints --tp 1's text: {three.stdout.strip()[-40:]!r} "
              f"({three.stderr.strip()[-200:]})")


def test_errors():
    cases = [((STORIES, "--tp", "0"), "--tp must be in [1, 64], got 0"),
             ((STORIES, "--tp", "2", "--tp-rank", "1"), "--tp-rank needs --dist-init"),
             ((STORIES, "--tp-rank", "1"), "--tp-rank needs --tp N with N > 1"),
             ((STORIES, "--tp", "2", "--sparse", "quest", "--recall"),
              "measures the attention mass over every head, and each rank holds only its own heads")]
    if os.path.exists(SMOLLM):
        cases.append(((SMOLLM, "--tp", "2"), "--tp 2: 3 KV heads are not divisible by 2"))
    for (model, *flags), want in cases:
        r = run("generate", "-m", model, "-p", "x", "-n", "2", *flags)
        check(r.returncode != 0 and want in r.stderr, f"{' '.join(flags)}: {r.stderr.strip()!r}")


def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30 * SCALE) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_serve():
    p = subprocess.Popen([SPADE, "serve", "-m", STORIES, "--port", "0", "--threads", "1", "--tp", "2",
                          "--quiet"], stderr=subprocess.PIPE, text=True)
    port = None
    t0 = time.monotonic()
    while port is None and time.monotonic() - t0 < 30 * SCALE:
        line = p.stderr.readline()
        if not line:
            break
        if "serving" in line:
            port = int(line.split("http://127.0.0.1:")[1].split()[0])
    check(port is not None, "serve --tp 2 starts")
    if port is None:
        p.kill()
        return
    status, body = post(port, {"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0})
    want = greedy(STORIES, "Once upon a time", 30, 1, "--ignore-eos").stdout.rstrip("\n")
    got = body["choices"][0]["text"] if status == 200 else body
    check(status == 200 and got == want, f"serve --tp 2 completes as generate --tp 1: {got!r}")
    status, body = post(port, {"prompt": "Once upon a time", "max_tokens": 30, "temperature": 0,
                               "sparse": "lessismore:budget=16"})
    want = greedy(STORIES, "Once upon a time", 30, 1, "--ignore-eos", "--sparse", "lessismore",
                  "--sparse-opt", "budget=16").stdout.rstrip("\n")
    got = body["choices"][0]["text"] if status == 200 else body
    check(status == 200 and got == want, f"a per-request lessismore under --tp 2 completes as generate --tp 1: {got!r}")
    status, body = post(port, {"prompt": "x", "max_tokens": 2,
                               "sparse": {"method": "quest", "recall": True}})
    check(status == 400 and "each rank holds only its own heads" in json.dumps(body),
          f"a per-request recall is refused: {body}")
    kids = children(p.pid)
    check(len(kids) == 1, f"one follower process ({kids})")
    for k in kids:
        os.kill(k, 9)
    rc, took = wait_exit(p, 10)
    err = p.stderr.read()
    check(rc is not None and rc != 0 and "tensor-parallel rank 1" in err and took < 5 * SCALE,
          f"a follower killed while serving stops rank 0 (status {rc}, {took:.1f} s): {err.strip()!r}")


def test_follower_killed_mid_run():
    if not os.path.exists(SMOLLM):
        print("skip the killed follower (no models/SmolLM2-135M-Instruct.Q4_1.gguf)")
        return
    p = subprocess.Popen([SPADE, "generate", "-m", SMOLLM, "-p", "Hello", "-n", "8000", "-c", "8192",
                          "--ignore-eos", "--threads", "1", "--tp", "3"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = p.stdout.read(8)  # generation runs
    kids = children(p.pid)
    check(len(first) > 0 and len(kids) == 2, f"--tp 3 generates with 2 followers ({kids})")
    if len(kids) != 2:
        p.kill()
        p.wait()
        return
    os.kill(kids[0], 9)
    rc, took = wait_exit(p, 10)
    err = p.stderr.read()
    check(rc is not None and rc != 0 and "rank 1" in err and took < 5 * SCALE,
          f"a follower killed mid-run fails rank 0 (status {rc}, {took:.1f} s): {err.strip()!r}")
    t0 = time.monotonic()
    while alive(kids[1]) and time.monotonic() - t0 < 5 * SCALE:
        time.sleep(0.05)
    check(not alive(kids[1]), "the other follower exits too")


def main():
    global SPADE
    ap = argparse.ArgumentParser()
    ap.add_argument("--spade", required=True)
    SPADE = ap.parse_args().spade
    test_generate_equal()
    test_sparse_methods_equal()
    test_errors()
    test_serve()
    test_follower_killed_mid_run()
    print("PASS" if failures == 0 else f"{failures} FAILED", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
