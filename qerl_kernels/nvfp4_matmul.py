"""Public NVFP4 weight-only matmul: dispatch, custom VJP, and the pure-jnp reference.

``nvfp4_matmul(x, q)`` computes ``x @ dequantize(q, x.dtype)`` for x of shape [..., K] and an
``NVFP4Tensor`` q of logical shape [K, N]. On a CUDA GPU with fp8 conversion (compute capability >= 8.9)
it runs the fused Pallas kernels, forward and backward (the gradient flows to x only: the base is frozen,
so LoRA training never materializes a 16-bit weight); elsewhere (CPU, older GPUs, float32 activations) it
falls back to the XLA reference, so the model can call it everywhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from qerl_kernels import config as config_lib, nvfp4_dequant, nvfp4_epilogue
from qerl_kernels.nvfp4_matmul_bwd import nvfp4_matmul_bwd_pallas
from qerl_kernels.nvfp4_matmul_fwd import nvfp4_matmul_fwd_pallas
from qerl_jax import quant
from qerl_jax.quant import nvfp4
from qerl_jax.quant.types import NVFP4_BLOCK, NVFP4Tensor
from qerl_jax.sharding import BATCH

IMPLEMENTATIONS = ("pallas", "triton", "xla")
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["members"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Nvfp4Group:
  """NVFP4 weights of one input (q, k, v; gate, up) multiplied as x @ [W_1 | W_2 | ...] of logical shape
  [K, sum of N], by one kernel launch that reads each member in place with its own global scale: nothing is
  concatenated. Members are single weights, or stacks [L, ...] all taken at the same ``layer``. As vLLM's
  merged layers, without their load-time copy."""

  members: tuple[NVFP4Tensor, ...]

  @property
  def shape(self) -> tuple[int, int]:
    return (self.members[0].shape[0], sum(q.shape[1] for q in self.members))

  @property
  def widths(self) -> tuple[int, ...]:
    return tuple(q.shape[1] for q in self.members)


def dequantize(q: NVFP4Tensor | Nvfp4Group, dtype) -> jax.Array:
  """[K, N] (or [L, K, N]) in ``dtype``; a group's members side by side along N."""
  if isinstance(q, Nvfp4Group):
    return jnp.concatenate([quant.dequantize(m, dtype) for m in q.members], axis=-1)
  return quant.dequantize(q, dtype)


def kernel_operands(q: NVFP4Tensor | Nvfp4Group) -> tuple:
  """(packed, scale, global_scale) as the kernels take them: arrays, or a group's tuples of its members'."""
  if isinstance(q, Nvfp4Group):
    return tuple(tuple(getattr(m, f) for m in q.members) for f in ("packed_NxKh", "scale_NxKb", "global_scale"))
  return q.packed_NxKh, q.scale_NxKb, q.global_scale


def is_stacked(q: NVFP4Tensor | Nvfp4Group) -> bool:
  """Whether q (or a group's members) is a stack [L, ...] of layers."""
  return (q.members[0] if isinstance(q, Nvfp4Group) else q).packed_NxKh.ndim == 3


def nvfp4_matmul_reference(x: jax.Array, q: NVFP4Tensor | Nvfp4Group, **dot_kwargs) -> jax.Array:
  """The pure-jnp reference: dequantize to x's dtype, then a plain dot. x [..., K] -> [..., N]. One layer is dotted
  in its stored [N, K] layout: the GEMM reads either operand order, so no transpose of the dequantized weight is
  asked of XLA. ``dot_kwargs``: e.g. preferred_element_type, for the epilogue's float32 sum."""
  return _dot_dequantized(x, q, quant.dequantize_NxK, **dot_kwargs)


def xla_path_matmul(x: jax.Array, q: NVFP4Tensor | Nvfp4Group, **dot_kwargs) -> jax.Array:
  """What implementation="xla" runs: `nvfp4_matmul_reference`'s values, each layer dequantized by `dequantize_layer`
  (the Pallas kernel where the device's tuning opts in)."""
  if xla_dequant() != "xla":
    # The dequantization waits for x: nothing else orders it, and with "words" XLA's GPU scheduler dequantized the
    # unrolled prefill's layers up front (7B rollout peak 14.5 -> 19.2 / 22.0 GB at batch 8 / 64, H200, 483586a;
    # with the barrier 14.5 / 14.8 GB, H100, fdbd31f). The integer decode was measured without it (14.5 GB), so it
    # keeps that program.
    x, q = jax.lax.optimization_barrier((x, q))
  if xla_backward_layout() == "KxN" and not is_stacked(q):
    return _dot_with_KxN_backward(x, q, tuple(sorted(dot_kwargs.items())), jnp.dtype(x.dtype))
  return _dot_dequantized(x, q, dequantize_layer, **dot_kwargs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dot_with_KxN_backward(x, q, dot_items, x_dtype):
  """The XLA path's forward; its backward (`_KxN_backward`) dequantizes into [K, N] ("xla_backward_layout")."""
  del x_dtype  # the backward's
  return _dot_dequantized(x, q, dequantize_layer, **dict(dot_items))


def _dot_with_KxN_forward(x, q, dot_items, x_dtype):
  return _dot_with_KxN_backward(x, q, dot_items, x_dtype), q


def _KxN_backward(dot_items, x_dtype, q, dy):
  """dx = dy @ W[K, N]^T, a 16-bit dot as JAX's transpose of the 16-bit forward is (float32 sums, one rounding).
  A float32 dy (the epilogue's forward) is rounded to x's dtype first, where JAX's own transpose would run a
  float32 x 16-bit dot.

  The transposed copy is made physical behind a barrier: otherwise XLA folds the transpose into the dot's
  dimension numbers and runs the [N, K] order again. The barrier with dy keeps the copy from being made before
  the backward reaches this layer (the forward's reason for its barrier with x)."""
  del dot_items
  dy, q = jax.lax.optimization_barrier((dy.astype(x_dtype), q))
  w_KxN = jax.lax.optimization_barrier(_layer_NxK(q, dequantize_layer, x_dtype).T)
  return jnp.einsum("...n,kn->...k", dy, w_KxN), jax.tree_util.tree_map(_zero_cotangent, q)


_dot_with_KxN_backward.defvjp(_dot_with_KxN_forward, _KxN_backward)


def _dot_dequantized(x, q, dequantize_NxK, **dot_kwargs) -> jax.Array:
  if is_stacked(q):
    return jnp.matmul(x, dequantize(q, x.dtype), **dot_kwargs)
  return jnp.einsum("...k,nk->...n", x, _layer_NxK(q, dequantize_NxK, x.dtype), **dot_kwargs)


def _layer_NxK(q: NVFP4Tensor | Nvfp4Group, dequantize_NxK, dtype) -> jax.Array:
  """One layer's [sum of N, K] weight in dtype, a group's members stacked along N."""
  members = q.members if isinstance(q, Nvfp4Group) else (q,)
  return jnp.concatenate([dequantize_NxK(m, dtype) for m in members], axis=0)


def xla_dequant() -> str:
  """How the XLA path dequantizes a layer here: the tuning file's "xla_dequant" on a supported GPU, "xla" elsewhere
  (CPU, other GPUs). Benchmarks record it: it moves the peak memory the planner does not model."""
  return config_lib.xla_dequant(_device_kind()) if _gpu_supported() else "xla"


def xla_backward_layout() -> str:
  """The layout the XLA path's backward dequantizes into here: the tuning file's "xla_backward_layout" on a
  supported GPU, "NxK" (JAX's own transpose of the forward) elsewhere."""
  return config_lib.xla_backward_layout(_device_kind()) if _gpu_supported() else "NxK"


def pallas_dequant_applies(q: NVFP4Tensor, dtype) -> bool:
  """Whether the XLA path dequantizes this one-layer weight with the Pallas kernel (`nvfp4_dequant`): a supported
  GPU whose tuning file opts in ("xla_dequant": "pallas"), a 16-bit dtype and a shape its blocks tile, and no mesh
  (XLA has no partitioning rule for a Pallas call: it would gather the layer's FSDP shards to run it whole)."""
  if xla_dequant() != "pallas" or not jax.sharding.get_abstract_mesh().empty:
    return False
  launch = config_lib.decode_kernel_params("dequant", _device_kind())
  return nvfp4_dequant.supports(q, dtype, launch["block_n"], launch["block_b"])


def dequantize_layer(q: NVFP4Tensor, dtype) -> jax.Array:
  """One layer's [N, K] weight in dtype for the XLA path, the same bits whoever computes them (the tuning file's
  "xla_dequant" says who). The weight is a constant of the model's gradient (frozen base): neither the Pallas call
  nor the words' bitcast has a tangent to give, so they get a stopped weight."""
  if pallas_dequant_applies(q, dtype):
    return nvfp4_dequant.dequantize_NxK(jax.tree_util.tree_map(jax.lax.stop_gradient, q), dtype)
  if xla_dequant() == "words":
    return nvfp4.dequantize_NxK(jax.tree_util.tree_map(jax.lax.stop_gradient, q), dtype, words=True)
  return quant.dequantize_NxK(q, dtype)


def check_shapes(x_shape, x_dtype, q: NVFP4Tensor | Nvfp4Group, layer=None) -> tuple[int, int]:
  """Validates a call; returns (K, N). Raises ValueError naming the offending value."""
  if isinstance(q, Nvfp4Group):
    if not q.members:
      raise ValueError("an Nvfp4Group needs at least one member")
    ks, ns = zip(*(check_shapes(x_shape, x_dtype, m, layer) for m in q.members))
    if len({m.packed_NxKh.shape[:-2] for m in q.members}) > 1:
      raise ValueError(f"the group's members must be stacked alike: {[m.packed_NxKh.shape for m in q.members]}")
    return ks[0], sum(ns)
  if not isinstance(q, NVFP4Tensor):
    raise TypeError(f"q must be an NVFP4Tensor or an Nvfp4Group, got {type(q).__name__}")
  want_ndim = 2 if layer is None else 3
  if q.packed_NxKh.ndim != want_ndim or q.scale_NxKb.ndim != want_ndim:
    what = "2-D (one weight)" if layer is None else "3-D (stacked [L, ...] weights, with layer=)"
    raise ValueError(f"{q.packed_NxKh.shape=} and {q.scale_NxKb.shape=} must be {what}")
  lead = q.packed_NxKh.shape[:-2]
  n, kh = q.packed_NxKh.shape[-2:]
  k = 2 * kh
  if k % NVFP4_BLOCK:
    raise ValueError(f"{k=} (in_features) must be a multiple of {NVFP4_BLOCK}")
  if q.scale_NxKb.shape != (*lead, n, k // NVFP4_BLOCK):
    raise ValueError(f"{q.scale_NxKb.shape=} must be {(*lead, n, k // NVFP4_BLOCK)} for {q.packed_NxKh.shape=}")
  if layer is not None and (jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer)):
    raise ValueError(f"layer must be an integer scalar, got {layer!r}")
  if isinstance(layer, (int, np.integer)) and not 0 <= layer < lead[0]:
    # The kernels read the stack at layer * N unchecked; a traced index is the caller's (the model's scan) to keep.
    raise ValueError(f"layer={layer} is outside the stack of {lead[0]} weights")
  if q.packed_NxKh.dtype != jnp.uint8:
    raise ValueError(f"{q.packed_NxKh.dtype=} must be uint8")
  if q.scale_NxKb.dtype != jnp.float8_e4m3fn:
    raise ValueError(f"{q.scale_NxKb.dtype=} must be float8_e4m3fn")
  if len(x_shape) < 1 or x_shape[-1] != k:
    raise ValueError(f"x.shape={tuple(x_shape)} must end in K={k} for a weight of logical shape {(k, n)}")
  if not jnp.issubdtype(x_dtype, jnp.floating):
    raise ValueError(f"x.dtype={x_dtype} must be floating")
  return k, n


def _gpu_supported() -> bool:
  """A CUDA device whose Triton lowering converts fp8 (sm_89+: Ada, Hopper, Blackwell)."""
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  if dev.platform != "gpu":
    return False
  cc = getattr(dev, "compute_capability", None)
  try:
    return cc is not None and float(cc) >= 8.9
  except ValueError:
    return False


_device_kind = config_lib.device_kind  # a module attribute here, so tests can give the dispatch another device


def xla_min_rows() -> int | None:
  """From how many rows ``implementation=None`` picks the XLA path on this device (None: never)."""
  return config_lib.xla_min_rows(_device_kind()) if _gpu_supported() else None


def default_implementation(x_dtype, rows: int | None = None) -> str:
  """What ``implementation=None`` resolves to on this backend for activations of this dtype and row count.

  The fused kernels on a supported GPU, except from the device's measured ``xla_min_rows`` on (training-sized
  batches, where dequantizing one layer and using XLA's dot is faster); XLA elsewhere.
  """
  if jnp.dtype(x_dtype) in KERNEL_DTYPES and _gpu_supported():
    threshold = xla_min_rows()
    return "xla" if threshold is not None and rows is not None and rows >= threshold else "pallas"
  return "xla"


def _zero_cotangent(a: jax.Array):
  if jnp.issubdtype(a.dtype, jnp.floating):
    return jnp.zeros_like(a)
  return np.zeros(a.shape, dtype=jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _pallas_matmul_2d(x_MxK, q, layer, xa_MxR, b_RxN, bias_N, fwd_cfg, bwd_cfg, interpret, lora_scale):
  return nvfp4_matmul_fwd_pallas(x_MxK, *kernel_operands(q), config=fwd_cfg,
                                 interpret=interpret, layer=layer, xa_MxR=xa_MxR, b_RxN=b_RxN, bias_N=bias_N,
                                 lora_scale=lora_scale)


def _pallas_matmul_2d_fwd(x_MxK, q, layer, xa_MxR, b_RxN, bias_N, fwd_cfg, bwd_cfg, interpret, lora_scale):
  y = _pallas_matmul_2d(x_MxK, q, layer, xa_MxR, b_RxN, bias_N, fwd_cfg, bwd_cfg, interpret, lora_scale)
  return y, (q, layer, xa_MxR, b_RxN, bias_N)


def _pallas_matmul_2d_bwd(fwd_cfg, bwd_cfg, interpret, lora_scale, res, dy_MxN):
  q, layer, xa_MxR, b_RxN, bias_N = res
  dx_MxK = backward_dx(dy_MxN, q, layer, bwd_cfg, interpret)
  d_xa = d_b = d_bias = None
  if xa_MxR is not None:  # the epilogue's adapter term, lora_scale * xa @ B, differentiated in XLA
    dy = dy_MxN.astype(jnp.float32) * lora_scale
    d_xa = (dy @ b_RxN.astype(jnp.float32).T).astype(xa_MxR.dtype)
    d_b = (xa_MxR.astype(jnp.float32).T @ dy).astype(b_RxN.dtype)
  if bias_N is not None:
    d_bias = dy_MxN.astype(jnp.float32).sum(axis=0).astype(bias_N.dtype)
  return dx_MxK, jax.tree_util.tree_map(_zero_cotangent, q), _zero_cotangent(layer), d_xa, d_b, d_bias


_pallas_matmul_2d.defvjp(_pallas_matmul_2d_fwd, _pallas_matmul_2d_bwd)


def backward_dx(dy_MxN: jax.Array, q: NVFP4Tensor | Nvfp4Group, layer, bwd_cfg, interpret: bool) -> jax.Array:
  """dx = dy @ dequant(W)^T by the backward kernel. For a group, each member's dx from its columns of dy (in dy's
  dtype, as the separate projections' gradients are), summed in float32 and rounded once."""
  if not isinstance(q, Nvfp4Group):
    return nvfp4_matmul_bwd_pallas(dy_MxN, q.packed_NxKh, q.scale_NxKb, q.global_scale, config=bwd_cfg,
                                   interpret=interpret, layer=layer)
  m, k = dy_MxN.shape[0], q.shape[0]
  dx, start = jnp.zeros((m, k), jnp.float32), 0
  for member, n in zip(q.members, q.widths):
    cfg = config_lib.fit(bwd_cfg, "bwd", m, k, n)
    dx = dx + backward_dx(dy_MxN[:, start:start + n], member, layer, cfg, interpret).astype(jnp.float32)
    start += n
  return dx.astype(dy_MxN.dtype)


def _rows_over_mesh(fn, x_MxK: jax.Array, q: NVFP4Tensor, xa_MxR=None, b_RxN=None, bias_N=None) -> jax.Array:
  """`fn(x, q, xa, b, bias)`, run per device on its rows when a mesh is set (`jax.set_mesh`) with batch axes > 1.

  XLA has no partitioning rule for a Pallas call, so inside a sharded program it replicates the operands
  around it (x gathered, every row computed on every device). Under shard_map each device runs the kernel
  on its own rows (the batch axes of
  `qerl_jax.sharding`) with the whole weight, which XLA gathers from its FSDP shards as FSDP does; the
  tensor axis, if any, computes the same rows on each of its devices. xa (rows of x @ A) splits like x; the
  adapter's B and the bias are whole on every device.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(x_MxK, q, xa_MxR, b_RxN, bias_N)
  axes = tuple(a for a in BATCH if a in mesh.axis_names and mesh.shape[a] > 1)
  shards = int(np.prod([mesh.shape[a] for a in axes]))
  if not axes or x_MxK.shape[0] % shards:
    return fn(x_MxK, q, xa_MxR, b_RxN, bias_N)
  rows = P(axes, None)
  specs = (rows, P(), None if xa_MxR is None else rows, None if b_RxN is None else P(),
           None if bias_N is None else P())
  return jax.shard_map(fn, in_specs=specs, out_specs=rows, check_vma=False)(x_MxK, q, xa_MxR, b_RxN, bias_N)


def _layer_of(q: NVFP4Tensor, layer) -> NVFP4Tensor:
  """One layer of a stacked weight (a copy: only the paths that cannot read the stack in place use it)."""
  return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), q)


@functools.partial(jax.jit, static_argnames=("implementation", "interpret", "fwd_config", "bwd_config",
                                             "lora_scale", "tuning_version"))
def _nvfp4_matmul_jit(x, q, layer, xa, b, bias, *, implementation, interpret, fwd_config, bwd_config, lora_scale,
                      tuning_version):
  # tuning_version only keys the trace cache: the XLA path reads the tuning file while tracing ("xla_dequant",
  # the Pallas dequantization's launch), and a file changed in the same process would otherwise run the program
  # of the one read first.
  del tuning_version
  if layer is not None and (implementation == "xla" or not jax.sharding.get_abstract_mesh().empty):
    # The XLA reference dequantizes one layer; under a mesh, shard_map gathers one layer, not the stack.
    q, layer = _layer_of(q, layer), None
  k, n = q.shape
  lead = x.shape[:-1]
  xa_MxR = None if xa is None else xa.reshape(-1, xa.shape[-1])
  if implementation == "xla":
    return _reference_with_epilogue(x.reshape(-1, k), q, xa_MxR, b, bias, lora_scale).reshape(*lead, n)
  layer = jnp.int32(0) if layer is None else layer  # one weight is a stack of one
  # (A stacked q only reaches here without a mesh, where _rows_over_mesh calls the kernel directly.)
  kernel = lambda x_MxK, q, xa_MxR, b_RxN, bias_N: _pallas_matmul_2d(  # noqa: E731
      x_MxK, q, layer, xa_MxR, b_RxN, bias_N, fwd_config, bwd_config, interpret, lora_scale)
  y_MxN = _rows_over_mesh(kernel, x.reshape(-1, k), q, xa_MxR, b, bias)
  return y_MxN.reshape(*lead, n)


def _reference_with_epilogue(x_MxK, q, xa_MxR, b_RxN, bias_N, lora_scale):
  """The XLA path with the kernels' epilogue: float32 sum of the three terms, rounded once."""
  if xa_MxR is None and bias_N is None:
    return xla_path_matmul(x_MxK, q)
  y = xla_path_matmul(x_MxK, q, preferred_element_type=jnp.float32)
  return nvfp4_epilogue.add_in_xla(y, xa_MxR, b_RxN, bias_N, lora_scale).astype(x_MxK.dtype)


def nvfp4_matmul(x: jax.Array, q: NVFP4Tensor | Nvfp4Group, *, layer=None, bias: jax.Array | None = None,
                 lora: tuple[jax.Array, jax.Array, float] | None = None, implementation: str | None = None,
                 interpret: bool = False, fwd_config: config_lib.Nvfp4MatmulConfig | None = None,
                 bwd_config: config_lib.Nvfp4MatmulConfig | None = None) -> jax.Array:
  """y = x @ dequantize(q, x.dtype) [+ bias + scale * xa @ B] without materializing the 16-bit weight.

  Args:
    x: activations [..., K], bf16 or fp16 for the kernels (other float dtypes use the XLA path).
    q: NVFP4Tensor of logical shape [K, N] (``qerl_jax.quant.quantize(w, "nvfp4")``), or a stack of them
      ([L, N, K/2] packed, as the model stores layers) with ``layer`` given, or an ``Nvfp4Group`` of
      either (weights of one input, one launch: y is [..., sum of their N]).
    layer: with a stacked q, the integer scalar (may be traced, e.g. a scan's layer index) of the weight to
      use. The kernels read that layer in place: a `lax.scan` over layers that slices the stack would
      otherwise copy every layer's weight before each matmul.
    implementation: "pallas" (fused Pallas/Triton kernels), "xla" (dequantize then dot), "triton"
      (reserved for a jax-triton kernel; not built, raises), or None for the fastest one available here
      (the kernels on a supported GPU below the device's measured ``xla_min_rows``, else XLA).
    bias: optional [N], added in the kernels' epilogue.
    lora: optional (xa [..., r] = x @ A, B [r, N], scale): scale * xa @ B is added in the epilogue, in
      float32, so the output is rounded once (``qerl_kernels/nvfp4_epilogue.py``). Differentiable in xa and B.
    interpret: run the Pallas kernels in interpret mode (any backend, for tests).
    fwd_config / bwd_config: tile configs; None picks the tuned or heuristic one for the shape.
  Returns:
    y [..., N] in x's dtype. Differentiable in x, bias and the adapter (the weight is treated as a constant).
  """
  k, n = check_shapes(x.shape, x.dtype, q, layer)
  xa, b, lora_scale = _check_epilogue(x.shape, n, bias, lora)
  m = int(np.prod(x.shape[:-1]))
  if implementation is None:
    implementation = "pallas" if interpret else default_implementation(x.dtype, m)
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS} or None")
  if implementation == "triton":
    raise NotImplementedError("implementation='triton' (a jax-triton kernel) is not built; use 'pallas', "
                              "which lowers to Triton through Pallas, or 'xla'")
  if implementation == "pallas":
    if jnp.dtype(x.dtype) not in KERNEL_DTYPES:
      raise ValueError(f"x.dtype={x.dtype} is not supported by the pallas kernels (bf16, fp16)")
    if not interpret and not _gpu_supported():
      raise ValueError("implementation='pallas' needs a CUDA GPU with compute capability >= 8.9 "
                       "(or interpret=True)")
    if m == 0 or n == 0:  # no launch for an empty product
      return jnp.zeros((*x.shape[:-1], n), x.dtype)
    kind = None if interpret else _device_kind()
    if fwd_config is None:
      fwd_config = config_lib.get_config("fwd", m, k, n, kind)
    else:
      fwd_config = config_lib.fit(fwd_config, "fwd", m, k, n)
    if bwd_config is None:
      bwd_config = config_lib.get_config("bwd", m, k, n, kind)
    else:
      bwd_config = config_lib.fit(bwd_config, "bwd", m, k, n)
  return _nvfp4_matmul_jit(x, q, layer, xa, b, bias, implementation=implementation, interpret=interpret,
                           fwd_config=fwd_config, bwd_config=bwd_config, lora_scale=lora_scale,
                           tuning_version=config_lib.tuning_version(_device_kind() if _gpu_supported() else None))


def _check_epilogue(x_shape, n: int, bias, lora):
  """(xa, B, scale) of a valid epilogue (None, None, 0.0 without an adapter); raises ValueError otherwise."""
  if bias is not None and tuple(bias.shape) != (n,):
    raise ValueError(f"bias.shape={tuple(bias.shape)} must be ({n},) for a weight with N={n}")
  if lora is None:
    return None, None, 0.0
  xa, b, scale = lora
  if xa.ndim != len(x_shape) or tuple(xa.shape[:-1]) != tuple(x_shape[:-1]):
    raise ValueError(f"lora xa.shape={tuple(xa.shape)} must be x's leading dims {tuple(x_shape[:-1])} + (r,)")
  if tuple(b.shape) != (xa.shape[-1], n):
    raise ValueError(f"lora B.shape={tuple(b.shape)} must be (r={xa.shape[-1]}, N={n})")
  return xa, b, float(scale)
