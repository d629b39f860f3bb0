"""One launch over a group of NVFP4 weights (`qerl_kernels.Nvfp4Group`: q|k|v, gate|up), each read in place.

Against the NumPy oracle of each member: the members have their own global scales and widths that are not
multiples of the column block (so a member's last block is masked at its own width), and sit in stacks read
at one layer. Interpret mode starts every output as NaN, so a column no program writes fails.
"""

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qerl_kernels as kernels
from qerl_kernels.config import Nvfp4MatmulConfig
from tests.test_kernels import _assert_close, _dequant_np, _random_q, _rng, _stack
from tests.triton_lowering import lower_for_cuda

LAYERS, LAYER = 3, 1

CASES = {  # name -> (rows, K, member widths, config)
  "gemv-1-row-split": (1, 96, (48, 24, 40), Nvfp4MatmulConfig(block_n=16, block_k=32, split=3, engine="gemv")),
  "gemv-2-rows": (2, 64, (32, 8), Nvfp4MatmulConfig(block_n=16, block_k=32, engine="gemv")),
  "tile-6-rows-halves": (6, 128, (48, 16, 40), Nvfp4MatmulConfig(block_m=16, block_n=32, block_k=32, split=2,
                                                                 dequant="halves")),
  "tile-37-rows": (37, 64, (64, 24), Nvfp4MatmulConfig(block_m=16, block_n=16, block_k=32, group_m=2)),
  # A tail split across two members: 6 column blocks on 4 slots, so the second member's masked last block and the
  # third member's block run in 2 K ranges each (3 + 2 steps), their partials added after the launch.
  "tile-20-rows-tail": (20, 160, (48, 24, 8), Nvfp4MatmulConfig(block_m=32, block_n=16, block_k=32, dequant="halves",
                                                                x_in_place=True, tail_slots=4)),
}


def _group(rng, k, widths):
  """(the group of stacks, each member's stack as a list of layers)."""
  layers = [[_random_q(rng, k, n) for _ in range(LAYERS)] for n in widths]
  return kernels.Nvfp4Group(tuple(_stack(qs) for qs in layers)), layers


def _columns(y, widths):
  return np.split(np.asarray(y.astype(jnp.float32)), np.cumsum(widths)[:-1], axis=-1)


def _assert_dx_close(dx, dy, layers, widths):
  """dx ~ sum of dy_i @ W_i^T: each member's product rounded to bf16 (as the separate projections' gradients
  are before the model adds them), the float32 sum rounded once."""
  f64 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)  # noqa: E731
  parts = [d @ _dequant_np(qs[LAYER]).T for d, qs in zip(np.split(f64(dy), np.cumsum(widths)[:-1], -1), layers)]
  bound = sum(np.abs(d) @ np.abs(_dequant_np(qs[LAYER])).T
              for d, qs in zip(np.split(f64(dy), np.cumsum(widths)[:-1], -1), layers))
  want, eps = sum(parts), 2.0 ** -8
  tol = eps * (sum(np.abs(p) for p in parts) + np.abs(want)) + 1e-5 * bound + 1e-30
  err = np.abs(f64(dx) - want)
  assert not np.isnan(f64(dx)).any() and (err <= tol).all(), f"{(err > tol).sum()} wrong; max err {err.max()}"


def test_the_tail_case_splits_a_tail_across_two_members():
  from qerl_kernels.nvfp4_matmul_fwd import TailPlan, tail_plan
  m, k, widths, cfg = CASES["tile-20-rows-tail"]
  assert tail_plan(cfg, m, k // cfg.block_k, widths) == TailPlan(4, 2, 48 + 16)


@pytest.mark.parametrize("case", sorted(CASES))
def test_group_forward_and_gradient_match_each_members_oracle(request, case):
  rng = _rng(request)
  m, k, widths, cfg = CASES[case]
  group, layers = _group(rng, k, widths)
  assert len({float(qs[LAYER].global_scale[0]) for qs in layers}) == len(widths)  # one scale per member
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((m, sum(widths))), jnp.bfloat16)
  f = lambda x: kernels.nvfp4_matmul(x, group, layer=jnp.int32(LAYER), interpret=True, fwd_config=cfg)
  y, vjp = jax.vjp(f, x)
  assert y.shape == (m, sum(widths))
  for y_i, qs in zip(_columns(y, widths), layers):
    _assert_close(y_i, x, _dequant_np(qs[LAYER]), jnp.bfloat16)
  (dx,) = vjp(dy)
  _assert_dx_close(dx, dy, layers, widths)
  # The XLA path (CPU dispatch) takes the same group: each member's columns are its own XLA product.
  ref = kernels.nvfp4_matmul(x, group, layer=LAYER, implementation="xla")
  for y_i, qs in zip(_columns(ref, widths), layers):
    np.testing.assert_array_equal(y_i, np.asarray(kernels.nvfp4_matmul_reference(x, qs[LAYER]), np.float32))


@pytest.mark.parametrize("case", ["gemv-1-row-split", "tile-6-rows-halves", "tile-20-rows-tail"])
def test_group_epilogue_adds_the_bias_and_adapter_at_each_members_columns(request, case):
  # The epilogue's operands span the group's columns (biases side by side, B block-diagonal in the model);
  # here a dense B: each member's block of columns must meet its own columns of B and the bias.
  rng = _rng(request)
  m, k, widths, cfg = CASES[case]
  group, layers = _group(rng, k, widths)
  n, r = sum(widths), 8
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  xa = jnp.asarray(rng.standard_normal((m, r)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((r, n)), jnp.bfloat16)
  bias = jnp.asarray(rng.standard_normal((n,)), jnp.bfloat16)
  y = kernels.nvfp4_matmul(x, group, layer=LAYER, bias=bias, lora=(xa, b, 0.5), interpret=True, fwd_config=cfg)
  w_KxN = np.concatenate([_dequant_np(qs[LAYER]) for qs in layers], axis=1)
  f32 = lambda a: np.asarray(a.astype(jnp.float32), np.float64)  # noqa: E731
  want = f32(x) @ w_KxN + f32(bias) + 0.5 * f32(xa) @ f32(b)
  bound = np.abs(f32(x)) @ np.abs(w_KxN) + np.abs(f32(bias)) + 0.5 * np.abs(f32(xa)) @ np.abs(f32(b))
  got = f32(y)
  assert not np.isnan(got).any()
  np.testing.assert_array_less(np.abs(got - want), 2 ** -8 * np.abs(want) + 1e-5 * bound + 1e-30)


def test_group_gemv_computes_x_at_a_in_the_same_launch(request):
  rng = _rng(request)
  m, k, widths, cfg = CASES["gemv-1-row-split"]
  group, layers = _group(rng, k, widths)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  a = jnp.asarray(rng.standard_normal((k, 16)), jnp.float32)
  assert kernels.xa_shares_launch(x, group, 16, layer=LAYER, interpret=True, fwd_config=cfg)
  f = lambda x, a: kernels.nvfp4_matmul_xa(x, group, a, layer=LAYER, interpret=True, fwd_config=cfg)
  (y, xa), vjp = jax.vjp(f, x, a)
  for y_i, qs in zip(_columns(y, widths), layers):
    _assert_close(y_i, x, _dequant_np(qs[LAYER]), jnp.bfloat16)
  np.testing.assert_allclose(np.asarray(xa), np.asarray(x.astype(jnp.float32)) @ np.asarray(a), rtol=1e-5,
                             atol=1e-4)
  dy = jnp.asarray(rng.standard_normal(y.shape), jnp.bfloat16)
  dx, _ = vjp((dy, jnp.zeros_like(xa)))
  _assert_dx_close(dx, dy, layers, widths)


def test_bad_groups_raise_clear_errors(request):
  rng = _rng(request)
  x = jnp.ones((1, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match="needs at least one member"):
    kernels.nvfp4_matmul(x, kernels.Nvfp4Group(()), interpret=True)
  with pytest.raises(ValueError, match="must end in K=64"):
    kernels.nvfp4_matmul(x, kernels.Nvfp4Group((_random_q(rng, 32, 16), _random_q(rng, 64, 16))), interpret=True)
  one, stack = _random_q(rng, 32, 16), _stack([_random_q(rng, 32, 16)] * 2)
  with pytest.raises(ValueError, match="must be 2-D"):
    kernels.nvfp4_matmul(x, kernels.Nvfp4Group((one, stack)), interpret=True)


@pytest.mark.parametrize("case", ["gemv-1-row-split", "tile-6-rows-halves", "tile-20-rows-tail"])
def test_group_kernels_lower_to_triton_for_cuda(case):
  """The group's branches (one per member, on the program's column block) through the Pallas -> Triton step
  that interpret mode skips, with the PTX decoder the GPU runs."""
  m, k, widths, cfg = CASES[case]
  cfg = dataclasses.replace(cfg, dequant="asm")
  group, _ = _group(np.random.default_rng(0), k, widths)
  operands = importlib.import_module("qerl_kernels.nvfp4_matmul").kernel_operands
  f = lambda x, g: kernels.nvfp4_matmul_fwd_pallas(x, *operands(g), config=cfg, layer=jnp.int32(LAYER))
  text, module = lower_for_cuda(f, jnp.ones((m, k), jnp.bfloat16), group)
  assert text.count("__gpu$xla.gpu.triton") == 1
  assert "module @" in module and '"builtin.module"' not in module, module[-3000:]
  assert module.count("scf.if") >= len(widths)  # a branch per member
