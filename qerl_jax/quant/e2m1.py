"""E2M1 (FP4) element codes shared by NVFP4 and MXFP4: rounding, sign, nibble packing.

A code is ``sign << 3 | index`` with magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 by index. Rounding is to the
nearest grid value with ties to the even code, which is what compressed-tensors' threshold cascade does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Upper edges of each magnitude bucket and whether the edge itself belongs to the bucket below
# (True: "<=", the lower code is even) or above (False: "<", the upper code is even).
_EDGES = ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False),
          (5.0, True))

_UINT_OF_FLOAT = {2: jnp.uint16, 4: jnp.uint32}


def is_negative(w: jax.Array) -> jax.Array:
  """True where ``w`` is strictly negative, read from the bits.

  Reading the sign bit (and a nonzero magnitude) instead of comparing ``w < 0`` keeps negative
  subnormals negative on backends that treat subnormal inputs as zero (XLA:CPU does), and keeps an
  exact -0.0 non-negative, which is how compressed-tensors codes it (0x0, not 0x8).
  """
  itemsize = jnp.dtype(w.dtype).itemsize
  if itemsize not in _UINT_OF_FLOAT:
    return w.astype(jnp.float32) < 0
  utype = _UINT_OF_FLOAT[itemsize]
  bits = lax.bitcast_convert_type(w, utype)
  sign_mask = utype(1 << (8 * itemsize - 1))
  return ((bits & sign_mask) != 0) & ((bits & ~sign_mask) != 0)


def e2m1_index(abs_y: jax.Array) -> jax.Array:
  """Magnitude index 0..7 of |y| on the E2M1 grid (values above 6 saturate to 6), as uint8."""
  idx = jnp.zeros(abs_y.shape, jnp.uint8)
  for edge, edge_goes_down in _EDGES:
    above = abs_y > edge if edge_goes_down else abs_y >= edge
    idx = idx + above.astype(jnp.uint8)
  return idx


def e2m1_codes(y: jax.Array, negative: jax.Array) -> jax.Array:
  """4-bit codes (uint8 0..15) of the scaled values ``y``; ``negative`` supplies the sign bit."""
  return e2m1_index(jnp.abs(y)) | (negative.astype(jnp.uint8) << 3)


def e2m1_decode(codes: jax.Array) -> jax.Array:
  """Float32 value of each 4-bit code (code 8 decodes to -0.0), E2M1_VALUES[code & 7] with the code's sign.

  Built from integer ops rather than a lookup, which XLA compiles to a gather: for a magnitude code c = 2e + m
  with e > 0 the bits (c << 22) + (126 << 23) are exponent e + 126 and mantissa m, i.e. 2**(e-1) * (1 + m/2);
  c = 1 is 0.5 (bits 126 << 23) and c = 0 is 0. The sign bit moves to bit 31.
  """
  c = codes.astype(jnp.uint32)
  mag = c & 7
  bits = jnp.where(mag >= 2, (mag << 22) + (126 << 23), mag * (126 << 23)) | ((c & 8) << 28)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def pack_low_first(codes_NxK: jax.Array) -> jax.Array:
  """Pairs along the last axis into bytes, element 2i in the LOW nibble (compressed-tensors order)."""
  n, k = codes_NxK.shape
  pairs = codes_NxK.reshape(n, k // 2, 2)
  return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_low_first(packed_NxKh: jax.Array) -> jax.Array:
  """Inverse of :func:`pack_low_first`: uint8 [N, K/2] -> codes uint8 [N, K]."""
  n, kh = packed_NxKh.shape
  lo = packed_NxKh & 0x0F
  hi = packed_NxKh >> 4
  return jnp.stack([lo, hi], axis=-1).reshape(n, 2 * kh)


def div_exact(a, b) -> jax.Array:
  """Correctly rounded float32 ``a / b`` (with broadcasting).

  XLA's algebraic simplifier rewrites a division by a broadcast (constants included) into a
  multiplication by the reciprocal, which is one ulp off for about a third of all quotients and so
  changes codes and scales. An optimization barrier on the materialized divisor keeps the true divide.
  """
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  shape = jnp.broadcast_shapes(a.shape, b.shape)
  return jnp.broadcast_to(a, shape) / lax.optimization_barrier(jnp.broadcast_to(b, shape))


def round_to_dtype(x_f32: jax.Array, dtype) -> jax.Array:
  """Round a float32 result to ``dtype`` and back: one PyTorch op evaluated in ``dtype``.

  PyTorch evaluates bf16/fp16 elementwise ops in float32 and rounds the result once, so emulating
  them this way is exact (and independent of how XLA chooses to evaluate low-precision math).
  """
  if jnp.dtype(dtype) == jnp.float32:
    return x_f32
  return x_f32.astype(dtype).astype(jnp.float32)


def check_float_dtype(w: jax.Array, scheme: str) -> None:
  if jnp.dtype(w.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                jnp.dtype(jnp.float32)):
    raise ValueError(f"{scheme} quantization takes bfloat16, float16 or float32 weights, got {w.dtype=}")
