#!/usr/bin/env python3
"""CPU decode on a quantized GGUF, spade vs llama.cpp (issue 43): decode tok/s after a
~128-token prompt with 1 thread, and peak RSS, in interleaved pairs (spade, llama.cpp, spade,
...) so a load on the machine hits both alike; medians go to a JSON in bench/results/.

    python3 bench/cpu_decode_quant.py --llama-bench ../peer/llama.cpp/build-cpu/bin/llama-bench \
        [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] [--pairs 5] [--out bench/results/X.json]

spade: `spade generate --prompt-file P --ignore-eos -n 128 --threads 1 --stats` (P is the
first ~128 tokens of tests/fixtures/sparse/genesis_1_3.txt), once natively (the default) and
once with --cpu-weights f32 per pair; llama.cpp: `llama-bench -p 0 -n 128 -d 128 -t 1 -r 1`
(decode of 128 tokens after a 128-token context). Peak RSS from /usr/bin/time -f %M.
"""
import argparse, datetime, hashlib, json, os, platform, re, statistics, subprocess, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(cmd):
    r = subprocess.run(["/usr/bin/time", "-f", "maxrss_kb=%M"] + cmd, capture_output=True,
                       text=True, check=True)
    rss = int(re.search(r"maxrss_kb=(\d+)", r.stderr).group(1))
    return r, rss / 1024.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spade", default=os.path.join(ROOT, "build/spade"))
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("--model", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--llama-src", default=os.path.join(ROOT, ".stage/llamacpp-src.tar.gz"))
    ap.add_argument("--out")
    a = ap.parse_args()
    text = open(os.path.join(ROOT, "tests/fixtures/sparse/genesis_1_3.txt")).read()
    prompt = " ".join(text.split()[:95])  # ~128 tokens with SmolLM2's tokenizer
    pf = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False)
    pf.write(prompt)
    pf.close()
    runs = {"spade_native": [], "spade_f32": [], "llama_cpp": []}
    prompt_tokens = None
    for _ in range(a.pairs):
        for key, extra in (("spade_native", []), ("llama_cpp", None), ("spade_f32", ["--cpu-weights", "f32"])):
            if extra is None:
                cmd = [a.llama_bench, "-m", a.model, "-p", "0", "-n", str(a.n), "-d", "128", "-t", "1",
                       "-r", "1", "-o", "json"]
                r, rss = timed(cmd)
                tps = json.loads(r.stdout)[0]["avg_ts"]
            else:
                cmd = [a.spade, "generate", "--model", a.model, "--prompt-file", pf.name, "--ignore-eos",
                       "-n", str(a.n), "--threads", "1", "--stats"] + extra
                r, rss = timed(cmd)
                m = re.search(r"prompt (\d+) tokens.*generated (\d+) tokens, ([\d.]+) tok/s decode", r.stderr)
                prompt_tokens = int(m.group(1))
                tps = float(m.group(3))
            runs[key].append({"decode_tok_s": tps, "peak_rss_mib": round(rss, 1)})
            print(key, runs[key][-1], flush=True)
    os.unlink(pf.name)
    med = {k: {"decode_tok_s": statistics.median(x["decode_tok_s"] for x in v),
               "peak_rss_mib": statistics.median(x["peak_rss_mib"] for x in v)} for k, v in runs.items()}
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    spade_commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True).stdout.strip()
    src_sha = hashlib.sha256(open(a.llama_src, "rb").read()).hexdigest() if os.path.exists(a.llama_src) else None
    res = {
        "what": "CPU decode tok/s after a 128-token prompt, 1 thread, and peak RSS (issue 43)",
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": cpu, "cores": os.cpu_count(), "os": platform.platform()},
        "model": os.path.relpath(a.model, ROOT),
        "spade_commit": spade_commit,
        "llama_cpp": {"source": "llama-cpp-python 0.3.36 sdist (../shared/tools/llamacpp_src.sh); "
                                "its build reports commit 'unknown' (no git in the sdist); PEERS.md: 0c1e57098",
                      "tarball_sha256": src_sha,
                      "build": "cmake -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON, target llama-bench"},
        "commands": {
            "spade": "spade generate --model M --prompt-file P --ignore-eos -n %d --threads 1 --stats "
                     "[--cpu-weights f32]; P: %d tokens" % (a.n, prompt_tokens),
            "llama_cpp": "llama-bench -m M -p 0 -n %d -d 128 -t 1 -r 1 -o json" % a.n,
            "rss": "/usr/bin/time -f %M",
            "reproduce": "python3 bench/cpu_decode_quant.py --llama-bench PATH --pairs %d" % a.pairs},
        "pairs": a.pairs,
        "median": med,
        "spade_native_over_llama_cpp": round(med["spade_native"]["decode_tok_s"] / med["llama_cpp"]["decode_tok_s"], 3),
        "rss_spade_native_over_llama_cpp": round(med["spade_native"]["peak_rss_mib"] / med["llama_cpp"]["peak_rss_mib"], 3),
        "runs": runs,
    }
    out = a.out or os.path.join(ROOT, "bench/results/cpu_decode_quant_%s.json" % res["date"].replace("-", ""))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    print(json.dumps(med, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
