"""The frozen base as a plain pytree: layout, preallocation, quantization of fused groups, random init.

A base is {"embed_tokens": [V, D], "norm": f32[D], "lm_head": [V, D] (untied only), "layers": {...}} where
"layers" holds every per-layer parameter stacked on a leading L axis:
  input_layernorm, post_attention_layernorm: f32[L, D]; q_norm, k_norm: f32[L, Dh] (Qwen3);
  q_proj ... down_proj: {"w": [L, K, N] array or quantized tensor with L-stacked arrays, "b": [L, N]}.
Norm scales are kept in float32 (they are tiny, may be trained, and receive AQN noise in float32).

Loaders preallocate this structure (`empty_base`) in its final device layout and write one layer at a
time into it with `put_layer`, whose buffer argument is donated so the update happens in place: the
full-precision model never exists anywhere, only the tensors of the layer being converted.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qerl_jax.model.config import ModelConfig
from qerl_jax.model.linear import PROJ_NAMES
from qerl_jax.quant import types as qtypes

QUANT_SCHEMES = ("bf16", "nvfp4", "mxfp4", "nf4")
# Projections that inference engines fuse, so NVFP4 gives them one shared global scale.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
_BLOCK = {"nvfp4": qtypes.NVFP4_BLOCK, "mxfp4": qtypes.MXFP4_BLOCK}


def proj_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
  """Logical [K, N] of each projection (y = x @ W)."""
  d, f = config.hidden_size, config.intermediate_size
  return {"q_proj": (d, config.q_size), "k_proj": (d, config.kv_size), "v_proj": (d, config.kv_size),
          "o_proj": (config.q_size, d), "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}


def has_bias(config: ModelConfig, name: str) -> bool:
  if name in ("q_proj", "k_proj", "v_proj"):
    return config.qkv_bias
  if name == "o_proj":
    return config.o_bias
  return config.mlp_bias


def check_quant(quant: str) -> None:
  if quant not in QUANT_SCHEMES:
    raise ValueError(f"unknown {quant=}; expected one of {QUANT_SCHEMES}")


def proj_scheme(quant: str, k: int, n: int) -> str | None:
  """The scheme a [K, N] projection gets under `quant`, or None where it stays unquantized.

  A layer whose K is not a multiple of the scheme's block cannot be represented (NVFP4.md) and stays in
  the model dtype, as llm-compressor leaves it (listed in `ignore`).
  """
  check_quant(quant)
  if quant == "bf16":
    return None
  if quant == "nf4":
    return "nf4" if (n * k) % qtypes.NF4_BLOCK == 0 else None
  return quant if k % _BLOCK[quant] == 0 else None


def quantize_group(ws_NxK: list[jax.Array], scheme: str | None, dtype,
                   names: list[str] | None = None) -> list[Any]:
  """Converts one fused group's weights, given in the file layout [N, K], to the model's [K, N] form.

  scheme None keeps them as `dtype` arrays [K, N]; NVFP4 members share the minimum global scale.
  """
  names = names or [None] * len(ws_NxK)
  if scheme is None:
    return [jnp.asarray(w).T.astype(dtype) for w in ws_NxK]
  from qerl_jax import quant  # pylint: disable=import-outside-toplevel
  gs = quant.shared_global_scale(ws_NxK) if scheme == "nvfp4" and len(ws_NxK) > 1 else None
  return [quant.quantize_NxK(w, scheme, global_scale=gs, name=name) for w, name in zip(ws_NxK, names)]


def quantize_members(ws_NxK: list[jax.Array], schemes: list[str | None], dtype,
                     names: list[str] | None = None) -> list[Any]:
  """`quantize_group` when all members share a scheme, else member by member (no shared scale)."""
  names = names or [None] * len(ws_NxK)
  if len(set(schemes)) == 1:
    return quantize_group(ws_NxK, schemes[0], dtype, names)
  return [quantize_group([w], s, dtype, [n])[0] for w, s, n in zip(ws_NxK, schemes, names)]


def abstract_weight(k: int, n: int, scheme: str | None, dtype) -> Any:
  """ShapeDtypeStruct pytree of one layer's [K, N] weight under `scheme`."""
  spec = jax.ShapeDtypeStruct((k, n), dtype)
  if scheme is None:
    return spec
  from qerl_jax import quant  # pylint: disable=import-outside-toplevel
  return jax.eval_shape(functools.partial(quant.quantize, scheme=scheme), spec)


def _stacked_abstract(abstract: Any, num_layers: int) -> Any:
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct((num_layers,) + tuple(s.shape), s.dtype), abstract)


def empty_base(config: ModelConfig, schemes: dict[str, str | None], *, dtype=None, mesh=None) -> dict[str, Any]:
  """A zero-filled base in its final layout; `schemes` maps each projection to its scheme or None.

  `dtype` is the dtype of unquantized weights and embeddings (default config.dtype). With a `mesh`, every
  array is born split by the partition rules (`qerl_jax.sharding`, paths under "frozen"), so no device
  ever holds the whole base; `put_layer` / `put_group` then write into the shards in place.
  """
  dtype = jnp.dtype(dtype or config.dtype)
  num_layers = config.num_layers
  f32 = jnp.float32
  layers: dict[str, Any] = {
    "input_layernorm": jax.ShapeDtypeStruct((num_layers, config.hidden_size), f32),
    "post_attention_layernorm": jax.ShapeDtypeStruct((num_layers, config.hidden_size), f32),
  }
  if config.qk_norm:
    layers["q_norm"] = jax.ShapeDtypeStruct((num_layers, config.head_dim), f32)
    layers["k_norm"] = jax.ShapeDtypeStruct((num_layers, config.head_dim), f32)
  for name, (k, n) in proj_shapes(config).items():
    p = {"w": _stacked_abstract(abstract_weight(k, n, schemes[name], dtype), num_layers)}
    if has_bias(config, name):
      p["b"] = jax.ShapeDtypeStruct((num_layers, n), dtype)
    layers[name] = p
  vd = (config.vocab_size, config.hidden_size)
  abstract = {"embed_tokens": jax.ShapeDtypeStruct(vd, dtype), "norm": jax.ShapeDtypeStruct(vd[1:], f32),
              "layers": layers}
  if not config.tie_word_embeddings:
    abstract["lm_head"] = jax.ShapeDtypeStruct(vd, dtype)
  leaves, treedef = jax.tree.flatten(abstract)
  specs = tuple((tuple(s.shape), jnp.dtype(s.dtype).name) for s in leaves)
  if mesh is None:
    return jax.tree.unflatten(treedef, _zeros(specs))
  from qerl_jax import sharding  # pylint: disable=import-outside-toplevel
  out = jax.tree.leaves(sharding.shardings_for(abstract, mesh, prefix="frozen"))
  return jax.tree.unflatten(treedef, jax.jit(functools.partial(_zeros_impl, specs), out_shardings=out)())


def _zeros_impl(specs: tuple[tuple[tuple[int, ...], str], ...]) -> list[jax.Array]:
  return [jnp.zeros(shape, dtype) for shape, dtype in specs]


# One cached program allocates the whole base: an eager jnp.zeros per array would compile once per shape,
# and a fresh lambda per call would recompile (and hold compiler memory) on every load. (A sharded base
# compiles its own once per load.)
_zeros = jax.jit(_zeros_impl, static_argnums=0)


@functools.partial(jax.jit, donate_argnums=0)
def put_layer(stacked: Any, layer: jax.Array, value: Any) -> Any:
  """Writes one layer's pytree `value` into the L-stacked `stacked` at index `layer`, in place (donated)."""
  return jax.tree.map(
    lambda s, v: jax.lax.dynamic_update_index_in_dim(s, jnp.asarray(v).astype(s.dtype), layer, 0),
    stacked, value)


@functools.partial(jax.jit, static_argnames=("schemes", "dtype"), donate_argnums=0)
def _put_group(stacked: tuple[Any, ...], layer: jax.Array, ws_NxK: tuple[jax.Array, ...], *,
               schemes: tuple[str | None, ...], dtype) -> tuple[tuple[Any, ...], jax.Array]:
  qs = quantize_members(list(ws_NxK), list(schemes), dtype)
  finite = jnp.stack([jnp.all(jnp.isfinite(w)) for w in ws_NxK])
  return tuple(put_layer(s, layer, q) for s, q in zip(stacked, qs)), finite


def put_group(stacked: tuple[Any, ...], layer: int, ws_NxK: list[Any], schemes: list[str | None], dtype,
              names: list[str]) -> tuple[Any, ...]:
  """Converts one fused group of layer `layer` (file layout [N, K]) and writes it into the stacked
  buffers in place: one compiled program per group shape. Waits for the result, so at most one group's
  source tensors are alive, and raises ValueError naming any weight with NaN/Inf that was to be quantized.
  """
  out, finite = _put_group(tuple(stacked), jnp.int32(layer), tuple(ws_NxK), schemes=tuple(schemes),
                           dtype=jnp.dtype(dtype))
  for ok, name, scheme in zip(np.asarray(finite), names, schemes):
    if scheme is not None and not ok:
      raise ValueError(f"tensor {name} contains NaN or Inf; refusing to quantize it")
  return out


def schemes_for(config: ModelConfig, quant: str) -> dict[str, str | None]:
  return {name: proj_scheme(quant, k, n) for name, (k, n) in proj_shapes(config).items()}


def random_base(config: ModelConfig, key: jax.Array, quant: str = "bf16", *, std: float = 0.02,
                dtype=None) -> dict[str, Any]:
  """A random base (normal weights of `std`, embedding std 1, norm scales near 1, small biases), quantized
  per `quant`. For tests and synthetic benchmarks; layers are drawn and quantized one at a time like a
  loader does. Draws come from a NumPy generator seeded by `key` (typed or legacy uint32 key): on CPU
  each eager jax.random call of a new shape costs a compile, which dominated small tests.
  """
  dtype = jnp.dtype(dtype or config.dtype)
  data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
  rng = np.random.default_rng(np.asarray(data, np.uint32).ravel().tolist())
  schemes = schemes_for(config, quant)
  base = empty_base(config, schemes, dtype=dtype)
  shapes = proj_shapes(config)
  layers = base["layers"]

  def normal(shape, scale, out_dtype):
    return jnp.asarray((scale * rng.standard_normal(shape, np.float32)).astype(out_dtype))

  for name in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm"):
    if name in layers:
      layers[name] = 1.0 + normal(layers[name].shape, 0.1, np.float32)
  for layer in range(config.num_layers):
    for group in FUSED_GROUPS:
      ws = [normal(shapes[name][::-1], std, dtype) for name in group]
      out = put_group([layers[name]["w"] for name in group], layer, ws, [schemes[name] for name in group],
                      dtype, list(group))
      for name, w in zip(group, out):
        layers[name]["w"] = w
  for name in PROJ_NAMES:
    if "b" in layers[name]:
      layers[name]["b"] = normal(layers[name]["b"].shape, 0.1, dtype)
  vd = (config.vocab_size, config.hidden_size)
  base["embed_tokens"] = normal(vd, 1.0, dtype)
  base["norm"] = 1.0 + normal((config.hidden_size,), 0.1, np.float32)
  if "lm_head" in base:
    base["lm_head"] = normal(vd, std, dtype)
  return base
