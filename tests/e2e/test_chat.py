#!/usr/bin/env python3
"""End-to-end checks of `spade chat` (stdin/stdout) on the default model.

- The first answer equals `spade generate --chat` on the same message (greedy).
- Multi-turn answers with the KV prefix reused equal answers with the whole conversation
  prefilled every turn (--no-cache-reuse), and the reuse really happened (stats).
- /reset starts a new conversation: the same question gets the first answer again.
- --tp 3 (three ranks on this host) gives the same answers; --tp 2 is refused clearly.
- Bad input: a model without a chat template and a bad --thinking value give a clear
  error and a non-zero exit, not a crash.
Exits 77 (skipped) when models/SmolLM2-135M-Instruct.Q4_1.gguf is absent.
"""
import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOLLM = os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf")
STORIES_HF = os.path.join(ROOT, "tests/fixtures/models/stories260k-hf")  # no chat template


def chat(spade, lines, *extra):
    p = subprocess.run([spade, "chat", "--model", SMOLLM, "--temperature", "0", "-n", "40",
                        "--threads", "2", "--stats", *extra],
                       input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise AssertionError("spade chat failed: %s" % p.stderr)
    return p.stdout.splitlines(), p.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spade", required=True)
    args = ap.parse_args()
    if not os.path.exists(SMOLLM):
        print("skipped: %s not present (scripts/fetch_model.sh)" % SMOLLM)
        return 77
    failures = 0

    def check(cond, what):
        nonlocal failures
        print(("ok   " if cond else "FAIL ") + what)
        failures += 0 if cond else 1

    q1, q2, q3 = "What is the capital of France?", "And of Italy?", "Name one famous dish from there."
    gen = subprocess.run([args.spade, "generate", "--model", SMOLLM, "--chat", "--prompt", q1,
                          "-n", "40", "--threads", "2"], capture_output=True, text=True, timeout=600)
    check(gen.returncode == 0, "generate --chat runs")
    reused, err = chat(args.spade, [q1, q2, q3])
    fresh, _ = chat(args.spade, [q1, q2, q3], "--no-cache-reuse")
    check(len(reused) == 3, "three answers for three messages (got %d)" % len(reused))
    check(reused[0] == gen.stdout.rstrip("\n"), "first answer equals generate --chat: %r vs %r"
          % (reused[0], gen.stdout.rstrip("\n")))
    check(reused == fresh, "answers with the cached prefix equal answers prefilled from scratch")
    turns = [tuple(map(int, m)) for m in re.findall(r"turn: (\d+) conversation tokens, (\d+) prefilled", err)]
    check(len(turns) == 3 and all(pre < total for total, pre in turns[1:]),
          "later turns prefill only the new tokens: %s" % turns)
    after_reset, _ = chat(args.spade, [q1, "/reset", q1])
    check(len(after_reset) == 2 and after_reset[0] == after_reset[1] == reused[0],
          "/reset starts over: %s" % after_reset)

    # Tensor parallelism: SmolLM2's 3 KV heads over 3 ranks (processes of this host) give the
    # same multi-turn answers; 2 ranks do not divide them: a clear error before any rank starts.
    tp3, _ = chat(args.spade, [q1, q2, q3], "--tp", "3")
    check(tp3 == reused, "--tp 3 answers equal --tp 1's: %s vs %s" % (tp3, reused))
    tp2 = subprocess.run([args.spade, "chat", "--model", SMOLLM, "--tp", "2"], input="hi\n",
                         capture_output=True, text=True, timeout=120)
    check(tp2.returncode != 0 and "not divisible by 2" in tp2.stderr,
          "--tp 2 on 3 KV heads: clear error (%r)" % tp2.stderr.strip()[-200:])

    bad = subprocess.run([args.spade, "chat", "--model", SMOLLM, "--thinking", "maybe"],
                         input="hi\n", capture_output=True, text=True, timeout=120)
    check(bad.returncode != 0 and "--thinking expects on or off" in bad.stderr,
          "bad --thinking value: clear error (%r)" % bad.stderr.strip())
    if os.path.exists(STORIES_HF):
        nt = subprocess.run([args.spade, "chat", "--model", STORIES_HF], input="hi\n",
                            capture_output=True, text=True, timeout=120)
        check(nt.returncode != 0 and "error" in nt.stderr.lower() and "Segmentation" not in nt.stderr,
              "model without a chat template: clear error (%r)" % nt.stderr.strip()[-200:])
    print("%d failure(s)" % failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
