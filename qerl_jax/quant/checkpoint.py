"""compressed-tensors checkpoint directories: the config block, a streaming reader, and the writer.

Writing (``quantize_checkpoint``, behind ``python -m qerl_jax.quantize``) turns a Hugging Face
checkpoint (config.json + model.safetensors, or shards with model.safetensors.index.json) into the
directory llm-compressor would write for NVFP4A16 (or MXFP4A16): the decoder blocks' Linear weights become
``weight_packed`` / ``weight_scale`` (/ ``weight_global_scale``), everything else is copied unchanged.
Host memory stays near one tensor: a first pass reads each target weight once for its global scale
(q/k/v and gate/up share the minimum), a second pass quantizes and writes tensor by tensor into
safetensors files whose headers are planned up front. The output appears only when complete: it is
written into a temporary directory beside ``out_dir`` and renamed at the end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Any, Iterator

import jax.numpy as jnp
import numpy as np

from qerl_jax.quant import api, nvfp4
from qerl_jax.quant.safetensors_io import SafetensorsError, SafetensorsFile, TensorSpec, write_file
from qerl_jax.quant.types import QuantizedTensor

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MistralForCausalLM")
FORMATS = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
SCHEME_OF_FORMAT = {v: k for k, v in FORMATS.items()}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
# Decoder-block Linear weights: the only tensors llm-compressor's NVFP4A16 recipe quantizes here.
_TARGET_RE = re.compile(
  r"^(model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj))\.weight$")
# vLLM fuses these projections and reads one global scale per fused layer.
_FUSED_GROUP = {"self_attn.q_proj": "qkv", "self_attn.k_proj": "qkv", "self_attn.v_proj": "qkv",
                "mlp.gate_proj": "gate_up", "mlp.up_proj": "gate_up"}
_WEIGHT_FILE_EXT = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


class CheckpointError(ValueError):
  """A user-facing problem with a checkpoint or the options (the CLI prints it without a traceback)."""


def quantization_config(scheme: str, ignore: list[str] | tuple[str, ...] = ("lm_head",)) -> dict:
  """The config.json ``quantization_config`` block compressed-tensors writes for NVFP4A16 / MXFP4A16."""
  if scheme not in FORMATS:
    raise ValueError(f"no compressed-tensors format for {scheme=}; expected one of {tuple(FORMATS)}")
  fmt = FORMATS[scheme]
  weights = {"num_bits": 4, "type": "float",
             "strategy": "tensor_group" if scheme == "nvfp4" else "group",
             "group_size": api.BLOCK_OF_SCHEME[scheme], "symmetric": True, "dynamic": False,
             "observer": "minmax"}
  return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
          "ignore": list(ignore), "kv_cache_scheme": None,
          "config_groups": {"group_0": {"targets": ["Linear"], "format": fmt, "weights": weights,
                                        "input_activations": None, "output_activations": None}}}


def is_ignored(module: str, ignore: list[str] | tuple[str, ...]) -> bool:
  """compressed-tensors' matching: an exact module name, or ``re:<pattern>`` matched from the start."""
  for pattern in ignore:
    if pattern.startswith("re:"):
      if re.match(pattern[3:], module):
        return True
    elif module == pattern:
      return True
  return False


def target_module(tensor_name: str) -> str | None:
  """The module name if ``tensor_name`` is a decoder-block Linear weight, else None."""
  m = _TARGET_RE.match(tensor_name)
  return m.group(1) if m else None


def fused_key(module: str) -> str:
  """Modules with the same key share a global scale (layer N's q/k/v, or its gate/up)."""
  m = re.match(r"^(model\.layers\.\d+)\.(.+)$", module)
  if m and m.group(2) in _FUSED_GROUP:
    return f"{m.group(1)}.{_FUSED_GROUP[m.group(2)]}"
  return module


class CheckpointDir:
  """The safetensors tensors of a checkpoint directory, by name, read lazily (one at a time)."""

  def __init__(self, model_dir: str):
    self.dir = model_dir
    if not os.path.isdir(model_dir):
      raise CheckpointError(f"model directory {model_dir} does not exist")
    self.config = _read_json(os.path.join(model_dir, "config.json"), "config.json")
    index_path = os.path.join(model_dir, INDEX_NAME)
    if os.path.exists(index_path):
      weight_map = _read_json(index_path, INDEX_NAME).get("weight_map")
      if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path} has no weight_map")
      files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(model_dir, SINGLE_NAME)):
      files = [SINGLE_NAME]
    else:
      raise CheckpointError(f"no {SINGLE_NAME} or {INDEX_NAME} in {model_dir} (only safetensors "
                            "checkpoints are supported)")
    self._files: dict[str, SafetensorsFile] = {}
    self._where: dict[str, str] = {}
    for fname in files:
      path = os.path.join(model_dir, fname)
      if not os.path.isfile(path):
        raise CheckpointError(f"weight file {path} listed in the checkpoint is missing")
      try:
        st = SafetensorsFile(path)
      except SafetensorsError as e:
        raise CheckpointError(str(e)) from None
      self._files[fname] = st
      for name in st.keys():
        self._where[name] = fname

  def keys(self) -> list[str]:
    return list(self._where)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._files[self._where[name]].shape(name)

  def dtype(self, name: str) -> np.dtype:
    return self._files[self._where[name]].dtype(name)

  def get(self, name: str) -> np.ndarray:
    return self._files[self._where[name]].get(name)

  def __contains__(self, name: str) -> bool:
    return name in self._where


def _read_json(path: str, what: str) -> dict:
  try:
    with open(path) as f:
      data = json.load(f)
  except FileNotFoundError:
    raise CheckpointError(f"{what} not found: {path}") from None
  except OSError as e:
    raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{path} is not valid JSON ({e})") from None
  if not isinstance(data, dict):
    raise CheckpointError(f"{path} does not hold a JSON object")
  return data


# ---------------------------------------------------------------------------------------------- reading


def read_quantization_config(model_dir: str) -> dict | None:
  """The ``quantization_config`` of a checkpoint's config.json (None when it has none)."""
  return _read_json(os.path.join(model_dir, "config.json"), "config.json").get("quantization_config")


def iter_ct_checkpoint(model_dir: str) -> Iterator[tuple[str, np.ndarray | QuantizedTensor]]:
  """Streams a compressed-tensors NVFP4 / MXFP4 directory as (name, value), one tensor in memory.

  A quantized Linear comes out once, as ``(<module>.weight, NVFP4Tensor | MXFP4Tensor)`` holding exact
  (memory-mapped) copies of its stored arrays; the W4A4 scheme's ``<module>.input_global_scale`` comes
  out as a plain array so it can be written back on export. Every other tensor is yielded as stored.
  """
  ckpt = CheckpointDir(model_dir)
  qcfg = ckpt.config.get("quantization_config") or {}
  fmt = qcfg.get("format")
  group_formats = {g.get("format") for g in (qcfg.get("config_groups") or {}).values()}
  for f in {fmt} | group_formats:
    if f is not None and f not in SCHEME_OF_FORMAT:
      raise CheckpointError(f"{model_dir}: unsupported compressed-tensors format {f!r}; this reader "
                            f"handles {sorted(SCHEME_OF_FORMAT)}")
  for name in ckpt.keys():
    if name.endswith((".weight_scale", ".weight_global_scale")):
      continue  # emitted with their weight_packed
    if not name.endswith(".weight_packed"):
      yield name, ckpt.get(name)
      continue
    module = name[: -len(".weight_packed")]
    parts = {p: ckpt.get(f"{module}.{p}") for p in ("weight_packed", "weight_scale",
                                                     "weight_global_scale") if f"{module}.{p}" in ckpt}
    if "weight_scale" not in parts:
      raise CheckpointError(f"{module} has weight_packed but no weight_scale")
    scheme = "nvfp4" if "weight_global_scale" in parts else "mxfp4"
    if scheme == "mxfp4" and parts["weight_scale"].dtype != np.uint8:
      raise CheckpointError(f"{module}: {parts['weight_scale'].dtype} weight_scale without a "
                            "weight_global_scale is neither NVFP4 nor MXFP4")
    try:
      yield f"{module}.weight", api.from_ct_tensors(parts, scheme)
    except ValueError as e:
      raise CheckpointError(f"{module}: {e}") from None


# ---------------------------------------------------------------------------------------------- writing


def _layer_of(name: str) -> int:
  m = re.match(r"^model\.layers\.(\d+)\.", name)
  return int(m.group(1)) if m else -1


def _global_scales(ckpt: CheckpointDir, targets: dict[str, str], progress: bool) -> dict[str, Any]:
  """Pass 1: every target's own NVFP4 global scale, then the minimum over each fused group."""
  own = {}
  for module, tensor in _progress(list(targets.items()), progress, "global scales"):
    w = jnp.asarray(ckpt.get(tensor))
    _check_finite(w, tensor)
    own[module] = np.asarray(nvfp4.global_scale(w))
  shared: dict[str, np.ndarray] = {}
  for module, gs in own.items():
    key = fused_key(module)
    shared[key] = gs if key not in shared else np.minimum(shared[key], gs)
  return {module: shared[fused_key(module)] for module in own}


def _is_float(dtype) -> bool:
  # ml_dtypes' bfloat16 / float8 report kind "V", so np.floating does not cover them.
  return np.dtype(dtype).kind == "f" or np.dtype(dtype).name in ("bfloat16", "float8_e4m3fn",
                                                                  "float8_e5m2")


def _check_finite(w, name: str) -> None:
  try:
    api.check_finite(w, name)
  except ValueError as e:
    raise CheckpointError(str(e)) from None


def _progress(items: list, enabled: bool, desc: str):
  if not enabled:
    return items
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(items, desc=desc, unit="layer" if desc == "quantizing" else "tensor", leave=False)


class _OneModuleCache:
  """Quantizes each module once although its 2-3 output tensors are produced separately."""

  def __init__(self):
    self.module, self.tensors = None, None

  def get(self, module: str, compute) -> dict[str, np.ndarray]:
    if module != self.module:
      self.module, self.tensors = module, compute()
    return self.tensors


def _plan(ckpt: CheckpointDir, scheme: str, ignore: list[str]):
  """(output TensorSpecs in write order, {module: source tensor}) for the quantized checkpoint."""
  targets: dict[str, str] = {}
  for name in ckpt.keys():
    module = target_module(name)
    if module is None or is_ignored(module, ignore):
      continue
    if not _is_float(ckpt.dtype(name)) or len(ckpt.shape(name)) != 2:
      raise CheckpointError(f"{name}: expected a 2-D float weight, got {ckpt.dtype(name)} "
                            f"{ckpt.shape(name)}")
    try:
      api.check_blocks(ckpt.shape(name)[1], scheme, module)
    except ValueError as e:
      raise CheckpointError(str(e)) from None
    targets[module] = name
  return targets


def _output_specs(ckpt, scheme, targets, gs_of, cache) -> list[TensorSpec]:
  module_of = {tensor: module for module, tensor in targets.items()}
  names = sorted(ckpt.keys(), key=lambda n: (_layer_of(n) if _layer_of(n) >= 0 else
                                             (-1 if "embed" in n else 1 << 30), n))
  specs = []
  for name in names:
    module = module_of.get(name)
    if module is None:
      def copy(name=name):
        arr = ckpt.get(name)
        if _is_float(arr.dtype) and not np.all(np.isfinite(arr)):
          raise CheckpointError(f"tensor {name} contains NaN or Inf")
        return arr
      specs.append(TensorSpec(name, ckpt.dtype(name), ckpt.shape(name), copy))
      continue
    n, k = ckpt.shape(name)

    def compute(name=name, module=module):
      gs = gs_of.get(module)
      q = api.quantize_NxK(jnp.asarray(ckpt.get(name)), scheme, global_scale=gs, name=name)
      return api.to_ct_tensors(q)
    block = api.BLOCK_OF_SCHEME[scheme]
    parts = [("weight_packed", np.uint8, (n, k // 2)),
             ("weight_scale", "float8_e4m3fn" if scheme == "nvfp4" else np.uint8, (n, k // block))]
    if scheme == "nvfp4":
      parts.append(("weight_global_scale", np.float32, (1,)))
    for part, dtype, shape in parts:
      dtype = np.dtype(jnp.float8_e4m3fn) if dtype == "float8_e4m3fn" else dtype
      specs.append(TensorSpec(f"{module}.{part}", dtype, shape,
                              lambda part=part, module=module, compute=compute:
                              cache.get(module, compute)[part]))
  return specs


def _shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
  shards: list[list[TensorSpec]] = [[]]
  size = 0
  for spec in specs:
    if shards[-1] and size + spec.nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(spec)
    size += spec.nbytes
  return shards


def quantize_checkpoint(model_dir: str, out_dir: str, *, scheme: str = "nvfp4",
                        ignore: list[str] | tuple[str, ...] = ("lm_head",), overwrite: bool = False,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, progress: bool = True) -> dict:
  """Writes the compressed-tensors checkpoint of ``model_dir`` to ``out_dir``; returns a summary.

  Raises CheckpointError (with nothing written) for missing or unreadable files, an unsupported
  architecture, NaN/Inf in a weight, a layer whose K is not a multiple of the block, or an existing
  ``out_dir`` without ``overwrite``.
  """
  if scheme not in FORMATS:
    raise CheckpointError(f"--scheme must be one of {tuple(FORMATS)}, got {scheme!r}")
  ignore = list(ignore)
  for pattern in ignore:
    if pattern.startswith("re:"):
      try:
        re.compile(pattern[3:])
      except re.error as e:
        raise CheckpointError(f"bad --ignore regex {pattern!r}: {e}") from None
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(out_dir) and not overwrite:
    raise CheckpointError(f"output directory {out_dir} already exists (pass --overwrite to replace it)")
  if os.path.exists(model_dir) and os.path.exists(out_dir) and os.path.samefile(model_dir, out_dir):
    raise CheckpointError("--out must differ from --model")
  ckpt = CheckpointDir(model_dir)
  archs = ckpt.config.get("architectures") or []
  if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
    raise CheckpointError(f"unsupported architecture {archs} in {model_dir}/config.json; supported: "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
  if ckpt.config.get("quantization_config"):
    raise CheckpointError(f"{model_dir} is already quantized (its config.json has a "
                          "quantization_config)")
  targets = _plan(ckpt, scheme, ignore)
  gs_of = _global_scales(ckpt, targets, progress) if scheme == "nvfp4" else {}
  if scheme != "nvfp4":
    for module, tensor in targets.items():
      _check_finite(jnp.asarray(ckpt.get(tensor)), tensor)
  specs = _output_specs(ckpt, scheme, targets, gs_of, _OneModuleCache())
  shards = _shards(specs, max_shard_bytes)

  parent = os.path.dirname(out_dir)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.partial-", dir=parent)
  try:
    _write_all(ckpt, tmp, shards, scheme, ignore, progress)
    _replace_dir(tmp, out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return {"out_dir": out_dir, "scheme": scheme, "quantized": sorted(targets),
          "shards": len(shards), "bytes": sum(s.nbytes for s in specs)}


def _write_all(ckpt: CheckpointDir, tmp: str, shards, scheme: str, ignore: list[str],
               progress: bool) -> None:
  layers = sorted({_layer_of(s.name) for shard in shards for s in shard})
  bar = _progress(layers, progress, "quantizing")
  bar_update = getattr(bar, "update", None)
  seen: set[int] = set()

  def on_tensor(spec: TensorSpec) -> None:
    layer = _layer_of(spec.name)
    if bar_update is not None and layer not in seen:
      seen.add(layer)
      bar_update(1)

  if len(shards) == 1:
    names = [SINGLE_NAME]
  else:
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  weight_map = {}
  for fname, shard in zip(names, shards):
    write_file(os.path.join(tmp, fname), shard, {"format": "pt"}, on_tensor)
    weight_map.update({s.name: fname for s in shard})
  if hasattr(bar, "close"):
    bar.close()
  if len(shards) > 1:
    total = sum(s.nbytes for shard in shards for s in shard)
    with open(os.path.join(tmp, INDEX_NAME), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  config = dict(ckpt.config)
  config["quantization_config"] = quantization_config(scheme, ignore)
  with open(os.path.join(tmp, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  for entry in sorted(os.listdir(ckpt.dir)):
    src = os.path.join(ckpt.dir, entry)
    if (entry.startswith(".") or entry in ("config.json", INDEX_NAME) or
        entry.endswith(_WEIGHT_FILE_EXT) or not os.path.isfile(src)):
      continue
    shutil.copy2(src, os.path.join(tmp, entry))  # tokenizer, generation config, chat template, ...


def _replace_dir(tmp: str, out_dir: str) -> None:
  """Renames the finished ``tmp`` to ``out_dir``, replacing an old ``out_dir`` only at the very end."""
  if not os.path.exists(out_dir):
    os.rename(tmp, out_dir)
    return
  old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
  os.rmdir(old)
  os.rename(out_dir, old)
  os.rename(tmp, out_dir)
  shutil.rmtree(old, ignore_errors=True)
