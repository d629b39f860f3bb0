"""The forward kernels' epilogue (bias + scale * xa @ B, qerl_kernels/nvfp4_epilogue.py) in interpret mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qerl_kernels as kernels
from qerl_kernels import config as config_lib
from qerl_kernels.config import Nvfp4MatmulConfig
from qerl_kernels.nvfp4_matmul_fwd import nvfp4_matmul_fwd_pallas
from tests.test_kernels import _dequant_np, _random_q, _rng

F32, BF16 = jnp.float32, jnp.bfloat16
CASES = [
  # (M, K, N, config, rank, bias, xa dtype). The tile kernels add xa @ B as one dot over the rank padded to a
  # power of two >= 16 (masked loads), the gemv as outer products.
  (20, 64, 48, Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=32, split=2), 4, True, F32),  # ragged, split-K
  (37, 128, 24, Nvfp4MatmulConfig(block_m=32, block_n=16, block_k=64, dequant="halves"), 16, False, F32),
  (20, 64, 48, Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=32, split=2), 24, True, BF16),  # rank 24 -> 32
  (33, 128, 64, Nvfp4MatmulConfig(block_m=32, block_n=32, block_k=64, dequant="asm"), 16, True, BF16),
  (1, 64, 40, Nvfp4MatmulConfig(block_n=16, block_k=32, engine="gemv"), 8, True, F32),  # gemv, ragged N
  (5, 192, 56, Nvfp4MatmulConfig(block_n=32, block_k=64, split=3, engine="gemv"), 0, True, F32),  # bias only
]


def _want(x, w_KxN, xa, b, bias, scale):
  y = np.asarray(x, np.float64) @ w_KxN
  if xa is not None:
    y = y + scale * (np.asarray(xa, np.float64) @ np.asarray(b.astype(jnp.float32), np.float64))
  if bias is not None:
    y = y + np.asarray(bias.astype(jnp.float32), np.float64)
  return y


def _assert_close(got, want, bound):
  got = np.asarray(got.astype(jnp.float32), np.float64)
  tol = 2 ** -8 * np.abs(want) + 1e-5 * bound + 1e-30  # one bf16 rounding of the output
  assert not np.isnan(got).any(), "NaN in output: a tile was not written"
  bad = np.abs(got - want) > tol
  assert not bad.any(), f"{bad.sum()} of {bad.size} wrong; max err {np.abs(got - want).max()}"


@pytest.mark.parametrize("m,k,n,cfg,rank,with_bias,xa_dtype", CASES)
def test_epilogue_adds_bias_and_adapter(request, m, k, n, cfg, rank, with_bias, xa_dtype):
  rng = _rng(request)
  q = _random_q(rng, k, n)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  xa = jnp.asarray(rng.standard_normal((m, rank)), xa_dtype) if rank else None
  b = jnp.asarray(rng.standard_normal((rank, n)), jnp.bfloat16) if rank else None
  bias = jnp.asarray(rng.standard_normal((n,)), jnp.bfloat16) if with_bias else None
  cfg = config_lib.fit(cfg, "fwd", m, k, n)
  y = nvfp4_matmul_fwd_pallas(x, q.packed_NxKh, q.scale_NxKb, q.global_scale, config=cfg, interpret=True,
                              poison=True, xa_MxR=xa, b_RxN=b, bias_N=bias, lora_scale=0.75)
  w = _dequant_np(q)
  want = _want(x, w, xa, b, bias, 0.75)
  bound = np.abs(np.asarray(x, np.float64)) @ np.abs(w)
  _assert_close(y, want, bound)
  # The epilogue changed the result (the test would notice a kernel that skipped it).
  plain = _want(x, w, None, None, None, 0.0)
  assert np.abs(want - plain).max() > 0.1


@pytest.mark.parametrize("engine", ["tensorcore", "gemv"])
def test_epilogue_gradients_match_the_xla_path(request, engine):
  # d/dx (the backward kernel), d/dxa, d/dB and d/dbias (XLA, in the custom VJP) against autodiff of the
  # XLA path's float32 formula.
  rng = _rng(request)
  k, n, r = 64, 40, 4
  q = _random_q(rng, k, n)
  x = jnp.asarray(rng.standard_normal((2, 3, k)), jnp.bfloat16)
  xa = jnp.asarray(rng.standard_normal((2, 3, r)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((r, n)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal((n,)), jnp.float32)
  fwd = Nvfp4MatmulConfig(block_n=16, block_k=32, engine=engine)
  dy = jnp.asarray(rng.standard_normal((2, 3, n)), jnp.float32)

  def loss(impl, x, xa, b, bias):
    y = kernels.nvfp4_matmul(x, q, bias=bias, lora=(xa, b, 0.5), implementation=impl, interpret=impl == "pallas",
                             fwd_config=fwd if impl == "pallas" else None)
    return jnp.sum(y.astype(jnp.float32) * dy)

  got = jax.grad(lambda *a: loss("pallas", *a), argnums=(0, 1, 2, 3))(x, xa, b, bias)
  want = jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2, 3))(x, xa, b, bias)
  for name, g, w in zip(("x", "xa", "B", "bias"), got, want):
    g, w = np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32))
    np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * np.abs(w).max(), err_msg=name)
    assert np.abs(w).max() > 0


def test_epilogue_shapes_are_checked():
  q = _random_q(np.random.default_rng(0), 32, 16)
  x = jnp.ones((3, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"bias.shape=\(15,\) must be \(16,\)"):
    kernels.nvfp4_matmul(x, q, bias=jnp.ones((15,)))
  with pytest.raises(ValueError, match="lora xa.shape=.* must be x's leading dims"):
    kernels.nvfp4_matmul(x, q, lora=(jnp.ones((2, 4)), jnp.ones((4, 16)), 1.0))
  with pytest.raises(ValueError, match=r"lora B.shape=\(4, 15\) must be \(r=4, N=16\)"):
    kernels.nvfp4_matmul(x, q, lora=(jnp.ones((3, 4)), jnp.ones((4, 15)), 1.0))
