"""The Mosaic GPU NVFP4 kernel (`qerl_kernels/nvfp4_mgpu.py`): Mosaic GPU's interpreter against NumPy, the CUDA lowering
of the GPU path (where Mosaic GPU checks its register layouts), and bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qerl_kernels as kernels
from qerl_kernels import config as config_lib, nvfp4_mgpu
from qerl_kernels.config import Nvfp4MatmulConfig
from qerl_kernels.nvfp4_mgpu import MgpuConfig
from qerl_jax.model.testing import fresh_seed
from tests.test_kernels import _dequant_np, _random_q

# (rows, K, N, config): rows padded up to the tile (5 of 8, 20 of 32), one pipeline step and several, two column
# programs and three, three stages in flight, tile_k 512, K split in 2 and 3 ranges (float32 partials).
CASES = [
  (5, 512, 128, MgpuConfig(tile_m=8)),
  (64, 256, 64, MgpuConfig(tile_m=64)),
  (20, 768, 192, MgpuConfig(tile_m=32, stages=3)),
  (16, 1024, 64, MgpuConfig(tile_m=16, tile_k=512)),
  (3, 1536, 64, MgpuConfig(tile_m=8, split=3, stages=2)),
  (9, 1024, 128, MgpuConfig(tile_m=16, split=2)),
  # 128 output columns per program (two accumulators against one x tile), two such programs, a split of 2.
  (12, 512, 256, MgpuConfig(tile_m=16, tile_n=128, split=2)),
  (130, 256, 64, MgpuConfig(tile_m=128)),  # two row tiles of 128, the second holding 2 rows
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_interpreted_kernel_matches_numpy(case):
  rows, k, n, cfg = CASES[case]
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  q = _random_q(rng, k, n)  # every nibble value, e4m3 scales across their range (subnormals included)
  x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
  y = nvfp4_mgpu.nvfp4_matmul_fwd_mgpu(x, q.packed_NxKh, q.scale_NxKb, q.global_scale, config=cfg, interpret=True)
  assert y.shape == (rows, n) and y.dtype == jnp.bfloat16
  want = np.asarray(x, np.float64) @ _dequant_np(q)
  got = np.asarray(y.astype(jnp.float32), np.float64)
  # The operand E2M1 * scale * 2**-20 is exact in bf16 and the products add in float32: what is left is the
  # output's one rounding to bf16 (2**-8 relative) and float32 sums (1e-6 of sum |x| |w|).
  bound = 2.0**-8 * np.abs(want) + 1e-6 * (np.abs(np.asarray(x, np.float64)) @ np.abs(_dequant_np(q)))
  assert (np.abs(got - want) <= bound).all(), f"{seed=}: max err / bound {(np.abs(got - want) / bound).max()}"


@pytest.mark.parametrize("tile_m,split,decode,tile_n", [(8, 1, "bits", 64), (64, 2, "bits", 64),
                                                        (16, 1, "arith", 64), (64, 1, "bits", 128)])
def test_gpu_path_lowers_for_cuda(tile_m, split, decode, tile_n):
  """The GPU path (register layouts, the bit decode, wgmma with A in registers) as Mosaic GPU lowers it for CUDA;
  a layout it cannot relayout or an operand wgmma cannot take fails here, on the CPU."""
  k, n = 512, 128
  q = _random_q(np.random.default_rng(0), k, n)
  x = jnp.ones((tile_m, k), jnp.bfloat16)
  cfg = MgpuConfig(tile_m=tile_m, split=split, decode=decode, tile_n=tile_n)
  f = lambda *a: nvfp4_mgpu.nvfp4_matmul_fwd_mgpu(*a, config=cfg)  # noqa: E731
  text = jax.jit(f).trace(x, q.packed_NxKh, q.scale_NxKb, q.global_scale).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 1, text[:2000]


def test_bad_inputs_are_named():
  q = _random_q(np.random.default_rng(0), 512, 128)
  w = (q.packed_NxKh, q.scale_NxKb, q.global_scale)
  x = jnp.ones((4, 512), jnp.bfloat16)
  with pytest.raises(ValueError, match="2-D bfloat16"):
    nvfp4_mgpu.nvfp4_matmul_fwd_mgpu(x.astype(jnp.float16), *w)
  with pytest.raises(ValueError, match="K/2 = 128"):
    nvfp4_mgpu.nvfp4_matmul_fwd_mgpu(jnp.ones((4, 256), jnp.bfloat16), *w)
  with pytest.raises(ValueError, match="multiple of tile_k=1024"):
    nvfp4_mgpu.nvfp4_matmul_fwd_mgpu(x, *w, config=MgpuConfig(tile_k=1024))
  q96 = _random_q(np.random.default_rng(0), 512, 96)
  with pytest.raises(ValueError, match="N=96"):
    nvfp4_mgpu.nvfp4_matmul_fwd_mgpu(x, q96.packed_NxKh, q96.scale_NxKb, q96.global_scale)
  with pytest.raises(ValueError, match="float8_e4m3fn"):
    nvfp4_mgpu.nvfp4_matmul_fwd_mgpu(x, q.packed_NxKh, q.scale_NxKb.astype(jnp.float32), q.global_scale)
  with pytest.raises(ValueError, match="tile_n=128"):
    nvfp4_mgpu.nvfp4_matmul_fwd_mgpu(jnp.ones((4, 512), jnp.bfloat16), q96.packed_NxKh, q96.scale_NxKb,
                                     q96.global_scale, config=MgpuConfig(tile_n=128))
  with pytest.raises(ValueError, match="tile_n=96"):
    MgpuConfig(tile_n=96)
  with pytest.raises(ValueError, match="tile_m=24"):
    MgpuConfig(tile_m=24)
  with pytest.raises(ValueError, match="tile_k=128"):
    MgpuConfig(tile_k=128)
  with pytest.raises(ValueError, match="decode='lut'"):
    MgpuConfig(decode="lut")
  with pytest.raises(ValueError, match="not 3 equal ranges"):
    nvfp4_mgpu.nvfp4_matmul_fwd_mgpu(x, *w, config=MgpuConfig(split=3))


def test_auto_split_fills_the_gpu_with_whole_ranges():
  cfg = MgpuConfig(tile_m=8)
  # 7B q/o at 8 rows: 56 column programs and 14 steps of K; 132 SMs x 2 want 5, so the split is 7 (392 programs).
  assert nvfp4_mgpu.auto_split(8, 3584, 3584, cfg) == 7
  assert nvfp4_mgpu.auto_split(8, 3584, 18944, cfg) == 1  # gate: 296 programs already
  assert nvfp4_mgpu.auto_split(8, 3584, 512, cfg) == 14  # k/v: 8 programs, at most one step each
  # down at 64 rows: 56 programs and 74 steps (2 x 37). 37 ranges would write 34 MB of partials for a 38 MB
  # weight; a quarter of it allows 2.
  assert nvfp4_mgpu.auto_split(64, 18944, 3584, MgpuConfig(tile_m=64)) == 2
  assert nvfp4_mgpu.auto_split(8, 18944, 3584, cfg) == 37  # at 8 rows the partials are 4 MB


MOSAIC = Nvfp4MatmulConfig(engine="mosaic", block_m=64, block_k=256, num_stages=2)


def test_dispatch_runs_it_with_the_epilogue_and_differentiates_through_the_tile_backward():
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  k, n, r = 512, 128, 8
  q = _random_q(rng, k, n)
  x = jnp.asarray(rng.standard_normal((2, 3, k)), jnp.bfloat16)  # 6 rows: tile_m 8
  xa = jnp.asarray(rng.standard_normal((2, 3, r)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((r, n)) * 0.1, jnp.bfloat16)
  bias = jnp.asarray(rng.standard_normal(n), jnp.bfloat16)
  f = lambda x, xa, b, bias: kernels.nvfp4_matmul(  # noqa: E731
      x, q, bias=bias, lora=(xa, b, 0.5), interpret=True, fwd_config=MOSAIC)
  y = f(x, xa, b, bias)
  f64 = lambda t: np.asarray(jnp.asarray(t, jnp.float32), np.float64)  # noqa: E731
  w = _dequant_np(q)
  want = f64(x) @ w + 0.5 * f64(xa) @ f64(b) + f64(bias)
  # One rounding of the float32 sum to bf16 (2**-8), float32 sums (1e-6 of sum |x| |w|).
  bound = 2.0**-8 * np.abs(want) + 1e-6 * (np.abs(f64(x)) @ np.abs(w)) + 1e-6
  assert y.shape == (2, 3, n) and (np.abs(f64(y) - want) <= bound).all(), f"{seed=}"
  # The backward is the tile kernel's (dx = dy W^T), the epilogue's terms differentiated in XLA.
  dy = jnp.asarray(rng.standard_normal((2, 3, n)), jnp.bfloat16)
  grads = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * dy.astype(jnp.float32)), argnums=(0, 1))(
      x, xa, b, bias)
  np.testing.assert_allclose(f64(grads[0]), f64(dy) @ w.T, rtol=2e-2, atol=2e-2 * np.abs(f64(dy) @ w.T).max(),
                             err_msg=f"{seed=}")
  np.testing.assert_allclose(f64(grads[1]), 0.5 * f64(dy) @ f64(b).T, rtol=2e-2, atol=1e-2, err_msg=f"{seed=}")


def test_fit_and_the_forward_fall_back_where_the_kernel_does_not_apply():
  assert config_lib.fit(MOSAIC, "fwd", 8, 512, 128).engine == "mosaic"
  assert config_lib.fit(MOSAIC, "fwd", 8, 512, 96).engine == "tensorcore"  # N not a multiple of 64
  assert config_lib.fit(MOSAIC, "fwd", 8, 384, 128).engine == "tensorcore"  # K not a multiple of 256
  assert config_lib.fit(MOSAIC, "bwd", 8, 512, 128).engine == "tensorcore"
  assert config_lib.fit(MOSAIC, "fwd", 1, 512, 128).engine == "mosaic"
  assert nvfp4_mgpu.from_matmul_config(MOSAIC, 5, 512, 128).tile_m == 8
  assert nvfp4_mgpu.from_matmul_config(MOSAIC, 200, 512, 128).tile_m == 64  # block_m caps the row tile
  wide = dataclasses.replace(MOSAIC, block_n=128)
  assert nvfp4_mgpu.from_matmul_config(wide, 8, 512, 256).tile_n == 128
  assert nvfp4_mgpu.from_matmul_config(wide, 8, 512, 192).tile_n == 64  # N not a multiple of 128
  # A stacked weight (the scan's in-place layer) takes the tile kernel, float16 x too: the same values.
  rng = np.random.default_rng(fresh_seed())
  qs = [_random_q(rng, 256, 64) for _ in range(2)]
  stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *qs)
  x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
  y = kernels.nvfp4_matmul(x, stacked, layer=1, interpret=True, fwd_config=MOSAIC)
  np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(x, np.float64) @ _dequant_np(qs[1]), rtol=2e-2,
                             atol=2e-2 * float(np.abs(np.asarray(x, np.float64) @ _dequant_np(qs[1])).max()))
  y16 = kernels.nvfp4_matmul(x.astype(jnp.float16), qs[0], interpret=True, fwd_config=MOSAIC)
  assert y16.dtype == jnp.float16
