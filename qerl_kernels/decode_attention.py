"""Decode attention (one new token per row) over a stacked KV cache, read in place, up to the causal limit.

With the model's stacked cache (k, v [L, B, S, Hkv, Dh], `decode_layers="scan"`), XLA copies layer l's
dynamic slice before its attention dots (measured on an H200: ~3 ms per 7B decode step at 64 rows and 1280
slots, experiments/RESULTS.md); this kernel reads layer l of the stack where it lies. The unrolled decode
loop keeps one cache per layer and passes it as a stack of one. Either way a decode step only reads the
blocks before the token's own slot + 1 (``num_visible``), not the whole response budget. Flash-decoding: the
grid is (row x kv head, split of the slots); each program keeps an online softmax for the G = H / Hkv query
heads that share its kv head (padded to the 16 rows a tensor-core dot needs), and a second small kernel merges
the splits' normalized outputs by their log-sum-exps. `decode_attention_update` also stores the token's own
k and v in the cache, so a decode step's layer needs no XLA kernel to write it.

Numerics follow `qerl_jax.model.attention`: float32 scores scaled by Dh**-0.5, masked scores set to the same
large negative finite number (a row with nothing visible gives finite garbage, not NaN), probabilities cast
to the activation dtype before the product with v.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qerl_kernels import config as config_lib
from qerl_kernels.decode_qkv import padded_heads

_MASKED = -0.7 * float(np.finfo(np.float32).max)


def split_blocks(visible, split, *, block_s: int, splits: int):
  """(first block, blocks) of split ``split``: the blocks holding a slot before ``visible`` (may be traced),
  shared evenly, so none walks more than ceil(blocks / splits) of them.

  The visible blocks, not the cache's, are what the splits share: a rollout at step i reads P + i slots, and a
  plan over the whole budget (before this) left the later splits idle while the first ones walked up to
  budget / splits blocks each (10 and 3 blocks mid-rollout at a 7B batch of 64).
  """
  visible_blocks = (visible + block_s - 1) // block_s
  per_split = (visible_blocks + splits - 1) // splits
  first = split * per_split
  return first, jnp.clip(visible_blocks - first, 0, per_split)


def decode_attention_kernel(*refs, batch: int, seq: int, cache_len: int, kv_heads: int, group: int, gp: int,
                            head_dim: int, block_s: int, splits: int, update: bool, q_dtype):
  """One (row, kv head) over one split of the blocks before the visible limit (the splits share them evenly).

  refs: rows_ref float32 [B, H (+ 2 Hkv with `update`) + Gp, Dh] (the query heads, then this token's k and v
  heads, then zeros: one array, so XLA forms it in one kernel); layer_ref int32 [1]; visible_ref int32 [1]
  (slots from it on are invisible to every row: they are not read); mask_ref int32 [B, S] (nonzero: visible);
  k_ref, v_ref [L * B * cache_len, Hkv * Dh] (the stacked cache, rows (l * B + b) * cache_len + s); then the
  outputs: o_ref float32 [Sp, B, Hkv, Gp, Dh] (each split's softmax-normalized output; Sp is the splits rounded
  up to a power of two), lse_ref float32 [Sp, B, Hkv, Gp] and, with `update`, the cache again (k_ref and v_ref's
  buffers, aliased), where split 0 writes the new slot.
  """
  if update:
    rows_ref, layer_ref, visible_ref, mask_ref, k_ref, v_ref, o_ref, lse_ref, k_out, v_out = refs
  else:
    rows_ref, layer_ref, visible_ref, mask_ref, k_ref, v_ref, o_ref, lse_ref = refs
  bh = pl.program_id(0)
  split = pl.program_id(1)
  b = bh // kv_heads
  h = bh % kv_heads
  layer = layer_ref[0]
  q_GxD = plgpu.load(rows_ref.at[b, pl.ds(h * group, gp), pl.ds(0, head_dim)],
                     mask=(jnp.arange(gp) < group)[:, None], other=0.0).astype(q_dtype)
  cache_row0 = (layer * batch + b) * cache_len
  cols = pl.ds(h * head_dim, head_dim)
  scale = head_dim ** -0.5

  first_block, blocks = split_blocks(visible_ref[0], split, block_s=block_s, splits=splits)

  def body(i, carry):
    m_G, l_G, acc_GxD = carry
    s0 = (first_block + i) * block_s
    slots = s0 + jnp.arange(block_s)
    # Never a slot past the limit: with `update`, split 0 writes the limit's slot while others may read.
    in_range = (slots < seq) & (slots < visible_ref[0])
    k_SxD = plgpu.load(k_ref.at[pl.ds(cache_row0 + s0, block_s), cols], mask=in_range[:, None], other=0.0)
    v_SxD = plgpu.load(v_ref.at[pl.ds(cache_row0 + s0, block_s), cols], mask=in_range[:, None], other=0.0)
    visible = plgpu.load(mask_ref.at[b, pl.ds(s0, block_s)], mask=in_range, other=0) != 0
    scores_GxS = jax.lax.dot_general(q_GxD, k_SxD.astype(q_GxD.dtype), (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32) * scale
    scores_GxS = jnp.where(visible[None, :], scores_GxS, _MASKED)
    m_new = jnp.maximum(m_G, jnp.max(scores_GxS, axis=1))
    alpha = jnp.exp(m_G - m_new)
    p_GxS = jnp.exp(scores_GxS - m_new[:, None])
    l_new = l_G * alpha + jnp.sum(p_GxS, axis=1)
    pv_GxD = jax.lax.dot_general(p_GxS.astype(q_GxD.dtype), v_SxD.astype(q_GxD.dtype), (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
    return m_new, l_new, acc_GxD * alpha[:, None] + pv_GxD

  init = (jnp.full((gp,), _MASKED, jnp.float32), jnp.zeros((gp,), jnp.float32),
          jnp.zeros((gp, head_dim), jnp.float32))
  m_G, l_G, acc_GxD = jax.lax.fori_loop(0, blocks, body, init)
  if update:  # this token's own slot, from its k and v rather than the cache: split 0 adds it and stores it
    slot = visible_ref[0]
    k_new_D = plgpu.load(rows_ref.at[b, kv_heads * group + h, pl.ds(0, head_dim)]).astype(k_out.dtype)
    v_new_D = plgpu.load(rows_ref.at[b, kv_heads * (group + 1) + h, pl.ds(0, head_dim)]).astype(v_out.dtype)
    seen = jnp.max(plgpu.load(mask_ref.at[b, pl.ds(slot, 1)])) != 0
    score_G = jnp.sum(q_GxD.astype(jnp.float32) * k_new_D.astype(q_GxD.dtype).astype(jnp.float32)[None, :],
                      axis=1) * scale
    score_G = jnp.where(seen, score_G, _MASKED)
    m_new = jnp.maximum(m_G, score_G)
    alpha = jnp.exp(m_G - m_new)
    p_G = jnp.exp(score_G - m_new)
    pv_GxD = p_G.astype(q_GxD.dtype).astype(jnp.float32)[:, None] * v_new_D.astype(q_GxD.dtype).astype(
        jnp.float32)[None, :]
    first_split = split == 0
    m_G = jnp.where(first_split, m_new, m_G)
    l_G = jnp.where(first_split, l_G * alpha + p_G, l_G)
    acc_GxD = jnp.where(first_split, acc_GxD * alpha[:, None] + pv_GxD, acc_GxD)

    @pl.when(first_split)
    def _():
      plgpu.store(k_out.at[pl.ds(cache_row0 + slot, 1), cols], k_new_D[None, :].astype(k_out.dtype))
      plgpu.store(v_out.at[pl.ds(cache_row0 + slot, 1), cols], v_new_D[None, :].astype(v_out.dtype))
  # A split that read a block has l_G >= 1 (its maximum contributes exp(0)); one that read none contributes
  # nothing to the merge: output 0 with a log-sum-exp far below any real one.
  read = l_G > 0
  plgpu.store(o_ref.at[split, b, h, pl.ds(0, gp), pl.ds(0, head_dim)],
              acc_GxD / jnp.where(read, l_G, 1.0)[:, None])
  plgpu.store(lse_ref.at[split, b, h, pl.ds(0, gp)], jnp.where(read, m_G + jnp.log(jnp.where(read, l_G, 1.0)),
                                                               _MASKED))


def merge_kernel(o_part_ref, lse_ref, out_ref, *, splits: int, kv_heads: int, group: int, head_dim: int):
  """One query head: its splits' normalized outputs weighted by the softmax of their log-sum-exps.

  o_part_ref float32 [splits, B, Hkv, Gp, Dh]; lse_ref float32 [splits, B, Hkv, Gp]; out_ref [B, H, Dh].
  """
  b = pl.program_id(0) // (kv_heads * group)
  head = pl.program_id(0) % (kv_heads * group)
  h, r = head // group, head % group
  sp = o_part_ref.shape[0]  # splits padded to a power of two (a Triton block); the padding is never written
  real = jnp.arange(sp) < splits
  lse_S = plgpu.load(lse_ref.at[pl.ds(0, sp), b, h, r], mask=real, other=_MASKED)
  o_SxD = plgpu.load(o_part_ref.at[pl.ds(0, sp), b, h, r, pl.ds(0, head_dim)], mask=real[:, None], other=0.0)
  w_S = jnp.where(real, jnp.exp(lse_S - jnp.max(lse_S)), 0.0)
  out_D = jnp.sum(w_S[:, None] * o_SxD, axis=0) / jnp.sum(w_S)
  plgpu.store(out_ref.at[b, head, pl.ds(0, head_dim)], out_D.astype(out_ref.dtype))


def _split_plan(b: int, kvh: int, seq: int, block_s: int, splits: int | None, programs_per_sm: int = 2) -> int:
  """Splits per (row, kv head): by default enough for ``programs_per_sm`` programs on each of the H200's 132
  SMs, at most one per block of the ``seq`` slots. A split walks its blocks one after another, so more, shorter
  splits trade the merge's reads for fewer loads in a row (on an H200 at 1e20e96 that trade came out even:
  experiments/RESULTS.md). Each launch shares the visible blocks among them (`split_blocks`).

  The count is the one whose even share of the budget's blocks needs no more splits (9 asked of 20 blocks: 3
  each, so 7): fewer programs for the same longest split, and the merge's power-of-two block stays 8 wide, not 16
  (on an H100 at a 7B batch of 8, 9 splits cost 1.87 us of merge per call against 1.60 for 7)."""
  num_blocks = pl.cdiv(seq, block_s)
  if splits is None:
    splits = -(-programs_per_sm * 132 // (b * kvh))
  splits = max(1, min(splits, num_blocks))
  return pl.cdiv(num_blocks, pl.cdiv(num_blocks, splits))


def _check(q_BxHxD, k_cache, v_cache, mask_BxS, block_s):
  b, h, d = q_BxHxD.shape
  _, cb, cache_len, kvh, cd = k_cache.shape
  seq = mask_BxS.shape[-1]
  if (cb, cd) != (b, d) or h % kvh or v_cache.shape != k_cache.shape or seq > cache_len:
    raise ValueError(f"decode_attention: q {q_BxHxD.shape}, caches {k_cache.shape} / {v_cache.shape}, mask "
                     f"{mask_BxS.shape} do not fit together ([B, H, Dh], [L, B, C, Hkv, Dh], [B, S <= C])")
  if block_s < 16 or block_s & (block_s - 1) or d & (d - 1):
    raise ValueError(f"{block_s=} and head_dim={d} must be powers of two (block_s >= 16)")


def _attend(q_BxHxD, k_cache, v_cache, layer, mask_BxS, limit, new_kv, *, block_s, splits, num_warps,
            programs_per_sm, num_stages, interpret):
  """The kernel, then the merge of its splits (a second small kernel): (out [B, H * Dh], the caches' outputs
  [L * B * C, Hkv * Dh] when `new_kv` gives this token's (k, v) [B, Hkv, Dh] to store at slot `limit`)."""
  _check(q_BxHxD, k_cache, v_cache, mask_BxS, block_s)
  b, h, d = q_BxHxD.shape
  gp = padded_heads(h, k_cache.shape[3])
  # float32 holds any activation or cache dtype exactly; k and v are rounded to the cache's, as a write would.
  rows = [q_BxHxD] + ([] if new_kv is None else [y.astype(k_cache.dtype) for y in new_kv])
  rows = jnp.concatenate([y.astype(jnp.float32) for y in rows] + [jnp.zeros((b, gp, d), jnp.float32)], axis=1)
  return _attend_rows(rows, k_cache, v_cache, layer, mask_BxS, limit, new_kv is not None, heads=h,
                      q_dtype=q_BxHxD.dtype, block_s=block_s, splits=splits, num_warps=num_warps,
                      programs_per_sm=programs_per_sm, num_stages=num_stages, interpret=interpret)


def _attend_rows(rows, k_cache, v_cache, layer, mask_BxS, limit, update: bool, *, heads: int, q_dtype, block_s,
                 splits, num_warps, programs_per_sm, num_stages, interpret):
  """`_attend` from its one input array: rows float32 [B, H (+ 2 Hkv with ``update``) + Gp, Dh]."""
  b, _, d = rows.shape
  num_layers, _, cache_len, kvh, _ = k_cache.shape
  h = heads
  seq = mask_BxS.shape[-1]
  g = h // kvh
  gp = padded_heads(h, kvh)
  splits = _split_plan(b, kvh, seq, block_s, splits, programs_per_sm)
  layer_1 = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  limit_1 = jnp.reshape(jnp.asarray(limit, jnp.int32), (1,))
  k2 = k_cache.reshape(num_layers * b * cache_len, kvh * d)
  v2 = v_cache.reshape(num_layers * b * cache_len, kvh * d)
  kernel = functools.partial(decode_attention_kernel, batch=b, seq=seq, cache_len=cache_len, kv_heads=kvh,
                             group=g, gp=gp, head_dim=d, block_s=block_s, splits=splits,
                             update=update, q_dtype=q_dtype)
  sp = 1 << (splits - 1).bit_length()  # the merge loads all splits as one power-of-two block
  out_shape = [jax.ShapeDtypeStruct((sp, b, kvh, gp, d), jnp.float32),
               jax.ShapeDtypeStruct((sp, b, kvh, gp), jnp.float32)]
  inputs = [rows, layer_1, limit_1, mask_BxS.astype(jnp.int32), k2, v2]
  aliases = {}
  if update:
    out_shape += [jax.ShapeDtypeStruct(k2.shape, k2.dtype), jax.ShapeDtypeStruct(v2.shape, v2.dtype)]
    aliases = {4: 2, 5: 3}  # the caches are written in place: one slot per (row, kv head)
  o_part, lse, *caches = pl.pallas_call(
      kernel,
      out_shape=tuple(out_shape),
      grid=(b * kvh, splits),
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="decode_attention",
  )(*inputs)
  if splits == 1:  # nothing to merge (e.g. 128 rollout rows of 7B: b * kvh programs fill the GPU)
    out = o_part[0, :, :, :g].reshape(b, h * d).astype(q_dtype)
  else:  # one kernel, where XLA's softmax over the splits and weighted sum took ~6 small ones per layer
    out = pl.pallas_call(
        functools.partial(merge_kernel, splits=splits, kv_heads=kvh, group=g, head_dim=d),
        out_shape=jax.ShapeDtypeStruct((b, h, d), q_dtype),
        grid=(b * h,),
        compiler_params=plgpu.CompilerParams(num_warps=1),
        interpret=interpret,
        name="decode_attention_merge",
    )(o_part, lse).reshape(b, h * d)
  return out, caches


def _launch(block_s: int | None, num_warps: int | None, interpret: bool) -> dict:
  """block_s, num_warps, programs_per_sm and num_stages: those given, else the device's tuning
  (``config.decode_launch``)."""
  return config_lib.decode_launch("attention", interpret, block_s=block_s, num_warps=num_warps)


def decode_attention(q_BxHxD: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, mask_BxS: jax.Array, *,
                     num_visible=None, block_s: int | None = None, splits: int | None = None,
                     num_warps: int | None = None, interpret: bool = False) -> jax.Array:
  """Attention of one query per row over layer ``layer`` of a stacked cache; returns [B, H * Dh] in q's dtype.

  q_BxHxD: the new token's query heads. k_cache, v_cache: [L, B, C, Hkv, Dh] (C >= S). layer: int32 scalar
  (may be traced). mask_BxS: bool, slot s of row b is visible (S <= C: later slots are never read).
  num_visible: int32 scalar (may be traced) or None (= S): slots from it on must be invisible in every row
  (the caller's promise, e.g. a decode step's causal limit); their blocks are skipped. splits: slot splits per
  (row, kv head) (None: the tuned ``programs_per_sm`` programs per SM, at most one split per block).
  """
  launch = _launch(block_s, num_warps, interpret)
  limit = mask_BxS.shape[-1] if num_visible is None else num_visible
  out, _ = _attend(q_BxHxD, k_cache, v_cache, layer, mask_BxS, limit, None, splits=splits, **launch,
                   interpret=interpret)
  return out


def decode_attention_update(q_BxHxD: jax.Array, k_new_BxKxD: jax.Array, v_new_BxKxD: jax.Array,
                            k_cache: jax.Array, v_cache: jax.Array, layer, slot, mask_BxS: jax.Array, *,
                            block_s: int | None = None, splits: int | None = None, num_warps: int | None = None,
                            interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`decode_attention` with the token's own k and v written into the cache by the same kernel.

  The same as storing k_new, v_new [B, Hkv, Dh] at slot ``slot`` of layer ``layer`` (``dynamic_update_slice``)
  and then attending with ``num_visible=slot + 1``: slots after ``slot`` must be invisible in every row. Returns
  (out [B, H * Dh], k_cache, v_cache), the caches updated in place where the caller donates them. On a GPU
  this removes XLA's two cache-writing kernels per layer (5.6 us at a 7B batch-1 step); with the merge kernel
  the step's kernel time fell 1.9% (aaa1393, experiments/RESULTS.md).
  """
  launch = _launch(block_s, num_warps, interpret)
  if k_new_BxKxD.shape != v_new_BxKxD.shape or k_new_BxKxD.shape != (k_cache.shape[1],) + k_cache.shape[3:]:
    raise ValueError(f"decode_attention_update: new k {k_new_BxKxD.shape} / v {v_new_BxKxD.shape} must be "
                     f"[B, Hkv, Dh] of the cache {k_cache.shape}")
  out, (k2, v2) = _attend(q_BxHxD, k_cache, v_cache, layer, mask_BxS, slot, (k_new_BxKxD, v_new_BxKxD),
                          splits=splits, **launch, interpret=interpret)
  return out, k2.reshape(k_cache.shape), v2.reshape(v_cache.shape)


def decode_attention_rows(rows: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, slot, mask_BxS: jax.Array,
                          *, heads: int, dtype, block_s: int | None = None, splits: int | None = None,
                          num_warps: int | None = None,
                          interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`decode_attention_update` from the kernel's input array as `qerl_kernels.decode_qkv.qkv_rows` writes it.

  rows: float32 [B, H + 2 Hkv + Gp, Dh]: the ``heads`` query heads in ``dtype`` (the activations'), this token's
  k and v heads in the cache's dtype, then zero rows (``padded_heads``). Returns (out [B, H * Dh] in ``dtype``,
  k_cache, v_cache) as `decode_attention_update` does.
  """
  launch = _launch(block_s, num_warps, interpret)
  b, n_rows, d = rows.shape
  kvh = k_cache.shape[3]
  if heads % kvh or n_rows != heads + 2 * kvh + padded_heads(heads, kvh):
    raise ValueError(f"decode_attention_rows: rows {rows.shape} must be [B, H + 2 Hkv + Gp, Dh] for H={heads} "
                     f"query heads and the cache's Hkv={kvh}")
  _check(jax.ShapeDtypeStruct((b, heads, d), dtype), k_cache, v_cache, mask_BxS, launch["block_s"])
  out, (k2, v2) = _attend_rows(rows, k_cache, v_cache, layer, mask_BxS, slot, True, heads=heads,
                               q_dtype=jnp.dtype(dtype), splits=splits, **launch, interpret=interpret)
  return out, k2.reshape(k_cache.shape), v2.reshape(v_cache.shape)
