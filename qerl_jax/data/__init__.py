"""Prompt datasets for math RL: GSM8K, MATH-500, BigMath, DAPO-Math, and an offline arithmetic task.

Local JSONL (offline) and hub (`datasets`) loaders give a `PromptDataset` of `Example`s; `build_prompt`
renders one through the tokenizer's chat template under the paper's SYSTEM_PROMPT;
`filter_long_prompts` drops prompts over a token budget; `PromptSampler` serves deterministic,
resumable batches.
"""

from qerl_jax.data.example import (SYSTEM_PROMPT, Example, PromptDataset, build_prompt, filter_long_prompts,
                                   prompt_messages, prompt_token_counts)
from qerl_jax.data.hub import (check_hub_reachable, load_bigmath, load_dapo_math, load_gsm8k_hub,
                               load_math500_hub)
from qerl_jax.data.local import default_data_dir, gsm8k_gold, load_gsm8k, load_math500, read_jsonl
from qerl_jax.data.sampler import PromptSampler, epoch_order
from qerl_jax.data.synthetic import MAX_DIFFICULTY, arithmetic_problem, make_arithmetic_dataset

__all__ = [
  "Example",
  "MAX_DIFFICULTY",
  "PromptDataset",
  "PromptSampler",
  "SYSTEM_PROMPT",
  "arithmetic_problem",
  "build_prompt",
  "check_hub_reachable",
  "default_data_dir",
  "epoch_order",
  "filter_long_prompts",
  "gsm8k_gold",
  "load_bigmath",
  "load_dapo_math",
  "load_gsm8k",
  "load_gsm8k_hub",
  "load_math500",
  "load_math500_hub",
  "make_arithmetic_dataset",
  "prompt_messages",
  "prompt_token_counts",
  "read_jsonl",
]
