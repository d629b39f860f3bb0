r"""Initial policy entropy and reward per base format, before any training (the paper's "quantization noise
raises entropy" figure).

Each format (bf16, NF4, MXFP4, NVFP4) loads the same model, samples the same prompts with the same keys,
and reports the mean token entropy of its sampled completions (the exact entropy of the full next-token
distribution at each sampled position, averaged over completion tokens), the sampled tokens' mean negative
log-prob (a Monte Carlo estimate of the same quantity), and the reward and accuracy of the completions.

Commands:
  python -m experiments.entropy                    # SmolLM2-135M, 16 prompts x 8 samples, 2 CPU cores: ~5 min
  python -m experiments.entropy --smoke            # CI: tiny random model, 2 prompts x 4 samples
Writes one JSON line per format to --out (default experiments/results/entropy.jsonl, replaced per run).

The paper reports higher initial entropy under NVFP4 / NF4 than bf16 on 7B+ models. Weights are quantized
from the GGUF's Q4_1 values, so "bf16" here is the Q4_1 model itself, not the original bf16 checkpoint.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Sequence

if __package__ in (None, ""):  # `python experiments/entropy.py`: make the repo root importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs import common  # noqa: E402
from configs import smollm2_135m  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "entropy.jsonl")
FORMATS = common.QUANTS  # bf16, nf4, mxfp4, nvfp4


def format_config(quant: str, *, smoke: bool, seed: int = 0, num_prompts: int | None = None,
                  samples: int | None = None):
  """The embedded default (or its smoke shrink) under base format `quant`, sized for one measurement."""
  if quant not in FORMATS:
    raise ValueError(f"{quant=} must be one of {FORMATS}")
  c = smollm2_135m.get_config("smoke" if smoke else None)
  c.model.quant = quant
  c.seed = seed
  c.rollout.temperature = 1.0  # the policy's own distribution: entropy at the paper's training temperature
  c.rollout.samples_per_prompt = samples or (4 if smoke else 8)
  c.train.batch_size = (num_prompts or (2 if smoke else 16)) * c.rollout.samples_per_prompt
  return c


@functools.lru_cache(maxsize=None)
def _entropy_fn(graphdef, chunk: int, vocab_chunk: int, temperature: float):
  from qerl_jax.train.policy import completion_logprobs, merge  # pylint: disable=import-outside-toplevel

  def fn(params, frozen, prompt_BxP, prompt_valid_BxP, completion_BxN):
    model = merge(graphdef, params, frozen)
    return completion_logprobs(model, prompt_BxP, prompt_valid_BxP, completion_BxN, chunk=chunk,
                               vocab_chunk=vocab_chunk, temperature=temperature)

  return jax.jit(fn)


def measure(config) -> dict:
  """Samples config.train.batch_size completions of the first prompts and returns entropy and reward."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from qerl_jax.model import split_params  # pylint: disable=import-outside-toplevel
  from qerl_jax.rewards import compute_rewards  # pylint: disable=import-outside-toplevel
  from qerl_jax.rollout.generate import default_stop_ids  # pylint: disable=import-outside-toplevel
  from qerl_jax.rollout.sampling import SamplingParams  # pylint: disable=import-outside-toplevel
  from qerl_jax.train import rollouts as rollouts_lib  # pylint: disable=import-outside-toplevel
  from qerl_jax.train import setup  # pylint: disable=import-outside-toplevel

  c = config
  model, tokenizer = setup.build_model(c)
  graphdef, trainable, frozen = split_params(model)
  # The same numbers the quantized matmul uses, stored dequantized: every format then shares one compiled
  # rollout and one compiled entropy program (and CPU has no fused 4-bit kernel anyway).
  frozen = setup.dequantize_frozen(frozen, model.config.dtype)
  params = trainable.to_pure_dict()
  group = c.rollout.samples_per_prompt
  examples = setup.load_train_dataset(c, tokenizer).examples[:c.train.batch_size // group]
  encoded = setup.encode_examples(examples, tokenizer, setup.system_prompt(c))
  prompts = [ids for ids in encoded for _ in range(group)]
  golds = [ex.gold_answer for ex in examples for _ in range(group)]
  out = rollouts_lib.generate(
    graphdef, nnx.merge_state(nnx.State(params), frozen), prompts, tokenizer=tokenizer,
    key=jax.random.key(c.seed), norm_noise=None, sampling=SamplingParams(temperature=c.rollout.temperature),
    max_new_tokens=c.rollout.max_new_tokens, stop_ids=default_stop_ids(tokenizer),
    pad_id=setup.pad_id(tokenizer), prompt_bucket=c.rollout.prompt_bucket)
  fn = _entropy_fn(graphdef, c.train.logprob_chunk, c.train.vocab_chunk, float(c.rollout.temperature))
  _, entropy_BxN = jax.device_get(fn(params, frozen, jnp.asarray(out.prompt_BxP),
                                     jnp.asarray(out.prompt_valid_BxP), jnp.asarray(out.completion_BxN)))
  mask_BxN = out.mask_BxN.astype(bool)
  rewards_B, per_fn = compute_rewards(out.texts, golds, dict(c.rewards))
  return {
    "entropy": float(np.asarray(entropy_BxN)[mask_BxN].mean()),
    "first_token_entropy": float(np.asarray(entropy_BxN)[:, 0].mean()),
    "sampled_nll": float(-np.asarray(out.logprobs_BxN)[mask_BxN].mean()),
    "reward/mean": float(np.mean(rewards_B)),
    "accuracy": float((per_fn[c.correctness_reward] > 0).mean()),
    "response_length/mean": float(out.lengths_B.mean()),
    "num_completions": len(prompts),
  }


def run(formats: Sequence[str], *, smoke: bool, out: str, seed: int = 0, num_prompts: int | None = None,
        samples: int | None = None, log=print) -> list[dict]:
  """Measures every format in `formats` and writes their lines to `out` (replacing it); returns them."""
  from experiments import provenance  # pylint: disable=import-outside-toplevel
  commit = provenance.commit()
  rows = []
  for quant in formats:
    config = format_config(quant, smoke=smoke, seed=seed, num_prompts=num_prompts, samples=samples)
    row = {"format": quant, "seed": seed, "smoke": smoke, "commit": commit, **measure(config)}
    log(json.dumps(row))
    rows.append(row)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  return rows


def main(argv: Sequence[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--smoke", action="store_true", help="tiny random model (CI)")
  p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset of " + ",".join(FORMATS))
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--prompts", type=int, default=None, help="prompts (default 16; smoke 2)")
  p.add_argument("--samples", type=int, default=None, help="completions per prompt (default 8; smoke 4)")
  p.add_argument("--out", default="")
  args = p.parse_args(argv)
  formats = [f.strip() for f in args.formats.split(",") if f.strip()]
  out = args.out or (RESULTS.replace(".jsonl", "_smoke.jsonl") if args.smoke else RESULTS)
  rows = run(formats, smoke=args.smoke, out=out, seed=args.seed, num_prompts=args.prompts, samples=args.samples)
  print(f"{'format':<8}{'entropy':>10}{'1st tok':>10}{'NLL':>10}{'reward':>10}{'acc':>8}")
  for r in rows:
    print(f"{r['format']:<8}{r['entropy']:>10.4f}{r['first_token_entropy']:>10.4f}{r['sampled_nll']:>10.4f}"
          f"{r['reward/mean']:>10.4f}{r['accuracy']:>8.3f}")
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
