#!/usr/bin/env python3
"""Figure 7 of the paper for our run: the probability that each gated head (layer > 0, KV
head) is a retrieval head over training steps, for direct optimization (continuous gate g)
and HardKuma (E[z]), plus the distillation loss, lambda and E[L0] curves.

Usage: python3 python/lycheedecode/plot.py lycheedecode_train.json lycheedecode_heads.png
"""
import json
import sys


def plot(record, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    chosen = record.get("chosen", {})
    methods = [chosen[m] for m in ("direct", "hardkuma") if m in chosen]
    runs = list(record["methods"])
    hkv = record["n_kv_heads"]
    fig, axes = plt.subplots(2, max(2, len(methods)), figsize=(13, 10),
                             gridspec_kw={"height_ratios": [3, 1]})
    titles = {"direct": "Direct optimization: gate g", "hardkuma": "HardKuma: E[z]"}
    for i, m in enumerate(methods):
        h = record["methods"][m]["history"]
        ez = np.array(h["ez"]).T  # [heads, logged steps]
        ax = axes[0, i]
        im = ax.imshow(ez, aspect="auto", cmap="coolwarm", vmin=0, vmax=1, interpolation="nearest",
                       extent=[h["step"][0], h["step"][-1], ez.shape[0] - 0.5, -0.5])
        ax.set_title(f"{titles[record['methods'][m]['method']]} [{m}]\n"
                     f"(> 0.5: {record['methods'][m]['n_retrieval_gated']} heads)", fontsize=10)
        ax.set_xlabel("step")
        ticks = list(range(0, ez.shape[0], hkv * 2))
        ax.set_yticks(ticks)
        ax.set_yticklabels([f"L{t // hkv + 1}H{t % hkv}" for t in ticks], fontsize=7)
        fig.colorbar(im, ax=ax, fraction=0.04)
    ax = axes[1, 0]
    for m in runs:
        h = record["methods"][m]["history"]
        ax.plot(h["step"][1:], h["loss"][1:], label=f"{m} distill loss", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.legend(fontsize=8)
    ax = axes[1, 1]
    ax2 = ax.twinx()
    for m in runs:
        h = record["methods"][m]["history"]
        line, = ax.plot(h["step"], h["el0"], label=f"{m} E[L0]")
        ax2.plot(h["step"], h["lambda"], "--", color=line.get_color(), label=f"{m} lambda")
    ax.axhline(record["args"]["target"], color="k", lw=0.5)
    ax.set_xlabel("step")
    ax.legend(fontsize=8, loc="upper left")
    ax2.legend(fontsize=7, loc="upper right")
    ax2.set_ylabel("lambda (dashed)")
    fig.suptitle(f"{record['model']}: head specialization ({record['n_gates']} gated KV heads, "
                 f"N_target = {record['args']['target']:g})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    plot(json.load(open(sys.argv[1])), sys.argv[2])
