"""Lowering a Pallas kernel for a CUDA GPU on a CPU machine: the step interpret mode skips."""

import contextlib
import functools
import io

import jax
from jax.experimental import pallas as pl


def lower_for_cuda(fn, *args) -> tuple[str, str]:
  """(jit(fn)'s lowered text for a CUDA GPU, the Triton modules Pallas printed while lowering it).

  The kernels look ``pl.pallas_call`` up at call time, so it is patched with ``debug=True`` for the duration.
  A Triton module that does not verify prints in MLIR's generic form ('"builtin.module"(...)'): lowering alone
  passes it on, and only the GPU's compile would reject it (an inline-asm result typed ui32 showed up so).
  """
  original, printed = pl.pallas_call, io.StringIO()
  pl.pallas_call = functools.partial(original, debug=True)
  try:
    with contextlib.redirect_stdout(printed):
      text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  finally:
    pl.pallas_call = original
  return text, printed.getvalue()
