"""Bit-exact NVFP4 / MXFP4 / NF4 quantizers in pure JAX (see shared docs NVFP4.md)."""

from qerl_jax.quant.types import (  # noqa: F401
  MXFP4_BLOCK, NF4_BLOCK, NVFP4_BLOCK, MXFP4Tensor, NF4Tensor, NVFP4Tensor, QuantizedTensor,
  is_quantized, nbytes,
)
from qerl_jax.quant.api import (  # noqa: F401
  SCHEMES, dequantize, dequantize_NxK, dequantize_stacked, from_ct_tensors, nvfp4_global_scale, quantize, quantize_NxK,
  shared_global_scale, to_ct_tensors,
)
