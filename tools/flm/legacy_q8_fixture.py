#!/usr/bin/env python3
"""Writes the legacy-q8 fixture of tests/weights_flm_legacy_q8.rs: a tiny Q8_0 matrix as a GGUF
(llama.cpp's writer, gguf-py) and the same matrix packed by FastFlowLM's own converter
(FLM_Q4NX_Converter, the `model.q4nx` it writes), so xdna's reading of the converter's 5120-byte
"q8 in q4nx" tiles is checked against bytes the real converter wrote, not a hand-made encoder.

What it does:
1. Draws a random `[ROWS, COLS]` f32 matrix (fixed seed; every (row, 32-column group) gets its
   own magnitude, spread over several octaves, so a scale read from the wrong cell shows; one
   group is all zeros), quantizes it with `gguf.quantize(..., Q8_0)` and writes `source.gguf`
   holding one tensor, `output.weight`, plus the two `qwen35.*` keys the converter reads.
2. Runs the converter on that file exactly as its `convert.py` does:
   `convert.convert_gguf_to_q4nx(gguf, out, "qwen3.5-4B")`, i.e. `create_converter` and
   `Qwen35.convert`. For `output.weight` (`lm_head.weight`, `"default_tensor_type": "Q8_0"` in
   configs/qwen3.5_4b.json) that is `GGUFTensor.unpack` → `unpack_q8_0` (f16 scales, int8
   codes) → `_pack(..., tensor_type=Q8_0)` → `_pack_q4nx_8b`: 32×128 tiles, bf16 scales at
   [0, 256), the same scales again at [256, 512), int8 codes at [512, 4608) as
   `(r/16)*2048 + c*16 + r%16`, zeros at [4608, 5120). `safetensors.torch.save_file` writes it
   as an I8 tensor of shape `[ROWS/32, COLS/128, 5120]` with no `__metadata__`. Its
   `model.q4nx` is copied here (the tokenizer.json it also writes is not).
3. Checks, independently of xdna, that the package decodes (codes from byte 512) to
   q · bf16(d) of the GGUF blocks, and that the last 512 bytes of every tile are zero.

The default shape, 64 × 384, is 2 row blocks × 3 tiles of 128 columns (6 tiles, each with both
16-row code planes), and 384 is not a multiple of 256: files of 26 kB (GGUF) and 31 kB (package).

Usage (from the repository root; the converter checkout is any clone of
https://github.com/FastFlowLM/FLM_Q4NX_Converter, the fixture was made at dd0993c):

    PYTHONPATH=/path/to/llama.cpp/gguf-py \\
        python3 tools/flm/legacy_q8_fixture.py --converter /path/to/FLM_Q4NX_Converter \\
        --out-dir tests/data/flm-legacy-q8

gguf-py: llama.cpp's `gguf-py/` directory (e.g. from the llama-cpp-python 0.3.36 sdist,
`vendor/llama.cpp/gguf-py`; version 0.19.0 was used), put on PYTHONPATH, or `pip install gguf`.

The converter imports torch, einops, safetensors, numpy and mpmath. What was used (no GPU, no
PyTorch index needed): Debian's `apt-get install --no-install-recommends python3-torch`
(1.13.1, brings numpy 1.24.2 and mpmath), then a venv with `--system-site-packages` and
`pip install einops==0.8.2 safetensors==0.8.0`. `pip install torch numpy mpmath einops
safetensors` works as well. transformers, amd-quark and matplotlib (in the converter's
setup_venv.sh) are not needed.

The output is deterministic for a given seed, shape, gguf-py and converter.
"""

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

TENSOR = "output.weight"  # GGUF name; the converter calls it lm_head.weight
PACKED = "lm_head.weight"
TILE_ROWS, TILE_COLS, TILE_BYTES = 32, 128, 5120
CODES = 512  # offset of the code area in a tile


def random_matrix(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Gaussian values, each (row, 32-column group) scaled by its own 2^U(-10, 2)."""
    groups = cols // 32
    mag = np.exp2(rng.uniform(-10.0, 2.0, size=(rows, groups))).astype(np.float32)
    w = rng.standard_normal((rows, groups, 32)).astype(np.float32) * mag[:, :, None]
    w[rows // 2 + 3, groups - 1, :] = 0.0  # an all-zero block (scale 0), second row block
    return w.reshape(rows, cols)


def write_gguf(path: str, q8: np.ndarray, gguf) -> None:
    w = gguf.GGUFWriter(path, "qwen35")
    w.add_name("xdna legacy q8 fixture")
    # Read by Qwen35.convert (no model is built from this file).
    w.add_uint32("qwen35.feed_forward_length", 512)
    w.add_uint32("qwen35.full_attention_interval", 4)
    w.add_tensor(TENSOR, q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def run_converter(converter: str, gguf_path: str, out_dir: str) -> None:
    """convert.py's own entry point, `convert_gguf_to_q4nx`, run from the converter checkout
    (it reads configs/ relative to the working directory). `q4nx` is imported before `convert`
    because q4nx/models/phi4.py imports convert (a circular import otherwise)."""
    cwd = os.getcwd()
    sys.path.insert(0, converter)
    os.chdir(converter)
    try:
        import q4nx  # noqa: F401
        import convert

        convert.convert_gguf_to_q4nx(gguf_path, out_dir, "qwen3.5-4B", weights_type="language")
    finally:
        os.chdir(cwd)


def check(q8: np.ndarray, packed: np.ndarray, rows: int, cols: int) -> None:
    """The package against the GGUF blocks: codes from byte 512, bf16 scales in both slots."""
    import torch

    blocks = q8.reshape(rows, cols // 32, 34)
    d16 = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[:, :, 0]
    q = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(rows, cols)
    # The converter's rounding: torch f16 → bf16 (round to nearest even).
    d_bf16 = torch.from_numpy(d16.copy()).to(torch.bfloat16).to(torch.float32).numpy()
    want = q.astype(np.float32) * np.repeat(d_bf16, 32, axis=1)

    assert packed.dtype == np.int8, packed.dtype
    assert packed.shape == (rows // TILE_ROWS, cols // TILE_COLS, TILE_BYTES), packed.shape
    got = np.zeros((rows, cols), np.float32)
    r = np.arange(TILE_ROWS)[:, None]
    c = np.arange(TILE_COLS)[None, :]
    for p in range(packed.shape[0]):
        for t in range(packed.shape[1]):
            tile = packed[p, t].view(np.uint8)
            scales = tile[:256].view(np.uint16)
            assert (tile[:256] == tile[256:512]).all(), "scale slot repeated"
            assert (tile[4608:] == 0).all(), "last 512 bytes zero"
            d = (scales.astype(np.uint32) << 16).view(np.float32)[(c // 32) * 32 + r]
            codes = tile[CODES + (r // 16) * 2048 + c * 16 + r % 16].view(np.int8)
            got[p * 32:(p + 1) * 32, t * 128:(t + 1) * 128] = codes.astype(np.float32) * d
    assert np.array_equal(got, want), f"max |Δ| {np.abs(got - want).max()}"
    changed = int((d_bf16 != d16.astype(np.float32)).sum())
    print(f"check: package == q·bf16(d) for all {rows * cols} values; "
          f"{changed} of {d16.size} scales changed by bf16 rounding")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--converter", required=True, help="FLM_Q4NX_Converter checkout")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--seed", type=int, default=20260)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cols", type=int, default=384)
    a = ap.parse_args()
    if a.rows % TILE_ROWS or a.cols % TILE_COLS:
        ap.error("rows must be a multiple of 32 and cols of 128 (the converter's blocks)")

    import gguf  # noqa: E402  (llama.cpp's gguf-py, through PYTHONPATH or pip)
    from safetensors.numpy import load_file

    converter = os.path.abspath(a.converter)
    out_dir = os.path.abspath(a.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    rev = subprocess.run(["git", "-C", converter, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip() or "unknown"

    rng = np.random.default_rng(a.seed)
    w = random_matrix(rng, a.rows, a.cols)
    q8 = gguf.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    gguf_path = os.path.join(out_dir, "source.gguf")
    write_gguf(gguf_path, q8, gguf)

    with tempfile.TemporaryDirectory() as tmp:
        run_converter(converter, gguf_path, tmp)
        shutil.copyfile(os.path.join(tmp, "model.q4nx"), os.path.join(out_dir, "model.q4nx"))
    pkg_path = os.path.join(out_dir, "model.q4nx")
    packed = load_file(pkg_path)
    assert list(packed) == [PACKED], list(packed)
    check(q8, packed[PACKED], a.rows, a.cols)

    print(f"converter {rev}, gguf-py {getattr(gguf, '__version__', '?')}, seed {a.seed}, "
          f"{a.rows} x {a.cols}")
    for p in (gguf_path, pkg_path):
        data = open(p, "rb").read()
        print(f"{os.path.relpath(p)}: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
