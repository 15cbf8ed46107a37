#!/usr/bin/env python3
"""Ctrl-C in `spade chat` stops the answer, not the program (issue 38), on the default model.

- SIGINT while an answer streams: the answer stops ("[spade] interrupted", stop reason
  interrupted), the process lives on, takes the next line and answers it; a second answer
  interrupted the same way; end of input then exits with status 0, nothing but the answers
  on stdout.
- SIGINT during a long prefill (a message of ~3,000 tokens, seen by its progress line):
  the message is dropped, and the next one is answered.
- SIGINT at the prompt (no answer running): the default action, the process ends by SIGINT.
Answers run with --ignore-eos and a large -n so that they are still running when the
signal comes. Exits 77 (skipped) when models/SmolLM2-135M-Instruct.Q4_1.gguf is absent.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOLLM = os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spade_client import time_scale  # noqa: E402

failures = 0


def check(cond, what):
    global failures
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    failures += 0 if cond else 1


class Chat:
    """A `spade chat` process whose stdout and stderr are read by threads."""

    def __init__(self, spade, *extra):
        self.proc = subprocess.Popen(
            [spade, "chat", "--model", SMOLLM, "-n", "4000", "--ignore-eos", "--threads", "2",
             "--stats", *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out, self.err = bytearray(), bytearray()
        self.lock = threading.Lock()
        for stream, buf in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._pump, args=(stream, buf), daemon=True).start()

    def _pump(self, stream, buf):
        while True:
            d = stream.read1(4096)
            if not d:
                return
            with self.lock:
                buf.extend(d)

    def text(self, which):
        with self.lock:
            return bytes(self.out if which == "out" else self.err).decode("utf-8", "replace")

    def send(self, line):
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()

    def wait_for(self, pred, timeout=120):
        deadline = time.time() + timeout * time_scale()
        while time.time() < deadline:
            if pred():
                return True
            if self.proc.poll() is not None:
                return pred()
            time.sleep(0.02)
        return False

    def prompts(self):
        return self.text("err").count("> ")


def answer_then_interrupt(c, line, n_out_before, what):
    """Sends `line`, waits for its answer to stream, sends SIGINT; True when it stopped."""
    c.send(line)
    started = c.wait_for(lambda: len(c.text("out")) > n_out_before + 20)
    check(started, "%s: the answer streams" % what)
    interrupted_before = c.text("err").count("stop interrupted")
    c.proc.send_signal(signal.SIGINT)
    stopped = c.wait_for(lambda: c.text("err").count("stop interrupted") > interrupted_before, 30)
    check(stopped and c.proc.poll() is None,
          "%s: SIGINT stops the answer, the process lives on" % what)
    # Stopped: no more output comes.
    n = len(c.text("out"))
    time.sleep(0.5)
    check(len(c.text("out")) == n and c.text("out").endswith("\n"),
          "%s: nothing more is written after the stop; the answer ends its line" % what)
    return len(c.text("out"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spade", required=True)
    args = ap.parse_args()
    if not os.path.exists(SMOLLM):
        print("skipped: %s not present (scripts/fetch_model.sh)" % SMOLLM)
        return 77

    # Two answers stopped by Ctrl-C, then end of input.
    c = Chat(args.spade)
    n = answer_then_interrupt(c, "Tell me a long story about a dragon.", 0, "first answer")
    check("[spade] interrupted (Ctrl-C at the prompt exits)" in c.text("err"),
          "stderr says so and how to exit")
    n = answer_then_interrupt(c, "Now tell me another one, about a cat.", n, "next line")
    c.proc.stdin.close()
    try:
        rc = c.proc.wait(60 * time_scale())
    except subprocess.TimeoutExpired:
        c.proc.kill()
        rc = None
    out = c.text("out")
    check(rc == 0, "end of input after the interrupted answers: exit status 0 (got %s)" % rc)
    check(out.endswith("\n") and out.strip() and "[spade]" not in out,
          "stdout holds the two partial answers and nothing else (%r)" % out[:200])
    turns = re.findall(r"turn: (\d+) conversation tokens, (\d+) prefilled", c.text("err"))
    check(len(turns) == 2 and int(turns[1][1]) < int(turns[1][0]),
          "the interrupted answer stays in the conversation, its cache reused: %s" % turns)

    # Ctrl-C during a long prefill drops the message; the next one is answered.
    c = Chat(args.spade, "--progress-after", "0")
    c.send("The quick brown fox jumps over the lazy dog. " * 300)
    seen = c.wait_for(lambda: "[spade] prefill " in c.text("err"))
    check(seen, "a long message shows the prefill progress line")
    c.proc.send_signal(signal.SIGINT)
    dropped = c.wait_for(lambda: "interrupted during the prefill" in c.text("err"), 60)
    check(dropped and c.proc.poll() is None and c.text("out") == "",
          "SIGINT in the prefill: the message is dropped, nothing on stdout, the process lives on")
    answer_then_interrupt(c, "Hello!", 0, "after a dropped message")
    turns = re.findall(r"turn: (\d+) conversation tokens, (\d+) prefilled", c.text("err"))
    check(len(turns) == 1 and turns[0][0] == turns[0][1] and int(turns[0][0]) < 100,
          "the next turn prefills the conversation without the dropped message: %s" % turns)

    # Ctrl-C at the prompt: the default action.
    prompts = c.prompts()
    c.wait_for(lambda: c.prompts() > prompts or c.text("err").endswith("> "), 10)
    time.sleep(0.3)  # back in getline, the default action restored
    c.proc.send_signal(signal.SIGINT)
    try:
        rc = c.proc.wait(30 * time_scale())
    except subprocess.TimeoutExpired:
        c.proc.kill()
        rc = None
    check(rc == -signal.SIGINT, "SIGINT at the prompt ends the program (status %s)" % rc)

    print("%d failure(s)" % failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
