"""NVFP4 (compressed-tensors ``nvfp4-pack-quantized``) in pure JAX, byte-exact with compressed-tensors.

W_hat = E2M1[code] * (scale_fp8 / global_scale), one float8_e4m3fn scale per 16 consecutive inputs of
an output row and one float32 global scale per tensor. All arithmetic follows the order in which
compressed-tensors (and llm-compressor's min-max observer) evaluate it; see shared/docs/NVFP4.md.

Functions here take the PyTorch layout [N = out_features, K = in_features] (the file layout); the
public API in ``api.py`` takes the model's [K, N].

Known limit: XLA:CPU flushes float32 subnormals to zero, so weights that are themselves float32
subnormals (|w| < 1.2e-38) may get a different magnitude code than PyTorch computes (their sign bit is
still right). Real checkpoints have no such weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qerl_jax.quant import e2m1
from qerl_jax.quant.types import NVFP4_BLOCK, NVFP4Tensor

FP8_MAX = 448.0
E2M1_MAX = 6.0
# compressed-tensors replaces a zero block scale by the float8 "eps" it uses: 0.125 (byte 0x20).
ZERO_SCALE_REPLACEMENT = 0.125


@jax.jit
def global_scale(w: jax.Array) -> jax.Array:
  """float32[1] quantize-direction global scale 448 * 6 / amax(|w|), evaluated as PyTorch does.

  ``2688 / t`` on a tensor is ``reciprocal(t) * 2688``: the reciprocal is rounded to the weight dtype,
  then the product is rounded again (bf16: amax 0.9453125 gives 2832, not 2848). amax is clamped
  to the dtype's smallest normal first, and an overflowing (or NaN) result becomes 1.0, like
  compressed-tensors' ``generate_gparam``.
  """
  e2m1.check_float_dtype(w, "nvfp4")
  dtype = w.dtype
  amax = jnp.max(jnp.abs(w)).astype(jnp.float32)
  amax = jnp.maximum(amax, jnp.float32(jnp.finfo(dtype).tiny))
  recip = e2m1.round_to_dtype(e2m1.div_exact(1.0, amax), dtype)
  gs = e2m1.round_to_dtype(jnp.float32(FP8_MAX * E2M1_MAX) * recip, dtype)
  gs = jnp.where(jnp.isfinite(gs), gs, jnp.float32(1.0))
  return gs.reshape(1)


def block_scales(w_NxK: jax.Array, gs: jax.Array) -> jax.Array:
  """float8_e4m3fn [N, K/16] block scales for the global scale ``gs`` (float32 [1])."""
  n, k = w_NxK.shape
  dtype = w_NxK.dtype
  bamax = jnp.max(jnp.abs(w_NxK.reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)), axis=-1)
  # amax / (range / 2) in the weight dtype, then gs * s in float32 (the [1]-shaped global scale
  # promotes the product to float32).
  s = e2m1.round_to_dtype(e2m1.div_exact(bamax, E2M1_MAX), dtype)
  s = gs.astype(jnp.float32).reshape(()) * s
  # Clamp before the cast: an out-of-range cast to float8_e4m3fn gives NaN, not 448.
  s = jnp.clip(s, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  return jnp.where(s.astype(jnp.float32) == 0, jnp.asarray(ZERO_SCALE_REPLACEMENT, s.dtype), s)


def byte_words(packed: jax.Array, step: jax.Array, dtype, decode=e2m1.e2m1_decode) -> jax.Array:
  """uint32 words, one per packed byte: its two values dtype(float32(E2M1[code]) * step) as 16-bit patterns, the
  low nibble's in the low half. Bitcast to ``dtype`` on a little-endian machine they are the weight's own [.., K]
  order (element 2i in the low nibble), so no interleave is formed. ``step`` broadcasts against ``packed``."""
  byte = packed.astype(jnp.uint32)

  def bits(codes):
    value = (decode(codes) * step).astype(dtype)
    return jax.lax.bitcast_convert_type(value, jnp.uint16).astype(jnp.uint32)

  return bits(byte & 15) | (bits(byte >> 4) << 16)


def effective_scale(scale_NxKb: jax.Array, gs: jax.Array) -> jax.Array:
  """float32 dequant step per block: float32(scale_fp8) / gs (a divide, as compressed-tensors does)."""
  return e2m1.div_exact(scale_NxKb.astype(jnp.float32), gs.reshape(()))


def quantize_codes(w_NxK: jax.Array, scale_NxKb: jax.Array, gs: jax.Array) -> jax.Array:
  """uint8 [N, K] E2M1 codes of ``w`` given its block scales and global scale."""
  n, k = w_NxK.shape
  nb = k // NVFP4_BLOCK
  eff = effective_scale(scale_NxKb, gs)[:, :, None]
  w_blocks = w_NxK.reshape(n, nb, NVFP4_BLOCK)
  # y = w / eff (not w * gs / s: the two round differently).
  y = jnp.clip(e2m1.div_exact(w_blocks.astype(jnp.float32), eff), -E2M1_MAX, E2M1_MAX)
  # The sign is read from w's bits (see is_negative): a float32 quotient w / eff cannot underflow
  # to zero for any real weight, while reading y would lose the sign of subnormal bf16 weights.
  codes = e2m1.e2m1_codes(y, e2m1.is_negative(w_blocks))
  return codes.reshape(n, k)


@functools.partial(jax.jit, static_argnames=())
def quantize_NxK(w_NxK: jax.Array, gs: jax.Array | None = None) -> NVFP4Tensor:
  """Quantize a [N, K] weight (PyTorch layout) to NVFP4.

  Args:
    w_NxK: bf16 / fp16 / fp32 weight, K divisible by 16.
    gs: optional float32 [1] global scale (a fused layer's shared one); default: this tensor's own.
  Returns:
    NVFP4Tensor with packed_NxKh uint8 [N, K/2], scale_NxKb float8_e4m3fn [N, K/16], global_scale [1].
  """
  n, k = w_NxK.shape
  if k % NVFP4_BLOCK:
    raise ValueError(f"nvfp4 needs K (in_features) divisible by {NVFP4_BLOCK}, got {k=}")
  gs = global_scale(w_NxK) if gs is None else jnp.asarray(gs, jnp.float32).reshape(1)
  scale = block_scales(w_NxK, gs)
  codes = quantize_codes(w_NxK, scale, gs)
  return NVFP4Tensor(packed_NxKh=e2m1.pack_low_first(codes), scale_NxKb=scale, global_scale=gs)


@functools.partial(jax.jit, static_argnames=("dtype", "decode", "words"))
def dequantize_NxK(q: NVFP4Tensor, dtype=jnp.bfloat16, decode=e2m1.e2m1_decode, words: bool = False) -> jax.Array:
  """[N, K] weight in ``dtype``: dtype(float32(E2M1[code]) * (float32(scale) / gs)). ``decode``: codes -> float32
  values (`experiments/bench_xla_dequant.py` times another form of it). ``words`` (16-bit dtypes): the same bits
  formed as one uint32 word per packed byte (`byte_words`), a program XLA writes faster: 7B gate|up alone in 302
  against 603 us on an H100 (7c40c02); the XLA path takes it where the tuning file says "xla_dequant": "words"."""
  if words and jnp.dtype(dtype).itemsize == 2:
    n, kh = q.packed_NxKh.shape
    nb = kh // (NVFP4_BLOCK // 2)
    step = effective_scale(q.scale_NxKb, q.global_scale)[:, :, None]
    w = byte_words(q.packed_NxKh.reshape(n, nb, NVFP4_BLOCK // 2), step, jnp.dtype(dtype), decode)
    return jax.lax.bitcast_convert_type(w, dtype).reshape(n, 2 * kh)
  codes = e2m1.unpack_low_first(q.packed_NxKh)
  n, k = codes.shape
  vals = decode(codes).reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
  eff = effective_scale(q.scale_NxKb, q.global_scale)[:, :, None]
  return (vals * eff).reshape(n, k).astype(dtype)
