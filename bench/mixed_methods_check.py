#!/usr/bin/env python3
"""Per-request methods on one server: does a request's greedy text depend on the other
requests' methods?

Against one `spade serve` (best with --deterministic), sends `--per-method` requests for each
method of `--methods` (";"-separated specs, the CLI's string form, e.g. "quest:budget=64"):
  mixed: all of them at once (every method in the same steps);
  alone: for each method, the same requests at once again, but every request of another method
         runs full attention instead: the batch keeps its size and prompts (GEMM shapes, the
         method's own rows), only the other methods are gone. Equal texts mean a request's
         output does not depend on which methods the other requests use. (A one-method server
         differs from both in batch sizes, and the GEMMs' and split-K attention's rounding
         depends on those.)
Greedy, ignore_eos, max_tokens each. Reports per method how many texts are equal, the first
differing character of the others, and the server's KV pages in use after each phase (from
/metrics; 0 = every page returned). JSON to --out.

  python3 bench/mixed_methods_check.py --url http://127.0.0.1:18083 \\
      --methods "full;quest:budget=64;tidal:budget=64" --per-method 4 --max-tokens 128 --out r.json
"""
import argparse
import concurrent.futures as cf
import datetime
import http.client
import json
import sys
import urllib.parse

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_serve import default_commit, prompt_text  # noqa: E402


def complete(host, port, prompt, method, max_tokens):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if method != "full":
        body["sparse"] = method
    c = http.client.HTTPConnection(host, port, timeout=600)
    c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    if r.status != 200:
        return {"error": "%d %s" % (r.status, data[:200].decode("utf-8", "replace"))}
    j = json.loads(data)
    return {"text": j["choices"][0]["text"], "usage": j.get("usage")}


def pages_in_use(host, port):
    c = http.client.HTTPConnection(host, port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    for line in text.splitlines():
        if line.startswith("spade_kv_pages_used") or line.startswith("spade_kv_used_pages"):
            return float(line.split()[-1])
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--methods", required=True)
    ap.add_argument("--per-method", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--label", default="")
    ap.add_argument("--commit", default=None, help="commit to record (default: $COMMIT, else git HEAD)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    u = urllib.parse.urlparse(a.url)
    methods = [m for m in a.methods.split(";") if m]
    jobs = [(m, i, prompt_text(i, a.prompt_words, 7)) for m in methods for i in range(a.per_method)]

    def run(batch):
        with cf.ThreadPoolExecutor(max_workers=max(1, len(batch))) as ex:
            futs = {ex.submit(complete, u.hostname, u.port, p, m, a.max_tokens): (m, i) for m, i, p in batch}
            return {futs[f]: f.result() for f in cf.as_completed(futs)}

    mixed = run(jobs)
    pages_after_mixed = pages_in_use(u.hostname, u.port)
    alone = {}
    for m in methods:
        got = run([(jm if jm == m else "full", i if jm == m else (jm, i), p) for jm, i, p in jobs])
        alone.update({k: v for k, v in got.items() if k[0] == m and not isinstance(k[1], tuple)})
    pages_after_alone = pages_in_use(u.hostname, u.port)
    per = {}
    for m in methods:
        r = {"requests": a.per_method, "equal": 0, "errors": [], "first_diff_chars": []}
        for i in range(a.per_method):
            x, y = mixed[(m, i)], alone[(m, i)]
            if "error" in x or "error" in y:
                r["errors"].append(x.get("error") or y.get("error"))
                continue
            if x["text"] == y["text"]:
                r["equal"] += 1
            else:
                k = next((n for n, (p, q) in enumerate(zip(x["text"], y["text"])) if p != q),
                         min(len(x["text"]), len(y["text"])))
                r["first_diff_chars"].append(k)
        per[m] = r
    total = sum(r["equal"] for r in per.values())
    res = {"label": a.label, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "commit": a.commit or default_commit(), "config": vars(a), "equal": total, "requests": len(jobs), "by_method": per,
           "kv_pages_used_after_mixed": pages_after_mixed, "kv_pages_used_after_alone": pages_after_alone}
    print("mixed vs alone: %d/%d greedy texts equal; KV pages in use after: %s / %s" %
          (total, len(jobs), pages_after_mixed, pages_after_alone))
    for m, r in per.items():
        print("  %-34s %d/%d equal%s%s" % (m, r["equal"], r["requests"],
                                            (" first diff at chars %s" % r["first_diff_chars"]) if r["first_diff_chars"] else "",
                                            (" errors %s" % r["errors"][:2]) if r["errors"] else ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if all(not r["errors"] for r in per.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
