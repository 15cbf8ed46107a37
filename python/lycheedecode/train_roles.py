#!/usr/bin/env python3
"""Head-role training for LycheeDecode (section 3.2, appendices A and F; docs/lycheedecode.md).

Per (layer > 0, KV head) a gate z: HardKuma(a, b) (a = b = 1 at start) or, for the
comparison, a continuous gate g in [0, 1] ("direct optimization", DuoAttention style).
The student mixes full and sparse attention z * A_full + (1 - z) * A_sparse (model.py) over
the target chunk of passkey-retrieval samples (data.py) conditioned on the teacher's dense
prompt cache; loss = distillation (squared logit error vs the dense teacher on the target
tokens, eq. 6, averaged over tokens and vocabulary) + lambda * (E[L0] - N_target) (eq. 7,
E[L0] in closed form, eq. 8). (a, b) by Adam (lr 0.01), lambda by projected gradient ascent:
lambda <- max(0, lambda + lr_lambda * (E[L0] - N_target)). Role: retrieval iff E[z] > 0.5.

Example (SmolLM2-135M-Instruct, the committed run; see docs/lycheedecode.md):
  python3 python/lycheedecode/train_roles.py --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --filler-dir .stage/filler --out /tmp/out --methods hardkuma,direct --steps 300
"""
import argparse
import json
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hardkuma import DirectGates, HardKumaGates  # noqa: E402
from model import HybridModel  # noqa: E402


def distill_loss(student, teacher):
    """Eq. 6 divided by (target tokens x vocabulary): the mean squared logit error."""
    return ((student - teacher) ** 2).mean()


class Trainer:
    """One gate family on one model; `sample_fn()` -> (prompt ids, target ids)."""

    def __init__(self, hm, gates, n_target, lr=0.01, lambda_init=0.0, lambda_lr=0.01,
                 ratio=0.3, budget=0, refresh="gate", device="cpu"):
        self.hm, self.gates = hm, gates
        self.n_target = float(n_target)
        self.lam = float(lambda_init)
        self.lambda_lr = lambda_lr
        self.ratio, self.budget, self.refresh = ratio, budget, refresh
        self.device = device
        self.opt = torch.optim.Adam(gates.parameters(), lr=lr)
        self.history = {"step": [], "loss": [], "lambda": [], "el0": [], "ez": [], "n_retrieval": [],
                        "seconds": []}

    def chunk(self, prompt, target):
        """Cache = prompt[:-1]; chunk = prompt[-1:] + target[:-1] predicts the target."""
        ids = torch.tensor([prompt + target], device=self.device)
        P = len(prompt)
        return ids[:, :P - 1], ids[:, P - 1:-1]

    def step(self, prompt, target):
        pre, chunk = self.chunk(prompt, target)
        cache = self.hm.prefill(pre)
        with torch.no_grad():
            teacher = self.hm.targets(chunk, cache)
        z = self.gates.sample().view(self.hm.n_layers - 1, self.hm.Hkv)
        student = self.hm.targets(chunk, cache, z=z, ratio=self.ratio, budget=self.budget,
                                  refresh=self.refresh)
        dl = distill_loss(student, teacher)
        el0 = self.gates.expected_l0()
        loss = dl + self.lam * (el0 - self.n_target)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        if hasattr(self.gates, "project"):
            self.gates.project()
        violation = float(el0.detach()) - self.n_target
        lam_used = self.lam
        self.lam = max(0.0, self.lam + self.lambda_lr * violation)  # gradient ascent on lambda
        return float(dl.detach()), float(el0.detach()), lam_used

    def log(self, step, loss, el0, lam, seconds):
        ez = self.gates.expectation().cpu()
        h = self.history
        h["step"].append(step)
        h["loss"].append(round(loss, 6))
        h["lambda"].append(round(lam, 6))
        h["el0"].append(round(el0, 4))
        h["ez"].append([round(float(x), 4) for x in ez])
        h["n_retrieval"].append(int((ez > 0.5).sum()))
        h["seconds"].append(round(seconds, 2))

    @torch.no_grad()
    def evaluate(self, samples, roles_mask):
        """Deterministic roles (z in {0, 1}) on held-out samples: mean distillation loss,
        greedy agreement with the teacher and target-token accuracy of both."""
        z = roles_mask.float().view(self.hm.n_layers - 1, self.hm.Hkv).to(self.device)
        tot = {"loss": 0.0, "agree": 0, "acc_student": 0, "acc_teacher": 0, "tokens": 0}
        for prompt, target in samples:
            pre, chunk = self.chunk(prompt, target)
            cache = self.hm.prefill(pre)
            t = self.hm.targets(chunk, cache)
            s = self.hm.targets(chunk, cache, z=z, ratio=self.ratio, budget=self.budget,
                                refresh="gate")
            tgt = torch.tensor(target, device=self.device)
            tot["loss"] += float(distill_loss(s, t))
            tot["agree"] += int((s.argmax(-1)[0] == t.argmax(-1)[0]).sum())
            tot["acc_student"] += int((s.argmax(-1)[0] == tgt).sum())
            tot["acc_teacher"] += int((t.argmax(-1)[0] == tgt).sum())
            tot["tokens"] += len(target)
        n = max(1, len(samples))
        return {"distill_loss": tot["loss"] / n, "greedy_agreement": tot["agree"] / tot["tokens"],
                "target_acc_student": tot["acc_student"] / tot["tokens"],
                "target_acc_teacher": tot["acc_teacher"] / tot["tokens"],
                "retrieval_heads_gated": int(roles_mask.sum()), "samples": len(samples)}


def roles_json(model_name, hm, mask, extra):
    roles = [["retrieval"] * hm.Hkv]
    m = mask.view(hm.n_layers - 1, hm.Hkv).tolist()
    roles += [["retrieval" if r else "sparse" for r in row] for row in m]
    cfg = hm.hf.config
    head = {"model": model_name, "arch": getattr(cfg, "model_type", "llama"),
            "n_layers": hm.n_layers, "n_heads": hm.Hq, "n_kv_heads": hm.Hkv,
            "hidden": cfg.hidden_size}
    lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    lines.append('  "roles": [')
    lines += [f"    {json.dumps(r)}{',' if i + 1 < len(roles) else ''}" for i, r in enumerate(roles)]
    lines.append("  ],")
    lines.append(f'  "training": {json.dumps(extra)}')
    lines.append("}")
    return "\n".join(lines) + "\n"


def load_gguf(path, dtype, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dtype)
    return model.to(device).eval(), tok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, help="model GGUF (transformers + gguf package)")
    ap.add_argument("--model-name", default="SmolLM2-135M-Instruct")
    ap.add_argument("--filler-dir", required=True, help="kjv_train.txt / kjv_eval.txt (make_filler.sh)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--methods", default="hardkuma,direct")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--target", type=float, default=9, help="N_target: retrieval heads among layers > 0")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--lambda-init", type=float, default=0.0)
    ap.add_argument("--lambda-lr", type=float, default=0.01)
    ap.add_argument("--ratio", type=float, default=0.3, help="kept fraction of the visible tokens")
    ap.add_argument("--budget", type=int, default=0, help="fixed tokens per sparse head (0: ratio)")
    ap.add_argument("--refresh", default="gate", choices=["gate", "always"])
    ap.add_argument("--min-len", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=7680)
    ap.add_argument("--min-keys", type=int, default=2)
    ap.add_argument("--max-keys", type=int, default=4)
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=0, help="seconds per method (0: none)")
    ap.add_argument("--roles-name", default="smollm2-135m-instruct")
    args = ap.parse_args(argv)

    from data import PasskeyData

    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    t0 = time.time()
    model, tok = load_gguf(args.gguf, dtype, args.device)
    print(f"loaded {args.gguf} in {time.time() - t0:.1f}s on {args.device} "
          f"({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'})", flush=True)
    hm = HybridModel(model)
    read = lambda f: open(os.path.join(args.filler_dir, f), encoding="utf-8").read()  # noqa: E731
    eval_data = PasskeyData(tok, read("kjv_eval.txt"), seed=10_000 + args.seed)
    eval_samples = [eval_data.batch(args.min_len, args.max_len, args.min_keys, args.max_keys)[:2]
                    for _ in range(args.eval_samples)]
    record = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "args": vars(args), "model": args.model_name,
              "n_layers": hm.n_layers, "n_kv_heads": hm.Hkv, "n_gates": hm.n_gates,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "methods": {}}
    masks = {}
    for method in [m for m in args.methods.split(",") if m]:
        torch.manual_seed(args.seed)
        data = PasskeyData(tok, read("kjv_train.txt"), seed=args.seed)
        gates = (HardKumaGates(hm.n_gates) if method == "hardkuma" else DirectGates(hm.n_gates)).to(args.device)
        tr = Trainer(hm, gates, args.target, lr=args.lr, lambda_init=args.lambda_init,
                     lambda_lr=args.lambda_lr, ratio=args.ratio, budget=args.budget,
                     refresh=args.refresh, device=args.device)
        logf = open(os.path.join(args.out, f"lycheedecode_train_{method}.log"), "w")
        logf.write(f"# {record['command']}\n# step distill_loss lambda E[L0] n(E[z]>0.5) prompt_len seconds\n")
        t1 = time.time()
        tr.log(0, float("nan"), float(gates.expected_l0()), tr.lam, 0.0)
        step = 0
        for step in range(1, args.steps + 1):
            prompt, target, _ = data.batch(args.min_len, args.max_len, args.min_keys, args.max_keys)
            loss, el0, lam = tr.step(prompt, target)
            el = time.time() - t1
            line = (f"{step} {loss:.6f} {lam:.5f} {el0:.3f} "
                    f"{int((gates.expectation() > 0.5).sum())} {len(prompt)} {el:.1f}")
            logf.write(line + "\n")
            if step % args.log_every == 0 or step == args.steps:
                tr.log(step, loss, el0, lam, el)
                logf.flush()
                print(f"[{method}] {line}", flush=True)
            if args.time_limit and el > args.time_limit:
                print(f"[{method}] time limit after {step} steps", flush=True)
                tr.log(step, loss, el0, lam, el)
                break
        logf.close()
        ez = gates.expectation().cpu()
        mask = ez > 0.5
        res = {"steps_done": step, "train_seconds": round(time.time() - t1, 1), "history": tr.history,
               "final_ez": [round(float(x), 4) for x in ez], "n_retrieval_gated": int(mask.sum()),
               "final_el0": float(gates.expected_l0()), "final_lambda": tr.lam}
        if method == "hardkuma":
            a, b = gates.ab()
            res["alpha"] = [round(float(x), 4) for x in a]
            res["beta"] = [round(float(x), 4) for x in b]
            # near-binary: mass of the HardKuma distribution at exactly 0 or 1
            from hardkuma import p_nonzero, p_one
            p0 = 1 - p_nonzero(a.double(), b.double())
            p1 = p_one(a.double(), b.double())
            res["mass_at_0_or_1_mean"] = float((p0 + p1).mean())
        masks[method] = mask
        res["eval"] = {"rounded": tr.evaluate(eval_samples, mask)}
        n_top = int(round(args.target))
        top = torch.zeros_like(mask)
        top[torch.topk(ez, n_top).indices] = True
        if int(mask.sum()) != n_top:
            res["eval"][f"top{n_top}"] = tr.evaluate(eval_samples, top)
        masks[method + "_top"] = top
        res["ambiguous_heads_0.2_0.8"] = int(((ez > 0.2) & (ez < 0.8)).sum())
        record["methods"][method] = res
        extra = {"method": method, "n_target": args.target, "steps": step, "E_L0": round(res["final_el0"], 3),
                 "rule": "retrieval iff E[z] > 0.5" if method == "hardkuma" else "retrieval iff g > 0.5",
                 "E_z": res["final_ez"], "command": record["command"],
                 "log": "docs/results/lycheedecode_train.json"}
        suffix = "" if method == "hardkuma" else f".{method}"
        with open(os.path.join(args.out, f"{args.roles_name}{suffix}.json"), "w") as f:
            f.write(roles_json(args.model_name, hm, mask, extra))
        print(f"[{method}] retrieval heads (layers > 0): {int(mask.sum())}, E[L0] {res['final_el0']:.2f}, "
              f"eval {json.dumps(res['eval'])}", flush=True)
    # Baselines at the same count: random roles, and no retrieval head after layer 0.
    n_top = int(round(args.target))
    g = torch.Generator().manual_seed(args.seed)
    rnd = torch.zeros(hm.n_gates, dtype=torch.bool)
    rnd[torch.randperm(hm.n_gates, generator=g)[:n_top]] = True
    tr = Trainer(hm, DirectGates(hm.n_gates), args.target, ratio=args.ratio, budget=args.budget,
                 device=args.device)
    record["baselines"] = {f"random{n_top}": tr.evaluate(eval_samples, rnd),
                           "layer0_only": tr.evaluate(eval_samples, torch.zeros(hm.n_gates, dtype=torch.bool))}
    if "hardkuma" in masks and "direct" in masks:
        record["overlap_hardkuma_direct_rounded"] = int((masks["hardkuma"] & masks["direct"]).sum())
    record["total_seconds"] = round(time.time() - t0, 1)
    with open(os.path.join(args.out, "lycheedecode_train.json"), "w") as f:
        json.dump(record, f)
    print("baselines", json.dumps(record["baselines"]), flush=True)
    try:
        from plot import plot

        plot(record, os.path.join(args.out, "lycheedecode_heads.png"))
    except Exception as e:  # plotting is optional (matplotlib)
        print("plot skipped:", e)
    print(f"done in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
