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

lr_lambda is not given by the paper and decides whether the run lands on N_target: Adam moves
every unneeded gate down at its full rate whatever lambda is, so lambda keeps growing by
lr_lambda * (E[L0] - N_target) (up to ~70 a step from E[L0] = 79.75 at a = b = 1) until E[L0]
reaches the target; that wound-up lambda then pushes E[L0] below it, and a HardKuma gate pushed
to P(z != 0) ~ 0 is never sampled inside (0, 1) again, so it gets no distillation gradient and
stays off even after lambda falls back to 0 (likewise a gate pinned at z = 1). Too small a rate
stops above the target the same way. `--runs` takes one lr_lambda per run; runs can go in
parallel processes (`--out` each) and `--merge` combines them; per method, the run whose
rounded count is closest to N_target gives the roles file.

The committed run (SmolLM2-135M-Instruct; docs/lycheedecode.md) is in
docs/results/lycheedecode_train.json under "command" (four runs in parallel, then --merge).
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


def roles_json(model_name, dims, mask, extra):
    """The C++ loader's file (src/sparse/head_roles.cpp): `dims` = {arch, n_layers, n_heads,
    n_kv_heads, hidden}; `mask` = one bool per gated head (layers > 0), layer-major."""
    L, hkv = dims["n_layers"], dims["n_kv_heads"]
    mask = [bool(x) for x in mask]
    assert len(mask) == (L - 1) * hkv, (len(mask), L, hkv)
    roles = [["retrieval"] * hkv]
    roles += [["retrieval" if mask[l * hkv + h] else "sparse" for h in range(hkv)] for l in range(L - 1)]
    head = {"model": model_name, "arch": dims.get("arch", "llama"), "n_layers": L,
            "n_heads": dims["n_heads"], "n_kv_heads": hkv, "hidden": dims["hidden"]}
    lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    lines.append('  "roles": [')
    lines += [f"    {json.dumps(r)}{',' if i + 1 < len(roles) else ''}" for i, r in enumerate(roles)]
    lines.append("  ],")
    lines.append(f'  "training": {json.dumps(extra)}')
    lines.append("}")
    return "\n".join(lines) + "\n"


def model_dims(hm):
    cfg = hm.hf.config
    return {"arch": getattr(cfg, "model_type", "llama"), "n_layers": hm.n_layers, "n_heads": hm.Hq,
            "n_kv_heads": hm.Hkv, "hidden": cfg.hidden_size}


def load_gguf(path, dtype, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dtype)
    return model.to(device).eval(), tok


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", help="model GGUF (transformers + gguf package)")
    ap.add_argument("--model-name", default="SmolLM2-135M-Instruct")
    ap.add_argument("--filler-dir", help="kjv_train.txt / kjv_eval.txt (make_filler.sh)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", default="hardkuma,direct",
                    help="comma list of METHOD[:LAMBDA_LR], METHOD = hardkuma | direct")
    ap.add_argument("--merge", nargs="+", metavar="DIR",
                    help="no training: combine the records (lycheedecode_train.json/.log) of runs "
                         "made in parallel into --out, then choose, write the roles files and plot")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--target", type=float, default=9, help="N_target: retrieval heads among layers > 0")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--lambda-init", type=float, default=0.0)
    ap.add_argument("--lambda-lr", type=float, default=0.001)
    ap.add_argument("--ratio", type=float, default=0.3, help="kept fraction of the visible tokens")
    ap.add_argument("--budget", type=int, default=0, help="fixed tokens per sparse head (0: ratio)")
    ap.add_argument("--refresh", default="gate", choices=["gate", "always"])
    ap.add_argument("--min-len", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=7680)
    ap.add_argument("--min-keys", type=int, default=2)
    ap.add_argument("--max-keys", type=int, default=4)
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--no-baselines", action="store_true", help="skip the random / layer-0-only evals")
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--device", default=None, help="cuda when available, else cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=0, help="seconds per method (0: none)")
    ap.add_argument("--roles-name", default="smollm2-135m-instruct")
    args = ap.parse_args(argv)
    if not args.merge and not (args.gguf and args.filler_dir):
        ap.error("--gguf and --filler-dir are required unless --merge")
    return args


def train(args):
    from data import PasskeyData

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    t0 = time.time()
    model, tok = load_gguf(args.gguf, dtype, args.device)
    print(f"loaded {args.gguf} in {time.time() - t0:.1f}s on {args.device} "
          f"({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'})", flush=True)
    hm = HybridModel(model)
    def read(name):
        with open(os.path.join(args.filler_dir, name), encoding="utf-8") as f:
            return f.read()

    eval_data = PasskeyData(tok, read("kjv_eval.txt"), seed=10_000 + args.seed)
    eval_samples = [eval_data.batch(args.min_len, args.max_len, args.min_keys, args.max_keys)[:2]
                    for _ in range(args.eval_samples)]
    record = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "args": vars(args), "model": args.model_name, "dims": model_dims(hm),
              "n_layers": hm.n_layers, "n_kv_heads": hm.Hkv, "n_gates": hm.n_gates,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "methods": {}}
    logf = open(os.path.join(args.out, "lycheedecode_train.log"), "w")
    logf.write(f"# {record['command']}\n# run step distill_loss lambda E[L0] n(E[z]>0.5) prompt_len seconds\n")
    n_top = int(round(args.target))
    for run in [r for r in args.runs.split(",") if r]:
        method, _, lam_lr = run.partition(":")
        lam_lr = float(lam_lr) if lam_lr else args.lambda_lr
        name = f"{method}@{lam_lr:g}"
        torch.manual_seed(args.seed)
        data = PasskeyData(tok, read("kjv_train.txt"), seed=args.seed)
        gates = (HardKumaGates(hm.n_gates) if method == "hardkuma" else DirectGates(hm.n_gates)).to(args.device)
        tr = Trainer(hm, gates, args.target, lr=args.lr, lambda_init=args.lambda_init,
                     lambda_lr=lam_lr, ratio=args.ratio, budget=args.budget,
                     refresh=args.refresh, device=args.device)
        t1 = time.time()
        tr.log(0, float("nan"), float(gates.expected_l0().detach()), tr.lam, 0.0)
        step = 0
        for step in range(1, args.steps + 1):
            prompt, target, _ = data.batch(args.min_len, args.max_len, args.min_keys, args.max_keys)
            loss, el0, lam = tr.step(prompt, target)
            el = time.time() - t1
            line = (f"{step} {loss:.6f} {lam:.5f} {el0:.3f} "
                    f"{int((gates.expectation() > 0.5).sum())} {len(prompt)} {el:.1f}")
            logf.write(f"{name} {line}\n")
            last = args.time_limit and el > args.time_limit
            if step % args.log_every == 0 or step == args.steps or last:
                tr.log(step, loss, el0, lam, el)
                logf.flush()
                print(f"[{name}] {line}", flush=True)
            if last:
                print(f"[{name}] time limit after {step} steps", flush=True)
                break
        ez = gates.expectation().cpu()
        mask = ez > 0.5
        res = {"method": method, "lambda_lr": lam_lr, "steps_done": step,
               "train_seconds": round(time.time() - t1, 1), "history": tr.history,
               "final_ez": [round(float(x), 4) for x in ez], "n_retrieval_gated": int(mask.sum()),
               "final_el0": float(gates.expected_l0().detach()), "final_lambda": tr.lam,
               "ambiguous_heads_0.2_0.8": int(((ez > 0.2) & (ez < 0.8)).sum())}
        if method == "hardkuma":
            from hardkuma import p_nonzero, p_one

            a, b = gates.ab()
            res["alpha"] = [round(float(x), 4) for x in a]
            res["beta"] = [round(float(x), 4) for x in b]
            # near-binary: mass of the HardKuma distributions exactly at 0 or 1
            p0 = 1 - p_nonzero(a.double(), b.double())
            res["mass_at_0_or_1_mean"] = float((p0 + p_one(a.double(), b.double())).mean())
        res["eval"] = {"rounded": tr.evaluate(eval_samples, mask)}
        top = torch.zeros_like(mask)
        top[torch.topk(ez, n_top).indices] = True
        if int(mask.sum()) != n_top:
            res["eval"][f"top{n_top}"] = tr.evaluate(eval_samples, top)
        record["methods"][name] = res
        print(f"[{name}] retrieval heads (layers > 0): {int(mask.sum())}, E[L0] {res['final_el0']:.2f}, "
              f"eval {json.dumps(res['eval'])}", flush=True)
    logf.close()
    if not args.no_baselines:
        # Baselines at the same count: random roles, and no retrieval head after layer 0.
        g = torch.Generator().manual_seed(args.seed)
        rnd = torch.zeros(hm.n_gates, dtype=torch.bool)
        rnd[torch.randperm(hm.n_gates, generator=g)[:n_top]] = True
        tr = Trainer(hm, DirectGates(hm.n_gates), args.target, ratio=args.ratio, budget=args.budget,
                     device=args.device)
        record["baselines"] = {f"random{n_top}": tr.evaluate(eval_samples, rnd),
                               "layer0_only": tr.evaluate(eval_samples, torch.zeros(hm.n_gates, dtype=torch.bool))}
        print("baselines", json.dumps(record["baselines"]), flush=True)
    record["total_seconds"] = round(time.time() - t0, 1)
    return record


def finalize(record, out, target, roles_name, log_name="docs/results/lycheedecode_train.{json,log}"):
    """Per method, the run whose rounded count is closest to N_target (then the lower held-out
    distillation loss) gives the roles file; writes the record and the plot."""
    n_top = int(round(target))
    chosen = {}
    for name, res in record["methods"].items():
        key = (abs(res["n_retrieval_gated"] - target), res["eval"]["rounded"]["distill_loss"])
        if res["method"] not in chosen or key < chosen[res["method"]][0]:
            chosen[res["method"]] = (key, name)
    masks = {}
    for method, (_, name) in chosen.items():
        res = record["methods"][name]
        ez = res["final_ez"]
        masks[method] = [x > 0.5 for x in ez]
        extra = {"method": method, "run": name, "lambda_lr": res["lambda_lr"], "n_target": target,
                 "steps": res["steps_done"], "E_L0": round(res["final_el0"], 3),
                 "final_lambda": round(res["final_lambda"], 4),
                 "rule": "retrieval iff E[z] > 0.5" if method == "hardkuma" else "retrieval iff g > 0.5",
                 "E_z": ez, "eval": res["eval"]["rounded"], "device": record.get("device"),
                 "command": record["command"], "log": log_name}
        suffix = "" if method == "hardkuma" else f".{method}"
        with open(os.path.join(out, f"{roles_name}{suffix}.json"), "w") as f:
            f.write(roles_json(record["model"], record["dims"], masks[method], extra))
        if method == "hardkuma" and sum(masks[method]) != n_top:
            order = sorted(range(len(ez)), key=lambda i: -ez[i])[:n_top]
            top = [i in order for i in range(len(ez))]
            extra = dict(extra, rule=f"the {n_top} largest E[z] (not the paper's rule)",
                         eval=res["eval"].get(f"top{n_top}"))
            with open(os.path.join(out, f"{roles_name}.top{n_top}.json"), "w") as f:
                f.write(roles_json(record["model"], record["dims"], top, extra))
    record["chosen"] = {m: n for m, (_, n) in chosen.items()}
    if "hardkuma" in masks and "direct" in masks:
        record["overlap_hardkuma_direct_rounded"] = sum(
            a and b for a, b in zip(masks["hardkuma"], masks["direct"]))
    with open(os.path.join(out, "lycheedecode_train.json"), "w") as f:
        json.dump(record, f)
    for m, (_, name) in chosen.items():
        res = record["methods"][name]
        print(f"chosen {m}: {name}, {res['n_retrieval_gated']} heads, E[L0] {res['final_el0']:.2f}, "
              f"eval {json.dumps(res['eval'])}", flush=True)
    try:
        from plot import plot

        plot(record, os.path.join(out, "lycheedecode_heads.png"))
    except Exception as e:  # plotting is optional (matplotlib)
        print("plot skipped:", e)


def merge(dirs, out):
    """Records of runs made in parallel (one process per run) -> one record and one log."""
    os.makedirs(out, exist_ok=True)
    record, log = None, []
    for d in dirs:
        if not os.path.exists(os.path.join(d, "lycheedecode_train.json")):
            print(f"merge: {d} has no record (run killed?), left out", flush=True)
            continue
        with open(os.path.join(d, "lycheedecode_train.json")) as f:
            r = json.load(f)
        with open(os.path.join(d, "lycheedecode_train.log")) as f:
            log += f.read().splitlines()
        if record is None:
            record = dict(r, methods={}, commands=[])
        record["commands"].append(r["command"])
        record["methods"].update(r["methods"])
        if "baselines" in r:
            record["baselines"] = r["baselines"]
        record["total_seconds"] = max(record.get("total_seconds", 0), r.get("total_seconds", 0))
    record["command"] = " & ".join(record["commands"]) + "; wait"
    record["args"].pop("runs", None)
    with open(os.path.join(out, "lycheedecode_train.log"), "w") as f:
        f.write("\n".join(["# " + c for c in record["commands"]] + [next(x for x in log if x.startswith("# run"))] +
                          [x for x in log if not x.startswith("#")]) + "\n")
    return record


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    if args.merge:
        record = merge(args.merge, args.out)
    else:
        record = train(args)
    finalize(record, args.out, args.target, args.roles_name)
    print(f"done in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
