"""The MLP's middle at a decode step in one kernel: gate|up's split-K partials and LoRA terms, then SwiGLU.

At a batch-1 7B decode step the gate|up group launch (``nvfp4_gemv.nvfp4_gemv_xa_pallas``) leaves float32 partial
sums of y = h @ [W_gate | W_up] over its K split and of the adapters' x @ [A_gate | A_up]. XLA then ran three
small kernels per layer before down_proj's gemv (the x @ A sum; the partials' sum with each adapter's
up-projection; SiLU(gate) * up), ~157 us per step at 86dbcd0. Here one launch does it, its programs over column
blocks of N: unlike a norm there is nothing to reduce across a row. On an H200 at e127210 it took 4.75 us per
call (133 us per step; experiments/RESULTS.md, "At e127210").

Rounding follows the unfused model (``swiglu_reference``; `qerl_jax.model.linear.merged_linears` and
`qerl_jax.model.transformer._layer`): y's sum rounded to x's dtype, each projection's bias and adapter term added
and rounded as `linear._add_terms` does, then SiLU(g) * u in float32, rounded once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qerl_kernels import config as config_lib


def swiglu_kernel(parts_ref, *refs, n: int, block_n: int, num_parts: int, xa_parts: int, rank: int,
                  lora_scale: float, bias: bool):
  """Columns [j * block_n, ...) of row ``program_id(0)`` (j = ``program_id(1)``): m = SiLU(g) * u.

  parts_ref [S, M, 2N] (float32 partial sums of [gate | up], or x's dtype when S = 1); with ``rank``, xa_ref
  float32 [P, M, R >= 2 rank] (x @ [A_gate | A_up | 0...] partials), bg_ref and bu_ref [rank, N]; with ``bias``
  biasg_ref, biasu_ref [N]; then m_ref [M, N] in x's dtype.
  """
  refs = list(refs)
  xa_ref, bg_ref, bu_ref = (refs.pop(0), refs.pop(0), refs.pop(0)) if rank else (None, None, None)
  biasg_ref, biasu_ref = (refs.pop(0), refs.pop(0)) if bias else (None, None)
  (m_ref,) = refs
  m, j = pl.program_id(0), pl.program_id(1)
  dtype = m_ref.dtype
  c0 = j * block_n
  valid = c0 + jnp.arange(block_n) < n

  def rounded(v):  # to x's dtype and back: each rounding of the unfused model
    return v.astype(dtype).astype(jnp.float32)

  def load(ref_at):
    return plgpu.load(ref_at, mask=valid, other=0).astype(jnp.float32)

  if rank:  # x @ [A_gate | A_up]: the partials' float32 sum, rounded to B's dtype, then each member's columns
    pp = pl.next_power_of_2(xa_parts)
    real = (jnp.arange(pp) < xa_parts)[:, None]
    xas = [jnp.sum(plgpu.load(xa_ref.at[pl.ds(0, pp), m, pl.ds(first, rank)], mask=real, other=0.0), axis=0)
           .astype(bg_ref.dtype).astype(jnp.float32) for first in (0, rank)]
  halves = []
  for half, (b_ref, bias_ref) in enumerate(((bg_ref, biasg_ref), (bu_ref, biasu_ref))):
    y = rounded(sum(load(parts_ref.at[jnp.int32(s), m, pl.ds(half * n + c0, block_n)]) for s in range(num_parts)))
    if bias:
      y = rounded(y + load(bias_ref.at[pl.ds(c0, block_n)]))
    if rank:
      b_RxC = plgpu.load(b_ref.at[pl.ds(0, rank), pl.ds(c0, block_n)], mask=valid[None, :], other=0).astype(
          jnp.float32)
      y = rounded(y + rounded(jnp.sum(xas[half][:, None] * b_RxC, axis=0) * jnp.float32(lora_scale)))
    halves.append(y)
  g, u = halves
  plgpu.store(m_ref.at[m, pl.ds(c0, block_n)], (jax.nn.silu(g) * u).astype(dtype), mask=valid)


def _check(parts_Sx_Mx2N, n, xa_PxMxR, b_gate_RxN, b_up_RxN, bias_gate_N, bias_up_N):
  if parts_Sx_Mx2N.ndim != 3 or parts_Sx_Mx2N.shape[2] != 2 * n:
    raise ValueError(f"swiglu: partials {parts_Sx_Mx2N.shape} must be [S, M, 2N] with N={n}")
  bs = (b_gate_RxN, b_up_RxN)
  if (xa_PxMxR is None) != (b_gate_RxN is None) or (b_gate_RxN is None) != (b_up_RxN is None):
    raise ValueError("swiglu: the adapters need x @ A partials and both B's, or none of them")
  if xa_PxMxR is not None:
    rank = b_gate_RxN.shape[0]
    if (any(b.shape != (rank, n) for b in bs) or xa_PxMxR.ndim != 3 or xa_PxMxR.shape[1] != parts_Sx_Mx2N.shape[1]
        or xa_PxMxR.shape[2] < 2 * rank or rank & (rank - 1)):
      raise ValueError(f"swiglu: B's {b_gate_RxN.shape} / {b_up_RxN.shape} must both be [r, N={n}] (r a power of "
                       f"two) and x @ A partials {xa_PxMxR.shape} [P, M, >= 2r]")
  if (bias_gate_N is None) != (bias_up_N is None) or any(
      b is not None and b.shape != (n,) for b in (bias_gate_N, bias_up_N)):
    raise ValueError("swiglu: biases must be given for both projections ([N]) or neither")


@functools.partial(jax.jit, static_argnames=("n", "dtype", "lora_scale", "block_n", "num_warps", "interpret"))
def swiglu(parts_Sx_Mx2N: jax.Array, *, n: int, dtype, xa_PxMxR: jax.Array | None = None,
           b_gate_RxN: jax.Array | None = None, b_up_RxN: jax.Array | None = None, lora_scale: float = 1.0,
           bias_gate_N: jax.Array | None = None, bias_up_N: jax.Array | None = None, block_n: int | None = None,
           num_warps: int | None = None, interpret: bool = False) -> jax.Array:
  """m [M, N] in ``dtype`` = SiLU(g) * u, [g | u] = sum(parts) + biases + each adapter's term, one launch.

  parts_Sx_Mx2N: the gate|up group launch's split-K partial sums (float32; or its finished output in ``dtype``,
  S = 1). xa_PxMxR: float32 partials of x @ [A_gate | A_up | zero padding] (the group's A), with the two
  adapters' B's [r, N]. block_n: columns per program (a power of two); it and num_warps default to the device's
  tuning (``config.decode_launch``).
  """
  _check(parts_Sx_Mx2N, n, xa_PxMxR, b_gate_RxN, b_up_RxN, bias_gate_N, bias_up_N)
  launch = config_lib.decode_launch("swiglu", interpret, block_n=block_n, num_warps=num_warps)
  block_n, num_warps = launch["block_n"], launch["num_warps"]
  if block_n < 16 or block_n & (block_n - 1):
    raise ValueError(f"swiglu: {block_n=} must be a power of two >= 16")
  m = parts_Sx_Mx2N.shape[1]
  rank = 0 if b_gate_RxN is None else b_gate_RxN.shape[0]
  operands = [parts_Sx_Mx2N]
  if rank:
    operands += [xa_PxMxR.astype(jnp.float32), b_gate_RxN, b_up_RxN]
  if bias_gate_N is not None:
    operands += [bias_gate_N, bias_up_N]
  block_n = min(block_n, pl.next_power_of_2(n))
  kernel = functools.partial(swiglu_kernel, n=n, block_n=block_n, num_parts=parts_Sx_Mx2N.shape[0],
                             xa_parts=0 if xa_PxMxR is None else xa_PxMxR.shape[0], rank=rank,
                             lora_scale=float(lora_scale), bias=bias_gate_N is not None)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), dtype),
      grid=(m, pl.cdiv(n, block_n)),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="decode_swiglu",
  )(*operands)


def swiglu_reference(parts_Sx_Mx2N: jax.Array, *, n: int, dtype, xa_PxMxR: jax.Array | None = None,
                     b_gate_RxN: jax.Array | None = None, b_up_RxN: jax.Array | None = None,
                     lora_scale: float = 1.0, bias_gate_N: jax.Array | None = None,
                     bias_up_N: jax.Array | None = None) -> jax.Array:
  """`swiglu` in jnp, in the unfused model's order of operations."""
  y = parts_Sx_Mx2N.astype(jnp.float32).sum(axis=0).astype(dtype)
  halves = [y[:, :n], y[:, n:]]
  if bias_gate_N is not None:
    halves = [h + b.astype(dtype) for h, b in zip(halves, (bias_gate_N, bias_up_N))]
  if b_gate_RxN is not None:
    rank = b_gate_RxN.shape[0]
    xa = xa_PxMxR.astype(jnp.float32).sum(axis=0).astype(b_gate_RxN.dtype)
    ups = [jnp.einsum("mr,rn->mn", xa[:, first:first + rank], b, preferred_element_type=jnp.float32) * lora_scale
           for first, b in ((0, b_gate_RxN), (rank, b_up_RxN))]
    halves = [h + up.astype(dtype) for h, up in zip(halves, ups)]
  g, u = (h.astype(jnp.float32) for h in halves)
  return (jax.nn.silu(g) * u).astype(dtype)
