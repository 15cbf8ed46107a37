#!/usr/bin/env python3
"""CPU tests of spade.hf (python/spade/hf.py): a tiny random transformers Llama (GQA, fp32)
decoding with spade's kernels.
  - method full: the logits of a prompt and of every decode step equal transformers' eager
    attention within fp32 tolerance (prefill runs the same eager math; decode steps run
    spade.ops.decode_attention);
  - method quest with a budget past the context reads every row and equals full; with a
    small budget it reads fewer rows (density < 1) and still gives finite logits;
  - greedy tokens equal transformers' and remove() restores transformers' attention;
  - every method the hook runs equals spade's C++ path on stories260k (the fixture loaded by
    transformers, fp32; spade with --kv-dtype f32): for each method spec (defaults and
    non-default options, twilight over several bases) the greedy tokens equal spade.LLM's
    (spade's engine in process) and `spade generate --sparse SPEC`'s (the CLI next to the
    package, build-*/spade, or $SPADE_BIN; skipped when absent), the density equals
    spade.LLM's within 1e-9, every decode step's tokens_per_head equals the CLI's
    --stats-jsonl within 1e-9 (the same number of tokens read per layer and KV head: the
    same selection sizes) and stats()' "method" equals the CLI's describe() line. Every spec
    of the list changes the greedy tokens of full attention within 100 tokens, so the
    selections matter. LycheeCluster's structure-aware chunks read the token text of the
    fixture's tokenizer (spade.hf.token_bytes), also on a prompt with every cut level;
  - each method on a batch of two sequences equals each sequence alone (logits within 1e-5,
    tokens_per_head exactly);
  - spec strings and keyword options, spade's option checks and the methods / option values
    the hook does not run (spade.Error naming what is supported).
Runs with pytest or as a script (ctest python_hf, via scripts/python_test.sh); exits 77
(skipped) without torch, transformers or the built package.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

try:
    import torch
    import transformers  # noqa: F401
    import spade
    import spade.hf
    ENABLED, WHY = True, ""
except ImportError as e:
    ENABLED, WHY = False, f"torch, transformers or the spade package unavailable ({e})"

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "tests", "fixtures", "models", "stories260k-hf")
PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in "
          "the park with her friends.")
N_TOKENS = 100
# Each changes the greedy tokens of full attention within N_TOKENS (36 prompt tokens).
SPECS = [
    "full",
    "streaming:budget=32",
    "streaming:budget=48,sinks=8,dense_layers=1",
    "quest:budget=32",
    "quest:budget=64,page_size=32,dense_layers=1",
    "tidal:budget=32",
    "tidal:budget=40,dense_layers=1,selection_layers=1,3",
    "lessismore:budget=32",
    "lessismore:budget=40,recent_ratio=0.5,sinks=2",
    "lycheecluster:budget=32,sink=4,buffer=16",
    "lycheecluster:budget=24,sink=4,buffer=8,tie=first,min_chunk=4,max_chunk=10",
    "lycheecluster:chunking=fixed,budget=32,sink=4,buffer=16",
    "lycheecluster:chunking=fixed,budget=48,fixed_chunk=8,buffer=24,budget_mode=total,"
    "dense_layers=1",
    "lycheecluster:chunking=fixed,budget=32,sink=4,buffer=16,group=sum,rank=center,pooling=max,"
    "bound=chunk,center_dtype=f32",
    "lycheecluster:chunking=fixed,budget=16,sink=4,buffer=8,fixed_chunk=4,kmeans_iters=3,"
    "chunks_per_fine=3,coarse_topk=2",
    "oracle-topk:budget=16",
    "oracle-topp:p=0.8",
    "oracle-topp:p=0.7,group=mean,dense_layers=1",
    "twilight",
    "twilight:p=0.8",
    "quest+twilight:budget=32",
    "twilight:base=tidal,budget=32",
    "twilight:base=lessismore,budget=32,p=0.9",
    "twilight:base=oracle-topk,budget=24",
    "twilight:base=lycheecluster,chunking=fixed,budget=32,sink=4,buffer=16",
    "twilight:base=lycheecluster,budget=32,sink=4,buffer=16",
    "twilight:base=full,dense_layers=1",
]


def find_cli():
    """The spade CLI of the build that holds this package (build-*/python/spade ->
    build-*/spade), or $SPADE_BIN; None when there is none."""
    path = os.environ.get("SPADE_BIN")
    if not path:
        pkg = os.path.dirname(os.path.abspath(spade.__file__))
        path = os.path.join(os.path.dirname(os.path.dirname(pkg)), "spade")
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def cli_run(cli, ids_prompt, spec, n):
    """`spade generate --sparse SPEC` (fp32 KV, greedy): tokens, the decode steps'
    tokens_per_head, the describe() line."""
    with tempfile.TemporaryDirectory() as tmp:
        js = os.path.join(tmp, "steps.jsonl")
        p = subprocess.run([cli, "generate", "-m", MODEL, "-p", ids_prompt, "-n", str(n),
                            "--ignore-eos", "--kv-dtype", "f32", "-t", "1", "--stats",
                            "--stats-jsonl", js, "--sparse", spec],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        with open(js) as f:
            rec = [json.loads(line) for line in f if line.strip()]
    desc = [line.split("attention: ", 1)[1] for line in p.stderr.splitlines()
            if line.startswith("[spade] attention: ")]
    return [r["id"] for r in rec], [r.get("tokens_per_head") for r in rec[1:]], desc[0]


def greedy(model, ids, n):
    """n greedy tokens of a [B, T] prompt with the model's own cache (the prefill's token,
    then n - 1 decode steps), and the logits of each."""
    from transformers import DynamicCache
    toks, logits = [], []
    with torch.no_grad():
        r = model(ids, past_key_values=DynamicCache(), use_cache=True)
        for i in range(n):
            logits.append(r.logits[:, -1])
            toks.append(r.logits[:, -1].argmax(-1, keepdim=True))
            if i + 1 < n:
                r = model(toks[-1], past_key_values=r.past_key_values, use_cache=True)
    return torch.cat(toks, 1), torch.stack(logits, 1)


# Token text of tiny_llama's 96 ids for LycheeCluster's structure-aware chunks: ASCII 32..95
# (spaces, '.', ',', ':', ';', '!', '?', ']', '>' among them), so two prompts chunk differently.
TINY_TEXT = [bytes([32 + i % 64]) for i in range(96)]


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



@unittest.skipUnless(ENABLED, WHY)
class HfMatchesCppTest(unittest.TestCase):
    """stories260k through transformers with spade.hf against spade's C++ methods."""

    @classmethod
    def setUpClass(cls):
        from transformers import AutoTokenizer, LlamaForCausalLM
        cls.llm = spade.LLM(MODEL, kv_dtype="f32")
        cls.ids = cls.llm.encode(PROMPT)
        cls.model = LlamaForCausalLM.from_pretrained(MODEL, torch_dtype=torch.float32).eval()
        cls.tokenizer = AutoTokenizer.from_pretrained(MODEL)  # LycheeCluster's token text
        cls.cli = find_cli()

    def hf(self, spec, ids=None, **kw):
        spade.hf.apply(self.model, spec, token_text=self.tokenizer, **kw)
        try:
            toks, _ = greedy(self.model, torch.tensor([ids or self.ids]), N_TOKENS)
            return toks[0].tolist(), spade.hf.stats(self.model)
        finally:
            spade.hf.remove(self.model)

    def test_every_method_equals_cpp(self):
        greedy_params = spade.SamplingParams(max_tokens=N_TOKENS, ignore_eos=True)
        full = None
        for spec in SPECS:
            with self.subTest(spec=spec):
                want = self.llm.generate([self.ids], greedy_params, sparse=spec)[0]
                got, st = self.hf(spec)
                self.assertEqual(got, want.token_ids)
                if spec == "full":
                    full = got
                    self.assertEqual(st["density"], 1.0)
                else:
                    self.assertNotEqual(got, full)  # the selections matter
                    self.assertLess(st["density"], 0.9)
                    self.assertAlmostEqual(st["density"], want.density, delta=1e-9)
                self.assertEqual(len(st["tokens_per_head"]), N_TOKENS - 1)
                if self.cli is None:
                    continue
                toks, tph, desc = cli_run(self.cli, PROMPT, spec, N_TOKENS)
                self.assertEqual(got, toks)
                self.assertEqual(st["method"], desc)
                hf_tph = [row[0] for row in st["tokens_per_head"]]
                self.assertEqual(len(hf_tph), len(tph))
                for i, (a, b) in enumerate(zip(hf_tph, tph)):
                    self.assertAlmostEqual(a, b, delta=1e-9, msg=f"decode step {i + 1}")
        if self.cli is None:
            self.skipTest("no spade CLI beside the package (set SPADE_BIN): compared with "
                          "spade.LLM only")

    def test_structure_chunks(self):
        # Structure-aware chunks over text with blank lines, a markdown rule, a fence and
        # ':', ';', '!': LycheeCluster's cut levels 1-4, against the CLI.
        if self.cli is None:
            self.skipTest("no spade CLI beside the package (set SPADE_BIN)")
        prompt = ("Once upon a time, there was a little girl named Lily.\n\nShe saw a big dog: "
                  "it was brown; it barked! \"Hello,\" said Lily.\n---\nThe end. {yes}, [no];"
                  " ok\n```\nTom -> Sue => Ben > Max\n")
        ids = self.llm.encode(prompt)
        for spec in ("lycheecluster:budget=32,sink=4,buffer=16",
                     "lycheecluster:budget=24,sink=4,buffer=8,tie=first,min_chunk=4,max_chunk=10"):
            with self.subTest(spec=spec):
                got, st = self.hf(spec, ids=ids)
                toks, tph, desc = cli_run(self.cli, prompt, spec, N_TOKENS)
                self.assertEqual(got, toks)
                self.assertEqual(st["method"], desc)
                for i, (a, b) in enumerate(zip([row[0] for row in st["tokens_per_head"]], tph)):
                    self.assertAlmostEqual(a, b, delta=1e-9, msg=f"decode step {i + 1}")

    def test_token_bytes(self):
        # spade's Tokenizer::token_bytes rules on the fixture's tokenizer.json: added tokens
        # their text, byte-fallback pieces their byte, "\u2581" a space.
        tb = spade.hf.token_bytes(self.tokenizer)
        self.assertEqual(len(tb), 512)
        self.assertEqual(tb[1], b"<s>")
        self.assertEqual(tb[13], b"\n")  # <0x0A>
        self.assertEqual(tb[403], b" Once")
        self.assertEqual(b"".join(tb[i] for i in self.ids[1:]).decode(), " " + PROMPT)

    def test_spec_and_keywords(self):
        m = self.model
        spade.hf.apply(m, "tidal:budget=32,selection_layers=2,3")
        a = spade.hf.stats(m)["method"]
        spade.hf.apply(m, "tidal", budget=32, selection_layers=[2, 3])
        self.assertEqual(spade.hf.stats(m)["method"], a)
        self.assertEqual(a, "tidal budget=32 (dense 0-1, select 2,3)")
        spade.hf.apply(m, "quest:budget=64,dense_layers=1", budget=32)  # keywords win
        self.assertIn("quest budget=32 page_size=16 pages=2 dense_layers=1",
                      spade.hf.stats(m)["method"])
        spade.hf.apply(m, method="quest", budget=64, page_size=32)  # Quest's page
        self.assertIn("page_size=32 pages=2", spade.hf.stats(m)["method"])
        spade.hf.apply(m, "lessismore", budget=40, recent_ratio=0.5)
        self.assertEqual(spade.hf.stats(m)["method"], "lessismore budget=40 recent_ratio=0.5 "
                         "(20 recent) sinks=4 (dense 0-1, select 2)")
        spade.hf.remove(m)

    def test_errors(self):
        m = self.model
        cases = [
            (("lycheedecode",), {}, "not supported by the Hugging Face hook.*supported: full, "
             "streaming, quest, tidal, lessismore, lycheecluster, oracle-topk, oracle-topp, "
             "twilight"),
            (("lycheecluster",), {}, "chunking=structure without token_text is not supported.*"
             "supported: chunking=fixed, or chunking=structure with apply"),
            (("lycheecluster:chunking=fixed,seeding=kmeans++",), {}, "seeding=kmeans\\+\\+ is "
             "not supported"),
            (("lycheecluster:chunking=fixed,min_chunk=9,max_chunk=8",), {},
             r"need 1 <= min_chunk \(9\) <= max_chunk \(8\)"),
            (("quest+blasst",), {}, "blasst.*not supported"),
            (("nope",), {}, "unknown method 'nope'"),
            (("quest:group=sum",), {}, "group=sum is not supported.*supported: group=max"),
            (("twilight:keys=exact",), {}, "keys=exact is not supported"),
            (("twilight:head_combine=mean",), {}, "head_combine=mean is not supported"),
            (("tidal:correction=1",), {}, "correction=1 is not supported"),
            (("quest:window=3",), {}, "sparse method 'quest' has no option 'window'; valid "
             "options: budget, page_size, dense_layers, group"),
            (("streaming",), {"budget": 0}, r"streaming option 'budget' = 0 outside \[1, "),
            (("streaming",), {"sinks": 48, "budget": 48}, r"budget \(48\) must exceed sinks"),
            (("quest",), {"budget": 8}, r"budget \(8\) must be at least one page"),
            (("tidal",), {"selection_layers": [2, 5]}, r"element 5 outside \[0, 4\] \(the "
             "model has 5 layers\)"),
            (("tidal",), {"dense_layers": 3, "selection_layers": [2]}, "layer 3 would reuse"),
            (("lessismore:budget=8,sinks=7",), {}, "fewer than the 7 sinks"),
            (("oracle-topp:p=0",), {}, r"p' = 0 outside \(0, 1\]"),
            (("twilight:sinks=4",), {}, "option 'sinks' belongs neither to twilight nor to "
             "its base 'quest'"),
            (("twilight:base=twilight",), {}, "cannot be twilight"),
            (("quest:budget=1.5",), {}, "expects an integer, got '1.5'"),
        ]
        for args, kw, pattern in cases:
            with self.subTest(args=args, kw=kw):
                with self.assertRaisesRegex(spade.Error, pattern):
                    spade.hf.apply(m, *args, **kw)
                self.assertIsNone(getattr(m, "_spade_hf", None))

    def test_new_sequence_starts_afresh(self):
        # One apply(), the same prompt twice: the second run rebuilds the method's state
        # (LycheeCluster's chunks and indexes, Tidal's set) and repeats the first.
        for spec in ("lycheecluster:chunking=fixed,budget=32,sink=4,buffer=16", "tidal:budget=32"):
            with self.subTest(spec=spec):
                spade.hf.apply(self.model, spec)
                a, _ = greedy(self.model, torch.tensor([self.ids]), 30)
                b, _ = greedy(self.model, torch.tensor([self.ids]), 30)
                tph = spade.hf.stats(self.model)["tokens_per_head"]
                spade.hf.remove(self.model)
                self.assertTrue(torch.equal(a, b))
                self.assertEqual(tph[:29], tph[29:])

    def test_layer_defaults(self):
        # src/sparse/model_defaults.cpp: the table, then 13/32 of the depth.
        d = spade.hf.layer_defaults
        self.assertEqual(d("llama", 30, 576, 3), (2, [2, 14]))     # SmolLM2-135M
        self.assertEqual(d("llama", 32, 4096, 8), (2, [2, 13]))    # Llama-3-8B
        self.assertEqual(d("llama", 32, 4096, 32), (2, [2, 7]))    # LongChat-7B
        self.assertEqual(d("qwen3", 36, 2560, 8), (2, [2, 20]))    # Qwen3-4B
        self.assertEqual(d("qwen2", 28, 1536, 2), (2, [2, 11]))    # not in the table
        self.assertEqual(d("llama", 5, 64, 4), (2, [2]))           # stories260k
        self.assertEqual(d("llama", 2, 64, 4), (0, [0]))


@unittest.skipUnless(ENABLED, WHY)
class HfBatchTest(unittest.TestCase):
    """Two sequences of one batch decode as each alone, for every method (the lists are built
    per request)."""

    SPECS = ["streaming:budget=24", "quest:budget=32,dense_layers=1", "tidal:budget=24",
             "lessismore:budget=24", "lycheecluster:chunking=fixed,budget=16,sink=4,buffer=8",
             "lycheecluster:budget=16,sink=4,buffer=8,min_chunk=2,max_chunk=6",
             "oracle-topk:budget=16", "oracle-topp:p=0.8",
             "twilight:budget=32,dense_layers=1", "twilight:base=lessismore,budget=24"]

    def test_batch_equals_alone(self):
        model = tiny_llama(layers=4)
        prompt = torch.randint(0, 96, (2, 45), generator=torch.Generator().manual_seed(3))
        for spec in self.SPECS:
            with self.subTest(spec=spec):
                spade.hf.apply(model, spec, token_text=TINY_TEXT)
                _, both = greedy(model, prompt, 10)
                tph = spade.hf.stats(model)["tokens_per_head"]
                self.assertLess(spade.hf.stats(model)["density"], 0.95)
                for b in range(2):
                    spade.hf.apply(model, spec, token_text=TINY_TEXT)
                    _, alone = greedy(model, prompt[b:b + 1], 10)
                    close(self, both[b:b + 1], alone)
                    self.assertEqual([row[b] for row in tph],
                                     [row[0] for row in spade.hf.stats(model)["tokens_per_head"]])
                spade.hf.remove(model)


if __name__ == "__main__":
    if not ENABLED:
        print(f"skipped: {WHY}")
        sys.exit(77)
    unittest.main()
