#!/usr/bin/env python3
"""Serving benchmark for any OpenAI-compatible server (spade serve, llama-server, ...), in the
manner of `vllm bench serve`. Python stdlib only.

  python3 bench/bench_serve.py --url http://127.0.0.1:8080 --num-prompts 512 \
      --concurrency 64 --prompt-words 200 --max-tokens 256 [--request-rate 32] \
      [--methods "full;quest:budget=64;tidal"] [--no-stream] --out result.json

Requests go to /v1/completions with a text prompt of --prompt-words words (the same seeded
text for every server, so the same tokenizer gives the same lengths), max_tokens and
ignore_eos (every request generates exactly max_tokens), temperature 0 unless given.
Arrivals: all at once (default) or Poisson at --request-rate requests/s; at most
--concurrency in flight. --methods spreads requests evenly over spade's per-request
"sparse" methods (round-robin; omitted for other servers).

Clients run in --procs processes (threads inside each), so the client is not the bottleneck
at tens of thousands of tokens/s. Reported (JSON): request and output-token throughput over
the whole run, TTFT (request sent -> first token), TPOT ((last - first token) / (tokens - 1)
per request), ITL (gaps between streamed chunks) and end-to-end latency: mean, p50, p90, p99.
"""
import argparse
import datetime
import http.client
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import threading
import time
import urllib.parse

WORDS = ("the of and to in a is that for it as was with be by on not he I this are or his from at "
         "which but have an they you were her she there one all we can their has been if more when "
         "will would who so no time story river light garden morning winter city music house").split()


def default_commit():
    """The commit every results file records: $COMMIT (the device scripts' convention), else
    `git rev-parse --short HEAD` of this checkout (+ "-dirty" with local changes), else "unknown"."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        c = subprocess.check_output(["git", "-C", root, "rev-parse", "--short", "HEAD"], text=True,
                                    stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.call(["git", "-C", root, "diff", "--quiet", "HEAD"],
                                stderr=subprocess.DEVNULL) != 0
        return c + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def prompt_text(i, words, seed):
    rng = random.Random(seed * 1000003 + i)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def percentiles(xs):
    if not xs:
        return None
    xs = sorted(xs)

    def p(q):
        k = (len(xs) - 1) * q / 100.0
        lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
    return {"mean": sum(xs) / len(xs), "p50": p(50), "p90": p(90), "p99": p(99), "n": len(xs)}


def one_request(host, port, job, args):
    """-> dict with status, timings (seconds since t0 of the run, perf_counter based)."""
    body = {"prompt": job["prompt"], "max_tokens": args.max_tokens, "temperature": args.temperature,
            "ignore_eos": True, "stream": args.stream}
    if args.stream:
        body["stream_options"] = {"include_usage": True}
    if job.get("sparse"):
        body["sparse"] = job["sparse"]
    if args.model_name:
        body["model"] = args.model_name
    r = {"method": job.get("sparse") or "default", "status": None, "error": None}
    t_send = time.perf_counter()
    r["sent"] = t_send
    try:
        c = http.client.HTTPConnection(host, port, timeout=args.timeout)
        c.request("POST", "/v1/completions", body=json.dumps(body),
                  headers={"Content-Type": "application/json"})
        resp = c.getresponse()
        r["status"] = resp.status
        if resp.status != 200:
            r["error"] = resp.read()[:300].decode("utf-8", "replace")
            c.close()
            return r
        chunks = []
        usage = None
        if args.stream:
            buf = b""
            done = False
            while not done:
                d = resp.read1(65536) if hasattr(resp, "read1") else resp.read(1)
                if not d:
                    break
                now = time.perf_counter()
                buf += d
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    for line in ev.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            done = True
                            break
                        j = json.loads(data)
                        if j.get("usage"):
                            usage = j["usage"]
                        ch = j.get("choices") or []
                        if ch and (ch[0].get("text") or ch[0].get("finish_reason") is None):
                            chunks.append(now)
        else:
            j = json.loads(resp.read())
            chunks.append(time.perf_counter())
            usage = j.get("usage")
        c.close()
        r["end"] = time.perf_counter()
        r["first"] = chunks[0] if chunks else r["end"]
        r["chunks"] = chunks
        r["tokens"] = (usage or {}).get("completion_tokens") or len(chunks)
        r["prompt_tokens"] = (usage or {}).get("prompt_tokens")
    except Exception as e:  # noqa: BLE001
        r["error"] = repr(e)[:300]
    return r


def worker(wid, jobs, args, start_at, q):
    """Runs this process's share of the jobs at their scheduled times, at most `slots` at once."""
    u = urllib.parse.urlparse(args.url)
    host, port = u.hostname, u.port or 80
    slots = threading.Semaphore(max(1, args.concurrency // args.procs + (1 if wid < args.concurrency % args.procs else 0)))
    out = []
    lock = threading.Lock()
    threads = []

    def run(job):
        try:
            res = one_request(host, port, job, args)
            with lock:
                out.append(res)
        finally:
            slots.release()

    while time.time() < start_at:
        time.sleep(0.001)
    t0 = time.perf_counter()
    for job in jobs:
        delay = job["at"] - (time.perf_counter() - t0)
        if delay > 0:
            time.sleep(delay)
        slots.acquire()
        t = threading.Thread(target=run, args=(job,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    # Times relative to this worker's t0 (all workers start at the same wall instant).
    for r in out:
        for k in ("sent", "first", "end"):
            if k in r:
                r[k] -= t0
        if "chunks" in r:
            r["chunks"] = [x - t0 for x in r["chunks"]]
    q.put(out)


def run_pool(jobs, args):
    """Runs `jobs` over args.procs client processes; returns every request's record."""
    shares = [jobs[w::args.procs] for w in range(args.procs)]
    q = mp.Queue()
    start_at = time.time() + 0.5
    procs = [mp.Process(target=worker, args=(w, shares[w], args, start_at, q)) for w in range(args.procs)]
    for p in procs:
        p.start()
    results = []
    for _ in procs:
        results.extend(q.get())
    for p in procs:
        p.join()
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per s (inf: all at once)")
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--methods", default="", help="spade sparse method specs spread round-robin: "
                    "\"full;quest:budget=64;twilight:base=quest,budget=128\" (or a comma list of names without options)")
    ap.add_argument("--no-stream", dest="stream", action="store_false")
    ap.add_argument("--procs", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--model-name", default="")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=0,
                    help="requests run first at the same concurrency, not measured (other prompts)")
    ap.add_argument("--label", default="", help="what is being measured (server, build, GPU)")
    ap.add_argument("--commit", default=None, help="commit to record (default: $COMMIT, else git HEAD)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    args.procs = max(1, min(args.procs, args.concurrency, args.num_prompts))

    rng = random.Random(args.seed)
    # ";"-separated specs (options may hold commas: "twilight:base=quest,budget=128"); a list
    # without ";" may use commas between plain method names.
    # One spec with options ("twilight:base=quest,budget=128") is one method, commas included.
    plain_list = ";" not in args.methods and ":" not in args.methods
    methods = [m for m in (args.methods.split(",") if plain_list else args.methods.split(";")) if m]
    t = 0.0
    jobs = []
    for i in range(args.num_prompts):
        if args.request_rate != float("inf"):
            t += rng.expovariate(args.request_rate)
        jobs.append({"i": i, "at": t, "prompt": prompt_text(i, args.prompt_words, args.seed),
                     "sparse": methods[i % len(methods)] if methods else None})
    if args.warmup > 0:
        # Unmeasured: the same load shape with other prompts (the server's first batches of
        # each size, its graph captures and allocations), then the measured run.
        warm = [{"i": i, "at": 0.0, "prompt": prompt_text(i, args.prompt_words, args.seed + 7919),
                 "sparse": methods[i % len(methods)] if methods else None} for i in range(args.warmup)]
        bad = [r for r in run_pool(warm, args) if r.get("status") != 200 or r.get("error")]
        if bad:
            print("warm-up: %d of %d requests failed (%s)" % (len(bad), len(warm), bad[0].get("error") or bad[0].get("status")),
                  file=sys.stderr)
    results = run_pool(jobs, args)

    ok = [r for r in results if r.get("status") == 200 and not r.get("error")]
    failed = [r for r in results if r not in ok]
    if ok:
        t_begin = min(r["sent"] for r in ok)
        t_end = max(r["end"] for r in ok)
    else:
        t_begin, t_end = 0.0, 1e-9
    dur = max(t_end - t_begin, 1e-9)
    out_tokens = sum(r["tokens"] for r in ok)
    ttft = [1000 * (r["first"] - r["sent"]) for r in ok] if args.stream else []  # no-stream: only e2e
    tpot = [1000 * (r["end"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1 and args.stream]
    itl = [1000 * (b - a) for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])] if args.stream else []
    e2e = [1000 * (r["end"] - r["sent"]) for r in ok]
    by_method = {}
    for r in ok:
        m = by_method.setdefault(r["method"], {"requests": 0, "tokens": 0})
        m["requests"] += 1
        m["tokens"] += r["tokens"]
    res = {
        "label": args.label,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": args.commit or default_commit(),
        "config": {k: (v if v != float("inf") else "inf") for k, v in vars(args).items() if k not in ("out", "commit")},
        "completed": len(ok), "failed": len(failed),
        "errors": sorted({(r.get("status"), (r.get("error") or "")[:120]) for r in failed})[:5],
        "duration_s": dur,
        "request_throughput": len(ok) / dur,
        "output_token_throughput": out_tokens / dur,
        "total_output_tokens": out_tokens,
        "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot), "itl_ms": percentiles(itl),
        "e2e_ms": percentiles(e2e), "by_method": by_method,
    }
    line = ("%-28s %5d ok %3d failed  %8.1f tok/s  %6.2f req/s  TTFT p50 %7.1f ms p99 %7.1f  TPOT p50 %6.2f ms p99 %6.2f"
            % (args.label[:28], len(ok), len(failed), res["output_token_throughput"], res["request_throughput"],
               (res["ttft_ms"] or {}).get("p50", 0), (res["ttft_ms"] or {}).get("p99", 0),
               (res["tpot_ms"] or {}).get("p50", 0), (res["tpot_ms"] or {}).get("p99", 0)))
    print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
