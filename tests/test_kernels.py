"""NVFP4 matmul kernels in Pallas interpret mode against an independent NumPy oracle.

Inputs are fresh random packed bytes (every nibble value), random positive finite e4m3 block scales and a
random global scale; the seed comes from the test name. Interpret mode starts every output as NaN, and the
``poison`` path aliases a NaN-filled buffer in, so a tile the kernel does not write fails the comparison.
"""

import dataclasses
import json
import os
import re
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qerl_kernels as kernels
from qerl_kernels import config as config_lib, nvfp4_gemv
from qerl_kernels.config import Nvfp4MatmulConfig
from qerl_kernels.nvfp4_matmul_bwd import nvfp4_matmul_bwd_pallas
from qerl_kernels.nvfp4_matmul_fwd import nvfp4_matmul_fwd_pallas
from qerl_jax.quant.types import NVFP4Tensor
from tests.triton_lowering import lower_for_cuda

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def _rng(request):
  seed = zlib.crc32(request.node.name.encode())
  print(f"seed={seed}")
  return np.random.default_rng(seed)


def _random_q(rng, k, n):
  packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
  # Log-uniform positive scales across e4m3's range, subnormals included; all finite (< 448).
  scale = np.exp2(rng.uniform(-9, 8.7, (n, k // 16))).astype(ml_dtypes.float8_e4m3fn)
  gs = np.array([rng.uniform(50.0, 3000.0)], np.float32)
  return NVFP4Tensor(jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(gs))


def _dequant_np(q):
  """W [K, N] in float64 from the bytes: E2M1[code] * scale / global_scale (NVFP4.md)."""
  p = np.asarray(q.packed_NxKh)
  codes = np.stack([p & 15, p >> 4], -1).reshape(p.shape[0], -1)
  scale = np.repeat(np.asarray(q.scale_NxKb).astype(np.float64), 16, axis=1)
  return (E2M1[codes] * scale / np.float64(np.asarray(q.global_scale)[0])).T


def _assert_close(got, a, b, out_dtype):
  """got ~ a @ b (float64), within one rounding to out_dtype plus float32 accumulation error."""
  got = np.asarray(jnp.asarray(got).astype(jnp.float32)).astype(np.float64)
  a = np.asarray(jnp.asarray(a).astype(jnp.float32)).astype(np.float64)
  want = a @ b
  bound = np.abs(a) @ np.abs(b)
  ulp = float(jnp.finfo(out_dtype).eps)
  tol = ulp * np.abs(want) + 1e-5 * bound + 1e-30
  assert not np.isnan(got).any(), "NaN in output: a tile was not written"
  bad = np.abs(got - want) > tol
  assert not bad.any(), f"{bad.sum()} of {bad.size} wrong; max err {np.abs(got - want).max()}"


FWD_CASES = [
  # (M, K, N, dtype, config or None)
  (1, 16, 16, jnp.bfloat16, None),  # smallest K and N
  (20, 64, 48, jnp.bfloat16, Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=32, split=2)),  # ragged
  (3, 48, 40, jnp.float16, None),  # K = 3 blocks: block_k falls to 16
  (37, 128, 24, jnp.bfloat16, Nvfp4MatmulConfig(block_m=32, block_n=16, block_k=64, group_m=2)),
  # The "halves" decoder (x's even / odd columns meet the two nibble planes): ragged, split, fp16.
  (20, 64, 48, jnp.bfloat16, Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=32, split=2, dequant="halves")),
  (37, 192, 24, jnp.float16, Nvfp4MatmulConfig(block_m=32, block_n=16, block_k=64, split=3, dequant="halves")),
  # The halves decoder splitting x's run in registers (x_in_place): ragged rows and N, a ragged split, fp16.
  (20, 64, 48, jnp.bfloat16, Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=32, split=2, dequant="halves",
                                               x_in_place=True)),
  (37, 160, 24, jnp.float16, Nvfp4MatmulConfig(block_m=32, block_n=16, block_k=32, split=2, dequant="halves",
                                               ragged_split=True, x_in_place=True)),
  # Ragged K ranges in the tile kernel: 5 K steps as 3 + 2, and as 2 + 2 + 1 with the halves decoder.
  (20, 160, 48, jnp.bfloat16, Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=32, split=2, ragged_split=True)),
  (5, 160, 24, jnp.float16, Nvfp4MatmulConfig(block_m=16, block_n=16, block_k=32, split=3, dequant="halves",
                                              ragged_split=True)),
  # The few-row gemv engine: one row at the smallest K, ragged N with a 3-way split, the most rows it takes.
  (1, 16, 16, jnp.bfloat16, Nvfp4MatmulConfig(block_n=16, block_k=16, engine="gemv")),
  (5, 192, 56, jnp.float16, Nvfp4MatmulConfig(block_n=32, block_k=64, split=3, engine="gemv")),
  (16, 256, 40, jnp.bfloat16, Nvfp4MatmulConfig(block_n=16, block_k=32, split=2, engine="gemv")),
  # A ragged gemv split: 5 K steps in ranges of 3 and 2 (the last program's loop is shorter), with prefetch.
  (3, 160, 40, jnp.bfloat16, Nvfp4MatmulConfig(block_n=16, block_k=32, split=2, engine="gemv", prefetch=True)),
  # Three trips loaded ahead: deeper than either range (the loads clamp to the range's last trip).
  (2, 160, 24, jnp.float16, Nvfp4MatmulConfig(block_n=16, block_k=32, split=2, engine="gemv", prefetch=3)),
  (1, 256, 48, jnp.bfloat16, Nvfp4MatmulConfig(block_n=16, block_k=32, engine="gemv", prefetch=2)),
  (2, 160, 24, jnp.bfloat16, Nvfp4MatmulConfig(block_n=16, block_k=32, split=3, engine="gemv", dequant="asm")),
  # x read where it lies (stride-2 loads of each plane): a ragged split with prefetch, float16 x, many rows.
  (2, 160, 40, jnp.bfloat16, Nvfp4MatmulConfig(block_n=16, block_k=32, split=2, engine="gemv", prefetch=1,
                                               x_in_place=True)),
  (5, 192, 56, jnp.float16, Nvfp4MatmulConfig(block_n=32, block_k=64, split=3, engine="gemv", x_in_place=True)),
  (1, 256, 48, jnp.bfloat16, Nvfp4MatmulConfig(block_n=16, block_k=32, engine="gemv", dequant="asm_fma",
                                               x_in_place=True)),
  # The gemv's K loop marked for Triton's software pipeliner (pipeline; interpret mode runs the mark as the
  # identity): a ragged split, and the model's one-row decoder reading x in place at two stages.
  (3, 160, 40, jnp.bfloat16, Nvfp4MatmulConfig(block_n=16, block_k=32, split=2, engine="gemv", pipeline=True)),
  (1, 256, 48, jnp.bfloat16, Nvfp4MatmulConfig(block_n=16, block_k=32, engine="gemv", dequant="asm_fma",
                                               x_in_place=True, num_stages=2, pipeline=True)),
  # A tail split (tail_slots): 7 column blocks on 3 slots, so blocks 6 runs in 3 programs of 2 + 2 + 1 K steps;
  # and 5 blocks on 4 slots with the halves decoder reading x in place (the last block in 4 ranges of one step).
  (20, 160, 112, jnp.float16, Nvfp4MatmulConfig(block_m=32, block_n=16, block_k=32, tail_slots=3)),
  (37, 128, 72, jnp.bfloat16, Nvfp4MatmulConfig(block_m=64, block_n=16, block_k=32, dequant="halves",
                                                x_in_place=True, tail_slots=4)),
]
# The gemv with float16 block sums (``half_products``): one and two rows, a ragged split with prefetch, float16 x,
# the e4m3-route PTX decoder (interpret mode runs its jnp twin).
HALF_CASES = [
  (1, 256, 48, jnp.bfloat16, Nvfp4MatmulConfig(block_n=16, block_k=32, engine="gemv", half_products=True)),
  (2, 160, 40, jnp.bfloat16, Nvfp4MatmulConfig(block_n=16, block_k=32, split=2, engine="gemv", prefetch=1,
                                               dequant="asm_e4m3", half_products=True)),
  (3, 192, 56, jnp.float16, Nvfp4MatmulConfig(block_n=32, block_k=64, split=3, engine="gemv", half_products=True)),
  (2, 160, 40, jnp.bfloat16, Nvfp4MatmulConfig(block_n=16, block_k=32, split=2, engine="gemv", half_products=True,
                                               x_in_place=True)),
]


def _assert_close_half(got, a, b, out_dtype):
  """got ~ a @ b (float64) with each NVFP4 block's 16 products summed in float16: per block at most 15 roundings
  of 2**-11 of that block's sum of |products|, one rounding to out_dtype, and overall within bf16 accuracy."""
  got = np.asarray(jnp.asarray(got).astype(jnp.float32)).astype(np.float64)
  a = np.asarray(jnp.asarray(a).astype(jnp.float32)).astype(np.float64)
  want = a @ b
  bound = np.abs(a) @ np.abs(b)
  tol = float(jnp.finfo(out_dtype).eps) * np.abs(want) + 15 * 2.0**-11 * bound + 1e-30
  assert not np.isnan(got).any(), "NaN in output: a tile was not written"
  assert (np.abs(got - want) <= tol).all(), f"max err {np.abs(got - want).max()}"
  assert np.linalg.norm(got - want) <= 4e-3 * np.linalg.norm(want)


@pytest.mark.parametrize("m,k,n,dtype,cfg", HALF_CASES)
def test_gemv_with_float16_block_sums_matches_oracle(request, m, k, n, dtype, cfg):
  rng = _rng(request)
  q = _random_q(rng, k, n)
  # Rows far apart in size. In bf16, float16 alone would overflow the first (1e6) and flush the last (1e-7) to
  # zero; float16 x spans less.
  row_scale = np.array([1e6, 1.0, 1e-7] if dtype == jnp.bfloat16 else [1e3, 1.0, 1e-3])[:m, None]
  x = jnp.asarray(rng.standard_normal((m, k)) * row_scale, dtype)
  cfg = config_lib.fit(cfg, "fwd", m, k, n)
  assert cfg.half_products and cfg.engine == "gemv"
  y = nvfp4_matmul_fwd_pallas(x, q.packed_NxKh, q.scale_NxKb, q.global_scale, config=cfg,
                              interpret=True, poison=True)
  assert y.shape == (m, n) and y.dtype == dtype
  _assert_close_half(y, x, _dequant_np(q), dtype)


def test_half_products_apply_to_the_e4m3_route_gemv_only():
  half = Nvfp4MatmulConfig(block_n=32, block_k=64, engine="gemv", half_products=True)
  assert config_lib.fit(half, "fwd", 1, 128, 64).half_products
  assert config_lib.fit(dataclasses.replace(half, dequant="asm_e4m3"), "fwd", 2, 128, 64).half_products
  assert not config_lib.fit(dataclasses.replace(half, dequant="asm"), "fwd", 1, 128, 64).half_products
  assert not config_lib.fit(half, "fwd", config_lib.GEMV_MAX_ROWS + 1, 128, 64).half_products  # a tile kernel
  assert not config_lib.fit(half, "bwd", 1, 128, 64).half_products


def test_half_gemv_takes_the_bias_and_lora_epilogue(request):
  rng = _rng(request)
  m, k, n, r = 2, 128, 40, 4
  q = _random_q(rng, k, n)
  x = jnp.asarray(rng.standard_normal((m, k)) * np.array([[3e4], [1e-3]]), jnp.bfloat16)
  xa = jnp.asarray(rng.standard_normal((m, r)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((r, n)), jnp.bfloat16)
  bias = jnp.asarray(rng.standard_normal(n), jnp.bfloat16)
  cfg = config_lib.fit(Nvfp4MatmulConfig(block_n=16, block_k=32, engine="gemv", half_products=True, split=2),
                       "fwd", m, k, n)
  assert cfg.half_products
  y = nvfp4_matmul_fwd_pallas(x, q.packed_NxKh, q.scale_NxKb, q.global_scale, config=cfg, xa_MxR=xa, b_RxN=b,
                              bias_N=bias, lora_scale=0.5, interpret=True, poison=True)
  f64 = lambda t: np.asarray(jnp.asarray(t, jnp.float32), np.float64)  # noqa: E731
  w = _dequant_np(q)
  want = f64(x) @ w + f64(bias)[None] + 0.5 * f64(xa) @ f64(b)
  # One bf16 rounding of the sum, float16 block sums' error (as ``_assert_close_half``), float32 elsewhere.
  tol = 2.0**-8 * np.abs(want) + 15 * 2.0**-11 * (np.abs(f64(x)) @ np.abs(w)) + 1e-6 * np.abs(want).max(axis=1,
                                                                                                  keepdims=True)
  err = np.abs(f64(y) - want)
  assert (err <= tol).all(), f"max err / tol {(err / tol).max()}"


def test_half_x_powers_put_the_largest_x_just_below_2_to_the_12(request):
  rng = _rng(request)
  # Magnitudes from 1e-37 to bf16's largest, zero, a float16 subnormal and float32's smallest normal.
  amax = np.concatenate([np.exp(rng.uniform(np.log(1e-37), np.log(3e38), 200)), [0.0, 2.0**-20, 2.0**-126]])
  amax = amax.astype(ml_dtypes.bfloat16).astype(np.float32)
  up, down = (np.asarray(p, np.float64) for p in jax.jit(nvfp4_gemv.half_x_powers)(jnp.asarray(amax)))
  assert (np.log2(up) == np.round(np.log2(up))).all() and (up * down == 1.0).all()
  scaled = amax * up
  normal = amax >= 2.0**-114  # below, the largest power (2**126) is kept
  assert (scaled[normal] < 2.0**12).all() and (scaled[normal] >= 2.0**11).all()
  assert (up[~normal] == 2.0**126).all()
  # A bf16 x at most amax, scaled, is exact in float16 unless below float16's normal range (2**-26 of amax).
  x = (amax[:, None] * rng.uniform(-1, 1, (amax.size, 64))).astype(ml_dtypes.bfloat16).astype(np.float64)
  x16 = (x * up[:, None]).astype(np.float16).astype(np.float64)
  big = (np.abs(x) >= amax[:, None] * 2.0**-25) & normal[:, None]
  np.testing.assert_array_equal(x16[big] * down[:, None].repeat(64, 1)[big], x[big])


@pytest.mark.parametrize("m,k,n,dtype,cfg", FWD_CASES)
def test_fwd_kernel_matches_oracle(request, m, k, n, dtype, cfg):
  rng = _rng(request)
  q = _random_q(rng, k, n)
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  wanted = (cfg.dequant, cfg.engine) if cfg else ("jnp", "gemv" if m <= 2 else "tensorcore")
  cfg = config_lib.fit(cfg, "fwd", m, k, n) if cfg else config_lib.heuristic_config("fwd", m, k, n)
  assert (cfg.dequant, cfg.engine) == wanted
  y = nvfp4_matmul_fwd_pallas(x, q.packed_NxKh, q.scale_NxKb, q.global_scale, config=cfg,
                              interpret=True, poison=True)
  assert y.shape == (m, n) and y.dtype == dtype
  _assert_close(y, x, _dequant_np(q), dtype)


def test_tail_plan_splits_only_the_blocks_past_the_last_whole_round():
  from qerl_kernels.nvfp4_matmul_fwd import TailPlan, tail_plan
  tile = Nvfp4MatmulConfig(block_m=64, block_n=64, block_k=128, num_warps=2, tail_slots=528)
  # 7B gate|up at 64 rows: 592 blocks on 528 slots; the last 64 in 7 ranges of 4 of the 28 K steps, from the
  # column where up's block 232 starts.
  assert tail_plan(tile, 64, 28, (18944, 18944)) == TailPlan(528, 7, 18944 + 232 * 64)
  assert tail_plan(tile, 64, 28, (37888,)) == TailPlan(528, 7, 528 * 64)
  off = dataclasses.replace(tile, tail_slots=0)
  for cfg, m, widths in ((off, 64, (37888,)),  # off
                         (dataclasses.replace(tile, split=2), 64, (37888,)),  # already split
                         (tile, 65, (37888,)),  # two row tiles
                         (tile, 64, (33792,)),  # 528 blocks: one whole round
                         (tile, 64, (18944,)),  # 296 blocks: less than one round
                         (dataclasses.replace(tile, tail_slots=100), 64, (4096,)),  # 64 blocks: no whole round
                         (tile, 64, (27648, 27648))):  # 32B gate|up: 336 past 528, 528 // 336 = 1 part
    assert tail_plan(cfg, m, 28, widths) is None, (cfg.tail_slots, m, widths)
  with pytest.raises(ValueError, match="tail_slots"):
    Nvfp4MatmulConfig(tail_slots=-1)


def test_tail_split_hands_a_consumer_one_finished_output(request):
  # Kernels that add split-K partials themselves (the decode step's, through sum_splits=False) get [1, M, N] in x's
  # dtype from a tail-split launch: its tail is already added, as an unsplit launch's output is.
  rng = _rng(request)
  m, k, n = 24, 128, 80
  q = _random_q(rng, k, n)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  cfg = config_lib.fit(Nvfp4MatmulConfig(block_m=32, block_n=16, block_k=32, tail_slots=4), "fwd", m, k, n)
  from qerl_kernels.nvfp4_matmul_fwd import TailPlan, tail_plan
  assert tail_plan(cfg, m, k // cfg.block_k, (n,)) == TailPlan(4, 4, 64)  # block 4 in 4 ranges of one K step
  kw = dict(config=cfg, interpret=True, poison=True)
  parts = nvfp4_matmul_fwd_pallas(x, q.packed_NxKh, q.scale_NxKb, q.global_scale, sum_splits=False, **kw)
  assert parts.shape == (1, m, n) and parts.dtype == jnp.bfloat16
  _assert_close(parts[0], x, _dequant_np(q), jnp.bfloat16)


def test_gemv_reads_x_in_place_with_no_layout_op(request):
  # x_in_place: the operand the gemv launch gets is x itself (a reshape, no transpose or float32 copy); the
  # default lays out float32 planes first. Both give the oracle's product.
  from tests.test_rollout_layers import _eqns  # pylint: disable=import-outside-toplevel
  rng = _rng(request)
  m, k, n = 2, 128, 32
  q = _random_q(rng, k, n)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  for in_place in (False, True):
    cfg = config_lib.fit(Nvfp4MatmulConfig(block_n=16, block_k=32, engine="gemv", x_in_place=in_place), "fwd", m,
                         k, n)
    f = lambda x, cfg=cfg: nvfp4_matmul_fwd_pallas(x, q.packed_NxKh, q.scale_NxKb, q.global_scale, config=cfg,
                                                     interpret=True)
    eqns = list(_eqns(jax.make_jaxpr(f)(x).jaxpr))
    prims = [e.primitive.name for e in eqns]
    call = next(e for e in eqns if e.primitive.name == "pallas_call")
    x_operand = call.invars[0].aval
    if in_place:
      assert "transpose" not in prims and (x_operand.shape, x_operand.dtype) == ((m, k // 16, 8, 2), jnp.bfloat16)
    else:
      assert "transpose" in prims and (x_operand.shape, x_operand.dtype) == ((m, 2, k // 16, 8), jnp.float32)
    _assert_close(f(x), x, _dequant_np(q), jnp.bfloat16)


def test_halves_tile_reads_x_in_place_with_no_reordered_copy(request):
  # The halves decoder meets x's even and odd columns: by default XLA reorders each block_k run first (a
  # transpose before the launch); with x_in_place the launch gets x itself and splits it in registers. Both give
  # the oracle's product, with the bias and adapter epilogue too.
  from tests.test_rollout_layers import _eqns  # pylint: disable=import-outside-toplevel
  rng = _rng(request)
  m, k, n, r = 8, 128, 48, 4
  q = _random_q(rng, k, n)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  xa = jnp.asarray(rng.standard_normal((m, r)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((r, n)) * 0.1, jnp.bfloat16)
  outs = []
  for in_place in (False, True):
    cfg = config_lib.fit(Nvfp4MatmulConfig(block_m=16, block_n=16, block_k=64, split=2, dequant="halves",
                                           x_in_place=in_place), "fwd", m, k, n)
    assert (cfg.engine, cfg.dequant, cfg.split) == ("tensorcore", "halves", 2)
    f = lambda x, cfg=cfg: nvfp4_matmul_fwd_pallas(x, q.packed_NxKh, q.scale_NxKb, q.global_scale, config=cfg,
                                                     xa_MxR=xa, b_RxN=b, lora_scale=0.5, interpret=True,
                                                     poison=True)
    eqns = list(_eqns(jax.make_jaxpr(f)(x).jaxpr))
    call = next(e for e in eqns if e.primitive.name == "pallas_call")
    before = [e.primitive.name for e in eqns[:eqns.index(call)]]
    assert ("transpose" in before) != in_place, before
    assert (call.invars[0].aval.shape, call.invars[0].aval.dtype) == ((m, k), jnp.bfloat16)
    y = f(x)
    outs.append(np.asarray(y.astype(jnp.float32)))
    f64 = lambda t: np.asarray(jnp.asarray(t, jnp.float32), np.float64)  # noqa: E731
    want = f64(x) @ _dequant_np(q) + 0.5 * f64(xa) @ f64(b)
    err = np.abs(f64(y) - want)
    assert (err <= 2.0**-8 * np.abs(want) + 1e-5 * np.abs(want).max()).all(), err.max()
  # The same float32 products in the same order: the two layouts agree bit for bit.
  np.testing.assert_array_equal(outs[0], outs[1])


BWD_CASES = [
  (1, 16, 16, jnp.bfloat16, None),
  (20, 64, 48, jnp.bfloat16, Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=32, split=2)),  # ragged
  (5, 96, 56, jnp.float16, Nvfp4MatmulConfig(block_m=16, block_n=16, block_k=32, split=3)),
  (33, 32, 40, jnp.bfloat16, Nvfp4MatmulConfig(block_m=32, block_n=32, block_k=16, group_m=2)),
  (20, 64, 48, jnp.bfloat16, Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=32, split=2, dequant="halves")),
  (5, 192, 56, jnp.float16, Nvfp4MatmulConfig(block_m=16, block_n=16, block_k=64, split=3, dequant="halves")),
]


@pytest.mark.parametrize("m,k,n,dtype,cfg", BWD_CASES)
def test_bwd_kernel_matches_oracle(request, m, k, n, dtype, cfg):
  rng = _rng(request)
  q = _random_q(rng, k, n)
  dy = jnp.asarray(rng.standard_normal((m, n)), dtype)
  wanted = cfg.dequant if cfg else "jnp"
  cfg = config_lib.fit(cfg, "bwd", m, k, n) if cfg else config_lib.heuristic_config("bwd", m, k, n)
  assert cfg.dequant == wanted
  dx = nvfp4_matmul_bwd_pallas(dy, q.packed_NxKh, q.scale_NxKb, q.global_scale, config=cfg,
                               interpret=True, poison=True)
  assert dx.shape == (m, k) and dx.dtype == dtype
  _assert_close(dx, dy, _dequant_np(q).T, dtype)


def test_interpret_outputs_start_poisoned():
  """The check above relies on this: an output the kernel never writes comes back NaN, not zero."""
  from jax.experimental import pallas as pl

  def writes_nothing(x_ref, o_ref):
    del x_ref, o_ref

  out = pl.pallas_call(writes_nothing, out_shape=jax.ShapeDtypeStruct((4, 4), jnp.float32),
                       interpret=True)(jnp.ones((4, 4)))
  assert np.isnan(np.asarray(out)).all()


def test_public_api_batched_and_reference(request):
  rng = _rng(request)
  q = _random_q(rng, 64, 32)
  x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.bfloat16)
  y = kernels.nvfp4_matmul(x, q, interpret=True)
  assert y.shape == (2, 3, 32) and y.dtype == jnp.bfloat16
  _assert_close(y.reshape(6, 32), x.reshape(6, 64), _dequant_np(q), jnp.bfloat16)
  # The reference rounds the weight to bf16 first: agree within that rounding.
  ref = np.asarray(kernels.nvfp4_matmul_reference(x, q).astype(jnp.float32))
  bound = np.abs(np.asarray(x.astype(jnp.float32))) @ np.abs(_dequant_np(q))
  assert np.all(np.abs(np.asarray(y.astype(jnp.float32)) - ref) <= 2**-7 * bound.reshape(ref.shape))


def test_gradient_matches_reference_and_never_expands_the_weight(request):
  rng = _rng(request)
  m, k, n = 19, 64, 48
  q = _random_q(rng, k, n)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  c = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)

  def loss(x, impl):
    y = kernels.nvfp4_matmul(x, q, implementation=impl, interpret=impl == "pallas")
    return jnp.sum(y.astype(jnp.float32) * c)

  g = jax.grad(loss)(x, "pallas")
  g_ref = jax.grad(loss)(x, "xla")
  w = _dequant_np(q)
  # dL/dx = dy @ W^T, with dy = c rounded to y's dtype (the cotangent of a bf16 output is bf16).
  _assert_close(g, c.astype(jnp.bfloat16), w.T, jnp.bfloat16)
  bound = np.abs(np.asarray(c)) @ np.abs(w.T)
  diff = np.abs(np.asarray(g.astype(jnp.float32)) - np.asarray(g_ref.astype(jnp.float32)))
  assert np.all(diff <= 2**-6 * bound)

  # No [K, N] or [N, K] float array anywhere in the forward+backward program: the weight stays packed.
  jaxpr = jax.make_jaxpr(jax.grad(loss), static_argnums=1)(x, "pallas")
  names, shapes = [], []

  def walk(jx):
    for eqn in jx.eqns:
      names.append(eqn.params.get("name", eqn.primitive.name))
      for v in eqn.outvars:
        aval = v.aval
        if hasattr(aval, "shape") and jnp.issubdtype(aval.dtype, jnp.floating):
          shapes.append(tuple(aval.shape))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
      for p in eqn.params.values():
        if isinstance(p, jax.extend.core.ClosedJaxpr):
          walk(p.jaxpr)
        elif isinstance(p, jax.extend.core.Jaxpr):
          walk(p)

  walk(jaxpr.jaxpr)
  assert "nvfp4_matmul_fwd" in names and "nvfp4_matmul_bwd" in names, names
  assert (k, n) not in shapes and (n, k) not in shapes


def test_cpu_dispatch_falls_back_to_xla(request):
  assert jax.devices()[0].platform == "cpu"
  assert kernels.default_implementation(jnp.bfloat16) == "xla"
  rng = _rng(request)
  q = _random_q(rng, 32, 16)
  x = jnp.asarray(rng.standard_normal((4, 32)), jnp.bfloat16)
  y = kernels.nvfp4_matmul(x, q)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(kernels.nvfp4_matmul_reference(x, q)))
  text = jax.jit(kernels.nvfp4_matmul).lower(x, q).as_text()
  assert "triton" not in text and "pallas" not in text
  with pytest.raises(ValueError, match="compute capability"):
    kernels.nvfp4_matmul(x, q, implementation="pallas")


def test_bad_inputs_raise_clear_errors(request):
  rng = _rng(request)
  q = _random_q(rng, 32, 16)
  x = jnp.ones((4, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match="must end in K=32"):
    kernels.nvfp4_matmul(jnp.ones((4, 48), jnp.bfloat16), q)
  q24 = NVFP4Tensor(jnp.zeros((16, 12), jnp.uint8), jnp.zeros((16, 1), jnp.float8_e4m3fn),
                    jnp.ones((1,), jnp.float32))
  with pytest.raises(ValueError, match="k=24"):
    kernels.nvfp4_matmul(jnp.ones((4, 24), jnp.bfloat16), q24)
  with pytest.raises(ValueError, match="scale_NxKb.shape"):
    kernels.nvfp4_matmul(x, NVFP4Tensor(q.packed_NxKh, q.scale_NxKb[:, :1], q.global_scale))
  with pytest.raises(ValueError, match="implementation='cuda'"):
    kernels.nvfp4_matmul(x, q, implementation="cuda")
  with pytest.raises(NotImplementedError, match="jax-triton"):
    kernels.nvfp4_matmul(x, q, implementation="triton")
  with pytest.raises(ValueError, match="float32"):
    kernels.nvfp4_matmul(x.astype(jnp.float32), q, implementation="pallas", interpret=True)
  # float32 activations with no implementation named take the XLA path instead.
  y32 = kernels.nvfp4_matmul(x.astype(jnp.float32), q)
  assert y32.dtype == jnp.float32
  with pytest.raises(ValueError, match="block_k=24"):
    Nvfp4MatmulConfig(block_k=24)
  for bad in (5, -1, 1.5):
    with pytest.raises(ValueError, match=f"prefetch={bad!r} must be a number of K trips"):
      Nvfp4MatmulConfig(engine="gemv", prefetch=bad)
  assert Nvfp4MatmulConfig(prefetch=True).prefetch == 1 and type(Nvfp4MatmulConfig(prefetch=True).prefetch) is int


def test_configs_fit_every_shape():
  """Heuristic and tuned configs yield launchable tiles (block_k divides K, split divides the steps)."""
  shapes = [(3584, 4608), (3584, 3584), (3584, 37888), (18944, 3584), (5120, 7168), (13824, 5120),
            (27648, 5120), (16, 16), (48, 8)]
  for kind in (None, "NVIDIA H200"):
    for direction in ("fwd", "bwd"):
      for rows in (1, 8, 16, 64, 256, 2048, 8192, 5):
        for k, n in shapes:
          cfg = config_lib.get_config(direction, rows, k, n, kind)
          assert k % cfg.block_k == 0
          if direction == "fwd" and (cfg.engine == "gemv" or cfg.ragged_split):  # ragged: no K range empty
            assert config_lib.split_trips(k // cfg.block_k, cfg.split)[1] == cfg.split
          elif direction == "fwd":
            assert (k // cfg.block_k) % cfg.split == 0
  # Few rows split the contraction so that ~2 programs per SM stream weights; decode rows take the gemv engine,
  # whose narrow column blocks alone give every SM work.
  cfg = config_lib.heuristic_config("fwd", 8, 3584, 3584)
  assert cfg.engine == "tensorcore" and cfg.split > 1 and cfg.split * (3584 // cfg.block_n) >= 2 * 132
  cfg = config_lib.heuristic_config("fwd", 1, 3584, 3584)
  assert cfg.engine == "gemv" and cfg.split * (3584 // cfg.block_n) >= 132


def test_few_row_forwards_shorten_k_steps_when_they_admit_no_split():
  # 7B down_proj at 16 rows: 18944 / 256 = 74 steps admit no even split of 4 for the tile kernel's 56 column
  # blocks, so unragged it gets block_k 128 and a split of 4 instead of 256 and 2. The gemv's split may be
  # ragged: at 1 row its 224 column blocks of 16 take 37 steps of 512 in 2 ranges (19 + 18) for 2 programs per
  # SM, or in 5 ranges of 8 (the last 5) for 8 per SM, and keep block_k. A shape whose split is already full keeps
  # block_k.
  gemv = Nvfp4MatmulConfig(block_n=16, block_k=512, engine="gemv")
  down = config_lib.fit(gemv, "fwd", 1, 18944, 3584, auto_split=True)
  assert (down.engine, down.block_k, down.split) == ("gemv", 512, 2)
  wave = config_lib.fit(dataclasses.replace(gemv, programs_per_sm=8), "fwd", 1, 18944, 3584, auto_split=True)
  assert (wave.block_k, wave.split) == (512, 5) and config_lib.split_trips(37, 5) == (8, 5)
  assert config_lib.split_trips(14, 6) == (3, 5)  # 6 ranges of 3 would leave the last one empty
  # Ragged ranges for the tile kernel (``ragged_split``), aiming at 2 programs per SM: 7B down_proj at 8 rows
  # reaches them at block_k 256 in 5 ranges (4 x 15 + 14 steps) where the power-of-two rule needs block_k 128
  # and gets 4 ranges. A ragged plan with fewer programs than the even one is not taken: o_proj's 14 steps keep
  # 7 even ranges (392 programs) rather than 5 ragged ones (280); k_proj's 112 go to 224.
  tile = Nvfp4MatmulConfig(block_m=16, block_n=64, block_k=256, num_stages=4, dequant="asm", ragged_split=True)
  plan = lambda cfg, m, k, n: config_lib.fit(cfg, "fwd", m, k, n, auto_split=True)  # noqa: E731
  tile8 = plan(tile, 8, 18944, 3584)
  even8 = plan(dataclasses.replace(tile, ragged_split=False), 8, 18944, 3584)
  assert (tile8.block_k, tile8.split, even8.block_k, even8.split) == (256, 5, 128, 4) and tile8.ragged_split
  o8, k8 = plan(tile, 8, 3584, 3584), plan(tile, 8, 3584, 512)
  assert (o8.block_k, o8.split, k8.block_k, k8.split) == (256, 7, 128, 28)
  assert plan(dataclasses.replace(tile, ragged_split=False), 8, 3584, 512).split == 14
  down16 = plan(tile, 16, 18944, 3584)
  assert (down16.engine, down16.block_k, down16.split) == ("tensorcore", 256, 5)
  # The H200 file (since x_in_place: 173 registers, 5 programs per SM) aims its ragged 3-16-row tiles at 5
  # programs per SM: down_proj at 8 rows takes 13 ranges of 6 steps (the last 2), 728 programs, where the even
  # plan has 4 (224); o_proj's even 14 ranges of block_k 128 (784 programs) beat any ragged plan, so it keeps them.
  h200_down8 = config_lib.get_config("fwd", 8, 18944, 3584, "NVIDIA H200")
  assert (h200_down8.block_k, h200_down8.split, h200_down8.programs_per_sm) == (256, 13, 5)
  assert h200_down8.x_in_place
  assert config_lib.split_trips(74, 13) == (6, 13)
  h200_o8 = config_lib.get_config("fwd", 8, 3584, 3584, "NVIDIA H200")
  assert (h200_o8.block_k, h200_o8.split) == (128, 14)
  gate = config_lib.fit(gemv, "fwd", 1, 3584, 18944, auto_split=True)
  assert (gate.block_k, gate.split) == (512, 1)  # 1184 column blocks: enough programs unsplit
  k_proj = config_lib.get_config("fwd", 1, 3584, 512, "NVIDIA H200")
  assert k_proj.split * (512 // k_proj.block_n) >= 2 * 132 and 3584 % (k_proj.block_k * k_proj.split) == 0
  bwd = config_lib.get_config("bwd", 16, 18944, 3584, "NVIDIA H200")  # the backward splits N: left alone
  assert bwd.block_k == 128  # the file's bwd:16 entry's (since 3dc71d5), not shortened


def test_one_round_split_is_the_largest_that_fits_one_round():
  # ``one_round``: the automatic split stops at one round of programs_per_sm x 132 SMs = 264 programs instead
  # of passing it. The H200's 65-256-row tile (128 x 128, block_k 64) at 128 rows, 7B: qkv's 36 column tiles
  # and 56 K steps take 4 even ranges (144; 8 would be 288) or 7 ragged ones of 8 steps (252); o's 28 tiles
  # 8 ranges of 7 (224, both ways: 9 ragged ranges would be 8); down's 296 steps 8 even (224) or 9 ragged of 33
  # (252); gate_up's 296 tiles are already past the round: unsplit. Without it: 288, 392, 296, 224 programs.
  def programs(k, n, **fields):
    base = config_lib.get_config("fwd", 128, k, n, "NVIDIA H200")
    cfg = config_lib.fit(dataclasses.replace(base, split=1, **fields), "fwd", 128, k, n, auto_split=True)
    assert cfg.block_k == 64 and config_lib.split_trips(k // 64, cfg.split)[1] == cfg.split  # no empty range
    return -(-n // cfg.block_n) * cfg.split, cfg.split

  shapes = {"qkv": (3584, 4608), "o": (3584, 3584), "down": (18944, 3584), "gate_up": (3584, 37888)}
  assert {name: programs(*kn) for name, kn in shapes.items()} == {
    "qkv": (288, 8), "o": (392, 14), "down": (224, 8), "gate_up": (296, 1)}
  assert {name: programs(*kn, one_round=True) for name, kn in shapes.items()} == {
    "qkv": (144, 4), "o": (224, 8), "down": (224, 8), "gate_up": (296, 1)}
  assert {name: programs(*kn, one_round=True, ragged_split=True) for name, kn in shapes.items()} == {
    "qkv": (252, 7), "o": (224, 8), "down": (252, 9), "gate_up": (296, 1)}
  assert config_lib.split_trips(56, 7) == (8, 7) and config_lib.split_trips(296, 9) == (33, 9)
  # A few-row forward short of the target tries shorter K steps; with one_round those obey the cap too. The H200's
  # 3-16-row tile aims at 5 programs per SM (660): 7B down at 8 rows (56 column tiles, 74 K steps of 256) takes 11
  # ragged ranges of 7 (616 programs); halving block_k would allow 12 ranges of 13 of its 148 steps, 672 programs.
  few = config_lib.get_config("fwd", 8, 18944, 3584, "NVIDIA H200")
  assert (few.programs_per_sm, few.ragged_split, few.split) == (5, True, 13)  # uncapped: 728 programs
  capped = config_lib.fit(dataclasses.replace(few, split=1, block_k=256, one_round=True), "fwd", 8, 18944, 3584,
                          auto_split=True)
  assert (capped.block_k, capped.split, 56 * capped.split) == (256, 11, 616)
  assert config_lib.split_trips(74, 11) == (7, 11) and config_lib.split_trips(148, 12) == (13, 12)
  # The backward's split over N obeys the same cap: 7B o_proj at 128 rows has 2 x 28 tiles of dx (64 x 128) and
  # 56 N steps of 64: split 8 (448 programs) uncapped, 4 (224) capped.
  bwd = Nvfp4MatmulConfig(block_m=64, block_n=64, block_k=128)
  splits = [config_lib.fit(dataclasses.replace(bwd, one_round=cap), "bwd", 128, 3584, 3584, auto_split=True).split
            for cap in (False, True)]
  assert splits == [8, 4]


def test_gemv_split_leaving_a_k_range_empty_is_refused(request):
  from qerl_kernels.nvfp4_gemv import nvfp4_gemv_pallas
  q = _random_q(_rng(request), 96, 32)  # 6 K steps of 16: 4 ranges of 2 would leave the fourth empty
  cfg = Nvfp4MatmulConfig(block_n=16, block_k=16, split=4, engine="gemv")
  with pytest.raises(ValueError, match="leaves one empty; use 3"):
    nvfp4_gemv_pallas(jnp.ones((1, 96), jnp.bfloat16), q.packed_NxKh, q.scale_NxKb, q.global_scale, config=cfg,
                      interpret=True)


def test_tuning_file_override_by_environment(tmp_path, monkeypatch):
  entry = {"direction": "fwd", "max_rows": 2, "config": {"engine": "gemv", "block_n": 32, "block_k": 128,
                                                         "programs_per_sm": 8, "dequant": "asm"}}
  path = tmp_path / "tuning.json"
  path.write_text(json.dumps({"entries": [entry]}))
  monkeypatch.setenv("QERL_KERNEL_TUNING", str(path))
  cfg = config_lib.get_config("fwd", 1, 18944, 3584, "Any GPU")
  # 112 column blocks of 32 need 9.4 ranges for 8 programs on each of 132 SMs: 148 steps in 10 of 15 (the last 13)
  assert (cfg.engine, cfg.block_n, cfg.block_k, cfg.dequant, cfg.split) == ("gemv", 32, 128, "asm", 10)
  assert config_lib.get_config("fwd", 64, 3584, 3584, "Any GPU") == config_lib.heuristic_config("fwd", 64, 3584, 3584)
  monkeypatch.setenv("QERL_KERNEL_TUNING", str(tmp_path / "missing.json"))
  with pytest.raises(FileNotFoundError, match="QERL_KERNEL_TUNING"):
    config_lib.get_config("fwd", 1, 3584, 3584, "Any GPU")
  # A bad file fails when read, naming itself and the entry.
  bad = {"not JSON": "{", 'an integer "max_rows"': {"entries": [{"direction": "fwd", "config": {}}]},
         "unknown config fields ['block_nn']": {"entries": [entry, {"direction": "bwd", "max_rows": 8,
                                                                    "config": {"block_nn": 64}}]},
         "block_k=24": {"entries": [{"direction": "fwd", "max_rows": 8, "config": {"block_k": 24}}]}}
  for i, (message, content) in enumerate(bad.items()):
    path = tmp_path / f"bad{i}.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    monkeypatch.setenv("QERL_KERNEL_TUNING", str(path))
    with pytest.raises(ValueError, match=re.escape(f"tuning file {path}") + ".*" + re.escape(message)):
      config_lib.get_config("fwd", 1, 3584, 3584, "Any GPU")


def test_h100_and_h800_read_the_h200_tuning_other_gpus_the_heuristic(monkeypatch):
  # The H100's jax device kinds ('NVIDIA H100 80GB HBM3' measured; PCIe / NVL / H800 the same chip) have no file of
  # their own: they take the H200's, whose 1-row entry (the gemv engine, asm_fma) differs from the heuristic's.
  monkeypatch.delenv("QERL_KERNEL_TUNING", raising=False)
  h200 = config_lib._device_file("NVIDIA H200")  # pylint: disable=protected-access
  assert os.path.basename(h200) == "nvidia_h200.json" and os.path.exists(h200)
  for kind in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H800"):
    assert config_lib._device_file(kind) == h200, kind  # pylint: disable=protected-access
    for rows, (k, n) in [(1, (3584, 37888)), (8, (18944, 3584)), (64, (3584, 4608))]:
      assert config_lib.get_config("fwd", rows, k, n, kind) == config_lib.get_config("fwd", rows, k, n, "NVIDIA H200")
    assert config_lib.xla_min_rows(kind) == config_lib.xla_min_rows("NVIDIA H200") is not None
  tuned = config_lib.get_config("fwd", 1, 3584, 37888, "NVIDIA H100 80GB HBM3")
  assert tuned.dequant == "asm_fma" and tuned != config_lib.heuristic_config("fwd", 1, 3584, 37888)
  # Names that only share the letters, and other GPUs, keep the heuristic.
  for kind in ("NVIDIA H1000", "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090"):
    assert not os.path.exists(config_lib._device_file(kind)), kind  # pylint: disable=protected-access
    assert config_lib.get_config("fwd", 1, 3584, 37888, kind) == config_lib.heuristic_config("fwd", 1, 3584, 37888)


def test_tuning_entries_restricted_to_shapes_come_first_for_those_shapes_only(tmp_path, monkeypatch):
  general = {"direction": "fwd", "max_rows": 1, "config": {"engine": "gemv", "block_n": 16, "block_k": 256,
                                                           "num_warps": 4, "programs_per_sm": 8}}
  down = {"direction": "fwd", "max_rows": 1, "shapes": [[18944, 3584], [4096, 512]],
          "config": dict(general["config"], block_n=64, num_warps=8)}
  path = tmp_path / "tuning.json"
  path.write_text(json.dumps({"entries": [down, general]}))
  monkeypatch.setenv("QERL_KERNEL_TUNING", str(path))
  got = {kn: config_lib.get_config("fwd", 1, *kn, "Any GPU") for kn in [(18944, 3584), (4096, 512), (3584, 3584)]}
  assert [(c.block_n, c.num_warps) for c in got.values()] == [(64, 8), (64, 8), (16, 4)]
  # Past the entries' rows neither applies; the heuristic does.
  assert config_lib.get_config("fwd", 2, 18944, 3584, "Any GPU") == config_lib.heuristic_config("fwd", 2, 18944, 3584)
  for i, bad in enumerate(([18944, 3584], [[18944]], [[0, 3584]], [], [["18944", 3584]])):
    path = tmp_path / f"bad{i}.json"
    path.write_text(json.dumps({"entries": [dict(down, shapes=bad)]}))
    monkeypatch.setenv("QERL_KERNEL_TUNING", str(path))
    with pytest.raises(ValueError, match=r'entry 0: "shapes" must be a non-empty list of \[K, N\] pairs'):
      config_lib.get_config("fwd", 1, 18944, 3584, "Any GPU")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_asm_decoder_bit_logic_in_numpy(dtype, request):
  """Runs the tile kernels' PTX decoder (``nvfp4_tile._ASM_BY_DTYPE``) in the NumPy interpreter on words of four
  bytes (every byte value in each position), times every finite e4m3 block scale as ``asm_scale`` hands it over,
  each 16-bit multiply rounded to ``dtype`` as the hardware does. Times ``output_multiplier`` it must equal
  E2M1[nibble] * scale exactly: a wrong constant, byte order, or a product that is not exact (overflow, lost
  bits) fails here though CI cannot run asm."""
  from qerl_kernels import nvfp4_tile

  np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
  rng = _rng(request)
  scales = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
  scales = scales[np.isfinite(scales.astype(np.float64))]
  scales = scales[rng.permutation(len(scales))]
  scale_bits = np.asarray(nvfp4_tile.asm_scale(jnp.asarray(scales), jnp.dtype(dtype))).view(np.uint16)
  pair = scale_bits.astype(np.uint64) * np.uint64(0x10001)  # (s, s): the two bytes of a pair share a block
  bytes_Wx4 = np.stack([rng.permutation(256) for _ in range(4)], axis=1).astype(np.uint8)
  words = bytes_Wx4.view("<u4")[:, 0].astype(np.uint64)
  w_WxS, p_WxS = (np.broadcast_to(a, (len(words), len(pair))).ravel() for a in (words[:, None], pair[None, :]))
  multiplier = np.float64(nvfp4_tile.output_multiplier(jnp.float32(1), "asm", jnp.dtype(dtype)))
  want_S = scales.astype(np.float64)
  for half, nib_Wx4 in (("lo", bytes_Wx4 & 15), ("hi", bytes_Wx4 >> 4)):
    regs = _run_ptx(nvfp4_tile._ASM_BY_DTYPE[(dtype, half)], {"$2": w_WxS, "$3": p_WxS, "$4": p_WxS},
                    f16_dtype=np_dtype)
    got = np.stack([(regs[r] >> np.uint64(shift)) & np.uint64(0xFFFF) for r in ("$0", "$1") for shift in (0, 16)],
                   axis=-1).astype(np.uint16).view(np_dtype).astype(np.float64).reshape(len(words), len(pair), 4)
    want = E2M1[nib_Wx4.astype(np.int64)][:, None, :] * want_S[None, :, None]
    np.testing.assert_array_equal(got * multiplier, want, err_msg=half)


def test_asm_output_multiplier_needs_the_decoded_dtype():
  # The "asm" planes carry 2**-FOLD_BF16 in bf16 only: a caller that does not say which dtype it decoded to
  # (the gemv's "asm" path did not, at 30cb867, and would have been 256x small on a GPU) fails at trace time,
  # which the CUDA lowering tests reach for every asm kernel.
  from qerl_kernels import nvfp4_tile
  with pytest.raises(ValueError, match="depends on the dtype"):
    nvfp4_tile.output_multiplier(jnp.float32(2.0), "asm")
  assert nvfp4_tile.output_multiplier(jnp.float32(2.0), "asm", jnp.bfloat16) == 2.0 ** nvfp4_tile.FOLD_BF16 / 2
  assert nvfp4_tile.output_multiplier(jnp.float32(2.0), "asm", jnp.float16) == 0.5


def test_asm_e4m3_decoder_bit_logic_in_numpy(request):
  """Emulates the e4m3-route PTX (``nvfp4_tile._ASM_E4M3``, constants read back from its text) on 32-bit words
  of four random bytes each, every byte value present: the shift / mask steps per plane, then each byte read as
  e4m3 (what cvt.rn.f16x2.e4m3x2 converts; e4m3 -> f16 is exact) against E2M1 / 64 of the byte's nibble, in
  byte order (e0 = bytes 0, 1 -> $0; e1 = bytes 2, 3 -> $1). A wrong shift, mask or byte order fails here."""
  import re
  from qerl_kernels import nvfp4_tile

  rng = _rng(request)
  bytes_Wx4 = np.concatenate([np.arange(256, dtype=np.uint8).reshape(64, 4),
                              rng.integers(0, 256, (64, 4), dtype=np.uint8)])
  words = bytes_Wx4.view("<u4")[:, 0].astype(np.uint64)
  for half, nib in (("lo", bytes_Wx4 & 15), ("hi", bytes_Wx4 >> 4)):
    asm = nvfp4_tile._ASM_E4M3[half]
    op, amount = re.search(r"(shl|shr)\.b32 e, \$2, (\d+);", asm).groups()
    e = (words << int(amount)) if op == "shl" else (words >> int(amount))
    e &= int(re.search(r"and\.b32 e, e, (0x\w+);", asm).group(1), 16)
    sign = re.search(r"(?:shl\.b32 s, \$2, (\d+);|mov\.b32 s, \$2;)", asm)
    s = (words << int(sign.group(1))) if sign.group(1) else words
    s &= int(re.search(r"and\.b32 s, s, (0x\w+);", asm).group(1), 16)
    out_Wx4 = ((e | s) & 0xFFFFFFFF).astype("<u4").view(np.uint8).reshape(-1, 4)
    got = out_Wx4.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    np.testing.assert_array_equal(got * nvfp4_tile.CODE_DIVISOR, E2M1[nib.astype(np.int64)], err_msg=half)
  assert nvfp4_tile.output_multiplier(jnp.float32(2.0), "asm_e4m3") == 32.0  # E2M1 / 64: the jnp route's


def _run_ptx(ptx: str, operands: dict, f16_dtype=np.float16) -> dict:
  """A NumPy interpreter for the PTX subset of the gemv's inline asm (32-bit words as uint64 masked to 32 bits,
  16-bit halves as uint16 bits, float32 as np.float32): runs ``ptx`` on ``operands`` ({"$4": ..., ...}, each an
  array of one value per asm instance) and returns every register. What it cannot read raises."""
  regs = dict(operands)
  mask32 = np.uint64(0xFFFFFFFF)

  def val(tok):
    return np.uint64(int(tok, 0)) if tok[0].isdigit() else regs[tok]

  for stmt in (t.strip().lstrip("{").rstrip("}").strip() for t in ptx.split(";")):
    if not stmt or stmt.startswith(".reg"):
      continue
    op, args = stmt.split(None, 1)
    halves = re.fullmatch(r"\{(\w+), (\w+)\}, (\S+)", args)
    if op == "mov.b32" and halves:  # a word split into its 16-bit halves, the low half first
      word = val(halves.group(3))
      regs[halves.group(1)], regs[halves.group(2)] = word & np.uint64(0xFFFF), word >> np.uint64(16)
      continue
    dst, *src = [a.strip() for a in args.split(",")]
    if op in ("shl.b32", "shr.b32", "and.b32", "or.b32", "mul.lo.u32"):
      a, b = val(src[0]), val(src[1])
      out = {"shl.b32": a << b, "shr.b32": a >> b, "and.b32": a & b, "or.b32": a | b, "mul.lo.u32": a * b}[op]
      regs[dst] = out & mask32
    elif op == "prmt.b32":  # result byte i = byte (selector nibble i) of {src1, src0}; no sign-replicate modes
      a, b, sel = val(src[0]), val(src[1]), int(src[2], 0)
      both = a | (b << np.uint64(32))
      out = np.zeros_like(a)
      for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        assert nib < 8, f"prmt mode {nib:#x} not emulated"
        out |= ((both >> np.uint64(8 * nib)) & np.uint64(0xFF)) << np.uint64(8 * i)
      regs[dst] = out
    elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):  # per 16-bit half: the exact a * b + c rounded once
      ty = ml_dtypes.bfloat16 if op == "fma.rn.bf16x2" else np.float16
      assert ty == f16_dtype or op == "fma.rn.f16x2", f"{op} in a {f16_dtype} decoder"
      a, b, c = (val(t) for t in src)
      out = np.zeros_like(a)
      for shift in (np.uint64(0), np.uint64(16)):
        fa, fb, fc = (((v >> shift) & np.uint64(0xFFFF)).astype(np.uint16).view(ty).astype(np.float64)
                      for v in (a, b, c))
        out |= (fa * fb + fc).astype(ty).view(np.uint16).astype(np.uint64) << shift
      regs[dst] = out
    elif op == "mov.b32":
      regs[dst] = val(src[0])
    elif op == "cvt.rn.f16x2.e4m3x2":  # two e4m3 bytes -> two float16 (the low byte -> the low half), exact
      pair = val(src[0])
      f16 = [((pair >> np.uint64(shift)) & np.uint64(0xFF)).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
             .astype(np.float16).view(np.uint16).astype(np.uint64) for shift in (0, 8)]
      regs[dst] = f16[0] | (f16[1] << np.uint64(16))
    elif op == "cvt.f32.f16":
      regs[dst] = val(src[0]).astype(np.uint16).view(np.float16).astype(np.float32)
    elif op == "mul.rn.f32":
      regs[dst] = (val(src[0]) * val(src[1])).astype(np.float32)
    elif op == "fma.rn.f32":  # the exact product and sum, rounded once
      regs[dst] = (val(src[0]).astype(np.float64) * val(src[1]) + val(src[2])).astype(np.float32)
    else:
      raise NotImplementedError(stmt)
  return regs


def test_asm_fma_products_ptx_in_numpy(request):
  """Runs the gemv's decode-and-multiply PTX (``nvfp4_tile._ASM_E4M3_PRODUCTS``) in a NumPy interpreter on words
  of four random bytes (every byte value present) and random x: output $i must be byte i's
  E2M1[lo] / 64 * x_lo[i] + E2M1[hi] / 64 * x_hi[i] (x_lo in $5..$8, x_hi in $9..$12), the product of the high
  nibble rounded once and added to the low one's in a fused multiply-add. A wrong shift, mask, byte order or
  operand number fails."""
  from qerl_kernels import nvfp4_tile

  rng = _rng(request)
  bytes_Wx4 = np.concatenate([np.arange(256, dtype=np.uint8).reshape(64, 4),
                              rng.integers(0, 256, (64, 4), dtype=np.uint8)])
  x_lo, x_hi = (rng.standard_normal((len(bytes_Wx4), 4)).astype(np.float32) for _ in range(2))
  operands = {"$4": bytes_Wx4.view("<u4")[:, 0].astype(np.uint64)}
  operands.update({f"${5 + i}": x_lo[:, i] for i in range(4)})
  operands.update({f"${9 + i}": x_hi[:, i] for i in range(4)})
  regs = _run_ptx(nvfp4_tile._ASM_E4M3_PRODUCTS, operands)
  lo, hi = (E2M1[nib.astype(np.int64)] / nvfp4_tile.CODE_DIVISOR for nib in (bytes_Wx4 & 15, bytes_Wx4 >> 4))
  for i in range(4):
    hi_product = (hi[:, i] * x_hi[:, i]).astype(np.float32)  # exact E2M1 / 64 times float32, rounded once
    want = (lo[:, i] * x_lo[:, i] + hi_product.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(regs[f"${i}"], want, err_msg=f"byte {i}")
  # The decode steps are the e4m3 decoder's (whose bit logic the test above checks), on operand $4.
  for half, steps in nvfp4_tile._E4M3_PLANE.items():
    for step in steps:
      assert step.format(w="$2") in nvfp4_tile._ASM_E4M3[half] and step.format(w="$4") in (
          nvfp4_tile._ASM_E4M3_PRODUCTS)


def test_quantized_bf16_weight_fwd_and_grad_match_reference(request):
  """End to end on a real quantization (qerl_jax.quant.quantize) of a random bf16 weight."""
  from qerl_jax import quant

  rng = _rng(request)
  k, n = 96, 80
  w = jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.bfloat16)
  q = quant.quantize(w, "nvfp4")
  x = jnp.asarray(rng.standard_normal((2, 7, k)), jnp.bfloat16)
  y = kernels.nvfp4_matmul(x, q, interpret=True)
  w_KxN = np.asarray(quant.dequantize(q, jnp.float32)).astype(np.float64)
  # Same bytes, same formula; theirs divides scale / global_scale in float32 first (one rounding).
  np.testing.assert_allclose(w_KxN, _dequant_np(q), rtol=2.5e-7, atol=0)
  _assert_close(y.reshape(14, n), x.reshape(14, k), w_KxN, jnp.bfloat16)
  # Against the XLA reference (weight rounded to bf16 first) and quantization error vs the bf16 weight.
  ref = np.asarray(kernels.nvfp4_matmul_reference(x, q).astype(jnp.float32))
  bound = np.abs(np.asarray(x, np.float32)) @ np.abs(w_KxN)
  assert np.all(np.abs(np.asarray(y, np.float32) - ref) <= 2**-7 * bound)
  exact = np.asarray(x, np.float32).reshape(14, k) @ np.asarray(w, np.float32)
  rel = np.linalg.norm(np.asarray(y, np.float32).reshape(14, n) - exact) / np.linalg.norm(exact)
  assert rel < 0.15, rel  # NVFP4's own error on Gaussian weights is ~0.1 relative
  g = jax.grad(lambda x: jnp.sum(kernels.nvfp4_matmul(x, q, interpret=True).astype(jnp.float32)))(x)
  _assert_close(g.reshape(14, k), np.ones((14, n)), w_KxN.T, jnp.bfloat16)


def test_halves_decoder_falls_back_where_a_half_tile_would_be_under_16_columns():
  # K = 48: block_k can only be 16, so each half would contract 8 columns, below Triton's dot minimum.
  cfg = config_lib.fit(Nvfp4MatmulConfig(block_k=64, dequant="halves"), "fwd", 4, 48, 32)
  assert (cfg.block_k, cfg.dequant) == (16, "jnp")
  assert config_lib.fit(Nvfp4MatmulConfig(block_k=64, dequant="halves"), "bwd", 4, 96, 32).dequant == "halves"
  with pytest.raises(ValueError, match="dequant='nibbles' must be one of"):
    Nvfp4MatmulConfig(dequant="nibbles")


def _dispatch_configs(kind):
  tile = dict(block_m=16, block_n=16, block_k=64)
  gemv = dict(block_n=32, block_k=32, engine="gemv")
  return {
    # The "halves" decoder both ways; the gemv engine forward (15 rows <= GEMV_MAX_ROWS), the tile kernel back.
    "halves": (Nvfp4MatmulConfig(**tile, dequant="halves"), Nvfp4MatmulConfig(**tile, dequant="halves")),
    "gemv": (Nvfp4MatmulConfig(**gemv), None),
    # "asm" (inline PTX on the GPU) runs its layout with the jnp decode in interpret mode: the plumbing.
    "asm": (Nvfp4MatmulConfig(**tile, dequant="asm"), Nvfp4MatmulConfig(**tile, dequant="asm")),
    "asm-gemv": (Nvfp4MatmulConfig(**gemv, dequant="asm"), None),
    # The e4m3-route PTX is the gemv's; interpret mode runs the jnp route (same values); a tile config gets "asm".
    "asm_e4m3-gemv": (Nvfp4MatmulConfig(**gemv, dequant="asm_e4m3"), Nvfp4MatmulConfig(**tile, dequant="asm_e4m3")),
    "asm_fma-gemv": (Nvfp4MatmulConfig(**gemv, dequant="asm_fma"), Nvfp4MatmulConfig(**tile, dequant="asm_fma")),
    # The gemv loading each K trip's weights one trip ahead (block_k 32: K = 128 takes four trips).
    "gemv-prefetch": (Nvfp4MatmulConfig(**gemv, prefetch=True), None),
    # float16 block sums (``half_products``): a gemv forward; the backward is the tile kernel's.
    "gemv-half": (Nvfp4MatmulConfig(**gemv, dequant="asm_e4m3", half_products=True), None),
  }[kind]


@pytest.mark.parametrize("kind", ["halves", "gemv", "asm", "asm-gemv", "asm_e4m3-gemv", "asm_fma-gemv",
                                  "gemv-prefetch", "gemv-half"])
def test_decoders_and_engines_through_dispatch_and_grad(request, kind):
  fwd_config, bwd_config = _dispatch_configs(kind)
  rng = _rng(request)
  k, n = 128, 40
  q = _random_q(rng, k, n)
  x = jnp.asarray(rng.standard_normal((3, 5, k)), jnp.bfloat16)
  f = lambda x: kernels.nvfp4_matmul(x, q, interpret=True, fwd_config=fwd_config, bwd_config=bwd_config)
  y, vjp = jax.vjp(f, x)
  close = _assert_close_half if fwd_config.half_products else _assert_close
  close(y.reshape(15, n), x.reshape(15, k), _dequant_np(q), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((3, 5, n)), jnp.bfloat16)
  (dx,) = vjp(dy)
  _assert_close(dx.reshape(15, k), dy.reshape(15, n), _dequant_np(q).T, jnp.bfloat16)


def test_gemv_engine_applies_to_few_row_forwards_only():
  gemv = Nvfp4MatmulConfig(block_n=32, block_k=64, engine="gemv")
  assert config_lib.fit(gemv, "fwd", config_lib.GEMV_MAX_ROWS, 128, 64).engine == "gemv"
  assert config_lib.fit(gemv, "fwd", config_lib.GEMV_MAX_ROWS + 1, 128, 64).engine == "tensorcore"
  assert config_lib.fit(gemv, "bwd", 1, 128, 64).engine == "tensorcore"
  # The e4m3-route PTX decoder is the gemv's; where a tile kernel runs instead it decodes with "asm".
  e4m3 = dataclasses.replace(gemv, dequant="asm_e4m3")
  assert config_lib.fit(e4m3, "fwd", 1, 128, 64).dequant == "asm_e4m3"
  assert config_lib.fit(e4m3, "fwd", config_lib.GEMV_MAX_ROWS + 1, 128, 64).dequant == "asm"
  assert config_lib.fit(e4m3, "bwd", 1, 128, 64).dequant == "asm"
  fma = dataclasses.replace(gemv, dequant="asm_fma")
  assert config_lib.fit(fma, "fwd", 1, 128, 64).dequant == "asm_fma"
  assert config_lib.fit(fma, "fwd", config_lib.GEMV_MAX_ROWS + 1, 128, 64).dequant == "asm"
  with pytest.raises(ValueError, match="engine='simt' must be one of"):
    Nvfp4MatmulConfig(engine="simt")


def _stack(qs):
  return NVFP4Tensor(jnp.stack([q.packed_NxKh for q in qs]), jnp.stack([q.scale_NxKb for q in qs]),
                     jnp.stack([q.global_scale for q in qs]))


@pytest.mark.parametrize("engine", ["tensorcore", "gemv"])
def test_stacked_weights_are_read_in_place_by_layer(request, engine):
  # A scan over layers hands the kernels the whole stack and its index: every layer's product (forward and
  # gradient) equals that layer's oracle, and no per-layer slice of the packed bytes is ever taken.
  rng = _rng(request)
  num_layers, m, k, n = 3, 5, 64, 48
  qs = [_random_q(rng, k, n) for _ in range(num_layers)]
  stacked = _stack(qs)
  x = jnp.asarray(rng.standard_normal((num_layers, m, k)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((num_layers, m, n)), jnp.bfloat16)
  cfg = Nvfp4MatmulConfig(block_n=16, block_k=32, engine=engine)

  def all_layers(x):
    def body(_, xs):
      x_l, layer = xs
      return None, kernels.nvfp4_matmul(x_l, stacked, layer=layer, interpret=True, fwd_config=cfg)
    return jax.lax.scan(body, None, (x, jnp.arange(num_layers, dtype=jnp.int32)))[1]

  y, vjp = jax.vjp(all_layers, x)
  (dx,) = vjp(dy)
  for layer, q in enumerate(qs):
    _assert_close(y[layer], x[layer], _dequant_np(q), jnp.bfloat16)
    _assert_close(dx[layer], dy[layer], _dequant_np(q).T, jnp.bfloat16)
  jaxpr = str(jax.make_jaxpr(lambda x: jax.vjp(all_layers, x)[1](dy))(x))
  assert f"u8[{n},{k // 2}]" not in jaxpr, "a layer of the packed weight was sliced out"
  assert f"u8[{num_layers * n},{k // 2}]" in jaxpr  # the kernels get the whole stack


def test_stacked_weights_need_a_layer_and_one_weight_takes_none(request):
  rng = _rng(request)
  q = _random_q(rng, 32, 16)
  x = jnp.ones((2, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match="must be 3-D"):
    kernels.nvfp4_matmul(x, q, layer=0, interpret=True)
  with pytest.raises(ValueError, match="must be 2-D"):
    kernels.nvfp4_matmul(x, _stack([q, q]), interpret=True)
  with pytest.raises(ValueError, match="layer=2 is outside the stack of 2 weights"):
    kernels.nvfp4_matmul(x, _stack([q, q]), layer=2, interpret=True)
  with pytest.raises(ValueError, match="layer must be an integer scalar"):
    kernels.nvfp4_matmul(x, _stack([q, q]), layer=jnp.zeros(2, jnp.int32), interpret=True)
  # An empty batch launches nothing and gives an empty product.
  assert kernels.nvfp4_matmul(jnp.zeros((0, 32), jnp.bfloat16), q, interpret=True).shape == (0, 16)
  # The XLA fallback takes the same stacked call (it slices the layer, as it must to dequantize).
  two = _stack([q, _random_q(rng, 32, 16)])
  np.testing.assert_array_equal(np.asarray(kernels.nvfp4_matmul(x, two, layer=1, implementation="xla")),
                                np.asarray(kernels.nvfp4_matmul(x, jax.tree.map(lambda a: a[1], two),
                                                                implementation="xla")))


def test_xla_path_from_the_devices_measured_crossover(monkeypatch):
  # The H200 file records the crossover; a device kind without one keeps the kernels at every size.
  assert config_lib.xla_min_rows("NVIDIA H200") == 256
  assert config_lib.xla_min_rows("Some Other GPU") is None and config_lib.xla_min_rows(None) is None
  import sys
  mm = sys.modules["qerl_kernels.nvfp4_matmul"]  # the module (the package attribute is the function)
  monkeypatch.setattr(mm, "_gpu_supported", lambda: True)
  monkeypatch.setattr(mm, "_device_kind", lambda: "NVIDIA H200")
  assert mm.default_implementation(jnp.bfloat16, 255) == "pallas"
  assert mm.default_implementation(jnp.bfloat16, 256) == "xla"
  assert mm.default_implementation(jnp.float32, 1) == "xla"
  monkeypatch.setattr(mm, "_device_kind", lambda: "Some Other GPU")
  assert mm.default_implementation(jnp.bfloat16, 1 << 20) == "pallas"



def test_the_h200_files_64_row_forward_splits_only_7b_gate_up_past_its_round(monkeypatch):
  # tail_slots 528 in the shipped file (timed on the bare 7B gate|up shape): of the 7B / 14B / 32B launches at
  # 17-64 rows only 7B gate|up has blocks past a whole round that split in two or more K ranges.
  from qerl_kernels.nvfp4_matmul_fwd import TailPlan, tail_plan
  monkeypatch.delenv("QERL_KERNEL_TUNING", raising=False)
  launches = {"7b": {"qkv": (3584, (3584, 512, 512)), "o": (3584, (3584,)), "gate_up": (3584, (18944, 18944)),
                     "down": (18944, (3584,))},
              "14b": {"qkv": (5120, (5120, 1024, 1024)), "o": (5120, (5120,)), "gate_up": (5120, (13824, 13824)),
                      "down": (13824, (5120,))},
              "32b": {"qkv": (5120, (5120, 1024, 1024)), "o": (5120, (5120,)), "gate_up": (5120, (27648, 27648)),
                      "down": (27648, (5120,))}}
  for rows in (17, 40, 64):
    for model, layers in launches.items():
      for layer, (k, widths) in layers.items():
        cfg = config_lib.get_config("fwd", rows, k, sum(widths), "NVIDIA H200")
        assert cfg.tail_slots == 528, cfg
        plan = tail_plan(config_lib.fit(cfg, "fwd", rows, k, sum(widths)), rows, k // cfg.block_k, widths)
        if (model, layer) == ("7b", "gate_up"):
          assert plan == TailPlan(528, 7, 18944 + 232 * 64), (rows, plan)
        else:
          assert plan is None, (rows, model, layer, plan)
  assert config_lib.get_config("fwd", 16, 3584, 37888, "NVIDIA H200").tail_slots == 0  # the 3-16-row tile: off

_LOWERING_CASES = {  # name -> (direction, config, with the epilogue)
  "fwd-tile-jnp": ("fwd", Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=64), False),
  "fwd-tile-halves": ("fwd", Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=64, dequant="halves"), False),
  "fwd-tile-asm-epilogue": ("fwd", Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=64, split=2, dequant="asm"),
                            True),
  "fwd-tile-asm-ragged": ("fwd", Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=32, split=3, dequant="asm",
                                                   ragged_split=True), False),  # 8 K steps as 3 + 3 + 2
  "fwd-gemv-jnp-epilogue": ("fwd", Nvfp4MatmulConfig(block_n=32, block_k=64, engine="gemv"), True),
  "fwd-gemv-asm-epilogue": ("fwd", Nvfp4MatmulConfig(block_n=32, block_k=64, engine="gemv", dequant="asm"), True),
  "fwd-gemv-asm-prefetch": ("fwd", Nvfp4MatmulConfig(block_n=32, block_k=64, engine="gemv", dequant="asm",
                                                     prefetch=True), False),
  "fwd-gemv-asm-ragged": ("fwd", Nvfp4MatmulConfig(block_n=32, block_k=32, split=3, engine="gemv", dequant="asm",
                                                   prefetch=True), False),  # 8 K steps as 3 + 3 + 2
  "fwd-gemv-asm_e4m3": ("fwd", Nvfp4MatmulConfig(block_n=32, block_k=64, engine="gemv", dequant="asm_e4m3",
                                                 num_warps=8), True),
  "fwd-gemv-asm_e4m3-xa": ("fwd", Nvfp4MatmulConfig(block_n=32, block_k=32, split=3, engine="gemv",
                                                    dequant="asm_e4m3"), "xa"),
  "fwd-gemv-asm_fma": ("fwd", Nvfp4MatmulConfig(block_n=32, block_k=64, engine="gemv", dequant="asm_fma"), True),
  "fwd-gemv-asm_fma-xa": ("fwd", Nvfp4MatmulConfig(block_n=32, block_k=32, split=3, engine="gemv", dequant="asm_fma",
                                                   prefetch=1), "xa"),
  "fwd-gemv-asm_fma-xa-in-place": ("fwd", Nvfp4MatmulConfig(block_n=32, block_k=32, split=3, engine="gemv",
                                                            dequant="asm_fma", prefetch=1, x_in_place=True), "xa"),
  "fwd-gemv-asm_e4m3-half": ("fwd", Nvfp4MatmulConfig(block_n=32, block_k=64, engine="gemv", dequant="asm_e4m3",
                                                      half_products=True, prefetch=1), False),
  "fwd-gemv-asm_e4m3-half-xa": ("fwd", Nvfp4MatmulConfig(block_n=32, block_k=32, split=3, engine="gemv",
                                                         dequant="asm_e4m3", half_products=True), "xa"),
  "fwd-gemv-asm-prefetch2": ("fwd", Nvfp4MatmulConfig(block_n=32, block_k=32, split=3, engine="gemv",
                                                      dequant="asm", prefetch=2), False),
  # x @ A in extra programs of the gemv launch (a ragged split of the weight, the adapter in float32).
  "fwd-gemv-asm-xa": ("fwd", Nvfp4MatmulConfig(block_n=32, block_k=32, split=3, engine="gemv", dequant="asm",
                                               prefetch=True), "xa"),
  # 3 column blocks on 2 slots: block 2 in 2 K ranges, the first adding the epilogue.
  "fwd-tile-asm-tail-epilogue": ("fwd", Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=64, dequant="asm",
                                                          tail_slots=2), True),
  "bwd-jnp": ("bwd", Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=64), False),
  "bwd-asm": ("bwd", Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=64, split=2, dequant="asm"), False),
}


@pytest.mark.parametrize("case", sorted(_LOWERING_CASES))
def test_kernels_lower_to_triton_for_cuda(case):
  """Lowers each kernel variant for a CUDA GPU on this CPU machine: the Pallas -> Triton step that interpret
  mode skips. (A masked load's fill value without a mask passed interpret mode and failed only on the GPU.)"""
  from qerl_kernels.nvfp4_matmul_bwd import nvfp4_matmul_bwd_pallas
  from qerl_kernels.nvfp4_matmul_fwd import nvfp4_matmul_fwd_pallas

  direction, cfg, epilogue = _LOWERING_CASES[case]
  k, n, m = 256, 96, 2
  q = _random_q(np.random.default_rng(0), k, n)
  weights = (q.packed_NxKh, q.scale_NxKb, q.global_scale)
  if direction == "bwd":
    f = lambda dy, *w: nvfp4_matmul_bwd_pallas(dy, *w, config=cfg)
    args = (jnp.ones((m, n), jnp.bfloat16), *weights)
  elif epilogue == "xa":
    f = lambda x, a, *w: nvfp4_gemv.nvfp4_gemv_xa_pallas(x, *w, a, config=cfg)
    args = (jnp.ones((m, k), jnp.bfloat16), jnp.ones((k, 16), jnp.float32), *weights)
  elif epilogue:
    f = lambda x, xa, b, bias, *w: nvfp4_matmul_fwd_pallas(x, *w, config=cfg, xa_MxR=xa, b_RxN=b, bias_N=bias,
                                                           lora_scale=2.0)
    args = (jnp.ones((m, k), jnp.bfloat16), jnp.ones((m, 4), jnp.bfloat16), jnp.ones((4, n), jnp.bfloat16),
            jnp.ones((n,), jnp.bfloat16), *weights)
  else:
    f = lambda x, *w: nvfp4_matmul_fwd_pallas(x, *w, config=cfg)
    args = (jnp.ones((m, k), jnp.bfloat16), *weights)
  text, module = lower_for_cuda(f, *args)
  assert text.count("__gpu$xla.gpu.triton") == 1, text[:2000]
  # The Triton module must verify (generic form: see triton_lowering); an inline-asm result typed ui32 (Triton's
  # integers are signless) once failed so.
  assert "module @" in module and '"builtin.module"' not in module, module[-3000:]
  if cfg.dequant == "asm_fma":  # the Triton module carries the PTX that forms the products
    asm_ops = re.findall(r'tt\.elementwise_inline_asm "([^"]*)"', module)
    assert any("fma.rn.f32" in op and "cvt.rn.f16x2.e4m3x2" in op for op in asm_ops), module[-3000:]
