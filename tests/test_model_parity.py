"""Logit parity with transformers' PyTorch models on tiny random Qwen2 / Qwen3 / Llama checkpoints."""

import numpy as np
import pytest
import torch

import jax.numpy as jnp

from qerl_jax.model.loading import from_pretrained
from qerl_jax.model.testing import hf_logits, save_tiny_hf, fresh_seed


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_float32_logits_match_transformers(arch, tmp_path):
  seed = fresh_seed()
  hf = save_tiny_hf(arch, str(tmp_path), seed, "float32")
  tokens = np.random.default_rng(seed).integers(0, 256, (2, 24))
  ref = hf_logits(hf, tokens)
  model, tokenizer = from_pretrained(str(tmp_path), quant="bf16", dtype=jnp.float32, lora_rank=None)
  assert tokenizer is None  # the tiny checkpoint has no tokenizer files
  out = np.asarray(model(jnp.asarray(tokens)))
  assert out.shape == (2, 24, 256) and out.dtype == np.float32
  err = np.abs(out - ref).max() / np.abs(ref).max()
  assert err < 2e-5, f"{arch=} {seed=} relative max error {err}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bfloat16_logits_match_transformers(arch, tmp_path):
  """A bf16 model errs no more than transformers' own bf16 forward, measured against float32 math."""
  seed = fresh_seed()
  hf = save_tiny_hf(arch, str(tmp_path), seed, "bfloat16")
  tokens = np.random.default_rng(seed).integers(0, 256, (2, 24))
  ref_bf16 = hf_logits(hf, tokens)
  exact = hf_logits(hf.to(torch.float32), tokens)  # the same bf16 weights, float32 arithmetic
  model, _ = from_pretrained(str(tmp_path), quant="bf16", dtype=jnp.bfloat16, lora_rank=None)
  assert model.config.dtype == jnp.bfloat16
  assert model.layers.q_proj.weight.get_value().dtype == jnp.bfloat16
  out = np.asarray(model(jnp.asarray(tokens)))
  ours = np.linalg.norm(out - exact) / np.linalg.norm(exact)
  theirs = np.linalg.norm(ref_bf16 - exact) / np.linalg.norm(exact)
  assert ours < 2e-2, f"{arch=} {seed=} relative error {ours}"
  assert ours < 2 * theirs + 1e-3, f"{arch=} {seed=} ours {ours} vs transformers bf16 {theirs}"
  agree = (out.argmax(-1) == exact.argmax(-1)).mean()
  assert agree >= 0.9, f"{arch=} {seed=} top-1 agreement {agree}"
