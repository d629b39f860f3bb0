"""Adapters and merged checkpoints out of (and PEFT adapters into) a `Transformer`.

- `save_peft_adapter(model, out_dir)`: adapter_model.safetensors + adapter_config.json in PEFT's naming
  (`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, K], `lora_B.weight` [N, r]), so
  `peft.PeftModel.from_pretrained(hf_model, out_dir)` and vLLM load it. Trainable block norms go in
  `modules_to_save`, as PEFT stores them.
- `load_peft_adapter(model, adapter_dir)`: the reverse, for any PEFT LoRA adapter on these projections.
- `save_merged(model, out_dir, scheme="bf16"|"nvfp4")`: W + scale * A @ B folded into the base, written as
  a plain HF checkpoint or as compressed-tensors NVFP4 (fused q/k/v and gate/up share global scales),
  layer by layer so only one layer's merged weights are in host memory at a time.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax.model import base as base_lib
from qerl_jax.model.linear import PROJ_NAMES, PROJ_PATHS, LoraConfig
from qerl_jax.model.safetensors_io import SafetensorsDir, save_shards
from qerl_jax.model.transformer import TRAINABLE_NORMS, Transformer
from qerl_jax.quant import types as qtypes

_PREFIX = "base_model.model."
_LORA_RX = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                      r"(?:\.default)?\.weight")
_NORM_RX = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)"
                      r"(?:\.modules_to_save\.default)?\.weight")
_ADAPTER_FILE = "adapter_model.safetensors"


def _np(x: jax.Array) -> np.ndarray:
  return np.asarray(jax.device_get(x))


def save_peft_adapter(model: Transformer, out_dir: str, *, base_model_name_or_path: str | None = None) -> None:
  """Writes the model's LoRA adapter (and trainable norms) as a PEFT LoRA adapter directory."""
  if model.lora is None:
    raise ValueError("the model has no LoRA adapter to save (built with lora_rank=None?)")
  lora = model.lora
  tensors: dict[str, np.ndarray] = {}
  for name in lora.targets:
    proj = getattr(model.layers, name)
    a_LxKxR, b_LxRxN = _np(proj.lora_a.get_value()), _np(proj.lora_b.get_value())
    stem = f"{_PREFIX}model.layers.{{}}.{PROJ_PATHS[name]}"
    for layer in range(model.config.num_layers):
      tensors[f"{stem.format(layer)}.lora_A.weight"] = np.ascontiguousarray(a_LxKxR[layer].T)
      tensors[f"{stem.format(layer)}.lora_B.weight"] = np.ascontiguousarray(b_LxRxN[layer].T)
  modules_to_save = None
  if model.train_norms:
    modules_to_save = list(TRAINABLE_NORMS)
    for norm in TRAINABLE_NORMS:
      values = _np(getattr(model.layers, norm).get_value())
      for layer in range(model.config.num_layers):
        tensors[f"{_PREFIX}model.layers.{layer}.{norm}.weight"] = values[layer].astype(np.float32)
  cfg = {
    "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
    "target_modules": list(lora.targets), "lora_dropout": 0.0, "bias": "none", "use_rslora": lora.use_rslora,
    "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
    "modules_to_save": modules_to_save, "base_model_name_or_path": base_model_name_or_path,
    "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
  }
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  os.makedirs(out_dir, exist_ok=True)
  save_file(tensors, os.path.join(out_dir, _ADAPTER_FILE), metadata={"format": "pt"})
  with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
    json.dump(cfg, f, indent=2)


def load_peft_adapter(model: Transformer, adapter_dir: str) -> Transformer:
  """Replaces the model's adapter with a PEFT LoRA adapter (in place; also returns the model).

  Supports plain LoRA (and rsLoRA) on q/k/v/o/gate/up/down of every layer, plus block norms saved in
  `modules_to_save`. Anything else (DoRA, per-layer ranks, LoRA on other modules, biases) is an error.
  The adapter keeps the model's LoRA dtype (float32 when it had none).
  """
  with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
    cfg = json.load(f)
  if cfg.get("peft_type") != "LORA":
    raise ValueError(f"{adapter_dir}: peft_type={cfg.get('peft_type')!r}, only 'LORA' is supported")
  unsupported = {"use_dora": bool(cfg.get("use_dora")), "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")),
                 "bias": cfg.get("bias", "none") != "none",
                 "layers_to_transform": cfg.get("layers_to_transform") is not None}
  for key, bad in unsupported.items():
    if bad:
      raise ValueError(f"{adapter_dir}: unsupported adapter setting {key}={cfg.get(key)!r}")
  for key in ("rank_pattern", "alpha_pattern"):
    if cfg.get(key):
      raise ValueError(f"{adapter_dir}: per-module {key} is not supported: {cfg[key]}")
  path = os.path.join(adapter_dir, _ADAPTER_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found (only safetensors adapters are supported)")
  source = SafetensorsDir.from_file(path)
  num_layers, rank = model.config.num_layers, int(cfg["r"])
  found: dict[str, dict[int, dict[str, str]]] = {}
  norms: dict[str, dict[int, str]] = {}
  for key in source.keys():
    if m := _LORA_RX.fullmatch(key):
      layer, _, name, ab = m.groups()
      if name not in PROJ_NAMES or PROJ_PATHS[name] != f"{m.group(2)}.{name}":
        raise ValueError(f"{adapter_dir}: LoRA on unsupported module in {key!r}")
      found.setdefault(name, {}).setdefault(int(layer), {})[ab] = key
    elif m := _NORM_RX.fullmatch(key):
      norms.setdefault(m.group(2), {})[int(m.group(1))] = key
    else:
      raise ValueError(f"{adapter_dir}: unsupported adapter tensor {key!r}")
  if not found:
    raise ValueError(f"{adapter_dir}: no LoRA tensors found")
  dtype = model.lora.dtype if model.lora is not None else jnp.dtype(jnp.float32)
  shapes = base_lib.proj_shapes(model.config)
  adapters = {}
  for name, per_layer in found.items():
    k, n = shapes[name]
    a_list, b_list = [], []
    for layer in range(num_layers):
      keys = per_layer.get(layer, {})
      for ab in "AB":
        if ab not in keys:
          raise ValueError(f"{adapter_dir}: missing tensor for layer {layer} {PROJ_PATHS[name]} lora_{ab}")
      a, b = source.get(keys["A"]), source.get(keys["B"])
      if a.shape != (rank, k) or b.shape != (n, rank):
        raise ValueError(f"{adapter_dir}: layer {layer} {name} has lora_A {a.shape} / lora_B {b.shape}, "
                         f"expected {(rank, k)} / {(n, rank)}")
      a_list.append(a.astype(np.float32).T)
      b_list.append(b.astype(np.float32).T)
    adapters[name] = (jnp.asarray(np.stack(a_list), dtype), jnp.asarray(np.stack(b_list), dtype))
  lora = LoraConfig(rank=rank, alpha=float(cfg["lora_alpha"]), targets=tuple(adapters), dtype=dtype,
                    use_rslora=bool(cfg.get("use_rslora", False)))
  model.set_lora(lora, adapters=adapters)
  for norm, per_layer in norms.items():
    if sorted(per_layer) != list(range(num_layers)):
      raise ValueError(f"{adapter_dir}: {norm} is saved for layers {sorted(per_layer)}, not all {num_layers}")
    values = np.stack([source.get(per_layer[layer]).astype(np.float32) for layer in range(num_layers)])
    var = getattr(model.layers, norm)
    if values.shape != tuple(var.get_value().shape):
      raise ValueError(f"{adapter_dir}: {norm} has shape {values.shape}, expected {var.get_value().shape}")
    var.set_value(jnp.asarray(values))
  return model


def merged_weight(model: Transformer, name: str, layer: int) -> jax.Array:
  """float32 [K, N]: the layer's base weight (dequantized) plus its LoRA update."""
  proj = getattr(model.layers, name)
  w = jax.tree.map(lambda x: x[layer], proj.weight.get_value())
  if qtypes.is_quantized(w):
    from qerl_jax import quant  # pylint: disable=import-outside-toplevel
    w = quant.dequantize(w, jnp.float32)
  w = w.astype(jnp.float32)
  if proj.lora_a is not None:
    a = proj.lora_a.get_value()[layer].astype(jnp.float32)
    b = proj.lora_b.get_value()[layer].astype(jnp.float32)
    w = w + model.lora_scale * jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
  return w


def save_merged(model: Transformer, out_dir: str, scheme: str = "bf16", *, dtype: Any = None, tokenizer=None,
                max_shard_bytes: int = 4 << 30) -> None:
  """Writes the model with its adapter merged: an HF checkpoint (scheme "bf16": in `dtype`, default the
  model's dtype) or a compressed-tensors NVFP4 one ("nvfp4": decoder linears quantized from the merged
  weights rounded to bf16, as llm-compressor would see them; lm_head, embeddings and norms stay bf16)."""
  if scheme not in ("bf16", "nvfp4"):
    raise ValueError(f"unknown {scheme=}; expected 'bf16' or 'nvfp4'")
  config = model.config
  dtype = jnp.dtype(dtype or (jnp.bfloat16 if scheme == "nvfp4" else config.dtype))
  ignore: list[str] = ["lm_head"]
  os.makedirs(out_dir, exist_ok=True)
  save_shards(_merged_tensors(model, scheme, dtype, ignore), out_dir, max_shard_bytes=max_shard_bytes)
  hf = config.to_hf_dict()
  hf.pop("quantization_config", None)
  hf["dtype"] = hf["torch_dtype"] = str(np.dtype(dtype).name)
  if scheme == "nvfp4":
    hf["quantization_config"] = _ct_quantization_config(ignore)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  if tokenizer is not None:
    tokenizer.save_pretrained(out_dir)


def _merged_tensors(model: Transformer, scheme: str, dtype, ignore: list[str]) -> Iterator[tuple[str, np.ndarray]]:
  config = model.config
  yield "model.embed_tokens.weight", _np(model.embed_tokens.get_value().astype(dtype))
  shapes = base_lib.proj_shapes(config)
  for layer in range(config.num_layers):
    prefix = f"model.layers.{layer}."
    for norm in ("input_layernorm", "post_attention_layernorm"):
      yield f"{prefix}{norm}.weight", _np(getattr(model.layers, norm).get_value()[layer].astype(dtype))
    if config.qk_norm:
      for norm in ("q_norm", "k_norm"):
        yield f"{prefix}self_attn.{norm}.weight", _np(getattr(model.layers, norm).get_value()[layer].astype(dtype))
    for group in base_lib.FUSED_GROUPS:
      ws_NxK = [merged_weight(model, name, layer).T.astype(dtype) for name in group]
      schemes = [None if scheme == "bf16" else base_lib.proj_scheme("nvfp4", *shapes[name]) for name in group]
      names = [f"{prefix}{PROJ_PATHS[name]}" for name in group]
      converted = base_lib.quantize_members(ws_NxK, schemes, dtype, names)
      for name, stem, s, q in zip(group, names, schemes, converted):
        if s is None:
          if scheme != "bf16":
            ignore.append(stem)
          yield f"{stem}.weight", _np(q.T)
        else:
          from qerl_jax import quant  # pylint: disable=import-outside-toplevel
          for part, value in quant.to_ct_tensors(q).items():
            yield f"{stem}.{part}", value
        bias = getattr(model.layers, name).bias
        if bias is not None:
          yield f"{stem}.bias", _np(bias.get_value()[layer].astype(dtype))
  yield "model.norm.weight", _np(model.norm.get_value().astype(dtype))
  if model.lm_head is not None:
    yield "lm_head.weight", _np(model.lm_head.get_value().astype(dtype))


def _ct_quantization_config(ignore: list[str]) -> dict[str, Any]:
  """compressed-tensors NVFP4A16 quantization_config (from qerl_jax.quant.checkpoint when present)."""
  try:
    from qerl_jax.quant.checkpoint import quantization_config  # pylint: disable=import-outside-toplevel
  except ImportError:
    quantization_config = None
  if quantization_config is not None:
    return quantization_config("nvfp4", ignore)
  # Fallback until the quant package's writer lands: the NVFP4A16 block of shared/docs/NVFP4.md.
  weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
             "dynamic": False, "observer": "minmax"}
  return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
          "quantization_status": "compressed", "ignore": list(ignore), "kv_cache_scheme": None,
          "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                        "weights": weights, "input_activations": None,
                                        "output_activations": None}}}
