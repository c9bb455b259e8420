#!/usr/bin/env python3
"""Runs llama.cpp's DFlash speculative decoding (`llama-speculative-simple --spec-type
draft-dflash`) greedily on a target GGUF and a DFlash draft GGUF, and writes what it drafted in
every round as JSON: the independent reference for xdna's DFlash drafter.

The run: temperature 0 (the target samples greedily), draft max = block size - 1 (15), draft
n_min 0, draft p_min 0 (nothing is cut for low confidence), one sequence, a fixed seed, -t THREADS,
verbosity 5 so that llama.cpp logs, for every round, the token ids drafted (a log line
tools/llama-cpp/build.sh adds to the example: "xdna: drafted at pos0 N: IDS"; the only record
of a generation-2 draft, whose selector logs nothing), the top-3 candidates of each drafted position
(`common_speculative_impl_draft_dflash::draft`: " - seq_id 0, draft candidate K, pos I: ID (P)")
and the verification ("accepted A/G draft tokens, the last target token is: (ID)"). The draft is
the first candidate at every position (llama.cpp's draft sampler is top-k 10 and takes the most
probable). P is the softmax over those top 10 draft logits, printed with 3 decimals, so
ln(P0/P1) is the top-2 logit margin of the draft to about +-0.01 nat (null where P1 prints as 0).

The generation is run for N + draft max + 1 tokens so that no round that starts within the first
N generated tokens has its draft cut by llama.cpp's remaining-budget rule; the JSON keeps those
rounds and the first N generated tokens.

A second run with `--spec-draft-n-max 0` is plain greedy decoding of the same target (one target
row per step, no draft token verified); the JSON says whether the speculative run generated the
same tokens (`plain_greedy_equal`).

JSON: program, version, commands, prompt_text, prompt_ids (llama-tokenize's, the same
tokenization llama-speculative-simple uses), generated_ids, stdout, eog, rounds: [{round,
pos0, id_last, drafted (the 15 draft tokens), candidates (top-3 ids per position), probs (their P),
top2_margin, n_verified, n_accepted, emitted}], plain_greedy_ids, plain_greedy_equal, draft_info
(block size, mask token, number of target layers, as llama.cpp reports them), timings.
pos0 is the position of the pending token id_last, the block's row 0; drafted[i] is the draft
for position pos0 + 1 + i.

Usage: dflash_reference.py --bin LLAMA_CPP_BIN_DIR --target TARGET.gguf --draft DRAFT.gguf
                           (--prompt TEXT | --prompt-ids 1,2,3) [-n 24] [--threads 2] [--seed 1]
                           [--ctx 1024] [--draft-max 15] [--logs DIR] [--extra ARG ...] --out OUT.json
"""

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time

CAND = re.compile(r"draft candidate\s+(\d+), pos\s+(\d+):\s+(-?\d+) \(\s*([-+0-9.eEinfa]+)\)")
CALLED = re.compile(r"called impl draft-dflash, hist size = (\d+), call_count = (\d+), gen = (\d+)")
ACCEPTED = re.compile(r"accepted (\d+)/(\d+) draft tokens, the last target token is: \((-?\d+)\)")
CLEAR = re.compile(r"clear kv cache from any extra tokens, n_past = (\d+)")
INFO = re.compile(r"block_size=(\d+), mask_token_id=(-?\d+), n_extract=(\d+)")
DRAFTED = re.compile(r"xdna: drafted at pos0 (\d+): ([-\d ]*)")
NMAX = re.compile(r"common_speculative_impl_draft_dflash: - n_max=(\d+), n_min=(\d+), p_min=([0-9.]+)")
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds, speed:\s+([0-9.]+) t/s")
ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([0-9.]+) seconds")


def run(cmd: list[str], log_dir: str | None, name: str) -> tuple[str, str, float]:
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True)
    wall = time.monotonic() - t0
    out = p.stdout.decode("utf-8", errors="replace")
    err = p.stderr.decode("utf-8", errors="replace")
    if log_dir:
        with open(os.path.join(log_dir, name + ".stdout"), "w", encoding="utf-8") as f:
            f.write(out)
        with open(os.path.join(log_dir, name + ".stderr"), "w", encoding="utf-8") as f:
            f.write(err)
    if p.returncode != 0:
        sys.stderr.write(err[-4000:])
        raise SystemExit(f"{' '.join(cmd)}: exit {p.returncode}")
    return out, err, wall


def tokenize(bin_dir: str, model: str, text: str) -> list[int]:
    out, _, _ = run([os.path.join(bin_dir, "llama-tokenize"), "-m", model, "-p", text, "--ids",
                     "--no-escape", "--log-disable"], None, "tokenize")
    return json.loads(out.strip().splitlines()[-1])


def detokenize_gpt2(bin_dir: str, model: str, ids: list[int]) -> str:
    """Text of byte-level BPE token ids (the GGUF's own vocabulary, read with gguf-py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(bin_dir)), "gguf-py"))
    import gguf  # noqa: E402  (gguf-py beside the programs: tools/llama-cpp/build.sh)

    r = gguf.GGUFReader(model)
    if r.fields["tokenizer.ggml.model"].contents() != "gpt2":
        raise SystemExit("--prompt-ids needs a byte-level BPE (gpt2) vocabulary; give --prompt")
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    # GPT-2's bytes_to_unicode, inverted
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    dec = {chr(c): b for b, c in zip(bs, cs)}
    data = bytearray()
    for i in ids:
        t = tokens[i]
        if all(ch in dec for ch in t):
            data += bytes(dec[ch] for ch in t)
        else:  # special/control tokens are stored as plain text
            data += t.encode("utf-8")
    return data.decode("utf-8")


def parse_rounds(err: str) -> tuple[list[dict], dict]:
    rounds: list[dict] = []
    cur = None
    info: dict = {}
    for line in err.splitlines():
        if m := CAND.search(line):
            k, pos, tok, p = int(m[1]), int(m[2]), int(m[3]), float(m[4])
            if cur is None or cur.get("closed"):
                cur = {"candidates": [], "probs": []}
                rounds.append(cur)
            if k == 0:
                if pos != len(cur["candidates"]):
                    raise SystemExit(f"unexpected draft position {pos} in: {line}")
                cur["candidates"].append([])
                cur["probs"].append([])
            cur["candidates"][pos].append(tok)
            cur["probs"][pos].append(p)
        elif m := CALLED.search(line):
            if cur is None or cur.get("closed"):
                # Generation 2 logs no candidates: the call opens the round.
                cur = {"candidates": [], "probs": []}
                rounds.append(cur)
            cur["hist_size"] = int(m[1])
            cur["gen"] = int(m[3])
        elif m := DRAFTED.search(line):
            if cur is None or cur.get("closed"):
                cur = {"candidates": [], "probs": []}
                rounds.append(cur)
            cur["logged_pos0"] = int(m[1])
            cur["logged"] = [int(x) for x in m[2].split()]
        elif m := ACCEPTED.search(line):
            if cur is None or cur.get("closed"):
                cur = {"candidates": [], "probs": []}  # a round without a draft
                rounds.append(cur)
            cur["n_accepted"], cur["n_verified"], cur["target_token"] = int(m[1]), int(m[2]), int(m[3])
            cur["closed"] = True
        elif m := CLEAR.search(line):
            if rounds:
                rounds[-1]["n_past_after"] = int(m[1])
        elif m := INFO.search(line):
            info.update(block_size=int(m[1]), mask_token_id=int(m[2]), n_target_layers=int(m[3]))
        elif m := NMAX.search(line):
            info.update(n_max=int(m[1]), n_min=int(m[2]), p_min=float(m[3]))
    if rounds and not rounds[-1].get("closed"):
        rounds.pop()  # drafted, never verified
    return rounds, info


def timings(err: str, wall: float) -> dict:
    t = {"wall_s": round(wall, 3)}
    if m := ENCODED.search(err):
        t["prompt_tokens"], t["prompt_s"] = int(m[1]), float(m[2])
    if m := DECODED.search(err):
        t["decoded_tokens"], t["decode_s"], t["decode_tok_per_s"] = int(m[1]), float(m[2]), float(m[3])
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", required=True, help="llama.cpp programs (tools/llama-cpp/build.sh prints it)")
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt")
    g.add_argument("--prompt-ids", help="comma-separated token ids (must round-trip through the text)")
    ap.add_argument("-n", type=int, default=24, help="generated tokens to record")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--draft-max", type=int, default=15, help="block size - 1")
    ap.add_argument("--logs", help="keep the programs' stdout/stderr in this dir")
    ap.add_argument("--extra", nargs="*", default=[], help="more llama-speculative-simple arguments")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    if a.logs:
        os.makedirs(a.logs, exist_ok=True)
    spec = os.path.join(a.bin, "llama-speculative-simple")
    if a.prompt_ids is not None:
        prompt_ids = [int(x) for x in a.prompt_ids.split(",") if x.strip()]
        text = detokenize_gpt2(a.bin, a.target, prompt_ids)
        if tokenize(a.bin, a.target, text) != prompt_ids:
            raise SystemExit(f"prompt ids do not round-trip through their text {text!r}")
    else:
        text = a.prompt
        prompt_ids = tokenize(a.bin, a.target, text)
    if len(prompt_ids) < 2:
        raise SystemExit("the prompt needs at least 2 tokens (llama-speculative-simple keeps the last one back)")

    version = subprocess.run([spec, "--version"], capture_output=True, text=True)
    version = (version.stdout + version.stderr).strip().splitlines()
    base = [spec, "-m", a.target, "-md", a.draft, "--spec-type", "draft-dflash",
            "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "--temp", "0",
            "--seed", str(a.seed), "-t", str(a.threads), "-c", str(a.ctx), "--no-escape",
            "-p", text, "-lv", "5", *a.extra]
    cmd_spec = base + ["--spec-draft-n-max", str(a.draft_max), "-n", str(a.n + a.draft_max + 1)]
    cmd_plain = base + ["--spec-draft-n-max", "0", "-n", str(a.n)]

    out, err, wall = run(cmd_spec, a.logs, "speculative")
    raw, info = parse_rounds(err)
    if info.get("n_max") != a.draft_max:
        raise SystemExit(f"llama.cpp drafts {info.get('n_max')} tokens, not {a.draft_max}: {info}")

    rounds = []
    generated: list[int] = []
    eog = False
    pos0 = len(prompt_ids) - 1
    id_last = prompt_ids[-1]
    for i, r in enumerate(raw):
        if len(generated) >= a.n:
            break
        drafted = r.get("logged", [c[0] for c in r["candidates"]])
        if r["candidates"] and drafted != [c[0] for c in r["candidates"]]:
            raise SystemExit(f"round {i}: the logged draft differs from the first candidates")
        if r.get("logged_pos0", pos0) != pos0:
            raise SystemExit(f"round {i}: drafted at pos0 {r['logged_pos0']}, expected {pos0}")
        if r.get("hist_size", pos0) != pos0:
            raise SystemExit(f"round {i}: llama.cpp's history is {r['hist_size']} tokens, expected {pos0}")
        if drafted and len(drafted) != a.draft_max:
            raise SystemExit(f"round {i}: {len(drafted)} drafted positions, expected {a.draft_max}")
        if r["n_verified"] != len(drafted):
            raise SystemExit(f"round {i}: {r['n_verified']} of {len(drafted)} drafts verified (budget cut)")
        n_acc = r["n_accepted"]
        emitted = drafted[:n_acc] + [r["target_token"]]
        margins = [round(math.log(p[0] / p[1]), 4) if len(p) > 1 and p[1] > 0 else None for p in r["probs"]]
        rounds.append({
            "round": i,
            "pos0": pos0,
            "id_last": id_last,
            "drafted": drafted,
            "candidates": r["candidates"],
            "probs": r["probs"],
            "top2_margin": margins,
            "n_verified": r["n_verified"],
            "n_accepted": n_acc,
            "emitted": emitted,
        })
        if "n_past_after" in r and r["n_past_after"] != pos0 + n_acc + 1:
            raise SystemExit(f"round {i}: n_past {r['n_past_after']} != {pos0 + n_acc + 1}")
        generated += emitted
        pos0 += n_acc + 1
        id_last = emitted[-1]
    if len(generated) < a.n:
        eog = True  # llama-speculative-simple stops at an end-of-generation token
    generated = generated[: a.n]

    out_plain, err_plain, wall_plain = run(cmd_plain, a.logs, "plain")
    plain = [int(m[3]) for m in ACCEPTED.finditer(err_plain)][: a.n]

    result = {
        "program": "llama-speculative-simple",
        "version": version,
        "command": cmd_spec,
        "command_plain": cmd_plain,
        "target": os.path.abspath(a.target),
        "draft": os.path.abspath(a.draft),
        "draft_info": info,
        "prompt_text": text,
        "prompt_ids": prompt_ids,
        "n": a.n,
        "generated_ids": generated,
        "stdout": out.strip(),  # the prompt and the whole (longer) speculative run, as text
        "eog": eog,
        "rounds": rounds,
        "plain_greedy_ids": plain,
        "plain_greedy_equal": plain == generated,
        "timings": {"speculative": timings(err, wall), "plain": timings(err_plain, wall_plain)},
    }
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    acc = sum(r["n_accepted"] for r in rounds)
    print(f"{a.out}: {len(rounds)} rounds, {acc} drafts accepted, {len(generated)} tokens; "
          f"plain greedy {'equal' if plain == generated else 'DIFFERENT'}", file=sys.stderr)
    return 0 if plain == generated else 1


if __name__ == "__main__":
    sys.exit(main())
