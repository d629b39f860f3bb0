"""Forward NVFP4 weight-only matmul: y[M, N] = x[M, K] @ dequant(W)[K, N], dequantization fused.

One Pallas (Triton backend) kernel serves decode and prefill; the config picks the shape of work:
- few rows: block_m = 16 and split-K, so that N / block_n * split programs keep every SM streaming packed
  weights (the problem is memory-bound; float32 partial sums are added by XLA afterwards);
- many rows: large tensor-core tiles with Triton's software pipelining (num_stages), grouped tile order.
The product is computed "swapped" (acc[N, M] = W_tile @ x_tile^T), as Marlin-style kernels do: the weight
tile, decoded in registers, is the left operand and the few activation rows are the narrow right operand,
so a 16-row batch wastes no tensor-core width.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qerl_kernels import config as config_lib, nvfp4_epilogue, nvfp4_tile
from qerl_kernels.config import HALVES_DECODERS, Nvfp4MatmulConfig
from qerl_kernels.nvfp4_epilogue import Epilogue
from qerl_kernels.nvfp4_gemv import nvfp4_gemv_pallas


def _tile_ids(pid, num_m: int, num_n: int, group_m: int):
  """Grouped order: group_m row tiles sweep each weight column tile together (weight reuse in L2)."""
  width = group_m * num_n
  group = pid // width
  first_m = group * group_m
  rows_in_group = jnp.minimum(num_m - first_m, group_m)
  pid_m = first_m + (pid % width) % rows_in_group
  pid_n = (pid % width) // rows_in_group
  return pid_m, pid_n


class TailPlan(NamedTuple):
  """A launch whose last column blocks split along K (``Nvfp4MatmulConfig.tail_slots``)."""
  whole: int  # programs 0 .. whole - 1 take column blocks 0 .. whole - 1 whole
  parts: int  # each later block in this many K ranges, one program each
  first_col: int  # the output column where block ``whole`` starts (the partials' column 0)


def tail_plan(cfg: Nvfp4MatmulConfig, m: int, steps: int, widths: tuple[int, ...]) -> TailPlan | None:
  """The tail split of a forward launch, or None where it does not apply: tail_slots off, a split already, more
  than one row tile, blocks that fill whole rounds (or less than one), or a tail too long to split.

  The blocks past the last whole round of ``tail_slots`` programs would run alone while the rest of the GPU idles;
  split into about tail_slots programs of a few K steps they fill the next round instead."""
  if not cfg.tail_slots or cfg.split != 1 or m > cfg.block_m:
    return None
  blocks = nvfp4_tile.column_blocks(widths, cfg.block_n)
  whole = blocks // cfg.tail_slots * cfg.tail_slots
  tail = blocks - whole
  if not whole or not tail:
    return None
  parts = config_lib.split_trips(steps, max(1, min(steps, cfg.tail_slots // tail)))[1]
  if parts < 2:
    return None
  # where block ``whole`` starts in y: in the last member whose blocks start at or before it
  first, _, offset = [span for span in nvfp4_tile.member_spans(widths, cfg.block_n) if span[0] <= whole][-1]
  return TailPlan(whole, parts, offset + (whole - first) * cfg.block_n)


def halves_order(a_MxK: jax.Array, block_k: int) -> jax.Array:
  """Reorders each run of block_k columns to (its even columns, its odd columns), the "halves" layout."""
  m, k = a_MxK.shape
  return a_MxK.reshape(m, k // block_k, block_k // 2, 2).swapaxes(2, 3).reshape(m, k)


def logical_order(a_MxK: jax.Array, block_k: int) -> jax.Array:
  """The inverse of ``halves_order``."""
  m, k = a_MxK.shape
  return a_MxK.reshape(m, k // block_k, 2, block_k // 2).swapaxes(2, 3).reshape(m, k)


def nvfp4_matmul_fwd_kernel(x_ref, layer_ref, *refs, widths: tuple[int, ...], block_m: int, block_n: int,
                            block_k: int, steps: int, group_m: int, split: int, dequant: str = "jnp",
                            epilogue: Epilogue = Epilogue(), x_in_place: bool = False, tail: TailPlan | None = None):
  """One [block_m, block_n] output tile over one contraction split.

  x_ref [M, K] (with a halves-layout dequant, each block_k run of columns holds the run's even columns,
  then its odd ones: see ``halves_order``; with ``x_in_place`` x as it is, split in registers); layer_ref
  int32 [1]; then per weight of ``widths`` (one, or a
  group's members along N: ``nvfp4_tile.group_operands``) packed_ref uint8 [L*N, K/2], scale_ref e4m3
  [L*N, K/16], gs_ref f32 [L] (rows layer*N .. layer*N + N are the weight); then the epilogue's refs
  (``nvfp4_epilogue``), then o_ref [M, sum of N] (x dtype) when split == 1, else float32 partials
  [split, M, sum of N]. steps: K steps of block_k in all, in ``split`` ranges (``nvfp4_tile.split_range``).
  tail (split 1, one row tile): programs past ``tail.whole`` take the last column blocks in ``tail.parts`` K ranges
  each and write float32 partials [parts, M, N - tail.first_col] to one more output ref, after o_ref.
  """
  weights = [refs[3 * i:3 * i + 3] for i in range(len(widths))]
  *epi_refs, o_ref = refs[3 * len(widths):len(refs) - (1 if tail else 0)]
  m, _ = x_ref.shape
  num_m = pl.cdiv(m, block_m)

  def run(pid_m, pid_n, pid_s, out_ref, ranges, col_shift):
    def member_tile(member, pid_n, col_offset):
      _tile(x_ref, layer_ref, *weights[member], epi_refs, out_ref, pid_m, pid_n, pid_s, n=widths[member],
            col_offset=col_offset, block_m=block_m, block_n=block_n, block_k=block_k, steps=steps, split=ranges,
            dequant=dequant, epilogue=epilogue, x_in_place=x_in_place, out_col_shift=col_shift)

    nvfp4_tile.for_member(pid_n, widths, block_n, member_tile)

  pid = pl.program_id(0)
  if tail is None:
    pid_m, pid_n = _tile_ids(pid, num_m, nvfp4_tile.column_blocks(widths, block_n), group_m)
    run(pid_m, pid_n, pl.program_id(1), o_ref, split, 0)
    return

  @pl.when(pid < tail.whole)
  def _():
    run(0, pid, 0, o_ref, 1, 0)

  @pl.when(pid >= tail.whole)
  def _():
    j = pid - tail.whole
    run(0, tail.whole + j // tail.parts, j % tail.parts, refs[-1], tail.parts, tail.first_col)


def _tile(x_ref, layer_ref, packed_ref, scale_ref, gs_ref, epi_refs, o_ref, pid_m, pid_n, pid_s, *, n: int,
          col_offset: int, block_m: int, block_n: int, block_k: int, steps: int, split: int, dequant: str,
          epilogue: Epilogue, x_in_place: bool = False, out_col_shift: int = 0):
  """Tile (pid_m, pid_n) of one weight's y over split ``pid_s`` (``nvfp4_matmul_fwd_kernel``'s work), written
  from output column ``col_offset`` on (a group member's place in y and in the epilogue's operands), less
  ``out_col_shift`` in o_ref (a tail's partials start at its first column)."""
  m, _ = x_ref.shape
  layer = layer_ref[0]
  rows_M = pid_m * block_m + jnp.arange(block_m)
  cols_N = pid_n * block_n + jnp.arange(block_n)
  row_mask = rows_M < m
  col_mask = cols_N < n
  first, trips = nvfp4_tile.split_range(pid_s, steps, split)
  w_rows = pl.ds(layer * n + pid_n * block_n, block_n)

  def body(i, acc_NxM):
    k0 = pl.multiple_of((first + i) * block_k, block_k)
    p_NxKh = plgpu.load(packed_ref.at[w_rows, pl.ds(pl.multiple_of(k0 // 2, block_k // 2), block_k // 2)],
                        mask=col_mask[:, None], other=0)
    # The alignment hint lets Triton load the scales with 16-byte async copies inside its software pipeline;
    # without it each thread fetched them one byte at a time, synchronously, every step (SASS at 61ea4fd).
    # Measured at 0dcb044 this changed no kernel time beyond noise (7B, 8-64 rows): other warps hid that wait.
    s_NxKb = plgpu.load(scale_ref.at[w_rows, pl.ds(pl.multiple_of(k0 // 16, block_k // 16), block_k // 16)],
                        mask=col_mask[:, None], other=0.0)
    contract = (((1,), (1,)), ((), ()))
    if dequant in HALVES_DECODERS:  # the low nibbles meet x's even columns, the high ones its odd
      rows = pl.ds(pid_m * block_m, block_m)
      if x_in_place:  # x's run as it lies, its even and odd columns split in registers (Triton's tt.split)
        x_MxK = plgpu.load(x_ref.at[rows, pl.ds(k0, block_k)], mask=row_mask[:, None], other=0.0)
        xe_MxKh, xo_MxKh = jax.lax.unstack(x_MxK.reshape(block_m, block_k // 2, 2), axis=-1)
      else:
        xe_MxKh, xo_MxKh = (plgpu.load(x_ref.at[rows, pl.ds(k0 + half * (block_k // 2), block_k // 2)],
                                       mask=row_mask[:, None], other=0.0) for half in (0, 1))
      we_NxKh, wo_NxKh = nvfp4_tile.decode_halves(dequant)(p_NxKh, s_NxKb, xe_MxKh.dtype)
      return (acc_NxM + jax.lax.dot_general(we_NxKh, xe_MxKh, contract, preferred_element_type=jnp.float32)
              + jax.lax.dot_general(wo_NxKh, xo_MxKh, contract, preferred_element_type=jnp.float32))
    x_MxK = plgpu.load(x_ref.at[pl.ds(pid_m * block_m, block_m), pl.ds(k0, block_k)],
                       mask=row_mask[:, None], other=0.0)
    w_NxK = nvfp4_tile.dequant_tile(p_NxKh, s_NxKb, x_MxK.dtype)
    return acc_NxM + jax.lax.dot_general(w_NxK, x_MxK, contract, preferred_element_type=jnp.float32)

  acc_NxM = jax.lax.fori_loop(0, trips, body, jnp.zeros((block_n, block_m), jnp.float32))
  y_MxN = acc_NxM.T * nvfp4_tile.output_multiplier(gs_ref[layer], dequant, x_ref.dtype)
  rows, cols = pl.ds(pid_m * block_m, block_m), pl.ds(col_offset + pid_n * block_n, block_n)
  out_cols = pl.ds(col_offset - out_col_shift + pid_n * block_n, block_n)
  mask = row_mask[:, None] & col_mask[None, :]
  if split == 1:
    if epilogue.num_refs:
      y_MxN = y_MxN + nvfp4_epilogue.term(epi_refs, epilogue, rows, row_mask, cols, col_mask, dot=True)
    plgpu.store(o_ref.at[rows, out_cols], y_MxN.astype(o_ref.dtype), mask=mask)
    return
  if not epilogue.num_refs:
    plgpu.store(o_ref.at[pid_s, rows, out_cols], y_MxN, mask=mask)
    return

  # Split-K: only split 0 adds the epilogue's terms (the splits are summed afterwards). The others skip its
  # loads and dot: computed and masked away, they made down_proj's K loop wait on every wgmma (kernel_sass).
  @pl.when(pid_s == 0)
  def _():
    extra = nvfp4_epilogue.term(epi_refs, epilogue, rows, row_mask, cols, col_mask, dot=True)
    plgpu.store(o_ref.at[pid_s, rows, out_cols], y_MxN + extra, mask=mask)

  @pl.when(pid_s != 0)
  def _():
    plgpu.store(o_ref.at[pid_s, rows, out_cols], y_MxN, mask=mask)


def nvfp4_matmul_fwd_pallas(x_MxK: jax.Array, packed_NxKh: jax.Array, scale_NxKb: jax.Array,
                            global_scale: jax.Array, *, config: Nvfp4MatmulConfig,
                            interpret: bool = False, poison: bool = False, layer=None, xa_MxR=None, b_RxN=None,
                            bias_N=None, lora_scale: float = 0.0, sum_splits: bool = True) -> jax.Array:
  """Builds the grid and launches the forward kernel (or, for config.engine == "gemv", the few-row kernel of
  ``nvfp4_gemv``); returns y [M, N] in x's dtype (tile kernels with ``sum_splits=False``: the split-K partial
  sums as they are, float32 [split, M, N], or [1, M, N] in x's dtype unsplit, for a kernel that adds them).

  The weight is one [N, K/2] tensor, or stacked [L, N, K/2] with ``layer`` picking one (read in place), or
  tuples of a group's members (``nvfp4_tile.group_operands``: y is [M, sum of their N]).
  xa_MxR, b_RxN, bias_N, lora_scale: the epilogue, y += bias + lora_scale * xa @ B (``nvfp4_epilogue``).
  poison: start from a NaN-filled output (aliased in place), so a tile the kernel fails to write shows up.
  """
  epi_ops, epi = nvfp4_epilogue.operands(xa_MxR, b_RxN, bias_N, lora_scale)
  if config.engine == "mosaic":
    if not isinstance(packed_NxKh, tuple):
      return _mosaic(x_MxK, packed_NxKh, scale_NxKb, global_scale, config, interpret, layer, xa_MxR, b_RxN,
                     bias_N, lora_scale)
    # The Mosaic kernel takes one weight; a group gets the heuristic config.
    config = config_lib.heuristic_config("fwd", *x_MxK.shape, sum(p.shape[-2] for p in packed_NxKh))
  if config.engine == "gemv":
    return nvfp4_gemv_pallas(x_MxK, packed_NxKh, scale_NxKb, global_scale, config=config, interpret=interpret,
                             poison=poison, layer=layer, epilogue=(epi_ops, epi))
  m, k = x_MxK.shape
  weight_operands, widths = nvfp4_tile.group_operands(packed_NxKh, scale_NxKb, global_scale, layer)
  n = sum(widths)
  cfg = config
  if k % cfg.block_k or cfg.split > k // cfg.block_k:
    raise ValueError(f"{k=} must split into {cfg.split=} runs of whole {cfg.block_k=} steps")
  num_m = pl.cdiv(m, cfg.block_m)
  num_n = nvfp4_tile.column_blocks(widths, cfg.block_n)
  kernel = functools.partial(
      nvfp4_matmul_fwd_kernel, widths=widths, block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k,
      steps=k // cfg.block_k, group_m=cfg.group_m, split=cfg.split,
      dequant=nvfp4_tile.decoder(cfg.dequant, interpret), epilogue=epi, x_in_place=cfg.x_in_place)
  # "halves": a reordered copy of x (small next to the weight it multiplies), unless the kernel splits x itself.
  # At decode rows that copy is a kernel of its own: four per 7B layer at batch 8, ~1.3 us each on an H200
  # (profile_decode at 2b01cf1), 0.15 of a 3.75 ms step.
  reorder = cfg.dequant in HALVES_DECODERS and not cfg.x_in_place
  x_in = halves_order(x_MxK, cfg.block_k) if reorder else x_MxK
  launch = functools.partial(nvfp4_tile.launch, operands=[x_in, *weight_operands, *epi_ops], rows=m, cols=n,
                             dtype=x_MxK.dtype, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                             interpret=interpret, poison=poison, name="nvfp4_matmul_fwd")
  tail = tail_plan(cfg, m, k // cfg.block_k, widths)
  if tail is None:
    return launch(kernel, split=cfg.split, grid=(num_m * num_n, cfg.split), sum_splits=sum_splits)
  partials = jax.ShapeDtypeStruct((tail.parts, m, n - tail.first_col), jnp.float32)
  y, partials = launch(functools.partial(kernel, tail=tail), split=1,
                       grid=(tail.whole + (num_n - tail.whole) * tail.parts, 1), extra_out=(partials,))
  # The tail's columns of y are unwritten (NaN when poisoned) until its partial sums land there.
  y = jax.lax.dynamic_update_slice(y, partials.sum(axis=0).astype(y.dtype), (0, tail.first_col))
  return y if sum_splits else y[None]


def _mosaic(x_MxK, packed_NxKh, scale_NxKb, global_scale, cfg, interpret, layer, xa_MxR, b_RxN, bias_N, lora_scale):
  """The Mosaic GPU kernel (engine "mosaic", experimental): one 2-D bf16 weight; the epilogue's terms are added
  to its float32 result and rounded once, as the Triton kernels' epilogue does. Stacked weights and other dtypes
  take the heuristic config instead (the kernel reads no layer index)."""
  from qerl_kernels import nvfp4_mgpu  # pylint: disable=import-outside-toplevel
  m, k = x_MxK.shape
  n = packed_NxKh.shape[-2]
  if packed_NxKh.ndim != 2 or x_MxK.dtype != jnp.bfloat16:
    fallback = config_lib.heuristic_config("fwd", m, k, n)
    return nvfp4_matmul_fwd_pallas(x_MxK, packed_NxKh, scale_NxKb, global_scale, config=fallback,
                                   interpret=interpret, layer=layer, xa_MxR=xa_MxR, b_RxN=b_RxN, bias_N=bias_N,
                                   lora_scale=lora_scale)
  mcfg = nvfp4_mgpu.from_matmul_config(cfg, m, k, n)
  y = nvfp4_mgpu.matmul_f32(x_MxK, packed_NxKh, scale_NxKb, global_scale, config=mcfg, interpret=interpret)
  return nvfp4_epilogue.add_in_xla(y, xa_MxR, b_RxN, bias_N, lora_scale).astype(x_MxK.dtype)
