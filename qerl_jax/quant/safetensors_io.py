"""The one safetensors reader and streaming writer of the project (NumPy + ml_dtypes).

The ``safetensors`` package's NumPy/Flax backends cannot return float8 tensors (compressed-tensors'
``weight_scale``), its ``safe_open`` maps whole files (every byte read stays resident until the file is
closed), and its writers need every tensor of a file in memory at once. The format is simple (8-byte
little-endian header length, a JSON header of {name: {dtype, shape, data_offsets}}, then the raw
little-endian bytes), so this module reads each requested tensor with a positioned read into a fresh array,
and writes a file's header first and then its tensors one at a time.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Callable, Iterable

import ml_dtypes
import numpy as np

DTYPES = {
  "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
  "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32),
  "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
  "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype(np.float32),
  "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
  "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
  """A safetensors file that is missing, unreadable or malformed (the message names the file)."""


def dtype_name(dtype) -> str:
  try:
    return DTYPE_NAMES[np.dtype(dtype)]
  except KeyError:
    raise SafetensorsError(f"no safetensors dtype for {dtype=}") from None


class SafetensorsFile:
  """Lazy reader: the header is parsed on open; ``get`` returns a read-only memory-mapped view."""

  def __init__(self, path: str):
    self.path = path
    try:
      with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
          raise SafetensorsError(f"{path}: too short to be a safetensors file")
        (hlen,) = struct.unpack("<Q", raw)
        if hlen > _MAX_HEADER:
          raise SafetensorsError(f"{path}: header length {hlen} is not plausible")
        header = json.loads(f.read(hlen))
      size = os.path.getsize(path)
    except OSError as e:
      raise SafetensorsError(f"cannot read {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise SafetensorsError(f"{path}: malformed safetensors header ({e})") from None
    self.metadata = header.pop("__metadata__", None) or {}
    self._data_start = 8 + hlen
    self._info = header
    for name, info in header.items():
      if info.get("dtype") not in DTYPES:
        raise SafetensorsError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')}")
      begin, end = info["data_offsets"]
      if self._data_start + end > size:
        raise SafetensorsError(f"{path}: tensor {name} runs past the end of the file (truncated?)")

  def __contains__(self, name: str) -> bool:
    return name in self._info

  def keys(self) -> list[str]:
    return list(self._info)

  def dtype(self, name: str) -> np.dtype:
    return DTYPES[self._info[name]["dtype"]]

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._info[name]["shape"])

  def get(self, name: str) -> np.ndarray:
    """The tensor in its stored dtype, read into a fresh array (only this tensor is resident)."""
    info = self._info[name]
    out = np.empty(info["shape"], DTYPES[info["dtype"]])
    begin, end = info["data_offsets"]
    if out.nbytes != end - begin:
      raise SafetensorsError(f"{self.path}: tensor {name} has {end - begin} bytes for shape {info['shape']} "
                             f"{info['dtype']}")
    try:
      with open(self.path, "rb", buffering=0) as f:
        view = memoryview(out.reshape(-1).view(np.uint8))
        f.seek(self._data_start + begin)
        got = 0
        while got < out.nbytes:
          n = f.readinto(view[got:])
          if not n:
            raise SafetensorsError(f"{self.path}: tensor {name} is truncated")
          got += n
    except OSError as e:
      raise SafetensorsError(f"cannot read {self.path}: {e.strerror or e}") from None
    return out


class TensorSpec:
  """One tensor to write: its name, dtype, shape, and a function that produces its data when needed."""

  def __init__(self, name: str, dtype, shape: Iterable[int], produce: Callable[[], Any]):
    self.name = name
    self.dtype = np.dtype(dtype)
    self.shape = tuple(int(s) for s in shape)
    self.produce = produce

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def write_file(path: str, specs: list[TensorSpec], metadata: dict[str, str] | None = None,
               on_tensor: Callable[[TensorSpec], None] | None = None) -> None:
  """Writes a safetensors file whose tensors are produced one at a time (peak memory: one tensor)."""
  header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
  offset = 0
  for spec in specs:
    header[spec.name] = {"dtype": dtype_name(spec.dtype), "shape": list(spec.shape),
                         "data_offsets": [offset, offset + spec.nbytes]}
    offset += spec.nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * ((-len(blob)) % 8)  # keep the data 8-byte aligned, as the reference writer does
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for spec in specs:
      arr = np.ascontiguousarray(np.asarray(spec.produce()))
      if arr.dtype != spec.dtype or arr.shape != spec.shape:
        raise AssertionError(f"{spec.name}: produced {arr.dtype} {arr.shape}, planned "
                             f"{spec.dtype} {spec.shape}")
      f.write(arr.reshape(-1).view(np.uint8).data)
      if on_tensor is not None:
        on_tensor(spec)
