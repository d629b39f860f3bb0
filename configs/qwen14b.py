r"""QeRL on Qwen2.5-14B-Instruct with BigMath (NVFP4 base + LoRA rank 32 + AQN, 16 samples per prompt).

Command (one H200; `:bf16` is the bf16-LoRA baseline, `:smoke` a CPU check):
  python -m qerl_jax.main --config=configs/qwen14b.py --workdir=/tmp/qerl_qwen14b
  python -m qerl_jax.main --config=configs/qwen14b.py --config.mode=eval --workdir=/tmp/qerl_qwen14b
  python -m qerl_jax.main --config=configs/qwen14b.py:smoke --workdir=/tmp/qerl_smoke

What a run should show: MATH-500 accuracy 80.2 in the paper (bf16 LoRA 81.0, full fine-tuning 83.2).
BigMath is downloaded from the hub (open-r1/Big-Math-RL-Verified-Processed, levels 3-5). The smoke mode
(tiny random Qwen2 weights, local MATH-500 problems) only checks that the loop runs.
"""

from configs.qwen_bigmath import bigmath_config


def get_config(arg=None):
  # 32 rows x 8704 KV positions take 55 GB of KV cache: the memory planner puts the step at about 72 GB.
  return bigmath_config("Qwen/Qwen2.5-14B-Instruct", arg, micro_batch_size=2, rollout_batch_size=32)
