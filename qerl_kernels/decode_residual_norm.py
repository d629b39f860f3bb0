"""The end of a decode step's block in two kernels: the residual add, then the RMSNorm the next matmul reads.

At a batch-1 7B decode step the gemv leaves o_proj's (and down_proj's) output as float32 partial sums over its
K split, and its LoRA x @ A as partial sums of the extra programs (``nvfp4_gemv.nvfp4_gemv_xa_pallas``). XLA then
ran four small kernels per layer for each: the x @ A sum, the partials' sum with the adapter's (x @ A) @ B and
the residual add, the norm's sum of squares, and the normalization (~6.3 us per layer after o_proj at aaa1393,
``experiments/results/decode_profile_hlo_aaa1393.txt``). Here the first kernel's programs each finish a block of
columns of x + y and its sum of squares; the second normalizes each block with the row's total. The two are
separate calls (``residual_add`` returns a ``PendingNorm``; ``pending_norm`` launches it), so a decode gemv can
read the pending norm and normalize x as it loads it instead (ModelConfig.decode_norm_fold).

Rounding follows the unfused model exactly (``residual_norm_reference``): the partials' sum is rounded to x's
dtype, then the bias and the adapter's term are added, each rounded as `qerl_jax.model.linear._add_terms` does,
then the residual add in x's dtype, then `qerl_jax.model.attention.rms_norm` in float32. Only the order of the
float32 sums differs from XLA's.

Measured on an H200 (experiments/RESULTS.md, "At e127210"): one program per row (86dbcd0, 6eb9863) took 11-18 us
per call at batch 1 against ~6 us for XLA's four kernels (one SM does not stream the ~0.2 MB of partials and B
fast enough); these two launches take 2.7-3.6 us and 1.4 us.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qerl_kernels import config as config_lib


def residual_add_kernel(x_ref, parts_ref, *refs, d: int, block_d: int, num_parts: int, xa_parts: int, rank: int,
                        lora_scale: float, bias: bool):
  """Columns [j * block_d, ...) of row m (program (m, j)): x_out = x + y, y the partials' sum plus bias and
  adapter; ss_out[m, j] = the block's sum of x_out^2 (float32) for the norm.

  x_ref [M, D] (x's dtype); parts_ref [S, M, D] (float32 partial sums, or x's dtype when S = 1); then, with
  ``rank``, xa_ref float32 [P, M, r] (x @ A partials) and b_ref [r, D]; with ``bias`` bias_ref [D]; then the
  outputs x_out [M, D] (x's dtype) and ss_out float32 [M, blocks].
  """
  refs = list(refs)
  xa_ref, b_ref = (refs.pop(0), refs.pop(0)) if rank else (None, None)
  bias_ref = refs.pop(0) if bias else None
  x_out, ss_out = refs
  m, j = pl.program_id(0), pl.program_id(1)
  dtype = x_out.dtype
  cols, valid = pl.ds(j * block_d, block_d), j * block_d + jnp.arange(block_d) < d

  def rounded(v):  # to x's dtype and back: each rounding of the unfused model
    return v.astype(dtype).astype(jnp.float32)

  def load(ref_at):
    return plgpu.load(ref_at, mask=valid, other=0).astype(jnp.float32)

  y = rounded(sum(load(parts_ref.at[jnp.int32(s), m, cols]) for s in range(num_parts)))
  if bias:
    y = rounded(y + load(bias_ref.at[cols]))
  if rank:  # x @ A: the partials' float32 sum, rounded to B's dtype (`linear._add_terms`'s input)
    pp = pl.next_power_of_2(xa_parts)
    xa_PxR = plgpu.load(xa_ref.at[pl.ds(0, pp), m, pl.ds(0, rank)], mask=(jnp.arange(pp) < xa_parts)[:, None],
                        other=0.0)
    xa_R = jnp.sum(xa_PxR, axis=0).astype(b_ref.dtype).astype(jnp.float32)
    b_RxC = plgpu.load(b_ref.at[pl.ds(0, rank), cols], mask=valid[None, :], other=0).astype(jnp.float32)
    y = rounded(y + rounded(jnp.sum(xa_R[:, None] * b_RxC, axis=0) * jnp.float32(lora_scale)))
  x_new = rounded(load(x_ref.at[m, cols]) + y)
  plgpu.store(x_out.at[m, cols], x_new.astype(dtype), mask=valid)
  plgpu.store(ss_out.at[m, pl.ds(j, 1)], jnp.sum(x_new * x_new, keepdims=True))


def row_inv_rms(ss_ref, row, *, blocks: int, d: int, eps: float) -> jax.Array:
  """rsqrt(mean(x^2) + eps) of row ``row`` (float32 scalar) from its blocks' sums of squares ss_ref [M, blocks].
  The norm kernel and a gemv that folds the norm in (``nvfp4_gemv.NormPlan``) both call this, so they agree."""
  bp = pl.next_power_of_2(blocks)
  sum_sq = jnp.sum(plgpu.load(ss_ref.at[row, pl.ds(0, bp)], mask=jnp.arange(bp) < blocks, other=0.0))
  return jax.lax.rsqrt(sum_sq * jnp.float32(1.0 / d) + jnp.float32(eps))


def normalized(x_f32: jax.Array, inv: jax.Array, scale_f32: jax.Array, dtype) -> jax.Array:
  """x * inv * (norm scale + noise), rounded to the activations' dtype as `qerl_jax.model.attention.rms_norm`."""
  return ((x_f32 * inv) * scale_f32).astype(dtype)


def norm_kernel(x_ref, ss_ref, w_ref, *refs, d: int, block_d: int, blocks: int, noise: bool, eps: float):
  """Columns [j * block_d, ...) of row m: h_out = x * rsqrt(mean(x^2) + eps) * (w + noise), the mean from the
  blocks' sums of squares. x_ref [M, D]; ss_ref float32 [M, blocks]; w_ref [D]; with ``noise`` noise_ref float32
  [D]; then h_out [M, D] in x's dtype."""
  noise_ref, h_out = refs if noise else (None, *refs)
  m, j = pl.program_id(0), pl.program_id(1)
  cols, valid = pl.ds(j * block_d, block_d), j * block_d + jnp.arange(block_d) < d
  inv = row_inv_rms(ss_ref, m, blocks=blocks, d=d, eps=eps)
  scale = plgpu.load(w_ref.at[cols], mask=valid, other=0).astype(jnp.float32)
  if noise:
    scale = scale + plgpu.load(noise_ref.at[cols], mask=valid, other=0.0)
  x = plgpu.load(x_ref.at[m, cols], mask=valid, other=0).astype(jnp.float32)
  plgpu.store(h_out.at[m, cols], normalized(x, inv, scale, h_out.dtype), mask=valid)


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


@functools.partial(jax.jit, static_argnames=("eps", "lora_scale", "block_d", "num_warps", "interpret"))
def residual_norm(x_MxD: jax.Array, parts_SxMxD: jax.Array, norm_D: jax.Array, *, eps: float,
                  xa_PxMxR: jax.Array | None = None, b_RxD: jax.Array | None = None, lora_scale: float = 1.0,
                  bias_D: jax.Array | None = None, noise_D: jax.Array | None = None, block_d: int | None = None,
                  num_warps: int | None = None, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """(x + y, rms_norm(x + y)) in x's dtype, y = sum(parts) + bias + lora_scale * (sum(xa) @ B): two launches.

  x_MxD: the residual stream. parts_SxMxD: a projection's split-K partial sums (float32; or its finished
  output in x's dtype, S = 1). norm_D: the RMSNorm's scale, noise_D its AQN addition (float32) or None.
  xa_PxMxR: float32 partial sums of the adapter's x @ A (summed, then rounded to B's dtype) with B [r, D], r a
  power of two. block_d: columns per program (a power of two); it and num_warps default to the device's tuning
  (``config.decode_launch``).
  """
  pending = residual_add(x_MxD, parts_SxMxD, norm_D, eps=eps, xa_PxMxR=xa_PxMxR, b_RxD=b_RxD,
                         lora_scale=lora_scale, bias_D=bias_D, noise_D=noise_D, block_d=block_d,
                         num_warps=num_warps, interpret=interpret)
  return pending.x_MxD, pending.materialize()


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x_MxD", "ss_MxB", "scale_D", "noise_D"],
                   meta_fields=["eps", "shape", "block_d", "num_warps", "interpret"])
@dataclasses.dataclass(frozen=True)
class PendingNorm:
  """An RMSNorm not yet applied: h = rms_norm(x) of ``shape`` (x_MxD reshaped), with each row's sum of squares
  already split over blocks of columns (ss_MxB, float32, from ``residual_add``).

  ``materialize()`` runs the norm launch (``norm_kernel``). A decode gemv can instead read it as it loads x
  (``qerl_kernels.nvfp4_gemv.NormPlan``), which saves that launch; both round as `rms_norm` does.
  """

  x_MxD: jax.Array
  ss_MxB: jax.Array
  scale_D: jax.Array
  noise_D: jax.Array | None
  eps: float
  shape: tuple[int, ...]
  block_d: int  # the norm launch's, as the add's: ss_MxB holds one sum per block_d columns
  num_warps: int
  interpret: bool

  @property
  def dtype(self):
    return self.x_MxD.dtype

  def materialize(self) -> jax.Array:
    """h [*shape] in x's dtype: the norm's own launch."""
    return pending_norm(self)


@jax.jit
def pending_norm(pending: PendingNorm) -> jax.Array:
  """`PendingNorm.materialize`: the norm's launch over the blocks' sums of squares."""
  m, d = pending.x_MxD.shape
  blocks = pending.ss_MxB.shape[1]
  ops = [pending.x_MxD, pending.ss_MxB, pending.scale_D] + ([] if pending.noise_D is None else [pending.noise_D])
  h = pl.pallas_call(
      functools.partial(norm_kernel, d=d, block_d=pending.block_d, blocks=blocks, noise=pending.noise_D is not None,
                        eps=float(pending.eps)),
      out_shape=jax.ShapeDtypeStruct((m, d), pending.x_MxD.dtype),
      grid=(m, blocks),
      compiler_params=plgpu.CompilerParams(num_warps=pending.num_warps, num_stages=1),
      interpret=pending.interpret,
      name="decode_residual_norm",
  )(*ops)
  return h.reshape(pending.shape)


@functools.partial(jax.jit, static_argnames=("eps", "lora_scale", "block_d", "num_warps", "interpret", "shape"))
def residual_add(x_MxD: jax.Array, parts_SxMxD: jax.Array, norm_D: jax.Array, *, eps: float,
                 xa_PxMxR: jax.Array | None = None, b_RxD: jax.Array | None = None, lora_scale: float = 1.0,
                 bias_D: jax.Array | None = None, noise_D: jax.Array | None = None, block_d: int | None = None,
                 num_warps: int | None = None, interpret: bool = False, shape: tuple[int, ...] | None = None
                 ) -> PendingNorm:
  """`residual_norm`'s first launch: x + y and its blocks' sums of squares, with the norm left pending
  (``PendingNorm``; x + y is its ``x_MxD``). shape: the normalized output's shape (default [M, D])."""
  _check(x_MxD, parts_SxMxD, norm_D, xa_PxMxR, b_RxD, bias_D, noise_D)
  launch = config_lib.decode_launch("residual_norm", interpret, block_d=block_d, num_warps=num_warps)
  block_d, num_warps = launch["block_d"], launch["num_warps"]
  m, d = x_MxD.shape
  rank = 0 if b_RxD is None else b_RxD.shape[0]
  if block_d < 16 or block_d & (block_d - 1) or rank & (rank - 1):
    raise ValueError(f"residual_norm: {block_d=} and the adapter's rank {rank} must be powers of two")
  block_d = min(block_d, pl.next_power_of_2(d))
  blocks = pl.cdiv(d, block_d)
  operands = [x_MxD, parts_SxMxD]
  if rank:
    operands += [xa_PxMxR.astype(jnp.float32), b_RxD]
  if bias_D is not None:
    operands.append(bias_D)
  x_new, ss = pl.pallas_call(
      functools.partial(residual_add_kernel, d=d, block_d=block_d, num_parts=parts_SxMxD.shape[0],
                        xa_parts=0 if xa_PxMxR is None else xa_PxMxR.shape[0], rank=rank,
                        lora_scale=float(lora_scale), bias=bias_D is not None),
      out_shape=(jax.ShapeDtypeStruct((m, d), x_MxD.dtype), jax.ShapeDtypeStruct((m, blocks), jnp.float32)),
      grid=(m, blocks),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="decode_residual_add",
  )(*operands)
  return PendingNorm(x_new, ss, norm_D, None if noise_D is None else noise_D.astype(jnp.float32), eps=float(eps),
                     shape=(m, d) if shape is None else tuple(shape), block_d=block_d, num_warps=num_warps,
                     interpret=interpret)


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
