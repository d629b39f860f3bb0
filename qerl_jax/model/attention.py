"""RMSNorm, rotary embeddings and grouped-query attention with an optional KV cache.

Numerics follow transformers' Llama/Qwen code where it matters for parity: RMSNorm and RoPE angles in
float32, softmax in float32. A masked-out score is a large negative finite number rather than -inf, so a
query row with nothing to attend to (left padding) gives finite garbage instead of NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax.model.config import ModelConfig, rope_inv_freq

_MASKED = -0.7 * float(np.finfo(np.float32).max)


def rms_norm(x_BxTxD: jax.Array, scale_D: jax.Array, eps: float, noise_D: jax.Array | None = None) -> jax.Array:
  """HF RMSNorm in float32: (scale + noise) * x / sqrt(mean(x^2) + eps), cast back to x's dtype.

  noise_D: the AQN addition to the scale (float32), or None. The sum is formed in float32 because a bf16
  add of noise below ~4e-3 to scales near 1 rounds away.
  """
  x = x_BxTxD.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  scale = scale_D.astype(jnp.float32)
  if noise_D is not None:
    scale = scale + noise_D.astype(jnp.float32)
  return (x * scale).astype(x_BxTxD.dtype)


def rope_cos_sin(config: ModelConfig, positions_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
  """float32 cos and sin [B, T, Dh/2] of the per-row positions (HF's attention_scaling folded in)."""
  inv_freq, attention_scale = rope_inv_freq(config)
  angles = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  return jnp.cos(angles) * attention_scale, jnp.sin(angles) * attention_scale


def apply_rope(x_BxTxNxDh: jax.Array, cos_BxTxR: jax.Array, sin_BxTxR: jax.Array) -> jax.Array:
  """Rotates the two halves of each head (HF's rotate_half layout, not interleaved pairs)."""
  x = x_BxTxNxDh.astype(jnp.float32)
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  cos, sin = cos_BxTxR[:, :, None, :], sin_BxTxR[:, :, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxDh.dtype)


def attention_mask(query_slots_BxT: jax.Array, num_slots: int, valid_BxS: jax.Array | None) -> jax.Array:
  """bool [B, T, S]: query t may see slot s iff s <= its own slot and valid_BxS[b, s]."""
  slots_S = jnp.arange(num_slots, dtype=jnp.int32)
  mask = slots_S[None, None, :] <= query_slots_BxT[:, :, None]
  if valid_BxS is not None:
    if valid_BxS.shape[-1] != num_slots:
      raise ValueError(f"valid_BxS has {valid_BxS.shape[-1]} slots, expected {num_slots}")
    mask = mask & valid_BxS.astype(bool)[:, None, :]
  return mask


def attend(q_BxTxHxDh: jax.Array, k_BxSxKxDh: jax.Array, v_BxSxKxDh: jax.Array, mask_BxTxS: jax.Array,
           query_chunk: int = 0, implementation: str = "xla", causal: bool = False) -> jax.Array:
  """Grouped-query attention; returns [B, T, H * Dh] in q's dtype.

  implementation "cudnn": `jax.nn.dot_product_attention`'s fused cuDNN kernel (GPU only; ModelConfig.train_attention),
  the mask passed as its additive bias; query_chunk does not apply (no scores are held in memory). causal: the
  caller's promise that query t (T == S) sees no slot past t, which lets the fused kernel skip those blocks.

  The H query heads are split into Hkv groups of H / Hkv that share one k/v head (q head h uses kv head
  h // (H / Hkv), as transformers' repeat_kv does), without materialising repeated k/v.
  query_chunk > 0 and T above it: the queries go through in near-equal blocks of at most that many, each
  rematerialised in the backward pass, so the float32 scores held at once are [B, H, chunk, S], not
  [B, H, T, S] (at T = S = 8704, 40 heads: 1.4 GB per row at chunk 1024 instead of 12 GB). Every query row
  has its own softmax, so the result is the same as in one block.
  """
  if implementation == "cudnn":
    if jax.default_backend() != "gpu":
      raise ValueError(f"train_attention='cudnn' needs a GPU with cuDNN; the backend is {jax.default_backend()!r}: "
                       "use 'auto' or 'xla'")
    return fused_attend(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxTxS, "cudnn", causal)
  if implementation != "xla":  # "auto" is resolved by the caller (ModelConfig.train_attention_impl)
    raise ValueError(f"{implementation=} must be 'xla' or 'cudnn'")
  t = q_BxTxHxDh.shape[1]
  if query_chunk <= 0 or t <= query_chunk:
    return _attend_block(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxTxS)
  num = -(-t // query_chunk)
  chunk = -(-t // num)  # near-equal blocks: at most num - 1 padded query rows
  pad = num * chunk - t
  q = jnp.pad(q_BxTxHxDh, ((0, 0), (0, pad), (0, 0), (0, 0)))
  mask = jnp.pad(mask_BxTxS, ((0, 0), (0, pad), (0, 0)))  # padded rows see nothing; they are cut off below
  b, _, h, dh = q.shape
  q_NxBxCxHxDh = q.reshape(b, num, chunk, h, dh).swapaxes(0, 1)
  mask_NxBxCxS = mask.reshape(b, num, chunk, mask.shape[-1]).swapaxes(0, 1)
  block = jax.checkpoint(lambda qm: _attend_block(qm[0], k_BxSxKxDh, v_BxSxKxDh, qm[1]))
  out_NxBxCxE = jax.lax.map(block, (q_NxBxCxHxDh, mask_NxBxCxS))
  return out_NxBxCxE.swapaxes(0, 1).reshape(b, num * chunk, h * dh)[:, :t]


def fused_attend(q_BxTxHxDh: jax.Array, k_BxSxKxDh: jax.Array, v_BxSxKxDh: jax.Array, mask_BxTxS: jax.Array,
                 implementation: str, causal: bool = False) -> jax.Array:
  """`attend` through `jax.nn.dot_product_attention` ("cudnn": the fused kernel; "xla": the same function's
  XLA lowering, which the CPU tests use to check this wrapper). [B, T, H * Dh] in q's dtype. causal (T == S
  and the mask sees no later slot): the causal mask type as well, so cuDNN skips the blocks past the diagonal."""
  b, t, h, dh = q_BxTxHxDh.shape
  s = k_BxSxKxDh.shape[1]
  q, k, v, mask = q_BxTxHxDh, k_BxSxKxDh.astype(q_BxTxHxDh.dtype), v_BxSxKxDh.astype(q_BxTxHxDh.dtype), mask_BxTxS
  # cuDNN's backward with a bias takes even lengths only: an odd T or S gets one more query row (cut off below)
  # or one more slot that no query sees. Both go at the end, so the causal type still holds.
  pad_t, pad_s = t % 2, s % 2
  if pad_t or pad_s:
    q = jnp.pad(q, ((0, 0), (0, pad_t), (0, 0), (0, 0)))
    k, v = (jnp.pad(x, ((0, 0), (0, pad_s), (0, 0), (0, 0))) for x in (k, v))
    mask = jnp.pad(mask, ((0, 0), (0, pad_t), (0, pad_s)))
  # A boolean mask becomes an additive bias of a large negative number: rows that see nothing (left padding)
  # stay finite, as in attend.
  out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], is_causal=causal, implementation=implementation)
  return out[:, :t].reshape(b, t, h * dh)


def _attend_block(q_BxTxHxDh: jax.Array, k_BxSxKxDh: jax.Array, v_BxSxKxDh: jax.Array,
                  mask_BxTxS: jax.Array) -> jax.Array:
  b, t, h, dh = q_BxTxHxDh.shape
  kvh = k_BxSxKxDh.shape[2]
  q = q_BxTxHxDh.reshape(b, t, kvh, h // kvh, dh)
  k = k_BxSxKxDh.astype(q.dtype)
  v = v_BxSxKxDh.astype(q.dtype)
  scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * (dh ** -0.5)
  scores = jnp.where(mask_BxTxS[:, None, None, :, :], scores, _MASKED)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
  return out.reshape(b, t, h * dh).astype(q_BxTxHxDh.dtype)
