"""NF4 (QLoRA / bitsandbytes) in pure JAX, byte-exact with bitsandbytes' CPU path.

The weight is flattened in PyTorch's [N, K] order and cut into blocks of 64. Per block: absmax (float32),
x * (1 / absmax) clamped to [-1, 1], then the nearest of the 16 NF4 values by float32 midpoints, a value
exactly on a midpoint taking the LOWER code. Two codes per byte, the FIRST element in the HIGH nibble.

Double quantization (QLoRA's "compress statistics"): the float32 absmaxes minus their mean are quantized
to 8 bits in blocks of 256 against bitsandbytes' signed dynamic map: per block absmax2, x / absmax2, the
exactly nearest code, ties to the lower code. (bitsandbytes >= 0.50 on CPU looks the code up in a
65536-bin table instead, which picks the second-nearest code for about 0.5% of the values; the CUDA kernel
and older CPU builds search exactly. The offset is a float32 mean whose summation order is the backend's,
so it can differ from PyTorch's in the last bit.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from qerl_jax.quant import e2m1
from qerl_jax.quant.bnb_dynamic_map import DYNAMIC_MAP
from qerl_jax.quant.types import NF4_BLOCK, NF4Tensor

NF4_VALUES = (
  -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
  -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
  0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
  0.7229568362236023, 1.0,
)
ABSMAX_BLOCK = 256
# bitsandbytes clamps absmax from below before taking its reciprocal (an all-zero block then maps to 0).
_ABSMAX_FLOOR = 1e-38


def _pad_to_blocks(x: jax.Array, block: int) -> jax.Array:
  """Flat x zero-padded to whole blocks, reshaped [num_blocks, block]; zeros never change an absmax."""
  pad = (-x.shape[0]) % block
  return jnp.pad(x, (0, pad)).reshape(-1, block)


def nf4_codes(x_flat: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(codes uint8 [num_blocks * 64], absmax float32 [num_blocks]) of a flat weight."""
  blocks = _pad_to_blocks(x_flat.astype(jnp.float32), NF4_BLOCK)
  absmax = jnp.max(jnp.abs(blocks), axis=-1)
  recip = e2m1.div_exact(1.0, jnp.maximum(absmax, jnp.float32(_ABSMAX_FLOOR)))
  # The floor is a float32 subnormal that XLA:CPU reads as 0; keep all-zero blocks at exactly 0.
  scaled = jnp.where(absmax[:, None] > 0, blocks * recip[:, None], 0.0)
  if x_flat.shape[0] % NF4_BLOCK:
    # bitsandbytes divides (instead of multiplying by the reciprocal) in a trailing partial block.
    floor = jnp.maximum(absmax[-1], jnp.float32(_ABSMAX_FLOOR))
    last = jnp.where(absmax[-1] > 0, e2m1.div_exact(blocks[-1], floor), 0.0)
    scaled = scaled.at[-1].set(last)
  scaled = jnp.clip(scaled, -1.0, 1.0)
  table = jnp.asarray(NF4_VALUES, jnp.float32)
  mids = (table[:-1] + table[1:]) / 2
  # side="left": the first midpoint >= x, so a value equal to a midpoint takes the lower code.
  codes = jnp.searchsorted(mids, scaled.reshape(-1), side="left").astype(jnp.uint8)
  return codes, absmax


def pack_high_first(codes: jax.Array) -> jax.Array:
  """Flat codes (even length) -> bytes with the FIRST element in the HIGH nibble (bitsandbytes)."""
  pairs = codes.reshape(-1, 2)
  return (pairs[:, 0] << 4) | pairs[:, 1]


def unpack_high_first(packed: jax.Array) -> jax.Array:
  return jnp.stack([packed >> 4, packed & 0x0F], axis=-1).reshape(-1)


def quantize_absmax_8bit(absmax: jax.Array, offset: jax.Array | None = None
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Double quantization: (uint8 codes [nb], float32 absmax2 [ceil(nb/256)], float32 offset []).

  ``offset`` defaults to mean(absmax). The barrier makes XLA compute that mean once: a fused copy
  could sum in another order and differ from the stored offset in the last bit.
  """
  if offset is None:
    offset = e2m1.div_exact(jnp.sum(absmax), absmax.shape[0])  # PyTorch's mean: sum / n
  offset = lax.optimization_barrier(jnp.asarray(offset, jnp.float32))
  x = absmax - offset
  blocks = _pad_to_blocks(x, ABSMAX_BLOCK)
  absmax2 = jnp.max(jnp.abs(blocks), axis=-1)
  # bitsandbytes divides here (0/0 for a constant absmax would be NaN there; we map it to 0).
  normed = jnp.where(absmax2[:, None] > 0, e2m1.div_exact(blocks, absmax2[:, None]), 0.0)
  normed = normed.reshape(-1)
  search_map = jnp.asarray(DYNAMIC_MAP, jnp.float32)
  # Largest index whose code is <= x, then the right neighbour only if strictly closer.
  left = jnp.clip(jnp.searchsorted(search_map, normed, side="right") - 1, 0, 255)
  right = jnp.minimum(left + 1, 255)
  dist_left = jnp.abs(normed - search_map[left])
  dist_right = jnp.abs(normed - search_map[right])
  idx = jnp.where((left < 255) & (dist_right < dist_left), right, left)
  return idx[: absmax.shape[0]].astype(jnp.uint8), absmax2, offset


@functools.partial(jax.jit, static_argnames=("double_quant",))
def quantize_NxK(w_NxK: jax.Array, double_quant: bool = False) -> NF4Tensor:
  """Quantize a [N, K] weight (PyTorch layout) to NF4 over its flattened elements."""
  e2m1.check_float_dtype(w_NxK, "nf4")
  n, k = w_NxK.shape
  codes, absmax = nf4_codes(w_NxK.reshape(-1))
  # bitsandbytes pads an odd element count with one zero before packing; whole blocks are even.
  packed = pack_high_first(codes[: n * k + (n * k) % 2])
  if not double_quant:
    return NF4Tensor(packed=packed, absmax=absmax, n=n, k=k)
  qabsmax, absmax2, offset = quantize_absmax_8bit(absmax)
  return NF4Tensor(packed=packed, absmax=qabsmax, n=n, k=k, absmax_scale=absmax2,
                   absmax_offset=offset, absmax_code=jnp.asarray(DYNAMIC_MAP, jnp.float32))


def absmax_float(q: NF4Tensor) -> jax.Array:
  """Per-64-block float32 absmax, undoing double quantization: code[q] * absmax2 + offset."""
  if q.absmax_scale is None:
    return q.absmax
  nb = q.absmax.shape[0]
  vals = q.absmax_code[q.absmax.astype(jnp.int32)]
  scale = jnp.repeat(q.absmax_scale, ABSMAX_BLOCK)[:nb]
  # Two separately rounded float32 ops, as bitsandbytes does; the barrier keeps XLA from
  # contracting them into one fused multiply-add.
  return lax.optimization_barrier(vals * scale) + q.absmax_offset


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_NxK(q: NF4Tensor, dtype=jnp.bfloat16) -> jax.Array:
  """[N, K] weight: dtype(NF4[code] * absmax), the product in float32."""
  n, k = q.n, q.k
  codes = unpack_high_first(q.packed)
  vals = jnp.asarray(NF4_VALUES, jnp.float32)[codes.astype(jnp.int32)]
  vals = _pad_to_blocks(vals, NF4_BLOCK)
  out = (vals * absmax_float(q)[:, None]).reshape(-1)[: n * k]
  return out.reshape(n, k).astype(dtype)
