"""Slow check (run by hand): the real SmolLM2-135M-Instruct solves the easiest synthetic problems
sometimes, so the RL rewards are not all zero. Generation is by transformers/PyTorch, independent of
this project's model code.

  python3 -m pytest -q -m slow tests/test_data_smollm2_slow.py -s
"""

import os

import numpy as np
import pytest

from qerl_jax import data as D
from qerl_jax import rewards as R


@pytest.mark.slow
def test_smollm2_gets_some_easy_problems_right():
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer

  from qerl_jax.assets import smollm2_gguf_path
  path = smollm2_gguf_path()
  folder, name = os.path.dirname(path), os.path.basename(path)
  tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
  model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
  ds = D.make_arithmetic_dataset(6, difficulty=0, seed=1)
  completions, golds = [], []
  torch.manual_seed(0)
  for ex in ds:
    ids = tokenizer(D.build_prompt(ex, tokenizer), return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, do_sample=True, temperature=1.0, max_new_tokens=48, num_return_sequences=8,
                         pad_token_id=tokenizer.eos_token_id)
    completions += tokenizer.batch_decode(out[:, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    golds += [ex.gold_answer] * 8
  strict, _ = R.compute_rewards(completions, golds, {"gsm8k_correctness": 1.0})
  lenient, per_fn = R.compute_rewards(completions, golds, R.ARITHMETIC_WEIGHTS)
  print(f"strict accuracy {np.mean(strict > 0):.3f}, lenient accuracy {np.mean(per_fn['gsm8k_lenient'] > 0):.3f}, "
        f"format {np.mean(per_fn['format'] > 0):.3f}, mean lenient reward {lenient.mean():.3f}")
  for c, g in list(zip(completions, golds))[:6]:
    print(repr(g), repr(c[:120]))
  assert 0 < np.mean(per_fn["gsm8k_lenient"] > 0) < 1  # some right, some wrong: a learning signal
