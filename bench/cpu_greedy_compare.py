#!/usr/bin/env python3
"""Greedy tokens of spade's CPU path (quantized weights as stored, the default) against
llama.cpp's on the same GGUF and prompt token ids (issue 43): both decode N tokens greedily;
the first step where they differ is reported with each engine's top-2 logit gap there (a
near-tie when small). spade runs with each --kv-dtype asked for; llama.cpp with its defaults
(f16 KV cache). The result goes into a results JSON under "greedy_vs_llama_cpp".

    python3 bench/cpu_greedy_compare.py --llama-dir ../peer/llama.cpp [--kv bf16,f16,f32] \\
        [--threads 2] --json bench/results/cpu_decode_quant_DATE.json

Builds bench/spade_greedy.cpp (against build-cpu/libspade_lib.a) and bench/llama_greedy.cpp
(against LLAMA_DIR/build-cpu's static libraries) into a temporary folder. The prompts are the
ones bench/cpu_decode_quant.py times: the first 95 / 5,790 words of
tests/fixtures/sparse/genesis_1_3.txt (110 / 6,801 tokens).
"""
import argparse, json, os, subprocess, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(tmp, llama_dir):
    sg, lg = os.path.join(tmp, "spade_greedy"), os.path.join(tmp, "llama_greedy")
    subprocess.run(["g++", "-O2", "-std=c++20", "-I" + os.path.join(ROOT, "src"),
                    os.path.join(ROOT, "bench/spade_greedy.cpp"), os.path.join(ROOT, "build-cpu/libspade_lib.a"),
                    "-lopenblas", "-lpcre2-8", "-lpthread", "-o", sg], check=True)
    b = os.path.join(llama_dir, "build-cpu")
    subprocess.run(["g++", "-O2", "-std=c++17", "-I" + os.path.join(llama_dir, "include"),
                    "-I" + os.path.join(llama_dir, "ggml/include"), os.path.join(ROOT, "bench/llama_greedy.cpp"),
                    os.path.join(b, "src/libllama.a"), os.path.join(b, "ggml/src/libggml.a"),
                    os.path.join(b, "ggml/src/libggml-cpu.a"), os.path.join(b, "ggml/src/libggml-base.a"),
                    "-lgomp", "-lpthread", "-ldl", "-o", lg], check=True)
    return sg, lg


def parse(out):
    rows = []
    for line in out.splitlines():
        s, t, l1, t2, l2 = line.split()
        rows.append({"token": int(t), "top1": float(l1), "second": int(t2), "second_logit": float(l2)})
    return rows


def compare(sp, lc):
    n = min(len(sp), len(lc))
    first = next((i for i in range(n) if sp[i]["token"] != lc[i]["token"]), None)
    res = {"steps": n, "equal_prefix": n if first is None else first, "all_equal": first is None}
    if first is not None:
        a, b = sp[first], lc[first]
        res["first_divergence"] = {
            "step": first, "spade_token": a["token"], "llama_cpp_token": b["token"],
            "spade_top2_gap": round(a["top1"] - a["second_logit"], 4),
            "spade_second_token": a["second"],
            "llama_cpp_top2_gap": round(b["top1"] - b["second_logit"], 4),
            "llama_cpp_second_token": b["second"],
            "near_tie": a["second"] == b["token"] and b["second"] == a["token"],
        }
    res["spade_tokens"] = [r["token"] for r in sp]
    res["llama_cpp_tokens"] = [r["token"] for r in lc]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-dir", required=True)
    ap.add_argument("--model", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--kv", default="bf16,f16,f32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--short-n", type=int, default=128)
    ap.add_argument("--long-n", type=int, default=32)
    ap.add_argument("--json", required=True)
    a = ap.parse_args()
    words = open(os.path.join(ROOT, "tests/fixtures/sparse/genesis_1_3.txt")).read().split()
    out = {"what": "greedy tokens of spade's CPU path (native quantized weights) vs llama.cpp on the "
                   "same GGUF and prompt token ids; first divergence with each engine's top-2 logit gap",
           "llama_cpp_kv_cache": "f16 (its default)", "threads": a.threads,
           "command": "python3 bench/cpu_greedy_compare.py --llama-dir LLAMA_DIR --kv %s --threads %d"
                      % (a.kv, a.threads), "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        sg, lg = build(tmp, a.llama_dir)
        for name, count, n in (("short", 95, a.short_n), ("long", 5790, a.long_n)):
            w = []
            while len(w) < count:
                w += words
            pf, ids = os.path.join(tmp, name + ".txt"), os.path.join(tmp, name + ".ids")
            open(pf, "w").write(" ".join(w[:count]))
            lc = None
            for kv in a.kv.split(","):
                sp = parse(subprocess.run([sg, a.model, pf, str(n), str(a.threads), kv, "auto", ids],
                                          check=True, capture_output=True, text=True).stdout)
                if lc is None:
                    lc = parse(subprocess.run([lg, a.model, ids, str(n), str(a.threads)], check=True,
                                              capture_output=True, text=True).stdout)
                prompt_tokens = sum(1 for _ in open(ids))
                r = compare(sp, lc)
                r["prompt_tokens"] = prompt_tokens
                r["spade_kv_dtype"] = kv
                out["cases"]["%s_kv_%s" % (name, kv)] = r
                print(name, kv, {k: v for k, v in r.items() if not k.endswith("tokens")}, flush=True)
    res = json.load(open(a.json)) if os.path.exists(a.json) else {}
    res["greedy_vs_llama_cpp"] = out
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    print("wrote", a.json)


if __name__ == "__main__":
    main()
