"""Views of the model's parameters that a rollout makes once, before its decode loop (the 4-bit base stays in
place unless `with_dequantized_base` is asked for). `qerl_jax.rollout.engine.rollout_params` applies them in this
order, as the config says: `with_norm_noise` adds AQN's noise to the RMSNorm scales, `with_adapter_dtype` casts the
adapters, `unstack_layers` gives each layer its own buffers (NVFP4 weights stay whole, read in place as `LayerOf`),
`with_dequantized_base` makes a 16-bit copy of the 4-bit base (ModelConfig.rollout_base_dtype) and
`with_merged_launches` groups the projections that read one input into one kernel launch. `transformer.forward`
runs on any of them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax.model.config import ModelConfig
from qerl_jax.model.linear import LayerOf, shared_lora_a
from qerl_jax.model.transformer import SHARED_INPUT, check_noise, layer_count, read_in_place, with_whole
from qerl_jax.quant import api as quant_api
from qerl_jax.quant.types import is_quantized


def unstack_layers(params: dict[str, Any]) -> dict[str, Any]:
  """`params` with "layers" as a list of per-layer dicts, for a forward that slices nothing per call.

  Every stacked leaf is sliced here, once (a copy of the 16-bit weights, adapters, norms and biases), except
  the NVFP4 weights, which stay whole as `LayerOf(stack, l)` because the fused kernels read a layer in place.
  Each layer also gets "shared_lora_a": the concatenated A's of the projections that share an input
  (`SHARED_INPUT`, `linears`). The rollout does this before its decode loop, so a decode step runs on its own
  per-layer buffers.
  """
  sliced, whole = read_in_place(params["layers"])
  num_layers = layer_count(sliced if jax.tree.leaves(sliced) else whole)
  per_layer = [_with_shared_a(with_whole(jax.tree.map(lambda a, layer=layer: a[layer], sliced), whole, layer))
               for layer in range(num_layers)]
  return {**params, "layers": per_layer}


def with_norm_noise(params: dict[str, Any], config: ModelConfig,
                    norm_noise: dict[str, jax.Array] | None) -> dict[str, Any]:
  """`params` with each noised RMSNorm scale replaced by scale + noise in float32 (`forward`'s norm_noise, added
  once, as `attention.rms_norm` adds it: the same float32 values), so a forward over them takes no noise.

  The rollout does this once before its decode loop: every norm launch, and a gemv that reads a pending norm
  (ModelConfig.decode_norm_fold), then loads one float32 scale per column instead of a scale and its noise.
  Stacked layers ([L, D] scales) and per-layer ones (`unstack_layers`) alike.
  """
  noise = check_noise(config, norm_noise)
  if not noise:
    return params
  layers = params["layers"]

  def noised(scale, value):
    return scale.astype(jnp.float32) + value

  if isinstance(layers, dict):
    layers = {**layers, **{name: noised(layers[name], value) for name, value in noise.items()}}
  else:
    layers = [{**p, **{name: noised(p[name], value[index]) for name, value in noise.items()}}
              for index, p in enumerate(layers)]
  return {**params, "layers": layers}


def with_adapter_dtype(params: dict[str, Any], dtype) -> dict[str, Any]:
  """`params` with every layer's LoRA A and B cast to `dtype` (the rest untouched)."""
  def cast(p):
    if not isinstance(p, dict) or p.get("lora_a") is None:
      return p
    return {**p, "lora_a": p["lora_a"].astype(dtype), "lora_b": p["lora_b"].astype(dtype)}
  return {**params, "layers": {name: cast(p) for name, p in params["layers"].items()}}


def with_dequantized_base(params: dict[str, Any], dtype) -> dict[str, Any]:
  """`params` with every quantized base weight of the layers as a plain array in `dtype` (the rest untouched).

  Stacked layers (a dict of [L, ...] leaves) get [L, K, N] arrays; per-layer ones (`unstack_layers`, where an
  NVFP4 weight is `LayerOf(stack, l)`) get layer l's [K, N] alone, so no stacked copy is made on the way.
  The values are `quant.dequantize`'s, the XLA path's (ModelConfig.rollout_base_dtype).
  """
  to_dense = lambda q: quant_api.dequantize(q, dtype)  # noqa: E731

  def dense(p, stacked: bool):
    w = p.get("w") if isinstance(p, dict) else None
    if isinstance(w, LayerOf):  # layer l of the stack alone
      return {**p, "w": to_dense(jax.tree.map(lambda a: a[w.layer], w.stacked))}
    if not is_quantized(w):
      return p
    return {**p, "w": quant_api.dequantize_stacked(w, dtype) if stacked else to_dense(w)}

  layers = params["layers"]
  if isinstance(layers, dict):
    return {**params, "layers": {name: dense(p, True) for name, p in layers.items()}}
  return {**params, "layers": [{name: dense(p, False) for name, p in layer.items()} for layer in layers]}


def with_merged_launches(params: dict[str, Any], groups: tuple[str, ...]) -> dict[str, Any]:
  """Per-layer `params` (`unstack_layers`) with p["merged"][group] for each of ``groups`` whose projections are
  all NVFP4 (`linear.merged_linears`, ModelConfig.merged_launch_groups).

  The group's weights are not copied: each layer gets `LayerOf(qerl_kernels.Nvfp4Group(the members' stacks),
  layer)`, which one kernel launch reads member by member in place, each with its own global scale; its biases
  concatenated, and its adapters' A's concatenated and B's block-diagonal (both padded with zeros to a
  power-of-two rank), small next to the weights.
  """
  from qerl_kernels import Nvfp4Group  # pylint: disable=import-outside-toplevel
  layers = params["layers"]
  if not isinstance(layers, (list, tuple)):
    raise ValueError("with_merged_launches takes per-layer params (unstack_layers)")
  stacks = {}
  for group in groups:
    ws = [layers[0][name]["w"] for name in SHARED_INPUT[group]]
    if all(isinstance(w, LayerOf) for w in ws):  # NVFP4 read in place (a dense rollout_base_dtype copy: left)
      stacks[group] = Nvfp4Group(tuple(w.stacked for w in ws))
  out = []
  for index, p in enumerate(layers):
    merged = {group: _merged_group([p[name] for name in SHARED_INPUT[group]], group_w, index)
              for group, group_w in stacks.items()}
    out.append({**p, "merged": merged})
  return {**params, "layers": out}


def _merged_group(ps: list[dict[str, Any]], group_w, layer: int) -> dict[str, Any]:
  """One layer's group weight (`LayerOf` the group of stacks), bias, A's and block-diagonal B's for
  `linear.merged_linears`."""
  widths = [p["w"].stacked.shape[1] for p in ps]
  biases = [p.get("b") for p in ps]
  out = {"w": LayerOf(group_w, layer), "b": None, "lora_a": None, "lora_b": None}
  present = [b for b in biases if b is not None]
  if present:
    out["b"] = jnp.concatenate([b if b is not None else jnp.zeros((n,), present[0].dtype)
                                for b, n in zip(biases, widths)])
  with_lora = [(i, p) for i, p in enumerate(ps) if p.get("lora_a") is not None]
  if with_lora:
    # Zero columns up to a power of two: the gemv computes x @ A in its launch only for such ranks (q|k|v at
    # rank 16 is 48 -> 64); the extra columns of x @ A are zeros that meet zero rows of B.
    rank = sum(p["lora_a"].shape[-1] for _, p in with_lora)
    padded = 1 << (rank - 1).bit_length()
    a = jnp.concatenate([p["lora_a"] for _, p in with_lora], axis=-1)
    out["lora_a"] = jnp.pad(a, ((0, 0), (0, padded - rank)))
    starts = np.concatenate([[0], np.cumsum(widths)])
    b_RxN = jnp.zeros((padded, sum(widths)), with_lora[0][1]["lora_b"].dtype)
    row = 0
    for i, p in with_lora:
      r = p["lora_b"].shape[0]
      b_RxN = b_RxN.at[row:row + r, starts[i]:starts[i + 1]].set(p["lora_b"])
      row += r
    out["lora_b"] = b_RxN
  return out


def _with_shared_a(p: dict[str, Any]) -> dict[str, Any]:
  """One layer's parameters with "shared_lora_a": {group: [A1 | A2 | ...]} for each `SHARED_INPUT` group."""
  shared = {group: shared_lora_a([p[name] for name in names]) for group, names in SHARED_INPUT.items()
            if all(name in p for name in names)}
  return {**p, "shared_lora_a": {group: a for group, a in shared.items() if a is not None}}
