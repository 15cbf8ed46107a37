#!/usr/bin/env python3
"""The programmatic-dependent-launch contract of src/backend/cuda/pdl.cuh, checked on the source.

A kernel launched with launch_pdl may start while the kernel before it still runs; only its
pdl_begin() (griddepcontrol.wait) orders it after that kernel. A kernel launched that way without
pdl_begin(), or with a `return` that some CTA can reach before it, races with the kernel before
it (and lets the kernel after it run ahead of both): wrong results that no GPU-less CI run can
see. So for every launch_pdl call under src/backend/cuda this checks that the launched kernel
(named directly, or passed to a local `auto go = [&](auto kernel)` launcher) is a __global__
function whose body calls pdl_begin() before its first `return`. Exit 0 when every launch
complies, 1 with the offenders listed, 2 when a launch's kernel cannot be found.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "backend" / "cuda"


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def matching(text, i, open_ch, close_ch):
    """Index of the bracket closing the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_ch:
            depth += 1
        elif text[j] == close_ch:
            depth -= 1
            if depth == 0:
                return j
    raise ValueError("unbalanced brackets")


def kernel_bodies(texts):
    """name -> list of bodies of the __global__ functions with that name."""
    bodies = {}
    for text in texts:
        for m in re.finditer(r"__global__\s+(?:void\s+)?(?:__launch_bounds__\s*\([^()]*\)\s*)?"
                             r"(?:void\s+)?(\w+)\s*\(", text):
            open_paren = m.end() - 1
            close_paren = matching(text, open_paren, "(", ")")
            brace = text.index("{", close_paren)
            if ";" in text[close_paren:brace]:
                continue  # a declaration
            end = matching(text, brace, "{", "}")
            bodies.setdefault(m.group(1), []).append(text[brace + 1:end])
    # Aliases: `constexpr auto name = kernel<...>;` (template variables naming an instance).
    for text in texts:
        for m in re.finditer(r"constexpr\s+auto\s+(\w+)\s*=\s*(\w+)\s*<", text):
            if m.group(2) in bodies:
                bodies.setdefault(m.group(1), bodies[m.group(2)])
    return bodies


def launched_kernels(text):
    """(line, kernel name) for every launch_pdl call of a file."""
    out = []
    for m in re.finditer(r"\blaunch_pdl\(\s*([A-Za-z_]\w*)", text):
        name, line = m.group(1), text.count("\n", 0, m.start()) + 1
        lam = None
        for lm in re.finditer(r"auto\s+(\w+)\s*=\s*\[[^\]]*\]\s*\(\s*auto\s+" + name + r"\s*\)", text):
            if lm.start() < m.start():
                lam = lm.group(1)
        if lam is None:
            out.append((line, name))
            continue
        # A local launcher: every kernel passed to it.
        for cm in re.finditer(r"\b" + lam + r"\(\s*([A-Za-z_]\w*)", text):
            out.append((text.count("\n", 0, cm.start()) + 1, cm.group(1)))
    return out


def main():
    # pdl.cuh defines launch_pdl itself.
    files = sorted(f for f in list(SRC.glob("*.cu")) + list(SRC.glob("*.cuh")) if f.name != "pdl.cuh")
    texts = {f: strip_comments(f.read_text()) for f in files}
    bodies = kernel_bodies(texts.values())
    bad, missing, checked = [], [], set()
    for f, text in texts.items():
        for line, name in launched_kernels(text):
            if name not in bodies:
                missing.append(f"{f.relative_to(ROOT)}:{line}: launch_pdl({name}, ...): no __global__ {name}")
                continue
            checked.add(name)
            for body in bodies[name]:
                # pdl_wait() is pdl_begin()'s wait without the early release (pdl.cuh).
                first = [i for i in (body.find("pdl_begin()"), body.find("pdl_wait()")) if i >= 0]
                if not first:
                    bad.append(f"{f.relative_to(ROOT)}:{line}: {name} never calls pdl_begin()")
                else:
                    # Every return must have a pdl_begin() / pdl_wait() before it in the text
                    # (the gemv's early-out block calls it first).
                    for r in re.finditer(r"\breturn\b", body):
                        if max(body.rfind("pdl_begin()", 0, r.start()),
                               body.rfind("pdl_wait()", 0, r.start())) < 0:
                            bad.append(f"{f.relative_to(ROOT)}:{line}: {name} can return before pdl_begin()")
                            break
    for msg in missing + bad:
        print(msg)
    if missing:
        return 2
    if bad:
        return 1
    print(f"pdl contract: {len(checked)} kernels launched with launch_pdl, all wait first")
    return 0


if __name__ == "__main__":
    sys.exit(main())
