"""Tiny random transformers checkpoints for tests (torch and transformers are imported lazily).

transformers initialises RMSNorm scales to 1 and biases to 0, which would let bugs in those paths hide;
`save_tiny_hf` perturbs them so every parameter matters.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-6)

# One variant per architecture, together covering: tied / untied embeddings, q/k/v/o and MLP biases,
# Qwen2's fixed qkv bias, Qwen3's q/k norms with head_dim != hidden / heads, llama3 and YaRN RoPE.
VARIANTS: dict[str, dict[str, Any]] = {
  "llama": dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True, rope_theta=500000.0,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
  "qwen2": dict(tie_word_embeddings=True, rope_theta=1000000.0),
  "qwen3": dict(tie_word_embeddings=False, head_dim=32, rope_theta=1000000.0,
                rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
}


def fresh_seed() -> int:
  """A fresh seed per run (print it in assertion messages); QERL_TEST_SEED pins it to reproduce."""
  return int(os.environ.get("QERL_TEST_SEED", random.randrange(1 << 30)))


def hf_classes(arch: str):
  import transformers as tr  # pylint: disable=import-outside-toplevel
  return {"llama": (tr.LlamaConfig, tr.LlamaForCausalLM), "qwen2": (tr.Qwen2Config, tr.Qwen2ForCausalLM),
          "qwen3": (tr.Qwen3Config, tr.Qwen3ForCausalLM)}[arch]


def tiny_hf_config(arch: str, **overrides):
  """A transformers config of the tiny shape for `arch` (TINY + VARIANTS[arch] + overrides)."""
  kw = {**TINY, **VARIANTS[arch], **overrides}
  rope = kw.pop("rope_scaling", None)
  theta = kw.pop("rope_theta", 10000.0)
  config_cls = hf_classes(arch)[0]
  # transformers 5 reads rope_parameters; 4.x reads rope_theta / rope_scaling.
  params = {"rope_type": "default", "rope_theta": theta, **(rope or {})}
  try:
    return config_cls(**kw, rope_parameters=params)
  except TypeError:
    return config_cls(**kw, rope_theta=theta, rope_scaling=rope)


def make_tiny_hf(arch: str, seed: int, dtype: str = "float32", **overrides):
  """A random tiny transformers model (eval mode) with perturbed norms and nonzero biases."""
  import torch  # pylint: disable=import-outside-toplevel
  torch.manual_seed(seed)
  model = hf_classes(arch)[1](tiny_hf_config(arch, **overrides)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(0.2 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.normal_(0.0, 0.1)
  return model.to(getattr(torch, dtype))


def save_tiny_hf(arch: str, out_dir: str, seed: int, dtype: str = "float32", **overrides):
  """Saves `make_tiny_hf(...)` with save_pretrained into out_dir; returns the torch model."""
  model = make_tiny_hf(arch, seed, dtype, **overrides)
  model.save_pretrained(out_dir)
  return model


def hf_logits(model, tokens_BxT: np.ndarray) -> np.ndarray:
  """float32 logits of a transformers (or PEFT) model on int tokens."""
  import torch  # pylint: disable=import-outside-toplevel
  with torch.no_grad():
    return model(torch.as_tensor(np.asarray(tokens_BxT), dtype=torch.long)).logits.float().numpy()
