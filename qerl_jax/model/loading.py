"""`from_pretrained`: HF safetensors dirs, compressed-tensors NVFP4/MXFP4 dirs, GGUF files, hub ids.

Loading streams: the base is preallocated in its final (quantized) layout, then each layer's tensors are
read one by one from disk, moved to the device, quantized there (fused q/k/v and gate/up share NVFP4
global scales) and written into the stacked buffers in place. Peak memory is the quantized model plus a
few tensors of one layer; the full-precision model never exists on host or device. All names and shapes
are checked against the config before anything heavy happens.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qerl_jax.model import base as base_lib
from qerl_jax.model.config import ModelConfig
from qerl_jax.model.linear import PROJ_NAMES, PROJ_PATHS, LoraConfig
from qerl_jax.model.transformer import Transformer

CT_FORMATS = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4"}
_CT_PARTS = {"nvfp4": ("weight_packed", "weight_scale", "weight_global_scale"),
             "mxfp4": ("weight_packed", "weight_scale")}
_HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model", "*.jinja"]


def from_pretrained(path: str, quant: str = "nvfp4", lora_rank: int | None = 16, lora_alpha: float = 16,
                    lora_targets: Any = "all-linear", dtype: Any = jnp.bfloat16, train_norms: bool = False, *,
                    lora_dtype: Any = jnp.float32, use_rslora: bool = False, remat: bool = False, seed: int = 0,
                    load_tokenizer: bool = True, mesh: Any = None):
  """Loads a model and its tokenizer, quantizing the decoder linears while loading.

  path: a local HF directory (safetensors, single or sharded), a compressed-tensors NVFP4/MXFP4 directory
    (its quantized weights are used as stored), a .gguf file, or a hub id (downloaded when online).
  quant: "nvfp4" | "mxfp4" | "nf4" | "bf16" (unquantized, in `dtype`). A compressed-tensors directory
    keeps its own scheme; quant="bf16" dequantizes it instead.
  lora_rank / lora_alpha / lora_targets / lora_dtype / use_rslora: the adapter (rank None or 0: none).
  dtype: activations, embeddings and unquantized weights. train_norms: block RMSNorm scales trainable.
  mesh: a `jax.sharding.Mesh`: the base is allocated split by `qerl_jax.sharding`'s rules and filled layer
    by layer, so no device ever holds all of it (the adapters start on the default device; the trainer
    places them).
  Returns (model, tokenizer); tokenizer is None when the directory has none or load_tokenizer=False.
  """
  base_lib.check_quant(quant)
  local = _resolve(path)
  if local.endswith(".gguf"):
    from qerl_jax.model.gguf_io import GGUFSource  # pylint: disable=import-outside-toplevel
    source = GGUFSource(local)
    meta = dict(source.metadata)
    if "model.embed_tokens.weight" in source:
      meta.setdefault(f"{source.arch}.vocab_size", source.shape("model.embed_tokens.weight")[0])
    config = ModelConfig.from_gguf_metadata(meta, tied="lm_head.weight" not in source, dtype=dtype, remat=remat)
    source.set_heads(config.num_heads, config.num_kv_heads)
    ct_scheme = None
  else:
    from qerl_jax.model.safetensors_io import SafetensorsDir  # pylint: disable=import-outside-toplevel
    with open(os.path.join(local, "config.json")) as f:
      hf = json.load(f)
    config = ModelConfig.from_hf(hf, dtype=dtype, remat=remat)
    ct_scheme = ct_scheme_of(hf)
    source = SafetensorsDir(local)
  base = load_base(source, config, quant, ct_scheme=ct_scheme, mesh=mesh)
  lora = None
  if lora_rank:
    lora = LoraConfig(rank=lora_rank, alpha=lora_alpha, targets=lora_targets, dtype=lora_dtype,
                      use_rslora=use_rslora)
  model = Transformer(config, base, lora=lora, train_norms=train_norms, rngs=nnx.Rngs(seed))
  tokenizer = _tokenizer(local) if load_tokenizer else None
  return model, tokenizer


def ct_scheme_of(hf_config: dict[str, Any]) -> str | None:
  """"nvfp4" / "mxfp4" for a compressed-tensors checkpoint config, None for an unquantized one."""
  qc = hf_config.get("quantization_config")
  if not qc:
    return None
  method = qc.get("quant_method")
  if method != "compressed-tensors":
    raise ValueError(f"unsupported quantization_config quant_method={method!r}; only compressed-tensors "
                     "NVFP4/MXFP4 checkpoints (or unquantized ones) can be loaded")
  formats = {qc.get("format")} | {g.get("format") for g in (qc.get("config_groups") or {}).values()}
  formats.discard(None)
  if len(formats) != 1 or next(iter(formats)) not in CT_FORMATS:
    raise ValueError(f"unsupported compressed-tensors format(s) {sorted(formats)}; supported: {sorted(CT_FORMATS)}")
  status = qc.get("quantization_status", "compressed")
  if status != "compressed":
    raise ValueError(f"compressed-tensors checkpoint has quantization_status={status!r}, expected 'compressed'")
  return CT_FORMATS[formats.pop()]


def _layer_name(layer: int, rest: str) -> str:
  return f"model.layers.{layer}.{rest}"


def plan_projections(source, config: ModelConfig, quant: str, ct_scheme: str | None):
  """Per projection: (mode, stored scheme). mode "ct" reads packed tensors, "float" reads .weight."""
  shapes = base_lib.proj_shapes(config)
  plan = {}
  for name in PROJ_NAMES:
    k, n = shapes[name]
    stem = _layer_name(0, PROJ_PATHS[name])
    if ct_scheme is not None and f"{stem}.weight_packed" in source:
      if quant not in (ct_scheme, "bf16"):
        raise ValueError(f"the checkpoint is {ct_scheme} (compressed-tensors); {quant=} would re-quantize it. "
                         f"Use quant={ct_scheme!r} (as stored) or 'bf16' (dequantized)")
      plan[name] = ("ct", None if quant == "bf16" else ct_scheme)
    else:
      plan[name] = ("float", None if ct_scheme is not None else base_lib.proj_scheme(quant, k, n))
  return plan


def expected_tensors(config: ModelConfig, plan, ct_scheme: str | None) -> dict[str, tuple[int, ...]]:
  """Every tensor name the model needs, with its on-disk (PyTorch layout) shape."""
  d, v = config.hidden_size, config.vocab_size
  out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
  if not config.tie_word_embeddings:
    out["lm_head.weight"] = (v, d)
  shapes = base_lib.proj_shapes(config)
  for layer in range(config.num_layers):
    out[_layer_name(layer, "input_layernorm.weight")] = (d,)
    out[_layer_name(layer, "post_attention_layernorm.weight")] = (d,)
    if config.qk_norm:
      out[_layer_name(layer, "self_attn.q_norm.weight")] = (config.head_dim,)
      out[_layer_name(layer, "self_attn.k_norm.weight")] = (config.head_dim,)
    for name in PROJ_NAMES:
      k, n = shapes[name]
      stem = _layer_name(layer, PROJ_PATHS[name])
      if plan[name][0] == "ct":
        block = 16 if ct_scheme == "nvfp4" else 32
        out[f"{stem}.weight_packed"] = (n, k // 2)
        out[f"{stem}.weight_scale"] = (n, k // block)
        if ct_scheme == "nvfp4":
          out[f"{stem}.weight_global_scale"] = (1,)
      else:
        out[f"{stem}.weight"] = (n, k)
      if base_lib.has_bias(config, name):
        out[f"{stem}.bias"] = (n,)
  return out


def check_tensors(source, expected: dict[str, tuple[int, ...]]) -> None:
  """Raises ValueError naming missing tensors or shape mismatches (before anything is loaded)."""
  missing = [name for name in expected if name not in source]
  if missing:
    more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
    raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {missing[:5]}{more}")
  for name, shape in expected.items():
    got = tuple(source.shape(name))
    if got != shape and not (shape == (1,) and got in ((), (1,))):
      raise ValueError(f"tensor {name!r} has shape {got}, expected {shape} from the config")
  if hasattr(source, "check_supported"):
    for name in expected:
      source.check_supported(name)


def load_base(source, config: ModelConfig, quant: str, *, ct_scheme: str | None = None,
              mesh=None) -> dict[str, Any]:
  """Streams `source` (SafetensorsDir or GGUFSource) into a preallocated base pytree (see base.py).

  With a `mesh` the base is allocated split by the partition rules and each layer is written into its
  shards, so the largest thing on one device is a device's share of the base plus one layer in flight.
  """
  from qerl_jax import quant as quant_lib  # pylint: disable=import-outside-toplevel
  plan = plan_projections(source, config, quant, ct_scheme)
  check_tensors(source, expected_tensors(config, plan, ct_scheme))
  dtype = config.dtype
  base = base_lib.empty_base(config, {name: scheme for name, (_, scheme) in plan.items()}, mesh=mesh)
  final = None
  if mesh is not None:
    from qerl_jax import sharding  # pylint: disable=import-outside-toplevel
    final = sharding.shardings_for(base, mesh, prefix="frozen")

  def to_device(host: np.ndarray, out_dtype, *path):  # host array -> its shards (or the default device)
    if final is None:
      on_device = jnp.asarray(host)
    else:
      where = final
      for key in path:
        where = where[key]
      on_device = jax.device_put(np.asarray(host), where)
    return on_device.astype(out_dtype)  # converted on the device(s), in place of a slow host cast

  layers = base["layers"]
  host_small: dict[str, np.ndarray] = {}  # norms and biases, [L, ...], sent to the device once at the end
  for layer in range(config.num_layers):
    idx = jnp.int32(layer)
    for group in base_lib.FUSED_GROUPS:
      floats = [name for name in group if plan[name][0] == "float"]
      if floats:
        names = [_layer_name(layer, f"{PROJ_PATHS[n]}.weight") for n in floats]
        out = base_lib.put_group([layers[n]["w"] for n in floats], layer, [source.get(nm) for nm in names],
                                 [plan[n][1] for n in floats], dtype, names)
        for name, w in zip(floats, out):
          layers[name]["w"] = w
      for name in group:
        if plan[name][0] == "ct":
          stem = _layer_name(layer, PROJ_PATHS[name])
          parts = {p: jnp.asarray(source.get(f"{stem}.{p}")) for p in _CT_PARTS[ct_scheme]}
          if "weight_global_scale" in parts:
            parts["weight_global_scale"] = parts["weight_global_scale"].reshape(1)
          q = quant_lib.from_ct_tensors(parts, ct_scheme)
          if plan[name][1] is None:
            q = quant_lib.dequantize(q, dtype)
          layers[name]["w"] = base_lib.put_layer(layers[name]["w"], idx, q)
    for name in ("input_layernorm", "post_attention_layernorm") + (("q_norm", "k_norm") if config.qk_norm else ()):
      rest = f"self_attn.{name}.weight" if name in ("q_norm", "k_norm") else f"{name}.weight"
      _host_put(host_small, name, layer, config.num_layers, source.get(_layer_name(layer, rest)))
    for name in PROJ_NAMES:
      if base_lib.has_bias(config, name):
        bias = source.get(_layer_name(layer, f"{PROJ_PATHS[name]}.bias"))
        _host_put(host_small, f"{name}.b", layer, config.num_layers, bias)
  for key, value in host_small.items():
    if key.endswith(".b"):
      layers[key[:-2]]["b"] = to_device(value, dtype, "layers", key[:-2], "b")
    else:
      layers[key] = to_device(value, np.float32, "layers", key)
  for key, out_dtype in (("embed_tokens", dtype), ("norm", np.float32)) + (
      () if config.tie_word_embeddings else (("lm_head", dtype),)):
    name = "lm_head.weight" if key == "lm_head" else f"model.{key}.weight"
    base[key] = to_device(source.get(name), out_dtype, key)
  return jax.block_until_ready(base)


def _host_put(store: dict[str, np.ndarray], key: str, layer: int, num_layers: int, value: np.ndarray) -> None:
  if key not in store:
    store[key] = np.zeros((num_layers,) + value.shape, np.float32)
  store[key][layer] = np.asarray(value, np.float32)


def _resolve(path: str) -> str:
  """A local directory or .gguf file for `path`, downloading a hub id when it is not a local path."""
  path = os.fspath(path)
  if os.path.isfile(path):
    if not path.endswith(".gguf"):
      raise ValueError(f"{path} is a file but not a .gguf; pass a model directory, a .gguf file or a hub id")
    return path
  if os.path.isdir(path):
    if not os.path.isfile(os.path.join(path, "config.json")):
      raise FileNotFoundError(f"{path} has no config.json (not a Hugging Face model directory)")
    return path
  if path.endswith(".gguf") or path.startswith((".", "/", "~")) or path.count("/") != 1:
    raise FileNotFoundError(f"{path} does not exist (and is not a hub id of the form owner/name)")
  from huggingface_hub import snapshot_download  # pylint: disable=import-outside-toplevel
  return snapshot_download(path, allow_patterns=_HUB_FILES)


def _tokenizer(local: str):
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  if local.endswith(".gguf"):
    from qerl_jax.model.tokenizer import load_gguf_tokenizer  # pylint: disable=import-outside-toplevel
    return load_gguf_tokenizer(local)
  names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
  if not any(os.path.isfile(os.path.join(local, n)) for n in names):
    return None
  return AutoTokenizer.from_pretrained(local)
