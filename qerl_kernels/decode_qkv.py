"""The attention's input at a decode step in one kernel: q|k|v's split-K partials, biases, LoRA terms and RoPE.

At a batch-1 7B decode step the q|k|v group launch (``nvfp4_gemv.nvfp4_gemv_xa_partials``) leaves float32
partial sums of y = h @ [W_q | W_k | W_v] over its K split and of the adapters' x @ [A_q | A_k | A_v | 0]. XLA
then ran the partials' sums, three adapter up-projections, RoPE on q and k, and the concatenation into the
decode attention kernel's one input array: ~0.23 ms per step at e127210 (experiments/RESULTS.md). Here one
launch writes that array (``qerl_kernels.decode_attention``'s rows: the query heads, the token's k and v heads, then
zero rows), one program per (row, head): a head's two RoPE halves are in the same program, so nothing crosses
programs.

Rounding follows the unfused model (``qkv_rows_reference``; `qerl_jax.model.linear.merged_linears`, then
`qerl_jax.model.attention.apply_rope` and the cache's dtype, as `qerl_jax.model.transformer._layer` does).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qerl_kernels import config as config_lib


def qkv_rows_kernel(parts_ref, cos_ref, sin_ref, *refs, heads: int, kv_heads: int, head_dim: int, num_parts: int,
                    xa_parts: int, rank: int, lora_scale: float, bias: bool, dtype, cache_dtype):
  """Row ``program_id(0)``'s head ``program_id(1)`` of the rows [M, H + 2 Hkv + Gp, Dh] (float32).

  parts_ref [S, M, (H + 2 Hkv) Dh] (float32 partial sums of [q | k | v], or x's dtype when S = 1); cos_ref,
  sin_ref float32 [M, Dh / 2]; with ``rank``, xa_ref float32 [P, M, R >= 3 rank] (x @ [A_q | A_k | A_v | 0]
  partials) and b_ref [3 rank, (H + 2 Hkv) Dh] (the group's block-diagonal B); with ``bias`` bias_ref [(H + 2
  Hkv) Dh]; then rows_ref. Head j < H is a query head, then Hkv k heads and Hkv v heads (each at columns
  j Dh of [q | k | v]), then the zero rows the attention kernel's padded loads may touch.
  """
  refs = list(refs)
  xa_ref, b_ref = (refs.pop(0), refs.pop(0)) if rank else (None, None)
  bias_ref = refs.pop(0) if bias else None
  (rows_ref,) = refs
  m, j = pl.program_id(0), pl.program_id(1)
  real = j < heads + 2 * kv_heads  # past them: a zero row
  kind = (j >= heads).astype(jnp.int32) + (j >= heads + kv_heads).astype(jnp.int32)  # 0 q, 1 k, 2 v
  half = head_dim // 2
  each = jnp.arange(half) >= 0  # an all-true mask of one half's columns, for the loads that depend on ``real``

  def rounded(v, to=dtype):  # to x's (or the cache's) dtype and back: each rounding of the unfused model
    return v.astype(to).astype(jnp.float32)

  def load(ref_at):
    return plgpu.load(ref_at, mask=each & real, other=0).astype(jnp.float32)

  if rank:  # this kind's x @ A: the partials' float32 sum, rounded to B's dtype
    pp = pl.next_power_of_2(xa_parts)
    xa_R = jnp.sum(plgpu.load(xa_ref.at[pl.ds(0, pp), m, pl.ds(kind * rank, rank)],
                              mask=(jnp.arange(pp) < xa_parts)[:, None], other=0.0), axis=0)
    xa_R = xa_R.astype(b_ref.dtype).astype(jnp.float32)
  ys = []
  for c0 in (j * head_dim, j * head_dim + half):  # the head's two RoPE halves
    cols = pl.ds(c0, half)
    y = rounded(sum(load(parts_ref.at[jnp.int32(s), m, cols]) for s in range(num_parts)))
    if bias:
      y = rounded(y + load(bias_ref.at[cols]))
    if rank:  # this kind's rows of the block-diagonal B: the same products as its own B
      b_RxC = plgpu.load(b_ref.at[pl.ds(kind * rank, rank), cols], mask=(each & real)[None, :], other=0).astype(
          jnp.float32)
      y = rounded(y + rounded(jnp.sum(xa_R[:, None] * b_RxC, axis=0) * jnp.float32(lora_scale)))
    ys.append(y)
  y1, y2 = ys
  cos, sin = cos_ref[m, pl.ds(0, half)], sin_ref[m, pl.ds(0, half)]
  rope = kind < 2
  o1 = jnp.where(rope, rounded(y1 * cos - y2 * sin), y1)
  o2 = jnp.where(rope, rounded(y2 * cos + y1 * sin), y2)
  cached = kind > 0  # k and v as the cache stores them
  for c0, o in ((0, o1), (half, o2)):
    o = jnp.where(cached, rounded(o, cache_dtype), o)
    plgpu.store(rows_ref.at[m, j, pl.ds(c0, half)], jnp.where(real, o, 0.0))


def _check(parts, cos_MxR, sin_MxR, heads, kv_heads, head_dim, xa_PxMxR, b_RxN, rank, bias_N):
  n = (heads + 2 * kv_heads) * head_dim
  if parts.ndim != 3 or parts.shape[2] != n or head_dim % 2 or heads % kv_heads:
    raise ValueError(f"qkv_rows: partials {parts.shape} must be [S, M, (H + 2 Hkv) Dh] with H={heads}, "
                     f"Hkv={kv_heads} (dividing H), Dh={head_dim} (even)")
  m = parts.shape[1]
  if cos_MxR.shape != (m, head_dim // 2) or sin_MxR.shape != cos_MxR.shape:
    raise ValueError(f"qkv_rows: cos {cos_MxR.shape} and sin {sin_MxR.shape} must be [M={m}, Dh/2={head_dim // 2}]")
  if (xa_PxMxR is None) != (b_RxN is None):
    raise ValueError("qkv_rows: the adapters need both x @ A partials and the block-diagonal B")
  if b_RxN is not None and (rank < 1 or rank & (rank - 1) or b_RxN.shape[0] < 3 * rank or b_RxN.shape[1] != n
                            or xa_PxMxR.ndim != 3 or xa_PxMxR.shape[1] != m or xa_PxMxR.shape[2] < 3 * rank):
    raise ValueError(f"qkv_rows: B {b_RxN.shape} must be [>= 3r, {n}] and x @ A partials {xa_PxMxR.shape} "
                     f"[P, M, >= 3r] for the adapters' rank r={rank} (a power of two)")
  if bias_N is not None and bias_N.shape != (n,):
    raise ValueError(f"qkv_rows: bias {bias_N.shape} must be [{n}]")


def padded_heads(heads: int, kv_heads: int) -> int:
  """The zero rows after the heads in ``qerl_kernels.decode_attention``'s rows: its tensor-core dots load Gp rows."""
  g = heads // kv_heads
  return max(16, 1 << (g - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("heads", "kv_heads", "head_dim", "rank", "lora_scale", "dtype",
                                             "cache_dtype", "num_warps", "interpret"))
def qkv_rows(parts: jax.Array, cos_MxR: jax.Array, sin_MxR: jax.Array, *, heads: int, kv_heads: int, head_dim: int,
             dtype, cache_dtype, xa_PxMxR: jax.Array | None = None, b_RxN: jax.Array | None = None, rank: int = 0,
             lora_scale: float = 1.0, bias_N: jax.Array | None = None, num_warps: int | None = None,
             interpret: bool = False) -> jax.Array:
  """float32 [M, H + 2 Hkv + Gp, Dh]: RoPE'd q heads, RoPE'd k heads and v heads in ``cache_dtype``, zero rows.

  parts: the q|k|v group launch's split-K partial sums [S, M, (H + 2 Hkv) Dh] (float32; or its finished output
  in ``dtype``, S = 1). cos_MxR, sin_MxR: each row's RoPE table at its position (`attention.rope_cos_sin`).
  xa_PxMxR: float32 partials of x @ [A_q | A_k | A_v | zero padding] and b_RxN the group's block-diagonal B
  (`param_views.with_merged_launches`), every member's rank ``rank``. bias_N: [b_q | b_k | b_v].
  """
  _check(parts, cos_MxR, sin_MxR, heads, kv_heads, head_dim, xa_PxMxR, b_RxN, rank, bias_N)
  num_warps = config_lib.decode_launch("qkv_rows", interpret, num_warps=num_warps)["num_warps"]
  m = parts.shape[1]
  operands = [parts, cos_MxR.astype(jnp.float32), sin_MxR.astype(jnp.float32)]
  if b_RxN is not None:
    operands += [xa_PxMxR.astype(jnp.float32), b_RxN]
  if bias_N is not None:
    operands.append(bias_N)
  rows = heads + 2 * kv_heads + padded_heads(heads, kv_heads)
  kernel = functools.partial(qkv_rows_kernel, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                             num_parts=parts.shape[0], xa_parts=0 if xa_PxMxR is None else xa_PxMxR.shape[0],
                             rank=rank if b_RxN is not None else 0, lora_scale=float(lora_scale),
                             bias=bias_N is not None, dtype=jnp.dtype(dtype), cache_dtype=jnp.dtype(cache_dtype))
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, rows, head_dim), jnp.float32),
      grid=(m, rows),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="decode_qkv_rows",
  )(*operands)


def qkv_rows_reference(parts: jax.Array, cos_MxR: jax.Array, sin_MxR: jax.Array, *, heads: int, kv_heads: int,
                       head_dim: int, dtype, cache_dtype, xa_PxMxR: jax.Array | None = None,
                       b_RxN: jax.Array | None = None, rank: int = 0, lora_scale: float = 1.0,
                       bias_N: jax.Array | None = None) -> jax.Array:
  """`qkv_rows` in jnp, in the unfused model's order of operations (each member's own B: its block)."""
  from qerl_jax.model.attention import apply_rope  # pylint: disable=import-outside-toplevel
  m = parts.shape[1]
  widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
  y = parts.astype(jnp.float32).sum(axis=0).astype(dtype)
  ends = [widths[0], widths[0] + widths[1]]
  members = jnp.split(y, ends, axis=-1)
  if bias_N is not None:
    members = [y_p + b.astype(dtype) for y_p, b in zip(members, jnp.split(bias_N, ends))]
  if b_RxN is not None:
    xa = xa_PxMxR.astype(jnp.float32).sum(axis=0).astype(b_RxN.dtype)
    bs = jnp.split(b_RxN, ends, axis=-1)
    members = [y_p + (jnp.einsum("mr,rn->mn", xa[:, i * rank:(i + 1) * rank], b_p[i * rank:(i + 1) * rank],
                                 preferred_element_type=jnp.float32) * lora_scale).astype(dtype)
               for i, (y_p, b_p) in enumerate(zip(members, bs))]
  q, k, v = (y_p.reshape(m, 1, -1, head_dim) for y_p in members)
  q, k = apply_rope(q, cos_MxR[:, None], sin_MxR[:, None]), apply_rope(k, cos_MxR[:, None], sin_MxR[:, None])
  k, v = k.astype(cache_dtype), v.astype(cache_dtype)
  zeros = jnp.zeros((m, padded_heads(heads, kv_heads), head_dim), jnp.float32)
  return jnp.concatenate([y_p[:, 0].astype(jnp.float32) for y_p in (q, k, v)] + [zeros], axis=1)
