"""The optimizer of the policy update: AdamW with warmup + cosine decay and global-norm clipping.

Weight decay is masked off norm scales and biases (as in TRL / PyTorch recipes that exclude them), and
applied to the LoRA A and B matrices. The schedule counts optimizer updates: `num_iterations` per RL step.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import optax

# Parameters whose path (lower-cased, "/"-joined) matches this take no weight decay.
NO_DECAY_PATTERN = r"norm|bias"


def _path_str(path) -> str:
  parts = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        parts.append(str(getattr(entry, attr)))
        break
    else:
      parts.append(str(entry))
  return "/".join(parts)


def decay_mask(params: Any, no_decay_pattern: str = NO_DECAY_PATTERN) -> Any:
  """Pytree of bools like `params`: True where weight decay applies (not norms, not biases)."""
  regex = re.compile(no_decay_pattern)
  return jax.tree_util.tree_map_with_path(lambda p, _: regex.search(_path_str(p).lower()) is None, params)


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


def make_optimizer(train_cfg, total_updates: int):
  """(optax transformation, schedule) from the `train` section of a config.

  Reads learning_rate, warmup_ratio, final_lr_ratio, adam_b1, adam_b2, adam_eps, weight_decay, grad_clip.
  """
  schedule = learning_rate_schedule(train_cfg.learning_rate, total_updates, train_cfg.warmup_ratio,
                                    train_cfg.final_lr_ratio)
  parts = []
  if train_cfg.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(train_cfg.grad_clip))
  parts.append(optax.adamw(schedule, b1=train_cfg.adam_b1, b2=train_cfg.adam_b2, eps=train_cfg.adam_eps,
                           weight_decay=train_cfg.weight_decay, mask=decay_mask))
  return optax.chain(*parts), schedule
