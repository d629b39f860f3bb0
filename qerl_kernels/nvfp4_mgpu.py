"""NVFP4 weight-only matmul in Pallas Mosaic GPU (Hopper): the weight decoded in registers as wgmma's A operand.

Experimental, forward only, and off by default: timed at 584a6d9 (``experiments/bench_kernels.py --mosaic``), the 7B
gate at 64 rows ran 98.8 us against 56.1 for the tile kernel (one warpgroup per SM hides no latency;
qerl_kernels/NOTES.md item M). ``qerl_kernels.nvfp4_matmul`` runs it for a config with ``engine="mosaic"``, e.g. a
tuning file entry (``experiments/tuning_variant.py --entry fwd:64 --set engine=mosaic``, then
``QERL_KERNEL_TUNING``); the backward stays the tile kernel's. Why a second backend: at 8-64 rows the Triton tile
kernels are latency-bound, not byte- or issue-bound (7B gate at 64 rows: ~15 M warp instructions, ~15 us of issue,
55.6 us measured; qerl_kernels/NOTES.md item 3). Triton decodes the weight, writes it to shared memory in the MMA's
layout, and re-reads it with byte re-packing; it cannot take wgmma's A operand from registers for a computed value.
Mosaic GPU gives the layouts to the kernel: the 4-bit codes travel by TMA into shared memory, load into registers in
a layout that relayouts to wgmma's A fragment by shuffles of packed words, are decoded there, scaled per NVFP4 block
and fed to wgmma directly. This is the design of Marlin / Machete on Hopper, and of jax's own int8 x bf16
``hopper_mixed_type_matmul_mgpu``.

Computed transposed: y^T [N, M] = dequant(W)^T [N, K] @ x^T [K, M], so that the weight's output columns are
wgmma's M (64 per warpgroup) and x's rows its N (``tile_m``: 8 to 128, so few rows cost little). Each program
owns 64 output columns (or 128, ``tile_n``: two accumulators against each x tile) and ``tile_m`` rows;
``plgpu.emit_pipeline`` streams K in ``tile_k`` steps (x, codes, scales by TMA, ``stages`` in flight). Per
NVFP4 block of 16 (one wgmma of K = 16, x in a 32-byte swizzle): codes -> bf16 bits reading E2M1 * 2**-126
(the subnormal 0.5 included: 16-bit float arithmetic keeps subnormals on the GPU, as in ``nvfp4_tile``'s
PTX), times the block scale * 2**106, so the operand is E2M1 * scale * 2**-20, exact in bf16; 2**20 /
global_scale multiplies the float32 result.

Layouts on the way in: the packed weight [N, K/2] uint8 is read as int4 [N, K] (low nibble first, as XLA packs
int4: byte j holds columns 2j and 2j + 1, NVFP4's order); the scales are passed as [K/16, N] so each block's
64 scales are one contiguous row (a transposed copy per call, 1/16 of the codes' elements: a layout to store
once if this kernel wins).

Interpret mode (``interpret=True``, Mosaic GPU's CPU interpreter) runs the same pipeline, indexing, block
scales and accumulation. Three things differ, because the interpreter lacks them: wgmma reads A and B from
shared memory (copied there), x is transposed by value, and the codes decode by compares and selects to
E2M1 * 2**-20 (``decode="arith"``: XLA on the CPU flushes bf16 subnormals; the GPU may run it too). The GPU
path itself is checked by lowering it for CUDA on the CPU (Mosaic GPU validates its layouts then) and against a
float32 reference on the GPU before any timing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

TILE_N = 64  # output columns per wgmma: its M for one warpgroup (a program has tile_n / 64 of them)
_BLOCK = 16  # NVFP4 block: K per wgmma, and per block scale
_X_SWIZZLE = 32  # bytes: x's K-minor rows in 16-element (one block) swizzle groups, so wgmma may take K = 16


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
  """tile_m: x rows per program (wgmma's N; rows are padded up to it). tile_k: K per pipeline step (at least 256,
  so a step's 16 block scales per column fill TMA's 16-byte minimum row). stages: pipeline steps in flight.
  split: the K steps cut into this many equal ranges, one program each (``auto_split`` picks one).
  decode: how the 4-bit codes become bf16 (``_decoded_codes``); interpret mode always runs "arith".
  tile_n: 64, or 128 so that each x tile (at 64 rows 78% of a step's bytes) serves twice the weight columns."""

  tile_m: int = 64
  tile_k: int = 256
  stages: int = 2
  tile_n: int = 64  # output columns per program: 128 decodes and accumulates two halves against one x tile
  split: int = 1  # K ranges run by separate programs (float32 partials, summed outside): more programs at small N
  decode: str = "bits"  # "bits" (E2M1 * 2**-126 from bit operations) | "arith" (compares and selects; no subnormal)

  def __post_init__(self):
    if self.tile_m not in (8, 16, 32, 64, 128):
      raise ValueError(f"tile_m={self.tile_m} must be one of 8, 16, 32, 64, 128 (wgmma's N)")
    if self.tile_k < 256 or self.tile_k % 256:
      raise ValueError(f"tile_k={self.tile_k} must be a multiple of 256 (16 block scales per TMA row)")
    if self.stages < 1:
      raise ValueError(f"stages={self.stages} must be at least 1")
    if self.split < 1:
      raise ValueError(f"split={self.split} must be at least 1")
    if self.tile_n not in (64, 128):
      raise ValueError(f"tile_n={self.tile_n} must be 64 or 128")
    if self.decode not in ("bits", "arith"):
      raise ValueError(f"decode={self.decode!r} must be 'bits' or 'arith'")


def auto_split(rows: int, k: int, n: int, cfg: MgpuConfig, num_sms: int = 132, per_sm: int = 2) -> int:
  """The smallest split of the K steps into equal ranges that gives ``per_sm`` programs per SM (7B q/o at 8 rows
  have 56 column programs for 132 SMs, k/v 8), as long as the float32 partials stay within a quarter of the
  weight's bytes (else the largest split that does): they are written, then read again to be summed."""
  steps = k // cfg.tile_k
  m_pad = -(-rows // cfg.tile_m) * cfg.tile_m
  programs = (n // cfg.tile_n) * (m_pad // cfg.tile_m)
  want = -(-num_sms * per_sm // programs)
  weight_bytes = n * k // 2 + n * k // _BLOCK
  cap = max(1, weight_bytes // 4 // (4 * n * m_pad))
  divisors = [d for d in range(1, steps + 1) if steps % d == 0 and d <= cap]
  return next((d for d in divisors if d >= want), divisors[-1])


def from_matmul_config(cfg, m: int, k: int, n: int, num_sms: int = 132) -> MgpuConfig:
  """The MgpuConfig an ``Nvfp4MatmulConfig`` with engine "mosaic" stands for at this shape: the smallest row tile
  that holds m rows (at most block_m, 8-128), block_k as the K step, num_stages as the depth, 128 output columns
  per program where block_n is 128 or more and N allows, ``auto_split``."""
  cap = max(8, min(128, cfg.block_m))
  tile_m = next((t for t in (8, 16, 32, 64, 128) if t >= min(m, cap)), 128)
  tile_n = 128 if cfg.block_n >= 128 and n % 128 == 0 else TILE_N
  out = MgpuConfig(tile_m=tile_m, tile_k=cfg.block_k, stages=cfg.num_stages, tile_n=tile_n)
  return dataclasses.replace(out, split=auto_split(m, k, n, out, num_sms=num_sms))


def nvfp4_matmul_fwd_mgpu(x_MxK: jax.Array, packed_NxKh: jax.Array, scale_NxKb: jax.Array, global_scale: jax.Array,
                          *, config: MgpuConfig = MgpuConfig(), interpret: bool = False) -> jax.Array:
  """y [M, N] = x @ dequant(W) in x's dtype (bf16), W as packed uint8 [N, K/2], e4m3 scales [N, K/16] and the
  float32 global scale (``qerl_jax.quant.quantize(w, "nvfp4")``). N must be a multiple of 64, K of tile_k."""
  return matmul_f32(x_MxK, packed_NxKh, scale_NxKb, global_scale, config=config, interpret=interpret).astype(
      x_MxK.dtype)


def matmul_f32(x_MxK: jax.Array, packed_NxKh: jax.Array, scale_NxKb: jax.Array, global_scale: jax.Array, *,
               config: MgpuConfig, interpret: bool = False) -> jax.Array:
  """``nvfp4_matmul_fwd_mgpu`` before its rounding: float32 [M, N] (an epilogue adds to it first)."""
  m, k = _check(x_MxK, packed_NxKh, scale_NxKb, config)
  n = packed_NxKh.shape[0]
  tile_m = config.tile_m
  m_pad = -(-m // tile_m) * tile_m
  x_pad = jnp.pad(x_MxK, ((0, m_pad - m), (0, 0))) if m_pad != m else x_MxK
  codes_NxK = jax.lax.bitcast_convert_type(packed_NxKh, jnp.int4).reshape(n, k)
  scale_KbxN = jax.lax.bitcast_convert_type(scale_NxKb, jnp.uint8).T
  kernel = _kernel(n, m_pad, k, config, interpret)
  yT_SxNxM = kernel(x_pad, codes_NxK, scale_KbxN)
  multiplier = jnp.float32(2.0 ** 20) / jnp.asarray(global_scale, jnp.float32).reshape(())
  return yT_SxNxM.sum(axis=0)[:, :m].T * multiplier


def _check(x_MxK, packed_NxKh, scale_NxKb, config: MgpuConfig) -> tuple[int, int]:
  if x_MxK.ndim != 2 or x_MxK.dtype != jnp.bfloat16:
    raise ValueError(f"x must be 2-D bfloat16 [M, K], got {x_MxK.dtype}{list(x_MxK.shape)}")
  m, k = x_MxK.shape
  if packed_NxKh.dtype != jnp.uint8 or packed_NxKh.ndim != 2 or packed_NxKh.shape[1] * 2 != k:
    raise ValueError(f"packed weight must be uint8 [N, K/2 = {k // 2}], got {packed_NxKh.dtype}"
                     f"{list(packed_NxKh.shape)}")
  n = packed_NxKh.shape[0]
  if scale_NxKb.shape != (n, k // _BLOCK) or scale_NxKb.dtype != jnp.float8_e4m3fn:
    raise ValueError(f"scales must be float8_e4m3fn [N, K/16] = [{n}, {k // _BLOCK}], got {scale_NxKb.dtype}"
                     f"{list(scale_NxKb.shape)}")
  if n % config.tile_n:
    raise ValueError(f"N={n} (out_features) must be a multiple of tile_n={config.tile_n} for the Mosaic GPU kernel")
  if k % config.tile_k:
    raise ValueError(f"K={k} (in_features) must be a multiple of tile_k={config.tile_k}")
  if (k // config.tile_k) % config.split:
    raise ValueError(f"K={k} has {k // config.tile_k} steps of tile_k={config.tile_k}: not {config.split} equal "
                     f"ranges (split={config.split})")
  if m < 1:
    raise ValueError(f"x has no rows: {list(x_MxK.shape)}")
  return m, k


def _kernel(n: int, m_pad: int, k: int, cfg: MgpuConfig, interpret: bool):
  """The plgpu.kernel: (x [M', K] bf16, codes int4 [N, K], scales uint8 [K/16, N]) -> float32 partials of y^T
  [split, N, M'], one per K range."""
  tile_m, tile_k = cfg.tile_m, cfg.tile_k
  range_steps = k // tile_k // cfg.split
  blocks = tile_k // _BLOCK
  codes_swizzle = plgpu.find_swizzle(tile_k * 4, "lhs")
  codes_transforms = (plgpu.TilingTransform((8, codes_swizzle * 2)), plgpu.SwizzleTransform(codes_swizzle))
  x_transforms = (plgpu.TilingTransform((8, _X_SWIZZLE // 2)), plgpu.SwizzleTransform(_X_SWIZZLE))
  if interpret:  # the interpreter reads neither transforms nor layouts: the same data, plain
    codes_transforms = x_transforms = ()
  wgmma_layout = plgpu.Layout.WGMMA
  decode = "arith" if interpret else cfg.decode
  scale_power = np.float32(2.0 ** 106 if decode == "bits" else 1.0)  # the decoded codes' 2**-126 or 2**-20
  row_layout = plgpu.Layout.WGMMA.reduce(1)  # one value per output column (wgmma's M), as the A fragment holds

  tile_n, halves = cfg.tile_n, cfg.tile_n // TILE_N

  def nvfp4_matmul_mgpu(x_gmem, codes_gmem, scale_gmem, o_gmem, o_smem, *interpret_smem):  # the trace's name
    ni, mi, si = jax.lax.axis_index("n"), jax.lax.axis_index("m"), jax.lax.axis_index("s")
    k0 = si * range_steps  # this program's first K step

    def acc_scope(*acc_refs):  # one accumulator per 64 output columns
      def step(_, x_smem, codes_smem, scale_smem):  # one tile_k of K: x [tile_m, tile_k], codes [tile_n, tile_k]
        for h, acc_ref in enumerate(acc_refs):
          w_bf = _decoded_codes(codes_smem.at[pl.ds(h * TILE_N, TILE_N)])
          for b in range(blocks):
            scale_row = scale_smem.at[b, pl.ds(h * TILE_N, TILE_N)]
            s = scale_row[...] if interpret else plgpu.load(scale_row, (), layout=row_layout)
            # e4m3 -> float32 (Hopper's ptxas converts e4m3 to f16 only), times 2**106 for "bits", exact in bf16.
            s_bf = (jax.lax.bitcast_convert_type(s, jnp.float8_e4m3fn).astype(jnp.float32) * scale_power).astype(
                jnp.bfloat16)
            a = w_bf[:, b * _BLOCK:(b + 1) * _BLOCK] * jax.lax.broadcast_in_dim(s_bf, (TILE_N, _BLOCK), (0,))
            x_block = x_smem.at[:, pl.ds(b * _BLOCK, _BLOCK)]
            if interpret:
              a_smem, xT_smem = interpret_smem
              a_smem[...] = a
              xT_smem[...] = x_block[...].T
              plgpu.wgmma(acc_ref, a_smem, xT_smem)
            else:
              plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(x_block, (1, 0)))
        plgpu.wgmma_wait(0)

      plgpu.emit_pipeline(
          step, grid=(range_steps,), max_concurrent_steps=cfg.stages,
          in_specs=[plgpu.BlockSpec((tile_m, tile_k), lambda kk: (mi, k0 + kk), transforms=x_transforms),
                    plgpu.BlockSpec((tile_n, tile_k), lambda kk: (ni, k0 + kk), transforms=codes_transforms),
                    plgpu.BlockSpec((blocks, tile_n), lambda kk: (k0 + kk, ni))],
      )(x_gmem, codes_gmem, scale_gmem)
      for h, acc_ref in enumerate(acc_refs):
        o_smem[pl.ds(h * TILE_N, TILE_N)] = acc_ref[...]

    pl.run_scoped(acc_scope, *[plgpu.ACC((TILE_N, tile_m), jnp.float32) for _ in range(halves)])
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, pl.ds(ni * tile_n, tile_n), pl.ds(mi * tile_m, tile_m)])
    plgpu.wait_smem_to_gmem(0)

  def _decoded_codes(codes_smem):
    """bf16 [64, tile_k] from 64 rows of codes, either E2M1 * 2**-126 from bit operations ("bits": the sign to
    bit 15, the exponent and mantissa bits to 8..6, the subnormal 0.5 included, which 16-bit float arithmetic
    keeps on the GPU), or E2M1 * 2**-20 from compares and selects ("arith": no subnormal; XLA on the CPU
    flushes them)."""
    if interpret:
      codes = codes_smem[...]
    else:  # the 4-bit codes relayout to the A fragment while packed (shuffles of 32-bit words), then widen
      codes = plgpu.layout_cast(plgpu.load(codes_smem, (), layout=plgpu.Layout.WGMMA_UPCAST_4X), wgmma_layout)
    c = codes.astype(jnp.int16) & 0xF
    if decode == "bits":
      return jax.lax.bitcast_convert_type(((c & 8) << 12) | ((c & 7) << 6), jnp.bfloat16)
    i = (c & 7).astype(jnp.float32)
    mag = jnp.where(i < 4, i * 0.5, jnp.where(i == 7, 6.0, i - 2.0))  # E2M1's magnitudes by code
    return (jnp.where((c & 8) != 0, -mag, mag) * np.float32(2.0 ** -20)).astype(jnp.bfloat16)

  scratch = [plgpu.SMEM((tile_n, tile_m), jnp.float32)]
  if interpret:
    scratch += [plgpu.SMEM((TILE_N, _BLOCK), jnp.bfloat16), plgpu.SMEM((_BLOCK, tile_m), jnp.bfloat16)]
  params = None
  if interpret:
    from jax._src.pallas.mosaic_gpu.interpret import params as interpret_params  # pylint: disable=C0415
    params = interpret_params.InterpretGPUParams()
  return plgpu.kernel(nvfp4_matmul_mgpu, out_type=jax.ShapeDtypeStruct((cfg.split, n, m_pad), jnp.float32),
                      scratch_types=scratch, grid=(n // tile_n, m_pad // tile_m, cfg.split),
                      grid_names=("n", "m", "s"), interpret=params)
