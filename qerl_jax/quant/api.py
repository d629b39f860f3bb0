"""Public quantization API: quantize / dequantize a weight, global scales, compressed-tensors tensors.

The model computes ``y = x @ w`` with ``w`` of shape [K, N]; ``quantize`` takes that orientation. The
``*_NxK`` variants take PyTorch's [N, K] file layout directly (the checkpoint reader and writer use them,
which saves a transpose per tensor). All math lives in nvfp4.py / mxfp4.py / nf4.py and is jittable;
the wrappers here only add input checks that need concrete values, and skip them under tracing.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qerl_jax.quant import mxfp4, nf4, nvfp4
from qerl_jax.quant.types import (
  MXFP4_BLOCK, NF4_BLOCK, NVFP4_BLOCK, MXFP4Tensor, NF4Tensor, NVFP4Tensor, QuantizedTensor,
)

SCHEMES = ("nvfp4", "mxfp4", "nf4")
BLOCK_OF_SCHEME = {"nvfp4": NVFP4_BLOCK, "mxfp4": MXFP4_BLOCK, "nf4": NF4_BLOCK}


def check_scheme(scheme: str) -> None:
  if scheme not in SCHEMES:
    raise ValueError(f"unknown quantization {scheme=}; expected one of {SCHEMES}")


def check_finite(w, name: str | None = None) -> None:
  """ValueError naming the tensor if ``w`` holds NaN or Inf (skipped when ``w`` is a tracer)."""
  try:
    ok = bool(jnp.all(jnp.isfinite(w)))
  except jax.errors.ConcretizationTypeError:
    return
  if not ok:
    raise ValueError(f"tensor {name or '<unnamed>'} contains NaN or Inf; refusing to quantize it")


def check_blocks(k: int, scheme: str, name: str | None = None) -> None:
  """ValueError naming the layer if its input size K is not a whole number of blocks.

  NF4 blocks run over the flattened tensor and accept any size, so only NVFP4 / MXFP4 are checked.
  """
  block = BLOCK_OF_SCHEME[scheme]
  if scheme != "nf4" and k % block:
    raise ValueError(
      f"layer {name or '<unnamed>'}: in_features {k=} is not divisible by the {scheme} block size "
      f"{block}, so it cannot be stored as {scheme}; add it to --ignore to keep it unquantized")


def quantize_NxK(w_NxK: jax.Array, scheme: str, *, global_scale=None, double_quant: bool = False,
                 name: str | None = None) -> QuantizedTensor:
  """Like :func:`quantize` for a weight already in PyTorch's [N = out, K = in] layout."""
  check_scheme(scheme)
  w_NxK = jnp.asarray(w_NxK)
  if w_NxK.ndim != 2:
    raise ValueError(f"tensor {name or '<unnamed>'}: expected a 2-D weight, got shape {w_NxK.shape}")
  check_blocks(w_NxK.shape[1], scheme, name)
  check_finite(w_NxK, name)
  if global_scale is not None and scheme != "nvfp4":
    raise ValueError(f"global_scale only applies to nvfp4, got {scheme=}")
  if double_quant and scheme != "nf4":
    raise ValueError(f"double_quant only applies to nf4, got {scheme=}")
  if scheme == "nvfp4":
    gs = None if global_scale is None else jnp.asarray(global_scale, jnp.float32).reshape(1)
    return nvfp4.quantize_NxK(w_NxK, gs)
  if scheme == "mxfp4":
    return mxfp4.quantize_NxK(w_NxK)
  return nf4.quantize_NxK(w_NxK, double_quant=double_quant)


def quantize(w_KxN: jax.Array, scheme: str, *, global_scale=None, double_quant: bool = False,
             name: str | None = None) -> QuantizedTensor:
  """Quantize a weight used as ``x @ w_KxN`` (blocks run along K, the input dimension).

  Args:
    w_KxN: bf16 / fp16 / fp32 weight [K = in_features, N = out_features].
    scheme: "nvfp4", "mxfp4" or "nf4".
    global_scale: nvfp4 only: float32 [1] to use instead of this tensor's own (fused q/k/v, gate/up;
      see :func:`shared_global_scale`).
    double_quant: nf4 only: also quantize the block absmaxes (QLoRA double quantization).
    name: tensor name for error messages.
  Returns:
    NVFP4Tensor | MXFP4Tensor | NF4Tensor holding the compressed-tensors / bitsandbytes bytes.
  Raises:
    ValueError: NaN/Inf in the weight, K not divisible by the block, unknown scheme.
  """
  w_KxN = jnp.asarray(w_KxN)
  if w_KxN.ndim != 2:
    raise ValueError(f"tensor {name or '<unnamed>'}: expected a 2-D weight, got shape {w_KxN.shape}")
  return quantize_NxK(w_KxN.T, scheme, global_scale=global_scale, double_quant=double_quant,
                      name=name)


def dequantize_NxK(q: QuantizedTensor, dtype=jnp.bfloat16) -> jax.Array:
  """[N, K] weight in ``dtype`` (compressed-tensors' / bitsandbytes' own dequantization order)."""
  if isinstance(q, NVFP4Tensor):
    return nvfp4.dequantize_NxK(q, dtype)
  if isinstance(q, MXFP4Tensor):
    return mxfp4.dequantize_NxK(q, dtype)
  if isinstance(q, NF4Tensor):
    return nf4.dequantize_NxK(q, dtype)
  raise TypeError(f"not a quantized tensor: {type(q).__name__}")


def dequantize(q: QuantizedTensor, dtype=jnp.bfloat16) -> jax.Array:
  """The [K, N] weight ``q`` stands for, in ``dtype``."""
  return dequantize_NxK(q, dtype).T


def dequantize_stacked(q: QuantizedTensor, dtype=jnp.bfloat16) -> jax.Array:
  """The [L, K, N] weights a stack of L quantized tensors (every array with a leading L axis) stands for."""
  return jax.vmap(lambda one: dequantize(one, dtype))(q)


def nvfp4_global_scale(w: jax.Array) -> jax.Array:
  """float32 [1] NVFP4 global scale 2688 / amax(|w|) (any layout: it only depends on amax)."""
  return nvfp4.global_scale(jnp.asarray(w))


def shared_global_scale(ws: Iterable[jax.Array]) -> jax.Array:
  """One float32 [1] global scale for fused partitions (q/k/v, gate/up): the minimum of theirs.

  The smallest global scale belongs to the largest amax, so every partition's blocks stay in range.
  vLLM fuses these layers and reads a single value, so they must agree in the checkpoint.
  """
  scales = [nvfp4_global_scale(w) for w in ws]
  if not scales:
    raise ValueError("shared_global_scale needs at least one tensor")
  return jnp.min(jnp.concatenate(scales)).reshape(1)


def to_ct_tensors(q: QuantizedTensor) -> dict[str, np.ndarray]:
  """compressed-tensors tensors of one Linear (without the module prefix), as exact host copies."""
  if isinstance(q, NVFP4Tensor):
    return {
      "weight_packed": np.asarray(q.packed_NxKh, np.uint8),
      "weight_scale": np.asarray(q.scale_NxKb).astype(ml_dtypes.float8_e4m3fn),
      "weight_global_scale": np.asarray(q.global_scale, np.float32).reshape(1),
    }
  if isinstance(q, MXFP4Tensor):
    return {
      "weight_packed": np.asarray(q.packed_NxKh, np.uint8),
      "weight_scale": np.asarray(q.scale_NxKb, np.uint8),
    }
  raise ValueError(f"{type(q).__name__} has no compressed-tensors format (only NVFP4 and MXFP4 do)")


def _as_fp8(scale: np.ndarray) -> np.ndarray:
  scale = np.asarray(scale)
  if scale.dtype == np.uint8:  # raw bytes, as some readers hand float8 back
    return scale.view(ml_dtypes.float8_e4m3fn)
  if scale.dtype != ml_dtypes.float8_e4m3fn:
    raise ValueError(f"nvfp4 weight_scale must be float8_e4m3fn, got {scale.dtype}")
  return scale


def from_ct_tensors(d: Mapping[str, np.ndarray], scheme: str) -> QuantizedTensor:
  """The quantized type for one Linear's compressed-tensors tensors (exact copies, no math).

  The arrays stay host NumPy arrays (a loader places them with ``jax.device_put``).
  """
  check_scheme(scheme)
  missing = [k for k in ("weight_packed", "weight_scale") if k not in d]
  if scheme == "nvfp4" and "weight_global_scale" not in d:
    missing.append("weight_global_scale")
  if missing:
    raise ValueError(f"{scheme} tensors are missing {missing}; got {sorted(d)}")
  packed = np.asarray(d["weight_packed"])
  if packed.dtype != np.uint8 or packed.ndim != 2:
    raise ValueError(f"weight_packed must be uint8 [N, K/2], got {packed.dtype} {packed.shape}")
  n, kh = packed.shape
  block = BLOCK_OF_SCHEME[scheme]
  if scheme == "nvfp4":
    scale = _as_fp8(d["weight_scale"])
    gs = np.asarray(d["weight_global_scale"], np.float32).reshape(1)
    if scale.shape != (n, 2 * kh // block):
      raise ValueError(f"weight_scale shape {scale.shape} does not match weight_packed {packed.shape}")
    return NVFP4Tensor(packed_NxKh=packed, scale_NxKb=scale, global_scale=gs)
  if scheme == "mxfp4":
    scale = np.asarray(d["weight_scale"])
    if scale.dtype != np.uint8 or scale.shape != (n, 2 * kh // block):
      raise ValueError(f"mxfp4 weight_scale must be uint8 [N, K/32], got {scale.dtype} {scale.shape}")
    return MXFP4Tensor(packed_NxKh=packed, scale_NxKb=scale)
  raise ValueError("nf4 has no compressed-tensors format")
