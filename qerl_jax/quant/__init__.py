"""Bit-exact NVFP4 / MXFP4 / NF4 quantizers in pure JAX (see shared docs NVFP4.md)."""

from qerl_jax.quant.types import (  # noqa: F401
  MXFP4_BLOCK, NF4_BLOCK, NVFP4_BLOCK, MXFP4Tensor, NF4Tensor, NVFP4Tensor, QuantizedTensor,
  is_quantized, nbytes,
)
