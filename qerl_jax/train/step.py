"""The jitted policy update: micro-batched gradients of the clipped GRPO/DAPO loss, one AdamW step.

`update_step(state, frozen, batch, first_iteration)` is a pure function of its inputs, jitted once (per
batch shape) with the state donated. Inside, a `lax.scan` over micro-batches accumulates float32 gradients,
so activation memory is that of one micro-batch whatever the batch size. Each micro-batch loss uses the
FULL batch's normalizers (`qerl_jax.rl.loss_normalizers`), so the accumulated gradient is the full-batch
gradient. A non-finite loss or gradient norm skips the update (params and optimizer state are kept) and
is counted in `state.nonfinite`; the loop stops after several in a row.

Old log-probs: on the first iteration over a rollout batch the parameters still are the rollout-time
parameters, so the old policy is the current one (ratio 1, stop-gradient), as in TRL. That iteration's
log-probs are returned and serve as `old_logp_BxN` for the following iterations (num_iterations > 1)
without an extra forward pass.

Sampler importance sampling (`tis_cap > 0`): rollouts come from the AQN-noisy policy while the update
optimises the noise-free one; each token's loss is weighted by min(pi_noise_free / pi_rollout, cap),
detached, folded into the mask (so aggregation "grpo", whose per-row normaliser is the mask sum, is
refused with it at config validation).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from qerl_jax.rl import loss_normalizers, policy_loss
from qerl_jax.train.optim import OptimizerSettings, make_optimizer
from qerl_jax.train.policy import completion_logprobs, merge
from qerl_jax.train.state import TrainState

# Incremented each time a jitted function is traced: tests assert one trace per batch shape.
TRACE_COUNT = {"update": 0, "logprobs": 0}


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
  """Static settings of the update (hashable: part of the jit cache key)."""

  micro_batch_size: int
  loss_type: str = "dapo"
  eps_low: float = 0.2
  eps_high: float = 0.28
  kl_beta: float = 0.0
  importance_sampling_level: str = "token"
  mask_truncated: bool = False
  tis_cap: float = 0.0
  temperature: float = 1.0
  max_len: int = 0  # dr_grpo's constant length: the response budget
  logprob_chunk: int = 256
  vocab_chunk: int = 16384
  # A NamedSharding for the micro-batched leaves [M, b, ...] (qerl_jax.sharding.micro_batch_sharding) on a
  # multi-device mesh; None on one device, where no constraint is emitted.
  micro_sharding: Any = None

  @classmethod
  def from_config(cls, config) -> "UpdateSettings":
    t = config.train
    return cls(micro_batch_size=t.micro_batch_size, loss_type=t.loss_type, eps_low=t.eps_low,
               eps_high=t.eps_high, kl_beta=t.kl_beta, importance_sampling_level=t.importance_sampling_level,
               mask_truncated=t.mask_truncated, tis_cap=t.tis_cap, temperature=config.rollout.temperature,
               max_len=config.rollout.max_new_tokens, logprob_chunk=t.logprob_chunk,
               vocab_chunk=t.vocab_chunk)


def _micro(batch: dict, size: int) -> dict:
  rows = batch["completion_BxN"].shape[0]
  if rows % size:
    raise ValueError(f"batch of {rows} completions is not divisible by micro_batch_size={size}")
  return jax.tree.map(lambda x: x.reshape(rows // size, size, *x.shape[1:]), batch)


def _logprobs(model, mb: dict, s: UpdateSettings):
  return completion_logprobs(model, mb["prompt_BxP"], mb["prompt_valid_BxP"], mb["completion_BxN"],
                             chunk=s.logprob_chunk, vocab_chunk=s.vocab_chunk, temperature=s.temperature)


def _weighted(metrics_M: dict, weights_M: jax.Array) -> dict:
  """Micro-batch metrics combined as full-batch values (means weighted by loss tokens)."""
  total = jnp.maximum(weights_M.sum(), 1.0)
  out = {}
  for name, values in metrics_M.items():
    if name == "ratio_min":
      out[name] = values.min()
    elif name == "ratio_max":
      out[name] = values.max()
    elif name == "num_tokens":
      out[name] = values.sum()
    else:
      out[name] = (values * weights_M).sum() / total
  return out


def update_step(state: TrainState, frozen: Any, batch: dict, first_iteration: jax.Array, *, graphdef,
                optimizer: optax.GradientTransformation, schedule, settings: UpdateSettings):
  """One optimizer step on a rollout batch. Returns (state, metrics, logp_BxN).

  batch (completion rows; groups contiguous): prompt_BxP int32, prompt_valid_BxP bool, completion_BxN
  int32, mask_BxN bool, truncated_B bool, advantages_B f32, old_logp_BxN f32 (ignored on the first
  iteration), rollout_logp_BxN f32, and ref_logp_BxN f32 when kl_beta > 0.
  """
  TRACE_COUNT["update"] += 1
  s = settings
  rows = batch["completion_BxN"].shape[0]
  norms = loss_normalizers(batch["mask_BxN"], batch["truncated_B"], s.mask_truncated)
  micro = _micro(batch, s.micro_batch_size)
  if s.micro_sharding is not None:
    micro = jax.lax.with_sharding_constraint(micro, s.micro_sharding)

  def loss_fn(params, mb):
    model = merge(graphdef, params, frozen)
    logp_BxN, entropy_BxN = _logprobs(model, mb, s)
    old_BxN = jnp.where(first_iteration, jax.lax.stop_gradient(logp_BxN), mb["old_logp_BxN"])
    mask_BxN = mb["mask_BxN"].astype(jnp.float32)
    # Log-ratio of the noise-free policy to the noisy rollout policy, on the sampled tokens.
    rollout_gap_BxN = jax.lax.stop_gradient(old_BxN) - mb["rollout_logp_BxN"]
    if s.tis_cap > 0:
      mask_BxN = mask_BxN * jnp.minimum(jnp.exp(rollout_gap_BxN), s.tis_cap)
    loss, metrics = policy_loss(
      logp_BxN, old_BxN, mb["advantages_B"], mask_BxN, loss_type=s.loss_type, eps_low=s.eps_low,
      eps_high=s.eps_high, beta=s.kl_beta, ref_logp_BxT=mb.get("ref_logp_BxN"), max_len=s.max_len,
      num_tokens=norms["num_tokens"], num_sequences=rows,
      importance_sampling_level=s.importance_sampling_level, truncated_B=mb["truncated_B"],
      mask_truncated_completions=s.mask_truncated, entropy_BxT=entropy_BxN)
    # KL(rollout || noise-free) per token, k1 estimate on rollout samples: how far AQN moved the sampler.
    token_mask = mb["mask_BxN"].astype(jnp.float32)
    metrics["rollout_kl"] = (-rollout_gap_BxN * token_mask).sum() / jnp.maximum(token_mask.sum(), 1.0)
    metrics["weight"] = token_mask.sum()
    return loss, (metrics, logp_BxN)

  def body(grads_acc, mb):
    (loss, (metrics, logp_BxN)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, mb)
    grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
    return grads_acc, (loss, metrics, jax.lax.stop_gradient(logp_BxN))

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
  grads, (loss_M, metrics_M, logp_MxbxN) = jax.lax.scan(body, zeros, micro)
  loss = loss_M.sum()
  grad_norm = optax.global_norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
  updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
  new_params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
  consecutive, total = state.nonfinite[0], state.nonfinite[1]
  bad = (~finite).astype(jnp.int32)
  new_state = state.replace(
    params=jax.tree.map(keep, new_params, state.params),
    opt_state=jax.tree.map(keep, new_opt_state, state.opt_state),
    num_updates=state.num_updates + finite.astype(jnp.int32),
    nonfinite=jnp.stack([(consecutive + 1) * bad, total + bad]))

  weights_M = metrics_M.pop("weight")
  metrics = _weighted(metrics_M, weights_M)
  metrics.update(loss=loss, grad_norm=grad_norm, lr=jnp.asarray(schedule(state.num_updates), jnp.float32),
                 update_finite=finite.astype(jnp.float32))
  logp_BxN = logp_MxbxN.reshape(rows, -1)
  return new_state, metrics, logp_BxN


def policy_logprobs(params: dict, frozen: Any, batch: dict, *, graphdef, settings: UpdateSettings):
  """logp_BxN of the completions under `params` (no gradient), micro-batched like the update.

  Used with the reference params (LoRA B zeroed) for the KL term.
  """
  TRACE_COUNT["logprobs"] += 1
  rows = batch["completion_BxN"].shape[0]
  micro = _micro({k: batch[k] for k in ("prompt_BxP", "prompt_valid_BxP", "completion_BxN")},
                 settings.micro_batch_size)
  if settings.micro_sharding is not None:
    micro = jax.lax.with_sharding_constraint(micro, settings.micro_sharding)

  def body(_, mb):
    logp_BxN, _ = _logprobs(merge(graphdef, params, frozen), mb, settings)
    return None, logp_BxN

  _, logp_MxbxN = jax.lax.scan(body, None, micro)
  return logp_MxbxN.reshape(rows, -1)


@functools.lru_cache(maxsize=16)
def jit_update(graphdef, optimizer_settings: OptimizerSettings, settings: UpdateSettings):
  """`update_step` jitted with its static parts bound and the train state donated.

  Cached on its (hashable) arguments, so trainers of equal models and settings share the compiled program.
  Returns (jitted update, optimizer, schedule).
  """
  optimizer, schedule = make_optimizer(optimizer_settings)
  fn = lambda state, frozen, batch, first: update_step(  # noqa: E731
    state, frozen, batch, first, graphdef=graphdef, optimizer=optimizer, schedule=schedule,
    settings=settings)
  return jax.jit(fn, donate_argnums=(0,)), optimizer, schedule


@functools.lru_cache(maxsize=16)
def jit_logprobs(graphdef, settings: UpdateSettings):
  fn = lambda params, frozen, batch: policy_logprobs(  # noqa: E731
    params, frozen, batch, graphdef=graphdef, settings=settings)
  return jax.jit(fn)
