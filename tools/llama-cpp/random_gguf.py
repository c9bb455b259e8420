#!/usr/bin/env python3
"""Writes a small random-weight GGUF of one model family with llama.cpp's own writer (gguf-py,
from the llama-cpp-python sdist: tools/llama-cpp/build.sh puts it beside the programs), for
checking xdna's reading of that family against llama.cpp on the same file.

The tokenizer (every `tokenizer.*` key) is copied from an existing GGUF, so both runtimes
tokenize real text the same way; the weights are drawn from a fixed seed. Weights are strong
enough (projections at ~1/sqrt(fan-in), biases and norm gains far from 0 and 1) that attention,
rotary positions, biases and q/k norms all move the predictions: a family-specific part read
wrongly changes the perplexity by far more than rounding does.

With `--llama3-rope FACTOR LOW HIGH ORIGINAL` a llama file gets Llama 3.1 rope scaling the way
llama.cpp's converter (`convert_hf_to_gguf.py`, LlamaModel) writes it: one frequency divisor per
rotated pair in `rope_freqs.weight`, computed by the converter's formula, and no scaling key.

With `--arch dflash` it writes a DFlash generation-1 draft (Qwen3-style layers, the fusion
matrix `fc` over the target's hidden states at `--target-layers`, `enc.output_norm`, no
embedding table or head: the target's are used) with the keys llama.cpp's converter
(`DFlashModel`) writes: `dflash.block_size`, `dflash.target_layers` (Hugging Face layer ids + 1)
and `tokenizer.ggml.mask_token_id`. `--hidden` must be the target's hidden size. With
`--dflash-generation 2` it adds the generation-2 parts under the converter's names and keys: per
layer `blk.N.{attn,ffn}_conv_base` `[2, kernel, hidden]` and `blk.N.{attn,ffn}_conv_proj.weight`
`[2 · kernel · hidden / group, hidden]`, the selector's `selector_{predecessor,successor}.weight`
`[vocab, rank]` and `selector_hidden.weight` `[rank, hidden]`, and `dflash.conv_kernel_size`,
`dflash.conv_group_size`, `dflash.selector_rank`, `dflash.selector_top_k`.

Usage: random_gguf.py --arch {llama,qwen2,qwen3,dflash} --tokenizer-from FILE.gguf --out FILE.gguf
"""

import argparse
import math
import sys

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", required=True, choices=["llama", "qwen2", "qwen3", "dflash"])
    ap.add_argument("--tokenizer-from", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--pre",
        help="write this tokenizer.ggml.pre instead of the source's (pre-tokenizer checks)",
    )
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument(
        "--llama3-rope",
        nargs=4,
        type=float,
        metavar=("FACTOR", "LOW_FREQ_FACTOR", "HIGH_FREQ_FACTOR", "ORIGINAL_CONTEXT"),
        help="llama only: Llama 3.1 rope scaling, stored as llama.cpp's converter stores it",
    )
    ap.add_argument("--rope-base", type=float, help="default: 1e4 (llama), 1e6 (others)")
    ap.add_argument("--rms-eps", type=float, default=1e-6)
    ap.add_argument(
        "--target-layers",
        default="1,10,19,28",
        help="dflash: the target's layer ids (Hugging Face, 0-based) read as context",
    )
    ap.add_argument("--block-size", type=int, default=16, help="dflash: rows per block")
    ap.add_argument("--mask-token", type=int, default=16, help="dflash: the mask token id")
    ap.add_argument("--dflash-generation", type=int, choices=[1, 2], default=1)
    ap.add_argument("--conv-kernel", type=int, default=4, help="dflash 2: convolution offsets")
    ap.add_argument("--conv-group", type=int, default=64, help="dflash 2: channels per kernel")
    ap.add_argument("--selector-rank", type=int, default=32, help="dflash 2: codebook width")
    ap.add_argument("--selector-top-k", type=int, default=8, help="dflash 2: candidates per row")
    ap.add_argument(
        "--selector-scale", type=float, default=1.0, help="dflash 2: codebook scale (0: no pairwise term)"
    )
    a = ap.parse_args()
    if a.llama3_rope is not None and a.arch != "llama":
        ap.error("--llama3-rope is for --arch llama")

    import gguf  # noqa: E402  (found through PYTHONPATH: the sdist's gguf-py)

    src = gguf.GGUFReader(a.tokenizer_from)
    rng = np.random.default_rng(a.seed)
    arch = a.arch
    w = gguf.GGUFWriter(a.out, arch)
    w.add_name(f"random {arch}")
    w.add_block_count(a.layers)
    w.add_context_length(2048)
    w.add_embedding_length(a.hidden)
    w.add_feed_forward_length(a.ffn)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_key_length(a.head_dim)
    w.add_value_length(a.head_dim)
    w.add_layer_norm_rms_eps(a.rms_eps)
    rope_base = a.rope_base or (10000.0 if arch == "llama" else 1000000.0)
    w.add_rope_freq_base(rope_base)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = 0
    for field in src.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if field.name == "tokenizer.ggml.pre" and a.pre is not None:
            continue
        if vtype == gguf.GGUFValueType.ARRAY:
            values = field.contents()
            if field.name == "tokenizer.ggml.tokens":
                vocab = len(values)
            w.add_key_value(field.name, values, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(field.name, field.contents(), vtype)
    if a.pre is not None:
        w.add_tokenizer_pre(a.pre)
    if vocab == 0:
        print(f"{a.tokenizer_from}: no tokenizer.ggml.tokens", file=sys.stderr)
        return 1

    def matrix(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def gains(n: int) -> np.ndarray:
        return rng.uniform(0.5, 1.5, n).astype(np.float32)

    h, hd = a.hidden, a.head_dim
    gen2 = False
    if arch == "dflash":
        target_layers = [int(x) for x in a.target_layers.split(",")]
        w.add_block_size(a.block_size)
        w.add_target_layers([i + 1 for i in target_layers])
        w.add_mask_token_id(a.mask_token)
        w.add_tensor("fc.weight", matrix(h, len(target_layers) * h, 2.0))
        w.add_tensor("enc.output_norm.weight", gains(h))
        gen2 = a.dflash_generation == 2
        if gen2:
            w.add_conv_kernel_size(a.conv_kernel)
            w.add_conv_group_size(a.conv_group)
            w.add_selector_rank(a.selector_rank)
            w.add_selector_top_k(a.selector_top_k)
            rank = a.selector_rank
            for name in ("selector_predecessor.weight", "selector_successor.weight"):
                codes = rng.standard_normal((vocab, rank)) * a.selector_scale
                w.add_tensor(name, codes.astype(np.float32))
            w.add_tensor("selector_hidden.weight", matrix(rank, h, 2.0))
    else:
        # Tied embeddings: the output head is token_embd.
        w.add_tensor(
            "token_embd.weight", (rng.standard_normal((vocab, h)) * 0.15).astype(np.float32)
        )
    w.add_tensor("output_norm.weight", gains(h))
    if a.llama3_rope is not None:
        w.add_tensor("rope_freqs.weight", llama3_rope_divisors(rope_base, hd, *a.llama3_rope))
    for i in range(a.layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", gains(h))
        w.add_tensor(b + "attn_q.weight", matrix(a.heads * hd, h, 2.0))
        w.add_tensor(b + "attn_k.weight", matrix(a.kv_heads * hd, h, 2.0))
        w.add_tensor(b + "attn_v.weight", matrix(a.kv_heads * hd, h))
        if arch == "qwen2":
            w.add_tensor(b + "attn_q.bias", rng.uniform(-1, 1, a.heads * hd).astype(np.float32))
            w.add_tensor(b + "attn_k.bias", rng.uniform(-1, 1, a.kv_heads * hd).astype(np.float32))
            w.add_tensor(b + "attn_v.bias", rng.uniform(-1, 1, a.kv_heads * hd).astype(np.float32))
        if arch in ("qwen3", "dflash"):
            w.add_tensor(b + "attn_q_norm.weight", gains(hd) * 2.0)
            w.add_tensor(b + "attn_k_norm.weight", gains(hd) * 2.0)
        w.add_tensor(b + "attn_output.weight", matrix(h, a.heads * hd))
        w.add_tensor(b + "ffn_norm.weight", gains(h))
        w.add_tensor(b + "ffn_gate.weight", matrix(a.ffn, h))
        w.add_tensor(b + "ffn_up.weight", matrix(a.ffn, h))
        w.add_tensor(b + "ffn_down.weight", matrix(h, a.ffn))
        if arch == "dflash" and gen2:
            projected = 2 * a.conv_kernel * (h // a.conv_group)
            for part in ("attn_conv", "ffn_conv"):
                # Offset 0 near 1 (the row itself), the earlier rows' weights smaller.
                base = rng.standard_normal((2, a.conv_kernel, h)).astype(np.float32) * 0.3
                base[:, 0, :] += 1.0
                w.add_tensor(b + part + "_base", base)
                w.add_tensor(b + part + "_proj.weight", matrix(projected, h, 0.5))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return 0


def llama3_rope_divisors(
    base: float, dim: int, factor: float, low: float, high: float, original: float
) -> np.ndarray:
    """The frequency divisor of each rotated pair, as convert_hf_to_gguf.py computes it: 1 for
    wavelengths under original/high, `factor` over original/low, the smooth blend between."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wavelen, high_wavelen = original / low, original / high
    divisors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            divisors.append(1.0)
        elif wavelen > low_wavelen:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


if __name__ == "__main__":
    sys.exit(main())
