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

Every vector is handled as its even and odd columns (refs viewed as [..., D/2, 2], two stride-2 loads): a
Triton block must be a power of two, and D/2 rounded up wastes less than D rounded up for D = 3584.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def residual_norm_kernel(x_ref, parts_ref, *refs, d: int, d2p: int, num_parts: int, xa_parts: int, rank: int,
                         lora_scale: float, bias: bool, noise: bool, eps: float):
  """Row ``program_id(0)``: x_out = x + y (y the partials' sum plus bias and adapter), h_out = rms_norm(x_out).

  x_ref [M, D/2, 2] (x's dtype); parts_ref [S, M, D/2, 2] (float32 partial sums, or x's dtype when S = 1);
  then, with ``rank``, xa_ref float32 [P, M, r] (x @ A partials) and b_ref [r, D/2, 2]; with ``bias`` bias_ref
  [D/2, 2]; w_ref [D/2, 2] (the norm's scale); with ``noise`` noise_ref float32 [D/2, 2]; then the outputs
  x_out, h_out [M, D/2, 2] in x's dtype. Column pair c of a [..., D/2, 2] view holds columns 2c and 2c + 1.
  """
  refs = list(refs)
  xa_ref, b_ref = (refs.pop(0), refs.pop(0)) if rank else (None, None)
  bias_ref = refs.pop(0) if bias else None
  w_ref = refs.pop(0)
  noise_ref = refs.pop(0) if noise else None
  x_out, h_out = refs
  m = pl.program_id(0)
  dtype = x_out.dtype
  pairs = pl.ds(0, d2p)
  valid = jnp.arange(d2p) < d // 2

  def rounded(v):  # to x's dtype and back: each rounding of the unfused model
    return v.astype(dtype).astype(jnp.float32)

  def load(ref_at):  # one plane of a [..., D/2, 2] view, float32, zeros past D
    return plgpu.load(ref_at, mask=valid, other=0).astype(jnp.float32)

  xa_r = []
  for r in range(rank):  # x @ A: the partials' float32 sum, rounded to B's dtype (`linear._add_terms`'s input)
    total = sum(xa_ref[jnp.int32(p), m, jnp.int32(r)] for p in range(xa_parts))
    xa_r.append(total.astype(b_ref.dtype).astype(jnp.float32))

  x_planes = []
  for h in range(2):
    plane = jnp.int32(h)
    y = rounded(sum(load(parts_ref.at[jnp.int32(s), m, pairs, plane]) for s in range(num_parts)))
    if bias:
      y = rounded(y + load(bias_ref.at[pairs, plane]))
    if rank:
      up = sum(xa_r[r] * load(b_ref.at[jnp.int32(r), pairs, plane]) for r in range(rank))
      y = rounded(y + rounded(up * jnp.float32(lora_scale)))
    x_new = rounded(load(x_ref.at[m, pairs, plane]) + y)
    plgpu.store(x_out.at[m, pairs, plane], x_new.astype(dtype), mask=valid)
    x_planes.append(x_new)
  mean_sq = (jnp.sum(x_planes[0] * x_planes[0]) + jnp.sum(x_planes[1] * x_planes[1])) * jnp.float32(1.0 / d)
  inv = jax.lax.rsqrt(mean_sq + jnp.float32(eps))
  for h in range(2):
    plane = jnp.int32(h)
    scale = load(w_ref.at[pairs, plane])
    if noise:
      scale = scale + load(noise_ref.at[pairs, plane])
    plgpu.store(h_out.at[m, pairs, plane], ((x_planes[h] * inv) * scale).astype(dtype), mask=valid)


def _pairs(a: jax.Array) -> jax.Array:
  return a.reshape(*a.shape[:-1], a.shape[-1] // 2, 2)


def _check(x_MxD, parts_SxMxD, norm_D, xa_PxMxR, b_RxD, bias_D, noise_D):
  m, d = x_MxD.shape
  if d % 2 or parts_SxMxD.ndim != 3 or parts_SxMxD.shape[1:] != (m, d) or norm_D.shape != (d,):
    raise ValueError(f"residual_norm: x {x_MxD.shape} must be [M, D] with D even, the partials "
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


@functools.partial(jax.jit, static_argnames=("eps", "lora_scale", "num_warps", "interpret"))
def residual_norm(x_MxD: jax.Array, parts_SxMxD: jax.Array, norm_D: jax.Array, *, eps: float,
                  xa_PxMxR: jax.Array | None = None, b_RxD: jax.Array | None = None, lora_scale: float = 1.0,
                  bias_D: jax.Array | None = None, noise_D: jax.Array | None = None, num_warps: int = 4,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """(x + y, rms_norm(x + y)) in x's dtype, y = sum(parts) + bias + lora_scale * (sum(xa) @ B), one kernel.

  x_MxD: the residual stream. parts_SxMxD: a projection's split-K partial sums (float32; or its finished
  output in x's dtype, S = 1). norm_D: the RMSNorm's scale, noise_D its AQN addition (float32) or None.
  xa_PxMxR: float32 partial sums of the adapter's x @ A (summed, then rounded to B's dtype) with B [r, D].
  """
  _check(x_MxD, parts_SxMxD, norm_D, xa_PxMxR, b_RxD, bias_D, noise_D)
  m, d = x_MxD.shape
  rank = 0 if b_RxD is None else b_RxD.shape[0]
  operands = [_pairs(x_MxD), _pairs(parts_SxMxD)]
  if rank:
    operands += [xa_PxMxR.astype(jnp.float32), _pairs(b_RxD)]
  operands += [_pairs(v) for v in (bias_D, norm_D) if v is not None]
  if noise_D is not None:
    operands.append(_pairs(noise_D.astype(jnp.float32)))
  kernel = functools.partial(residual_norm_kernel, d=d, d2p=pl.next_power_of_2(d // 2),
                             num_parts=parts_SxMxD.shape[0], xa_parts=0 if xa_PxMxR is None else xa_PxMxR.shape[0],
                             rank=rank, lora_scale=float(lora_scale), bias=bias_D is not None,
                             noise=noise_D is not None, eps=float(eps))
  out = jax.ShapeDtypeStruct((m, d // 2, 2), x_MxD.dtype)
  x_new, h = pl.pallas_call(
      kernel,
      out_shape=(out, out),
      grid=(m,),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="decode_residual_norm",
  )(*operands)
  return x_new.reshape(m, d), h.reshape(m, d)


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
