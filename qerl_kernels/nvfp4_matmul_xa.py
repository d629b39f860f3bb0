"""y = x @ dequantize(q) and a LoRA adapter's x @ A from one few-row launch (``nvfp4_gemv.nvfp4_gemv_xa_pallas``).

At a decode step the adapter's x @ A is a few hundred KB of A against one x row, and XLA runs it as small
kernels of its own (a product and a column reduction; on an H200 at e0f3129 ~21 us per 7B layer over the four
projection groups, 12% of a batch-1 step). Here the gemv's grid gets extra programs that read A while the
others stream the weight. Where that launch does not apply (more rows than the gemv takes, a tile config, a
rank that is not a power of two, a mesh, the XLA path) both products are computed the usual way.
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp

from qerl_kernels import config as config_lib
from qerl_kernels.nvfp4_gemv import nvfp4_gemv_xa_pallas, nvfp4_gemv_xa_partials, xa_rank_supported
from qerl_jax.quant.types import NVFP4Tensor

# The module, not the package attribute of the same name (the function `qerl_kernels.nvfp4_matmul`).
mm = importlib.import_module("qerl_kernels.nvfp4_matmul")


def nvfp4_matmul_xa(x: jax.Array, q: NVFP4Tensor | mm.Nvfp4Group, a_KxR: jax.Array, *, layer=None,
                    interpret: bool = False, fwd_config: config_lib.Nvfp4MatmulConfig | None = None
                    ) -> tuple[jax.Array, jax.Array]:
  """(x @ dequantize(q, x.dtype) in x's dtype, x @ A in float32 [..., r]).

  Args:
    x, q, layer, interpret: as for ``qerl_kernels.nvfp4_matmul``.
    a_KxR: the adapter's A [K, r] (float32 or bf16). x @ A is x cast to A's dtype times A, accumulated in
      float32 (PEFT's order; the caller casts it to B's dtype).
    fwd_config: the few-row config (None: the tuned or heuristic one). The shared launch needs the gemv
      engine; otherwise the two products run separately.
  Returns:
    (y, xa). Differentiable in x and A (the weight is a constant).
  """
  k, n = mm.check_shapes(x.shape, x.dtype, q, layer)
  if a_KxR.ndim != 2 or a_KxR.shape[0] != k:
    raise ValueError(f"A.shape={tuple(a_KxR.shape)} must be (K={k}, r)")
  m, rank = math.prod(x.shape[:-1]), a_KxR.shape[1]
  cfg = _shared_config(x, q, rank, layer, interpret, fwd_config)
  if cfg is None:
    y = mm.nvfp4_matmul(x, q, layer=layer, interpret=interpret, fwd_config=fwd_config)
    xa = jnp.einsum("...k,kr->...r", x.astype(a_KxR.dtype), a_KxR, preferred_element_type=jnp.float32)
    return y, xa
  kind = None if interpret else mm._device_kind()  # pylint: disable=protected-access
  bwd_cfg = config_lib.get_config("bwd", m, k, n, kind)
  layer = jnp.int32(0) if layer is None else layer  # one weight is a stack of one
  y_MxN, xa_MxR = _shared_launch(x.reshape(m, k), q, layer, a_KxR, cfg, bwd_cfg, interpret)
  return y_MxN.reshape(*x.shape[:-1], n), xa_MxR.reshape(*x.shape[:-1], rank)


def nvfp4_matmul_xa_partials(x: jax.Array, q: NVFP4Tensor | mm.Nvfp4Group, a_KxR: jax.Array, *, layer=None,
                             interpret: bool = False, fwd_config: config_lib.Nvfp4MatmulConfig | None = None,
                             tiles: bool = False) -> tuple[jax.Array, jax.Array]:
  """The shared launch's outputs before their sums: (y partials [S, M, N], x @ A partials [P, M, r] float32).

  x [..., K] (M rows in all), or a ``decode_residual_norm.PendingNorm`` of that shape: the gemv then reads the
  norm of its x (``nvfp4_gemv.NormPlan``) and the norm's own launch never runs (the tile path runs it first).
  Only where ``partials_launch_applies`` holds (else ValueError); not differentiable.
  A consumer kernel adds the partials (``qerl_kernels.decode_residual_norm``), which saves XLA's kernels for them.
  With ``tiles``, a few-row call that the tile kernels take (3-16 rows on an H200) gives their split-K partials
  and XLA's x @ A as one partial (P = 1): the same consumer kernels then end the step at those rows too.
  """
  from qerl_kernels.decode_residual_norm import PendingNorm  # pylint: disable=import-outside-toplevel
  mm.check_shapes(x.shape, x.dtype, q, layer)
  k = x.shape[-1]
  cfg = _shared_config(x, q, a_KxR.shape[-1], layer, interpret, fwd_config)
  if cfg is not None:
    x_MxK = x if isinstance(x, PendingNorm) else x.reshape(-1, k)  # a pending norm's x is [M, K] already
    return _partials_launch(x_MxK, q, jnp.int32(0) if layer is None else layer, a_KxR, cfg, interpret)
  cfg = _tile_config(x, q, layer, interpret, fwd_config) if tiles else None
  if cfg is None:
    raise ValueError(f"x {x.shape} and A {a_KxR.shape} do not share a gemv launch here, and {tiles=} gives no "
                     "tile launch (partials_launch_applies)")
  if isinstance(x, PendingNorm):
    x = x.materialize()
  return _tile_partials(x.reshape(-1, k), q, layer, a_KxR, cfg, interpret)


def partials_launch_applies(x: jax.Array, q: NVFP4Tensor | mm.Nvfp4Group, rank: int, *, layer=None,
                            interpret: bool = False, fwd_config: config_lib.Nvfp4MatmulConfig | None = None,
                            tiles: bool = False) -> bool:
  """Whether ``nvfp4_matmul_xa_partials`` (same arguments) has a launch for this call."""
  return (xa_shares_launch(x, q, rank, layer=layer, interpret=interpret, fwd_config=fwd_config)
          or tiles and _tile_config(x, q, layer, interpret, fwd_config) is not None)


def xa_shares_launch(x: jax.Array, q: NVFP4Tensor | mm.Nvfp4Group, rank: int, *, layer=None,
                     interpret: bool = False, fwd_config: config_lib.Nvfp4MatmulConfig | None = None) -> bool:
  """Whether ``nvfp4_matmul_xa`` (same arguments, A of this rank) computes x @ A in the gemv's launch.

  Where it does not, a caller may prefer its own x @ A (the model concatenates the A's that share an input).
  """
  mm.check_shapes(x.shape, x.dtype, q, layer)
  return _shared_config(x, q, rank, layer, interpret, fwd_config) is not None


def _few_row_config(x, q, layer, interpret, fwd_config) -> config_lib.Nvfp4MatmulConfig | None:
  """The fitted forward config of a call of at most GEMV_MAX_ROWS rows that the Pallas kernels take, else None."""
  k, n = mm.check_shapes(x.shape, x.dtype, q, layer)
  m = math.prod(x.shape[:-1])
  if not (0 < m <= config_lib.GEMV_MAX_ROWS and jnp.dtype(x.dtype) in mm.KERNEL_DTYPES
          and jax.sharding.get_abstract_mesh().empty
          and (interpret or mm.default_implementation(x.dtype, m) == "pallas")):
    return None
  kind = None if interpret else mm._device_kind()  # pylint: disable=protected-access
  return (config_lib.get_config("fwd", m, k, n, kind) if fwd_config is None
          else config_lib.fit(fwd_config, "fwd", m, k, n))


def _shared_config(x, q, rank, layer, interpret, fwd_config) -> config_lib.Nvfp4MatmulConfig | None:
  """The gemv config of the shared launch, or None where the two products run separately."""
  cfg = _few_row_config(x, q, layer, interpret, fwd_config) if xa_rank_supported(rank) else None
  return cfg if cfg is not None and cfg.engine == "gemv" else None


def _tile_config(x, q, layer, interpret, fwd_config) -> config_lib.Nvfp4MatmulConfig | None:
  """The tile config of a few-row call the Pallas tile kernels take, else None."""
  cfg = _few_row_config(x, q, layer, interpret, fwd_config)
  return cfg if cfg is not None and cfg.engine == "tensorcore" else None


@functools.partial(jax.jit, static_argnums=(4, 5))
def _tile_partials(x_MxK, q, layer, a_KxR, cfg, interpret):
  from qerl_kernels.nvfp4_matmul_fwd import nvfp4_matmul_fwd_pallas  # pylint: disable=import-outside-toplevel
  parts = nvfp4_matmul_fwd_pallas(x_MxK, *mm.kernel_operands(q), config=cfg, interpret=interpret,
                                  layer=layer if mm.is_stacked(q) else None, sum_splits=False)
  xa_MxR = jnp.einsum("mk,kr->mr", x_MxK.astype(a_KxR.dtype), a_KxR, preferred_element_type=jnp.float32)
  return parts, xa_MxR[None]


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _shared_launch(x_MxK, q, layer, a_KxR, cfg, bwd_cfg, interpret):
  return _gemv_xa(x_MxK, q, layer, a_KxR, cfg, bwd_cfg, interpret)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _partials_launch(x_MxK, q, layer, a_KxR, cfg, interpret):
  return nvfp4_gemv_xa_partials(x_MxK, *mm.kernel_operands(q), a_KxR, config=cfg, interpret=interpret,
                                layer=layer if mm.is_stacked(q) else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _gemv_xa(x_MxK, q, layer, a_KxR, cfg, bwd_cfg, interpret):
  return nvfp4_gemv_xa_pallas(x_MxK, *mm.kernel_operands(q), a_KxR, config=cfg, interpret=interpret,
                              layer=layer if mm.is_stacked(q) else None)


def _gemv_xa_fwd(x_MxK, q, layer, a_KxR, cfg, bwd_cfg, interpret):
  return _gemv_xa(x_MxK, q, layer, a_KxR, cfg, bwd_cfg, interpret), (x_MxK, q, layer, a_KxR)


def _gemv_xa_bwd(cfg, bwd_cfg, interpret, res, cotangents):
  x_MxK, q, layer, a_KxR = res
  dy_MxN, dxa_MxR = cotangents
  dx_MxK = mm.backward_dx(dy_MxN, q, layer if mm.is_stacked(q) else None, bwd_cfg, interpret)
  dxa_MxR = dxa_MxR.astype(jnp.float32)
  a_f32 = a_KxR.astype(jnp.float32)
  dx_MxK = (dx_MxK.astype(jnp.float32) + dxa_MxR @ a_f32.T).astype(x_MxK.dtype)
  da_KxR = (x_MxK.astype(a_KxR.dtype).astype(jnp.float32).T @ dxa_MxR).astype(a_KxR.dtype)
  return (dx_MxK, jax.tree_util.tree_map(mm._zero_cotangent, q),  # pylint: disable=protected-access
          mm._zero_cotangent(layer), da_KxR)  # pylint: disable=protected-access


_gemv_xa.defvjp(_gemv_xa_fwd, _gemv_xa_bwd)
