r"""QeRL on Qwen2.5-7B-Instruct with GSM8K (NVFP4 base + LoRA rank 32 + AQN, DAPO loss).

Command (one H200; `:bf16`, `:nf4`, `:mxfp4` give the paper's baselines, `:smoke` a CPU check):
  python -m qerl_jax.main --config=configs/qwen7b.py --workdir=/tmp/qerl_qwen7b
  python -m qerl_jax.main --config=configs/qwen7b.py --workdir=/tmp/qerl_qwen7b \
      --config.train.learning_rate=3e-5   # the paper's faster, still stable setting for NVFP4
  python -m qerl_jax.main --config=configs/qwen7b.py:smoke --workdir=/tmp/qerl_smoke

What a run should show: GSM8K test accuracy 90.8 in the paper (bf16 LoRA 88.1, QLoRA 85.0); at lr 3e-5
the reward climbs about twice as fast as at 1e-5. The smoke mode (tiny random Qwen2 weights) only checks
that the loop runs: finite metrics, 3 steps.
"""

from configs.qwen_gsm8k import gsm8k_config


def get_config(arg=None):
  return gsm8k_config("Qwen/Qwen2.5-7B-Instruct", arg)
