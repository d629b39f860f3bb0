"""The policy as the update sees it: completion log-probs of a merged model, and the reference parameters.

The update rebuilds the model from (graphdef, trainable params, frozen base) inside jit, runs it over
prompt + completion without AQN noise (the update maximises the noise-free policy's objective), and reads
the log-probs of the completion tokens in chunks (`token_logprobs`), never forming [B, T, V] logits.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from qerl_jax.sharding import path_str
from qerl_jax.train.logprobs import token_logprobs

# Trainable leaves that are LoRA "B" matrices (zero at init, PEFT-style): zeroing them turns adapters off.
LORA_B_PATTERN = r"(^|/)lora_b$"


def merge(graphdef, params: dict, frozen) -> nnx.Module:
  """The model from its graphdef, a pure dict of trainable params and the frozen state."""
  return nnx.merge(graphdef, nnx.State(params), frozen)


def sequence_positions(valid_BxS: jax.Array) -> jax.Array:
  """RoPE positions of left-padded rows: 0 at each row's first valid token (as the rollout uses)."""
  return jnp.maximum(jnp.cumsum(valid_BxS.astype(jnp.int32), axis=-1) - 1, 0)


def completion_logprobs(model, prompt_BxP: jax.Array, prompt_valid_BxP: jax.Array, completion_BxN: jax.Array,
                        *, chunk: int, vocab_chunk: int, temperature: float):
  """(logp_BxN, entropy_BxN) of each completion token given the left-padded prompt and the tokens before it.

  The model runs over the concatenation [prompt | completion]; position P-1+i predicts completion token i.
  Completion tokens after a stop token are padding: they come after every token that counts, so under
  causal attention they change nothing that is read.
  """
  batch, prompt_len = prompt_BxP.shape
  new = completion_BxN.shape[1]
  tokens_BxS = jnp.concatenate([prompt_BxP, completion_BxN.astype(prompt_BxP.dtype)], axis=1)
  valid_BxS = jnp.concatenate([prompt_valid_BxP, jnp.ones((batch, new), bool)], axis=1)
  h_BxSxD = model(tokens_BxS, sequence_positions(valid_BxS), valid_BxS=valid_BxS, return_hidden=True)
  h_BxNxD = jax.lax.dynamic_slice_in_dim(h_BxSxD, prompt_len - 1, new, axis=1)
  return token_logprobs(h_BxNxD, model.lm_head_weight(), completion_BxN, chunk=chunk,
                        vocab_chunk=vocab_chunk, temperature=temperature)


def reference_params(initial_params: dict, lora_b_pattern: str = LORA_B_PATTERN) -> dict:
  """The initial trainable params with every LoRA B zeroed: merged with the frozen base this is the base
  policy (adapters off, original norm scales), the KL reference, with no second copy of the base."""
  regex = re.compile(lora_b_pattern)

  def zero_b(path, x):
    # A fresh copy of every other leaf: the update donates the live params' buffers.
    return jnp.zeros_like(x) if regex.search(path_str(path).lower()) else jnp.array(x, copy=True)

  return jax.tree_util.tree_map_with_path(zero_b, initial_params)


def count_lora_b(params: Any, lora_b_pattern: str = LORA_B_PATTERN) -> int:
  """Number of leaves `reference_params` zeroes (a sanity check that the pattern fits the model)."""
  regex = re.compile(lora_b_pattern)
  paths = [path_str(p).lower() for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  return sum(bool(regex.search(p)) for p in paths)
