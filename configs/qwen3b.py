r"""QeRL on Qwen2.5-3B-Instruct with GSM8K (NVFP4 base + LoRA rank 32 + AQN, DAPO loss).

Command (one H200; `:bf16`, `:nf4`, `:mxfp4` give the paper's baselines, `:smoke` a CPU check):
  python -m qerl_jax.main --config=configs/qwen3b.py --workdir=/tmp/qerl_qwen3b
  python -m qerl_jax.main --config=configs/qwen3b.py:bf16 --workdir=/tmp/qerl_qwen3b_bf16
  python -m qerl_jax.main --config=configs/qwen3b.py:smoke --workdir=/tmp/qerl_smoke

What a run should show: the reward rises within the first ~100 steps and entropy stays above the bf16
LoRA run's; the paper reports GSM8K test accuracy 83.7 for QeRL vs 76.1 for bf16 LoRA and for QLoRA.
The smoke mode (tiny random Qwen2 weights) only checks that the loop runs: finite metrics, 3 steps.
"""

from configs.qwen_gsm8k import gsm8k_config


def get_config(arg=None):
  return gsm8k_config("Qwen/Qwen2.5-3B-Instruct", arg)
