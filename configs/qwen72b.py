r"""QeRL on Qwen2.5-72B-Instruct with BigMath on one 141 GB H200: the 72B model no 80 GB GPU holds.

Command (one H200; `:smoke` a CPU check):
  python -m qerl_jax.main --config=configs/qwen72b.py --workdir=/tmp/qerl_qwen72b
  python -m qerl_jax.main --config=configs/qwen72b.py:smoke --workdir=/tmp/qerl_smoke

What a run should show: the paper stops at 32B, so there is no published number to match; the NVFP4 weights
take about 44.5 GB, and the memory planner puts a step (16 rollout rows x 8704 KV positions, micro-batches
of one) at about 100 GB. The smoke mode (tiny random Qwen2 weights, local MATH-500 problems) only checks that
the loop runs.
"""

from configs.qwen_bigmath import bigmath_config


def get_config(arg=None):
  return bigmath_config("Qwen/Qwen2.5-72B-Instruct", arg, micro_batch_size=1, rollout_batch_size=16)
