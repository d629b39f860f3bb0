"""Rewards for math reasoning RL: GSM8K exact answer, the think/answer format, MATH equivalence.

Every reward is a plain function (completion, gold) -> float, registered in `REWARDS` by name; a config
picks rewards and weights by name and `compute_rewards` scores a whole rollout batch with them.
"""

from typing import Callable, Dict, Mapping, Sequence, Tuple

import numpy as np

from qerl_jax.rewards.extract import extract_final_answer, last_boxed, last_number, parse_number
from qerl_jax.rewards.scoring import (COUNTERS, FORMAT_REWARD, GSM8K_CORRECT, MATH_CORRECT, format_reward,
                                      gsm8k_correctness, has_think_answer_format, math_equivalence,
                                      reset_counters)

RewardFn = Callable[[str, str], float]

REWARDS: Dict[str, RewardFn] = {
  "gsm8k_correctness": gsm8k_correctness,
  "gsm8k_lenient": lambda completion, gold: gsm8k_correctness(completion, gold, last_number_fallback=True),
  "format": lambda completion, gold: format_reward(completion),
  "math_equivalence": math_equivalence,
}

# The paper's reward sets (the per-function magnitudes 2.0 / 0.2 / 1.0 live in the functions).
GSM8K_WEIGHTS = {"gsm8k_correctness": 1.0, "format": 1.0}
MATH_WEIGHTS = {"math_equivalence": 1.0, "format": 1.0}
# The offline arithmetic task with a small model: credit an unmarked last number while the format
# reward pulls the model towards <think>/<answer>.
ARITHMETIC_WEIGHTS = {"gsm8k_lenient": 1.0, "format": 1.0}


def compute_rewards(completions: Sequence[str], golds: Sequence[str],
                    weights: Mapping[str, float]) -> Tuple[np.ndarray, Dict[str, np.ndarray]]:
  """Score a batch: total_B = sum over names of weight * REWARDS[name](completion, gold).

  Args:
    completions: B decoded completions.
    golds: B gold answers (repeat each prompt's gold G times for a group of G).
    weights: {reward name: weight}; names must be keys of REWARDS. A weight of 0 skips the function.

  Returns:
    (total float32[B], {name: float32[B] unweighted per-function rewards}).
  """
  unknown = sorted(set(weights) - set(REWARDS))
  if unknown:
    raise ValueError(f"unknown rewards {unknown}; known: {sorted(REWARDS)}")
  if not weights:
    raise ValueError(f"{weights=} must name at least one reward")
  if len(completions) != len(golds):
    raise ValueError(f"{len(completions)=} must equal {len(golds)=}")
  total_B = np.zeros(len(completions), np.float32)
  per_fn = {}
  for name, weight in weights.items():
    if weight == 0:
      continue
    fn = REWARDS[name]
    values_B = np.array([fn(c, g) for c, g in zip(completions, golds)], np.float32)
    per_fn[name] = values_B
    total_B += np.float32(weight) * values_B
  return total_B, per_fn


__all__ = [
  "ARITHMETIC_WEIGHTS",
  "COUNTERS",
  "FORMAT_REWARD",
  "GSM8K_CORRECT",
  "GSM8K_WEIGHTS",
  "MATH_CORRECT",
  "MATH_WEIGHTS",
  "REWARDS",
  "compute_rewards",
  "extract_final_answer",
  "format_reward",
  "gsm8k_correctness",
  "has_think_answer_format",
  "last_boxed",
  "last_number",
  "math_equivalence",
  "parse_number",
  "reset_counters",
]
