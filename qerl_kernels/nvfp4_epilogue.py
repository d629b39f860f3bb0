"""The forward kernels' epilogue: y = x @ W + bias + scale * xa @ B, rounded once to the output dtype.

An unmerged LoRA adapter and a bias on a projection otherwise cost a decode step separate XLA kernels per
projection (the xa @ B product, the scaling, the additions): at 0708d08 a 7B decode step ran about 25 small
kernels per layer beside the 7 matmuls, 2.2 ms of a 6.0 ms step at batch 1, each a few microseconds at
decode sizes. Here they ride on the matmul: xa = x @ A [M, r] comes in (a K-long contraction per rank, which
XLA does once per input) with B [r, N] and the bias [N], and the output tile adds xa @ B (one tensor-core dot in
the tile kernels, r outer products in the gemv) before its store. With split-K only split 0 adds them (the
splits are summed afterwards).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class Epilogue:
  """Static description of the epilogue operands a launch carries (after the weight operands)."""

  rank: int = 0  # LoRA rank r; 0: no adapter (then no xa / B operands)
  scale: float = 0.0  # the adapter's alpha / r
  bias: bool = False  # a bias [N] operand follows the adapter's

  @property
  def num_refs(self) -> int:
    return 2 * (self.rank > 0) + int(self.bias)


def operands(xa_MxR: jax.Array | None, b_RxN: jax.Array | None, bias_N: jax.Array | None,
             scale: float) -> tuple[list[jax.Array], Epilogue]:
  """The epilogue's kernel operands (xa, B, bias: those given, in this order) and their description."""
  ops = []
  rank = 0
  if xa_MxR is not None:
    rank = xa_MxR.shape[-1]
    ops += [xa_MxR, b_RxN]
  if bias_N is not None:
    ops.append(bias_N)
  return ops, Epilogue(rank=rank, scale=float(scale) if rank else 0.0, bias=bias_N is not None)


def term(refs, epi: Epilogue, rows, row_mask, cols, col_mask, *, dot: bool = False) -> jax.Array | float:
  """float32 [rows, cols] to add to an output tile (0.0 when the epilogue is empty).

  refs: the epilogue refs in ``operands`` order; rows / cols: ``pl.ds`` slices of the output tile, with
  masks for the rows and columns past the array (row_mask None: every row exists).
  dot: xa @ B as one tensor-core dot of the [rows, r] and [r, cols] tiles (r padded to a power of two >= 16 by
  masked loads; tiles of 16+ rows), not r outer products on the CUDA cores. The tile kernels take it: at
  e7ec3b0 the outer products made the fused epilogue cost 0.33 ms per 7B step at batch 8 and 1.4 at 64.
  """
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel

  out = 0.0
  if epi.rank and dot:
    xa_ref, b_ref = refs[0], refs[1]
    r_pad = max(16, 1 << (epi.rank - 1).bit_length())
    in_rank = jnp.arange(r_pad) < epi.rank
    xa_MxR = plgpu.load(xa_ref.at[rows, pl.ds(0, r_pad)], mask=row_mask[:, None] & in_rank[None, :], other=0.0)
    b_RxN = plgpu.load(b_ref.at[pl.ds(0, r_pad), cols], mask=in_rank[:, None] & col_mask[None, :], other=0.0)
    # In the wider of the two dtypes, as the outer products' float32 would be; float32 at full precision (the
    # dot's default would round it to tf32 on the GPU). The model's xa and B are both B's dtype (bf16).
    dtype = jnp.promote_types(xa_MxR.dtype, b_RxN.dtype)
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    out = jax.lax.dot_general(xa_MxR.astype(dtype), b_RxN.astype(dtype), (((1,), (0,)), ((), ())),
                              precision=precision, preferred_element_type=jnp.float32) * jnp.float32(epi.scale)
  elif epi.rank:
    xa_ref, b_ref = refs[0], refs[1]
    acc = None
    for r in range(epi.rank):
      rank = jnp.int32(r)  # Pallas indexes refs with traced ints, not Python ones
      # (Triton takes no fill value without a mask: the gemv passes row_mask None, every row exists.)
      xa_M = (plgpu.load(xa_ref.at[rows, rank]) if row_mask is None
              else plgpu.load(xa_ref.at[rows, rank], mask=row_mask, other=0.0)).astype(jnp.float32)
      b_N = plgpu.load(b_ref.at[rank, cols], mask=col_mask, other=0.0).astype(jnp.float32)
      outer = xa_M[:, None] * b_N[None, :]
      acc = outer if acc is None else acc + outer
    out = acc * jnp.float32(epi.scale)
  if epi.bias:
    bias_N = plgpu.load(refs[epi.num_refs - 1].at[cols], mask=col_mask, other=0.0).astype(jnp.float32)
    out = out + bias_N[None, :]
  return out


def add_in_xla(y_MxN: jax.Array, xa_MxR: jax.Array | None, b_RxN: jax.Array | None, bias_N: jax.Array | None,
               scale: float) -> jax.Array:
  """y + scale * xa @ B + bias in float32 (y float32 [M, N]), for the paths that add the epilogue's terms outside
  a kernel (the XLA reference, the Mosaic GPU kernel); the caller rounds once, as the kernels' epilogue does."""
  if xa_MxR is not None:
    y_MxN = y_MxN + scale * (xa_MxR.astype(jnp.float32) @ b_RxN.astype(jnp.float32))
  if bias_N is not None:
    y_MxN = y_MxN + bias_N.astype(jnp.float32)
  return y_MxN
