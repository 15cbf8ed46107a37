#!/usr/bin/env python3
"""CPU decode and prefill on a quantized GGUF, spade vs llama.cpp (issue 43), with 1 and 2
threads, after a short (~128-token) and a long (~6,800-token) prompt; peak RSS of each run.
Runs go in interleaved pairs (spade, llama.cpp, spade, ...) so a load on the machine hits both
alike; medians and the issue's bars go to a JSON in bench/results/.

    python3 bench/cpu_decode_quant.py --llama-bench ../peer/llama.cpp/build-cpu/bin/llama-bench \\
        [--spade build-cpu/spade] [--threads 1,2] [--pairs 3] [--long-pairs 2] [--lock F] [--out X.json]
        [--model M.gguf] [--spade-base OLD/spade] [--spade-args "--cpu-weights native"]

--spade-base: a spade binary built from an earlier commit, run natively in every pair after the
current one (its ratios to the current one go to the JSON: a before / after of a change);
--spade-args: more options for the native runs of both (f16 / bf16 GGUFs load as fp32 unless
given --cpu-weights native). The model's tensor types (spade inspect) go to the JSON.

spade: `spade generate --prompt-file P --ignore-eos -n N --threads T --stats`, natively (the
default for a quantized GGUF) and, on the short prompt, with --cpu-weights f32 (the reference);
P is the first words of tests/fixtures/sparse/genesis_1_3.txt, repeated for the long prompt.
Its --stats line gives prefill and decode tok/s and the threads the process had.
llama.cpp: `llama-bench -p 0 -n N -d DEPTH -t T -r 1 --progress`: decode of N tokens after a
DEPTH-token context; its prefill of that context is not timed by llama-bench, so it is timed
here from the progress lines around it ("depth run" ... "generation run").
Peak RSS from /usr/bin/time -f %M. llama-bench keeps a copy of the context's KV state for
reuse across repetitions (llama_state_seq_get_data), which its peak RSS includes; the JSON
gives an estimate of that copy (f16 K and V of every layer for DEPTH tokens) beside it.
"""
import argparse, datetime, hashlib, json, os, platform, re, statistics, subprocess, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BARS = {"decode_short": 1.0, "decode_long": 1.5, "prefill": 1.5, "rss": 1.5}


LOCK = []  # ["flock", PATH, ...] with --lock (repeatable): each run holds the locks builds take


def run_timed(cmd):
    """Runs cmd under /usr/bin/time; returns (stdout, [(t, stderr line)], peak RSS MiB)."""
    p = subprocess.Popen(LOCK + ["/usr/bin/time", "-f", "maxrss_kb=%M"] + cmd, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    lines = []
    for line in p.stderr:
        lines.append((time.monotonic(), line))
    out = p.stdout.read()
    if p.wait() != 0:
        raise RuntimeError("%s failed:\n%s" % (" ".join(cmd), "".join(l for _, l in lines)[-3000:]))
    rss = next(int(m.group(1)) for _, l in lines for m in [re.search(r"maxrss_kb=(\d+)", l)] if m)
    return out, lines, rss / 1024.0


def run_spade(a, prompt_file, n, threads, extra, binary=None):
    _, lines, rss = run_timed([binary or a.spade, "generate", "--model", a.model, "--prompt-file", prompt_file,
                               "--ignore-eos", "-n", str(n), "--threads", str(threads), "--stats"] + extra)
    err = "".join(l for _, l in lines)
    m = re.search(r"prompt (\d+) tokens, ([\d.]+) tok/s prefill \| generated (\d+) tokens, ([\d.]+) tok/s "
                  r"decode .*\| threads (\d+) \(process (-?\d+)\)", err)
    if not m:
        raise RuntimeError("no --stats line:\n" + err[-2000:])
    return {"prompt_tokens": int(m.group(1)), "prefill_tok_s": float(m.group(2)),
            "decode_tok_s": float(m.group(4)), "process_threads": int(m.group(6)),
            "peak_rss_mib": round(rss, 1)}


def run_llama(a, depth, n, threads):
    out, lines, rss = run_timed([a.llama_bench, "-m", a.model, "-p", "0", "-n", str(n), "-d", str(depth),
                                 "-t", str(threads), "-r", "1", "--progress", "-o", "json"])
    # "benchmark 1/1: depth run 1/1", then (after the prefill) "benchmark 1/1: generation run 1/1"
    # ("warmup generation run" comes before both).
    t_depth = next(t for t, l in lines if re.search(r"benchmark \d+/\d+: depth run", l))
    t_gen = next(t for t, l in lines if re.search(r"benchmark \d+/\d+: generation run", l) and t >= t_depth)
    return {"prompt_tokens": depth, "prefill_tok_s": round(depth / (t_gen - t_depth), 2),
            "decode_tok_s": json.loads(out)[0]["avg_ts"], "peak_rss_mib": round(rss, 1)}


def med(runs, key):
    return statistics.median(r[key] for r in runs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spade", default=os.path.join(ROOT, "build-cpu/spade"))
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--model", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--pairs", type=int, default=3, help="pairs per thread count, short prompt")
    ap.add_argument("--long-pairs", type=int, default=2, help="pairs per thread count, long prompt")
    ap.add_argument("--n", type=int, default=128, help="tokens decoded after the short prompt")
    ap.add_argument("--long-n", type=int, default=32, help="tokens decoded after the long prompt")
    ap.add_argument("--short-words", type=int, default=95)   # 111 tokens with SmolLM2's tokenizer
    ap.add_argument("--long-words", type=int, default=5790)  # 6,801 tokens
    ap.add_argument("--spade-cuda", help="a CUDA-enabled spade binary: one short run for its RSS")
    ap.add_argument("--llama-src", default=os.path.join(ROOT, ".stage/llamacpp-src.tar.gz"))
    ap.add_argument("--lock", action="append", default=[],
                    help="a lock file each run holds (flock; repeatable), e.g. the ones builds on this "
                         "machine take, so no build of those runs beside a timed run")
    ap.add_argument("--spade-base", help="a spade binary of an earlier commit, run natively in every pair")
    ap.add_argument("--spade-args", default="", help="more options for the native spade runs (both binaries)")
    ap.add_argument("--what", help="the JSON's 'what' (default: the issue 43 comparison)")
    ap.add_argument("--out")
    a = ap.parse_args()
    native_args = a.spade_args.split()
    for lk in a.lock:
        LOCK.extend(["flock", lk])
    words = open(os.path.join(ROOT, "tests/fixtures/sparse/genesis_1_3.txt")).read().split()
    prompts = {}
    for name, count in (("short", a.short_words), ("long", a.long_words)):
        w = []
        while len(w) < count:
            w += words
        f = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False)
        f.write(" ".join(w[:count]))
        f.close()
        prompts[name] = f.name
    threads = [int(t) for t in a.threads.split(",")]
    cases = {}
    try:
        for t in threads:
            for length, n, pairs in (("short", a.n, a.pairs), ("long", a.long_n, a.long_pairs)):
                if pairs <= 0:
                    continue
                runs = {"spade_native": [], "llama_cpp": []}
                if a.spade_base:
                    runs["spade_base_native"] = []
                if length == "short":
                    runs["spade_f32"] = []
                depth = None
                for _ in range(pairs):
                    r = run_spade(a, prompts[length], n, t, native_args)
                    runs["spade_native"].append(r)
                    depth = r["prompt_tokens"]
                    print("t=%d %s spade_native" % (t, length), r, flush=True)
                    if a.spade_base:
                        r = run_spade(a, prompts[length], n, t, native_args, a.spade_base)
                        runs["spade_base_native"].append(r)
                        print("t=%d %s spade_base_native" % (t, length), r, flush=True)
                    r = run_llama(a, depth, n, t)
                    runs["llama_cpp"].append(r)
                    print("t=%d %s llama_cpp" % (t, length), r, flush=True)
                    if length == "short":
                        r = run_spade(a, prompts[length], n, t, ["--cpu-weights", "f32"])
                        runs["spade_f32"].append(r)
                        print("t=%d %s spade_f32" % (t, length), r, flush=True)
                m = {k: {key: med(v, key) for key in ("prefill_tok_s", "decode_tok_s", "peak_rss_mib")}
                     for k, v in runs.items()}
                # llama-bench's copy of the context's state: f16 K and V, every layer, `depth` tokens
                # (SmolLM2-135M: 30 layers, 3 KV heads x 64).
                state_mib = depth * 30 * 2 * 192 * 2 / 2**20
                sn, lc = m["spade_native"], m["llama_cpp"]
                ratios = {"decode": round(sn["decode_tok_s"] / lc["decode_tok_s"], 3),
                          "prefill": round(sn["prefill_tok_s"] / lc["prefill_tok_s"], 3),
                          "rss": round(sn["peak_rss_mib"] / lc["peak_rss_mib"], 3),
                          "rss_vs_llama_less_state_copy": round(
                              sn["peak_rss_mib"] / (lc["peak_rss_mib"] - state_mib), 3)}
                if a.spade_base:
                    sb = m["spade_base_native"]
                    ratios["decode_over_base"] = round(sn["decode_tok_s"] / sb["decode_tok_s"], 3)
                    ratios["prefill_over_base"] = round(sn["prefill_tok_s"] / sb["prefill_tok_s"], 3)
                bar_decode = BARS["decode_short" if length == "short" else "decode_long"]
                cases["%s_t%d" % (length, t)] = {
                    "threads": t, "context_tokens": depth, "decoded_tokens": n, "pairs": pairs,
                    "median": m, "spade_native_over_llama_cpp": ratios,
                    "llama_bench_state_copy_mib_estimate": round(state_mib, 1),
                    "bars": {"decode": {"bar": bar_decode, "met": ratios["decode"] >= bar_decode},
                             "prefill": {"bar": BARS["prefill"], "met": ratios["prefill"] >= BARS["prefill"]},
                             "rss": {"bar": BARS["rss"], "met": ratios["rss"] <= BARS["rss"]},
                             "one_thread_per_thread": all(r["process_threads"] == t for r in runs["spade_native"])},
                    "runs": runs}
        cuda_rss = None
        if a.spade_cuda:
            b = argparse.Namespace(**vars(a))
            b.spade = a.spade_cuda
            try:
                cuda_rss = run_spade(b, prompts["short"], a.n, 1, [])
                print("cuda-enabled binary, short, 1 thread", cuda_rss, flush=True)
            except (RuntimeError, OSError) as e:
                print("cuda-enabled binary did not run:", e, flush=True)
    finally:
        for f in prompts.values():
            os.unlink(f)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    spade_commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True).stdout.strip()
    src_sha = hashlib.sha256(open(a.llama_src, "rb").read()).hexdigest() if os.path.exists(a.llama_src) else None
    inspect = subprocess.run([a.spade, "inspect", a.model], capture_output=True, text=True).stdout
    types = next((l.split(":", 1)[1].strip() for l in inspect.splitlines() if l.startswith("tensor types:")), None)
    res = {
        "what": a.what or "CPU decode and prefill tok/s and peak RSS, spade vs llama.cpp, 1 and 2 threads, "
                          "short and ~6,800-token contexts (issue 43)",
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "os": platform.platform()},
        "model": os.path.relpath(a.model, ROOT),
        "model_tensor_types": types,
        "spade_commit": spade_commit,
        "spade_binary": os.path.relpath(a.spade, ROOT) + " (SPADE_CUDA=OFF build)",
        "spade_native_args": a.spade_args,
        "spade_base_binary": a.spade_base,
        "llama_cpp": {"source": "llama-cpp-python 0.3.36 sdist (../shared/tools/llamacpp_src.sh); "
                                "its build reports commit 'unknown' (no git in the sdist); PEERS.md: 0c1e57098",
                      "tarball_sha256": src_sha,
                      "build": "cmake -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON, target llama-bench"},
        "commands": {
            "spade": "spade generate --model M --prompt-file P --ignore-eos -n N --threads T --stats "
                     "[--cpu-weights f32] (KV cache bf16: the default --kv-dtype)",
            "llama_cpp": "llama-bench -m M -p 0 -n N -d DEPTH -t T -r 1 --progress -o json "
                         "(DEPTH = spade's prompt tokens; prefill timed between its 'depth run' and "
                         "'generation run' progress lines)",
            "rss": "/usr/bin/time -f %M",
            "reproduce": "python3 bench/cpu_decode_quant.py --llama-bench PATH --model %s --threads %s "
                         "--pairs %d --long-pairs %d --n %d%s%s%s" % (
                             os.path.relpath(a.model, ROOT), a.threads, a.pairs, a.long_pairs, a.n,
                             " --spade-base BASE/spade" if a.spade_base else "",
                             " --spade-args '%s'" % a.spade_args if a.spade_args else "",
                             "".join(" --lock " + lk for lk in a.lock))},
        "bars": BARS,
        "cases": cases,
    }
    if cuda_rss:
        res["cuda_enabled_binary_short_t1"] = dict(cuda_rss, binary=os.path.relpath(a.spade_cuda, ROOT))
    out = a.out or os.path.join(ROOT, "bench/results/cpu_decode_quant_%s.json" % res["date"].replace("-", ""))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    for k, c in cases.items():
        print(k, json.dumps(c["spade_native_over_llama_cpp"]), json.dumps(c["bars"]))
    print("wrote", out)


if __name__ == "__main__":
    main()
