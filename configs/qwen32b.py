r"""QeRL on Qwen2.5-32B-Instruct with BigMath: the paper's headline, RL of a 32B model on one GPU.

Command (one H200 or H100-80GB; `:bf16` for the bf16-LoRA baseline on a larger machine, `:smoke` a CPU
check):
  python -m qerl_jax.main --config=configs/qwen32b.py --workdir=/tmp/qerl_qwen32b
  python -m qerl_jax.main --config=configs/qwen32b.py:smoke --workdir=/tmp/qerl_smoke

What a run should show: MATH-500 accuracy 83.3 in the paper (bf16 LoRA 83.6, full fine-tuning 84.0), with
the NVFP4 weights taking about 21 GB. The smoke mode (tiny random Qwen2 weights, local MATH-500 problems)
only checks that the loop runs.
"""

from configs.qwen_bigmath import bigmath_config


def get_config(arg=None):
  # Sized for 80 GB: 16 rows x 8704 KV positions (36.5 GB) beside 20.7 GB of NVFP4 weights; the memory
  # planner puts the step at about 64 GB. On a 141 GB H200, --config.rollout.batch_size=32 (about 104 GB).
  return bigmath_config("Qwen/Qwen2.5-32B-Instruct", arg, micro_batch_size=1, rollout_batch_size=16)
