"""Decode attention (one new token per row) over a stacked KV cache, read in place, up to the causal limit.

With the model's stacked cache (k, v [L, B, S, Hkv, Dh], `decode_layers="scan"`), XLA copies layer l's
dynamic slice before its attention dots (measured on an H200: ~3 ms per 7B decode step at 64 rows and 1280
slots, experiments/RESULTS.md); this kernel reads layer l of the stack where it lies. The unrolled decode
loop keeps one cache per layer and passes it as a stack of one. Either way a decode step only reads the
blocks before the token's own slot + 1 (``num_visible``), not the whole response budget. Flash-decoding: the
grid is (row x kv head, split of the slots); each program keeps an online softmax for the G = H / Hkv query
heads that share its kv head (padded to the 16 rows a tensor-core dot needs), and XLA merges the splits'
normalized outputs by their log-sum-exps.

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

_MASKED = -0.7 * float(np.finfo(np.float32).max)
_MIN_DOT_ROWS = 16  # Triton's tensor-core dots need at least 16 rows


def decode_attention_kernel(q_ref, layer_ref, visible_ref, mask_ref, k_ref, v_ref, o_ref, lse_ref, *, batch: int,
                            seq: int, cache_len: int, kv_heads: int, head_dim: int, block_s: int,
                            blocks_per_split: int):
  """One (row, kv head) over one split of the slots, up to the last visible one.

  q_ref [B, Hkv, Gp, Dh]; layer_ref int32 [1]; visible_ref int32 [1] (slots from it on are invisible to every
  row: their blocks are not read); mask_ref int32 [B, S] (nonzero: visible); k_ref, v_ref
  [L * B * cache_len, Hkv * Dh] (the stacked cache, rows (l * B + b) * cache_len + s); o_ref float32
  [splits, B, Hkv, Gp, Dh] (this split's softmax-normalized output); lse_ref float32 [splits, B, Hkv, Gp].
  """
  bh = pl.program_id(0)
  split = pl.program_id(1)
  b = bh // kv_heads
  h = bh % kv_heads
  layer = layer_ref[0]
  gp = q_ref.shape[2]
  q_GxD = plgpu.load(q_ref.at[b, h, pl.ds(0, gp), pl.ds(0, head_dim)])
  cache_row0 = (layer * batch + b) * cache_len
  cols = pl.ds(h * head_dim, head_dim)
  scale = head_dim ** -0.5

  def body(i, carry):
    m_G, l_G, acc_GxD = carry
    s0 = (split * blocks_per_split + i) * block_s
    slots = s0 + jnp.arange(block_s)
    in_range = slots < seq
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
  # Blocks of this split that start before the first invisible slot (a rollout at step i reads P + i slots,
  # not the whole response budget).
  first = split * blocks_per_split * block_s
  blocks = jnp.clip((visible_ref[0] - first + block_s - 1) // block_s, 0, blocks_per_split)
  m_G, l_G, acc_GxD = jax.lax.fori_loop(0, blocks, body, init)
  # A split that read a block has l_G >= 1 (its maximum contributes exp(0)); one that read none contributes
  # nothing to the merge: output 0 with a log-sum-exp far below any real one.
  read = l_G > 0
  plgpu.store(o_ref.at[split, b, h, pl.ds(0, gp), pl.ds(0, head_dim)],
              acc_GxD / jnp.where(read, l_G, 1.0)[:, None])
  plgpu.store(lse_ref.at[split, b, h, pl.ds(0, gp)], jnp.where(read, m_G + jnp.log(jnp.where(read, l_G, 1.0)),
                                                               _MASKED))


def decode_attention(q_BxHxD: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, mask_BxS: jax.Array, *,
                     num_visible=None, block_s: int = 64, splits: int | None = None, num_warps: int = 4,
                     interpret: bool = False) -> jax.Array:
  """Attention of one query per row over layer ``layer`` of a stacked cache; returns [B, H * Dh] in q's dtype.

  q_BxHxD: the new token's query heads. k_cache, v_cache: [L, B, C, Hkv, Dh] (C >= S). layer: int32 scalar
  (may be traced). mask_BxS: bool, slot s of row b is visible (S <= C: later slots are never read).
  num_visible: int32 scalar (may be traced) or None (= S): slots from it on must be invisible in every row
  (the caller's promise, e.g. a decode step's causal limit); their blocks are skipped. splits: slot splits per
  (row, kv head) (None: enough programs for every SM, at most one per block).
  """
  b, h, d = q_BxHxD.shape
  num_layers, cb, cache_len, kvh, cd = k_cache.shape
  seq = mask_BxS.shape[-1]
  if (cb, cd) != (b, d) or h % kvh or v_cache.shape != k_cache.shape or seq > cache_len:
    raise ValueError(f"decode_attention: q {q_BxHxD.shape}, caches {k_cache.shape} / {v_cache.shape}, mask "
                     f"{mask_BxS.shape} do not fit together ([B, H, Dh], [L, B, C, Hkv, Dh], [B, S <= C])")
  if block_s < 16 or block_s & (block_s - 1) or d & (d - 1):
    raise ValueError(f"{block_s=} and head_dim={d} must be powers of two (block_s >= 16)")
  g = h // kvh
  gp = max(_MIN_DOT_ROWS, 1 << (g - 1).bit_length())
  num_blocks = pl.cdiv(seq, block_s)
  if splits is None:
    splits = max(1, min(num_blocks, -(-2 * 132 // (b * kvh))))
  splits = min(splits, num_blocks)
  blocks_per_split = pl.cdiv(num_blocks, splits)
  splits = pl.cdiv(num_blocks, blocks_per_split)  # no split without an in-range slot
  q = q_BxHxD.reshape(b, kvh, g, d)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
  layer_1 = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  visible_1 = jnp.reshape(jnp.asarray(seq if num_visible is None else num_visible, jnp.int32), (1,))
  k2 = k_cache.reshape(num_layers * b * cache_len, kvh * d)
  v2 = v_cache.reshape(num_layers * b * cache_len, kvh * d)
  kernel = functools.partial(decode_attention_kernel, batch=b, seq=seq, cache_len=cache_len, kv_heads=kvh,
                             head_dim=d, block_s=block_s, blocks_per_split=blocks_per_split)
  o_part, lse = pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((splits, b, kvh, gp, d), jnp.float32),
                 jax.ShapeDtypeStruct((splits, b, kvh, gp), jnp.float32)),
      grid=(b * kvh, splits),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
      interpret=interpret,
      name="decode_attention",
  )(q, layer_1, visible_1, mask_BxS.astype(jnp.int32), k2, v2)
  if splits == 1:  # nothing to merge (e.g. 128 rollout rows of 7B: b * kvh programs fill the GPU), no XLA kernels
    out = o_part[0, :, :, :g]
  else:
    weights = jax.nn.softmax(lse, axis=0)[..., None]  # merge the splits by their log-sum-exps
    out = jnp.sum(weights * o_part, axis=0)[:, :, :g]
  return out.reshape(b, h * d).astype(q_BxHxD.dtype)
