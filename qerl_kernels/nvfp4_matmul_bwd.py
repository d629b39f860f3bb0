"""Backward NVFP4 matmul for activations: dx[M, K] = dy[M, N] @ dequant(W)[K, N]^T, dequantization fused.

The base weight is frozen, so this is the only gradient the kernels produce (no weight gradient). Same
packed [N, K/2] weight, now contracted over N: each program owns a [block_m, block_k] tile of dx, walks N in
block_n steps, decodes the [block_n, block_k] weight tile in registers and accumulates the swapped product
acc[K, M] += W_tile^T @ dy_tile^T. With few rows the N walk is split over programs (split-N), whose float32
partials XLA adds, so all SMs stream weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qerl_kernels import nvfp4_tile
from qerl_kernels.config import HALVES_DECODERS, Nvfp4MatmulConfig
from qerl_kernels.nvfp4_matmul_fwd import _tile_ids, logical_order


def nvfp4_matmul_bwd_kernel(dy_ref, layer_ref, packed_ref, scale_ref, gs_ref, o_ref, *, block_m: int, block_n: int,
                            block_k: int, steps_per_split: int, group_m: int, split: int,
                            dequant: str = "jnp"):
  """One [block_m, block_k] tile of dx over one split of N.

  dy_ref [M, N]; layer_ref int32 [1]; packed_ref uint8 [L*N, K/2]; scale_ref e4m3 [L*N, K/16]; gs_ref f32
  [L] (rows layer*N .. layer*N + N are this weight);
  o_ref [M, K] (dy dtype) when split == 1, else float32 partials [split, M, K]; with dequant "halves" or
  "asm" each block_k run of dx's columns is written as its even columns, then its odd ones (``halves_order``).
  """
  m, n = dy_ref.shape
  k = 2 * packed_ref.shape[1]
  layer = layer_ref[0]
  num_m = pl.cdiv(m, block_m)
  num_k = k // block_k
  pid_m, pid_k = _tile_ids(pl.program_id(0), num_m, num_k, group_m)
  pid_s = pl.program_id(1)
  rows_M = pid_m * block_m + jnp.arange(block_m)
  row_mask = rows_M < m
  k0 = pid_k * block_k
  n_start = pid_s * steps_per_split * block_n

  def loads(i):
    n0 = n_start + i * block_n
    col_mask = (n0 + jnp.arange(block_n)) < n
    dy_MxN = plgpu.load(dy_ref.at[pl.ds(pid_m * block_m, block_m), pl.ds(n0, block_n)],
                        mask=row_mask[:, None] & col_mask[None, :], other=0.0)
    w_rows = pl.ds(layer * n + n0, block_n)
    p_NxKh = plgpu.load(packed_ref.at[w_rows, pl.ds(pl.multiple_of(k0 // 2, block_k // 2), block_k // 2)],
                        mask=col_mask[:, None], other=0)
    s_NxKb = plgpu.load(scale_ref.at[w_rows, pl.ds(pl.multiple_of(k0 // 16, block_k // 16), block_k // 16)],
                        mask=col_mask[:, None], other=0.0)
    return dy_MxN, p_NxKh, s_NxKb

  contract = (((0,), (1,)), ((), ()))
  multiplier = nvfp4_tile.output_multiplier(gs_ref[layer], dequant, dy_ref.dtype)
  mask = row_mask[:, None]
  if dequant in HALVES_DECODERS:  # two accumulators, dx's even and odd columns: no interleave
    decode = nvfp4_tile.decode_halves(dequant)

    def body_halves(i, accs):
      dy_MxN, p_NxKh, s_NxKb = loads(i)
      we_NxKh, wo_NxKh = decode(p_NxKh, s_NxKb, dy_MxN.dtype)
      return tuple(acc + jax.lax.dot_general(w, dy_MxN, contract, preferred_element_type=jnp.float32)
                   for acc, w in zip(accs, (we_NxKh, wo_NxKh)))

    zeros = jnp.zeros((block_k // 2, block_m), jnp.float32)
    accs = jax.lax.fori_loop(0, steps_per_split, body_halves, (zeros, zeros))
    rows = pl.ds(pid_m * block_m, block_m)
    for half, acc_KhxM in enumerate(accs):
      dx_MxKh = acc_KhxM.T * multiplier
      cols = pl.ds(k0 + half * (block_k // 2), block_k // 2)
      if split == 1:
        plgpu.store(o_ref.at[rows, cols], dx_MxKh.astype(o_ref.dtype), mask=mask)
      else:
        plgpu.store(o_ref.at[pid_s, rows, cols], dx_MxKh, mask=mask)
    return

  def body(i, acc_KxM):
    dy_MxN, p_NxKh, s_NxKb = loads(i)
    w_NxK = nvfp4_tile.dequant_tile(p_NxKh, s_NxKb, dy_MxN.dtype)
    return acc_KxM + jax.lax.dot_general(w_NxK, dy_MxN, contract, preferred_element_type=jnp.float32)

  acc_KxM = jax.lax.fori_loop(0, steps_per_split, body, jnp.zeros((block_k, block_m), jnp.float32))
  dx_MxK = acc_KxM.T * multiplier
  if split == 1:
    plgpu.store(o_ref.at[pl.ds(pid_m * block_m, block_m), pl.ds(k0, block_k)],
                dx_MxK.astype(o_ref.dtype), mask=mask)
  else:
    plgpu.store(o_ref.at[pid_s, pl.ds(pid_m * block_m, block_m), pl.ds(k0, block_k)], dx_MxK, mask=mask)


def nvfp4_matmul_bwd_pallas(dy_MxN: jax.Array, packed_NxKh: jax.Array, scale_NxKb: jax.Array,
                            global_scale: jax.Array, *, config: Nvfp4MatmulConfig,
                            interpret: bool = False, poison: bool = False, layer=None) -> jax.Array:
  """Builds the grid and launches the backward kernel; returns dx [M, K] in dy's dtype.

  The weight is one [N, K/2] tensor, or stacked [L, N, K/2] with ``layer`` picking one (read in place).
  poison: start from a NaN-filled output (aliased in place), so a tile the kernel fails to write shows up.
  """
  m, n = dy_MxN.shape
  k = 2 * packed_NxKh.shape[-1]
  weight_operands, _ = nvfp4_tile.layer_operands(packed_NxKh, scale_NxKb, global_scale, layer)
  cfg = config
  if k % cfg.block_k:
    raise ValueError(f"{k=} must be a multiple of {cfg.block_k=}")
  num_m = pl.cdiv(m, cfg.block_m)
  steps = pl.cdiv(n, cfg.block_n)
  steps_per_split = pl.cdiv(steps, cfg.split)
  split = pl.cdiv(steps, steps_per_split)  # no split left without work
  kernel = functools.partial(
      nvfp4_matmul_bwd_kernel, block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k,
      steps_per_split=steps_per_split, group_m=cfg.group_m, split=split,
      dequant=nvfp4_tile.decoder(cfg.dequant, interpret))
  out = nvfp4_tile.launch(kernel, [dy_MxN, *weight_operands], rows=m, cols=k, split=split, dtype=dy_MxN.dtype,
                          grid=(num_m * (k // cfg.block_k), split), num_warps=cfg.num_warps,
                          num_stages=cfg.num_stages, interpret=interpret, poison=poison, name="nvfp4_matmul_bwd")
  if cfg.dequant in HALVES_DECODERS:
    out = logical_order(out, cfg.block_k)
  return out
