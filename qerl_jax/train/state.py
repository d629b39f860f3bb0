"""The training state: one pytree holding everything a run needs to continue exactly.

Trainable parameters (LoRA A/B, optional norm scales) as a plain nested dict, the optimizer state, the
step, the base PRNG keys (AQN noise of step t is drawn from fold_in(aqn_key, t), rollout samples from
fold_in(sample_key, t)), the counters of skipped non-finite updates, and the data sampler's position.
The frozen base is not part of it: it is reloaded from the model files and never checkpointed.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 []: RL steps completed
  params: dict  # trainable leaves, a pure nested dict of arrays
  opt_state: Any  # optax state of `params`
  num_updates: jax.Array  # int32 []: optimizer updates applied (skipped non-finite ones excluded)
  aqn_key: jax.Array  # uint32 [2]: base key of the AQN noise
  sample_key: jax.Array  # uint32 [2]: base key of the rollout sampling
  nonfinite: jax.Array  # int32 [2]: (consecutive, total) updates skipped for NaN/Inf
  data: Any = None  # the prompt sampler's position {name: int64 []} (host side; None inside jit)


def base_keys(seed: int) -> tuple[jax.Array, jax.Array]:
  """(aqn_key, sample_key): independent raw uint32[2] keys derived from the run's seed."""
  root = jax.random.PRNGKey(seed)
  return jax.random.fold_in(root, 1), jax.random.fold_in(root, 2)


def data_position(sampler_state: dict) -> dict:
  """A sampler's state() as a pytree of int64 numpy scalars (kept on the host, saved as JSON)."""
  return {k: np.asarray(int(v), np.int64) for k, v in sampler_state.items()}


def sampler_state(position: dict) -> dict:
  return {k: int(v) for k, v in position.items()}


def init_train_state(params: dict, optimizer, seed: int, data: dict | None = None) -> TrainState:
  """A step-0 state for `params` (a pure dict) and `optimizer`."""
  aqn_key, sample_key = base_keys(seed)
  return TrainState(
    step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
    num_updates=jnp.zeros((), jnp.int32), aqn_key=aqn_key, sample_key=sample_key,
    nonfinite=jnp.zeros((2,), jnp.int32), data=data)


def device_part(state: TrainState) -> TrainState:
  """The state without the host-side data position (what jitted functions and orbax array saves take)."""
  return state.replace(data=None)
