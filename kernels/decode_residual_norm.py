"""The end of a decode step's attention block in one kernel: the residual add, then the RMSNorm the MLP reads.

At a batch-1 7B decode step the gemv leaves o_proj's output as float32 partial sums over its K split, and its
LoRA x @ A as partial sums of the extra programs (``nvfp4_gemv.nvfp4_gemv_xa_pallas``). XLA then ran four small
kernels per layer before the MLP's gemv: the x @ A sum, the partials' sum with the adapter's (x @ A) @ B and the
residual add, the norm's sum of squares, and the normalization (~6.3 us per layer, 177 us per step at aaa1393,
``experiments/results/decode_profile_hlo_aaa1393.txt``). Here one program per row does all of it: the row is
small (D = 3584: 14 KB of bf16), so one program can hold it and reduce it without a second launch.

Rounding follows the unfused model exactly (``residual_norm_reference``): the partials' sum is rounded to x's
dtype, then the bias and the adapter's term are added, each rounded as `qerl_jax.model.linear._add_terms` does,
then the residual add in x's dtype, then `qerl_jax.model.attention.rms_norm` in float32. Only the order of the
float32 sums differs from XLA's.

The row is read in contiguous pieces of ``chunk`` columns (Triton blocks are powers of two), held in registers
until the sum of squares is known. On an H200 at 86dbcd0 a first version, with the row split into its even
and odd columns (stride-2 loads), 4 warps and x @ A read as scalars, took 18.3 us per call at batch 1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def residual_norm_kernel(x_ref, parts_ref, *refs, d: int, chunk: int, num_parts: int, xa_parts: int, rank: int,
                         lora_scale: float, bias: bool, noise: bool, eps: float):
  """Row ``program_id(0)``: x_out = x + y (y the partials' sum plus bias and adapter), h_out = rms_norm(x_out).

  x_ref [M, D] (x's dtype); parts_ref [S, M, D] (float32 partial sums, or x's dtype when S = 1); then, with
  ``rank``, xa_ref float32 [P, M, r] (x @ A partials) and b_ref [r, D]; with ``bias`` bias_ref [D]; w_ref [D]
  (the norm's scale); with ``noise`` noise_ref float32 [D]; then the outputs x_out, h_out [M, D] in x's dtype.
  The row goes in ``chunk``-column pieces (a power of two; the last one masked), all held in registers until
  the norm's sum of squares is known.
  """
  refs = list(refs)
  xa_ref, b_ref = (refs.pop(0), refs.pop(0)) if rank else (None, None)
  bias_ref = refs.pop(0) if bias else None
  w_ref = refs.pop(0)
  noise_ref = refs.pop(0) if noise else None
  x_out, h_out = refs
  m = pl.program_id(0)
  dtype = x_out.dtype

  def rounded(v):  # to x's dtype and back: each rounding of the unfused model
    return v.astype(dtype).astype(jnp.float32)

  if rank:  # x @ A: the partials' float32 sum, rounded to B's dtype (`linear._add_terms`'s input)
    pp = pl.next_power_of_2(xa_parts)
    xa_PxR = plgpu.load(xa_ref.at[pl.ds(0, pp), m, pl.ds(0, rank)], mask=(jnp.arange(pp) < xa_parts)[:, None],
                        other=0.0)
    xa_R = jnp.sum(xa_PxR, axis=0).astype(b_ref.dtype).astype(jnp.float32)

  x_chunks, sum_sq = [], jnp.float32(0.0)
  for c0 in range(0, d, chunk):
    cols, valid = _piece(c0, chunk, d)
    load = lambda ref_at, valid=valid: plgpu.load(ref_at, mask=valid, other=0).astype(jnp.float32)
    y = rounded(sum(load(parts_ref.at[jnp.int32(s), m, cols]) for s in range(num_parts)))
    if bias:
      y = rounded(y + load(bias_ref.at[cols]))
    if rank:
      b_RxC = plgpu.load(b_ref.at[pl.ds(0, rank), cols], mask=valid[None, :], other=0).astype(jnp.float32)
      up = jnp.sum(xa_R[:, None] * b_RxC, axis=0)
      y = rounded(y + rounded(up * jnp.float32(lora_scale)))
    x_new = rounded(load(x_ref.at[m, cols]) + y)
    plgpu.store(x_out.at[m, cols], x_new.astype(dtype), mask=valid)
    x_chunks.append(x_new)
    sum_sq = sum_sq + jnp.sum(x_new * x_new)
  inv = jax.lax.rsqrt(sum_sq * jnp.float32(1.0 / d) + jnp.float32(eps))
  for c0, x_new in zip(range(0, d, chunk), x_chunks):
    cols, valid = _piece(c0, chunk, d)
    scale = plgpu.load(w_ref.at[cols], mask=valid, other=0).astype(jnp.float32)
    if noise:
      scale = scale + plgpu.load(noise_ref.at[cols], mask=valid, other=0.0)
    plgpu.store(h_out.at[m, cols], ((x_new * inv) * scale).astype(dtype), mask=valid)


def _piece(c0: int, chunk: int, d: int):
  """Columns [c0, c0 + chunk) and which of them are < d. The start is traced: Pallas refuses a static slice
  that overhangs the array, as the last piece may (its loads and stores are masked)."""
  return pl.ds(jnp.int32(c0), chunk), c0 + jnp.arange(chunk) < d


def _check(x_MxD, parts_SxMxD, norm_D, xa_PxMxR, b_RxD, bias_D, noise_D):
  m, d = x_MxD.shape
  if parts_SxMxD.ndim != 3 or parts_SxMxD.shape[1:] != (m, d) or norm_D.shape != (d,):
    raise ValueError(f"residual_norm: x {x_MxD.shape} must be [M, D], the partials "
                     f"{parts_SxMxD.shape} [S, M, D] and the norm's scale {norm_D.shape} [D]")
  if (xa_PxMxR is None) != (b_RxD is None):
    raise ValueError("residual_norm: the adapter needs both its x @ A partials and B, or neither")
  if xa_PxMxR is not None and (xa_PxMxR.ndim != 3 or xa_PxMxR.shape[1] != m
                               or b_RxD.shape != (xa_PxMxR.shape[2], d)):
    raise ValueError(f"residual_norm: x @ A partials {xa_PxMxR.shape} must be [P, M={m}, r] and B "
                     f"{b_RxD.shape} [r, D={d}]")
  for name, v in (("bias", bias_D), ("noise", noise_D)):
    if v is not None and v.shape != (d,):
      raise ValueError(f"residual_norm: {name} {v.shape} must be [D={d}]")


@functools.partial(jax.jit, static_argnames=("eps", "lora_scale", "chunk", "num_warps", "interpret"))
def residual_norm(x_MxD: jax.Array, parts_SxMxD: jax.Array, norm_D: jax.Array, *, eps: float,
                  xa_PxMxR: jax.Array | None = None, b_RxD: jax.Array | None = None, lora_scale: float = 1.0,
                  bias_D: jax.Array | None = None, noise_D: jax.Array | None = None, chunk: int = 1024,
                  num_warps: int = 8, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """(x + y, rms_norm(x + y)) in x's dtype, y = sum(parts) + bias + lora_scale * (sum(xa) @ B), one kernel.

  x_MxD: the residual stream. parts_SxMxD: a projection's split-K partial sums (float32; or its finished
  output in x's dtype, S = 1). norm_D: the RMSNorm's scale, noise_D its AQN addition (float32) or None.
  xa_PxMxR: float32 partial sums of the adapter's x @ A (summed, then rounded to B's dtype) with B [r, D], r a
  power of two. chunk: columns per piece of the row (a power of two).
  """
  _check(x_MxD, parts_SxMxD, norm_D, xa_PxMxR, b_RxD, bias_D, noise_D)
  m, d = x_MxD.shape
  rank = 0 if b_RxD is None else b_RxD.shape[0]
  if chunk < 16 or chunk & (chunk - 1) or rank & (rank - 1):
    raise ValueError(f"residual_norm: {chunk=} and the adapter's rank {rank} must be powers of two")
  operands = [x_MxD, parts_SxMxD]
  if rank:
    operands += [xa_PxMxR.astype(jnp.float32), b_RxD]
  operands += [v for v in (bias_D, norm_D) if v is not None]
  if noise_D is not None:
    operands.append(noise_D.astype(jnp.float32))
  kernel = functools.partial(residual_norm_kernel, d=d, chunk=min(chunk, pl.next_power_of_2(d)),
                             num_parts=parts_SxMxD.shape[0], xa_parts=0 if xa_PxMxR is None else xa_PxMxR.shape[0],
                             rank=rank, lora_scale=float(lora_scale), bias=bias_D is not None,
                             noise=noise_D is not None, eps=float(eps))
  out = jax.ShapeDtypeStruct((m, d), x_MxD.dtype)
  x_new, h = pl.pallas_call(
      kernel,
      out_shape=(out, out),
      grid=(m,),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="decode_residual_norm",
  )(*operands)
  return x_new, h


def residual_norm_reference(x_MxD: jax.Array, parts_SxMxD: jax.Array, norm_D: jax.Array, *, eps: float,
                            xa_PxMxR: jax.Array | None = None, b_RxD: jax.Array | None = None,
                            lora_scale: float = 1.0, bias_D: jax.Array | None = None,
                            noise_D: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """`residual_norm` in jnp, in the unfused model's order of operations (its decode path with this off)."""
  dtype = x_MxD.dtype
  y = parts_SxMxD.astype(jnp.float32).sum(axis=0).astype(dtype)
  if bias_D is not None:
    y = y + bias_D.astype(dtype)
  if b_RxD is not None:
    xa = xa_PxMxR.astype(jnp.float32).sum(axis=0).astype(b_RxD.dtype)
    up = jnp.einsum("mr,rd->md", xa, b_RxD, preferred_element_type=jnp.float32) * lora_scale
    y = y + up.astype(dtype)
  x_new = x_MxD + y
  x32 = x_new.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  scale = norm_D.astype(jnp.float32)
  if noise_D is not None:
    scale = scale + noise_D.astype(jnp.float32)
  return x_new, (x32 * scale).astype(dtype)
