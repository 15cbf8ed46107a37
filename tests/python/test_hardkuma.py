#!/usr/bin/env python3
"""CPU tests of the LycheeDecode head-role training math (python/lycheedecode/):
  - E[L0] closed form (appendix A.3) vs a Monte-Carlo estimate, P(z=0), P(z=1) and E[z];
  - the token-set selection vs a brute-force top-k of the group-averaged query;
  - ratio = 1 makes the hybrid student equal the dense teacher for any gate values;
  - a few training steps on a tiny random Llama: gradients reach alpha and beta, lambda
    follows projected gradient ascent, the roles file has the C++ loader's shape.
Runs with `python3 -m pytest tests/python/test_hardkuma.py` or `python3 tests/python/test_hardkuma.py`.
Without torch (CI) every test is skipped with a message; as a script it then exits 77 (the
ctest SKIP_RETURN_CODE).
"""
import json
import math
import os
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python", "lycheedecode"))

try:
    import torch
    import transformers  # noqa: F401
    HAVE_TORCH = True
    WHY = ""
except ImportError as e:  # CI has no torch
    HAVE_TORCH = False
    WHY = f"torch/transformers unavailable ({e}); the head-role training math is not tested here"


def tiny_llama(seed=0, layers=3, hidden=32, heads=4, kv_heads=2, vocab=64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger q/k so attention is peaked and sparsity matters
        for layer in m.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return m


@unittest.skipUnless(HAVE_TORCH, WHY)
class HardKumaMath(unittest.TestCase):
    def setUp(self):
        import hardkuma as hk

        self.hk = hk
        torch.manual_seed(1)
        self.a = torch.tensor([1.0, 0.3, 3.0, 0.7, 5.0, 1.0], dtype=torch.float64)
        self.b = torch.tensor([1.0, 2.0, 0.5, 0.2, 4.0, 30.0], dtype=torch.float64)

    def test_expected_l0_closed_form_matches_monte_carlo(self):
        n = 400_000
        a = self.a[:, None].expand(-1, n)
        b = self.b[:, None].expand(-1, n)
        z = self.hk.sample(a, b, u=torch.rand(a.shape, dtype=torch.float64))
        mc_nonzero = (z > 0).double().mean(1)
        closed = self.hk.p_nonzero(self.a, self.b)
        se = torch.sqrt(closed * (1 - closed) / n).clamp(min=1e-4)
        self.assertTrue(bool(((mc_nonzero - closed).abs() < 5 * se).all()),
                        f"closed {closed.tolist()} mc {mc_nonzero.tolist()}")
        self.assertAlmostEqual(float(self.hk.expected_l0(self.a, self.b)), float(closed.sum()), places=12)
        # a = b = 1 (the start): P(z != 0) = 1 - 1/12
        self.assertAlmostEqual(float(self.hk.p_nonzero(torch.tensor(1.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))), 11 / 12, places=12)
        # P(z = 1) and E[z]
        mc_one = (z >= 1).double().mean(1)
        p1 = self.hk.p_one(self.a, self.b)
        self.assertTrue(bool(((mc_one - p1).abs() < 5 * torch.sqrt(p1 * (1 - p1) / n).clamp(min=1e-4)).all()))
        ez = self.hk.expected_z(self.a, self.b)
        self.assertTrue(bool(((z.mean(1) - ez).abs() < 5e-3).all()), f"{ez.tolist()} vs {z.mean(1).tolist()}")
        self.assertAlmostEqual(float(self.hk.expected_z(torch.tensor([1.0]), torch.tensor([1.0]))), 0.5, places=5)

    def test_closed_form_gradients_match_finite_differences(self):
        a = self.a.clone().requires_grad_(True)
        b = self.b.clone().requires_grad_(True)
        self.hk.expected_l0(a, b).backward()
        eps = 1e-6
        for i in range(len(self.a)):
            for t, g in ((self.a, a.grad), (self.b, b.grad)):
                up, dn = t.clone(), t.clone()
                up[i] += eps
                dn[i] -= eps
                f = (lambda x: self.hk.expected_l0(x, self.b)) if t is self.a else (lambda x: self.hk.expected_l0(self.a, x))
                fd = (float(f(up)) - float(f(dn))) / (2 * eps)
                self.assertAlmostEqual(float(g[i]), fd, delta=1e-6 * max(1.0, abs(fd)))

    def test_samples_are_in_unit_interval_with_mass_at_the_ends(self):
        g = self.hk.HardKumaGates(5)
        z = torch.stack([g.sample() for _ in range(2000)])
        self.assertTrue(bool(((z >= 0) & (z <= 1)).all()))
        frac0 = float((z == 0).double().mean())
        self.assertAlmostEqual(frac0, 1 / 12, delta=0.02)


@unittest.skipUnless(HAVE_TORCH, WHY)
class HybridModelTests(unittest.TestCase):
    def setUp(self):
        from model import HybridModel

        self.hm = HybridModel(tiny_llama())
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, 64, (1, 70), generator=g)

    def test_selection_equals_brute_force_topk_of_the_group_averaged_query(self):
        torch.manual_seed(0)
        B, H, T, N, D = 1, 2, 6, 40, 8
        qbar = torch.randn(B, H, T, D)
        K = torch.randn(B, H, N, D)
        pos = torch.arange(N - T, N)
        visible = torch.arange(N)[None, :] <= pos[:, None]
        k_row = self.hm.budget(pos, 0.3, 0)
        m = self.hm.select(qbar, K, visible, k_row)
        for h in range(H):
            for t in range(T):
                s = [(float(qbar[0, h, t] @ K[0, h, j]), j) for j in range(int(pos[t]) + 1)]
                s.sort(key=lambda x: (-x[0], x[1]))
                want = sorted(j for _, j in s[:int(k_row[t])])
                got = torch.nonzero(m[0, h, t]).flatten().tolist()
                self.assertEqual(got, want)
                self.assertEqual(int(k_row[t]), math.ceil(0.3 * (int(pos[t]) + 1)))

    def test_ratio_one_student_equals_teacher_for_any_gates(self):
        cache = self.hm.prefill(self.ids[:, :50])
        chunk = self.ids[:, 50:]
        teacher = self.hm.targets(chunk, cache)
        # the functional dense path reproduces transformers' own forward
        ref = self.hm.hf(self.ids).logits[:, 50:].float()
        self.assertLess(float((teacher - ref).abs().max()), 1e-4)
        z = torch.rand(self.hm.n_layers - 1, self.hm.Hkv)
        student = self.hm.targets(chunk, cache, z=z, ratio=1.0)
        self.assertLess(float((student - teacher).abs().max()), 1e-5)
        small = self.hm.targets(chunk, cache, z=torch.zeros_like(z), ratio=0.1)
        self.assertGreater(float((small - teacher).abs().max()), 1e-3)

    def test_sparse_heads_pass_their_set_on_and_never_add_tokens(self):
        cache = self.hm.prefill(self.ids[:, :50])
        z = torch.tensor([[0.0, 1.0], [0.0, 0.0]])  # layer 1: head 0 sparse, head 1 retrieval
        trace = []
        self.hm.targets(self.ids[:, 50:], cache, z=z, ratio=0.2, trace=trace)
        self.assertEqual(len(trace), 2)  # sets after layer 0 and after layer 1
        self.assertTrue(torch.equal(trace[1][:, 0], trace[0][:, 0]))   # sparse: unchanged
        self.assertFalse(torch.equal(trace[1][:, 1], trace[0][:, 1]))  # retrieval: fresh set


@unittest.skipUnless(HAVE_TORCH, WHY)
class TrainingSteps(unittest.TestCase):
    def run_steps(self, gates_cls, steps=3):
        from model import HybridModel
        from train_roles import Trainer

        hm = HybridModel(tiny_llama(seed=2, layers=4))
        gates = gates_cls(hm.n_gates)
        tr = Trainer(hm, gates, n_target=2, lr=0.01, lambda_init=0.5, lambda_lr=0.1, ratio=0.2)
        g = torch.Generator().manual_seed(3)
        lam = 0.5
        for _ in range(steps):
            ids = torch.randint(0, 64, (90,), generator=g).tolist()
            before = [p.detach().clone() for p in gates.parameters()]
            el0_before = float(gates.expected_l0().detach())
            loss, el0, lam_used = tr.step(ids[:70], ids[70:])
            self.assertEqual(lam_used, lam)
            self.assertAlmostEqual(el0, el0_before, places=5)
            lam = max(0.0, lam + 0.1 * (el0 - 2))
            self.assertAlmostEqual(tr.lam, lam, places=9)
            self.assertTrue(math.isfinite(loss) and loss > 0)
            for p, q in zip(gates.parameters(), before):
                self.assertTrue(bool(torch.isfinite(p.grad).all()))
                self.assertGreater(float(p.grad.abs().max()), 0.0)
                self.assertFalse(torch.equal(p.detach(), q))
        return hm, gates, tr

    def test_gradients_reach_alpha_and_beta(self):
        import hardkuma as hk

        hm, gates, tr = self.run_steps(hk.HardKumaGates)
        # the distillation term alone also reaches both parameters (not only the E[L0] term)
        tr.lam = 0.0
        ids = list(range(1, 64)) + list(range(1, 28))
        pre, chunk = tr.chunk(ids[:70], ids[70:])
        cache = hm.prefill(pre)
        teacher = hm.targets(chunk, cache)
        torch.manual_seed(7)
        found = False
        for _ in range(20):  # a sample whose z lands inside (0, 1) for some head
            gates.zero_grad()
            z = gates.sample()
            if not bool(((z > 0) & (z < 1)).any()):
                continue
            s = hm.targets(chunk, cache, z=z.view(hm.n_layers - 1, hm.Hkv), ratio=0.2)
            ((s - teacher) ** 2).mean().backward()
            if float(gates.log_a.grad.abs().max()) > 0 and float(gates.log_b.grad.abs().max()) > 0:
                found = True
                break
        self.assertTrue(found, "no distillation gradient reached log alpha and log beta")

    def test_direct_gates_train_and_stay_in_the_unit_interval(self):
        import hardkuma as hk

        _, gates, _ = self.run_steps(hk.DirectGates)
        self.assertTrue(bool(((gates.g >= 0) & (gates.g <= 1)).all()))

    def test_roles_file_has_the_loader_shape(self):
        from model import HybridModel
        from train_roles import model_dims, roles_json

        hm = HybridModel(tiny_llama(layers=3))
        mask = torch.tensor([True, False, False, True])
        j = json.loads(roles_json("tiny", model_dims(hm), mask.tolist(), {"steps": 1}))
        self.assertEqual(j["model"], "tiny")
        self.assertEqual(j["n_layers"], 3)
        self.assertEqual(j["n_kv_heads"], 2)
        self.assertEqual(j["roles"], [["retrieval", "retrieval"], ["retrieval", "sparse"],
                                      ["sparse", "retrieval"]])


class CharTokenizer:
    """A stand-in for the HF tokenizer PasskeyData calls: one id per byte, mod the vocabulary."""

    def __init__(self, vocab=64):
        self.vocab = vocab

    def __call__(self, s, add_special_tokens=False):
        return {"input_ids": [b % self.vocab for b in s.encode("utf-8")]}


@unittest.skipUnless(HAVE_TORCH, WHY)
class TrainScript(unittest.TestCase):
    def test_two_runs_in_parallel_then_merge(self):
        """train_roles.py end to end on a tiny model: two runs (as made in parallel on the GPU
        machine), then --merge chooses per method and writes the roles files and the record."""
        import tempfile

        import train_roles

        model = tiny_llama(seed=4, layers=4)
        train_roles.load_gguf = lambda path, dtype, device: (model, CharTokenizer())
        text = " ".join(f"verse {i} of the filler text with words like garden and river" for i in range(300))
        with tempfile.TemporaryDirectory() as tmp:
            fill = os.path.join(tmp, "filler")
            os.makedirs(fill)
            for name in ("kjv_train.txt", "kjv_eval.txt"):
                with open(os.path.join(fill, name), "w") as f:
                    f.write(text)
            common = ["--gguf", "tiny.gguf", "--filler-dir", fill, "--model-name", "tiny", "--target", "2",
                      "--steps", "3", "--min-len", "800", "--max-len", "1000", "--min-keys", "1",
                      "--max-keys", "1", "--eval-samples", "1", "--log-every", "1", "--dtype", "fp32",
                      "--device", "cpu", "--roles-name", "tiny"]
            train_roles.main(common + ["--out", os.path.join(tmp, "a"), "--runs", "hardkuma:0.01,hardkuma:0.1"])
            train_roles.main(common + ["--out", os.path.join(tmp, "b"), "--runs", "direct:0.01", "--no-baselines"])
            out = os.path.join(tmp, "out")
            train_roles.main(["--merge", os.path.join(tmp, "a"), os.path.join(tmp, "b"), "--out", out,
                              "--target", "2", "--roles-name", "tiny"])
            with open(os.path.join(out, "lycheedecode_train.json")) as f:
                rec = json.load(f)
            self.assertEqual(sorted(rec["methods"]), ["direct@0.01", "hardkuma@0.01", "hardkuma@0.1"])
            self.assertIn("baselines", rec)
            self.assertEqual(set(rec["chosen"]), {"hardkuma", "direct"})
            for name, res in rec["methods"].items():
                self.assertEqual(res["steps_done"], 3)
                self.assertEqual(res["history"]["step"], [0, 1, 2, 3])
                self.assertEqual(len(res["final_ez"]), 6)  # (4 - 1) layers x 2 KV heads
            with open(os.path.join(out, "lycheedecode_train.log")) as f:
                rows = [x.split() for x in f if not x.startswith("#")]
            self.assertEqual(len(rows), 9)  # 3 runs x 3 steps: run step loss lambda E[L0] ...
            for suffix in ("", ".direct"):
                with open(os.path.join(out, f"tiny{suffix}.json")) as f:
                    j = json.load(f)
                self.assertEqual(len(j["roles"]), 4)
                self.assertEqual(j["roles"][0], ["retrieval", "retrieval"])
                ez = j["training"]["E_z"]
                flat = [r == "retrieval" for row in j["roles"][1:] for r in row]
                self.assertEqual(flat, [x > 0.5 for x in ez])
                self.assertEqual(j["training"]["run"], rec["chosen"][j["training"]["method"]])


if __name__ == "__main__":
    if not HAVE_TORCH:
        print("SKIP:", WHY)
        sys.exit(77)
    unittest.main()
