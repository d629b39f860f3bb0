"""Token sampling from logits: greedy, temperature, top-k and top-p, with the log-prob of the token drawn.

The log-prob returned is under the distribution actually sampled from: logits / temperature, restricted to
the top-k and the top-p nucleus, renormalized. With top_p = 1 and top_k = 0 that is
log_softmax(logits / temperature), which is what a teacher-forced forward at the same temperature gives, so
rollout log-probs can serve as GRPO's old log-probs. Greedy (temperature 0) reports log_softmax(logits).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Static sampling settings (one compiled decode loop per distinct value)."""

  temperature: float = 1.0  # 0 means greedy
  top_p: float = 1.0  # nucleus mass in (0, 1]
  top_k: int = 0  # 0 disables

  def __post_init__(self):
    if not self.temperature >= 0:
      raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables it)")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def sampling_logits(logits_BxV: jax.Array, params: SamplingParams) -> jax.Array:
  """float32 logits of the distribution that is sampled from; excluded tokens get -inf."""
  logits_BxV = logits_BxV.astype(jnp.float32)
  if params.greedy:
    return logits_BxV
  logits_BxV = logits_BxV / params.temperature
  neg_inf = jnp.finfo(jnp.float32).min
  if params.top_k > 0 and params.top_k < logits_BxV.shape[-1]:
    kth_B1 = jax.lax.top_k(logits_BxV, params.top_k)[0][:, -1:]
    logits_BxV = jnp.where(logits_BxV < kth_B1, neg_inf, logits_BxV)
  if params.top_p < 1.0:
    # Keep the smallest set of most likely tokens whose mass reaches top_p (the token that crosses the
    # threshold is kept, as in HF and vLLM). Ties at the cut-off logit are all kept.
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    keep_BxV = mass_before_BxV < params.top_p
    cutoff_B1 = jnp.min(jnp.where(keep_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
    logits_BxV = jnp.where(logits_BxV < cutoff_B1, neg_inf, logits_BxV)
  return logits_BxV


def sample(logits_BxV: jax.Array, key: jax.Array, params: SamplingParams):
  """Draws one token per row. Returns (token_B int32, logprob_B float32)."""
  logits_BxV = sampling_logits(logits_BxV, params)
  logp_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
  if params.greedy:
    token_B = jnp.argmax(logits_BxV, axis=-1)
  else:
    token_B = jax.random.categorical(key, logits_BxV, axis=-1)
  token_B = token_B.astype(jnp.int32)
  logp_B = jnp.take_along_axis(logp_BxV, token_B[:, None], axis=-1)[:, 0]
  return token_B, logp_B
