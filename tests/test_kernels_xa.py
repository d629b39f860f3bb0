"""x @ A in the gemv's launch (`qerl_kernels.nvfp4_matmul_xa`): interpret mode against NumPy, gradients, fallbacks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qerl_kernels as kernels
from qerl_kernels import nvfp4_gemv
from qerl_kernels.config import Nvfp4MatmulConfig
from qerl_jax.model.testing import fresh_seed
from tests.test_kernels import _dequant_np, _random_q
from tests.test_rollout_layers import _eqns

# (rows, K, N, rank, A dtype, config): one and two rows, a K split that is ragged (5 steps in 3 ranges) and one
# that is even, N not a multiple of block_n, more x @ A programs than steps of A (K = 64: 4 blocks), rank 64, and
# four x @ A programs in two columns of a split of 2 (K = 1536 at rank 16 in float32: 96 KB of A).
CASES = [
  (1, 256, 48, 16, jnp.float32, Nvfp4MatmulConfig(block_n=16, block_k=32, split=1, engine="gemv")),
  (2, 160, 40, 8, jnp.bfloat16, Nvfp4MatmulConfig(block_n=16, block_k=32, split=3, engine="gemv", prefetch=1)),
  (1, 512, 64, 32, jnp.float32, Nvfp4MatmulConfig(block_n=32, block_k=64, split=2, engine="gemv")),
  (2, 64, 24, 4, jnp.float32, Nvfp4MatmulConfig(block_n=16, block_k=16, split=4, engine="gemv")),
  (1, 256, 32, 64, jnp.bfloat16, Nvfp4MatmulConfig(block_n=16, block_k=64, split=1, engine="gemv")),  # 4 per trip
  (1, 1536, 32, 16, jnp.float32, Nvfp4MatmulConfig(block_n=16, block_k=64, split=2, engine="gemv")),
  # float16 block sums (each weight program scales its rows of x itself): the x @ A programs read float32 x.
  (2, 160, 40, 8, jnp.float32, Nvfp4MatmulConfig(block_n=16, block_k=32, split=3, engine="gemv", dequant="asm_e4m3",
                                                 half_products=True)),
  # x read where it lies, both products (the x @ A programs take the same stride-2 planes).
  (2, 160, 40, 8, jnp.float32, Nvfp4MatmulConfig(block_n=16, block_k=32, split=3, engine="gemv", x_in_place=True)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_shared_launch_gives_both_products(case):
  rows, k, n, rank, a_dtype, cfg = CASES[case]
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  q = _random_q(rng, k, n)
  x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
  a = jnp.asarray(rng.standard_normal((k, rank)) / np.sqrt(k), a_dtype)
  # Poisoned outputs: a y tile or an x @ A partial the kernel leaves unwritten is NaN.
  y, xa = nvfp4_gemv.nvfp4_gemv_xa_pallas(x, q.packed_NxKh, q.scale_NxKb, q.global_scale, a, config=cfg,
                                          interpret=True, poison=True)
  x64 = np.asarray(x, np.float64)
  y_want = x64 @ _dequant_np(q)
  assert y.dtype == jnp.bfloat16 and xa.dtype == jnp.float32 and xa.shape == (rows, rank)
  np.testing.assert_allclose(np.asarray(y, np.float64), y_want, rtol=1e-2, atol=1e-2 * np.abs(y_want).max(),
                             err_msg=f"{seed=}")
  _assert_xa_close(xa, x, a, f"{seed=}")


def _assert_xa_close(got, x, a, msg):
  """got ~ x @ A (float64) within float32 accumulation error: 1e-5 of sum |x| |A| per element."""
  x64, a64 = np.asarray(x, np.float64).reshape(-1, a.shape[0]), np.asarray(a, np.float64)
  err = np.abs(np.asarray(got, np.float64).reshape(x64.shape[0], -1) - x64 @ a64)
  assert (err <= 1e-5 * (np.abs(x64) @ np.abs(a64))).all(), f"{msg}: max err {err.max()}"


def test_stacked_weight_layer_and_gradients_match_the_separate_products():
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  k, n, rank = 128, 48, 16
  qs = [_random_q(rng, k, n) for _ in range(3)]
  stack = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *qs)
  x = jnp.asarray(rng.standard_normal((1, 1, k)), jnp.bfloat16)
  a = jnp.asarray(rng.standard_normal((k, rank)) / np.sqrt(k), jnp.float32)
  cot_y = jnp.asarray(rng.standard_normal((1, 1, n)), jnp.float32)
  cot_xa = jnp.asarray(rng.standard_normal((1, 1, rank)), jnp.float32)

  def loss(x, a, shared):
    if shared:
      y, xa = kernels.nvfp4_matmul_xa(x, stack, a, layer=jnp.int32(2), interpret=True)
    else:
      y = kernels.nvfp4_matmul_reference(x, qs[2])
      xa = jnp.einsum("...k,kr->...r", x.astype(a.dtype), a, preferred_element_type=jnp.float32)
    return jnp.sum(y.astype(jnp.float32) * cot_y) + jnp.sum(xa * cot_xa)

  (gx, ga), (wx, wa) = (jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, a, s) for s in (True, False))
  np.testing.assert_allclose(np.asarray(gx, np.float32), np.asarray(wx, np.float32),
                             atol=0.02 * float(jnp.abs(wx).max()), err_msg=f"{seed=}")
  np.testing.assert_allclose(np.asarray(ga), np.asarray(wa), rtol=1e-5, atol=1e-6, err_msg=f"{seed=}")
  # d(xa)/dA is x itself: the A gradient is the outer product x^T cot_xa.
  np.testing.assert_allclose(np.asarray(ga), np.asarray(x, np.float32)[0].T @ np.asarray(cot_xa)[0], rtol=1e-6)


def test_without_a_gemv_launch_the_products_run_separately():
  # More rows than the gemv takes, or a rank that is not a power of two: the same two products, computed
  # the usual way (no shared launch in the program).
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  q = _random_q(rng, 64, 32)
  for rows, rank in ((3, 8), (1, 6)):
    x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.bfloat16)
    a = jnp.asarray(rng.standard_normal((64, rank)), jnp.float32)
    y, xa = kernels.nvfp4_matmul_xa(x, q, a, interpret=True)
    text = str(jax.make_jaxpr(lambda x, a: kernels.nvfp4_matmul_xa(x, q, a, interpret=True))(x, a))
    assert "nvfp4_gemv_xa" not in text
    _assert_xa_close(xa, x, a, f"{seed=}")
    want = np.asarray(kernels.nvfp4_matmul(x, q, interpret=True), np.float32)
    np.testing.assert_array_equal(np.asarray(y, np.float32), want)


def test_bad_adapter_shapes_and_configs_are_named():
  q = _random_q(np.random.default_rng(0), 64, 32)
  x = jnp.ones((1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"A.shape=\(32, 4\) must be \(K=64, r\)"):
    kernels.nvfp4_matmul_xa(x, q, jnp.ones((32, 4)), interpret=True)
  tile = Nvfp4MatmulConfig(block_m=16, block_n=16, block_k=32)
  with pytest.raises(ValueError, match="rides in the gemv engine only"):
    nvfp4_gemv.nvfp4_gemv_xa_pallas(x, q.packed_NxKh, q.scale_NxKb, q.global_scale, jnp.ones((64, 4)), config=tile,
                                    interpret=True)
  with pytest.raises(ValueError, match="power-of-two LoRA rank"):
    nvfp4_gemv.xa_plan(64, 12, 4, 1)


def test_xa_plan_covers_k_with_programs_of_about_32_kb():
  # 7B at rank 16 in float32: q/o/gate/up (K = 3584, 229 KB) in 7 programs, down (K = 18944, 1.2 MB) in 37,
  # rounded up to whole grid columns of the K split; every step of A lands in exactly one program.
  for k, split, columns, programs in ((3584, 1, 7, 7), (3584, 5, 2, 10), (18944, 5, 8, 40), (3584, 28, 1, 28)):
    plan = nvfp4_gemv.xa_plan(k, 16, 4, split)
    assert (plan.columns, plan.programs) == (columns, programs), (k, split, plan)
    covered = [t for p in range(plan.programs) for t in range(p * plan.per, min(plan.steps, (p + 1) * plan.per))]
    assert covered == list(range(plan.steps)) and plan.steps * plan.block_b == k // 16
  # Larger ranks take fewer blocks of A per trip (at most 2048 elements per plane, to keep the registers).
  assert [nvfp4_gemv.xa_plan(3584, r, 4, 1).block_b for r in (16, 32, 64, 128, 256)] == [8, 8, 4, 2, 1]


# (rows, fused_lora, gemv_lora_xa, adapter dtype) -> (the one kernel launched, its operand count): 5 for x, layer
# and the weight's three arrays, 6 with A (x @ A in the gemv's launch), 8 with xa, B and the bias (the fused
# epilogue). Float32 adapters (the trainer's) stay out of the epilogue: they would make its dot a float32 one,
# 1.4 ms slower per 7B batch-64 decode step on an H200, so XLA adds them.
ROUTES = {
  (1, True, True, "bf16"): ("nvfp4_gemv_xa", 6), (2, True, True, "bf16"): ("nvfp4_gemv_xa", 6),  # gemv_xa first
  (8, True, True, "bf16"): ("nvfp4_matmul_fwd", 8),  # past the gemv's rows: the tile kernel's fused epilogue
  (1, True, False, "bf16"): ("nvfp4_gemv", 8), (8, True, False, "bf16"): ("nvfp4_matmul_fwd", 8),
  (1, False, True, "bf16"): ("nvfp4_gemv_xa", 6), (8, False, True, "bf16"): ("nvfp4_matmul_fwd", 5),
  (1, False, False, "bf16"): ("nvfp4_gemv", 5), (8, False, False, "bf16"): ("nvfp4_matmul_fwd", 5),
  (1, True, False, "f32"): ("nvfp4_gemv", 5), (8, True, False, "f32"): ("nvfp4_matmul_fwd", 5),
  (8, True, True, "f32"): ("nvfp4_matmul_fwd", 5),
}


@pytest.mark.parametrize("rows,fused,gemv_xa,lora_dtype", sorted(ROUTES))
def test_model_projection_routes_bias_and_adapter_by_the_two_flags(monkeypatch, rows, fused, gemv_xa, lora_dtype):
  # ModelConfig.gemv_lora_xa takes precedence over fused_lora where the gemv computes x @ A (1-2 rows on an
  # H200); from 3 rows the tile kernel's fused epilogue adds bias and adapter. Traced with the H200 dispatch
  # forced on this CPU (nothing runs).
  import sys
  from qerl_jax.model.linear import linear
  mm = sys.modules["qerl_kernels.nvfp4_matmul"]
  monkeypatch.setattr(mm, "_gpu_supported", lambda: True)
  monkeypatch.setattr(mm, "_device_kind", lambda: "NVIDIA H200")
  q = _random_q(np.random.default_rng(fresh_seed()), 256, 64)
  dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[lora_dtype]
  p = {"w": q, "b": jnp.zeros((64,), jnp.bfloat16), "lora_a": jnp.zeros((256, 16), dtype),
       "lora_b": jnp.zeros((16, 64), dtype)}
  jaxpr = jax.make_jaxpr(lambda x: linear(x, p, 2.0, fused, gemv_xa=gemv_xa))(jnp.zeros((rows, 256), jnp.bfloat16))
  calls = [(str(e.params["name"]), len(e.invars)) for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]
  assert calls == [ROUTES[rows, fused, gemv_xa, lora_dtype]]



def test_partials_are_the_shared_launchs_outputs_before_their_sums():
  # nvfp4_matmul_xa_partials: [S, M, N] and [P, M, r] whose sums are nvfp4_matmul_xa's y (rounded to x's dtype)
  # and x @ A; with no K split the one "partial" is y itself. Where the shared launch does not apply it refuses.
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  k, n, rank = 160, 40, 8
  q = _random_q(rng, k, n)
  x = jnp.asarray(rng.standard_normal((2, 1, k)), jnp.bfloat16)
  a = jnp.asarray(rng.standard_normal((k, rank)) / np.sqrt(k), jnp.float32)
  for split in (3, 1):
    cfg = Nvfp4MatmulConfig(block_n=16, block_k=32, split=split, engine="gemv")
    parts, xa_parts = kernels.nvfp4_matmul_xa_partials(x, q, a, interpret=True, fwd_config=cfg)
    y, xa = kernels.nvfp4_matmul_xa(x, q, a, interpret=True, fwd_config=cfg)
    assert parts.shape == (split, 2, n) and parts.dtype == (jnp.float32 if split > 1 else jnp.bfloat16)
    assert xa_parts.ndim == 3 and xa_parts.shape[1:] == (2, rank) and xa_parts.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(parts.astype(jnp.float32).sum(0).astype(jnp.bfloat16), np.float32),
                                  np.asarray(y.reshape(2, n), np.float32), err_msg=f"{seed=}")
    np.testing.assert_allclose(np.asarray(xa_parts.sum(0)), np.asarray(xa.reshape(2, rank)), rtol=1e-6,
                               atol=1e-6, err_msg=f"{seed=}")
    _assert_xa_close(xa_parts.sum(0), x, a, f"{seed=}")
  tile = Nvfp4MatmulConfig(block_m=16, block_n=16, block_k=32)  # a tile kernel: no x @ A in its launch
  with pytest.raises(ValueError, match="do not share a gemv launch"):
    kernels.nvfp4_matmul_xa_partials(x, q, a, interpret=True, fwd_config=tile)
  assert not kernels.partials_launch_applies(x, q, rank, interpret=True, fwd_config=tile)
  # With tiles (ModelConfig.decode_partials_tiles) the tile kernel's split-K partials, and XLA's x @ A as one.
  for split in (5, 1):
    cfg = dataclasses.replace(tile, split=split)
    assert kernels.partials_launch_applies(x, q, rank, interpret=True, fwd_config=cfg, tiles=True)
    parts, xa_parts = kernels.nvfp4_matmul_xa_partials(x, q, a, interpret=True, fwd_config=cfg, tiles=True)
    y = kernels.nvfp4_matmul(x, q, interpret=True, fwd_config=cfg)
    assert parts.shape == (split, 2, n) and parts.dtype == (jnp.float32 if split > 1 else jnp.bfloat16)
    assert xa_parts.shape == (1, 2, rank) and xa_parts.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(parts.astype(jnp.float32).sum(0).astype(jnp.bfloat16), np.float32),
                                  np.asarray(y.reshape(2, n), np.float32), err_msg=f"{seed=}")
    _assert_xa_close(xa_parts[0], x, a, f"{seed=}")


@pytest.mark.parametrize("in_place,noise,group,pipeline",
                         [(True, True, False, False), (False, False, False, False), (True, False, True, True)])
def test_a_pending_norm_read_by_the_gemv_equals_the_norm_launch_then_the_gemv(in_place, noise, group, pipeline):
  # decode_residual_norm.PendingNorm into nvfp4_matmul_xa_partials: the gemv normalizes x as it loads it (for the
  # weight's products and x @ A) and its partials equal those of the norm's own launch followed by the gemv, bit
  # for bit (the same float32 steps, rounded to bf16 at the same place). Both x layouts, AQN noise, a group
  # launch (with the K loops marked for Triton's pipeliner, as the model's pipelined config would), a K split and
  # two rows.
  from qerl_kernels.decode_residual_norm import residual_add, residual_norm_reference
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  m, k, rank = 2, 192, 8
  x = jnp.asarray(rng.standard_normal((m, k)) * 3, jnp.bfloat16)
  parts = jnp.asarray(rng.standard_normal((3, m, k)), jnp.float32)
  norm = jnp.asarray(1 + 0.2 * rng.standard_normal(k), jnp.bfloat16)
  noise_D = jnp.asarray(0.05 * rng.standard_normal(k), jnp.float32) if noise else None
  pending = residual_add(x, parts, norm, eps=1e-6, noise_D=noise_D, block_d=64, interpret=True)
  h = pending.materialize()
  assert pending.shape == h.shape == (m, k) and pending.dtype == jnp.bfloat16
  _, want_h = residual_norm_reference(x, parts, norm, eps=1e-6, noise_D=noise_D)
  assert np.mean(np.asarray(h, np.float32) != np.asarray(want_h, np.float32)) < 0.02, f"{seed=}"
  q = kernels.Nvfp4Group((_random_q(rng, k, 24), _random_q(rng, k, 40))) if group else _random_q(rng, k, 40)
  a = jnp.asarray(rng.standard_normal((k, rank)) / np.sqrt(k), jnp.float32)
  cfg = Nvfp4MatmulConfig(block_n=16, block_k=32, split=3, engine="gemv", x_in_place=in_place, pipeline=pipeline)
  got_parts, got_xa = kernels.nvfp4_matmul_xa_partials(pending, q, a, interpret=True, fwd_config=cfg)
  want_parts, want_xa = kernels.nvfp4_matmul_xa_partials(h, q, a, interpret=True, fwd_config=cfg)
  np.testing.assert_array_equal(np.asarray(got_parts), np.asarray(want_parts), err_msg=f"{seed=}")
  np.testing.assert_array_equal(np.asarray(got_xa), np.asarray(want_xa), err_msg=f"{seed=}")
  # ... and not those of the un-normalized x (a kernel that ignored the norm fails).
  raw_parts, _ = kernels.nvfp4_matmul_xa_partials(pending.x_MxD, q, a, interpret=True, fwd_config=cfg)
  assert not np.allclose(np.asarray(raw_parts), np.asarray(want_parts), rtol=0.1), f"{seed=}"
  # A tile config takes the pending norm too, through the norm's own launch first.
  tile = Nvfp4MatmulConfig(block_m=16, block_n=16, block_k=32, split=1)
  got_tile, _ = kernels.nvfp4_matmul_xa_partials(pending, q, a, interpret=True, fwd_config=tile, tiles=True)
  want_tile, _ = kernels.nvfp4_matmul_xa_partials(h, q, a, interpret=True, fwd_config=tile, tiles=True)
  np.testing.assert_array_equal(np.asarray(got_tile, np.float32), np.asarray(want_tile, np.float32))


@pytest.mark.parametrize("in_place", [True, False])
def test_the_gemv_reading_a_pending_norm_lowers_to_one_triton_kernel(in_place):
  # The Pallas -> Triton step interpret mode skips, for a CUDA GPU: the norm's scale and noise planes (strided
  # loads in place, or the planes layout) and the per-row 1 / rms before the K loop, in the H200's gemv config.
  from qerl_kernels.decode_residual_norm import PendingNorm
  from tests.triton_lowering import lower_for_cuda
  m, k = 2, 256
  q = _random_q(np.random.default_rng(fresh_seed()), k, 96)
  cfg = Nvfp4MatmulConfig(block_n=16, block_k=128, split=2, engine="gemv", dequant="asm_fma", x_in_place=in_place)

  def f(x, ss, scale, noise, a, *w):
    pending = PendingNorm(x, ss, scale, noise, eps=1e-6, shape=(m, k), block_d=128, num_warps=2, interpret=False)
    return nvfp4_gemv.nvfp4_gemv_xa_partials(pending, *w, a, config=cfg)

  args = (jnp.ones((m, k), jnp.bfloat16), jnp.ones((m, 2), jnp.float32), jnp.ones((k,), jnp.bfloat16),
          jnp.ones((k,), jnp.float32), jnp.ones((k, 16), jnp.float32), q.packed_NxKh, q.scale_NxKb, q.global_scale)
  text, module = lower_for_cuda(f, *args)
  assert text.count("__gpu$xla.gpu.triton") == 1 and "nvfp4_gemv_xa" in text, text[:2000]
  assert "module @" in module and '"builtin.module"' not in module, module[-3000:]
  assert module.count("rsqrt") >= 2, module[-3000:]  # the row's 1 / rms (libdevice's rsqrtf)
