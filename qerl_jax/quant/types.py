"""Pytree types for quantized weights.

Every type stores a weight that the model uses as ``y = x @ w`` with ``w`` of logical shape [K, N]
(K = in_features, N = out_features). The arrays inside are kept in the on-disk layout of the PyTorch
ecosystem ([N, ...] rows, blocks running along K), so loading and exporting are copies, and a kernel reads
each output column's K-run contiguously (the layout Marlin-style weight-only kernels want).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
NF4_BLOCK = 64


@struct.dataclass
class NVFP4Tensor:
  """NVFP4 (compressed-tensors ``nvfp4-pack-quantized``) weight of logical shape [K, N].

  packed_NxKh: uint8 [N, K/2], element 2i in the low nibble (``weight_packed``).
  scale_NxKb: float8_e4m3fn [N, K/16] block scales (``weight_scale``).
  global_scale: float32 [1], the quantize-direction multiplier 2688/amax (``weight_global_scale``);
    dequant is code * (scale / global_scale).
  """

  packed_NxKh: jax.Array
  scale_NxKb: jax.Array
  global_scale: jax.Array
  scheme: str = struct.field(pytree_node=False, default="nvfp4")

  @property
  def shape(self) -> tuple[int, int]:
    n, kh = self.packed_NxKh.shape[-2:]
    return (2 * kh, n)


@struct.dataclass
class MXFP4Tensor:
  """MXFP4 (compressed-tensors ``mxfp4-pack-quantized``) weight of logical shape [K, N].

  packed_NxKh: uint8 [N, K/2], same nibble order as NVFP4.
  scale_NxKb: uint8 [N, K/32], E8M0 exponent bytes (scale = 2 ** (byte - 127)).
  """

  packed_NxKh: jax.Array
  scale_NxKb: jax.Array
  scheme: str = struct.field(pytree_node=False, default="mxfp4")

  @property
  def shape(self) -> tuple[int, int]:
    n, kh = self.packed_NxKh.shape[-2:]
    return (2 * kh, n)


@struct.dataclass
class NF4Tensor:
  """bitsandbytes NF4 weight of logical shape [K, N], quantized over the flattened [N, K] tensor.

  packed: uint8 [N*K/2], FIRST element of each pair in the HIGH nibble (bitsandbytes order).
  absmax: float32 [N*K/64] per-block absmax; or, with double quantization, uint8 codes of
    (absmax - absmax_offset) in blocks of 256 against ``absmax_code`` with ``absmax_scale`` per block.
  """

  packed: jax.Array
  absmax: jax.Array
  n: int = struct.field(pytree_node=False, default=0)
  k: int = struct.field(pytree_node=False, default=0)
  absmax_scale: Any = None  # float32 [num_blocks/256] when double-quantized
  absmax_offset: Any = None  # float32 [] when double-quantized
  absmax_code: Any = None  # float32 [256] dynamic map when double-quantized
  scheme: str = struct.field(pytree_node=False, default="nf4")

  @property
  def shape(self) -> tuple[int, int]:
    return (self.k, self.n)


QuantizedTensor = NVFP4Tensor | MXFP4Tensor | NF4Tensor


def is_quantized(x: Any) -> bool:
  return isinstance(x, (NVFP4Tensor, MXFP4Tensor, NF4Tensor))


def nbytes(x: Any) -> int:
  """Device bytes of a (possibly quantized) weight."""
  leaves = jax.tree_util.tree_leaves(x)
  return sum(int(leaf.size) * jnp.dtype(leaf.dtype).itemsize for leaf in leaves)


__all__ = [
  "NVFP4_BLOCK", "MXFP4_BLOCK", "NF4_BLOCK", "NVFP4Tensor", "MXFP4Tensor", "NF4Tensor",
  "QuantizedTensor", "is_quantized", "nbytes",
]
