"""Llama / Qwen2 / Qwen3 decoders with LoRA over an NVFP4 (or MXFP4, NF4, bf16) base.

Modules, one job each:
  config     ModelConfig (from a transformers config or GGUF metadata), RoPE frequencies.
  linear     base_matmul (the one entry point for base matmuls), LoRA, the Frozen variable type.
  attention  RMSNorm, RoPE, grouped-query attention with a KV cache.
  base       the frozen base as a stacked pytree: preallocation, fused-group quantization, random init.
  transformer  the NNX module, the pure scanned forward, init_cache, split_params.
  safetensors_io, gguf_io  streaming readers; loading  from_pretrained; export  PEFT / merged checkpoints.
  testing    tiny random transformers checkpoints for tests.

Forward contract, trainable/frozen split and AQN noise: see `qerl_jax.model.transformer`.
"""

from qerl_jax.model.base import empty_base, random_base  # noqa: F401
from qerl_jax.model.config import ModelConfig  # noqa: F401
from qerl_jax.model.linear import PROJ_NAMES, Frozen, LoraConfig, base_matmul  # noqa: F401
from qerl_jax.model.transformer import (  # noqa: F401
  Transformer, forward, init_cache, lm_head_logits, split_params,
)


def from_pretrained(*args, **kwargs):
  """See `qerl_jax.model.loading.from_pretrained` (imported lazily: it pulls in transformers)."""
  from qerl_jax.model.loading import from_pretrained as impl  # pylint: disable=import-outside-toplevel
  return impl(*args, **kwargs)
