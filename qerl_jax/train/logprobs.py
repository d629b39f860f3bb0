"""Per-token log-probs and entropies of completions, chunked so [B, T, V] float32 logits never exist.

At Qwen's vocabulary (152k) a 64 x 4096 completion batch would need 160 GB of float32 logits. Here the
sequence is cut into chunks of `chunk` positions and the vocabulary into slices of `vocab_chunk` columns; a
running (max, sum of exp, sum of exp * logit) triple gives the log-normaliser and the entropy in one pass.
Both loops are `jax.checkpoint`ed, so the backward pass recomputes one [B, chunk, vocab_chunk] slice at a
time instead of storing them all.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Stand-in for -inf on masked vocabulary columns: exp() of it underflows to exactly 0, and unlike -inf it
# never produces inf - inf = nan in the running-max updates or their gradients.
_NEG = -1e30


def _chunk_stats(h_BxCxD, targets_BxC, lm_head_VxD, vocab_chunk: int, temperature: float):
  """(logp_BxC, entropy_BxC) of one sequence chunk, scanning the vocabulary in slices."""
  vocab = lm_head_VxD.shape[0]
  num_slices = -(-vocab // vocab_chunk)
  batch, length = targets_BxC.shape
  col_Vc = jnp.arange(vocab_chunk, dtype=jnp.int32)

  @jax.checkpoint
  def vocab_step(carry, i):
    max_BxC, sumexp_BxC, sumexp_logit_BxC, target_BxC = carry
    # The last slice is shifted left to stay inside the matrix (no padded copy of lm_head); columns it
    # shares with the previous slice are masked out so each column is counted once.
    nominal = i * vocab_chunk
    start = jnp.minimum(nominal, vocab - vocab_chunk)
    w_VcxD = jax.lax.dynamic_slice_in_dim(lm_head_VxD, start, vocab_chunk, axis=0)
    logits_BxCxVc = jnp.einsum("bcd,vd->bcv", h_BxCxD, w_VcxD.astype(h_BxCxD.dtype),
                               preferred_element_type=jnp.float32)
    logits_BxCxVc = logits_BxCxVc.astype(jnp.float32) / temperature
    index_Vc = start + col_Vc
    keep_Vc = index_Vc >= nominal
    logits_BxCxVc = jnp.where(keep_Vc, logits_BxCxVc, _NEG)
    new_max_BxC = jnp.maximum(max_BxC, logits_BxCxVc.max(axis=-1))
    rescale_BxC = jnp.exp(max_BxC - new_max_BxC)
    exp_BxCxVc = jnp.exp(logits_BxCxVc - new_max_BxC[..., None])
    sumexp_BxC = sumexp_BxC * rescale_BxC + exp_BxCxVc.sum(axis=-1)
    masked_logits = jnp.where(keep_Vc, logits_BxCxVc, 0.0)
    sumexp_logit_BxC = sumexp_logit_BxC * rescale_BxC + (exp_BxCxVc * masked_logits).sum(axis=-1)
    hit_BxCxVc = (index_Vc == targets_BxC[..., None]) & keep_Vc
    target_BxC = target_BxC + jnp.where(hit_BxCxVc, logits_BxCxVc, 0.0).sum(axis=-1)
    return (new_max_BxC, sumexp_BxC, sumexp_logit_BxC, target_BxC), None

  zeros = jnp.zeros((batch, length), jnp.float32)
  init = (jnp.full((batch, length), _NEG, jnp.float32), zeros, zeros, zeros)
  (max_BxC, sumexp_BxC, sumexp_logit_BxC, target_BxC), _ = jax.lax.scan(
    vocab_step, init, jnp.arange(num_slices, dtype=jnp.int32))
  lse_BxC = max_BxC + jnp.log(sumexp_BxC)
  logp_BxC = target_BxC - lse_BxC
  entropy_BxC = lse_BxC - sumexp_logit_BxC / sumexp_BxC
  return logp_BxC, entropy_BxC


def token_logprobs(h_BxTxD: jax.Array, lm_head_VxD: jax.Array, targets_BxT: jax.Array, *, chunk: int = 256,
                   vocab_chunk: int = 16384, temperature: float = 1.0):
  """log softmax(h @ lm_head / temperature)[target] and the entropy of that softmax, per position.

  h_BxTxD: final-normed hidden states (any float dtype; the matmul accumulates in float32).
  lm_head_VxD: the output matrix, [vocab, hidden] (HF layout; the embedding when tied).
  targets_BxT: int token ids whose log-probs are wanted.
  chunk, vocab_chunk: positions and vocabulary columns handled per step; peak extra memory is about
    B * chunk * vocab_chunk float32 in the forward and in the backward pass.
  Returns (logp_BxT, entropy_BxT), both float32. Differentiable in h (and lm_head).
  """
  if h_BxTxD.ndim != 3 or targets_BxT.shape != h_BxTxD.shape[:2]:
    raise ValueError(f"expected h [B, T, D] and targets [B, T], got {h_BxTxD.shape=} {targets_BxT.shape=}")
  if lm_head_VxD.ndim != 2 or lm_head_VxD.shape[1] != h_BxTxD.shape[-1]:
    raise ValueError(f"{lm_head_VxD.shape=} must be [vocab, hidden={h_BxTxD.shape[-1]}]")
  if chunk <= 0 or vocab_chunk <= 0:
    raise ValueError(f"{chunk=} and {vocab_chunk=} must be > 0")
  if not temperature > 0:
    raise ValueError(f"{temperature=} must be > 0 for log-probs")
  batch, length, hidden = h_BxTxD.shape
  vocab_chunk = min(vocab_chunk, lm_head_VxD.shape[0])
  chunk = min(chunk, length)
  num_chunks = -(-length // chunk)
  pad = num_chunks * chunk - length
  if pad:
    h_BxTxD = jnp.pad(h_BxTxD, ((0, 0), (0, pad), (0, 0)))
    targets_BxT = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
  h_NxBxCxD = h_BxTxD.reshape(batch, num_chunks, chunk, hidden).swapaxes(0, 1)
  targets_NxBxC = targets_BxT.astype(jnp.int32).reshape(batch, num_chunks, chunk).swapaxes(0, 1)

  stats = jax.checkpoint(functools.partial(
    _chunk_stats, lm_head_VxD=lm_head_VxD, vocab_chunk=vocab_chunk, temperature=temperature))

  def seq_step(_, xs):
    return None, stats(*xs)

  _, (logp_NxBxC, entropy_NxBxC) = jax.lax.scan(seq_step, None, (h_NxBxCxD, targets_NxBxC))
  logp_BxT = logp_NxBxC.swapaxes(0, 1).reshape(batch, -1)[:, :length]
  entropy_BxT = entropy_NxBxC.swapaxes(0, 1).reshape(batch, -1)[:, :length]
  return logp_BxT, entropy_BxT


def token_logprobs_reference(h_BxTxD, lm_head_VxD, targets_BxT, *, temperature: float = 1.0):
  """The naive formula (full [B, T, V] float32 logits), for tests and tiny models."""
  logits_BxTxV = jnp.einsum("btd,vd->btv", h_BxTxD, lm_head_VxD,
                            preferred_element_type=jnp.float32).astype(jnp.float32) / temperature
  logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
  logp_BxT = jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None].astype(jnp.int32), axis=-1)[..., 0]
  entropy_BxT = -(jnp.exp(logp_BxTxV) * logp_BxTxV).sum(axis=-1)
  return logp_BxT, entropy_BxT
