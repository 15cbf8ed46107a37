#!/usr/bin/env python3
"""Throughput of `spade serve` under concurrent load (Python stdlib only).

Starts the server, runs N concurrent streaming clients over a fixed, seeded mix of prompt
lengths and output lengths (ignore_eos, so every request generates exactly max_tokens),
and records requests/s, tokens/s and TTFT / TPOT / end-to-end latency percentiles, plus
the server's own /metrics (batch sizes, preemptions), to
bench/results/server_load_<device>_<date>.json.

  python3 bench/bench_server_load.py --spade build/spade \
      [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--clients 16] [--requests 200]

TTFT: request sent -> first content chunk. TPOT: (last chunk - first chunk) / (tokens - 1)
per request. Client-side numbers include HTTP and JSON overhead.
"""
import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
from spade_client import Server, Stream, wait_idle  # noqa: E402


def percentile(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def pcts(xs):
    return {"p50": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99),
            "mean": sum(xs) / len(xs) if xs else None, "n": len(xs)}


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit():
    if os.environ.get("COMMIT"):  # the device scripts' convention (no .git on the device)
        return os.environ["COMMIT"]
    try:
        c = subprocess.check_output(["git", "-C", ROOT, "rev-parse", "HEAD"], text=True).strip()
        dirty = subprocess.call(["git", "-C", ROOT, "diff", "--quiet", "HEAD"]) != 0
        return c + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spade", default=os.path.join(ROOT, "build/spade"))
    ap.add_argument("--model", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--prompt-words", default="8,32,128,384", help="prompt lengths (words), mixed")
    ap.add_argument("--max-tokens", default="16,32,64,128", help="output lengths, mixed")
    ap.add_argument("--server-args", default="--max-batch 16 --max-queue 64",
                    help="extra `spade serve` options")
    ap.add_argument("--sparse", default=None, help='JSON "sparse" field for every request')
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="", help="free text stored with the results (conditions)")
    args = ap.parse_args()

    words = []
    for name in ("kjv_genesis1.txt", "story_lighthouse.txt", "technical_kv_cache.txt"):
        p = os.path.join(ROOT, "python", "prompts", name)
        if os.path.exists(p):
            with open(p, encoding="utf-8") as f:
                words += f.read().split()
    if not words:
        words = ("Once upon a time there was a little girl named Lily who loved to play "
                 "outside in the park").split()
    rng = random.Random(args.seed)
    plens = [int(x) for x in args.prompt_words.split(",")]
    olens = [int(x) for x in args.max_tokens.split(",")]
    jobs = []
    for i in range(args.requests):
        n = rng.choice(plens)
        start = rng.randrange(0, max(1, len(words) - n))
        jobs.append({"prompt": " ".join((words * (1 + n // max(1, len(words))))[start:start + n]),
                     "max_tokens": rng.choice(olens)})

    server_args = args.server_args.split()
    srv = Server(args.spade, args.model, server_args, tokenizer=args.tokenizer)
    results, errors, statuses = [], [], {}
    lock = threading.Lock()
    todo = list(range(len(jobs)))

    def one(job):
        body = {"prompt": job["prompt"], "max_tokens": job["max_tokens"], "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if args.sparse:
            body["sparse"] = json.loads(args.sparse)
        while True:
            t0 = time.time()
            st = Stream(srv, "/v1/completions", body, timeout=600)
            if st.status == 429:
                st.close()
                with lock:
                    statuses[429] = statuses.get(429, 0) + 1
                time.sleep(0.05)
                continue
            break
        first = last = None
        usage = None
        for ev in st.events():
            now = time.time()
            if ev == "[DONE]":
                break
            if "error" in ev:
                raise RuntimeError(ev["error"]["message"])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices", []):
                if ch.get("text"):
                    first = first or now
                    last = now
        st.close()
        t1 = time.time()
        n = usage["completion_tokens"] if usage else 0
        return {"ttft": (first or t1) - t0, "e2e": t1 - t0,
                "tpot": (last - first) / (n - 1) if first and n > 1 else None,
                "prompt_tokens": usage["prompt_tokens"] if usage else 0, "completion_tokens": n,
                "status": st.status}

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            try:
                r = one(jobs[i])
                with lock:
                    results.append(r)
                    statuses[r["status"]] = statuses.get(r["status"], 0) + 1
            except Exception as e:  # noqa: BLE001
                with lock:
                    errors.append(str(e))

    # Warm-up: one request alone (first-touch of workspaces).
    one({"prompt": "warm up", "max_tokens": 4})
    m0 = srv.metrics()
    load0 = os.getloadavg()
    t0 = time.time()
    ts = [threading.Thread(target=worker) for _ in range(args.clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.time() - t0
    load1 = os.getloadavg()
    m1 = wait_idle(srv)
    srv.stop()

    gen = sum(r["completion_tokens"] for r in results)
    prompt = sum(r["prompt_tokens"] for r in results)
    steps = m1["spade_engine_steps_total"] - m0["spade_engine_steps_total"]
    bsum = m1["spade_batch_size_sum"] - m0["spade_batch_size_sum"]
    bcount = m1["spade_batch_size_count"] - m0["spade_batch_size_count"]
    date = datetime.datetime.now(datetime.timezone.utc)
    out = {
        "benchmark": "server_load",
        "device": "%s (%d cores)" % (cpu_name(), os.cpu_count() or 0) if args.device == "cpu" else args.device,
        "date": date.isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "server_command": " ".join(os.path.relpath(c, ROOT) if os.path.exists(c) else c for c in srv.cmd),
        "model": os.path.relpath(args.model, ROOT),
        "clients": args.clients,
        "requests": args.requests,
        "completed": len(results),
        "errors": len(errors),
        "first_errors": errors[:5],
        "http_statuses": {str(k): v for k, v in statuses.items()},
        "wall_seconds": wall,
        "requests_per_second": len(results) / wall,
        "generated_tokens_per_second": gen / wall,
        "prompt_tokens_per_second": prompt / wall,
        "generated_tokens": gen,
        "prompt_tokens": prompt,
        "ttft_seconds": pcts([r["ttft"] for r in results]),
        "tpot_seconds": pcts([r["tpot"] for r in results if r["tpot"] is not None]),
        "e2e_seconds": pcts([r["e2e"] for r in results]),
        "server": {
            "engine_steps": steps,
            "mean_batch_size": bsum / bcount if bcount else None,
            "preemptions": m1["spade_preemptions_total"] - m0["spade_preemptions_total"],
            "kv_pages_used_after": m1["spade_kv_pages_used"],
            "kv_pages_total": m1["spade_kv_pages_total"],
        },
        "host_load_average": {"before": load0, "after": load1},
        "note": args.note,
        "mix": {"prompt_words": plens, "max_tokens": olens, "seed": args.seed, "sparse": args.sparse},
    }
    path = args.out or os.path.join(ROOT, "bench", "results", "server_load_%s_%s.json" % (
        args.device.split()[0].lower(), date.strftime("%Y%m%d")))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    print("%d/%d requests in %.1f s: %.2f req/s, %.1f generated tok/s, %.1f prompt tok/s" % (
        len(results), args.requests, wall, out["requests_per_second"],
        out["generated_tokens_per_second"], out["prompt_tokens_per_second"]))
    for k in ("ttft_seconds", "tpot_seconds", "e2e_seconds"):
        v = out[k]
        if v["n"]:
            print("  %-13s p50 %.3f  p90 %.3f  p99 %.3f" % (k, v["p50"], v["p90"], v["p99"]))
    print("  mean batch %.2f, preemptions %d, errors %d -> %s" % (
        out["server"]["mean_batch_size"] or 0, out["server"]["preemptions"], len(errors),
        os.path.relpath(path, ROOT)))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
