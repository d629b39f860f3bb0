"""Streaming access to (sharded) safetensors checkpoints, one tensor at a time.

The file format is a little-endian u64 header length, a JSON header {name: {dtype, shape, data_offsets}},
then the raw bytes. This reader parses the headers once and reads each requested tensor with a positioned
read into a fresh NumPy array. Two reasons not to use `safetensors.safe_open` here: its NumPy backend
cannot return float8 tensors (compressed-tensors' `weight_scale`), and it maps whole files, so every
byte read stays resident in the process until the file is closed; with explicit reads only the tensor
being converted is in memory. Writing goes through `safetensors.numpy.save_file` (ml_dtypes arrays).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator

import ml_dtypes
import numpy as np

DTYPES = {
  "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
  "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
  "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}


class TensorInfo:
  """Where one tensor lives: file, dtype, shape, byte range."""

  __slots__ = ("path", "dtype", "shape", "start", "end")

  def __init__(self, path: str, dtype: np.dtype, shape: tuple[int, ...], start: int, end: int):
    self.path, self.dtype, self.shape, self.start, self.end = path, dtype, shape, start, end


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
  """{name: TensorInfo} and the __metadata__ of one .safetensors file."""
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise ValueError(f"{path} is not a safetensors file (too short)")
    (size,) = struct.unpack("<Q", raw)
    if size > 100_000_000:
      raise ValueError(f"{path} is not a safetensors file (header of {size} bytes)")
    header = json.loads(f.read(size))
  base = 8 + size
  meta = header.pop("__metadata__", None) or {}
  infos = {}
  for name, h in header.items():
    if h["dtype"] not in DTYPES:
      raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {h['dtype']}")
    start, end = h["data_offsets"]
    infos[name] = TensorInfo(path, DTYPES[h["dtype"]], tuple(h["shape"]), base + start, base + end)
  return infos, meta


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
    self.infos: dict[str, TensorInfo] = {}
    for name in files:
      path = os.path.join(directory, name)
      if not os.path.isfile(path):
        raise FileNotFoundError(f"shard {path} listed in the index is missing")
      self.infos.update(read_header(path)[0])

  @classmethod
  def from_file(cls, path: str) -> "SafetensorsDir":
    """A reader over one .safetensors file (e.g. a PEFT adapter)."""
    obj = cls.__new__(cls)
    obj.directory = path
    obj.infos = read_header(path)[0]
    return obj

  def __contains__(self, name: str) -> bool:
    return name in self.infos

  def keys(self) -> Iterator[str]:
    return iter(self.infos)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._info(name).shape

  def dtype(self, name: str) -> np.dtype:
    return self._info(name).dtype

  def get(self, name: str) -> np.ndarray:
    """The tensor as a NumPy array in its stored dtype (bf16 / float8 through ml_dtypes)."""
    info = self._info(name)
    out = np.empty(info.shape, info.dtype)
    nbytes = info.end - info.start
    if out.nbytes != nbytes:
      raise ValueError(f"tensor {name!r}: header says {nbytes} bytes for shape {info.shape} {info.dtype}")
    with open(info.path, "rb", buffering=0) as f:
      view = memoryview(out.reshape(-1).view(np.uint8))
      f.seek(info.start)
      got = 0
      while got < nbytes:
        n = f.readinto(view[got:])
        if not n:
          raise ValueError(f"tensor {name!r}: file {info.path} is truncated")
        got += n
    return out

  def _info(self, name: str) -> TensorInfo:
    try:
      return self.infos[name]
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
