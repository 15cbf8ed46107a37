#!/usr/bin/env python3
"""CPU tests of spade.hf (python/spade/hf.py): a tiny random transformers Llama (GQA, fp32)
decoding with spade's kernels.
  - method full: the logits of a prompt and of every decode step equal transformers' eager
    attention within fp32 tolerance (prefill runs the same eager math; decode steps run
    spade.ops.decode_attention);
  - method quest with a budget past the context reads every row and equals full; with a
    small budget it reads fewer rows (density < 1) and still gives finite logits;
  - greedy tokens equal transformers' and remove() restores transformers' attention.
Runs with pytest or as a script (ctest python_hf, via scripts/python_test.sh); exits 77
(skipped) without torch, transformers or the built package.
"""
import sys
import unittest

try:
    import torch
    import transformers  # noqa: F401
    import spade
    import spade.hf
    ENABLED, WHY = True, ""
except ImportError as e:
    ENABLED, WHY = False, f"torch, transformers or the spade package unavailable ({e})"


def tiny_llama(seed=0, layers=3, hidden=64, heads=4, kv_heads=2, vocab=96):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=False, attn_implementation="eager")
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # peaked attention, so that a page selection matters
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return m


def step_logits(model, prompt, steps):
    """Logits of the prompt's last token and of `steps` greedy decode steps (the greedy
    tokens of the first run are fed to the second, so both see the same inputs)."""
    from transformers import DynamicCache
    out = []
    with torch.no_grad():
        cache = DynamicCache()
        r = model(prompt, past_key_values=cache, use_cache=True)
        out.append(r.logits[:, -1])
        ids = []
        for _ in range(steps):
            nxt = out[-1].argmax(-1, keepdim=True)
            ids.append(nxt)
            r = model(nxt, past_key_values=r.past_key_values, use_cache=True)
            out.append(r.logits[:, -1])
    return torch.stack(out, 1), torch.cat(ids, 1)


def close(test, got, want, rtol=1e-5, atol=1e-5):
    err = (got - want).abs()
    test.assertLessEqual(float((err - atol - rtol * want.abs()).max()), 0.0,
                         f"max error {float(err.max()):.3g}")


@unittest.skipUnless(ENABLED, WHY)
class HfTest(unittest.TestCase):
    def setUp(self):
        self.model = tiny_llama()
        g = torch.Generator().manual_seed(1)
        self.prompt = torch.randint(0, 96, (2, 45), generator=g)

    def test_full_equals_eager(self):
        want, _ = step_logits(self.model, self.prompt, 12)
        spade.hf.apply(self.model, method="full")
        got, _ = step_logits(self.model, self.prompt, 12)
        close(self, got, want)
        st = spade.hf.stats(self.model)
        self.assertEqual(st["density"], 1.0)
        self.assertEqual(st["decode_steps"], 12 * 3)
        spade.hf.remove(self.model)
        again, _ = step_logits(self.model, self.prompt, 3)
        self.assertTrue(torch.equal(again, want[:, :4]))

    def test_quest(self):
        full, _ = step_logits(self.model, self.prompt, 6)
        spade.hf.apply(self.model, method="quest", budget=128, page_size=16, dense_layers=1)
        wide, _ = step_logits(self.model, self.prompt, 6)  # budget past the context: every row
        close(self, wide, full)
        spade.hf.apply(self.model, method="quest", budget=32, page_size=16, dense_layers=1)
        narrow, _ = step_logits(self.model, self.prompt[:1], 6)
        self.assertTrue(bool(torch.isfinite(narrow).all()))
        self.assertLess(spade.hf.stats(self.model)["density"], 0.9)
        spade.hf.remove(self.model)

    def test_greedy_tokens_and_errors(self):
        # (model.generate() itself does not run on Debian's torch 1.13 under Python 3.11:
        # torch.distributed fails to import; the greedy loop of step_logits stands for it.)
        _, want = step_logits(self.model, self.prompt[:1], 10)
        spade.hf.apply(self.model, method="full")
        _, got = step_logits(self.model, self.prompt[:1], 10)
        self.assertTrue(torch.equal(got, want))
        spade.hf.remove(self.model)
        with self.assertRaisesRegex(spade.Error, "unknown method"):
            spade.hf.apply(self.model, method="nope")
        with self.assertRaisesRegex(spade.Error, "budget"):
            spade.hf.apply(self.model, method="quest", budget=4)


if __name__ == "__main__":
    if not ENABLED:
        print(f"skipped: {WHY}")
        sys.exit(77)
    unittest.main()
