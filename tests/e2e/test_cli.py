#!/usr/bin/env python3
"""End-to-end checks of the CLI conventions of `spade generate` and `spade chat` (issue 38),
run on the stories260k fixture (tests/fixtures/models/stories260k-hf; a few seconds in all):

- --tokenizer PATH: a model directory without tokenizer files runs with the fixture's
  tokenizer.json / tokenizer.model / directory given, and gives the fixture's own text; a bad
  path and another model's tokenizer are clear errors.
- One default temperature: generate's and chat's --help say 0, serve's says what requests
  get; two runs without --temperature and different seeds give the greedy text, and the same
  seeds at temperature 1 do differ (so the check can fail).
- --stats prints the summary (stop reason, prompt tokens, prefill and decode tok/s; a sparse
  method's mean density and recall) and no per-step line; --stats-steps one per decode step;
  --stats-jsonl FILE one JSON object per generated token whose texts make the stdout.
- The prefill progress line: forced with --progress-after 0, it appears on stderr (plain
  lines when stderr is a pipe, one '\\r' line erased at the end on a terminal), stdout stays
  the same; with the default threshold of 2 s a short prefill shows none.
chat runs on the fixture with a tokenizer directory that adds a chat template (--tokenizer).
"""
import argparse
import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STORIES = os.path.join(ROOT, "tests/fixtures/models/stories260k-hf")
SMOLLM = os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPT = "Once upon a time"

failures = 0


def check(cond, what):
    global failures
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    failures += 0 if cond else 1


def run(spade, *args, stdin=None, timeout=120):
    return subprocess.run([spade, *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def gen(spade, *args, model=STORIES, **kw):
    return run(spade, "generate", "-m", model, "-t", "2", *args, **kw)


def tokenizer_checks(spade, tmp):
    ref = gen(spade, "-p", PROMPT, "-n", "12")
    check(ref.returncode == 0 and ref.stdout.strip(), "generate on the fixture runs")
    bare = os.path.join(tmp, "no-tokenizer")  # the weights and config, no tokenizer files
    os.makedirs(bare)
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(os.path.join(STORIES, f), bare)
    p = gen(spade, "-p", PROMPT, "-n", "12", model=bare)
    check(p.returncode != 0 and "neither tokenizer.json nor tokenizer.model" in p.stderr,
          "without --tokenizer the bare model has no tokenizer: %r" % p.stderr.strip())
    for t in ("tokenizer.json", "tokenizer.model", ""):
        path = os.path.join(STORIES, t) if t else STORIES
        p = gen(spade, "-p", PROMPT, "-n", "12", "--tokenizer", path, model=bare)
        check(p.returncode == 0 and p.stdout == ref.stdout,
              "--tokenizer %s: the model's own text (%r vs %r; %s)"
              % (t or "DIR", p.stdout, ref.stdout, p.stderr.strip()[-200:]))
    p = gen(spade, "-p", PROMPT, "-n", "4", "--tokenizer", "/nonexistent/tokenizer.json")
    check(p.returncode == 1 and "--tokenizer: /nonexistent/tokenizer.json: no such file" in p.stderr
          and not p.stdout, "bad --tokenizer path: clear error (%r)" % p.stderr.strip())
    p = gen(spade, "-p", PROMPT, "-n", "4", "--tokenizer", os.path.join(STORIES, "config.json"))
    check(p.returncode == 1 and p.stderr.startswith("spade generate: error: --tokenizer: "),
          "--tokenizer on a file that is no tokenizer: clear error (%r)" % p.stderr.strip())
    if os.path.exists(SMOLLM):  # a 49K-token vocabulary against the fixture's 512
        p = gen(spade, "-p", "The capital of France", "-n", "4", "--tokenizer", SMOLLM)
        check(p.returncode == 1 and "--tokenizer is not this model's tokenizer" in p.stderr,
              "another model's tokenizer: clear error (%r)" % p.stderr.strip())


def chat_tokenizer_dir(tmp):
    """The fixture's tokenizer with a chat template: chat runs on stories260k."""
    d = os.path.join(tmp, "chat-tokenizer")
    os.makedirs(d)
    shutil.copy(os.path.join(STORIES, "tokenizer.json"), d)
    with open(os.path.join(STORIES, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg["chat_template"] = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                            "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def chat(spade, tok, lines, *args):
    return run(spade, "chat", "-m", STORIES, "--tokenizer", tok, "-n", "24", "-t", "2", *args,
               stdin="\n".join(lines) + "\n")


def temperature_checks(spade, tok):
    for cmd in ("generate", "chat"):
        h = run(spade, cmd, "--help").stdout
        line = next((l for l in h.splitlines() if "--temperature" in l), "")
        check(re.search(r"\(default 0\b", line) is not None,
              "%s --help: default temperature 0 (%r)" % (cmd, line.strip()))
    h = run(spade, "serve", "--help").stdout
    check(re.search(r'"temperature".*1\.0', h, re.S) is not None and "greedy" in h,
          "serve --help says what a request without \"temperature\" gets")

    greedy = gen(spade, "-p", PROMPT, "-n", "24", "--temperature", "0").stdout
    plain = [gen(spade, "-p", PROMPT, "-n", "24", "--seed", s).stdout for s in ("1", "2")]
    hot = [gen(spade, "-p", PROMPT, "-n", "24", "--seed", s, "--temperature", "1").stdout
           for s in ("1", "2")]
    check(plain[0] == plain[1] == greedy, "generate without --temperature is greedy: %r" % plain)
    check(hot[0] != hot[1], "generate at temperature 1: the seeds differ (the check can fail)")

    q = ["Tell me a story."]
    c_greedy = chat(spade, tok, q, "--temperature", "0")
    c_plain = [chat(spade, tok, q, "--seed", s) for s in ("1", "2")]
    c_hot = [chat(spade, tok, q, "--seed", s, "--temperature", "1") for s in ("1", "2")]
    check(c_greedy.returncode == 0 and c_greedy.stdout.strip(),
          "chat on the fixture with a template from --tokenizer runs (%s)" % c_greedy.stderr[-200:])
    check(c_plain[0].stdout == c_plain[1].stdout == c_greedy.stdout,
          "chat without --temperature is greedy: %r" % [c.stdout for c in c_plain])
    check(c_hot[0].stdout != c_hot[1].stdout,
          "chat at temperature 1: the seeds differ (the check can fail)")


SUMMARY = re.compile(r"\[spade\] stop (\S+) \| prompt (\d+) tokens, ([0-9.]+) tok/s prefill \| "
                     r"generated (\d+) tokens, ([0-9.]+) tok/s decode")


def stats_checks(spade, tmp):
    n = 40
    base = ["-p", PROMPT, "-n", str(n), "--ignore-eos", "--sparse", "quest", "--budget", "16"]
    p = gen(spade, *base, "--stats", "--recall")
    m = SUMMARY.search(p.stderr)
    check(p.returncode == 0 and m is not None, "--stats: the summary line (%r)" % p.stderr[-600:])
    if m:
        check(m.group(1) == "max-tokens" and int(m.group(4)) == n and int(m.group(2)) > 0
              and float(m.group(3)) > 0 and float(m.group(5)) > 0,
              "summary: stop max-tokens, prompt tokens, prefill and decode rates: %s" % m.group(0))
    check(re.search(r"\[spade\] quest: \d+ decode steps, mean density 0\.\d+", p.stderr) is not None
          and re.search(r"mean recall [01]\.\d+", p.stderr) is not None,
          "summary: the sparse method's mean density and recall")
    check("[spade] step " not in p.stderr, "--stats alone prints no per-step line")

    p = gen(spade, *base, "--stats-steps")
    steps = re.findall(r"^\[spade\] step (\d+) L=(\d+) [0-9.]+ ms tokens/head [0-9.]+ density ",
                       p.stderr, re.M)
    check(SUMMARY.search(p.stderr) is not None and [int(s) for s, _ in steps] == list(range(1, n)),
          "--stats-steps: the summary and one line per decode step (%d lines)" % len(steps))

    full = gen(spade, "-p", PROMPT, "-n", "8", "--stats")
    m = SUMMARY.search(full.stderr)
    check(m is not None and "mean density" not in full.stderr,
          "full attention: the summary, no density line")
    long = gen(spade, "-p", PROMPT, "-n", "600", "--stats")  # past the fixture's 512 tokens
    m = SUMMARY.search(long.stderr)
    check(m is not None and m.group(1) == "context", "stop reason context at the model's context: %s"
          % (m.group(0) if m else long.stderr[-300:]))
    if os.path.exists(SMOLLM):  # an instruct model ends its answer
        eos = gen(spade, "--chat", "-p", "Say hello.", "-n", "200", "--stats", model=SMOLLM)
        m = SUMMARY.search(eos.stderr)
        check(m is not None and m.group(1) == "eos", "stop reason eos: %s"
              % (m.group(0) if m else eos.stderr[-300:]))
    ctx = gen(spade, "-p", PROMPT, "-n", "50", "-c", "12", "--stats")
    m = SUMMARY.search(ctx.stderr)
    check(m is not None and m.group(1) == "context", "stop reason context with -c 12")

    path = os.path.join(tmp, "steps.jsonl")
    p = gen(spade, *base, "--stats-jsonl", path)
    check(p.returncode == 0 and "[spade] stop" not in p.stderr and "[spade] step" not in p.stderr,
          "--stats-jsonl alone: nothing on stderr")
    with open(path) as f:
        lines = f.read().splitlines()
    recs = []
    try:
        recs = [json.loads(l) for l in lines]
        valid = all(isinstance(r, dict) for r in recs)
    except ValueError as e:
        valid = False
        print("  invalid JSON line: %s" % e)
    check(valid and len(lines) == n, "--stats-jsonl: %d valid JSON lines for %d tokens" % (len(lines), n))
    if valid and recs:
        check([r["i"] for r in recs] == list(range(n)) and recs[0]["phase"] == "prefill"
              and all(r["phase"] == "decode" for r in recs[1:]),
              "JSONL: i = 0..n-1, token 0 from the prefill, the others from decode steps")
        check("".join(r["text"] for r in recs) + "\n" == p.stdout,
              "JSONL: the tokens' texts make the stdout")
        check(all(0 < r["density"] <= 1 and r["tokens_per_head"] > 0 for r in recs[1:])
              and min(r["density"] for r in recs[1:]) < 1,
              "JSONL: each decode step's density (sparse once past the budget)")
        check(all(r["length"] == recs[0]["length"] + r["i"] and r["ms"] >= 0 for r in recs),
              "JSONL: each token's sequence length and time")
    p = gen(spade, "-p", PROMPT, "-n", "4", "--stats-jsonl", "/nonexistent/dir/x.jsonl")
    check(p.returncode == 1 and "--stats-jsonl: cannot write" in p.stderr,
          "--stats-jsonl to a bad path: clear error")


PROGRESS = re.compile(r"\[spade\] prefill (\d+)/(\d+) tokens \(\d+%\), \d+ tok/s, ETA [0-9.]+ s")


def progress_checks(spade, tmp, tok):
    # ~300 prompt tokens in chunks of 8: many chunk callbacks.
    prompt = os.path.join(tmp, "prompt.txt")
    with open(prompt, "w") as f:
        f.write("Once upon a time there was a little girl named Lily. " * 20)
    args = ["--prompt-file", prompt, "-n", "8", "--prefill-chunk", "8"]
    quiet = gen(spade, *args, "--progress-after", "-1")
    default = gen(spade, *args)
    forced = gen(spade, *args, "--progress-after", "0")
    check("prefill" not in default.stderr and "prefill" not in quiet.stderr,
          "no progress line for a prefill under the 2 s default, none with -1")
    lines = PROGRESS.findall(forced.stderr)
    check(forced.returncode == 0 and len(lines) >= 1 and "\r" not in forced.stderr,
          "--progress-after 0, stderr a pipe: plain progress lines with ETA (%r)" % forced.stderr[:300])
    check(re.search(r"\[spade\] prefill done: (\d+) tokens in [0-9.]+ s \(\d+ tok/s\)\n",
                    forced.stderr) is not None, "a last line gives the prefill's total")
    # Rate-limited: one plain line every 5 s at most; this prefill (~40 chunks) takes < 1 s.
    check(1 <= len(lines) <= 2, "plain lines rate-limited: %d for ~40 chunks" % len(lines))
    check(forced.stdout == quiet.stdout == default.stdout and "[spade]" not in forced.stdout,
          "stdout is the same text with and without the progress line")

    # stderr a terminal: one line rewritten with '\r' and erased at the end.
    master, slave = pty.openpty()
    proc = subprocess.Popen([spade, "generate", "-m", STORIES, "-t", "2", *args, "--progress-after", "0"],
                            stdout=subprocess.PIPE, stderr=slave, text=False)
    os.close(slave)
    err = b""
    while True:
        r, _, _ = select.select([master], [], [], 60)
        if not r:
            break
        try:
            d = os.read(master, 4096)
        except OSError:
            break
        if not d:
            break
        err += d
    out = proc.stdout.read().decode()
    proc.wait(60)
    os.close(master)
    e = err.decode("utf-8", "replace")
    check(proc.returncode == 0 and re.search(r"\r\[spade\] prefill \d+/\d+ tokens", e) is not None
          and "\r\x1b[K" in e and "prefill done" not in e,
          "stderr a terminal: one '\\r' line erased at the end (%r)" % e[:200])
    check(out == quiet.stdout, "stdout unchanged with stderr a terminal")

    c_quiet = chat(spade, tok, ["Tell me a story."], "--progress-after", "-1")
    c_forced = chat(spade, tok, ["Tell me a story."], "--progress-after", "0")
    check("[spade] prefill done" in c_forced.stderr and "prefill" not in c_quiet.stderr
          and c_forced.stdout == c_quiet.stdout and c_forced.returncode == 0,
          "chat: the progress line on stderr, the same answer on stdout")


def kv_mem_checks(spade):
    """serve --kv-mem GIB: the pages that much K and V holds; bad values and --kv-pages with
    it are errors before the server starts."""
    for extra, words in ((["--kv-mem", "0"], "--kv-mem must be a positive number"),
                         (["--kv-mem", "x"], "--kv-mem expects a number"),
                         (["--kv-mem", "1e-9"], "holds no KV page"),
                         (["--kv-mem", "1", "--kv-pages", "8"], "give one")):
        p = run(spade, "serve", "-m", STORIES, "--port", "0", *extra, timeout=60)
        check(p.returncode == 1 and words in p.stderr, "serve %s: %r (%r)" % (" ".join(extra), words, p.stderr[-300:]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spade", required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tok = chat_tokenizer_dir(tmp)
        tokenizer_checks(args.spade, tmp)
        temperature_checks(args.spade, tok)
        stats_checks(args.spade, tmp)
        progress_checks(args.spade, tmp, tok)
        kv_mem_checks(args.spade)
    print("%d failure(s)" % failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
