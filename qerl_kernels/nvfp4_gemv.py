"""Few-row NVFP4 matmul (decode): y[M, N] = x[M, K] @ dequant(W)[K, N] on the CUDA cores, no tensor-core tile.

At 1-2 rows the tensor-core kernel spends its time decoding weights into a tile laid out for the MMA (and
Triton's layout conversions around it) only to multiply them by a mostly empty operand. Here each decoded
weight is used directly: it is multiplied by its x element in float32 and summed, as a matrix-vector
product does. Four decoders: the e4m3 route (a few bit operations, half a hardware e4m3 -> 16-bit
conversion and one conversion to float32 per weight), inline PTX (``dequant="asm"``: the two nibble planes
as bf16 E2M1 * scale, from bit operations and paired multiply-adds on packed words), the e4m3 route in
inline PTX on whole packed words (``dequant="asm_e4m3"``: five bit operations and two conversions per four
weights; the block scale multiplies each block's partial sum), and that decode with each byte's two products
in the same PTX (``dequant="asm_fma"``, the H200 default at 1-2 rows: XLA's compile of this kernel forms no
fused multiply-add from the jnp products, so the PTX spells one out). On an H200 at 1 row the e4m3 route was
2.1x faster than the tile kernel; each extra row adds its products and an x load per weight, so at 8 rows
the tile kernel wins (experiments/RESULTS.md).

Layout: the packed weight [N, K/2] is viewed as [N, K/16, 8] (one NVFP4 block of 16 logical columns per
8 bytes; byte j of block b holds columns 16b + 2j in its low nibble and 16b + 2j + 1 in its high one), and x
is passed as float32 [M, 2, K/16, 8] with x[m, h, b, j] = x[m, 16b + 2j + h] (``gemv_x_layout``), so each
nibble plane meets its own x plane without any interleave. Each program owns block_n output columns and one
split of the K blocks; it keeps a [block_n, block_k / 16] float32 accumulator per row (one partial sum per
NVFP4 block, multiplied by that block's scale) and reduces it once at the end.

``nvfp4_gemv_xa_pallas`` runs the same kernel with extra programs that compute a LoRA adapter's x @ A while
the others stream the weight (``qerl_kernels/nvfp4_matmul_xa.py`` is its public, differentiable entry).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qerl_kernels import loop_stages, nvfp4_epilogue, nvfp4_tile
from qerl_kernels.decode_residual_norm import PendingNorm, normalized, row_inv_rms
from qerl_kernels.config import GEMV_MAX_ROWS, Nvfp4MatmulConfig
from qerl_kernels.nvfp4_epilogue import Epilogue


def gemv_x_layout(x_MxK: jax.Array, dtype=jnp.float32) -> jax.Array:
  """[M, 2, K/16, 8] in ``dtype``: [m, h, b, j] = x[m, 16b + 2j + h] (even columns, then odd ones, per block)."""
  m, k = x_MxK.shape
  return x_MxK.astype(dtype).reshape(m, k // 16, 8, 2).transpose(0, 3, 1, 2)


# With ``half_products`` each program scales each row's x by a power of two 2**e so that the largest |x| of its K
# range is below 2**_HALF_X_BITS: a product with E2M1 / 64 (at most 6 / 64) then stays below 384 and a block's
# sum of 16 below 6144, inside float16. Inside the kernel: a per-row scale computed by XLA cost more kernels
# than the float16 sums saved (profile_decode at a8cf207, 7B batch 1: 4.31 against 3.91 ms per step); per
# NVFP4 block it cost the K loop more instructions than it saved (kernel_sass, 7B gate at 1 row: 5.00 per
# weight against 5.34 in float32 and 4.12 with XLA's scale). Measured this way (fabab54) it saves nothing in
# the model either (batch 1: 3.87-3.90 against 3.88 ms; batch 2: 5.46 against 5.30), so it stays off.
_HALF_X_BITS = 12


def half_x_powers(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(2**e, 2**-e) in float32 for max |x| = ``amax`` (any shape): the power of two that puts amax just below
  2**_HALF_X_BITS. A bf16 or float16 value (8 or 11 significant bits) times an E2M1 code (2) is then an exact
  float16 product, down to float16's smallest normal number (2**-26 of amax; smaller products flush to zero).
  Read off the exponent bits: amax < 2**(E - 126) for its biased exponent E, clamped at 12 so that both powers
  are normal floats (a zero or tiny amax gets 2**126); inf and NaN propagate."""
  biased = jnp.maximum(jax.lax.shift_right_logical(jax.lax.bitcast_convert_type(amax, jnp.int32), 23) & 0xFF, 12)
  up = jax.lax.bitcast_convert_type((2 * 127 + _HALF_X_BITS - 1 - biased) << 23, jnp.float32)
  down = jax.lax.bitcast_convert_type((biased - _HALF_X_BITS + 1) << 23, jnp.float32)
  return up, down


def nvfp4_gemv_kernel(x_ref, layer_ref, *refs, widths: tuple[int, ...], rows: int, block_n: int,
                      block_b: int, steps: int, split: int, dequant: str = "jnp",
                      epilogue: Epilogue = Epilogue(), prefetch: int = 0, xa: XaPlan | None = None,
                      half: bool = False, x_in_place: bool = False, norm: NormPlan | None = None,
                      stages: int = 0):
  """One block_n slice of y for every row, over one split of the K blocks.

  x_ref f32 [M, 2, K/16, 8] (``gemv_x_layout``), or with ``x_in_place`` x itself as [M, K/16, 8, 2] (x's
  dtype: element [m, b, j, h] is x[m, 16b + 2j + h]); layer_ref int32 [1]; then per weight of ``widths`` (one,
  or a group's members along N: ``nvfp4_tile.group_operands``) packed_ref uint8 [L*N, K/16, 8], scale_ref e4m3
  [L*N, K/16], gs_ref f32 [L] (rows layer*N .. layer*N + N are the weight); then the epilogue's refs
  (``nvfp4_epilogue``), then o_ref [M, sum of N] (x dtype) when split == 1, else float32 partials [split, M,
  sum of N].
  steps: K trips of block_b NVFP4 blocks in all, cut into ``split`` ranges (``nvfp4_tile.split_range``).
  dequant "asm" decodes with inline PTX (GPU only); any other value with the e4m3 conversion.
  half: the e4m3-route codes, their products with x and each block's sum in float16, each row's x scaled into
  float16's range over this program's K range (``half_x_powers``; ``half_products``).
  prefetch: load the weights this many trips ahead (``k_loop``).
  stages: >= 2 marks the K loop for Triton's software pipeliner, this many stages deep (``k_loop``); 0 does not.
  xa: also x @ A for a LoRA adapter (``XaPlan``): the refs end (*epilogue refs, a_ref, o_ref, xa_ref), and the
  first ``xa.columns`` columns of the grid compute it (``_lora_xa_partials``) while the others do the above.
  norm: x_ref holds the residual stream and the kernel reads its RMSNorm (``NormPlan``); the norm's refs follow
  the weights'.
  """
  # Program ids are read here, not inside the branches below: interpret mode does not resolve them there.
  pid_n, pid_s = pl.program_id(0), pl.program_id(1)
  weights, rest = [refs[3 * i:3 * i + 3] for i in range(len(widths))], refs[3 * len(widths):]
  norm_refs, rest = (rest[:norm.num_refs], rest[norm.num_refs:]) if norm is not None else ((), rest)
  # Pipelined, x in place loads as whole (even, odd) pairs split in registers: a stride-2 load of bf16 is 2 bytes
  # per element, under the 4 bytes Triton's pipeliner copies asynchronously, so it would stay a synchronous load
  # in the loop (kernel_sass, 7B gate, one row: 4 LDG.E.U16 per trip; as pairs 2 LDGSTS, 440 -> 437 instructions
  # per trip at 3 stages, 82 -> 71 registers).
  read_x = x_source(x_ref, rows, ("pairs" if stages else "strided") if x_in_place else "planes", norm, norm_refs)
  if xa is None:
    *epi_refs, o_ref = rest
  else:
    *epi_refs, a_ref, o_ref, xa_ref = rest

  def work(pid_w):  # column block pid_w of the weights (a group's members one after the other)
    def member_block(member, pid_n, col_offset):
      _weight_block(read_x, layer_ref, *weights[member], epi_refs, o_ref, pid_n, pid_s, n=widths[member],
                    col_offset=col_offset, rows=rows, block_n=block_n, block_b=block_b, steps=steps, split=split,
                    dequant=dequant, epilogue=epilogue, prefetch=prefetch, half=half, stages=stages)
    nvfp4_tile.for_member(pid_w, widths, block_n, member_block)

  if xa is None:
    work(pid_n)
    return

  @pl.when(pid_n < xa.columns)
  def _():
    _lora_xa_partials(read_x, a_ref, xa_ref, pid_n * split + pid_s, rows=rows, plan=xa)

  @pl.when(pid_n >= xa.columns)
  def _():
    work(pid_n - xa.columns)


@dataclasses.dataclass(frozen=True)
class XaPlan:
  """How a gemv launch also computes x @ A [K, r]: ``columns`` extra grid columns (times the split: that many
  programs) each sum ``per`` trips of ``block_b`` NVFP4 blocks (16 rows of A each) into float32 partials
  [programs, M, r], added outside (``nvfp4_gemv_xa_pallas``)."""

  columns: int
  programs: int
  block_b: int
  steps: int  # trips of block_b blocks over all of K
  per: int  # trips per program (the last ones may have fewer, or none)
  rank: int


def x_planes(x_ref, row, blocks, layout: str) -> tuple[jax.Array, jax.Array]:
  """float32 [blocks, 8] of row ``row``'s even and odd columns over the K blocks ``blocks`` (``nvfp4_gemv_kernel``'s
  layouts of x_ref: "planes", or x in place read by a stride-2 load per plane, "strided", or whole, "pairs")."""
  return _planes(_values(x_ref, (row,), blocks, layout), layout)


def _values(ref, prefix: tuple, blocks, layout: str):
  """float32 values of x's layout (``prefix``: the row, or none for a [K] vector stored so) over ``blocks``: the
  (even, odd) planes [blocks, 8], or for "pairs" the whole [blocks, 8, 2], which ``_planes`` splits."""
  if layout == "pairs":
    return ref[(*prefix, blocks, slice(None), slice(None))].astype(jnp.float32)
  if layout == "planes":
    return tuple(ref[(*prefix, h, blocks, slice(None))].astype(jnp.float32) for h in (0, 1))
  return tuple(ref[(*prefix, blocks, slice(None), h)].astype(jnp.float32) for h in (0, 1))


def _planes(values, layout: str) -> tuple[jax.Array, jax.Array]:
  return tuple(jax.lax.unstack(values, axis=-1)) if layout == "pairs" else values


@dataclasses.dataclass(frozen=True)
class NormPlan:
  """The gemv's x is rms_norm(x_ref) (a decode step's pending norm, ``decode_residual_norm.PendingNorm``): after
  the weights' refs come ss_ref float32 [M, blocks] (each row's sums of squares over blocks of columns), the
  norm's scale and, with ``noise``, its AQN addition (float32), both in x_ref's layout without the row
  (``_values``). Each program finishes every row's mean once and normalizes the x it loads, rounding to
  ``dtype`` as the norm's own launch does, so its products are those of the unfused path."""

  blocks: int
  d: int
  eps: float
  noise: bool
  dtype: str

  @property
  def num_refs(self) -> int:
    return 3 if self.noise else 2


def x_source(x_ref, rows: int, layout: str, norm: NormPlan | None = None, norm_refs=()):
  """read(r, blocks) -> float32 [blocks, 8] planes (even, odd columns) of x's row r, or with ``norm`` of its
  RMSNorm (``x_planes``' layouts). Each row's 1 / rms is computed here, once per program, before any K loop."""
  if norm is None:
    return lambda r, blocks: x_planes(x_ref, jnp.int32(r), blocks, layout)
  ss_ref, w_ref, *noise_ref = norm_refs
  invs = [row_inv_rms(ss_ref, jnp.int32(r), blocks=norm.blocks, d=norm.d, eps=norm.eps) for r in range(rows)]

  def read(r, blocks):
    x = x_planes(x_ref, jnp.int32(r), blocks, layout)
    # The norm's vectors stay strided under "pairs": loaded as pairs too, Triton's layouts put the norm's math in
    # the products' layout, where each value sits in many threads (kernel_sass, 7B gate|up, pipelined: 891
    # instructions per trip against 490).
    vectors = "strided" if layout == "pairs" else layout
    scale = _values(w_ref, (), blocks, vectors)
    if norm.noise:
      scale = jax.tree.map(jnp.add, scale, _values(noise_ref[0], (), blocks, vectors))
    return jax.tree.map(lambda x, w: normalized(x, invs[r], w, norm.dtype).astype(jnp.float32), x, scale)
  return read


def _lora_xa_partials(read_x, a_ref, xa_ref, program, *, rows: int, plan: XaPlan):
  """Program ``program``'s share of x @ A: trips [program * per, ...) of A viewed as [K/16, 8, 2r], whose row
  (b, j) holds A's rows 16b + 2j (columns :r) and 16b + 2j + 1 (columns r:), the two x planes' rows."""
  r, bb = plan.rank, plan.block_b
  first = program * plan.per
  trips = jnp.clip(plan.steps - first, 0, plan.per)

  def trip(i, accs):
    blocks = pl.ds(pl.multiple_of((first + i) * bb, bb), bb)
    a_even_Bx8xR = a_ref[blocks, :, pl.ds(0, r)].astype(jnp.float32)
    a_odd_Bx8xR = a_ref[blocks, :, pl.ds(r, r)].astype(jnp.float32)
    out = []
    for row in range(rows):
      xe_Bx8, xo_Bx8 = read_x(row, blocks)
      prod_Bx8xR = xe_Bx8[:, :, None] * a_even_Bx8xR + xo_Bx8[:, :, None] * a_odd_Bx8xR
      out.append(accs[row] + jnp.sum(jnp.sum(prod_Bx8xR, axis=1), axis=0))
    return tuple(out)

  accs = jax.lax.fori_loop(0, trips, trip, tuple(jnp.zeros((r,), jnp.float32) for _ in range(rows)))
  for row, acc in enumerate(accs):
    plgpu.store(xa_ref.at[program, jnp.int32(row), :], acc)


def _weight_block(read_x, layer_ref, packed_ref, scale_ref, gs_ref, epi_refs, o_ref, pid_n, pid_s, *, n: int,
                  col_offset: int, rows: int, block_n: int, block_b: int, steps: int, split: int, dequant: str,
                  epilogue: Epilogue, prefetch: int, half: bool = False, stages: int = 0):
  """Column block ``pid_n`` of one weight's y over K split ``pid_s`` (``nvfp4_gemv_kernel``'s main work), written
  from output column ``col_offset`` on (a group member's place in y and in the epilogue's operands)."""
  layer = layer_ref[0]
  cols_N = pid_n * block_n + jnp.arange(block_n)
  col_mask = cols_N < n
  cols = pl.ds(col_offset + pid_n * block_n, block_n)
  w_rows = pl.ds(layer * n + pid_n * block_n, block_n)
  first, trips = nvfp4_tile.split_range(pid_s, steps, split)

  def blocks(i):
    return pl.ds(pl.multiple_of((first + i) * block_b, block_b), block_b)

  def load_weights(i):
    p_NxBx8 = plgpu.load(packed_ref.at[w_rows, blocks(i), :], mask=col_mask[:, None, None], other=0)
    s_NxB = plgpu.load(scale_ref.at[w_rows, blocks(i)], mask=col_mask[:, None], other=0.0)
    return p_NxBx8, s_NxB

  def trip(i, p_NxBx8, s_NxB, accs):
    if dequant == "asm":  # E2M1 * scale, exact in bf16, from inline PTX (no per-weight conversion)
      lo, hi = (plane.astype(jnp.float32)
                for plane in nvfp4_tile.dequant_halves_asm(p_NxBx8, s_NxB, jnp.bfloat16))
    elif dequant == "asm_e4m3":  # E2M1 / 64 exactly, in f16 from inline PTX on whole words; scaled per block
      s_NxB = s_NxB.astype(jnp.float32)
      lo, hi = (plane if half else plane.astype(jnp.float32) for plane in nvfp4_tile.dequant_e4m3_asm(p_NxBx8))
    elif dequant == "asm_fma":  # the same decode and each byte's two products, in one PTX block per word
      s_NxB = s_NxB.astype(jnp.float32)
    else:  # E2M1 / 64 exactly (see nvfp4_tile): the hardware e4m3 conversion does the decode
      s_NxB = s_NxB.astype(jnp.float32)
      lo_bits, hi_bits = nvfp4_tile.nibbles_to_e4m3_bits(p_NxBx8)
      codes = jnp.float16 if half else jnp.float32
      lo = jax.lax.bitcast_convert_type(lo_bits, jnp.float8_e4m3fn).astype(codes)
      hi = jax.lax.bitcast_convert_type(hi_bits, jnp.float8_e4m3fn).astype(codes)
    out = []
    for r in range(rows):
      xe_Bx8, xo_Bx8 = read_x(r, blocks(i))
      if half:  # x times the row's 2**e, in float16 (the accumulator's sum takes 2**-e at the end)
        xe_Bx8, xo_Bx8 = ((plane * x_powers[r][0]).astype(jnp.float16) for plane in (xe_Bx8, xo_Bx8))
      if dequant == "asm_fma":
        prod_NxBx8 = nvfp4_tile.e4m3_products_asm(
            p_NxBx8, *(jnp.broadcast_to(plane[None], p_NxBx8.shape) for plane in (xe_Bx8, xo_Bx8)))
      else:
        prod_NxBx8 = lo * xe_Bx8[None] + hi * xo_Bx8[None]
      # lax.reduce keeps a float16 sum in float16 (jnp.sum would add in float32, converting every product).
      block_sums_NxB = jax.lax.reduce(prod_NxBx8, np.zeros((), prod_NxBx8.dtype), jax.lax.add, (2,)).astype(
          jnp.float32)
      out.append(accs[r] + (block_sums_NxB if dequant == "asm" else block_sums_NxB * s_NxB))
    return tuple(out)

  x_powers = [half_x_powers(amax) for amax in _x_amax(read_x, blocks, trips, rows)] if half else None
  zeros = tuple(jnp.zeros((block_n, block_b), jnp.float32) for _ in range(rows))
  accs = k_loop(trips, load_weights, trip, zeros, prefetch, stages)
  multiplier = nvfp4_tile.output_multiplier(gs_ref[layer], dequant, jnp.bfloat16)  # "asm" decodes in bf16
  for r, acc in enumerate(accs):
    y_N = jnp.sum(acc, axis=-1) * (multiplier if x_powers is None else multiplier * x_powers[r][1])
    row = jnp.int32(r)  # Pallas indexes refs with traced ints, not Python ones
    if epilogue.num_refs:
      extra = nvfp4_epilogue.term(epi_refs, epilogue, pl.ds(row, 1), None, cols, col_mask).reshape(y_N.shape)
      y_N = y_N + (extra if split == 1 else jnp.where(pid_s == 0, extra, 0.0))
    if split == 1:
      plgpu.store(o_ref.at[row, cols], y_N.astype(o_ref.dtype), mask=col_mask)
    else:
      plgpu.store(o_ref.at[pid_s, row, cols], y_N, mask=col_mask)


def _x_amax(read_x, blocks, trips, rows: int) -> tuple:
  """Per row, max |x| (a float32 scalar) over this program's K range (``blocks(0)`` .. ``blocks(trips - 1)``).
  The loop keeps an elementwise maximum and reduces it once: a reduction per trip (a barrier each) made the
  7B gate gemv at one row 29 us against 20 (bench_kernels --trace at bc0fae1)."""
  def trip(i, amaxes_Bx8):
    out = []
    for r, amax_Bx8 in enumerate(amaxes_Bx8):
      xe_Bx8, xo_Bx8 = read_x(r, blocks(i))
      out.append(jnp.maximum(amax_Bx8, jnp.maximum(jnp.abs(xe_Bx8), jnp.abs(xo_Bx8))))
    return tuple(out)

  block_b = blocks(0).size
  zeros = tuple(jnp.zeros((block_b, 8), jnp.float32) for _ in range(rows))
  return tuple(jnp.max(amax_Bx8) for amax_Bx8 in jax.lax.fori_loop(0, trips, trip, zeros))


def k_loop(trips, load_weights, trip, zeros: tuple, prefetch: int, stages: int = 0) -> tuple:
  """The gemv's K loop: accs = trip(i, *load_weights(i), accs) for i < trips, from ``zeros``.

  prefetch: trip i loads trip i + prefetch's weights before its own math (the loaded tiles are carried in the
  loop state), since Triton does not software-pipeline this loop: the loads then overlap the math instead of
  stalling it. One trip ahead took 14-19% off the gemv (f391df6); more trips keep more bytes in flight per
  program at ~5 registers per trip.
  stages: with no prefetch, >= 2 lets Triton do that instead (``loop_stages``): the loop is marked so that its
  loads become asynchronous copies into shared memory, ``stages - 1`` trips ahead, without carrying the tiles in
  registers. The mark sits on the first accumulator, in the loop body itself, where its lowering finds the loop.
  """
  if not prefetch:
    def body(i, accs):
      if stages:
        accs = (loop_stages.pipelined(accs[0], stages), *accs[1:])
      return trip(i, *load_weights(i), accs)
    return jax.lax.fori_loop(0, trips, body, zeros)

  def body(i, carry):
    accs, ahead = carry  # the weights of trips i .. i + prefetch - 1
    upcoming = load_weights(jnp.minimum(i + prefetch, trips - 1))  # the last trips re-read a (cached) tile
    return trip(i, *ahead[0], accs), (*ahead[1:], upcoming)

  first = tuple(load_weights(jnp.minimum(j, trips - 1)) for j in range(prefetch))
  accs, _ = jax.lax.fori_loop(0, trips, body, (zeros, first))
  return accs


def nvfp4_gemv_pallas(x_MxK: jax.Array, packed_NxKh: jax.Array, scale_NxKb: jax.Array, global_scale: jax.Array,
                      *, config: Nvfp4MatmulConfig, interpret: bool = False, poison: bool = False,
                      layer=None, epilogue=([], Epilogue())) -> jax.Array:
  """Launches the few-row kernel; returns y [M, N] in x's dtype (config: block_n, block_k, split, warps).

  The weight is one [N, K/2] tensor, or stacked [L, N, K/2] with ``layer`` picking one (read in place), or
  tuples of a group's members (``nvfp4_tile.group_operands``: y is [M, sum of their N]).
  epilogue: (operands, Epilogue) from ``nvfp4_epilogue.operands``.
  """
  return _launch(x_MxK, packed_NxKh, scale_NxKb, global_scale, config, interpret, poison, layer, epilogue)


def _launch(x_MxK, packed_NxKh, scale_NxKb, global_scale, cfg: Nvfp4MatmulConfig, interpret: bool, poison: bool,
            layer, epilogue, a_KxR: jax.Array | None = None, partials: bool = False, norm=None):
  """The gemv launch: y, or with ``a_KxR`` (y, x @ A in float32) (``nvfp4_gemv_xa_pallas``); with ``partials``
  both as the kernel's partial sums ([S, M, N] and [P, M, r], ``nvfp4_gemv_xa_partials``). norm: a
  ``decode_residual_norm.PendingNorm`` the kernel applies to x as it loads it (its x_MxD is x_MxK)."""
  epi_ops, epi = epilogue
  m, k = x_MxK.shape
  (layer_1, *weights), widths = nvfp4_tile.group_operands(packed_NxKh, scale_NxKb, global_scale, layer)
  n = sum(widths)
  if m > GEMV_MAX_ROWS:
    raise ValueError(f"the gemv kernel takes at most {GEMV_MAX_ROWS} rows, got {m}")
  if k % cfg.block_k or cfg.split > k // cfg.block_k:
    raise ValueError(f"{k=} must split into {cfg.split=} runs of whole {cfg.block_k=} steps")
  kb = k // 16
  plan = None if a_KxR is None else xa_plan(k, a_KxR.shape[1], a_KxR.dtype.itemsize, cfg.split)
  norm_plan, norm_ops = _norm_operands(norm, cfg.x_in_place)
  kernel = functools.partial(nvfp4_gemv_kernel, widths=widths, rows=m, block_n=cfg.block_n,
                             block_b=cfg.block_k // 16, steps=k // cfg.block_k, split=cfg.split,
                             dequant=nvfp4_tile.decoder(cfg.dequant, interpret), epilogue=epi,
                             prefetch=cfg.prefetch, xa=plan, half=cfg.half_products, x_in_place=cfg.x_in_place,
                             norm=norm_plan, stages=cfg.num_stages if cfg.pipeline and loop_stages.available() else 0)
  for i in range(0, len(weights), 3):  # packed [L*N, K/2] as [L*N, K/16, 8]: one NVFP4 block per row
    weights[i] = weights[i].reshape(weights[i].shape[0], kb, 8)
  x_op = x_MxK.reshape(m, kb, 8, 2) if cfg.x_in_place else gemv_x_layout(x_MxK)
  operands = [x_op, layer_1, *weights, *norm_ops, *epi_ops]
  extra_out, columns = (), 0
  if plan is not None:
    operands.append(a_KxR.reshape(kb, 8, 2 * plan.rank))  # row (b, j): A's rows 16b + 2j, then 16b + 2j + 1
    extra_out, columns = (jax.ShapeDtypeStruct((plan.programs, m, plan.rank), jnp.float32),), plan.columns
  out = nvfp4_tile.launch(kernel, operands, rows=m, cols=n, split=cfg.split, dtype=x_MxK.dtype,
                          grid=(columns + nvfp4_tile.column_blocks(widths, cfg.block_n), cfg.split),
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages, interpret=interpret, poison=poison,
                          name="nvfp4_gemv" if plan is None else "nvfp4_gemv_xa", extra_out=extra_out,
                          sum_splits=not partials)
  if plan is None:
    return out
  y, xa_partials = out
  return (y, xa_partials) if partials else (y, xa_partials.sum(axis=0))


def _norm_operands(norm, x_in_place: bool) -> tuple[NormPlan | None, list]:
  """(NormPlan, its refs' operands) of a pending norm (``decode_residual_norm.PendingNorm``), or (None, [])."""
  if norm is None:
    return None, []
  m, k = norm.x_MxD.shape
  if norm.scale_D.shape != (k,) or norm.ss_MxB.shape[0] != m:
    raise ValueError(f"the pending norm's scale {norm.scale_D.shape} and sums {norm.ss_MxB.shape} do not fit x "
                     f"{norm.x_MxD.shape}")

  def layout(v_K):  # x's layout without the row (``_values``)
    return v_K.reshape(k // 16, 8, 2) if x_in_place else v_K.reshape(k // 16, 8, 2).transpose(2, 0, 1)

  vectors = [norm.scale_D] + ([] if norm.noise_D is None else [norm.noise_D.astype(jnp.float32)])
  plan = NormPlan(blocks=norm.ss_MxB.shape[1], d=k, eps=float(norm.eps), noise=norm.noise_D is not None,
                  dtype=jnp.dtype(norm.x_MxD.dtype).name)
  return plan, [norm.ss_MxB, *(layout(v) for v in vectors)]


# Bytes of A each x @ A program reads: ~32 KB keeps each one well under the gemv's own per-program time (a 7B
# rank-16 adapter in float32 is 229 KB at K = 3584: 7 programs; 1.2 MB at K = 18944: 37).
_XA_BYTES_PER_PROGRAM = 32 * 1024


def xa_rank_supported(rank: int) -> bool:
  """Whether the gemv can take x @ A along for an adapter of this rank (Triton tiles: a power of two)."""
  return 0 < rank <= 256 and rank & (rank - 1) == 0


def xa_plan(k: int, rank: int, itemsize: int, split: int) -> XaPlan:
  """The x @ A work of a gemv launch with K split ``split`` ways (``XaPlan``)."""
  if not xa_rank_supported(rank):
    raise ValueError(f"x @ A in the gemv needs a power-of-two LoRA rank up to 256, got {rank}")
  kb = k // 16
  # At most 2048 elements of A per plane and trip: a larger tile costs the kernel registers, and so the
  # weight programs occupancy (7B gate_up, kernel_sass: rank 64 at 8 blocks per trip took 58 registers and 8
  # programs per SM, rank 128 68 and 7, against 56 and 9 up to rank 32).
  block_b = next(b for b in (8, 4, 2, 1) if kb % b == 0 and (b * 8 * rank <= 2048 or b == 1))
  steps = kb // block_b
  want = min(steps, -(-k * rank * itemsize // _XA_BYTES_PER_PROGRAM))
  # Rounded up to whole grid columns of the K split, so a program reads no more trips of A than it must: at
  # fc5f785 7B k/v took 7 programs of 4 trips instead of 28 of 1, and their gemv launches ran 6.4 us per call
  # against 2.7 (profile_decode, batch 1, at fabab54 against 7ed72d1: +0.21 ms per step) where the reduce
  # kernels of 28 partials that fewer partials removed had cost 0.04 ms.
  columns = -(-want // split)
  programs = columns * split
  return XaPlan(columns=columns, programs=programs, block_b=block_b, steps=steps, per=-(-steps // programs),
                rank=rank)


def nvfp4_gemv_xa_pallas(x_MxK: jax.Array, packed_NxKh: jax.Array, scale_NxKb: jax.Array, global_scale: jax.Array,
                         a_KxR: jax.Array, *, config: Nvfp4MatmulConfig, interpret: bool = False,
                         poison: bool = False, layer=None) -> tuple[jax.Array, jax.Array]:
  """(y [M, N] in x's dtype, x @ A [M, r] in float32) from one launch of the few-row kernel.

  A LoRA adapter's x @ A at a decode step is a few hundred KB of A against one x row. On its own XLA runs it
  as two small kernels (a product and a column reduction, `qerl_jax.model.linear.lora_xa`: ~21 us per 7B
  layer on an H200 at e0f3129, 12% of a batch-1 step); here extra programs of the gemv's grid read A while
  the others stream the weight, and only their float32 partial sums [programs, M, r] are added by XLA.
  x @ A is in float32 from A's values (PEFT casts x to A's dtype: bf16 x is exact in float32 either way).
  """
  _check_xa(x_MxK, a_KxR, config)
  return _launch(x_MxK, packed_NxKh, scale_NxKb, global_scale, config, interpret, poison, layer, ([], Epilogue()),
                 a_KxR)


def _check_xa(x_MxK: jax.Array, a_KxR: jax.Array, config: Nvfp4MatmulConfig) -> None:
  if config.engine != "gemv":
    raise ValueError(f"x @ A rides in the gemv engine only (at most {GEMV_MAX_ROWS} rows), not {config}")
  if a_KxR.ndim != 2 or a_KxR.shape[0] != x_MxK.shape[1]:
    raise ValueError(f"A.shape={tuple(a_KxR.shape)} must be (K={x_MxK.shape[1]}, r)")


def nvfp4_gemv_xa_partials(x_MxK, packed_NxKh: jax.Array, scale_NxKb: jax.Array, global_scale: jax.Array,
                           a_KxR: jax.Array, *, config: Nvfp4MatmulConfig, interpret: bool = False,
                           poison: bool = False, layer=None) -> tuple[jax.Array, jax.Array]:
  """`nvfp4_gemv_xa_pallas` without the sums XLA adds after it: (y's partial sums over the K split [S, M, N]
  (float32; x's dtype when S = 1), x @ A's over the extra programs [P, M, r] float32), for a kernel that adds
  them itself (``qerl_kernels.decode_residual_norm``). Not differentiable: decode steps only.

  x_MxK may be a ``decode_residual_norm.PendingNorm`` of [M, K]: the kernel normalizes x as it loads it, for the
  weight's products and for x @ A alike, and the norm's own launch never runs."""
  norm = x_MxK if isinstance(x_MxK, PendingNorm) else None
  x = x_MxK.x_MxD if norm is not None else x_MxK
  _check_xa(x, a_KxR, config)
  return _launch(x, packed_NxKh, scale_NxKb, global_scale, config, interpret, poison, layer, ([], Epilogue()),
                 a_KxR, partials=True, norm=norm)
