"""Checkpoints of the train state with orbax: every N steps, the last k kept, written atomically.

A checkpoint holds the device part of `TrainState` (trainable params, optimizer state, step, keys,
counters) and a JSON record: the data sampler's position, the whole config, and the config fields that
decide whether the state fits a run (`COMPAT_KEYS`). The frozen base is never saved: it comes back from the
model files. Orbax writes each step into a temporary directory and renames it when complete, so a process
killed during a save leaves the previous checkpoint loadable (the half-written one is ignored).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from qerl_jax.train.state import TrainState, data_position, device_part

# Config fields a checkpoint's state depends on: resuming under different values would load adapters of
# another shape, model or meaning. Everything else (learning rate, lengths, logging) may change on resume.
COMPAT_KEYS = (
  "model.path", "model.quant", "model.lora_rank", "model.lora_alpha", "model.lora_targets",
  "model.train_norms", "model.random.model_type", "model.random.hidden_size",
  "model.random.intermediate_size", "model.random.num_hidden_layers", "model.random.num_attention_heads",
  "model.random.num_key_value_heads", "model.random.tie_word_embeddings", "data.name", "seed",
)


class IncompatibleCheckpointError(ValueError):
  """The workdir holds a checkpoint of a run whose config does not fit this one."""


def _get(config, dotted: str) -> Any:
  node = config
  for part in dotted.split("."):
    node = node[part] if isinstance(node, dict) else getattr(node, part)
  return node


def compat_fields(config) -> dict:
  return {key: _get(config, key) for key in COMPAT_KEYS}


class Checkpointer:
  """Saves and restores `TrainState` under `workdir/checkpoints` (synchronous, atomic saves)."""

  def __init__(self, workdir: str, keep: int = 3):
    if keep < 1:
      raise ValueError(f"keep_checkpoints={keep} must be >= 1")
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self._keep = keep
    self._manager = self._open()

  def _open(self) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=self._keep, create=True,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, state: TrainState, config) -> None:
    """Writes `state` (which must be finite: the loop never saves a skipped update's NaN) at its step."""
    step = int(state.step)
    tree = jax.device_get(device_part(state))
    leaves = [np.asarray(x) for x in jax.tree.leaves(tree.params)]
    if not all(np.isfinite(x).all() for x in leaves if np.issubdtype(x.dtype, np.floating)):
      raise FloatingPointError(f"refusing to save a checkpoint with non-finite parameters at step {step}")
    meta = {"step": step, "data": {k: int(v) for k, v in (state.data or {}).items()},
            "compat": compat_fields(config), "config": config.to_json_best_effort()}
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                     meta=ocp.args.JsonSave(meta)), force=True)
    self._manager.wait_until_finished()

  def read_meta(self, step: int) -> dict:
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def check_compatible(self, step: int, config) -> None:
    """Raises IncompatibleCheckpointError naming every field that differs from the checkpoint's."""
    saved = self.read_meta(step).get("compat", {})
    mine = compat_fields(config)
    diffs = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
    if diffs:
      lines = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in sorted(diffs.items()))
      raise IncompatibleCheckpointError(
        f"the checkpoint at step {step} in {self.directory} comes from an incompatible config ({lines}). "
        "Use another --workdir, or pass --config.train.restart=True to move the old checkpoints aside "
        "and start over.")

  def restore(self, step: int, template: TrainState) -> TrainState:
    """The state saved at `step`, shaped like `template` (a freshly initialised state)."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, device_part(template))
    out = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                              meta=ocp.args.JsonRestore()))
    return out["state"].replace(data=data_position(out["meta"]["data"]))

  def move_aside(self) -> str:
    """Renames the checkpoint directory to checkpoints.old-<time> (nothing is deleted); returns the new name."""
    self._manager.close()
    target = f"{self.directory}.old-{time.strftime('%Y%m%d-%H%M%S')}"
    shutil.move(self.directory, target)
    logging.warning("moved incompatible checkpoints to %s", target)
    self._manager = self._open()
    return target

  def close(self) -> None:
    self._manager.close()
