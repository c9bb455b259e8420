#!/usr/bin/env python3
"""Writes a random-weight DFlash (generation 1, z-lab `DFlashDraftModel`) draft for a target model
as a Hugging Face checkpoint, converts it with llama.cpp's own converter (`convert_hf_to_gguf.py
--target-model-dir`) and checks the GGUF with gguf-py: an independent DFlash reference for xdna.

What it writes under OUT_DIR:
  target/      the target as the converter wants it: config.json (the target's, less xdna's own
               "xdna" key), tokenizer.json, tokenizer_config.json. The converter takes only the
               vocabulary from it (DFlash drafts share the target's embeddings and output head).
  draft/       config.json in the z-lab form (architectures ["DFlashDraftModel"], Qwen3 layer
               parameters, `block_size`, `dflash_config` {block_size, target_layer_ids,
               mask_token_id}) and model.safetensors (bf16, as z-lab ships them) with z-lab's tensor
               names: layers.N.self_attn.{q,k,v,o}_proj / q_norm / k_norm, layers.N.input_layernorm,
               layers.N.post_attention_layernorm, layers.N.mlp.{gate,up,down}_proj, fc, hidden_norm,
               norm; no embed_tokens / lm_head.
  draft.gguf   llama.cpp's conversion (arch `dflash`), checked: block size, target layers (HF ids
               + 1, i.e. the inputs of those target layers), mask token, pre-tokenizer, tensors.
  draft-gguf.json  the GGUF's keys (long arrays summarised) and tensors (name, type, shape).

The draft's layers: hidden size, heads, KV heads, head dim, FFN size, RMS epsilon and rope theta
default to the target's config; 2 layers. Target layers default to z-lab's choice
(`build_target_layer_ids`: evenly from layer 1 to n_layers-3). The mask token defaults to 16
(`<empty_output>` in SmolLM2's vocabulary: a special token that exists in the target's vocabulary,
is not BOS/EOS/PAD/UNK nor part of the chat template, never occurs in prose, and is not one of
the end-of-generation tokens llama.cpp infers for this vocabulary (0, 2 and 4 `<reponame>`); z-lab's
Qwen3 drafts likewise use a token id the target never emits).

Weights come from a fixed seed: projections ~ N(0, 1/fan_in) so every layer moves the hidden state
by about its own size, and every RMS norm gain random (input/post-attention norms, hidden_norm,
final norm uniform in [0.5, 1.5]; q/k norms the same times --qk-gain, default 2, i.e. [1, 3]), so
a norm read in the wrong place changes the drafts. With q/k gains around 1 the attention is nearly
uniform, every mask row sees about the same mix and the 15 drafted tokens of a round are mostly
one token (1-6 distinct per round on SmolLM2); around 2 the rows attend differently by position
and a round typically drafts 2-9 distinct tokens, which pins rotary positions and the context
features.

Needs numpy; the conversion also needs torch, transformers and sentencepiece (the converter imports
them; for a llama-family target it tries sentencepiece before tokenizer.json) in the Python that
runs this script (PyPI torch works: `python3 -m venv --system-site-packages VENV && VENV/bin/pip
install torch sentencepiece`, then run this with VENV/bin/python), and the llama.cpp source tree (`--llama-cpp`: the directory holding
convert_hf_to_gguf.py, conversion/ and gguf-py/, e.g. vendor/llama.cpp of the llama-cpp-python
sdist; or the sdist .tar.gz itself, which is then unpacked to a temporary directory).

Usage: random_dflash.py --target-pkg DIR --llama-cpp SRC_DIR_OR_SDIST --out-dir DIR
                        [--seed 7] [--layers 2] [--target-layers 1 10 18 27] [--mask-token-id 16]
                        [--qk-gain 2] [--outtype f16] [--expect-pre smollm]
                        [--target-gguf TARGET.gguf]
"""

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile

import numpy as np


def zlab_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """z-lab's `build_target_layer_ids` (dflash model/utils.py)."""
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + (i * span) / (num_features - 1))) for i in range(num_features)]


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def write_safetensors_bf16(path: str, tensors: dict[str, np.ndarray]) -> None:
    """A minimal safetensors writer (all tensors bf16), so generation needs no torch."""
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs = []
    offset = 0
    for name, arr in tensors.items():
        raw = to_bf16_bits(arr).tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    hdr = json.dumps(header, separators=(",", ":")).encode()
    hdr += b" " * (-len(hdr) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hdr)))
        f.write(hdr)
        for b in blobs:
            f.write(b)


def llama_cpp_source(arg: str, tmp: str) -> str:
    """The llama.cpp source dir: `arg` itself, or the vendor/llama.cpp unpacked from an sdist."""
    if os.path.isdir(arg):
        return arg
    want = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    with tarfile.open(arg) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/vendor/llama.cpp/", 1)
            if len(parts) == 2 and parts[1].startswith(want):
                members.append(m)
        try:
            tar.extractall(tmp, members=members, filter="data")
        except TypeError:  # Python without extraction filters
            tar.extractall(tmp, members=members)
    roots = {m.name.split("/vendor/llama.cpp/", 1)[0] for m in members}
    if len(roots) != 1:
        raise SystemExit(f"{arg}: no vendor/llama.cpp converter found")
    return os.path.join(tmp, roots.pop(), "vendor", "llama.cpp")


def write_target_dir(target_pkg: str, target_dir: str) -> dict:
    """The target as the converter reads it (config.json less xdna's own key, and the
    tokenizer files) in `target_dir`; returns the target's config."""
    with open(os.path.join(target_pkg, "config.json"), encoding="utf-8") as f:
        tcfg = json.load(f)
    tcfg.pop("xdna", None)
    shutil.rmtree(target_dir, ignore_errors=True)
    os.makedirs(target_dir)
    with open(os.path.join(target_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(tcfg, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(target_pkg, name), target_dir)
    return tcfg


def draft_shape(tcfg: dict) -> dict:
    """The draft layers' shape taken from the target's config (z-lab drafts share the target's
    hidden size, heads, head dim and FFN size)."""
    heads = tcfg["num_attention_heads"]
    return {
        "hidden": tcfg["hidden_size"],
        "heads": heads,
        "kv_heads": tcfg.get("num_key_value_heads", heads),
        "head_dim": tcfg.get("head_dim") or tcfg["hidden_size"] // heads,
        "ffn": tcfg["intermediate_size"],
        "vocab": tcfg["vocab_size"],
        "rms_eps": tcfg.get("rms_norm_eps", 1e-6),
        "rope_theta": tcfg.get("rope_theta",
                               (tcfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
    }


def draft_config(tcfg: dict, layers: int, block_size: int, target_layers: list[int],
                 mask_token_id: int) -> dict:
    """The draft's config.json in the form z-lab publishes (Qwen3Config + block_size +
    dflash_config)."""
    d = draft_shape(tcfg)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": block_size,
        "dflash_config": {
            "block_size": block_size,
            "target_layer_ids": target_layers,
            "mask_token_id": mask_token_id,
        },
        "bos_token_id": tcfg.get("bos_token_id"),
        "eos_token_id": tcfg.get("eos_token_id"),
        "dtype": "bfloat16",
        "head_dim": d["head_dim"],
        "hidden_act": "silu",
        "hidden_size": d["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": d["ffn"],
        "layer_types": ["full_attention"] * layers,
        "max_position_embeddings": tcfg.get("max_position_embeddings", 8192),
        "max_window_layers": layers,
        "num_attention_heads": d["heads"],
        "num_hidden_layers": layers,
        "num_key_value_heads": d["kv_heads"],
        "num_target_layers": tcfg["num_hidden_layers"],
        "rms_norm_eps": d["rms_eps"],
        "rope_scaling": None,
        "rope_theta": d["rope_theta"],
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": d["vocab"],
    }


def convert_draft(llama_cpp: str, draft_dir: str, target_dir: str, outtype: str,
                  gguf_path: str, check: dict) -> dict:
    """llama.cpp's converter over the checkpoint in `draft_dir`, then the GGUF checked with
    llama.cpp's own gguf-py (`check`: the keyword arguments of `check_gguf`); returns the
    GGUF's summary."""
    with tempfile.TemporaryDirectory() as tmp:
        src = llama_cpp_source(llama_cpp, tmp)
        cmd = [sys.executable, os.path.join(src, "convert_hf_to_gguf.py"), draft_dir,
               "--target-model-dir", target_dir, "--outtype", outtype, "--outfile", gguf_path]
        print("+ " + " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True)

        sys.path.insert(0, os.path.join(src, "gguf-py"))
        import gguf  # noqa: E402  (llama.cpp's own gguf-py, from the same source)

        return check_gguf(gguf, gguf_path, **check)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-pkg", required=True,
                    help="dir with the target's config.json, tokenizer.json, tokenizer_config.json")
    ap.add_argument("--llama-cpp", required=True,
                    help="llama.cpp source dir (with convert_hf_to_gguf.py) or the llama-cpp-python sdist")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--layers", type=int, default=2, help="draft layers")
    ap.add_argument("--n-features", type=int, default=4,
                    help="number of target layers read (z-lab spacing) when --target-layers is not given")
    ap.add_argument("--target-layers", type=int, nargs="+", help="HF (0-based) target layer ids")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--mask-token-id", type=int, default=16)
    ap.add_argument("--outtype", default="f16", choices=["f32", "f16", "bf16", "q8_0"])
    ap.add_argument("--qk-gain", type=float, default=2.0,
                    help="scale of the q/k norm gains (attention sharpness; see the top)")
    ap.add_argument("--expect-pre", help="require this tokenizer.ggml.pre (SmolLM2: smollm)")
    ap.add_argument("--target-gguf",
                    help="the target's GGUF: require the draft's vocabulary keys to equal its own")
    a = ap.parse_args()

    out = os.path.abspath(a.out_dir)
    target_dir = os.path.join(out, "target")
    draft_dir = os.path.join(out, "draft")
    tcfg = write_target_dir(a.target_pkg, target_dir)
    n_tgt_layers = tcfg["num_hidden_layers"]
    d = draft_shape(tcfg)
    hidden, heads, kv_heads, head_dim, ffn = (d["hidden"], d["heads"], d["kv_heads"],
                                              d["head_dim"], d["ffn"])
    target_layers = a.target_layers or zlab_target_layer_ids(n_tgt_layers, a.n_features)
    if not all(0 <= i < n_tgt_layers for i in target_layers):
        ap.error(f"target layers {target_layers} outside 0..{n_tgt_layers - 1}")
    if not 0 <= a.mask_token_id < d["vocab"]:
        ap.error(f"mask token id {a.mask_token_id} outside the vocabulary (0..{d['vocab'] - 1})")

    shutil.rmtree(draft_dir, ignore_errors=True)
    os.makedirs(draft_dir)
    dcfg = draft_config(tcfg, a.layers, a.block_size, target_layers, a.mask_token_id)
    with open(os.path.join(draft_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(dcfg, f, indent=2)

    rng = np.random.default_rng(a.seed)

    def linear(n_out: int, n_in: int) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def gain(n: int) -> np.ndarray:
        return rng.uniform(0.5, 1.5, n).astype(np.float32)

    t: dict[str, np.ndarray] = {}
    for i in range(a.layers):
        p = f"layers.{i}."
        t[p + "input_layernorm.weight"] = gain(hidden)
        t[p + "self_attn.q_proj.weight"] = linear(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = linear(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = linear(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = linear(hidden, heads * head_dim)
        t[p + "self_attn.q_norm.weight"] = gain(head_dim) * a.qk_gain
        t[p + "self_attn.k_norm.weight"] = gain(head_dim) * a.qk_gain
        t[p + "post_attention_layernorm.weight"] = gain(hidden)
        t[p + "mlp.gate_proj.weight"] = linear(ffn, hidden)
        t[p + "mlp.up_proj.weight"] = linear(ffn, hidden)
        t[p + "mlp.down_proj.weight"] = linear(hidden, ffn)
    t["fc.weight"] = linear(hidden, len(target_layers) * hidden)
    t["hidden_norm.weight"] = gain(hidden)
    t["norm.weight"] = gain(hidden)
    write_safetensors_bf16(os.path.join(draft_dir, "model.safetensors"), t)
    print(f"draft checkpoint: {draft_dir} ({len(t)} tensors, seed {a.seed}); "
          f"target layers {target_layers}, mask token {a.mask_token_id}", file=sys.stderr)

    gguf_path = os.path.join(out, "draft.gguf")
    summary = convert_draft(a.llama_cpp, draft_dir, target_dir, a.outtype, gguf_path, check={
        "layers": a.layers, "block_size": a.block_size, "target_layers": target_layers,
        "mask_token_id": a.mask_token_id, "expect_pre": a.expect_pre,
        "target_gguf": a.target_gguf})
    with open(os.path.join(out, "draft-gguf.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    for k, v in summary["keys"].items():
        print(f"{k} = {v}")
    for name, typ, shape in summary["tensors"]:
        print(f"{name:40s} {typ:5s} {shape}")
    print(f"OK: {gguf_path}", file=sys.stderr)
    return 0


def check_gguf(gguf, path: str, *, layers: int, block_size: int, target_layers: list[int],
               mask_token_id: int, expect_pre: str | None = None,
               target_gguf: str | None = None) -> dict:
    r = gguf.GGUFReader(path)
    keys = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY and len(f.data) > 16:
            keys[k] = f"[{len(f.data)} x {f.types[-1].name}]"
        else:
            keys[k] = f.contents()
    tensors = [(t.name, t.tensor_type.name, [int(x) for x in t.shape]) for t in r.tensors]

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise SystemExit(f"{path}: {what}")

    need(keys.get("general.architecture") == "dflash", f"architecture {keys.get('general.architecture')}")
    need(keys.get("dflash.block_size") == block_size, f"dflash.block_size {keys.get('dflash.block_size')}")
    need(keys.get("dflash.target_layers") == [i + 1 for i in target_layers],
         f"dflash.target_layers {keys.get('dflash.target_layers')} != HF ids + 1")
    need(keys.get("tokenizer.ggml.mask_token_id") == mask_token_id,
         f"mask token {keys.get('tokenizer.ggml.mask_token_id')}")
    # the converter refuses a BPE pre-tokenizer whose hash it does not know, so any value here was
    # recognised; --expect-pre / --target-gguf pin it
    pre = keys.get("tokenizer.ggml.pre")
    need(pre is not None, "no tokenizer.ggml.pre")
    if expect_pre is not None:
        need(pre == expect_pre, f"tokenizer.ggml.pre {pre!r} != {expect_pre!r}")
    if target_gguf:
        tr = gguf.GGUFReader(target_gguf)
        for k in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                  "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                  "tokenizer.ggml.eos_token_id", "tokenizer.ggml.add_bos_token"):
            tf, df = tr.fields.get(k), r.fields.get(k)
            need(tf is not None and df is not None and tf.contents() == df.contents(),
                 f"{k} differs from the target GGUF's")
    names = {n for n, _, _ in tensors}
    need({"fc.weight", "enc.output_norm.weight", "output_norm.weight"} <= names,
         f"fc / enc.output_norm / output_norm missing: {sorted(names)}")
    need(not {"token_embd.weight", "output.weight"} & names, "the draft carries its own embeddings/head")
    per_layer = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    for i in range(layers):
        for p in per_layer:
            need(f"blk.{i}.{p}.weight" in names, f"blk.{i}.{p}.weight missing")
    need(len(names) == 3 + layers * len(per_layer), f"unexpected tensors: {sorted(names)}")
    return {"file": path, "keys": keys, "tensors": tensors}


if __name__ == "__main__":
    sys.exit(main())
