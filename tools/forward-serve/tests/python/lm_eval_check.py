"""Run two tiny local lm-eval tasks against forward-serve through lm-eval's `local-completions` model.

usage: lm_eval_check.py BASE_URL TOKENIZER_DIR [--model ID] [--string-prompts]
  BASE_URL       e.g. http://127.0.0.1:8080 (/v1/completions is appended)
  TOKENIZER_DIR  Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json);
                 its name is the default served model id (a package directory's name).
  --string-prompts  send prompts as text (tokenized_requests=False) instead of token-id lists.

Prints one JSON object on stdout: every loglikelihood request lm-eval made (context, continuation,
the token ids lm-eval split them into, and the log-likelihood / is_greedy it recorded) and every
generate_until output. Exits non-zero if a task fails or a result is malformed.
Needs lm-eval[api]==0.4.13 and transformers; works offline (nothing is fetched from the hub).
"""
import argparse
import atexit
import contextlib
import json
import math
import os
import pathlib
import shutil
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent / "lm_eval_tasks"
TASKS = {"fs_tiny_mc": "tiny_mc.jsonl", "fs_tiny_gen": "tiny_gen.jsonl"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("base_url")
    ap.add_argument("tokenizer_dir")
    ap.add_argument("--model", help="served model id (default: name of TOKENIZER_DIR)")
    ap.add_argument("--string-prompts", action="store_true")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="lm_eval_check_")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    # Offline everywhere; set before `datasets`/`transformers` are imported (they read these at import).
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                      HF_EVALUATE_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
                      HF_DATASETS_CACHE=os.path.join(tmp, "datasets"),  # no stale cache across runs
                      TOKENIZERS_PARALLELISM="false")
    import yaml
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    # `datasets` resolves data_files against the cwd, so write copies of the task yamls
    # whose data_files point at the absolute jsonl paths.
    task_dir = os.path.join(tmp, "tasks")
    os.makedirs(task_dir)
    for name, data in TASKS.items():
        cfg = yaml.safe_load((HERE / f"{name}.yaml").read_text())
        cfg["dataset_kwargs"]["data_files"] = str(HERE / data)
        with open(os.path.join(task_dir, f"{name}.yaml"), "w") as f:
            yaml.safe_dump(cfg, f)

    tokdir = os.path.abspath(args.tokenizer_dir)
    model_args = {
        "model": args.model or os.path.basename(os.path.normpath(tokdir)),
        "base_url": args.base_url.rstrip("/") + "/v1/completions",  # posted to as is
        "tokenizer_backend": "huggingface",  # "auto" would probe BASE_URL/tokenizer_info first
        "tokenizer": tokdir,
        "tokenized_requests": not args.string_prompts,
        "batch_size": 1,  # else several prompts go in one request's `prompt`
        "num_concurrent": 1,
        "max_retries": 2,
        "timeout": 120,
    }
    lm = get_model("local-completions")(**model_args)
    tm = TaskManager(include_path=task_dir, include_defaults=False)
    with contextlib.redirect_stdout(sys.stderr):  # keep stdout for our JSON only
        res = simple_evaluate(model=lm, tasks=list(TASKS), task_manager=tm, log_samples=True,
                              batch_size=1, bootstrap_iters=0)

    out = {"model_args": model_args, "loglikelihood": [], "generate_until": [], "metrics": {}}
    problems = []
    for task in TASKS:
        if task not in res["results"] or task not in res["samples"]:
            problems.append(f"{task}: no results")
            continue
        out["metrics"][task] = {k: v for k, v in res["results"][task].items() if k != "alias"}
        for s in sorted(res["samples"][task], key=lambda s: s["doc_id"]):
            for (ctx, arg), resp in zip(s["arguments"], s["resps"]):
                if task == "fs_tiny_gen":
                    out["generate_until"].append({"doc_id": s["doc_id"], "context": ctx,
                                                  "until": arg["until"], "output": resp[0]})
                    # local-completions uses `text` verbatim: the server must cut at `stop`
                    if any(u in resp[0] for u in arg["until"]):
                        problems.append(f"{task} doc {s['doc_id']}: stop sequence in {resp[0]!r}")
                    continue
                ll, greedy = resp[0]
                # the ids lm-eval sent: context_ids + continuation_ids (trailing spaces of the
                # context move into the continuation before encoding)
                ctx_ids, cont_ids = lm._encode_pair(ctx, arg)
                out["loglikelihood"].append({"doc_id": s["doc_id"], "context": ctx, "continuation": arg,
                                             "context_ids": ctx_ids, "continuation_ids": cont_ids,
                                             "loglikelihood": ll, "is_greedy": greedy})
                if not (isinstance(ll, float) and math.isfinite(ll) and ll < 0.0):
                    # exactly 0.0 usually means lm-eval's [ctxlen:-1] slice came up empty: the
                    # reply lacked the one generated token that follows the echoed prompt
                    problems.append(f"{task} doc {s['doc_id']}: bad loglikelihood {ll!r}")
    n_docs = {t: sum(1 for _ in open(HERE / d)) for t, d in TASKS.items()}
    if len(out["generate_until"]) != n_docs["fs_tiny_gen"]:
        problems.append(f"expected {n_docs['fs_tiny_gen']} generations, got {len(out['generate_until'])}")
    if len({r["doc_id"] for r in out["loglikelihood"]}) != n_docs["fs_tiny_mc"]:
        problems.append("some multiple-choice docs have no loglikelihood")
    out["problems"] = problems
    # one record per line: readable when a test prints it, still a single JSON document
    print("{" + ",\n".join(
        f"{json.dumps(k)}: " + ("[\n" + ",\n".join(json.dumps(r) for r in v) + "\n]"
                               if isinstance(v, list) and v else json.dumps(v))
        for k, v in out.items()) + "}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
