"""In-kernel NVFP4 tile dequantization, shared by the forward and backward kernels.

The E2M1 nibble (sign, two exponent bits, one mantissa bit) is moved bit for bit into a float8_e4m3fn byte:
sign to bit 7, exponent and mantissa to bits 4..2. Read as e4m3 that byte is exactly E2M1 / 64, including
the subnormal code 1 (0.5), because e4m3's subnormal step 2**-9 times 4 is 2**-7 = 0.5 / 64. Hopper converts
e4m3 to 16-bit floats in hardware (two elements per instruction), so the whole decode is a few bit operations
and one conversion per element, with no lookup table.

The e4m3 block scale times the decoded code is exact in bf16 and fp16 (at most 6 significant bits, exponents
within range), so the tile fed to the tensor cores is exactly code * scale / 64; the remaining factor
64 / global_scale is applied once to the float32 accumulator (see ``output_multiplier``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qerl_kernels.config import GEMV_DECODERS, split_trips

# The decoded e4m3 value is E2M1 / CODE_DIVISOR.
CODE_DIVISOR = 64.0
# The tile kernels' bf16 asm planes are E2M1 * scale * 2**-FOLD_BF16 (``asm_scale``): a decoded weight is then
# at least 2**-18 and the accumulator's products stay normal float32.
FOLD_BF16 = 8


def nibbles_to_e4m3_bits(packed_u8: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Splits packed bytes into two e4m3 bit patterns: (low nibble, high nibble), same shape as the input."""
  lo = ((packed_u8 & 0x08) << 4) | ((packed_u8 & 0x07) << 2)
  hi = (packed_u8 & 0x80) | ((packed_u8 >> 2) & 0x1C)
  return lo, hi


def dequant_tile(packed_RxKh: jax.Array, scale_RxKb: jax.Array, dtype) -> jax.Array:
  """Decodes one weight tile to ``dtype``, still divided by 64 * global_scale.

  packed_RxKh: uint8 [R, Kt/2] (element 2i in the low nibble); scale_RxKb: float8_e4m3fn [R, Kt/16].
  Returns [R, Kt] of ``dtype`` equal to E2M1[code] * scale / 64 exactly.
  """
  r, kh = packed_RxKh.shape
  kt = 2 * kh
  lo, hi = nibbles_to_e4m3_bits(packed_RxKh)
  # Interleave (2i from the low nibble, 2i+1 from the high one): a join on a new last axis plus a reshape,
  # which Triton lowers to tt.join + tt.reshape without a trip through memory.
  bits_RxK = jnp.stack([lo, hi], axis=-1).reshape(r, kt)
  codes_RxK = jax.lax.bitcast_convert_type(bits_RxK, jnp.float8_e4m3fn).astype(dtype)
  scale = scale_RxKb.astype(dtype)
  w = codes_RxK.reshape(r, kt // 16, 16) * scale[:, :, None]
  return w.reshape(r, kt)


def dequant_halves(packed_RxKh: jax.Array, scale_RxKb: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """Decodes one weight tile as its two nibble planes, without interleaving them.

  Returns (even_RxKh, odd_RxKh): element i of the first is logical column 2i (the low nibble), of the second
  column 2i+1 (the high nibble), each equal to E2M1[code] * scale / 64 like ``dequant_tile``. Multiplying
  them by the even and odd columns of x and adding gives the same product with no join / reshape of the
  decoded values (the interleave that ``dequant_tile`` asks Triton for).
  """
  r, kh = packed_RxKh.shape
  lo, hi = nibbles_to_e4m3_bits(packed_RxKh)
  scale = scale_RxKb.astype(dtype)

  def plane(bits):  # one scale per 16 logical columns = per 8 packed bytes
    codes = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(dtype)
    return (codes.reshape(r, kh // 8, 8) * scale[:, :, None]).reshape(r, kh)

  return plane(lo), plane(hi)


def output_multiplier(global_scale: jax.Array, method: str = "jnp", dtype=None) -> jax.Array:
  """The float32 factor that turns an accumulator over decoded tiles into the true product. ``dtype``: the type
  ``dequant_halves_asm`` decoded to, required with "asm" (its bf16 planes are scaled by 2**-FOLD_BF16)."""
  if method != "asm":
    return jnp.float32(CODE_DIVISOR) / global_scale.astype(jnp.float32)
  if dtype is None:
    raise ValueError('output_multiplier: the "asm" decoder\'s factor depends on the dtype it decoded to')
  divisor = 2.0 ** FOLD_BF16 if jnp.dtype(dtype) == jnp.bfloat16 else 1.0
  return jnp.float32(divisor) / global_scale.astype(jnp.float32)


# PTX for 4 packed bytes ($2) and their 4 block scales ($3, $4: pairs of 16-bit floats) -> the 4 low (or
# high) nibbles as two pairs of 16-bit floats ($0, $1) equal to E2M1[code] * scale exactly (up to a power of
# two, ``output_multiplier``). prmt spreads bytes 0,1 (then 2,3) into the two 16-bit halves; then the sign goes
# to bit 15 and the two exponent bits + mantissa bit to the bottom of the float's exponent / top of its
# mantissa, which reads as E2M1 * 2**-BIAS including the subnormal code 0.5 (16-bit float arithmetic keeps
# subnormals); the multiplies by 2**BIAS and by the block scale are exact.
# (Pallas lowers only single-result inline asm, hence one call per nibble.)
def _ptx_f16(pow2: str, sign_shift: int, em_shift: int, em_mask: str) -> str:
  """float16: shifts and masks, then an fma by 2**14 and one by the scale."""
  return f"""{{
.reg .b32 t0, t1, a, b, c, z;
mov.b32 c, {pow2};
mov.b32 z, 0x80008000;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
shl.b32 a, t0, {sign_shift}; and.b32 a, a, 0x80008000;
shl.b32 b, t0, {em_shift}; and.b32 b, b, {em_mask}; or.b32 $0, a, b;
shl.b32 a, t1, {sign_shift}; and.b32 a, a, 0x80008000;
shl.b32 b, t1, {em_shift}; and.b32 b, b, {em_mask}; or.b32 $1, a, b;
fma.rn.f16x2 $0, $0, c, z; fma.rn.f16x2 $1, $1, c, z;
fma.rn.f16x2 $0, $0, $3, z; fma.rn.f16x2 $1, $1, $4, z;
}}"""


def _ptx_bf16(nibble_mask: str, multiplier: int) -> str:
  """bfloat16: the nibble masked, then one integer multiply by 2**em_shift + 2**sign_shift places its sign and
  its other three bits at once (the two shifted copies do not overlap, so the sum is their OR), one mask keeps
  those four bits; the scale operand carries 2**(126 - FOLD_BF16) (``asm_scale``), so one fma finishes.
  ~4 instructions per pair of weights fewer than shift / mask / or and a separate fma by 2**126 (kernel_sass,
  7B gate_up at 8 rows)."""
  return f"""{{
.reg .b32 t0, t1, z;
mov.b32 z, 0x80008000;
prmt.b32 t0, $2, 0, 0x4140;
prmt.b32 t1, $2, 0, 0x4342;
and.b32 t0, t0, {nibble_mask}; and.b32 t1, t1, {nibble_mask};
mul.lo.u32 t0, t0, {multiplier}; mul.lo.u32 t1, t1, {multiplier};
and.b32 t0, t0, 0x81C081C0; and.b32 t1, t1, 0x81C081C0;
fma.rn.bf16x2 $0, t0, $3, z; fma.rn.bf16x2 $1, t1, $4, z;
}}"""


# bf16: exponent/mantissa bits at 8..6, value E2M1 * 2**-126. The low nibble (bits 0..3 of each half after
# prmt) moves up 6 (bits 0..2) and 12 (its sign); the high one (bits 4..7) up 2 and 8.
# fp16: exponent/mantissa bits at 11..9, value E2M1 * 2**-14 (0x7400 is 2**14); its shifted copies would
# overlap, so it keeps the shift / mask / or form.
_ASM_BY_DTYPE = {
    ("bfloat16", "lo"): _ptx_bf16("0x000F000F", (1 << 6) + (1 << 12)),
    ("bfloat16", "hi"): _ptx_bf16("0x00F000F0", (1 << 2) + (1 << 8)),
    ("float16", "lo"): _ptx_f16("0x74007400", sign_shift=12, em_shift=9, em_mask="0x0E000E00"),
    ("float16", "hi"): _ptx_f16("0x74007400", sign_shift=8, em_shift=5, em_mask="0x0E000E00"),
}


def asm_scale(scale_RxKb: jax.Array, dtype) -> jax.Array:
  """The block scales as ``dequant_halves_asm`` multiplies by them: in ``dtype``; for bf16 times
  2**(126 - FOLD_BF16), the decoded bits' 2**126 less what would overflow (448 * 2**126 > bf16's max), which
  ``output_multiplier`` puts back. Exact: a power of two times an e4m3 value, inside bf16's normal range."""
  dtype = jnp.dtype(dtype)
  scale = scale_RxKb.astype(dtype)
  return scale * jnp.asarray(2.0 ** (126 - FOLD_BF16), dtype) if dtype == jnp.bfloat16 else scale


def dequant_halves_asm(packed_RxKh: jax.Array, scale_RxKb: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """Like ``dequant_halves`` but decoded by inline PTX (GPU only): (even, odd) planes equal to E2M1 * scale.

  Note the missing 1/64: use ``output_multiplier(gs, "asm", dtype)``. Per packed 32-bit word (4 bytes, 8
  weights) and plane, the bf16 PTX spends 2 byte permutes, 6 bit operations and 2 paired fmas (the fp16 one ~10
  bit operations and 4 fmas). The bf16 form (c5493f1+) cut the 8-row tile kernel's K loop from 824 to 728
  instructions per trip (kernel_sass, 7B gate_up, 3 stages) and changed no kernel time beyond noise in the model
  (profile_decode, 7B NVFP4 batch 8: 4.71 against 4.70 kernel ms at 3 stages, 4.83 against 4.91 at 2), as
  folding the 2**BIAS into the scale had not at b38e8cc: these kernels are not bound by the decode's issue.
  The planes must not be interleaved afterwards: measured on an H200 (7f1d80d),
  joining two asm outputs and reshaping interleaves them by pairs (the 32-bit registers the asm writes), which
  is what made the first, interleaving version of this decoder wrong; each plane alone is exact.
  """
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel

  dtype = jnp.dtype(dtype)
  scale = asm_scale(scale_RxKb, dtype)  # one scale per 8 packed bytes (16 weights)
  scale_RxKh = jnp.broadcast_to(scale[..., None], (*scale.shape, 8)).reshape(packed_RxKh.shape)
  return tuple(plgpu.elementwise_inline_asm(
      _ASM_BY_DTYPE[(dtype.name, half)], args=[packed_RxKh, scale_RxKh], constraints="=r,=r,r,r,r",
      pack=4, result_shape_dtypes=[jax.ShapeDtypeStruct(packed_RxKh.shape, dtype)])[0] for half in ("lo", "hi"))


# The e4m3 route of one nibble plane of the packed word {w} into e (bits) and s (signs): the low nibble's bits
# 2..0 move up 2 and its sign (bit 3) up 4; the high's down 2.
_E4M3_PLANE = {"lo": ("shl.b32 e, {w}, 2;", "shl.b32 s, {w}, 4;"), "hi": ("shr.b32 e, {w}, 2;", "mov.b32 s, {w};")}


def _ptx_e4m3_plane(half: str, word: str, out01: str, out23: str) -> str:
  """PTX lines: one nibble plane of the packed ``word`` as two pairs of f16 (``out01``: bytes 0, 1; ``out23``:
  bytes 2, 3), through registers e, s (b32) and e0, e1 (b16) that the caller declares."""
  em, sign = (step.format(w=word) for step in _E4M3_PLANE[half])
  return f"""{em} and.b32 e, e, 0x1C1C1C1C;
{sign} and.b32 s, s, 0x80808080;
or.b32 e, e, s;
mov.b32 {{e0, e1}}, e;
cvt.rn.f16x2.e4m3x2 {out01}, e0;
cvt.rn.f16x2.e4m3x2 {out23}, e1;"""


# PTX for 4 packed bytes ($2) -> their 4 low (or high) nibbles as two pairs of f16 ($0, $1) equal to
# E2M1[code] / 64 exactly: the e4m3 route of ``nibbles_to_e4m3_bits`` on all four bytes of a 32-bit word at
# once (each byte's code to its e4m3 bits: sign to bit 7, exponent and mantissa bits to bits 4..2), then the
# hardware's e4m3x2 -> f16x2 conversion, two bytes per instruction. Per 4 weights: 5 bit operations and 2
# conversions, against 2 byte permutes, 10 bit operations and 4 paired multiplies for one ``_ptx`` plane,
# and no block scale operand (the gemv multiplies its per-block sums by the scale instead).
# half -> that PTX.
_ASM_E4M3 = {half: f"""{{
.reg .b32 e, s;
.reg .b16 e0, e1;
{_ptx_e4m3_plane(half, "$2", "$0", "$1")}
}}""" for half in _E4M3_PLANE}


def dequant_e4m3_asm(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(low, high) nibble planes of packed bytes as float16 E2M1[code] / 64, by inline PTX (GPU only): the
  values ``nibbles_to_e4m3_bits`` then an e4m3 -> 16-bit conversion give, from whole 32-bit words."""
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel

  return tuple(plgpu.elementwise_inline_asm(
      _ASM_E4M3[half], args=[packed], constraints="=r,=r,r", pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(packed.shape, jnp.float16)])[0] for half in ("lo", "hi"))


def _ptx_e4m3_products() -> str:
  """PTX for 4 packed bytes ($4) and the x values of their low nibbles ($5..$8) and high ones ($9..$12), all
  float32 -> per byte lo * x_lo + hi * x_hi ($0..$3, float32), lo and hi being E2M1 / 64 from the e4m3 route
  (the planes decoded as in ``_ASM_E4M3``, then each 16-bit value widened to float32).

  Why in PTX: compiled by XLA, the gemv's ``lo * xe + hi * xo`` stays a multiply and an add (ncu on an H200,
  7B gate at one row, 0d9c40a: 0 fused of 4.42M float32 warp instructions), where one multiply and one fused
  multiply-add per byte do. With asm_fma ncu counted 1.06M fused + 2.30M others (2.08 -> 1.58 float32
  instructions per weight, block sums included) and the gemvs ran 0-8% faster (RESULTS.md)."""
  planes = [_ptx_e4m3_plane("lo", "$4", "l01", "l23"), _ptx_e4m3_plane("hi", "$4", "h01", "h23")]
  products = "\n".join(f"cvt.f32.f16 fl, c{i}; cvt.f32.f16 fh, d{i}; mul.rn.f32 ${i}, fh, ${9 + i}; "
                       f"fma.rn.f32 ${i}, fl, ${5 + i}, ${i};" for i in range(4))
  return f"""{{
.reg .b32 e, s, l01, l23, h01, h23;
.reg .b16 e0, e1, c0, c1, c2, c3, d0, d1, d2, d3;
.reg .f32 fl, fh;
{planes[0]}
{planes[1]}
mov.b32 {{c0, c1}}, l01; mov.b32 {{c2, c3}}, l23;
mov.b32 {{d0, d1}}, h01; mov.b32 {{d2, d3}}, h23;
{products}
}}"""


_ASM_E4M3_PRODUCTS = _ptx_e4m3_products()


def e4m3_products_asm(packed: jax.Array, x_lo: jax.Array, x_hi: jax.Array) -> jax.Array:
  """Per packed byte, lo * x_lo + hi * x_hi in float32 (lo, hi: its nibbles as E2M1 / 64), by inline PTX (GPU
  only). x_lo, x_hi: float32 of packed's shape (each byte's two x values)."""
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel

  return plgpu.elementwise_inline_asm(
      _ASM_E4M3_PRODUCTS, args=[packed, x_lo, x_hi], constraints="=f,=f,=f,=f,r," + ",".join(["f"] * 8), pack=4,
      result_shape_dtypes=[jax.ShapeDtypeStruct(packed.shape, jnp.float32)])[0]


def decode_halves(dequant: str):
  """The halves-layout tile decoder for ``dequant`` ("halves" or "asm"): f(packed, scale, dtype)."""
  return dequant_halves_asm if dequant == "asm" else dequant_halves


def layer_operands(packed, scale, global_scale, layer) -> tuple[list, int]:
  """The weight operands every kernel takes, for one weight or one layer of a stacked one, without a copy.

  packed [N, K/2] / scale [N, K/16] / global_scale [] or [1] (one weight, layer None or 0), or stacked
  [L, N, K/2] / [L, N, K/16] / [L] with ``layer`` an int32 scalar (may be traced). Returns
  ([layer int32[1], packed [L*N, K/2], scale [L*N, K/16], global_scale f32[L]], N): the kernels offset their
  row reads by layer * N, so a model scanning over stacked layers never slices (copies) the weight.
  """
  if packed.ndim == 2:
    packed, scale = packed[None], scale[None]
    global_scale = jnp.reshape(global_scale, (1,))
    layer = 0 if layer is None else layer
  elif layer is None:
    raise ValueError(f"a stacked weight ({packed.shape=}) needs the layer to multiply by")
  num_layers, n, kh = packed.shape
  layer_1 = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
  return [layer_1, packed.reshape(num_layers * n, kh), scale.reshape(num_layers * n, scale.shape[-1]),
          global_scale.astype(jnp.float32).reshape(num_layers)], n


def group_operands(packed, scale, global_scale, layer) -> tuple[list, tuple[int, ...]]:
  """`layer_operands` for one weight, or for each member of a group (packed, scale and global_scale tuples
  of the members, which share K): ([layer int32[1], packed_1, scale_1, gs_1, packed_2, ...], their widths N).
  One launch computes x @ [W_1 | W_2 | ...] from the members read in place (``for_member``), no concatenation.
  """
  if not isinstance(packed, tuple):
    ops, n = layer_operands(packed, scale, global_scale, layer)
    return ops, (n,)
  layer_1, ops, widths = None, [], []
  for p, s, g in zip(packed, scale, global_scale):
    (layer_1, *member), n = layer_operands(p, s, g, layer)
    ops += member
    widths.append(n)
  return [layer_1, *ops], tuple(widths)


def member_spans(widths: tuple[int, ...], block_n: int) -> list[tuple[int, int, int]]:
  """(first column block, column blocks, first output column) of each member of a group: each member's blocks
  follow the previous member's, and a member's last block is masked at its own width, so no block spans two
  weights."""
  spans, first, offset = [], 0, 0
  for n in widths:
    blocks = -(-n // block_n)
    spans.append((first, blocks, offset))
    first, offset = first + blocks, offset + n
  return spans


def for_member(pid_n, widths: tuple[int, ...], block_n: int, work) -> None:
  """Calls ``work(member, its column block, its first output column)`` for the member of a group whose column
  blocks hold ``pid_n`` (``member_spans``). One member: no branch."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel

  if len(widths) == 1:
    work(0, pid_n, 0)
    return
  for member, (first, blocks, offset) in enumerate(member_spans(widths, block_n)):

    @pl.when((pid_n >= first) & (pid_n < first + blocks))
    def _(member=member, first=first, offset=offset):
      work(member, pid_n - first, offset)


def column_blocks(widths: tuple[int, ...], block_n: int) -> int:
  """Column blocks of a group's grid (``for_member``)."""
  first, blocks, _ = member_spans(widths, block_n)[-1]
  return first + blocks


def split_range(pid_s, steps: int, split: int):
  """(first step, steps) of K split ``pid_s``: ranges of ceil(steps / split) K steps, the last one shorter when
  they do not divide (``config.split_trips``; a ragged split lets the split fill the GPU whatever the factors
  of the step count, e.g. 74 steps of 7B down_proj in 5 ranges). A static count when the split is even."""
  per, ranges = split_trips(steps, split)
  if ranges != split:
    raise ValueError(f"a split of {steps} K steps into {split} ranges leaves one empty; use {ranges}")
  if steps % split == 0:
    return pid_s * per, per
  return pid_s * per, jnp.minimum(per, steps - pid_s * per)


def drop_poison_refs(kernel, count: int, *refs):
  """Calls ``kernel`` without the ``count`` NaN-filled inputs aliased to its ``count`` outputs (never read)."""
  return kernel(*refs[:-2 * count], *refs[-count:])


def decoder(dequant: str, interpret: bool) -> str:
  """The decoder a launch uses: inline PTX cannot run in interpret mode, which decodes the same layout and
  values with jnp ("halves" for "asm"; the e4m3 route, "jnp", for "asm_e4m3" and "asm_fma")."""
  if interpret:
    return "halves" if dequant == "asm" else "jnp" if dequant in GEMV_DECODERS else dequant
  return dequant


def launch(kernel, operands: list, *, rows: int, cols: int, split: int, dtype, grid: tuple[int, int],
           num_warps: int, num_stages: int, interpret: bool, poison: bool, name: str, extra_out: tuple = (),
           sum_splits: bool = True):
  """Runs ``kernel`` over ``grid``; returns its [rows, cols] output in ``dtype``.

  split > 1: the kernel writes float32 partial sums [split, rows, cols], added here (``sum_splits``; else
  returned as they are, and the output with split 1 as [1, rows, cols]: a consumer kernel adds them). poison:
  the outputs start NaN-filled (aliased in place), so a tile the kernel fails to write shows up. extra_out: shapes
  (``jax.ShapeDtypeStruct``) of more outputs the kernel writes after that one; then (y, *those) is returned.
  """
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel

  shape, out_dtype = ((rows, cols), dtype) if split == 1 else ((split, rows, cols), jnp.float32)
  out_shapes = (jax.ShapeDtypeStruct(shape, out_dtype), *extra_out)
  aliases = {}
  if poison:
    aliases = {len(operands) + i: i for i in range(len(out_shapes))}
    operands = [*operands, *(jnp.full(s.shape, jnp.nan, s.dtype) for s in out_shapes)]
    kernel = functools.partial(drop_poison_refs, kernel, len(out_shapes))
  out, *extras = pl.pallas_call(
      kernel,
      out_shape=out_shapes,
      grid=grid,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      input_output_aliases=aliases,
      interpret=interpret,
      name=name,
  )(*operands)
  if sum_splits:
    y = out if split == 1 else out.sum(axis=0).astype(dtype)
  else:
    y = out[None] if split == 1 else out
  return (y, *extras) if extra_out else y
