#!/usr/bin/env python3
"""scripts/eval_plot.py: each point is the mean of its samples with one standard error, the
panels say how many samples, perplexity's bar goes through exp, and (with matplotlib) every
kind of results file draws.  python3 tests/python/test_eval_plot.py"""
import importlib.util
import json
import math
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("eval_plot", os.path.join(ROOT, "scripts", "eval_plot.py"))
ep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ep)


def close(a, b, tol=1e-12):
    assert abs(a - b) <= tol, (a, b)


def test_point():
    p = ep.Point([1.0, 2.0, 3.0, float("nan"), None])
    assert p.n == 3
    close(p.value, 2.0)
    se = math.sqrt(1.0 / 3.0)  # sample variance 1, three samples
    close(p.lo, 2.0 - se)
    close(p.hi, 2.0 + se)
    one = ep.Point([0.5])
    assert one.n == 1 and one.lo == one.hi == one.value == 0.5  # no bar from one sample
    ppl = ep.Point([1.0, 3.0], math.exp)  # mean NLL 2, standard error 1
    close(ppl.value, math.exp(2.0))
    close(ppl.lo, math.exp(1.0))
    close(ppl.hi, math.exp(3.0))
    assert ppl.yerr()[0] > 0 and ppl.yerr()[1] > ppl.yerr()[0]  # asymmetric through exp


def results():
    rs = []
    for s, (q, f) in enumerate([(0.5, 0.9), (0.7, 0.8), (0.6, 1.0)]):
        rs.append({"method": "quest:budget=64", "budget": 64, "length": 1024, "score": q,
                   "density": 0.1 + 0.01 * s, "kl_mean": 0.01 * (s + 1), "first_divergence": 10 + s,
                   "nll_mean": 2.0 + 0.1 * s, "recall": 0.9, "kl_windows": [0.01, 0.02 * (s + 1)]})
        rs.append({"method": "full", "budget": None, "length": 1024, "score": f, "density": 1.0,
                   "kl_mean": 0.0, "first_divergence": 1024, "nll_mean": 1.9, "recall": 1.0,
                   "kl_windows": [0.0, 0.0]})
    return rs


def test_grouped_and_counts():
    g = ep.grouped(results(), "score")
    q = g["quest"][1024][64]
    assert q.n == 3
    close(q.value, 0.6)
    full = g["full"][1024][None]
    close(full.value, 0.9)
    assert ep.sample_counts([q, full]) == " (n = 3 samples per point)"
    assert ep.sample_counts([ep.Point([1.0]), q]) == " (n = 1-3 samples per point)"
    assert ep.sample_counts([]) == ""


def test_plots_draw():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("test_eval_plot: matplotlib missing, drawing not tested")
        return
    with tempfile.TemporaryDirectory() as d:
        for kind in ["tasks", "ppl", "agree", "recall", "longgen"]:
            doc = {"kind": kind, "results": results(), "meta": {"model": "m", "window": 2}}
            src = os.path.join(d, f"{kind}.json")
            with open(src, "w") as f:
                json.dump(doc, f)
            out = os.path.join(d, f"{kind}.png")
            ep.plot(doc, out)
            assert os.path.getsize(out) > 10_000, kind


if __name__ == "__main__":
    test_point()
    test_grouped_and_counts()
    test_plots_draw()
    print("test_eval_plot: ok")
    sys.exit(0)
