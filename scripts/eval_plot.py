#!/usr/bin/env python3
"""Plots of `spade eval` results (docs/eval.md): one PNG per JSON file.

  tasks:  mean score vs budget per method, one panel per length (methods without a budget
          are horizontal lines), and density vs length per method
  ppl:    perplexity vs budget per method, one panel per prefix length
  agree:  mean KL(full || method) and tokens until first divergence vs budget
  recall: recall vs budget per method, one panel per prefix length, and density vs length
  longgen: KL and tokens until first divergence vs budget per generated length, and the KL
          along the generation (the per-window means, averaged over samples) per method

Every point is the mean over the samples of its (method, length, budget) with an error bar of
one standard error of that mean (none with one sample); each panel's title gives the samples
per point.

Usage: python3 scripts/eval_plot.py RESULTS.json [OUT.png]   (needs python3-matplotlib)
"""
import json
import math
import sys
from collections import OrderedDict, defaultdict


def finite(xs):
    return [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]


def mean(xs):
    xs = finite(xs)
    return sum(xs) / len(xs) if xs else float("nan")


class Point:
    """The mean of a point's samples, the ends of its error bar (mean -/+ one standard error,
    through `transform` when one is given: perplexity = exp(mean NLL)), and the sample count."""

    def __init__(self, xs, transform=None):
        xs = finite(xs)
        self.n = len(xs)
        m = mean(xs)
        se = 0.0
        if self.n >= 2:
            var = sum((x - m) ** 2 for x in xs) / (self.n - 1)
            se = math.sqrt(var / self.n)
        f = transform or (lambda v: v)
        self.value, self.lo, self.hi = f(m), f(m - se), f(m + se)

    def yerr(self):
        return [self.value - self.lo, self.hi - self.value]


def grouped(results, field, transform=None):
    """{method_name: {length: {budget: Point}}}, budget None for budget-less methods; methods
    keyed by their label without the budget."""
    acc = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in results:
        if field not in r:
            continue
        label = strip_budget(r)
        acc[label][r["length"]][r.get("budget")].append(r[field])
    out = OrderedDict()
    for label, by_len in acc.items():
        out[label] = {L: {b: Point(v, transform) for b, v in bb.items()} for L, bb in by_len.items()}
    return out


def sample_counts(points):
    """' (n = 3 samples per point)' or ' (n = 2-5 ...)' over the points drawn."""
    ns = sorted({p.n for p in points})
    if not ns:
        return ""
    span = str(ns[0]) if ns[0] == ns[-1] else f"{ns[0]}-{ns[-1]}"
    return f" (n = {span} sample{'s' if ns[-1] != 1 else ''} per point)"


COLORS = {}


def color(group):
    """One color per method (budget stripped), the same in every panel."""
    if group not in COLORS:
        COLORS[group] = f"C{len(COLORS) % 10}"
    return COLORS[group]


def strip_budget(r):
    label = r["method"]
    if r.get("budget") is not None:
        label = label.replace(f":budget={r['budget']}", "").replace(f",budget={r['budget']}", "")
    return label


def panel_vs_budget(ax, data, length, ylabel, title):
    budgets = sorted({b for m in data.values() for b in m.get(length, {}) if b is not None})
    drawn = []
    for label, by_len in data.items():
        pts = by_len.get(length, {})
        if None in pts:
            p = pts[None]
            ax.axhline(p.value, linestyle="--", linewidth=1.2, color=color(label), label=label)
            if p.hi > p.lo:
                ax.axhspan(p.lo, p.hi, color=color(label), alpha=0.12)
            drawn.append(p)
        xs = [b for b in budgets if b in pts]
        if xs:
            ps = [pts[b] for b in xs]
            ax.errorbar(xs, [p.value for p in ps], yerr=list(zip(*[p.yerr() for p in ps])),
                        marker="o", capsize=3, color=color(label), label=label)
            drawn += ps
    title += sample_counts(drawn)
    if budgets:
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets)
        ax.set_xticklabels([str(b) for b in budgets])
    ax.set_xlabel("budget (tokens per KV head)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)


def panel_vs_length(ax, results, field, ylabel, title):
    """One line per method and budget: the method's color, a marker / line style per budget."""
    acc = defaultdict(lambda: defaultdict(list))
    for r in results:
        if field in r:
            acc[(strip_budget(r), r.get("budget"))][r["length"]].append(r[field])
    budgets = sorted({b for (_, b) in acc if b is not None})
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-.")]
    drawn = []
    for (group, b), by_len in acc.items():
        xs = sorted(by_len)
        mk, ls = styles[budgets.index(b) % len(styles)] if b is not None else ("x", "-")
        ps = [Point(by_len[x]) for x in xs]
        ax.errorbar(xs, [p.value for p in ps], yerr=list(zip(*[p.yerr() for p in ps])), marker=mk,
                    linestyle=ls, capsize=3, color=color(group),
                    label=f"{group} {b}" if b is not None else group)
        drawn += ps
    title += sample_counts(drawn)
    if budgets:
        title += "\n(budgets: " + ", ".join(
            f"{b} {styles[i % len(styles)][0]}{styles[i % len(styles)][1]}" for i, b in enumerate(budgets)) + ")"
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)


def panel_drift(ax, rs, window):
    """longgen: mean KL per window of generated tokens, per method (longest generation)."""
    longest = max(r["length"] for r in rs)
    acc = defaultdict(list)
    for r in rs:
        if r["length"] == longest and r.get("kl_windows"):
            acc[r["method"]].append((strip_budget(r), r["kl_windows"]))
    steps = longest - 1  # teacher-forced steps after the prefill's
    for label, runs in acc.items():
        n = min(len(w) for _, w in runs)
        ps = [Point([w[i] for _, w in runs]) for i in range(n)]
        xs = [(i * window + min(steps, (i + 1) * window)) / 2 for i in range(n)]
        ax.plot(xs, [p.value for p in ps], marker=".", label=label, color=color(runs[0][0]))
        if any(p.hi > p.lo for p in ps):
            ax.fill_between(xs, [p.lo for p in ps], [p.hi for p in ps], color=color(runs[0][0]),
                            alpha=0.15)
    ax.set_xlabel("generated token")
    ax.set_ylabel(f"KL(full || method), mean per {window} tokens")
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.set_title(f"KL along the generation ({longest} tokens, {len(next(iter(acc.values()), []))} "
                 "samples; band: one standard error)")
    ax.grid(alpha=0.3)


def plot(doc, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kind, rs = doc["kind"], doc["results"]
    lengths = sorted({r["length"] for r in rs})
    if kind == "tasks":
        data = grouped(rs, "score")
        specs = [(data, L, "mean score", f"score vs budget, length {L}") for L in lengths]
        extra = ("density", "density", "density vs length")
    elif kind == "ppl":
        data = grouped(rs, "nll_mean", math.exp)
        specs = [(data, L, "perplexity", f"perplexity vs budget, prefix {L}") for L in lengths]
        extra = ("density", "density", "density vs length")
    elif kind == "agree":
        kl = grouped(rs, "kl_mean")
        div = grouped(rs, "first_divergence")
        specs = [(kl, L, "mean KL(full || method)", f"KL vs budget, length {L}") for L in lengths]
        specs += [(div, L, "tokens to first divergence", f"divergence vs budget, length {L}")
                  for L in lengths]
        extra = None
    elif kind == "longgen":
        kl = grouped(rs, "kl_mean")
        div = grouped(rs, "first_divergence")
        specs = [(kl, L, "mean KL(full || method)", f"KL vs budget, {L} tokens") for L in lengths]
        specs += [(div, L, "tokens to first divergence", f"divergence vs budget, {L} tokens")
                  for L in lengths]
        extra = "drift"
    else:
        data = grouped(rs, "recall")
        specs = [(data, L, "attention recall", f"recall vs budget, prefix {L}") for L in lengths]
        extra = ("density", "density", "density vs length")
    n = len(specs) + (1 if extra else 0)
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.5 * rows), squeeze=False)
    flat = [a for row in axes for a in row]
    for ax, (d, L, yl, t) in zip(flat, specs):
        panel_vs_budget(ax, d, L, yl, t)
    if extra == "drift":
        panel_drift(flat[len(specs)], rs, doc.get("meta", {}).get("window", 256))
    elif extra:
        panel_vs_length(flat[len(specs)], rs, *extra)
    for ax in flat[n:]:
        ax.axis("off")
    handles, labels = flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, max(1, len(labels))), fontsize=8)
    meta = doc.get("meta", {})
    fig.suptitle(f"spade eval {kind}: {meta.get('model', '')} ({meta.get('machine', '')})", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 0.96))
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    src = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else src.rsplit(".json", 1)[0] + ".png"
    with open(src) as f:
        doc = json.load(f)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("eval_plot: python3-matplotlib is missing (apt-get install python3-matplotlib)",
              file=sys.stderr)
        return 1
    plot(doc, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
