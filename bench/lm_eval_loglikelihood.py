"""lm-eval's ``local-completions`` model against ``kvledger up``: a small multiple-choice
log-likelihood task from a local file, and the same scores computed from the model directly.

lm-eval is a test dependency (``tests/e2e/test_lm_eval.py`` runs this in ``make test``); from
the project's environment, or with one installed apart:

    python -m bench.lm_eval_loglikelihood                                       # ~1 min
    LM_EVAL=/tmp/lmvenv/bin/lm_eval python -m bench.lm_eval_loglikelihood

What it checks: lm-eval scores each choice with ``echo`` + ``logprobs`` completions (the sum of
the prompt logprobs over the continuation's tokens, served by the gateway, the prefix cache on:
the three choices of a question share their context); this script tokenizes every pair exactly
as lm-eval did (its own ``_encode_pair``, run in its environment), computes the same sums from the
loaded checkpoint in one cold forward each, and compares: ``loglikelihoods_equal`` (every value,
bit for bit as JSON floats), ``max_abs_diff``, and the task's accuracy both ways.
"""

from __future__ import annotations

import glob
import json
import random
import subprocess
import sys
from pathlib import Path

import torch

from bench.tiny_stack import external_tool, metric, tiny_stack

WORDS = ["ledger", "block", "replica", "lease", "worker", "tenant", "prefix", "cache"]
TASK = """task: kvl_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
ENCODE = """
import json, sys
from lm_eval.models.openai_completions import LocalCompletionsAPI

def encode(tokenizer, pairs):
    lm = LocalCompletionsAPI(model="model", base_url="http://127.0.0.1:9/v1/completions",
                             tokenizer_backend="huggingface", tokenizer=tokenizer)
    return [lm._encode_pair(c, x) for c, x in pairs]

if __name__ == "__main__":
    print(json.dumps(encode(sys.argv[1], json.load(open(sys.argv[2])))))
"""


def write_task(d: Path, n: int = 12) -> Path:
    rng = random.Random(3)
    with open(d / "data.jsonl", "w") as f:
        for _ in range(n):
            q = "Q: which word follows " + " ".join(rng.choice(WORDS) for _ in range(4)) + "? A:"
            f.write(json.dumps({"question": q, "choices": [" " + w for w in rng.sample(WORDS, 3)],
                                "answer": rng.randrange(3)}) + "\n")
    (d / "tasks").mkdir()
    (d / "tasks" / "kvl_tiny.yaml").write_text(TASK.format(data=d / "data.jsonl"))
    return d / "tasks"


def main(lm_eval: str | None = None) -> dict:
    """Run it (``lm_eval``: the harness's executable; default ``$LM_EVAL`` or the one on PATH)."""
    lm_eval = lm_eval or external_tool("LM_EVAL", "lm_eval")
    with tiny_stack(1, "kvl-bench-lm-eval-") as (d, model_dir, stack):
        tasks = write_task(d)
        env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
        run = subprocess.run([lm_eval, "run", "--model", "local-completions", "--model_args",
                              f"model=model,base_url={stack['gateway_url']}/v1/completions,tokenizer_backend=huggingface,"
                              f"tokenizer={model_dir},num_concurrent=1,max_retries=1",
                              "--tasks", "kvl_tiny", "--include_path", str(tasks), "--log_samples",
                              "--output_path", str(d / "out")], capture_output=True, text=True, timeout=900, env=env)
        if run.returncode != 0:
            raise SystemExit(f"bench.lm_eval_loglikelihood: lm_eval failed: {run.stderr[-3000:]}")
        print(run.stdout[-1500:])
        samples = [json.loads(line) for f in glob.glob(str(d / "out" / "**" / "samples_*.jsonl"), recursive=True)
                   for line in open(f)]
        pairs, served = [], []
        for s in sorted(samples, key=lambda s: s["doc_id"]):
            for k in range(len(s["doc"]["choices"])):
                a = s["arguments"][f"gen_args_{k}"]
                pairs.append((a["arg_0"], a["arg_1"]))
                served.append(float(s["resps"][k][0][0]))
        (d / "pairs.json").write_text(json.dumps(pairs))
        encoded = encode_pairs(Path(lm_eval), model_dir, d / "pairs.json", env)
        cached = metric(stack["worker_urls"][0], "kvl_worker_prefix_cache_validated_hits_total")
        direct = direct_loglikelihoods(model_dir, encoded)
    diffs = [abs(a - b) for a, b in zip(served, direct)]

    def acc(values: list[float]) -> float:
        right, i = 0, 0
        for s in sorted(samples, key=lambda s: s["doc_id"]):
            k = len(s["doc"]["choices"])
            right += max(range(k), key=lambda j: values[i + j]) == int(s["doc"]["answer"])
            i += k
        return right / len(samples)

    result = {"bench": "lm_eval_loglikelihood", "questions": len(samples), "loglikelihoods": len(served),
              "lm_eval_acc": acc(served), "direct_acc": acc(direct),
              "loglikelihoods_equal": served == direct, "max_abs_diff": max(diffs) if diffs else None,
              "worker_cached_prompt_tokens": cached}
    print(json.dumps(result))
    return result


def encode_pairs(lm_eval: Path, model_dir: Path, pairs: Path, env: dict) -> list:
    """The (context, continuation) pairs tokenized as lm-eval's model tokenizes them: in this
    process when the harness is installed in this interpreter's environment (``make test``: a
    second interpreter importing transformers cost ~8 s), else by the harness's own Python."""
    python = lm_eval.parent / "python"
    if python.resolve() == Path(sys.executable).resolve():
        scope: dict = {"__name__": "kvl_lm_eval_encode"}
        exec(ENCODE, scope)
        return scope["encode"](str(model_dir), json.loads(pairs.read_text()))
    enc = subprocess.run([str(python), "-c", ENCODE, str(model_dir), str(pairs)], capture_output=True,
                         text=True, timeout=300, env=env)
    if enc.returncode != 0:
        raise SystemExit(f"bench.lm_eval_loglikelihood: tokenizing as lm-eval failed: {enc.stderr[-2000:]}")
    return json.loads(enc.stdout.strip().splitlines()[-1])


def direct_loglikelihoods(model_dir: Path, encoded: list) -> list[float]:
    """Sum of log-softmax over the continuation's tokens, from one cold forward of context +
    continuation on the checkpoint (the worker's own model code, the same dtype)."""
    from worker.model.checkpoint import load_checkpoint

    # NOTE: one intra-op thread, as the worker runs (KVL_TORCH_THREADS): more threads split the
    # matmuls' reductions differently, and the bits would differ
    torch.set_num_threads(1)
    model = load_checkpoint(model_dir).model
    out = []
    with torch.inference_mode():
        for context, continuation in encoded:
            ids = list(context) + list(continuation)
            cap = -(-len(ids) // 16) * 16
            logits = model.prefill(ids, model.new_state(16, cap), chunk_blocks=1, logits="all")
            lp = torch.log_softmax(logits.float(), -1)
            n = len(context)
            out.append(sum(float(lp[n - 1 + j, t]) for j, t in enumerate(continuation)))
    return out


if __name__ == "__main__":
    main()
