#!/usr/bin/env python3
"""Trains a DFlash block draft (z-lab `DFlashDraftModel` layout, generation 1) for the default
model (SmolLM2-135M-Instruct Q4_1) on this machine's CPUs, and exports it through llama.cpp's
converter to a `dflash` GGUF.

Stages, each kept under --out so that a rerun resumes where the last one stopped:
  1. corpus   prompts cut from text every machine of this project has and that no evaluation
              uses: the Python standard library's sources (code), the Rust sources of the crates
              in this repository's Cargo.lock as cargo fetched them (code), and prose: the Python
              reference manual's topics (`pydoc_data.topics`), those crates' README files, and
              the standard library's docstrings. Documents are split train / held-out by a hash
              of their name, so a held-out prompt never shares a document with a training one.
  2. labels   the target's own greedy continuations of every prompt, with its hidden states after
              the tap layers at every position, from `xdna greedy-taps` (the project's forward:
              the same numbers that verify the draft's blocks later). Greedy continuations, not
              the per-position argmax over the corpus text: in a greedy speculative run the draft
              sees the target's own output as context and must predict its next greedy tokens, so
              the labels are a greedy chain and the context is that same chain.
  3. train    the DFlash recipe: per sequence, random anchor positions a; a block is the anchor's
              token followed by B - 1 mask tokens at positions a .. a+B-1; the context is the
              target's hidden states of positions < a (fused by `fc` + `hidden_norm`, keys and
              values beside the block's own in every layer, no causal mask inside the block);
              block row k is scored against the target's greedy token at a+k with cross-entropy
              weighted exp(-(k-1)/gamma). The target's embeddings and output head are frozen.
              Held-out acceptance is measured as a greedy run would see it: tokens per round =
              1 + the leading drafted tokens equal to the target's.
  4. export   a z-lab style checkpoint (config.json + model.safetensors) and llama.cpp's
              conversion of it (`convert_hf_to_gguf.py --target-model-dir`).

Usage: train.py --out DIR [--xdna target/release/xdna] [--llama-cpp SDIST_OR_SRC]
                [--steps N] [--seed 1] ...   (see --help)
"""

import argparse
import ast
import glob
import hashlib
import json
import math
import os
import random
import struct
import subprocess
import sys
import sysconfig
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "tools", "llama-cpp"))
import random_dflash  # noqa: E402  (the converter plumbing shared with the random drafts)


# ---------------------------------------------------------------------------------------------
# 1. corpus


def cargo_lock_crates(lock_path: str) -> list[tuple[str, str]]:
    """(name, version) of the registry crates in Cargo.lock."""
    crates, cur = [], {}
    with open(lock_path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line == "[[package]]":
                if cur.get("source", "").startswith("registry+"):
                    crates.append((cur["name"], cur["version"]))
                cur = {}
            elif " = " in line:
                k, v = line.split(" = ", 1)
                cur[k] = v.strip('"')
    if cur.get("source", "").startswith("registry+"):
        crates.append((cur["name"], cur["version"]))
    return sorted(set(crates))


def crate_dirs(lock_path: str) -> list[str]:
    home = os.environ.get("CARGO_HOME", os.path.expanduser("~/.cargo"))
    dirs = []
    for name, version in cargo_lock_crates(lock_path):
        hits = sorted(glob.glob(os.path.join(home, "registry", "src", "*", f"{name}-{version}")))
        if hits:
            dirs.append(hits[0])
    return dirs


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def corpus_documents(lock_path: str) -> list[tuple[str, str, str]]:
    """(kind, name, text) of every document, in a fixed order; kind is "code" or "prose"."""
    docs = []
    stdlib = sysconfig.get_paths()["stdlib"]
    skip = ("site-packages", os.sep + "test" + os.sep, os.sep + "tests" + os.sep, "idlelib",
            "pydoc_data")
    py_files = sorted(p for p in glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)
                      if not any(s in p for s in skip))
    for p in py_files:
        text = read_text(p)
        if not text:
            continue
        rel = os.path.relpath(p, stdlib)
        docs.append(("code", "py:" + rel, text))
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        strings = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                d = ast.get_docstring(node)
                if d and len(d) >= 400:
                    strings.append(d)
        if strings:
            docs.append(("prose", "pydoc:" + rel, "\n\n".join(strings)))
    try:
        from pydoc_data.topics import topics
        for key in sorted(topics):
            docs.append(("prose", "topic:" + key, topics[key]))
    except ImportError:
        pass
    for d in crate_dirs(lock_path):
        crate = os.path.basename(d)
        for p in sorted(glob.glob(os.path.join(d, "src", "**", "*.rs"), recursive=True)):
            text = read_text(p)
            if text:
                docs.append(("code", f"rs:{crate}/{os.path.relpath(p, d)}", text))
        for p in sorted(glob.glob(os.path.join(d, "*.md"))):
            text = read_text(p)
            if text and len(text) >= 1000:
                docs.append(("prose", f"md:{crate}/{os.path.basename(p)}", text))
    return docs


def held_out(name: str, fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return h / 2**64 < fraction


def make_prompts(docs, tokenizer, n: int, rng: random.Random, min_len: int, max_len: int):
    """`n` prompts: half prose, half code; each a window of a random document starting at a line
    start, min_len..max_len tokens."""
    by_kind = {"prose": [d for d in docs if d[0] == "prose"], "code": [d for d in docs if d[0] == "code"]}
    prompts = []
    while len(prompts) < n:
        kind = "prose" if len(prompts) % 2 == 0 else "code"
        pool = by_kind[kind]
        if not pool:
            raise SystemExit(f"no {kind} documents found for the corpus")
        _, name, text = pool[rng.randrange(len(pool))]
        lines = text.splitlines(keepends=True)
        if len(lines) < 2:
            continue
        start = rng.randrange(len(lines))
        chunk = "".join(lines[start:start + 200])
        ids = tokenizer.encode(chunk, add_special_tokens=False).ids
        want = rng.randint(min_len, max_len)
        if len(ids) < want or not chunk.strip():
            continue
        prompts.append({"kind": kind, "doc": name, "ids": ids[:want]})
    return prompts


# ---------------------------------------------------------------------------------------------
# 2. labels


def read_greedy_taps(path: str):
    """Records of an `xdna greedy-taps` file: (prompt_len, tokens int64 [L], features f16
    [L-1, taps*hidden])."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"XGT1":
        raise SystemExit(f"{path}: not an xdna greedy-taps file")
    hidden, ntaps = struct.unpack_from("<II", data, 4)
    taps = list(struct.unpack_from(f"<{ntaps}I", data, 12))
    off = 12 + 4 * ntaps
    width = ntaps * hidden
    records = []
    while off < len(data):
        if off + 8 > len(data):
            raise SystemExit(f"{path}: truncated record header at byte {off}")
        p, total = struct.unpack_from("<II", data, off)
        off += 8
        need = 4 * total + 2 * (total - 1) * width
        if total < 1 or off + need > len(data):
            raise SystemExit(f"{path}: truncated record at byte {off}")
        tokens = np.frombuffer(data, dtype="<u4", count=total, offset=off).astype(np.int64)
        off += 4 * total
        feats = np.frombuffer(data, dtype="<f2", count=(total - 1) * width, offset=off)
        off += 2 * (total - 1) * width
        records.append((p, tokens, feats.reshape(total - 1, width)))
    return hidden, taps, records


# ---------------------------------------------------------------------------------------------
# 3. the draft


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, d: dict):
        super().__init__()
        h, hd = d["hidden"], d["head_dim"]
        self.heads, self.kv_heads, self.head_dim = d["heads"], d["kv_heads"], hd
        self.q_proj = nn.Linear(h, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, d["rms_eps"])
        self.k_norm = RMSNorm(hd, d["rms_eps"])


class MLP(nn.Module):
    def __init__(self, d: dict):
        super().__init__()
        self.gate_proj = nn.Linear(d["hidden"], d["ffn"], bias=False)
        self.up_proj = nn.Linear(d["hidden"], d["ffn"], bias=False)
        self.down_proj = nn.Linear(d["ffn"], d["hidden"], bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, d: dict):
        super().__init__()
        self.input_layernorm = RMSNorm(d["hidden"], d["rms_eps"])
        self.self_attn = Attention(d)
        self.post_attention_layernorm = RMSNorm(d["hidden"], d["rms_eps"])
        self.mlp = MLP(d)


def rotate(x, cos, sin):
    """Rotary embedding over the last dim, halves rotated (the Llama/Qwen layout)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


class Draft(nn.Module):
    """The z-lab `DFlashDraftModel` (generation 1): parameter names are its checkpoint's."""

    def __init__(self, d: dict, layers: int, taps: int, feature_scale: torch.Tensor):
        super().__init__()
        self.d = d
        # 1 / RMS of each feature channel over the training data, applied before `fc` while
        # training and folded into `fc` at export (`export_state`): the target's residual stream
        # carries a few massive channels (RMS ~4400 against a median ~15 at layers 18 and 27)
        # that would otherwise swamp the fused row after `hidden_norm` and slow learning.
        self.register_buffer("inv_feature_rms", feature_scale, persistent=False)
        self.layers = nn.ModuleList(Layer(d) for _ in range(layers))
        self.fc = nn.Linear(taps * d["hidden"], d["hidden"], bias=False)
        self.hidden_norm = RMSNorm(d["hidden"], d["rms_eps"])
        self.norm = RMSNorm(d["hidden"], d["rms_eps"])
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def rope(self, positions):
        hd = self.d["head_dim"]
        inv = 1.0 / (self.d["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = positions.to(torch.float64)[..., None] * inv
        return ang.cos().float(), ang.sin().float()

    def forward(self, features, block_emb, anchors):
        """features [S, C, taps*h] (context rows 0..C-1), block_emb [S, A, B, h], anchors [S, A]
        -> block hidden states [S, A, B, h] after the final norm.
        Block (s, i) reads context rows < anchors[s, i] and its own B rows."""
        S, A, B, h = block_emb.shape
        C = features.shape[1]
        ctx = self.hidden_norm(self.fc(features * self.inv_feature_rms))
        x = block_emb.reshape(S, A * B, h)
        bpos = (anchors[:, :, None] + torch.arange(B)[None, None, :]).reshape(S, A * B)
        cpos = torch.arange(C)[None, :].expand(S, C)
        ccos, csin = self.rope(cpos)
        bcos, bsin = self.rope(bpos)
        ccos, csin = ccos[:, :, None, :], csin[:, :, None, :]
        bcos, bsin = bcos[:, :, None, :], bsin[:, :, None, :]
        # mask [S, A*B, C + A*B]: context keys before the row's anchor, and the row's own block
        ctx_ok = torch.arange(C)[None, None, :] < anchors.reshape(S, A, 1).repeat_interleave(B, 1)
        blk = torch.arange(A).repeat_interleave(B)
        blk_ok = (blk[:, None] == blk[None, :])[None].expand(S, -1, -1)
        mask = torch.cat((ctx_ok, blk_ok), dim=2)[:, None]
        hd, H, KV = self.d["head_dim"], self.d["heads"], self.d["kv_heads"]
        for layer in self.layers:
            at = layer.self_attn
            xn = layer.input_layernorm(x)
            q = rotate(at.q_norm(at.q_proj(xn).view(S, A * B, H, hd)), bcos, bsin)
            kb = rotate(at.k_norm(at.k_proj(xn).view(S, A * B, KV, hd)), bcos, bsin)
            vb = at.v_proj(xn).view(S, A * B, KV, hd)
            kc = rotate(at.k_norm(at.k_proj(ctx).view(S, C, KV, hd)), ccos, csin)
            vc = at.v_proj(ctx).view(S, C, KV, hd)
            k = torch.cat((kc, kb), dim=1).transpose(1, 2).repeat_interleave(H // KV, dim=1)
            v = torch.cat((vc, vb), dim=1).transpose(1, 2).repeat_interleave(H // KV, dim=1)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)
            x = x + at.o_proj(o.transpose(1, 2).reshape(S, A * B, H * hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x).view(S, A, B, h)


def target_embeddings(gguf_path: str) -> torch.Tensor:
    """The target's token embeddings (also its output head: SmolLM2 ties them), dequantized
    from the GGUF with gguf-py."""
    import gguf

    r = gguf.GGUFReader(gguf_path)
    names = {t.name: t for t in r.tensors}
    if "output.weight" in names:
        raise SystemExit(f"{gguf_path}: an untied output head; this trainer expects a tied one")
    t = names.get("token_embd.weight")
    if t is None:
        raise SystemExit(f"{gguf_path}: no token_embd.weight")
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))


def export_state(model: "Draft") -> dict[str, np.ndarray]:
    """The checkpoint's tensors with the feature scaling folded into `fc` (exact: `fc` is linear
    without bias), so the exported draft reads the raw hidden states as z-lab drafts do."""
    out = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out["fc.weight"] = out["fc.weight"] * model.inv_feature_rms.numpy()[None, :]
    return out


def feature_rms(records, indices, path: str) -> torch.Tensor:
    """1 / RMS per feature channel over every 4th row of the `indices` records (cached in
    `path`, so a resumed run uses the same scaling)."""
    if os.path.exists(path):
        return torch.from_numpy(np.load(path))
    acc, n = None, 0
    for i in indices:
        f = records[i][2][::4].astype(np.float64)
        acc = (f * f).sum(0) if acc is None else acc + (f * f).sum(0)
        n += f.shape[0]
    inv = (1.0 / np.sqrt(acc / max(n, 1) + 1e-6)).astype(np.float32)
    np.save(path, inv)
    return torch.from_numpy(inv)


class Batches:
    """Training batches: S sequences, A anchors each; block tokens, labels, weights."""

    def __init__(self, records, block: int, mask_token: int, gamma: float):
        self.records = records
        self.block = block
        self.mask_token = mask_token
        self.weights = torch.tensor([0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, block)])

    def anchors_of(self, rec):
        p, tokens, _ = rec
        # the first round drafts after the prompt's last token; a block needs one label at least
        return list(range(max(p - 1, 1), len(tokens) - 1))

    def make(self, items):
        """items: [(record index, [anchors])] -> tensors."""
        B = self.block
        C = max(len(self.records[i][1]) - 1 for i, _ in items)
        A = max(len(a) for _, a in items)
        S = len(items)
        width = self.records[items[0][0]][2].shape[1]
        feats = np.zeros((S, C, width), dtype=np.float32)
        anchors = np.zeros((S, A), dtype=np.int64)
        tokens = np.full((S, A, B), self.mask_token, dtype=np.int64)
        labels = np.zeros((S, A, B), dtype=np.int64)
        valid = np.zeros((S, A, B), dtype=np.float32)
        for s, (i, anc) in enumerate(items):
            _, tok, f = self.records[i]
            feats[s, : len(f)] = f
            for j, a in enumerate(anc):
                anchors[s, j] = a
                tokens[s, j, 0] = tok[a]
                for k in range(1, B):
                    if a + k < len(tok):
                        labels[s, j, k] = tok[a + k]
                        valid[s, j, k] = 1.0
        return (torch.from_numpy(feats), torch.from_numpy(anchors), torch.from_numpy(tokens),
                torch.from_numpy(labels), torch.from_numpy(valid) * self.weights)


def block_loss(model, embed, batch):
    feats, anchors, tokens, labels, weights = batch
    S, A, B = tokens.shape
    hs = model(feats, embed[tokens], anchors)
    rows = weights.reshape(-1) > 0
    logits = hs.reshape(S * A * B, -1)[rows] @ embed.T
    ce = F.cross_entropy(logits, labels.reshape(-1)[rows], reduction="none")
    w = weights.reshape(-1)[rows]
    return (ce * w).sum() / w.sum()


@torch.no_grad()
def acceptance(model, embed, batches: Batches, eval_idx, kinds):
    """Tokens per round on held-out sequences as the greedy speculative loop counts them: from
    the prompt's last token, a round at anchor a drafts B - 1 tokens, accepts the leading ones
    equal to the target's, and the next round starts after them and the target's own token;
    tokens per round = tokens / rounds. (An average over every anchor instead would weigh the
    positions a run skips through in long accepted rounds as often as the ones it stalls at, and
    overstate it.) Every anchor's drafts come from one batched pass: teacher-forced, a block
    depends only on the target's rows before it. Returns the overall and per-kind figures and the
    acceptance at each block position over the rounds that reached it."""
    B = batches.block
    per_kind: dict[str, list[int]] = {}
    reached = np.zeros(B)
    hits = np.zeros(B)
    for i in eval_idx:
        p, tok, _ = batches.records[i]
        anc = batches.anchors_of(batches.records[i])
        drafts = {}
        for chunk in range(0, len(anc), 64):
            part = anc[chunk:chunk + 64]
            if not part:
                continue
            feats, anchors, tokens, _, _ = batches.make([(i, part)])
            hs = model(feats, embed[tokens], anchors)
            pred = (hs[0, :, 1:] @ embed.T).argmax(-1).numpy()
            for a, row in zip(part, pred):
                drafts[a] = row
        a, rounds, emitted = max(p - 1, 1), 0, 0
        while a + 1 < len(tok):
            k = min(B - 1, len(tok) - 1 - a)
            acc = 0
            while acc < k and drafts[a][acc] == tok[a + 1 + acc]:
                acc += 1
            reached[1:k + 1] += 1
            hits[1:acc + 1] += 1
            rounds += 1
            emitted += acc + 1
            a += acc + 1
        kind = per_kind.setdefault(kinds[i], [0, 0])
        kind[0] += emitted
        kind[1] += rounds
    tokens = sum(v[0] for v in per_kind.values())
    rounds = sum(v[1] for v in per_kind.values())
    return (tokens / max(rounds, 1),
            {k: v[0] / max(v[1], 1) for k, v in per_kind.items()},
            (hits / np.maximum(reached, 1)).tolist())


# ---------------------------------------------------------------------------------------------
# driver


def run(cmd):
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout


def atomic_json(path: str, obj) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="working directory (resumed when it exists)")
    ap.add_argument("--xdna", default=os.path.join(REPO, "target", "release", "xdna"))
    ap.add_argument("--llama-cpp", help="llama-cpp-python sdist or llama.cpp source dir "
                    "(default: the one tools/llama-cpp/build.sh caches)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--train-prompts", type=int, default=2400)
    ap.add_argument("--eval-prompts", type=int, default=48)
    ap.add_argument("--gen-tokens", type=int, default=160)
    ap.add_argument("--prompt-min", type=int, default=24)
    ap.add_argument("--prompt-max", type=int, default=96)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--target-layers", type=int, nargs="+", default=[1, 10, 18, 27])
    ap.add_argument("--mask-token-id", type=int, default=16)
    ap.add_argument("--gamma", type=float, default=4.0, help="loss decay over block positions")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seqs", type=int, default=8, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=16, help="anchors per sequence")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                    help="bfloat16 autocast for the training passes (about 2x on CPUs with "
                    "AVX-512 BF16; the weights and the optimizer stay float32)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-minutes", type=float, default=0,
                    help="stop training (checkpointed, resumable) after this long; 0: no limit")
    ap.add_argument("--evaluate", action="store_true",
                    help="load the checkpoint in --out, print its held-out tokens per round (as "
                    "the loop counts them), write the held-out prompts as OUT/heldout-prompts.txt "
                    "for `xdna spec-acceptance --prompts`, and stop")
    ap.add_argument("--outtype", default="q8_0", choices=["f32", "f16", "bf16", "q8_0"])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    os.makedirs(a.out, exist_ok=True)

    pkg = run([a.xdna, "pack", "default"]).strip().splitlines()[-1]
    cache = os.path.dirname(pkg)
    target_gguf = os.path.join(cache, "SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(os.path.join(pkg, "config.json"), encoding="utf-8") as f:
        tcfg = json.load(f)
    shape = random_dflash.draft_shape(tcfg)

    # 1. corpus -> prompts
    prompts_path = os.path.join(a.out, "prompts.json")
    if not os.path.exists(prompts_path):
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(pkg, "tokenizer.json"))
        docs = corpus_documents(os.path.join(REPO, "Cargo.lock"))
        train_docs = [d for d in docs if not held_out(d[1], 0.05)]
        eval_docs = [d for d in docs if held_out(d[1], 0.05)]
        rng = random.Random(a.seed)
        prompts = (make_prompts(train_docs, tok, a.train_prompts, rng, a.prompt_min, a.prompt_max)
                   + make_prompts(eval_docs, tok, a.eval_prompts, rng, a.prompt_min, a.prompt_max))
        counts = {k: sum(1 for d in docs if d[0] == k) for k in ("prose", "code")}
        print(f"corpus: {len(docs)} documents ({counts}); {a.train_prompts} training and "
              f"{a.eval_prompts} held-out prompts", file=sys.stderr)
        atomic_json(prompts_path, {"seed": a.seed, "train": a.train_prompts, "prompts": prompts})
    with open(prompts_path, encoding="utf-8") as f:
        pj = json.load(f)
    prompts = pj["prompts"]
    n_train = pj["train"]

    # 2. labels
    data_path = os.path.join(a.out, "greedy-taps.bin")
    if not os.path.exists(data_path):
        ids_path = os.path.join(a.out, "prompt-ids.jsonl")
        with open(ids_path, "w", encoding="utf-8") as f:
            for p in prompts:
                f.write(json.dumps(p["ids"]) + "\n")
        t0 = time.time()
        subprocess.run([a.xdna, "greedy-taps", "--backend", "host", "--prompts", ids_path,
                        "--tokens", str(a.gen_tokens),
                        "--taps", ",".join(map(str, a.target_layers)),
                        "--output", data_path + ".tmp"], check=True)
        os.replace(data_path + ".tmp", data_path)
        print(f"labels: {time.time() - t0:.0f} s", file=sys.stderr)
    hidden, taps, records = read_greedy_taps(data_path)
    if taps != a.target_layers or hidden != shape["hidden"] or len(records) != len(prompts):
        raise SystemExit(f"{data_path}: taps {taps} / hidden {hidden} / {len(records)} records "
                         f"do not match this run ({a.target_layers}, {shape['hidden']}, "
                         f"{len(prompts)}); remove it to relabel")
    kinds = [p["kind"] for p in prompts]
    train_idx = list(range(n_train))
    eval_idx = list(range(n_train, len(prompts)))

    # 3. train
    torch.manual_seed(a.seed)
    embed = target_embeddings(target_gguf)
    scale = feature_rms(records, train_idx, os.path.join(a.out, "inv-feature-rms.npy"))
    model = Draft(shape, a.layers, len(a.target_layers), scale)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    batches = Batches(records, a.block_size, a.mask_token_id, a.gamma)
    ckpt = os.path.join(a.out, "ckpt.pt")
    curve_path = os.path.join(a.out, "curve.tsv")
    step, rng = 0, random.Random(a.seed + 1)
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        rng.setstate(state["rng"])
        print(f"resumed at step {step}", file=sys.stderr)
    else:
        with open(curve_path, "w", encoding="utf-8") as f:
            f.write("step\tseconds\ttrain_loss\theldout_tokens_per_round\tprose\tcode\n")

    def lr_at(s):
        if s < a.warmup:
            return a.lr * (s + 1) / a.warmup
        frac = (s - a.warmup) / max(1, a.steps - a.warmup)
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    def save():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "rng": rng.getstate()}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)

    def evaluate(loss_avg):
        model.eval()
        tau, by_kind, pos = acceptance(model, embed, batches, eval_idx, kinds)
        model.train()
        with open(curve_path, "a", encoding="utf-8") as f:
            f.write(f"{step}\t{time.time() - t_start + spent:.0f}\t{loss_avg:.4f}\t{tau:.4f}\t"
                    f"{by_kind.get('prose', 0):.4f}\t{by_kind.get('code', 0):.4f}\n")
        print(f"step {step}: held-out tokens per round {tau:.3f} (prose "
              f"{by_kind.get('prose', 0):.3f}, code {by_kind.get('code', 0):.3f}); per position "
              + " ".join(f"{p:.2f}" for p in pos[1:]), file=sys.stderr, flush=True)

    spent = 0.0
    if os.path.exists(os.path.join(a.out, "seconds.json")):
        with open(os.path.join(a.out, "seconds.json"), encoding="utf-8") as f:
            spent = json.load(f)["seconds"]
    t_start = time.time()
    losses = []
    if a.evaluate:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(pkg, "tokenizer.json"))
        with open(os.path.join(a.out, "heldout-prompts.txt"), "w", encoding="utf-8") as f:
            for n, i in enumerate(eval_idx):
                text = tok.decode(prompts[i]["ids"], skip_special_tokens=False)
                f.write(json.dumps({"name": f"{kinds[i]}-{n}", "prompt": text}) + "\n")
        model.eval()
        tau, by_kind, pos = acceptance(model, embed, batches, eval_idx, kinds)
        print(f"step {step}: held-out tokens per round {tau:.3f} (prose "
              f"{by_kind.get('prose', 0):.3f}, code {by_kind.get('code', 0):.3f}); acceptance "
              "at block positions " + " ".join(f"{p:.2f}" for p in pos[1:]))
        return 0
    if step == 0:
        evaluate(float("nan"))
    while step < a.steps:
        chosen = rng.sample(train_idx, a.seqs)
        items = []
        for i in chosen:
            anc = batches.anchors_of(records[i])
            items.append((i, sorted(rng.sample(anc, min(a.anchors, len(anc))))))
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            loss = block_loss(model, embed, batches.make(items))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        losses.append(loss.item())
        if step % 10 == 0:
            el = time.time() - t_start
            print(f"step {step}/{a.steps} loss {np.mean(losses[-10:]):.4f} lr {lr_at(step):.2e} "
                  f"{el / max(1, len(losses)):.2f} s/step", file=sys.stderr, flush=True)
        if step % a.ckpt_every == 0 or step == a.steps:
            save()
            atomic_json(os.path.join(a.out, "seconds.json"),
                        {"seconds": spent + time.time() - t_start})
        if step % a.eval_every == 0 or step == a.steps:
            evaluate(float(np.mean(losses[-a.eval_every:])))
        if a.max_minutes and time.time() - t_start > 60 * a.max_minutes:
            save()
            print(f"stopped at step {step} after --max-minutes {a.max_minutes}; rerun to resume",
                  file=sys.stderr)
            return 0

    # 4. export
    hf = os.path.join(a.out, "hf")
    target_dir = os.path.join(a.out, "target")
    random_dflash.write_target_dir(pkg, target_dir)
    os.makedirs(hf, exist_ok=True)
    cfg = random_dflash.draft_config(tcfg, a.layers, a.block_size, a.target_layers,
                                     a.mask_token_id)
    with open(os.path.join(hf, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
    tensors = export_state(model)
    random_dflash.write_safetensors_bf16(os.path.join(hf, "model.safetensors"), tensors)
    src = a.llama_cpp or sorted(glob.glob(os.path.join(cache, "llama.cpp",
                                                      "llama_cpp_python-*.tar.gz")))[-1]
    gguf_path = os.path.join(a.out, "draft.gguf")
    random_dflash.convert_draft(src, hf, target_dir, a.outtype, gguf_path, check={
        "layers": a.layers, "block_size": a.block_size, "target_layers": a.target_layers,
        "mask_token_id": a.mask_token_id, "expect_pre": None, "target_gguf": target_gguf})
    print(f"OK: {gguf_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
