"""qerl_kernels.loop_stages: the Triton pipelining mark on a Pallas loop, and the gemv's ``pipeline`` config."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qerl_kernels import config as config_lib, loop_stages, nvfp4_gemv
from qerl_kernels.config import Nvfp4MatmulConfig
from tests.triton_lowering import lower_for_cuda

MARK = re.compile(r"\} \{tt\.num_stages = (\d+) : i32\}")


def _two_loops(marked_first: bool):
  """A kernel with two K loops over x: o = sum of x's 16-wide rows, then plus twice their sum. One is marked (3)."""
  def kernel(x_ref, o_ref):
    def body(mark, scale):
      def step(i, acc):
        acc = loop_stages.pipelined(acc, 3) if mark else acc
        return acc + scale * x_ref[pl.ds(i * 16, 16)].astype(jnp.float32)
      return step
    first = jax.lax.fori_loop(0, 8, body(marked_first, 1.0), jnp.zeros((16,), jnp.float32))
    o_ref[...] = jax.lax.fori_loop(0, 8, body(not marked_first, 2.0), first)

  def run(x, interpret=False):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), interpret=interpret,
                          compiler_params=plgpu.CompilerParams(num_warps=4), name="two_loops")(x)
  return run


@pytest.mark.parametrize("marked_first", [True, False])
def test_the_mark_lands_on_the_loop_it_sits_in_and_changes_no_value(marked_first):
  assert loop_stages.available()
  x = jnp.asarray(np.random.default_rng().standard_normal(128), jnp.float32)
  run = _two_loops(marked_first)
  _, module = lower_for_cuda(run, x)
  loops = [m.start() for m in re.finditer(r"scf\.for ", module)]
  marks = [(m.start(), int(m.group(1))) for m in MARK.finditer(module)]
  assert len(loops) == 2 and len(marks) == 1 and marks[0][1] == 3, (loops, marks)
  # The first loop's closing brace comes before the second loop opens; the second's after.
  assert (marks[0][0] < loops[1]) == marked_first
  want = 3.0 * np.asarray(x).reshape(8, 16).sum(axis=0)
  np.testing.assert_allclose(np.asarray(run(x, interpret=True)), want, rtol=1e-6, atol=1e-6)


def test_a_mark_away_from_a_loop_body_or_too_shallow_is_refused():
  def kernel(x_ref, o_ref):
    def step(i, acc):
      @pl.when(i > 0)
      def _():
        o_ref[...] = loop_stages.pipelined(acc, 2)
      return acc + x_ref[pl.ds(i * 16, 16)]
    o_ref[...] = jax.lax.fori_loop(0, 4, step, jnp.zeros((16,), jnp.float32))

  call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                        compiler_params=plgpu.CompilerParams(num_warps=4))
  with pytest.raises(Exception) as err:
    lower_for_cuda(call, jnp.zeros((64,), jnp.float32))
  chain, e = [], err.value
  while e is not None:
    chain.append(str(e))
    e = e.__cause__ or e.__context__
  assert any("must sit directly in a fori_loop body (found it in scf.if)" in s for s in chain), chain
  for bad in (1, 0, 2.0):
    with pytest.raises(ValueError, match="at least 2 stages"):
      loop_stages.pipelined(jnp.zeros(()), bad)


def test_pipeline_config_needs_stages_and_no_manual_prefetch():
  with pytest.raises(ValueError, match="pipeline needs num_stages >= 2 and no manual prefetch"):
    Nvfp4MatmulConfig(engine="gemv", pipeline=True, prefetch=1)
  with pytest.raises(ValueError, match="num_stages=1"):
    Nvfp4MatmulConfig(engine="gemv", pipeline=True, num_stages=1)
  assert Nvfp4MatmulConfig(engine="gemv", pipeline=True, num_stages=2).pipeline


@pytest.mark.parametrize("pipeline,stages", [(False, 3), (True, 3), (True, 2)])
def test_the_gemv_marks_each_weights_k_loop_and_not_the_x_at_a_loop(pipeline, stages):
  # The model's one-row q|k|v launch: a group of three weights (a K loop in each member's branch) and x @ A in
  # extra programs (a loop over A, whose loads the mark must leave alone). The shipped config is unmarked.
  k, widths, rank = 256, (64, 32, 32), 16
  shipped = config_lib.get_config("fwd", 1, k, sum(widths), "NVIDIA H200")
  assert not shipped.pipeline
  cfg = config_lib.fit(dataclasses.replace(shipped, block_k=64, num_stages=stages, pipeline=pipeline), "fwd", 1,
                       k, sum(widths))
  members = [(jax.ShapeDtypeStruct((w, k // 2), jnp.uint8), jax.ShapeDtypeStruct((w, k // 16), jnp.float8_e4m3fn),
              jax.ShapeDtypeStruct((), jnp.float32)) for w in widths]

  def f(x, a, *flat):
    packed, scales, gs = (tuple(flat[i::3]) for i in range(3))
    return nvfp4_gemv.nvfp4_gemv_xa_pallas(x, packed, scales, gs, a, config=cfg)

  _, module = lower_for_cuda(f, jax.ShapeDtypeStruct((1, k), jnp.bfloat16),
                             jax.ShapeDtypeStruct((k, rank), jnp.float32), *(t for m in members for t in m))
  marks = [int(s) for s in MARK.findall(module)]
  assert module.count("scf.for ") == len(widths) + 1  # each member's K loop and the x @ A loop
  assert marks == ([stages] * len(widths) if pipeline else []), marks
  # Pipelined, x (bf16, in place) loads as whole pairs, 4 bytes each, which the pipeliner can copy asynchronously;
  # unpipelined as two stride-2 planes of 2-byte elements.
  pairs = re.findall(r"tt\.load %\w+ : tensor<\d+x8x2x!tt\.ptr<bf16>>", module)
  assert bool(pairs) == pipeline, pairs
