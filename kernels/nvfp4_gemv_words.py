"""Few-row NVFP4 matmul (decode) over 32-bit words of packed weights (``dequant="words"``).

The other gemv decoders spend ~9.5 SASS instructions per weight at 1 row (kernel_sass at dea03ae): the
packed bytes are unpacked and re-packed (PRMT) for the 16-bit decode, and the block scales and x move
between register layouts through shared memory, with barriers, every K trip. Here every step stays in one
register layout:

- The packed rows are read as little-endian 32-bit words, 8 weights each: nibble i (bits 4i..4i+3) of word w
  is logical column 8w + i (byte j of a packed row holds columns 2j and 2j + 1 in its low and high nibble).
- Nibbles i and i + 4 are 16 bits apart, so one PTX snippet per pair (two shifts, a masked merge, one
  paired bf16 multiply by 2**126) turns them into a bf16 pair equal to E2M1 exactly, the subnormal code 0.5
  included (16-bit float arithmetic keeps subnormals; the 32-bit arithmetic of XLA's CPU flushes them, which
  is why the decode is not done in float32 bits). Each half widens to float32 with one shift or mask.
- One float32 multiply-add per weight and row; each word's partial sum is multiplied by its block's e4m3
  scale, and 1 / global_scale is applied once at the end.
- x (float32 [M, 8, K/8]) and the scales are read as gathers whose index arrays have the words' [block_n,
  block_w] shape, so Triton gives them the words' register layout. (A [block_w] tile of x broadcast over
  the rows was moved through shared memory every trip.)

Interpret mode (CPU) decodes the same planes with exact jnp arithmetic; ``pair_ptx`` is checked bit for bit
by a NumPy emulation in the tests, since CI cannot run PTX.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels import nvfp4_gemv, nvfp4_tile
from kernels.config import Nvfp4MatmulConfig
from kernels.nvfp4_epilogue import Epilogue


def words_x_layout(x_MxK: jax.Array) -> jax.Array:
  """float32 [M, 8, K/8]: [m, i, w] = x[m, 8w + i], the x element that nibble i of word w meets."""
  m, k = x_MxK.shape
  return x_MxK.astype(jnp.float32).reshape(m, k // 8, 8).transpose(0, 2, 1)


def _shift(reg: str, src: str, left: int) -> str:
  if left == 0:
    return f"mov.b32 {reg}, {src};"
  return f"shl.b32 {reg}, {src}, {left};" if left > 0 else f"shr.b32 {reg}, {src}, {-left};"


def pair_ptx(i: int) -> str:
  """PTX: word $1 -> $0, the bf16 pair (E2M1(nibble i), E2M1(nibble i + 4)) in the (low, high) half.

  The sign goes to bit 15 (31) and the exponent and mantissa bits to 8..6 (24..22), which reads as
  E2M1 * 2**-126; the paired multiply by 2**126 (0x7E80) restores E2M1 exactly (-0.0 as the addend keeps
  the sign of zero)."""
  return f"""{{
.reg .b32 a, b, c, z;
mov.b32 c, 0x7E807E80;
mov.b32 z, 0x80008000;
{_shift("a", "$1", 12 - 4 * i)} and.b32 a, a, 0x80008000;
{_shift("b", "$1", 6 - 4 * i)} and.b32 b, b, 0x01C001C0;
or.b32 $0, a, b;
fma.rn.bf16x2 $0, $0, c, z;
}}"""


def _e2m1_plane(words: jax.Array, i: int) -> jax.Array:
  """E2M1(nibble i) as float32, by exact arithmetic (the interpret-mode decoder)."""
  nib = (words >> (4 * i)) & 0xF
  e, m = ((nib >> 1) & 3).astype(jnp.int32), (nib & 1).astype(jnp.float32)
  magnitude = jnp.where(e == 0, 0.5 * m, (2.0 + m) * jnp.where(e == 1, 0.5, jnp.where(e == 2, 1.0, 2.0)))
  return jnp.where((nib & 8) != 0, -magnitude, magnitude)


def decode_words(words: jax.Array, use_asm: bool) -> list[jax.Array]:
  """int32 words (any shape; Triton's integers are signless) -> 8 float32 planes, plane i = E2M1(nibble i)."""
  if not use_asm:
    return [_e2m1_plane(words, i) for i in range(8)]
  planes = [None] * 8
  for i in range(4):
    pair = plgpu.elementwise_inline_asm(pair_ptx(i), args=[words], constraints="=r,r", pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, jnp.int32)])[0]
    planes[i] = jax.lax.bitcast_convert_type(pair << 16, jnp.float32)
    planes[i + 4] = jax.lax.bitcast_convert_type(pair & jnp.int32(-0x10000), jnp.float32)  # 0xFFFF0000
  return planes


def nvfp4_gemv_words_kernel(x_ref, layer_ref, words_ref, scale_ref, gs_ref, *rest, n: int, rows: int, block_n: int,
                            block_w: int, steps: int, split: int, use_asm: bool,
                            epilogue: Epilogue = Epilogue(), prefetch: bool = False):
  """One block_n slice of y for every row, over one split of the K words.

  x_ref f32 [M, 8, K/8] (``words_x_layout``); layer_ref int32 [1]; words_ref int32 [L*N, K/8]; scale_ref
  e4m3 [L*N, K/16]; gs_ref f32 [L]; rest: the epilogue's refs, then o_ref [M, N] (x dtype) when split == 1,
  else float32 partials [split, M, N]. Keeps one float32 partial per word and row, reduced at the end.
  """
  *epi_refs, o_ref = rest
  layer = layer_ref[0]
  pid_n, pid_s, cols_N, col_mask, cols = nvfp4_gemv.program_columns(n, block_n)
  first, trips = nvfp4_gemv.split_range(pid_s, steps, split)
  shape = (block_n, block_w)
  w_rows_NxW = jnp.broadcast_to((layer * n + cols_N)[:, None], shape)
  mask_NxW = jnp.broadcast_to(col_mask[:, None], shape)

  def first_word(i):
    return pl.multiple_of((first + i) * block_w, block_w)

  def word_idx(i):  # trip i's word indices in the tile's shape (gathers with them share its layout)
    return jnp.broadcast_to((first_word(i) + jnp.arange(block_w))[None, :], shape)

  def load_weights(i):
    words_NxW = plgpu.load(words_ref.at[pl.ds(layer * n + pid_n * block_n, block_n), pl.ds(first_word(i), block_w)],
                           mask=col_mask[:, None], other=0)
    s_NxW = plgpu.load(scale_ref.at[w_rows_NxW, word_idx(i) // 2], mask=mask_NxW, other=0.0)
    return words_NxW, s_NxW

  def trip(i, words_NxW, s_NxW, accs):
    w_idx_NxW = word_idx(i)
    s_NxW = s_NxW.astype(jnp.float32)
    planes = decode_words(words_NxW, use_asm)
    out = []
    for r in range(rows):
      row = jnp.int32(r)  # Pallas indexes refs with traced ints, not Python ones
      dot_NxW = planes[0] * x_ref[row, jnp.int32(0), w_idx_NxW]
      for j in range(1, 8):
        dot_NxW = dot_NxW + planes[j] * x_ref[row, jnp.int32(j), w_idx_NxW]
      out.append(accs[r] + dot_NxW * s_NxW)
    return tuple(out)

  zeros = tuple(jnp.zeros(shape, jnp.float32) for _ in range(rows))
  accs = nvfp4_gemv.k_loop(trips, load_weights, trip, zeros, prefetch)
  nvfp4_gemv.store_rows(accs, 1.0 / gs_ref[layer], o_ref, epi_refs, epilogue, split=split, pid_s=pid_s, cols=cols,
                        col_mask=col_mask)


def nvfp4_gemv_words_pallas(x_MxK: jax.Array, packed_NxKh: jax.Array, scale_NxKb: jax.Array,
                            global_scale: jax.Array, *, config: Nvfp4MatmulConfig, interpret: bool = False,
                            poison: bool = False, layer=None, epilogue=([], Epilogue())) -> jax.Array:
  """Launches the word gemv; like ``nvfp4_gemv.nvfp4_gemv_pallas`` (block_k counts logical columns)."""
  epi_ops, epi = epilogue
  m, k = x_MxK.shape
  (layer_1, packed, scale, gs), n = nvfp4_tile.layer_operands(packed_NxKh, scale_NxKb, global_scale, layer)
  cfg = config
  nvfp4_gemv.check_launch(m, k, cfg)
  # The packed rows as little-endian 32-bit words (a bitcast, no copy).
  words = jax.lax.bitcast_convert_type(packed.reshape(packed.shape[0], k // 8, 4), jnp.int32)
  kernel = functools.partial(nvfp4_gemv_words_kernel, n=n, rows=m, block_n=cfg.block_n, block_w=cfg.block_k // 8,
                             steps=k // cfg.block_k, split=cfg.split, use_asm=not interpret, epilogue=epi,
                             prefetch=cfg.prefetch)
  operands = [words_x_layout(x_MxK), layer_1, words, scale, gs, *epi_ops]
  return nvfp4_tile.launch(kernel, operands, rows=m, cols=n, split=cfg.split, dtype=x_MxK.dtype,
                           grid=(pl.cdiv(n, cfg.block_n), cfg.split), num_warps=cfg.num_warps,
                           num_stages=cfg.num_stages, interpret=interpret, poison=poison, name="nvfp4_gemv")
