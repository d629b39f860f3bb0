"""The paper's GSM8K recipe for Qwen2.5-Instruct models (shared by qwen3b.py and qwen7b.py)."""

from __future__ import annotations

import ml_collections

from configs import common


def gsm8k_config(model_id: str, arg: str | None) -> ml_collections.ConfigDict:
  """GSM8K train -> GSM8K test, 8 samples per prompt, 4096-token responses, NVFP4 + LoRA r32 + AQN.

  arg: "smoke" and/or one of bf16 | nf4 | mxfp4 | nvfp4 (comma-separated), see common.parse_arg.
  """
  words = common.parse_arg(arg)
  c = common.recipe()
  c.model.path = model_id
  c.data.name = "gsm8k"
  c.rollout.samples_per_prompt = 8
  c.rollout.max_new_tokens = 4096
  c.train.batch_size = 128
  # 128 rows per rollout call: there the fused kernels lose to XLA's bf16 dot, so the rollout dequantizes the
  # base once into a bf16 copy (13 GB at 7B by the planner, which puts the 7B recipe at 73.9 GB) and
  # holds bf16 adapters. One H200, 7B (41186a8 / 73f3cb7): 13607.7 against 9820.6 tok/s at 128 rows (bf16
  # LoRA 13842.6); GRPO step 19.96 s against 22.20 (experiments/RESULTS.md).
  c.model.rollout_base_dtype = "bfloat16"
  c.model.rollout_lora_dtype = "bfloat16"
  c.eval.dataset = "gsm8k"
  c.eval.max_new_tokens = 4096
  for quant in words & set(common.QUANTS):
    common.apply_quant(c, quant)
  if "smoke" in words:
    common.shrink_to_smoke(c, "qwen2")
  return c
