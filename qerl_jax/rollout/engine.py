"""The jitted rollout: prefill of left-padded prompts, then a decode loop over a preallocated KV cache.

Everything between the prompt tokens and the finished completions runs on the device in one program: a
`lax.while_loop` with per-row stop handling and early exit once every row is finished, with no host round
trip per token. Shapes are static per (batch, prompt length, max_new_tokens) bucket, so a training run
compiles a handful of programs. The trainer calls `rollout`; notebooks use `generate.generate`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from qerl_jax.model import init_cache
from qerl_jax.model.param_views import (unstack_layers, with_adapter_dtype, with_dequantized_base,
                                           with_merged_launches, with_norm_noise)
from qerl_jax.model.transformer import forward
from qerl_jax.rollout.sampling import SamplingParams, sample

# Incremented each time the decode program is traced: the tests assert one trace per bucket.
TRACE_COUNT = {"rollout": 0}


@struct.dataclass
class RolloutBatch:
  """Completions of a batch of prompts (row b continues prompt row b).

  tokens_BxN: sampled ids; after the stop token, `pad_id`.
  logprobs_BxN: log-prob of each sampled token under the sampling distribution; 0 after the stop.
  mask_BxN: True on completion tokens, the stop token included.
  lengths_B: number of completion tokens (stop token included).
  finished_B: True where the row emitted a stop token ("stop"), False where it ran out ("length").
  """

  tokens_BxN: jax.Array
  logprobs_BxN: jax.Array
  mask_BxN: jax.Array
  lengths_B: jax.Array
  finished_B: jax.Array


def prompt_positions(valid_BxP: jax.Array) -> jax.Array:
  """RoPE positions of left-padded prompts: 0 at each row's first real token."""
  return jnp.maximum(jnp.cumsum(valid_BxP.astype(jnp.int32), axis=-1) - 1, 0)


def rollout_params(params, config, norm_noise=None):
  """The model's params as the decode loop takes them, made once per rollout before it: the AQN noise added to
  its norm scales (`with_norm_noise`), the adapters in `rollout_lora_dtype`, per-layer buffers
  (`decode_layers="unrolled"`), the base in `rollout_base_dtype`, and the merged launches of
  `merged_launch_groups` (ModelConfig)."""
  params = with_norm_noise(params, config, norm_noise)
  if config.rollout_lora_dtype:
    params = with_adapter_dtype(params, config.rollout_lora_dtype)
  if config.decode_layers == "unrolled":  # one copy per rollout, not a slice (copy) of each stack per token
    params = unstack_layers(params)
  if config.rollout_base_dtype:  # layer by layer
    params = with_dequantized_base(params, config.rollout_base_dtype)
  if config.merged_launch_groups:
    params = with_merged_launches(params, config.merged_launch_groups)
  return params


@functools.partial(
  jax.jit, static_argnames=("graphdef", "sampling", "max_new_tokens", "stop_ids", "pad_id"))
def rollout(graphdef, state, prompt_BxP, valid_BxP, key, norm_noise=None, *, sampling: SamplingParams,
            max_new_tokens: int, stop_ids: tuple[int, ...], pad_id: int = 0) -> RolloutBatch:
  """Samples `max_new_tokens` (or until a stop id) after each left-padded prompt row (one jitted program).

  graphdef, state: `nnx.split(model)`. prompt_BxP: int32 ids, padding on the left; valid_BxP: bool, False
  on padding. key: this rollout's PRNG key (the token at step i uses fold_in(key, i)). norm_noise: the AQN
  additions to the RMSNorm scales for this rollout, or None.
  """
  TRACE_COUNT["rollout"] += 1
  model = nnx.merge(graphdef, state)
  config = model.config
  batch, prompt_len = prompt_BxP.shape
  cache_len = prompt_len + max_new_tokens
  params = rollout_params(model.params(), config, norm_noise)  # the noise is in the norm scales from here on
  per_layer = config.decode_layers == "unrolled"
  fwd = functools.partial(forward, params, config, model.lora_scale)
  cache = init_cache(config, batch, cache_len, config.dtype, per_layer=per_layer)
  valid_BxS = jnp.concatenate([valid_BxP, jnp.ones((batch, max_new_tokens), bool)], axis=1)
  real_len_B = valid_BxP.sum(axis=-1).astype(jnp.int32)
  stop_V = jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32)

  # Prefill: hidden states only, lm_head on the last position alone (not [B, P, V]).
  h_BxPxD, cache = fwd(prompt_BxP, prompt_positions(valid_BxP), cache=cache, cache_index=0, valid_BxS=valid_BxS,
                       return_hidden=True)
  logits_BxV = model.lm_head_logits(h_BxPxD[:, -1])
  token_B, logp_B = sample(logits_BxV, jax.random.fold_in(key, 0), sampling)
  tokens_BxN = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(token_B)
  logp_BxN = jnp.zeros((batch, max_new_tokens), jnp.float32).at[:, 0].set(logp_B)
  done_B = jnp.isin(token_B, stop_V)
  lengths_B = jnp.ones((batch,), jnp.int32)

  def cond(carry):
    i, _, _, done_B, *_ = carry
    return (i < max_new_tokens) & ~jnp.all(done_B)

  def body(carry):
    i, token_B, cache, done_B, lengths_B, tokens_BxN, logp_BxN = carry
    # Token i-1 sits at cache slot P+i-1 and RoPE position real_len+i-1.
    positions_Bx1 = (real_len_B + i - 1)[:, None]
    logits_Bx1xV, cache = fwd(token_B[:, None], positions_Bx1, cache=cache, cache_index=prompt_len + i - 1,
                              valid_BxS=valid_BxS)
    new_B, new_logp_B = sample(logits_Bx1xV[:, 0], jax.random.fold_in(key, i), sampling)
    new_B = jnp.where(done_B, pad_id, new_B)
    new_logp_B = jnp.where(done_B, 0.0, new_logp_B)
    tokens_BxN = jax.lax.dynamic_update_slice(tokens_BxN, new_B[:, None], (0, i))
    logp_BxN = jax.lax.dynamic_update_slice(logp_BxN, new_logp_B[:, None], (0, i))
    lengths_B = lengths_B + (~done_B).astype(jnp.int32)
    done_B = done_B | jnp.isin(new_B, stop_V)
    return i + 1, new_B, cache, done_B, lengths_B, tokens_BxN, logp_BxN

  carry = (jnp.int32(1), token_B, cache, done_B, lengths_B, tokens_BxN, logp_BxN)
  _, _, _, done_B, lengths_B, tokens_BxN, logp_BxN = jax.lax.while_loop(cond, body, carry)
  mask_BxN = jnp.arange(max_new_tokens)[None, :] < lengths_B[:, None]
  return RolloutBatch(tokens_BxN, logp_BxN, mask_BxN, lengths_B, done_B)
