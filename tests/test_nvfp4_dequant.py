"""The XLA path's Pallas dequantization (`qerl_kernels.nvfp4_dequant`): the same bits as the library's, its
lowering for a CUDA GPU, and when the dispatch takes it (only where a device's tuning file opts in)."""

import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax.quant import nvfp4
from qerl_jax.quant.types import NVFP4Tensor
import qerl_kernels as kernels
from qerl_kernels import config as config_lib, nvfp4_dequant
from tests import test_kernels
from tests.triton_lowering import lower_for_cuda


def _random_q(rng, k, n) -> NVFP4Tensor:
  """test_kernels' random weight (every byte value, block scales across e4m3's range, subnormals included) with its
  global scale drawn over 2**-4 .. 2**12, so the steps reach bf16's subnormals too."""
  q = test_kernels._random_q(rng, k, n)
  return NVFP4Tensor(q.packed_NxKh, q.scale_NxKb, jnp.asarray(np.float32(np.exp2(rng.uniform(-4, 12)))))


@pytest.mark.parametrize("k,n,block_n,block_b", [(512, 64, 32, 32), (1024, 96, 32, 16), (256, 128, 64, 16)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_kernel_equals_the_library_dequantization_bit_for_bit(k, n, block_n, block_b, dtype):
  q = _random_q(np.random.default_rng(), k, n)
  got = nvfp4_dequant.dequantize_NxK(q, dtype, block_n=block_n, block_b=block_b, interpret=True, poison=True)
  want = nvfp4.dequantize_NxK(q, dtype)
  assert got.shape == (n, k) and got.dtype == jnp.dtype(dtype)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
  # The library's words form (XLA's program over the same uint32 words) too.
  words = nvfp4.dequantize_NxK(q, dtype, words=True)
  np.testing.assert_array_equal(np.asarray(words).view(np.uint16), np.asarray(want).view(np.uint16))
  # And against an independent NumPy formula: E2M1[code] * (scale / gs) in float32, low nibble first, rounded once.
  e2m1 = test_kernels.E2M1.astype(np.float32)
  packed = np.asarray(q.packed_NxKh)
  codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, k)
  step = np.asarray(q.scale_NxKb).astype(np.float32) / np.asarray(q.global_scale, np.float32)
  ref = (e2m1[codes] * np.repeat(step, 16, axis=1)).astype(jnp.dtype(dtype))
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), ref.view(np.uint16))


def test_poisoned_words_show_a_tile_the_kernel_skips(monkeypatch):
  # The poison path must be able to fail: with the kernel writing nothing, every value reads NaN.
  q = _random_q(np.random.default_rng(), 256, 64)
  monkeypatch.setattr(nvfp4_dequant, "dequant_kernel", lambda packed_ref, step_ref, words_ref, *, dtype: None)
  nvfp4_dequant.dequantize_NxK.clear_cache()  # the jitted function looks the kernel up when it traces
  try:
    got = nvfp4_dequant.dequantize_NxK(q, jnp.bfloat16, block_n=32, block_b=16, interpret=True, poison=True)
  finally:
    nvfp4_dequant.dequantize_NxK.clear_cache()  # no later call may reuse the kernel that writes nothing
  assert np.isnan(np.asarray(got, np.float32)).all()


def test_kernel_refuses_what_it_does_not_tile():
  q = _random_q(np.random.default_rng(), 512, 48)  # N = 48 is not a multiple of 32 rows per program
  assert not nvfp4_dequant.supports(q, jnp.bfloat16, 32, 32)
  assert not nvfp4_dequant.supports(_random_q(np.random.default_rng(), 512, 64), jnp.float32, 32, 32)
  with pytest.raises(ValueError, match="N a multiple of block_n=32"):
    nvfp4_dequant.dequantize_NxK(q, jnp.bfloat16, block_n=32, block_b=32, interpret=True)


def test_kernel_lowers_to_triton_for_cuda():
  q = _random_q(np.random.default_rng(0), 512, 64)
  text, module = lower_for_cuda(lambda q: nvfp4_dequant.dequantize_NxK(q, block_n=32, block_b=32, num_warps=4), q)
  assert text.count("__gpu$xla.gpu.triton") == 1, text[:2000]
  assert "module @" in module and '"builtin.module"' not in module, module[-3000:]


def test_the_xla_path_takes_the_kernel_only_where_the_tuning_opts_in(tmp_path, monkeypatch):
  mm = sys.modules["qerl_kernels.nvfp4_matmul"]  # the module (the package attribute is the function)
  monkeypatch.setattr(mm, "_gpu_supported", lambda: True)
  monkeypatch.setattr(mm, "_device_kind", lambda: "NVIDIA H200")
  tiles, ragged = _random_q(np.random.default_rng(), 512, 64), _random_q(np.random.default_rng(), 512, 48)
  monkeypatch.delenv("QERL_KERNEL_TUNING", raising=False)
  assert not mm.pallas_dequant_applies(tiles, jnp.bfloat16)  # the shipped file does not opt in (untimed)
  path = tmp_path / "tuning.json"
  path.write_text(json.dumps({"xla_dequant": "pallas"}))
  monkeypatch.setenv("QERL_KERNEL_TUNING", str(path))
  assert mm.pallas_dequant_applies(tiles, jnp.bfloat16) and mm.pallas_dequant_applies(tiles, jnp.float16)
  assert not mm.pallas_dequant_applies(ragged, jnp.bfloat16)  # XLA's dequantization for shapes it does not tile
  assert not mm.pallas_dequant_applies(tiles, jnp.float32)
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  with jax.set_mesh(mesh):  # under a mesh XLA's dequantization keeps the sharded program's own partitioning
    assert not mm.pallas_dequant_applies(tiles, jnp.bfloat16)
  monkeypatch.setattr(mm, "_gpu_supported", lambda: False)
  assert not mm.pallas_dequant_applies(tiles, jnp.bfloat16)
  # A bad value fails when the file is read, naming the key.
  path.write_text(json.dumps({"xla_dequant": "triton"}))
  with pytest.raises(ValueError, match='"xla_dequant" must be one of'):
    config_lib.xla_dequant("NVIDIA H200")


def test_the_xla_path_forms_words_where_the_tuning_says_so(tmp_path, monkeypatch):
  # "words": XLA's program over one uint32 word per packed byte, the shipped bits; on the CPU (no GPU) and by
  # default the integer decode the library ships.
  mm = sys.modules["qerl_kernels.nvfp4_matmul"]
  rng = np.random.default_rng()
  q = _random_q(rng, 512, 48)  # a width the Pallas kernel does not tile: "words" does not need it to
  x = jnp.asarray(rng.standard_normal((4, 512)), jnp.bfloat16)
  path = tmp_path / "tuning.json"
  path.write_text(json.dumps({"xla_dequant": "words"}))
  monkeypatch.setenv("QERL_KERNEL_TUNING", str(path))
  monkeypatch.setattr(mm, "_device_kind", lambda: "NVIDIA H200")

  def program(dtype):
    return str(jax.make_jaxpr(lambda q: mm.dequantize_layer(q, dtype))(q))

  for gpu in (False, True):
    monkeypatch.setattr(mm, "_gpu_supported", lambda gpu=gpu: gpu)
    assert kernels.xla_dequant() == ("words" if gpu else "xla")  # what the benchmarks record
    for dtype in (jnp.bfloat16, jnp.float16):
      # the words reach 16 bits by a bitcast (the integer decode bitcasts to float32 only)
      assert (f"bitcast_convert_type[new_dtype={jnp.dtype(dtype).name}]" in program(dtype)) == gpu
      np.testing.assert_array_equal(np.asarray(mm.dequantize_layer(q, dtype)).view(np.uint16),
                                    np.asarray(nvfp4.dequantize_NxK(q, dtype)).view(np.uint16))
    y = mm.xla_path_matmul(x, q)
    np.testing.assert_array_equal(np.asarray(y, np.float32),
                                  np.asarray(jnp.einsum("mk,nk->mn", x, nvfp4.dequantize_NxK(q, jnp.bfloat16)),
                                             np.float32))


def test_the_xla_paths_words_dequantization_waits_for_its_input(tmp_path, monkeypatch):
  # The weight's bytes reach the dequantization only through a barrier with x: otherwise XLA's GPU scheduler may
  # dequantize every layer of an unrolled program up front ("words" on an H200: the 7B rollout's peak 14.5 -> 22 GB).
  mm = sys.modules["qerl_kernels.nvfp4_matmul"]
  path = tmp_path / "tuning.json"
  path.write_text(json.dumps({"xla_dequant": "words"}))
  monkeypatch.setenv("QERL_KERNEL_TUNING", str(path))
  monkeypatch.setattr(mm, "_device_kind", lambda: "NVIDIA H200")
  monkeypatch.setattr(mm, "_gpu_supported", lambda: True)
  rng = np.random.default_rng()
  q = _random_q(rng, 512, 48)
  x = jnp.asarray(rng.standard_normal((4, 512)), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(lambda x, q: mm.xla_path_matmul(x, q))(x, q).jaxpr
  barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
  assert len(barriers) == 1, jaxpr
  q_vars = set(jaxpr.invars[1:])
  assert set(barriers[0].invars) == set(jaxpr.invars)  # x and every leaf of q
  for e in jaxpr.eqns:
    if e is not barriers[0]:
      assert not q_vars & set(e.invars), f"{e.primitive} reads the weight before the barrier"
  np.testing.assert_array_equal(np.asarray(mm.xla_path_matmul(x, q), np.float32),
                                np.asarray(jnp.einsum("mk,nk->mn", x, nvfp4.dequantize_NxK(q, jnp.bfloat16)),
                                           np.float32))


@pytest.mark.parametrize("mode", ["xla", "words"])
def test_bench_kernels_times_the_xla_paths_backward_in_every_dequantization_mode(tmp_path, monkeypatch, mode):
  # The benchmark's backward is the model's: jax.vjp of the XLA path. "words" failed under jax.linear_transpose
  # (the barrier makes the weight depend on x) on an H100 at fdbd31f, the first bwd timing after the barrier.
  from experiments import bench_kernels
  mm = sys.modules["qerl_kernels.nvfp4_matmul"]
  path = tmp_path / "tuning.json"
  path.write_text(json.dumps({"xla_dequant": mode}))
  monkeypatch.setenv("QERL_KERNEL_TUNING", str(path))
  monkeypatch.setattr(mm, "_device_kind", lambda: "NVIDIA H200")
  monkeypatch.setattr(mm, "_gpu_supported", lambda: True)
  rng = np.random.default_rng()
  rows, k, n = 6, 512, 48
  q = _random_q(rng, k, n)
  dy = jnp.asarray(rng.standard_normal((rows, n)), jnp.bfloat16)
  dx = jax.jit(bench_kernels.xla_path_op("bwd", rows, k))(dy, q)
  assert kernels.xla_dequant() == mode
  w_NxK = np.asarray(nvfp4.dequantize_NxK(q, jnp.float32))
  expect = np.asarray(dy, np.float32) @ w_NxK  # dx = dy @ W^T with W [K, N] stored as [N, K]
  np.testing.assert_allclose(np.asarray(dx, np.float32), expect, rtol=2e-2, atol=2e-2 * np.abs(expect).max())


def test_a_tuning_file_changed_in_the_same_process_retraces_the_xla_path(tmp_path, monkeypatch):
  # The mode is read while tracing nvfp4_matmul's inner jit: the file's version keys that jit's cache, else a
  # notebook trying "words" after "xla" (or a test after another) would run the program of the first file.
  mm = sys.modules["qerl_kernels.nvfp4_matmul"]
  monkeypatch.setattr(mm, "_device_kind", lambda: "NVIDIA H200")
  monkeypatch.setattr(mm, "_gpu_supported", lambda: True)
  rng = np.random.default_rng()
  q = _random_q(rng, 512, 48)
  x = jnp.asarray(rng.standard_normal((3, 512)), jnp.bfloat16)
  path = tmp_path / "tuning.json"
  monkeypatch.setenv("QERL_KERNEL_TUNING", str(path))
  for i, mode in enumerate(("xla", "words", "xla")):
    path.write_text(json.dumps({"xla_dequant": mode}))
    os.utime(path, ns=(0, (i + 1) * 10**9))  # a rewrite the tuning reader sees as new (mtime alone may not move)
    program = str(jax.make_jaxpr(lambda x, q: kernels.nvfp4_matmul(x, q, implementation="xla"))(x, q))
    # the barrier with x (the integer decode's division has a barrier of its own, over the scales)
    with_x = [line for line in program.splitlines() if "optimization_barrier" in line and "bf16[3,512]" in line]
    assert bool(with_x) == (mode == "words"), (i, mode)


@pytest.mark.parametrize("group", [False, True])
def test_the_xla_paths_KxN_backward_gives_the_same_gradient_from_a_transposed_copy(tmp_path, monkeypatch, group):
  # "xla_backward_layout": "KxN": dx = dy @ W[K, N]^T over a physical transposed copy (the bf16 dot's backward
  # order) instead of JAX's transpose dy @ W[N, K]. Same values; the copy must survive XLA's transpose folding.
  mm = sys.modules["qerl_kernels.nvfp4_matmul"]
  path = tmp_path / "tuning.json"
  monkeypatch.setenv("QERL_KERNEL_TUNING", str(path))
  monkeypatch.setattr(mm, "_device_kind", lambda: "NVIDIA H200")
  monkeypatch.setattr(mm, "_gpu_supported", lambda: True)
  rng = np.random.default_rng()
  members = (_random_q(rng, 512, 48), _random_q(rng, 512, 16))
  q = kernels.Nvfp4Group(members) if group else members[0]
  n = sum(m.shape[1] for m in members) if group else 48
  x = jnp.asarray(rng.standard_normal((2, 3, 512)), jnp.bfloat16)
  dy = jnp.asarray(rng.standard_normal((2, 3, n)), jnp.bfloat16)
  # The weight as the path dequantizes it (bf16: the random global scale leaves some steps inexact in 16 bits).
  w_KxN = np.concatenate([np.asarray(nvfp4.dequantize_NxK(m, jnp.bfloat16), np.float64).T
                          for m in (q.members if group else (q,))], axis=1)
  # each dx element: a float32 sum of exact bf16 products, rounded once to bf16
  want = np.asarray(dy, np.float64) @ w_KxN.T
  sum_error = 2 ** -20 * (np.abs(np.asarray(dy, np.float64)) @ np.abs(w_KxN).T)

  def backward(**dot_kwargs):
    f = lambda x: mm.xla_path_matmul(x, q, **dot_kwargs)  # noqa: E731
    dt = jnp.float32 if dot_kwargs else x.dtype
    return jax.jit(lambda x, dy: jax.vjp(f, x)[1](dy.astype(dt))[0])(x, dy)

  for layout in ("NxK", "KxN"):
    path.write_text(json.dumps({"xla_dequant": "words", "xla_backward_layout": layout}))
    assert kernels.xla_backward_layout() == layout
    for dot_kwargs in ({}, {"preferred_element_type": jnp.float32}):
      dx = backward(**dot_kwargs)
      assert dx.dtype == jnp.bfloat16 and dx.shape == x.shape
      error = np.abs(np.asarray(dx, np.float64) - want)
      assert np.all(error <= 2 ** -8 * np.abs(want) + sum_error), (layout, dot_kwargs)
    program = jax.jit(lambda x, dy: jax.vjp(lambda x: mm.xla_path_matmul(x, q), x)[1](dy)).lower(x, dy)
    # XLA's optimized program: the [K, N] copy is a physical transpose only where the option asks for it (without
    # the barrier XLA folds it into the dot, and this finds none).
    compiled = program.compile().as_text()
    transposes = re.findall(rf"\[{x.shape[-1]},{n}\]\{{1,0\}} (?:copy|transpose)\(", compiled)
    assert bool(transposes) == (layout == "KxN"), (layout, compiled)
  # A bad value fails when the file is read, naming the key; a CPU never takes the option.
  monkeypatch.setattr(mm, "_gpu_supported", lambda: False)
  assert kernels.xla_backward_layout() == "NxK"
  path.write_text(json.dumps({"xla_backward_layout": "NK"}))
  with pytest.raises(ValueError, match='"xla_backward_layout" must be one of'):
    config_lib.xla_backward_layout("NVIDIA H200")
