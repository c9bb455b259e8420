#!/usr/bin/env python3
"""Writes the Qwen3.5 value-head fixture of tests/model_flm_qwen35_value_heads.rs: a tiny
random-weight Qwen3.5 model with more value heads than key heads, written as a GGUF by llama.cpp's
own converter and quantizer, then packaged by FastFlowLM's own converter (FLM_Q4NX_Converter), so
xdna's reading of the converter's value-head order is checked against files the real tools wrote.

What it does, in OUT_DIR/NAME/:
1. A Hugging Face checkpoint (transformers `Qwen3_5ForCausalLM`, fixed seed): `--layers`
   Gated DeltaNet layers (and a full-attention layer for every 4th), `--key-heads` key heads,
   `--value-heads` value heads, head dims `--head-dim`, hidden `--hidden`, FFN `--ffn`. Weights
   are strong (projections ~ N(0, 1/fan_in), per-head A_log, dt_bias and conv taps far apart) so a
   value head read in the wrong place moves the logits; the MLP is all zeros (the FFN size only
   selects the converter's path, see below, and zero blocks keep the files small). A byte-level
   BPE tokenizer of 320 tokens is trained on this docstring (tokenizers library).
2. `convert_hf_to_gguf.py --no-mtp --outtype f32` (llama.cpp; its `_reorder_v_heads` tiles the
   value heads), run with `get_vocab_base_pre` answering "qwen35" (the converter refuses a
   pre-tokenizer hash it does not know; the tokens themselves are the tokenizer's), then
   `llama-quantize --output-tensor-type q4_1 F32 Q4_1`: `source.gguf`, every matrix Q4_1 (the
   converter's Q8_0 packer cannot take a 32-column matrix, one block per row).
3. FastFlowLM's `convert.convert_gguf_to_q4nx(gguf, out, "qwen3.5-4B")` (as its convert.py does).
   It reorders the linear-attention value heads again only when `qwen35.feed_forward_length`
   > 6144, so `--ffn 6400` takes that path (Qwen3.5-4B/9B) and `--ffn 256` the other one. Its
   `model.q4nx` is kept minus the MLP tensors, which must be all-zero bytes (checked; the test puts
   them back as zeros, at the shapes listed in `zeros.json`), with its `tokenizer.json`, the
   checkpoint's `config.json` and a `tokenizer_config.json`: `package/`.

Usage (from the repository root; the converter at dd0993c, gguf-py and the converter's packages as
in tools/flm/legacy_q8_fixture.py, plus transformers for step 1 and the llama.cpp source tree,
e.g. vendor/llama.cpp of the llama-cpp-python 0.3.36 sdist, and its llama-quantize):

    python3 tools/flm/qwen35_value_heads_fixture.py --converter /path/to/FLM_Q4NX_Converter \\
        --llama-cpp /path/to/llama.cpp --quantize /path/to/llama-quantize \\
        --out-dir tests/data/flm-qwen35 --name r2-reorder --ffn 6400

tests/data/flm-qwen35/README.md lists the runs that made the committed fixtures.
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

VOCAB = 320
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(d: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([__doc__] * 4, trainer=trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
                   "eos_token": "<|endoftext|>", "model_max_length": 4096}, f, indent=2)


def write_checkpoint(d: str, a: argparse.Namespace) -> None:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(a.layers)]
    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=a.hidden, intermediate_size=a.ffn,
        num_hidden_layers=a.layers, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        linear_num_key_heads=a.key_heads, linear_num_value_heads=a.value_heads,
        linear_key_head_dim=a.head_dim, linear_value_head_dim=a.head_dim,
        linear_conv_kernel_dim=4, layer_types=types, full_attention_interval=4,
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=0,
    )
    torch.manual_seed(a.seed)
    m = Qwen3_5ForCausalLM(cfg).float()
    g = torch.Generator().manual_seed(a.seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if ".mlp." in n:
                p.zero_()
            elif n.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 3.0 - 2.0)
            elif n.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 2.0)
            elif "conv1d" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.7)
            elif n.endswith("linear_attn.norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif "norm" in n:  # zero-centred: the gain is 1 + w
                p.copy_(torch.rand(p.shape, generator=g) - 0.5)
            elif "embed_tokens" in n:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    m.save_pretrained(d)
    write_tokenizer(d)


def run_hf_to_gguf(llama_cpp: str, hf_dir: str, out: str) -> None:
    """llama.cpp's converter, with the pre-tokenizer name fixed (its hash table does not know a
    320-token vocabulary); everything else is the converter's own code."""
    code = (
        "import runpy, sys\n"
        f"sys.path.insert(0, {llama_cpp!r})\n"
        f"sys.path.insert(1, {os.path.join(llama_cpp, 'gguf-py')!r})\n"
        "import conversion.base as b\n"
        "b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen35'\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {hf_dir!r}, '--no-mtp', '--outtype', 'f32',"
        f" '--outfile', {out!r}]\n"
        f"runpy.run_path({os.path.join(llama_cpp, 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)


def run_flm(converter: str, gguf_path: str, out_dir: str) -> None:
    """convert.py's own entry point, run from the converter checkout (it reads configs/ relative to
    the working directory); `q4nx` first, as q4nx/models/phi4.py imports convert."""
    cwd = os.getcwd()
    sys.path.insert(0, converter)
    os.chdir(converter)
    try:
        import q4nx  # noqa: F401
        import convert

        convert.convert_gguf_to_q4nx(gguf_path, out_dir, "qwen3.5-4B", weights_type="language")
    finally:
        os.chdir(cwd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--converter", required=True, help="FLM_Q4NX_Converter checkout")
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--quantize", required=True, help="llama-quantize")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--seed", type=int, default=35)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=6400)
    ap.add_argument("--key-heads", type=int, default=8)
    ap.add_argument("--value-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=32)
    a = ap.parse_args()
    if a.value_heads != 16 and a.value_heads % 32:
        ap.error("the converter packs ssm_alpha/beta rows in blocks of 32 (heads doubled below 32)")

    sys.path.insert(0, os.path.join(os.path.abspath(a.llama_cpp), "gguf-py"))
    import torch
    from safetensors.torch import load_file, save_file

    converter = os.path.abspath(a.converter)
    out = os.path.abspath(os.path.join(a.out_dir, a.name))
    pkg = os.path.join(out, "package")
    os.makedirs(pkg, exist_ok=True)
    rev = subprocess.run(["git", "-C", converter, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip() or "unknown"
    gguf_path = os.path.join(out, "source.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        hf = os.path.join(tmp, "hf")
        write_checkpoint(hf, a)
        f32 = os.path.join(tmp, "f32.gguf")
        run_hf_to_gguf(os.path.abspath(a.llama_cpp), hf, f32)
        subprocess.run([a.quantize, "--output-tensor-type", "q4_1", f32, gguf_path, "Q4_1"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        flm = os.path.join(tmp, "flm")
        run_flm(converter, gguf_path, flm)
        tensors = load_file(os.path.join(flm, "model.q4nx"))
        zeros = []
        for name in sorted(tensors):
            if ".mlp." in name:
                t = tensors.pop(name)
                assert t.dtype == torch.int8 and not t.any(), f"{name}: {t.dtype}, not all zero"
                zeros.append({"name": name, "dtype": "I8", "shape": list(t.shape)})
        assert zeros, "no MLP tensors"
        save_file(tensors, os.path.join(pkg, "model.q4nx"))
        with open(os.path.join(out, "zeros.json"), "w") as f:
            json.dump(zeros, f, indent=1)
            f.write("\n")
        shutil.copyfile(os.path.join(flm, "tokenizer.json"), os.path.join(pkg, "tokenizer.json"))
        for f in ("config.json", "tokenizer_config.json"):
            shutil.copyfile(os.path.join(hf, f), os.path.join(pkg, f))

    print(f"converter {rev}, seed {a.seed}, {a.key_heads} key / {a.value_heads} value heads, "
          f"ffn {a.ffn}, {len(zeros)} zero MLP tensors dropped")
    for root, _, files in sorted(os.walk(out)):
        for name in sorted(files):
            p = os.path.join(root, name)
            data = open(p, "rb").read()
            print(f"{os.path.relpath(p, out)}: {len(data)} bytes, "
                  f"sha256 {hashlib.sha256(data).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
