"""The paper's BigMath recipe for Qwen2.5-Instruct models (shared by qwen14b.py and qwen32b.py)."""

from __future__ import annotations

import ml_collections

from configs import common


def bigmath_config(model_id: str, arg: str | None, *, micro_batch_size: int,
                   rollout_batch_size: int) -> ml_collections.ConfigDict:
  """BigMath (levels 3-5) -> MATH-500, 16 samples per prompt, 8192-token responses, math-verify reward.

  arg: "smoke" and/or one of bf16 | nf4 | mxfp4 | nvfp4 (comma-separated), see common.parse_arg.
  """
  words = common.parse_arg(arg)
  c = common.recipe()
  c.model.path = model_id
  c.data.name = "bigmath"
  c.rollout.samples_per_prompt = 16
  c.rollout.max_new_tokens = 8192
  c.rollout.batch_size = rollout_batch_size
  c.train.batch_size = 128
  c.train.micro_batch_size = micro_batch_size
  c.rewards = ml_collections.ConfigDict({"math_equivalence": 1.0, "format": 1.0})
  c.correctness_reward = "math_equivalence"
  c.eval.dataset = "math500"
  c.eval.max_new_tokens = 8192
  for quant in words & set(common.QUANTS):
    common.apply_quant(c, quant)
  if "smoke" in words:
    common.shrink_to_smoke(c, "qwen2")
    # BigMath comes from the hub; the offline smoke run keeps the MATH reward on local MATH-500 problems.
    c.data.name = "math500"
  return c
