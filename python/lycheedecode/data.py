"""Passkey-retrieval samples for head-role training (LycheeDecode appendix F, after
DuoAttention): several 32-word passkeys inserted at random depths of long real filler text
(KJV, python/lycheedecode/make_filler.sh), a question at the end, and the passkeys as the
target. Everything is assembled in token space so prompt lengths hit their targets exactly.

  prompt = intro + filler[..] + key_1 + filler[..] + ... + key_n + filler[..] + question
  key_i  = " Remember this sequence of words, it is passkey number {i} to the vault: {32 words}."
  target = " passkey number 1 is: {words}. passkey number 2 is: {words}. ..."
"""
import random
import re

INTRO = ("There are passkeys hidden inside a lot of irrelevant text. Find them and memorize "
         "them. I will quiz you about them.\n\n")
QUESTION = "\n\nWhat are the passkeys to the vault, in order? Answer: The"


class PasskeyData:
    def __init__(self, tokenizer, filler_text, seed=0, words=32):
        self.tok = tokenizer
        self.rng = random.Random(seed)
        self.words = words
        text = " ".join(line.strip() for line in filler_text.splitlines() if line.strip())
        self.filler = self.encode(text)
        vocab = sorted({w.lower() for w in re.findall(r"[A-Za-z]{4,}", text)})
        self.vocab = vocab
        self.intro = self.encode(INTRO)
        self.question = self.encode(QUESTION)

    def encode(self, s):
        return self.tok(s, add_special_tokens=False)["input_ids"]

    def sample(self, prompt_len, n_keys):
        """-> (prompt ids, target ids, info) with len(prompt ids) == prompt_len."""
        keys = [" ".join(self.rng.choice(self.vocab) for _ in range(self.words))
                for _ in range(n_keys)]
        key_ids = [self.encode(f" Remember this sequence of words, it is passkey number {i + 1} "
                               f"to the vault: {k}.") for i, k in enumerate(keys)]
        target = self.encode(" " + " ".join(f"passkey number {i + 1} is: {k}."
                                            for i, k in enumerate(keys)))
        fixed = len(self.intro) + len(self.question) + sum(len(k) for k in key_ids)
        n_fill = prompt_len - fixed
        if n_fill < n_keys + 1:
            raise ValueError(f"prompt_len {prompt_len} too short for {n_keys} passkeys")
        start = self.rng.randrange(0, len(self.filler) - n_fill)
        fill = self.filler[start:start + n_fill]
        cuts = sorted(self.rng.sample(range(1, n_fill), n_keys))
        ids = list(self.intro)
        prev = 0
        for c, k in zip(cuts, key_ids):
            ids += fill[prev:c] + k
            prev = c
        ids += fill[prev:] + self.question
        assert len(ids) == prompt_len, (len(ids), prompt_len)
        depths = [round(c / n_fill, 3) for c in cuts]
        return ids, target, {"keys": keys, "depths": depths}

    def batch(self, min_len, max_len, min_keys, max_keys):
        n_keys = self.rng.randint(min_keys, max_keys)
        length = self.rng.randint(min_len, max_len)
        return self.sample(length, n_keys)
