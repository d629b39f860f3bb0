"""MXFP4 (compressed-tensors ``mxfp4-pack-quantized``) in pure JAX, byte-exact with compressed-tensors.

One power-of-two scale per 32 consecutive inputs, stored as an E8M0 byte (scale = 2 ** (byte - 127));
no global scale. The block amax (in the weight dtype) is written m * 2^e and rounded to a power of two
p = 2^e if m < 1.75 else 2^(e + 1) (compressed-tensors adds half an E2M1 mantissa step to the bits and
truncates); the scale is p / 4, so the block max lands in [4, 7) before E2M1 rounding (6 at most).
Elements use the same E2M1 rounding and nibble order as NVFP4.

The exponent arithmetic is done on integer bit patterns, so it is exact even where XLA:CPU would flush
float32 subnormals (tiny scales like 2^-127 appear for all-zero blocks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from qerl_jax.quant import e2m1
from qerl_jax.quant.types import MXFP4_BLOCK, MXFP4Tensor

E2M1_MAX = 6.0
E8M0_BIAS = 127
_E2M1_EMAX = 2  # floor(log2(6)): the block's power of two is divided by 2^2.

# dtype -> (mantissa bits, exponent bits, exponent bias, unsigned int of the same width).
_FLOAT_BITS = {
  jnp.dtype(jnp.bfloat16): (7, 8, 127, jnp.uint16),
  jnp.dtype(jnp.float16): (10, 5, 15, jnp.uint16),
  jnp.dtype(jnp.float32): (23, 8, 127, jnp.uint32),
}


def _pow2_f32(exponent: jax.Array) -> jax.Array:
  """2.0 ** exponent as float32 for integer exponents in [-126, 127], built from bits."""
  biased = jnp.clip(exponent + 127, 1, 254).astype(jnp.uint32)
  return lax.bitcast_convert_type(biased << 23, jnp.float32)


def scale_bytes(w_NxK: jax.Array) -> jax.Array:
  """uint8 [N, K/32] E8M0 scale bytes, as compressed-tensors computes and stores them."""
  e2m1.check_float_dtype(w_NxK, "mxfp4")
  n, k = w_NxK.shape
  mant, exp_bits, bias, utype = _FLOAT_BITS[jnp.dtype(w_NxK.dtype)]
  bamax = jnp.max(jnp.abs(w_NxK.reshape(n, k // MXFP4_BLOCK, MXFP4_BLOCK)), axis=-1)
  bits = lax.bitcast_convert_type(bamax, utype).astype(jnp.int32)
  # Round the mantissa at 1.75 (add a quarter of the leading-one step) and keep only the exponent.
  biased_exp = ((bits + (1 << (mant - 2))) >> mant) & ((1 << exp_bits) - 1)
  exp_all_ones = (1 << exp_bits) - 1
  byte = biased_exp - bias + E8M0_BIAS - _E2M1_EMAX
  # Exponent field 0 means the rounded power is 0: log2 gives -inf, clamped to byte 0.
  # All ones means it overflowed to inf: +inf, clamped to 255.
  byte = jnp.where(biased_exp == 0, 0, jnp.where(biased_exp == exp_all_ones, 255, byte))
  byte = jnp.clip(byte, 0, 255)
  if jnp.dtype(w_NxK.dtype) == jnp.dtype(jnp.float16):
    # compressed-tensors turns the byte back into a float16 scale before storing it; 2^(byte-127)
    # below float16's smallest subnormal (2^-24, ties to even at 2^-25) becomes 0, which its zero-scale
    # guard replaces by 1.0, i.e. byte 127.
    byte = jnp.where(byte - E8M0_BIAS < -24, E8M0_BIAS, byte)
  return byte.astype(jnp.uint8)


def quantize_codes(w_NxK: jax.Array, scale_NxKb: jax.Array) -> jax.Array:
  """uint8 [N, K] E2M1 codes of w / 2^(byte - 127), the divide evaluated in the weight dtype."""
  n, k = w_NxK.shape
  nb = k // MXFP4_BLOCK
  w_blocks = w_NxK.reshape(n, nb, MXFP4_BLOCK)
  # Dividing by a power of two is a multiply by its inverse, exact in float32 for normal results.
  inv = _pow2_f32(E8M0_BIAS - scale_NxKb.astype(jnp.int32))[:, :, None]
  y = e2m1.round_to_dtype(w_blocks.astype(jnp.float32) * inv, w_NxK.dtype)
  # PyTorch takes the sign from y: a quotient that underflows to zero in the weight dtype is unsigned.
  # That is reachable for float16 (smallest subnormal 2^-24); for bf16 / fp32 it would need subnormal
  # weights, which XLA:CPU reads as zero, so there the sign comes from w's bits alone.
  negative = e2m1.is_negative(w_blocks)
  if jnp.dtype(w_NxK.dtype) == jnp.dtype(jnp.float16):
    negative = negative & (y != 0)
  y = jnp.clip(y, -E2M1_MAX, E2M1_MAX)
  return e2m1.e2m1_codes(y, negative).reshape(n, k)


@jax.jit
def quantize_NxK(w_NxK: jax.Array) -> MXFP4Tensor:
  """Quantize a [N, K] weight (PyTorch layout) to MXFP4; K must be divisible by 32."""
  n, k = w_NxK.shape
  if k % MXFP4_BLOCK:
    raise ValueError(f"mxfp4 needs K (in_features) divisible by {MXFP4_BLOCK}, got {k=}")
  scale = scale_bytes(w_NxK)
  codes = quantize_codes(w_NxK, scale)
  return MXFP4Tensor(packed_NxKh=e2m1.pack_low_first(codes), scale_NxKb=scale)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_NxK(q: MXFP4Tensor, dtype=jnp.bfloat16) -> jax.Array:
  """[N, K] weight: dtype(E2M1[code] * 2^(byte - 127)), the product taken in float32."""
  codes = e2m1.unpack_low_first(q.packed_NxKh)
  n, k = codes.shape
  vals = e2m1.e2m1_decode(codes).reshape(n, k // MXFP4_BLOCK, MXFP4_BLOCK)
  exp = q.scale_NxKb.astype(jnp.int32) - E8M0_BIAS
  # Split the power of two so that 2^-127 (byte 0) needs no subnormal constant.
  half = exp // 2
  scale_a = _pow2_f32(half)[:, :, None]
  scale_b = _pow2_f32(exp - half)[:, :, None]
  return ((vals * scale_a) * scale_b).reshape(n, k).astype(dtype)
