"""Linear layers over a frozen (possibly quantized) base with an unmerged LoRA adapter.

y = base_matmul(x, W) + b + (x @ A) @ B * scale, with W [K, N] frozen (bf16/fp32 array or a quantized
tensor from `qerl_jax.quant`), A [K, r] and B [r, N] trainable (`nnx.LoRAParam`), scale = alpha / r
(alpha / sqrt(r) with rsLoRA). A is initialised like PEFT (kaiming-uniform, bound 1/sqrt(K)), B is zero, so
a fresh adapter leaves the model unchanged.

Every base matmul in the model goes through `base_matmul`: the fused-kernel work replaces what it calls for
NVFP4, and nothing else in the model needs to change.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qerl_jax.quant import types as qtypes

# The seven decoder-block projections, by their Hugging Face module path inside a block.
PROJ_PATHS = {
  "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
  "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
  "down_proj": "mlp.down_proj",
}
PROJ_NAMES = tuple(PROJ_PATHS)


class Frozen(nnx.Variable):
  """A frozen base parameter (weights, biases, embeddings, frozen norms): never differentiated.

  `split_params` separates these from `nnx.Param` (LoRA A/B, trainable norms), so a jitted train step
  takes the frozen state as a plain non-differentiated argument and never copies it.
  """


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """LoRA adapter settings (PEFT semantics)."""

  rank: int = 16  # r
  alpha: float = 16.0  # scale = alpha / r (alpha / sqrt(r) with use_rslora)
  targets: tuple[str, ...] = PROJ_NAMES  # projection names, resolved by `resolve_targets`
  dtype: Any = jnp.float32  # parameter dtype of A and B (float32 or bfloat16)
  use_rslora: bool = False

  def __post_init__(self):
    if not isinstance(self.rank, int) or self.rank <= 0:
      raise ValueError(f"lora rank={self.rank!r} must be a positive int")
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    object.__setattr__(self, "targets", resolve_targets(self.targets))

  @property
  def scale(self) -> float:
    return float(self.alpha) / (self.rank ** 0.5 if self.use_rslora else self.rank)


def resolve_targets(spec: str | Sequence[str]) -> tuple[str, ...]:
  """Projection names selected by a LoRA target spec, in canonical order.

  spec: "all-linear" / "all"; a regex searched in each projection's path ("self_attn.q_proj", so "q_proj",
  "attn" or "q_proj|v_proj" work); or a sequence of names/regexes, each of which must match something.
  A spec that matches no projection raises ValueError.
  """
  if isinstance(spec, str):
    if spec in ("all-linear", "all"):
      return PROJ_NAMES
    patterns = [spec]
  else:
    patterns = list(spec)
    if not patterns:
      raise ValueError("lora targets must not be empty")
  chosen = set()
  for pattern in patterns:
    try:
      rx = re.compile(pattern)
    except re.error as e:
      raise ValueError(f"invalid lora target regex {pattern!r}: {e}") from None
    hits = {name for name, path in PROJ_PATHS.items() if name == pattern or rx.search(path)}
    if not hits:
      raise ValueError(f"lora target {pattern!r} matches none of the projections {PROJ_NAMES}")
    chosen |= hits
  return tuple(name for name in PROJ_NAMES if name in chosen)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["stacked", "layer"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LayerOf:
  """Layer ``layer`` (an int32 scalar, e.g. a scan's index) of a stacked frozen NVFP4 weight [L, ...].

  A `lax.scan` that slices stacked weights makes XLA copy each layer's slice before its matmul (measured on
  an H200: 2.7x the time of unsliced weights for a decode-sized bf16 MLP pass, experiments/RESULTS.md). The
  model hands NVFP4 weights over whole with the index instead, and the fused kernels read the layer in place.
  A pytree (both fields are leaves), so a layer's parameters can pass through jax.checkpoint with it.
  """

  stacked: Any
  layer: Any  # an int32 scalar or a Python int


def is_nvfp4(w: Any) -> bool:
  """Whether a base weight goes to the fused NVFP4 kernels (an NVFP4 tensor or a `LayerOf` stack)."""
  return isinstance(w, (LayerOf, qtypes.NVFP4Tensor))


def base_matmul(x_BxTxK: jax.Array, w: Any, **epilogue) -> jax.Array:
  """x @ W for a frozen base weight of logical shape [K, N]; x may have any leading dims.

  w: a float array [K, N] (cast to x's dtype), a quantized tensor, or a `LayerOf` NVFP4 stack. NVFP4 goes
  to the fused kernel when available (which reads a `LayerOf` in place; ``epilogue``: its bias= / lora=);
  other schemes are dequantized to x's dtype and multiplied. Accumulation is float32.
  """
  if is_nvfp4(w):
    # The project's top-level kernels/ package; it falls back to XLA itself where no kernel runs.
    from qerl_kernels import nvfp4_matmul  # pylint: disable=import-outside-toplevel
    stacked, layer = _stack_and_layer(w)
    return nvfp4_matmul(x_BxTxK, stacked, layer=layer, **epilogue)
  if qtypes.is_quantized(w):
    from qerl_jax.quant import dequantize  # pylint: disable=import-outside-toplevel
    w = dequantize(w, x_BxTxK.dtype)
  w_KxN = w.astype(x_BxTxK.dtype)
  if x_BxTxK.shape[-1] != w_KxN.shape[0]:
    raise ValueError(f"x last dim {x_BxTxK.shape[-1]} != weight K {w_KxN.shape[0]} (w is [K, N]={w_KxN.shape})")
  # A dot in x's dtype, as the NVFP4 path's XLA reference runs it: XLA sums 16-bit dots in float32 and rounds
  # once, and JAX's transpose (dy @ W^T) stays 16-bit. A float32 result cast afterwards made that transpose a
  # float32 GEMM over a float32 copy of W (RESULTS.md "At 0554259", "At 0d5b0d8" and "At 5ea2f34").
  return jnp.matmul(x_BxTxK, w_KxN)


def _xa_in_gemv(x_BxTxK: jax.Array, p: dict[str, Any]) -> bool:
  """Whether this projection's gemv computes its adapter's x @ A in the same launch
  (`qerl_kernels.nvfp4_matmul_xa`: decode rows, an NVFP4 weight, a kernel that takes it). Elsewhere the caller's
  own x @ A (`lora_xa`, concatenated in `linears`) is the faster one."""
  if p.get("lora_a") is None or not is_nvfp4(p["w"]):
    return False
  import qerl_kernels as kernels  # pylint: disable=import-outside-toplevel
  stacked, layer = _stack_and_layer(p["w"])
  return kernels.xa_shares_launch(x_BxTxK, stacked, p["lora_a"].shape[-1], layer=layer)


def base_matmul_xa(x_BxTxK: jax.Array, w: Any, a_KxR: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(x @ W, x @ A in float32) for an NVFP4 weight: one kernel launch at decode rows (where it applies)."""
  import qerl_kernels as kernels  # pylint: disable=import-outside-toplevel
  stacked, layer = _stack_and_layer(w)
  return kernels.nvfp4_matmul_xa(x_BxTxK, stacked, a_KxR, layer=layer)


def partials_apply(x_BxTxK: jax.Array, p: dict[str, Any], tiles: bool = False) -> bool:
  """Whether `base_matmul_xa_partials` takes this projection: an adapter whose x @ A shares the gemv's launch,
  or (``tiles``, ModelConfig.decode_partials_tiles) a few-row call of the tile kernels."""
  if p.get("lora_b") is None or p.get("lora_a") is None or not is_nvfp4(p["w"]):
    return False
  import qerl_kernels as kernels  # pylint: disable=import-outside-toplevel
  stacked, layer = _stack_and_layer(p["w"])
  return kernels.partials_launch_applies(x_BxTxK, stacked, p["lora_a"].shape[-1], layer=layer, tiles=tiles)


def base_matmul_xa_partials(x_BxTxK: jax.Array, w: Any, a_KxR: jax.Array,
                            tiles: bool = False) -> tuple[jax.Array, jax.Array]:
  """`base_matmul_xa` before the partial sums are added: (y partials [S, M, N], x @ A partials [P, M, r] float32)
  for a kernel that adds them itself; M = the rows of x. Decode only (not differentiable)."""
  import qerl_kernels as kernels  # pylint: disable=import-outside-toplevel
  stacked, layer = _stack_and_layer(w)
  return kernels.nvfp4_matmul_xa_partials(x_BxTxK, stacked, a_KxR, layer=layer, tiles=tiles)


def _stack_and_layer(w: Any) -> tuple[Any, Any]:
  """(NVFP4 tensor, layer index or None) of an NVFP4 weight, for the kernels that read a stack in place."""
  return (w.stacked, w.layer) if isinstance(w, LayerOf) else (w, None)


def lora_xa(x_BxTxK: jax.Array, a_KxR: jax.Array, b_RxN: jax.Array) -> jax.Array:
  """x @ A in the adapter's dtype with float32 accumulation, cast to B's dtype (PEFT's order).

  At one row (a batch-1 decode step) XLA rewrites the dot into a multiply and a column reduction over K, and
  when it fuses the two it ran o_proj's [3584, 16] as one 15 us kernel on an H200. The product is formed
  first (behind an optimization barrier) so the reduction runs alone: 7B NVFP4 batch-1 step 4.93 -> 4.69 ms
  (profile_decode, d55cfc8). Same float32 products, summed over K.
  """
  x_BxTxK = x_BxTxK.astype(a_KxR.dtype)
  if math.prod(x_BxTxK.shape[:-1]) == 1:
    x_K = x_BxTxK.reshape(-1).astype(jnp.float32)
    prod_KxR = jax.lax.optimization_barrier(x_K[:, None] * a_KxR.astype(jnp.float32))
    xa = prod_KxR.sum(0).reshape(*x_BxTxK.shape[:-1], a_KxR.shape[-1])
  else:
    xa = jnp.einsum("...k,kr->...r", x_BxTxK, a_KxR, preferred_element_type=jnp.float32)
  return xa.astype(b_RxN.dtype)


def lora_up(xa_BxTxR: jax.Array, b_RxN: jax.Array, scale: float) -> jax.Array:
  """scale * (x @ A) @ B in float32, from x @ A (`lora_xa`) in B's dtype, as PEFT computes it."""
  return jnp.einsum("...r,rn->...n", xa_BxTxR, b_RxN, preferred_element_type=jnp.float32) * scale


def linear(x_BxTxK: jax.Array, p: dict[str, Any], lora_scale: float, fused: bool = False,
           xa_BxTxR: jax.Array | None = None, gemv_xa: bool = False) -> jax.Array:
  """One projection from its parameter dict {"w", optional "b", optional "lora_a"/"lora_b"}.

  fused: with an NVFP4 weight, add the bias and the adapter's (x @ A) @ B inside the matmul kernel's
  epilogue (`qerl_kernels.nvfp4_matmul(..., bias=, lora=)`), in float32 with one rounding, instead of as separate
  XLA operations; x @ A stays in XLA. Other weights, and adapters not in x's dtype, ignore it.
  xa_BxTxR: x @ A already computed (`linears`).
  gemv_xa: at decode rows on an NVFP4 weight, x @ A is computed in the gemv's launch where a kernel takes it
  (`_xa_in_gemv`); there it takes precedence over ``fused``.
  """
  w = p["w"]
  has_lora = p.get("lora_a") is not None
  if gemv_xa and xa_BxTxR is None and _xa_in_gemv(x_BxTxK, p):
    y, xa_f32 = base_matmul_xa(x_BxTxK, w, p["lora_a"])
    return _add_terms(y, p, xa_f32.astype(p["lora_b"].dtype), lora_scale)
  if has_lora and xa_BxTxR is None:
    xa_BxTxR = lora_xa(x_BxTxK, p["lora_a"], p["lora_b"])
  # float32 adapters (the trainer's) make the epilogue's dot a float32 one: +1.4 ms per 7B batch-64 decode step
  # on an H200 at 28aefa1 (profile_decode --lora-dtype float32), so they stay with XLA.
  if fused and is_nvfp4(w) and not (has_lora and p["lora_b"].dtype != x_BxTxK.dtype):
    lora = (xa_BxTxR, p["lora_b"], lora_scale) if has_lora else None
    return base_matmul(x_BxTxK, w, bias=p.get("b"), lora=lora)
  return _add_terms(base_matmul(x_BxTxK, w), p, xa_BxTxR, lora_scale)


def _add_terms(y: jax.Array, p: dict[str, Any], xa_BxTxR: jax.Array | None, lora_scale: float) -> jax.Array:
  """y + bias + the adapter's (x @ A) @ B, each rounded to y's dtype (the unfused order)."""
  if p.get("b") is not None:
    y = y + p["b"].astype(y.dtype)
  if xa_BxTxR is not None:
    y = y + lora_up(xa_BxTxR, p["lora_b"], lora_scale).astype(y.dtype)
  return y


def shared_lora_a(ps: Sequence[dict[str, Any]]) -> jax.Array | None:
  """[A1 | A2 | ...] [..., K, sum of ranks] of the projections in ``ps`` that have adapters, the one x @ A matmul
  `linears` runs for their shared input; None where fewer than two have adapters or their dtypes differ."""
  with_lora = [p for p in ps if p.get("lora_a") is not None]
  if len(with_lora) < 2 or len({(p["lora_a"].dtype, p["lora_b"].dtype) for p in with_lora}) > 1:
    return None
  return jnp.concatenate([p["lora_a"] for p in with_lora], axis=-1)


def merged_linears(x_BxTxK: jax.Array, ps: Sequence[dict[str, Any]], merged: dict[str, Any], lora_scale: float,
                   fused: bool = False, gemv_xa: bool = False) -> list:
  """`linears` over one launch of the group's NVFP4 weights (ModelConfig.rollout_merged_launches).

  merged: {"w": LayerOf(kernels.Nvfp4Group of the stacks, read in place as [W1 | W2 | ...] along N, layer),
  "b": [b1 | b2 | ...] or None, "lora_a":
  [A1 | A2 | ... | 0] of the projections with adapters (zero columns up to a power-of-two rank) or None,
  "lora_b": those B's block-diagonal [that rank, sum of N] or None}, made once per rollout
  (`param_views.with_merged_launches`). The output is split back per projection. At decode rows the gemv
  computes x @ [A1 | A2 | ...] in the same launch (gemv_xa); up to the fused rows the kernel's epilogue adds
  the bias and the block-diagonal product (its zero blocks add exact zeros); otherwise XLA adds each
  projection's terms as `linear` does.
  """
  # Outside the fused epilogue each projection's own terms are added (not `linear` on the merged dict): the
  # block-diagonal B's padded rank would change XLA's float32 sum order (measured: logits 5.5e-4 apart at one
  # row against 0.0) and multiply its zero blocks.
  widths = [logical_shape(_stack_and_layer(p["w"])[0])[1] for p in ps]
  with_lora = [p for p in ps if p.get("lora_a") is not None]
  w, a_KxRs = merged["w"], merged.get("lora_a")
  xa = None
  if gemv_xa and with_lora and _xa_in_gemv(x_BxTxK, {"w": w, "lora_a": a_KxRs}):
    y, xa_f32 = base_matmul_xa(x_BxTxK, w, a_KxRs)
    xa = xa_f32.astype(with_lora[0]["lora_b"].dtype)
  else:
    if with_lora:
      xa = lora_xa(x_BxTxK, a_KxRs, with_lora[0]["lora_b"])
    if fused and not (with_lora and with_lora[0]["lora_b"].dtype != x_BxTxK.dtype):
      lora = (xa, merged["lora_b"], lora_scale) if with_lora else None
      return jnp.split(base_matmul(x_BxTxK, w, bias=merged.get("b"), lora=lora), np.cumsum(widths)[:-1], axis=-1)
    y = base_matmul(x_BxTxK, w)
  # (The last piece of the split is the zero columns that pad the rank.)
  xas = iter(jnp.split(xa, np.cumsum([p["lora_a"].shape[-1] for p in with_lora]), axis=-1) if with_lora else [])
  return [_add_terms(y_p, p, next(xas) if p.get("lora_a") is not None else None, lora_scale)
          for y_p, p in zip(jnp.split(y, np.cumsum(widths)[:-1], axis=-1), ps)]


def linears(x_BxTxK: jax.Array, ps: Sequence[dict[str, Any]], lora_scale: float, fused: bool = False,
            gemv_xa: bool = False, a_KxRs: jax.Array | None = None, merged: dict[str, Any] | None = None) -> list:
  """`linear` for several projections of the same input (q/k/v, gate/up), their adapters' x @ A as one matmul.

  At one decode row XLA runs each x @ A as its own small reduction kernel (7B, batch 1, 3c549d8: 196 per
  token, ~0.8 ms of a 5.4 ms step); concatenating the A's that share an input halves their number. Measured
  on an H200 (0dc83ad, with a gemv retune in the same commit): the NVFP4 step 5.36 -> 5.07 ms; the bf16
  rollout 8.36 -> 6.44 ms per step since 61ea4fd. Each column of x @ [A1 | A2 | ...] is the same dot as x @ Ai.
  gemv_xa (`linear`): at decode rows on NVFP4 weights each projection's gemv computes its own x @ A instead.
  a_KxRs: ``shared_lora_a(ps)`` made ahead (the rollout makes it once, before its decode loop: XLA does not
  hoist the concatenation out of the loop, and on an H200 it ran as two ~1.7 us kernels per layer and token).
  merged: the group's merged weight (`merged_linears`), one launch for all of ``ps``.
  """
  if merged is not None:
    return merged_linears(x_BxTxK, ps, merged, lora_scale, fused, gemv_xa)
  with_lora = [p for p in ps if p.get("lora_a") is not None]
  if gemv_xa and with_lora and all(_xa_in_gemv(x_BxTxK, p) for p in with_lora):
    return [linear(x_BxTxK, p, lora_scale, gemv_xa=True) for p in ps]
  if a_KxRs is None:
    a_KxRs = shared_lora_a(ps)
  if a_KxRs is None:
    return [linear(x_BxTxK, p, lora_scale, fused) for p in ps]
  xa_BxTxRs = lora_xa(x_BxTxK, a_KxRs, with_lora[0]["lora_b"])
  ends = np.cumsum([p["lora_a"].shape[-1] for p in with_lora])[:-1]
  xas = iter(jnp.split(xa_BxTxRs, ends, axis=-1))  # in the order of with_lora, i.e. of ps
  return [linear(x_BxTxK, p, lora_scale, fused, next(xas) if p.get("lora_a") is not None else None) for p in ps]


def init_lora(key: jax.Array, num_layers: int, k: int, n: int, cfg: LoraConfig) -> tuple[jax.Array, jax.Array]:
  """Stacked PEFT-style initial adapter: A [L, K, r] ~ U(-1/sqrt(K), 1/sqrt(K)), B [L, r, N] = 0.

  PEFT's kaiming_uniform_(a=sqrt(5)) on lora_A.weight [r, K] has bound sqrt(6 / ((1 + 5) K)) = 1/sqrt(K).
  """
  return init_loras(key, ((num_layers, k, n),), cfg)[0]


@functools.partial(jax.jit, static_argnames=("shapes", "cfg"))
def init_loras(key: jax.Array, shapes: tuple[tuple[int, int, int], ...], cfg: LoraConfig):
  """`init_lora` for several (L, K, N) projections in one compiled program."""
  # One uniform draw sliced into the A's: a single RNG op compiles far faster than one per projection.
  sizes = [num_layers * k * cfg.rank for num_layers, k, _ in shapes]
  u = jax.random.uniform(key, (sum(sizes),), jnp.float32, -1.0, 1.0)
  out, start = [], 0
  for size, (num_layers, k, n) in zip(sizes, shapes):
    a = (u[start:start + size] / (k ** 0.5)).reshape(num_layers, k, cfg.rank).astype(cfg.dtype)
    out.append((a, jnp.zeros((num_layers, cfg.rank, n), cfg.dtype)))
    start += size
  return tuple(out)


class Projection(nnx.Module):
  """Stacked parameters of one projection kind across all layers.

  weight: Frozen, [L, K, N] array or a quantized tensor whose arrays carry a leading L axis.
  bias: Frozen [L, N] or None. lora_a: LoRAParam [L, K, r] or None. lora_b: LoRAParam [L, r, N] or None.
  """

  def __init__(self, weight: Any, bias: jax.Array | None = None, lora: tuple[jax.Array, jax.Array] | None = None):
    self.weight = Frozen(weight)
    self.bias = Frozen(bias) if bias is not None else None
    self.set_lora(lora)

  def set_lora(self, lora: tuple[jax.Array, jax.Array] | None) -> None:
    # nnx.data: the slots switch between None and a variable, so they must be declared data, not static.
    self.lora_a = nnx.data(nnx.LoRAParam(lora[0]) if lora is not None else None)
    self.lora_b = nnx.data(nnx.LoRAParam(lora[1]) if lora is not None else None)

  def params(self) -> dict[str, Any]:
    """The pure pytree the layer function consumes."""
    p = {"w": self.weight.get_value()}
    if self.bias is not None:
      p["b"] = self.bias.get_value()
    if self.lora_a is not None:
      p["lora_a"] = self.lora_a.get_value()
      p["lora_b"] = self.lora_b.get_value()
    return p


def logical_shape(w: Any) -> tuple[int, int]:
  """[K, N] of one layer's weight, for a stacked [L, K, N] array or a stacked quantized tensor."""
  if qtypes.is_quantized(w):
    return tuple(w.shape)
  return tuple(w.shape[-2:])
