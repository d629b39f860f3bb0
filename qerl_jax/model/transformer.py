"""The decoder: an NNX module over stacked layer parameters, run as a `lax.scan` of one pure layer function.

Forward (rollouts and training):

    model(tokens_BxT, positions_BxT=None, *, cache=None, cache_index=None, valid_BxS=None,
          norm_noise=None, return_hidden=False)

  - no cache: causal attention over the T tokens (and valid_BxS[b, s] with S = T when given, for padded
    rows); returns logits_BxTxV (float32) or, with return_hidden, the final-normed h_BxTxD.
  - cache (from `init_cache`, k/v [L, B, S, Hkv, Dh]): the T new tokens are written at slots
    [cache_index, cache_index + T) of every row; query t (slot cache_index + t) sees slot s iff
    s <= cache_index + t and valid_BxS[b, s] (valid_BxS must be True on the new tokens' slots). Returns
    (logits_or_hidden, new_cache).
  - positions_BxT: RoPE positions per row (default: slot indices), so left-padded rows start at 0.
  - norm_noise (AQN): {"input_layernorm": f32[L, D], "post_attention_layernorm": f32[L, D],
    "q_norm": f32[L, Dh], "k_norm": f32[L, Dh]}, any subset; added to those RMSNorm scales in float32 for
    this call only.
  - `model.lm_head_logits(h_...xD)` (or the pure `lm_head_logits(h, w_VxD)`) maps hidden states to float32
    logits, so a trainer can work in vocabulary chunks on `model.lm_head_weight()` ([V, D], HF layout).

Trainable vs frozen: LoRA A/B are `nnx.LoRAParam`, trainable norm scales `nnx.Param`, everything else
`Frozen`. `split_params(model) -> (graphdef, trainable, frozen)`; `nnx.merge(graphdef, trainable, frozen)`
rebuilds the model inside a jitted step that differentiates only `trainable`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qerl_jax.model import attention as attn, linear as linear_lib
from qerl_jax.model.config import ModelConfig
from qerl_jax.model.linear import (PROJ_NAMES, Frozen, LayerOf, LoraConfig, Projection, init_loras, linear, linears,
                                   logical_shape)
from qerl_jax.quant.types import NVFP4Tensor

# Projections that read the same input; their adapters' x @ A run as one matmul (`linears`).
SHARED_INPUT = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}
NOISE_KEYS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")
# RMSNorm scales that `train_norms=True` makes trainable: the block norms, as the QeRL authors train.
TRAINABLE_NORMS = ("input_layernorm", "post_attention_layernorm")


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None, *, per_layer: bool = False):
  """An empty KV cache: {"k", "v"} of [L, B, max_len, Hkv, Dh] in `dtype` (default config.dtype).

  per_layer: lists of L arrays [B, max_len, Hkv, Dh] instead, for a forward over `param_views.unstack_layers` params
  (each layer then attends and writes its own buffer, with no slice of a stacked one).
  """
  dtype = jnp.dtype(dtype or config.dtype)
  layer_shape = (batch, max_len, config.num_kv_heads, config.head_dim)
  if per_layer:
    return {name: [jnp.zeros(layer_shape, dtype) for _ in range(config.num_layers)] for name in ("k", "v")}
  return {name: jnp.zeros((config.num_layers, *layer_shape), dtype) for name in ("k", "v")}


def lm_head_logits(h_xD: jax.Array, w_VxD: jax.Array) -> jax.Array:
  """float32 logits [..., V] of final-normed hidden states against an output matrix [V, D]."""
  return jnp.einsum("...d,vd->...v", h_xD, w_VxD.astype(h_xD.dtype), preferred_element_type=jnp.float32)


def _layer(config: ModelConfig, lora_scale: float, x_BxTxD, h_BxTxD, p, noise, next_norm, cos, sin, mask_BxTxS, kv,
           layer, cache_index, fold_norm: bool = False):
  """One decoder block: (x, h_next, kv). h_BxTxD: x under this block's input_layernorm. next_norm: (scale,
  AQN noise or None) of the norm after the block (the next block's input_layernorm, or the final norm), so
  h_next is the next block's input: at a decode step the kernel that ends the block applies it
  (`_residual_norm`). kv: None (no cache), the stacked (k, v) caches [L, B, S, Hkv, Dh] to update at
  `layer`, or this layer's own (k, v) [B, S, Hkv, Dh]. fold_norm (ModelConfig.decode_norm_fold): the block's
  norms may stay pending (`qerl_kernels.decode_residual_norm.PendingNorm`) for the gemv that reads them, so
  h_BxTxD and h_next may be pending norms rather than arrays (`_materialized` makes them arrays)."""
  b, t, _ = x_BxTxD.shape
  fused = config.fused_lora and b * t <= config.fused_lora_max_rows  # static: decode calls only
  gemv_xa = config.gemv_lora_xa
  decode = kv is not None
  shared_a = p.get("shared_lora_a", {})  # made once per rollout by `param_views.unstack_layers`, else in `linears`
  merged = p.get("merged", {})  # made once per rollout by `param_views.with_merged_launches`
  on_gpu = jax.default_backend() == "gpu"
  pallas_attention = decode and t == 1 and (config.decode_attention == "pallas"
                                            or config.decode_attention == "auto" and on_gpu)
  rows = (_decode_qkv_rows(config, lora_scale, h_BxTxD, p, merged.get("qkv"), cos, sin, kv[0].dtype, gemv_xa)
          if pallas_attention else None)
  if rows is None:
    h_BxTxD = _materialized(h_BxTxD)
    q, k, v = linears(h_BxTxD, [p["q_proj"], p["k_proj"], p["v_proj"]], lora_scale, fused, gemv_xa,
                      shared_a.get("qkv"), merged.get("qkv"))
    q = q.reshape(b, t, config.num_heads, config.head_dim)
    k, v = (y.reshape(b, t, config.num_kv_heads, config.head_dim) for y in (k, v))
    if config.qk_norm:
      q = attn.rms_norm(q, p["q_norm"], config.rms_norm_eps, noise.get("q_norm"))
      k = attn.rms_norm(k, p["k_norm"], config.rms_norm_eps, noise.get("k_norm"))
    q, k = attn.apply_rope(q, cos, sin), attn.apply_rope(k, cos, sin)
  if kv is None:
    # No cache: slot t is query t, and attention_mask sees no later slot.
    o = attn.attend(q, k, v, mask_BxTxS, config.attn_query_chunk, config.train_attention_impl, causal=True)
  else:
    k_cache, v_cache = kv
    stacked = k_cache.ndim == 5  # [L, B, S, Hkv, Dh] and this layer's index, or this layer's [B, S, Hkv, Dh]
    if pallas_attention:
      # The kernel reads this layer's cache in place and writes the token's k and v into it.
      from qerl_kernels import decode_attention as kernel  # pylint: disable=import-outside-toplevel
      k_stack, v_stack, index = (k_cache, v_cache, layer) if stacked else (k_cache[None], v_cache[None], 0)
      # Slots past this token's own are invisible to every row: their blocks are not read.
      if rows is None:
        o, k_stack, v_stack = kernel.decode_attention_update(q[:, 0], k[:, 0].astype(k_cache.dtype),
                                                             v[:, 0].astype(v_cache.dtype), k_stack, v_stack, index,
                                                             cache_index, mask_BxTxS[:, 0], interpret=not on_gpu)
      else:
        o, k_stack, v_stack = kernel.decode_attention_rows(rows, k_stack, v_stack, index, cache_index,
                                                           mask_BxTxS[:, 0], heads=config.num_heads,
                                                           dtype=h_BxTxD.dtype, interpret=not on_gpu)
      o = o[:, None]
      kv = (k_stack, v_stack) if stacked else (k_stack[0], v_stack[0])
    else:
      start = (layer, 0, cache_index, 0, 0) if stacked else (0, cache_index, 0, 0)
      k_new, v_new = (k[None], v[None]) if stacked else (k, v)
      k_cache = jax.lax.dynamic_update_slice(k_cache, k_new.astype(k_cache.dtype), start)
      v_cache = jax.lax.dynamic_update_slice(v_cache, v_new.astype(v_cache.dtype), start)
      kv = (k_cache, v_cache)
      k_all = jax.lax.dynamic_index_in_dim(k_cache, layer, 0, keepdims=False) if stacked else k_cache
      v_all = jax.lax.dynamic_index_in_dim(v_cache, layer, 0, keepdims=False) if stacked else v_cache
      # The mask's slot count: all of the cache, or (static cache_index, e.g. a prefill) the slots these
      # queries can see at all, so a prefill attends over the prompt, not the whole response budget.
      k_all, v_all = k_all[:, :mask_BxTxS.shape[-1]], v_all[:, :mask_BxTxS.shape[-1]]
      o = attn.attend(q, k_all, v_all, mask_BxTxS, config.attn_query_chunk)
  x_BxTxD, h_BxTxD = _residual_norm(config, lora_scale, x_BxTxD, o, p["o_proj"], p["post_attention_layernorm"],
                                    noise.get("post_attention_layernorm"), fused, gemv_xa, decode, fold_norm)
  m = _swiglu(config, lora_scale, h_BxTxD, p, shared_a.get("gate_up"), merged.get("gate_up"), fused, gemv_xa, decode,
              x_BxTxD.dtype)
  x_BxTxD, h_next = _residual_norm(config, lora_scale, x_BxTxD, m, p["down_proj"], *next_norm, fused, gemv_xa,
                                   decode, fold_norm)
  return x_BxTxD, h_next, kv


def _materialized(h):
  """h as an array: a pending norm (`qerl_kernels.decode_residual_norm.PendingNorm`) gets its own launch."""
  return h.materialize() if hasattr(h, "materialize") else h


def _partials_to_pallas(config: ModelConfig, decode: bool, gemv_xa: bool) -> tuple[bool, bool]:
  """(whether a decode step's gemv partials go to the Pallas kernels that end its steps, interpret mode)."""
  on_gpu = jax.default_backend() == "gpu"
  wanted = config.decode_partials == "pallas" or config.decode_partials == "auto" and on_gpu
  return decode and gemv_xa and wanted, not on_gpu


def _decode_qkv_rows(config: ModelConfig, lora_scale: float, h_BxTxD: jax.Array, p, merged, cos, sin, cache_dtype,
                     gemv_xa: bool) -> jax.Array | None:
  """The decode attention kernel's input rows from one kernel over the q|k|v group launch's partials
  (qerl_kernels/decode_qkv.py: sums, biases, adapters, RoPE, the cache's dtype), with config.decode_partials on and
  every member adapted at one rank; None where that does not apply (then `_layer` runs XLA's steps)."""
  pallas, interpret = _partials_to_pallas(config, True, gemv_xa)
  ps = [p[name] for name in SHARED_INPUT["qkv"]]
  ranks = {None if q.get("lora_b") is None else q["lora_b"].shape[0] for q in ps}
  if (not pallas or config.qk_norm or merged is None or merged.get("lora_b") is None or len(ranks) != 1
      or None in ranks or not linear_lib.partials_apply(h_BxTxD, merged, config.decode_partials_tiles)):
    return None
  from qerl_kernels.decode_qkv import qkv_rows  # pylint: disable=import-outside-toplevel
  parts_SxMxN, xa_PxMxR = linear_lib.base_matmul_xa_partials(h_BxTxD, merged["w"], merged["lora_a"],
                                                              config.decode_partials_tiles)
  b, t, _ = h_BxTxD.shape
  return qkv_rows(parts_SxMxN, cos.reshape(b * t, -1), sin.reshape(b * t, -1), heads=config.num_heads,
                  kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=h_BxTxD.dtype,
                  cache_dtype=cache_dtype, xa_PxMxR=xa_PxMxR, b_RxN=merged["lora_b"], rank=ranks.pop(),
                  lora_scale=lora_scale, bias_N=merged.get("b"), interpret=interpret)


def _swiglu(config: ModelConfig, lora_scale: float, h_BxTxD: jax.Array, p, a_KxRs, merged, fused: bool,
            gemv_xa: bool, decode: bool, dtype) -> jax.Array:
  """SiLU(gate_proj(h)) * up_proj(h) in ``dtype``. At a decode step whose gate|up group launch computes the
  adapters' x @ A, with config.decode_partials on, one kernel adds the launch's partial sums and the adapters'
  terms and applies SwiGLU (qerl_kernels/decode_swiglu.py), with the same roundings."""
  gate, up = p["gate_proj"], p["up_proj"]
  pallas, interpret = _partials_to_pallas(config, decode, gemv_xa)
  if (pallas and merged is not None and merged.get("lora_b") is not None and h_BxTxD.dtype == dtype
      and gate.get("lora_b") is not None and up.get("lora_b") is not None
      and gate["lora_b"].shape[0] == up["lora_b"].shape[0] and (gate.get("b") is None) == (up.get("b") is None)
      and linear_lib.partials_apply(h_BxTxD, merged, config.decode_partials_tiles)):
    from qerl_kernels.decode_swiglu import swiglu  # pylint: disable=import-outside-toplevel
    parts_SxMx2N, xa_PxMxR = linear_lib.base_matmul_xa_partials(h_BxTxD, merged["w"], merged["lora_a"],
                                                                config.decode_partials_tiles)
    n = gate["lora_b"].shape[1]
    m_MxN = swiglu(parts_SxMx2N, n=n, dtype=dtype, xa_PxMxR=xa_PxMxR, b_gate_RxN=gate["lora_b"],
                   b_up_RxN=up["lora_b"], lora_scale=lora_scale, bias_gate_N=gate.get("b"), bias_up_N=up.get("b"),
                   interpret=interpret)
    return m_MxN.reshape(*h_BxTxD.shape[:-1], n)
  h_BxTxD = _materialized(h_BxTxD)
  g, u = (y.astype(jnp.float32) for y in linears(h_BxTxD, [gate, up], lora_scale, fused, gemv_xa, a_KxRs, merged))
  return (jax.nn.silu(g) * u).astype(dtype)


def _residual_norm(config: ModelConfig, lora_scale: float, x_BxTxD: jax.Array, in_BxTxK: jax.Array, proj, norm_D,
                   noise_D, fused: bool, gemv_xa: bool, decode: bool, fold_norm: bool = False):
  """(x + proj(in), the RMSNorm (norm_D + noise_D) of it). At a decode step whose gemv computes the adapter's
  x @ A, with config.decode_partials on, one kernel adds the gemv's partial sums, bias and adapter term to the
  residual and normalizes (qerl_kernels/decode_residual_norm.py), with the same roundings; with ``fold_norm``
  the norm is left pending (`_layer`) for the gemv that reads it."""
  eps = config.rms_norm_eps
  pallas, interpret = _partials_to_pallas(config, decode, gemv_xa)
  if (pallas and in_BxTxK.dtype == x_BxTxD.dtype
      and linear_lib.partials_apply(in_BxTxK, proj, config.decode_partials_tiles)):
    from qerl_kernels.decode_residual_norm import residual_add  # pylint: disable=import-outside-toplevel
    parts_SxMxD, xa_PxMxR = linear_lib.base_matmul_xa_partials(in_BxTxK, proj["w"], proj["lora_a"],
                                                                config.decode_partials_tiles)
    shape = x_BxTxD.shape
    pending = residual_add(x_BxTxD.reshape(-1, shape[-1]), parts_SxMxD, norm_D, eps=eps, xa_PxMxR=xa_PxMxR,
                           b_RxD=proj["lora_b"], lora_scale=lora_scale, bias_D=proj.get("b"), noise_D=noise_D,
                           interpret=interpret, shape=shape)
    return pending.x_MxD.reshape(shape), pending if fold_norm else pending.materialize()
  x_BxTxD = x_BxTxD + linear(in_BxTxK, proj, lora_scale, fused, gemv_xa=gemv_xa)
  return x_BxTxD, attn.rms_norm(x_BxTxD, norm_D, eps, noise_D)


def check_noise(config: ModelConfig, norm_noise: dict[str, jax.Array] | None) -> dict[str, jax.Array]:
  if not norm_noise:
    return {}
  dims = {"input_layernorm": config.hidden_size, "post_attention_layernorm": config.hidden_size,
          "q_norm": config.head_dim, "k_norm": config.head_dim}
  out = {}
  for key, value in norm_noise.items():
    if key not in dims or (key in ("q_norm", "k_norm") and not config.qk_norm):
      raise ValueError(f"norm_noise key {key!r} is not a norm of this {config.arch} model")
    if value is None:
      continue
    if tuple(value.shape) != (config.num_layers, dims[key]):
      raise ValueError(f"norm_noise[{key!r}] has shape {tuple(value.shape)}, expected "
                       f"{(config.num_layers, dims[key])}")
    out[key] = value.astype(jnp.float32)
  return out


def read_in_place(layers: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """(what the layer scan slices, the stacked NVFP4 weights it leaves whole for the kernels to index).

  Slicing a stacked weight inside the scan costs a copy of that layer's weight per use; the NVFP4 kernels
  read layer l of the stack in place instead (`LayerOf`). Everything else (norms, biases, adapters, other
  formats) is sliced as usual.
  """
  whole = {name: p["w"] for name, p in layers.items()
           if isinstance(p, dict) and isinstance(p.get("w"), NVFP4Tensor)}
  sliced = {name: ({k: v for k, v in p.items() if k != "w"} if name in whole else p) for name, p in layers.items()}
  return sliced, whole


def with_whole(p: dict[str, Any], whole: dict[str, Any], layer) -> dict[str, Any]:
  """One layer's sliced parameters with its NVFP4 weights put back as `LayerOf(stack, layer)`."""
  return {**p, **{name: {**p[name], "w": LayerOf(w, layer)} for name, w in whole.items()}}


def forward(params: dict[str, Any], config: ModelConfig, lora_scale: float, tokens_BxT: jax.Array,
            positions_BxT: jax.Array | None = None, *, cache: dict[str, jax.Array] | None = None,
            cache_index: Any = None, valid_BxS: jax.Array | None = None,
            norm_noise: dict[str, jax.Array] | None = None, return_hidden: bool = False):
  """The pure forward over a params pytree (see the module docstring for the arguments)."""
  if tokens_BxT.ndim != 2:
    raise ValueError(f"tokens must be [B, T], got shape {tokens_BxT.shape}")
  b, t = tokens_BxT.shape
  noise = check_noise(config, norm_noise)
  if cache is None:
    if cache_index is not None:
      raise ValueError("cache_index given without a cache")
    slots_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    num_slots = t
  else:
    cache_index = 0 if cache_index is None else cache_index
    cache_b, num_slots = _cache_rows_and_slots(cache)
    if cache_b != b:
      raise ValueError(f"cache batch {cache_b} != tokens batch {b}")
    if isinstance(cache_index, (int, np.integer)):  # static: later slots are invisible to these queries
      num_slots = min(num_slots, int(cache_index) + t)
      valid_BxS = None if valid_BxS is None else valid_BxS[:, :num_slots]
    cache_index = jnp.asarray(cache_index, jnp.int32)
    slots_BxT = jnp.broadcast_to(cache_index + jnp.arange(t, dtype=jnp.int32), (b, t))
  positions_BxT = slots_BxT if positions_BxT is None else positions_BxT
  mask_BxTxS = attn.attention_mask(slots_BxT, num_slots, valid_BxS)
  cos, sin = attn.rope_cos_sin(config, positions_BxT)
  x = jnp.take(params["embed_tokens"], tokens_BxT, axis=0).astype(config.dtype)

  # The scan's carry must keep one structure, so only the unrolled loop leaves norms pending.
  unrolled = isinstance(params["layers"], (list, tuple))
  fold_norm = config.decode_norm_fold and unrolled and cache is not None

  def layer_fn(x, h, kv, p, layer_noise, next_norm, layer):
    return _layer(config, lora_scale, x, h, p, layer_noise, next_norm, cos, sin, mask_BxTxS, kv, layer,
                  cache_index, fold_norm)

  if config.remat:
    layer_fn = jax.checkpoint(layer_fn, policy=getattr(jax.checkpoint_policies, config.remat_policy))
  kv = None if cache is None else (cache["k"], cache["v"])
  # Each block ends with the norm after it (the next block's input norm, the final one last), so h is always
  # the next block's input: one decode kernel can end a block and normalize for the next (`_residual_norm`).
  first_norm = params["layers"][0]["input_layernorm"] if unrolled else params["layers"]["input_layernorm"][0]
  first_noise = noise["input_layernorm"][0] if "input_layernorm" in noise else None
  h = attn.rms_norm(x, first_norm, config.rms_norm_eps, first_noise)
  if unrolled:
    _, h, kv = _unrolled(layer_fn, x, h, kv, params["layers"], noise, params["norm"])
  else:
    _, h, kv = _scanned(layer_fn, x, h, kv, params["layers"], noise, params["norm"], config.num_layers)
  h = _materialized(h)
  out = h if return_hidden else lm_head_logits(h, _lm_head(params))
  if cache is None:
    return out
  return out, {"k": kv[0], "v": kv[1]}


def _cache_rows_and_slots(cache: dict[str, Any]) -> tuple[int, int]:
  """(B, S) of a stacked cache [L, B, S, ...] or a per-layer one (lists of [B, S, ...])."""
  k = cache["k"]
  return tuple(k[0].shape[:2]) if isinstance(k, (list, tuple)) else tuple(k.shape[1:3])


def _scanned(layer_fn, x, h, kv, layers: dict[str, Any], noise: dict[str, jax.Array], final_norm: jax.Array,
             num_layers: int):
  """The layers as a `lax.scan` over the stacked parameters (training, and the "scan" decode loop)."""
  sliced, whole = read_in_place(layers)
  # The norm after block l, stacked: block l + 1's input norm, the final norm last (float32: rms_norm's own
  # cast of either scale, so nothing rounds), and its AQN noise (none on the final norm: zeros add nothing).
  norms = layers["input_layernorm"].astype(jnp.float32)
  next_scale = jnp.concatenate([norms[1:], final_norm.astype(jnp.float32)[None]])
  next_noise = None
  if "input_layernorm" in noise:
    next_noise = jnp.concatenate([noise["input_layernorm"][1:], jnp.zeros_like(noise["input_layernorm"][:1])])

  def body(carry, xs):
    x, h, kv = carry
    p, layer_noise, next_norm, layer = xs
    return layer_fn(x, h, kv, with_whole(p, whole, layer), layer_noise, next_norm, layer), None

  xs = (sliced, noise, (next_scale, next_noise), jnp.arange(num_layers, dtype=jnp.int32))
  (x, h, kv), _ = jax.lax.scan(body, (x, h, kv), xs)
  return x, h, kv


def _unrolled(layer_fn, x, h, kv, layers: list[dict[str, Any]], noise: dict[str, jax.Array],
              final_norm: jax.Array):
  """The layers as a Python loop over per-layer parameters (`param_views.unstack_layers`) and per-layer caches."""
  new_k, new_v = [], []
  next_noise = noise.get("input_layernorm")
  for layer, p in enumerate(layers):
    kv_l = None if kv is None else (kv[0][layer], kv[1][layer])
    last = layer == len(layers) - 1
    next_norm = ((final_norm, None) if last else
                 (layers[layer + 1]["input_layernorm"], None if next_noise is None else next_noise[layer + 1]))
    x, h, kv_l = layer_fn(x, h, kv_l, p, {name: value[layer] for name, value in noise.items()}, next_norm, layer)
    if kv_l is not None:
      new_k.append(kv_l[0])
      new_v.append(kv_l[1])
  return x, h, (None if kv is None else (new_k, new_v))


_forward_jit = jax.jit(forward, static_argnums=(1, 2), static_argnames=("return_hidden",))


def _lm_head(params: dict[str, Any]) -> jax.Array:
  return params["lm_head"] if params.get("lm_head") is not None else params["embed_tokens"]


class Block(nnx.Module):
  """All decoder blocks' parameters, stacked on a leading L axis (HF names per block)."""

  def __init__(self, layers: dict[str, Any], lora: LoraConfig | None, train_norms: bool, key: jax.Array):
    for name in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm"):
      if name in layers:
        kind = nnx.Param if (train_norms and name in TRAINABLE_NORMS) else Frozen
        setattr(self, name, kind(layers[name]))
      else:
        setattr(self, name, None)
    adapters = _fresh_adapters(key, {name: layers[name]["w"] for name in PROJ_NAMES}, lora)
    for name in PROJ_NAMES:
      setattr(self, name, Projection(layers[name]["w"], layers[name].get("b"), adapters.get(name)))

  def params(self) -> dict[str, Any]:
    p = {name: getattr(self, name).params() for name in PROJ_NAMES}
    for name in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm"):
      if getattr(self, name) is not None:
        p[name] = getattr(self, name).get_value()
    return p


def layer_count(w: Any) -> int:
  return jax.tree.leaves(w)[0].shape[0]


def _fresh_adapters(key: jax.Array, weights: dict[str, Any], lora: LoraConfig | None):
  """{name: (A, B)} PEFT-style initial adapters for the targeted projections (one compiled program)."""
  if lora is None:
    return {}
  names = [name for name in PROJ_NAMES if name in lora.targets]
  shapes = tuple((layer_count(weights[n]),) + tuple(logical_shape(weights[n])) for n in names)
  return dict(zip(names, init_loras(key, shapes, lora)))


class Transformer(nnx.Module):
  """Llama / Qwen2 / Qwen3 decoder with LoRA over a frozen, possibly quantized base.

  Build it from a base pytree (see `qerl_jax.model.base`): `Transformer(config, base, lora=LoraConfig(...),
  train_norms=False, rngs=nnx.Rngs(0))`; `qerl_jax.model.loading.from_pretrained` does this from files.
  """

  def __init__(self, config: ModelConfig, base: dict[str, Any], *, lora: LoraConfig | None = None,
               train_norms: bool = False, rngs: nnx.Rngs | None = None):
    self.config = config
    self.lora = lora
    self.train_norms = train_norms
    key = (rngs or nnx.Rngs(0)).params()
    self.embed_tokens = Frozen(base["embed_tokens"])
    self.layers = Block(base["layers"], lora, train_norms, key)
    self.norm = Frozen(base["norm"])
    self.lm_head = Frozen(base["lm_head"]) if base.get("lm_head") is not None else None

  @property
  def lora_scale(self) -> float:
    return self.lora.scale if self.lora is not None else 0.0

  def params(self) -> dict[str, Any]:
    """The pure pytree `forward` consumes (views of the variables, no copies)."""
    p = {"embed_tokens": self.embed_tokens.get_value(), "layers": self.layers.params(),
         "norm": self.norm.get_value()}
    if self.lm_head is not None:
      p["lm_head"] = self.lm_head.get_value()
    return p

  def __call__(self, tokens_BxT, positions_BxT=None, *, cache=None, cache_index=None, valid_BxS=None,
               norm_noise=None, return_hidden=False):
    # Jitted even when called eagerly (one compile per shape instead of one per op); inside an outer
    # jit it is simply inlined.
    return _forward_jit(self.params(), self.config, self.lora_scale, tokens_BxT, positions_BxT, cache=cache,
                   cache_index=cache_index, valid_BxS=valid_BxS, norm_noise=norm_noise,
                   return_hidden=return_hidden)

  def lm_head_weight(self) -> jax.Array:
    """The output matrix [V, D] (the embedding when tied)."""
    return (self.lm_head if self.lm_head is not None else self.embed_tokens).get_value()

  def lm_head_logits(self, h_xD: jax.Array) -> jax.Array:
    """float32 logits [..., V] of final-normed hidden states [..., D]."""
    return lm_head_logits(h_xD, self.lm_head_weight())

  def set_lora(self, lora: LoraConfig | None, *, key: jax.Array | None = None,
               adapters: dict[str, tuple[jax.Array, jax.Array]] | None = None) -> None:
    """Replaces the adapters: fresh PEFT-style init from `key`, or the given {name: (A [L,K,r], B [L,r,N])}."""
    self.lora = lora
    if adapters is None:
      weights = {name: getattr(self.layers, name).weight.get_value() for name in PROJ_NAMES}
      adapters = _fresh_adapters(key if key is not None else jax.random.key(0), weights, lora)
    for name in PROJ_NAMES:
      getattr(self.layers, name).set_lora(adapters.get(name) if lora is not None and name in lora.targets else None)


def split_params(model: Transformer):
  """(graphdef, trainable_state, frozen_state): LoRA A/B and trainable norms vs the frozen base.

  Differentiate a loss w.r.t. `trainable_state` only; pass `frozen_state` through jit as a plain argument
  (it is never copied or differentiated) and rebuild with `nnx.merge(graphdef, trainable, frozen)`.
  """
  return nnx.split(model, nnx.Param, ...)
