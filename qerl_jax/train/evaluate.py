"""Evaluation: pass@1 and pass@k on GSM8K test / MATH-500 (or the arithmetic task) with the rollout engine.

Each problem gets `eval.num_samples` completions at the paper's evaluation sampling (temperature 0.6,
top-p 0.95), scored by the config's reward functions; a completion is correct when the correctness
reward is > 0. pass@k uses the unbiased estimator of Chen et al. (2021), 1 - C(n - c, k) / C(n, k).
The report goes to <out_dir>/report.json and every completion to <out_dir>/samples.jsonl.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time

import jax
import numpy as np
from flax import nnx

from qerl_jax.rewards import compute_rewards
from qerl_jax.rollout.generate import default_stop_ids
from qerl_jax.rollout.sampling import SamplingParams
from qerl_jax.train import rollouts as rollouts_lib
from qerl_jax.train import setup

EVAL_KEY_SALT = 0x3E7A1


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
  """Unbiased pass@k of one problem with `num_correct` of `num_samples` correct."""
  if not 1 <= k <= num_samples:
    raise ValueError(f"{k=} must be in [1, {num_samples=}]")
  if num_samples - num_correct < k:
    return 1.0
  return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def pass_ks(num_samples: int) -> list[int]:
  """k = 1, 2, 4, ... up to num_samples (and num_samples itself)."""
  ks, k = [], 1
  while k < num_samples:
    ks.append(k)
    k *= 2
  return ks + [num_samples]


def run_eval(model, tokenizer, config, out_dir: str, *, step: int | None = None) -> dict:
  """Evaluates `model` on config.eval's dataset; writes report.json and samples.jsonl under out_dir."""
  e = config.eval
  start = time.perf_counter()
  dataset = setup.load_eval_dataset(config, tokenizer)
  system = setup.system_prompt(config)
  encoded = setup.encode_examples(dataset.examples, tokenizer, system)
  n = e.num_samples
  rows = [(i, s) for i in range(len(encoded)) for s in range(n)]
  prompts = [encoded[i] for i, _ in rows]
  # One prompt bucket for the whole set (padding every prompt to the longest): one compiled program.
  longest = max(len(p) for p in prompts)
  bucket = rollouts_lib.bucket_length(longest, config.rollout.prompt_bucket)
  graphdef, state = nnx.split(model)
  key = jax.random.fold_in(jax.random.PRNGKey(config.seed), EVAL_KEY_SALT)
  out = rollouts_lib.generate(
    graphdef, state, prompts, tokenizer=tokenizer, key=key, norm_noise=None,
    sampling=SamplingParams(temperature=e.temperature, top_p=e.top_p), max_new_tokens=e.max_new_tokens,
    stop_ids=default_stop_ids(tokenizer), pad_id=setup.pad_id(tokenizer), prompt_bucket=bucket,
    chunk=min(e.batch_size, len(prompts)))
  golds = [dataset.examples[i].gold_answer for i, _ in rows]
  total_B, per_fn = compute_rewards(out.texts, golds, dict(config.rewards))
  correct_B = per_fn[config.correctness_reward] > 0
  correct_per_problem = correct_B.reshape(len(encoded), n).sum(axis=1)
  report = {
    "dataset": dataset.name, "step": step, "num_problems": len(encoded), "num_samples": n,
    "temperature": e.temperature, "top_p": e.top_p, "max_new_tokens": e.max_new_tokens,
    "mean_reward": float(total_B.mean()),
    "mean_response_length": float(out.lengths_B.mean()),
    "truncated_frac": float(1.0 - out.finished_B.mean()),
    "seconds": time.perf_counter() - start,
  }
  for k in pass_ks(n):
    report[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct_per_problem]))
  for name, values in per_fn.items():
    report[f"reward/{name}"] = float(values.mean())
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "samples.jsonl"), "w") as f:
    for row, ((i, s), text) in enumerate(zip(rows, out.texts)):
      ex = dataset.examples[i]
      f.write(json.dumps({
        "problem": i, "sample": s, "uid": ex.uid, "question": ex.question, "gold": ex.gold_answer,
        "completion": text, "correct": bool(correct_B[row]), "reward": float(total_B[row]),
        "length": int(out.lengths_B[row]), "finished": bool(out.finished_B[row])}) + "\n")
  with open(os.path.join(out_dir, "report.json"), "w") as f:
    json.dump(report, f, indent=2)
  logging.info("eval %s: %s", out_dir, {k: v for k, v in report.items() if k.startswith("pass@")})
  return report
