"""The optimizer of the policy update: AdamW with warmup + cosine decay and global-norm clipping.

Weight decay is masked off norm scales and biases (as in TRL / PyTorch recipes that exclude them), and
applied to the LoRA A and B matrices. The schedule counts optimizer updates: `num_iterations` per RL step.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import optax

from qerl_jax.sharding import path_str

# Parameters whose path (lower-cased, "/"-joined) matches this take no weight decay.
NO_DECAY_PATTERN = r"norm|bias"


def decay_mask(params: Any, no_decay_pattern: str = NO_DECAY_PATTERN) -> Any:
  """Pytree of bools like `params`: True where weight decay applies (not norms, not biases)."""
  regex = re.compile(no_decay_pattern)
  return jax.tree_util.tree_map_with_path(lambda p, _: regex.search(path_str(p).lower()) is None, params)


def learning_rate_schedule(learning_rate: float, total_updates: int, warmup_ratio: float,
                           final_lr_ratio: float = 0.0) -> optax.Schedule:
  """Linear warmup from 0 over `warmup_ratio` of the updates, then cosine decay to final_lr_ratio * lr."""
  if total_updates < 1:
    raise ValueError(f"{total_updates=} must be >= 1")
  if not 0.0 <= warmup_ratio < 1.0:
    raise ValueError(f"{warmup_ratio=} must be in [0, 1)")
  warmup = int(round(warmup_ratio * total_updates))
  decay = max(total_updates - warmup, 1)
  cosine = optax.cosine_decay_schedule(learning_rate, decay, alpha=final_lr_ratio)
  if warmup == 0:
    return cosine
  # Warmup starts one step in (lr / warmup, not 0) so the first update is not wasted.
  ramp = optax.linear_schedule(learning_rate / warmup, learning_rate, warmup - 1) if warmup > 1 else (
    lambda _: learning_rate)
  return optax.join_schedules([ramp, cosine], [warmup])


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
  """Hyperparameters of the optimizer (hashable, so equal settings share one compiled update)."""

  learning_rate: float
  total_updates: int
  warmup_ratio: float = 0.1
  final_lr_ratio: float = 0.0
  adam_b1: float = 0.9
  adam_b2: float = 0.99
  adam_eps: float = 1e-8
  weight_decay: float = 0.1
  grad_clip: float = 0.2

  @classmethod
  def from_config(cls, config) -> "OptimizerSettings":
    t = config.train
    return cls(learning_rate=t.learning_rate, total_updates=t.steps * t.num_iterations,
               warmup_ratio=t.warmup_ratio, final_lr_ratio=t.final_lr_ratio, adam_b1=t.adam_b1,
               adam_b2=t.adam_b2, adam_eps=t.adam_eps, weight_decay=t.weight_decay, grad_clip=t.grad_clip)


def make_optimizer(s: OptimizerSettings):
  """(optax transformation, schedule): [clip_by_global_norm] -> AdamW(schedule, masked weight decay)."""
  schedule = learning_rate_schedule(s.learning_rate, s.total_updates, s.warmup_ratio, s.final_lr_ratio)
  parts = []
  if s.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(s.grad_clip))
  parts.append(optax.adamw(schedule, b1=s.adam_b1, b2=s.adam_b2, eps=s.adam_eps, weight_decay=s.weight_decay,
                           mask=decay_mask))
  return optax.chain(*parts), schedule
