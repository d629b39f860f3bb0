"""Checkpoint directories of safetensors files (single file or an index of shards), one tensor at a time.

Tensors are read by `qerl_jax.quant.safetensors_io.SafetensorsFile` (positioned reads, float8-capable),
so only the tensor being converted is in host memory. Writing whole arrays goes through
`safetensors.numpy.save_file` (ml_dtypes arrays).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import numpy as np

from qerl_jax.quant.safetensors_io import SafetensorsFile


class SafetensorsDir:
  """All tensors of a checkpoint directory (single file or an index of shards), read lazily."""

  def __init__(self, directory: str):
    self.directory = directory
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
      with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    else:
      files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not files:
      raise FileNotFoundError(f"no .safetensors files in {directory}")
    self.files: dict[str, SafetensorsFile] = {}
    for name in files:
      path = os.path.join(directory, name)
      if not os.path.isfile(path):
        raise FileNotFoundError(f"shard {path} listed in the index is missing")
      shard = SafetensorsFile(path)
      self.files.update({key: shard for key in shard.keys()})

  @classmethod
  def from_file(cls, path: str) -> "SafetensorsDir":
    """A reader over one .safetensors file (e.g. a PEFT adapter)."""
    obj = cls.__new__(cls)
    obj.directory = path
    shard = SafetensorsFile(path)
    obj.files = {key: shard for key in shard.keys()}
    return obj

  def __contains__(self, name: str) -> bool:
    return name in self.files

  def keys(self) -> Iterator[str]:
    return iter(self.files)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._file(name).shape(name)

  def dtype(self, name: str) -> np.dtype:
    return self._file(name).dtype(name)

  def get(self, name: str) -> np.ndarray:
    """The tensor as a NumPy array in its stored dtype (bf16 / float8 through ml_dtypes)."""
    return self._file(name).get(name)

  def _file(self, name: str) -> SafetensorsFile:
    try:
      return self.files[name]
    except KeyError:
      raise KeyError(f"tensor {name!r} not found in {self.directory}") from None


def save_shards(tensors: Iterator[tuple[str, np.ndarray]], directory: str, *, max_shard_bytes: int = 4 << 30,
                metadata: dict[str, str] | None = None) -> list[str]:
  """Writes (name, array) pairs as model.safetensors, or numbered shards plus an index past the size limit.

  Tensors arrive one by one (a generator), so only one shard's worth is held in memory at a time.
  """
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  metadata = {"format": "pt", **(metadata or {})}
  current: dict[str, np.ndarray] = {}
  size = 0
  written: list[tuple[str, list[str]]] = []
  tmp_names: list[str] = []

  def flush():
    nonlocal current, size
    if current:
      tmp = os.path.join(directory, f".shard-{len(tmp_names):05d}.safetensors")
      save_file(current, tmp, metadata=metadata)
      tmp_names.append(tmp)
      written.append((tmp, list(current)))
      current, size = {}, 0

  os.makedirs(directory, exist_ok=True)
  total = 0
  for name, array in tensors:
    array = np.ascontiguousarray(array)
    if current and size + array.nbytes > max_shard_bytes:
      flush()
    current[name] = array
    size += array.nbytes
    total += array.nbytes
  flush()
  if len(written) == 1:
    final = os.path.join(directory, "model.safetensors")
    os.replace(written[0][0], final)
    return [final]
  weight_map, finals = {}, []
  for i, (tmp, names) in enumerate(written):
    final_name = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
    os.replace(tmp, os.path.join(directory, final_name))
    finals.append(os.path.join(directory, final_name))
    weight_map.update({n: final_name for n in names})
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return finals
