#!/usr/bin/env python3
"""Turns a generation-1 DFlash GGUF (F32, from tools/llama-cpp/random_gguf.py --arch dflash) into a
generation-2 one with llama.cpp's own writer (gguf-py): the keys `dflash.conv_kernel_size`,
`conv_group_size`, `selector_rank`, `selector_top_k` and, as llama.cpp's `src/models/dflash.cpp`
creates them, per layer `blk.N.attn_conv_base` / `blk.N.ffn_conv_base` (ne [hidden, kernel, 2],
f32) and `blk.N.attn_conv_proj.weight` / `blk.N.ffn_conv_proj.weight` (ne [hidden, 2 * kernel *
hidden / group]), and `selector_predecessor.weight` / `selector_successor.weight` (ne [rank,
vocab]) and `selector_hidden.weight` (ne [hidden, rank]). For the gate's tests, not for running.

Usage: dflash2_gguf.py IN.gguf OUT.gguf KERNEL GROUP RANK TOP_K [--proj-rows N]
  --proj-rows N writes every conv projection with N rows instead (a broken file).
"""

import argparse
import sys

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("kernel", type=int)
    ap.add_argument("group", type=int)
    ap.add_argument("rank", type=int)
    ap.add_argument("top_k", type=int)
    ap.add_argument("--proj-rows", type=int)
    a = ap.parse_args()

    import gguf  # noqa: E402  (found through PYTHONPATH: the sdist's gguf-py)

    src = gguf.GGUFReader(a.src)
    w = gguf.GGUFWriter(a.out, "dflash")
    hidden = vocab = layers = 0
    for field in src.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            values = field.contents()
            if field.name == "tokenizer.ggml.tokens":
                vocab = len(values)
            w.add_key_value(field.name, values, vtype, sub_type=field.types[-1])
        else:
            value = field.contents()
            if field.name == "dflash.embedding_length":
                hidden = int(value)
            if field.name == "dflash.block_count":
                layers = int(value)
            w.add_key_value(field.name, value, vtype)
    w.add_uint32("dflash.conv_kernel_size", a.kernel)
    w.add_uint32("dflash.conv_group_size", a.group)
    w.add_uint32("dflash.selector_rank", a.rank)
    w.add_uint32("dflash.selector_top_k", a.top_k)
    for t in src.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            print(f"{t.name}: expected an F32 source", file=sys.stderr)
            return 1
        w.add_tensor(t.name, np.asarray(t.data, dtype=np.float32).reshape(
            [int(d) for d in reversed(t.shape)]))
    rng = np.random.default_rng(3)
    rows = a.proj_rows or 2 * a.kernel * (hidden // a.group)
    for i in range(layers):
        for part in ("attn", "ffn"):
            w.add_tensor(f"blk.{i}.{part}_conv_base",
                         (rng.standard_normal((2, a.kernel, hidden)) * 0.1).astype(np.float32))
            w.add_tensor(f"blk.{i}.{part}_conv_proj.weight",
                         (rng.standard_normal((rows, hidden)) / np.sqrt(hidden)).astype(np.float32))
    for name in ("selector_predecessor.weight", "selector_successor.weight"):
        w.add_tensor(name, (rng.standard_normal((vocab, a.rank)) * 0.1).astype(np.float32))
    w.add_tensor("selector_hidden.weight",
                 (rng.standard_normal((a.rank, hidden)) / np.sqrt(hidden)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
