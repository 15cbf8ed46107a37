#!/usr/bin/env python3
"""Writes the dequantization fixtures under tests/fixtures/dequant/.

For each type: random blocks (<type>.bin, raw bytes as stored in a GGUF file) and the
values the independent reference, gguf-py (PyPI `gguf`), dequantizes them to
(<type>.f32, little-endian float32). manifest.json records the versions and seed.
Needs `pip install gguf numpy`; the tests only read the committed outputs.

    python3 python/make_dequant_fixtures.py [OUT_DIR]
"""
import importlib.metadata
import json
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

SEED = 20240611
N_BLOCKS = 8

# type -> (byte offsets of the f16 scale fields inside a block)
QUANT = {
    "q8_0": (T.Q8_0, [0]),
    "q4_0": (T.Q4_0, [0]),
    "q4_1": (T.Q4_1, [0, 2]),
    "q4_k": (T.Q4_K, [0, 2]),
    "q5_k": (T.Q5_K, [0, 2]),
    "q6_k": (T.Q6_K, [208]),
}


def random_f16(rng, n):
    """Finite f16 scales spanning several binades, both signs."""
    mag = rng.uniform(1.0, 2.0, n) * np.exp2(rng.integers(-14, 3, n))
    return (mag * rng.choice([-1.0, 1.0], n)).astype(np.float16)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(__file__), "..", "tests", "fixtures", "dequant")
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(SEED)
    manifest = {"generator": "python/make_dequant_fixtures.py",
                "reference": (f"gguf-py (PyPI gguf {importlib.metadata.version('gguf')}), "
                              f"numpy {np.__version__}"),
                "seed": SEED, "types": {}}

    for name, (qtype, scale_offsets) in QUANT.items():
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (N_BLOCKS, block_bytes), dtype=np.uint8)
        for off in scale_offsets:
            raw[:, off:off + 2] = random_f16(rng, N_BLOCKS).view(np.uint8).reshape(N_BLOCKS, 2)
        ref = dequantize(raw.reshape(-1), qtype).astype("<f4").reshape(-1)
        assert ref.size == N_BLOCKS * block_elems and np.all(np.isfinite(ref))
        raw.tofile(os.path.join(out, name + ".bin"))
        ref.tofile(os.path.join(out, name + ".f32"))
        manifest["types"][name] = {"elements": int(ref.size), "bytes": int(raw.size)}

    # Plain types: every bit pattern class (normals, subnormals, zeros, inf, nan).
    for name, qtype in (("f16", T.F16), ("bf16", T.BF16), ("f32", T.F32)):
        n = 512
        bits = rng.integers(0, 1 << 16, n, dtype=np.uint32)
        if name == "f32":
            raw = rng.standard_normal(n).astype("<f4").view(np.uint8)
        else:
            specials = [0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x7c00, 0xfc00, 0x7e00,
                        0x0400, 0x7bff] if name == "f16" else \
                       [0x0000, 0x8000, 0x0001, 0x007f, 0x0080, 0x7f80, 0xff80, 0x7fc0, 0x7f7f]
            bits[:len(specials)] = specials
            raw = bits.astype("<u2").view(np.uint8)
        ref = dequantize(raw, qtype).astype("<f4").reshape(-1)
        raw.tofile(os.path.join(out, name + ".bin"))
        ref.tofile(os.path.join(out, name + ".f32"))
        manifest["types"][name] = {"elements": int(ref.size), "bytes": int(raw.size)}

    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
