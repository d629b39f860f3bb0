"""A software-pipelining mark for a Pallas Triton loop: ``pipelined(carry, stages)`` in a ``fori_loop`` body.

Triton's pipeliner turns a loop's global loads into asynchronous copies into shared memory issued
``num_stages - 1`` trips ahead. It does so only for loads that feed a dot, unless the loop itself carries a
``tt.num_stages`` attribute (Triton's AssignLatencies pass, 3.x: a loop without a dot is pipelined only when it
is marked). Triton's ``tl.range(..., num_stages=n)`` writes that attribute; Pallas has no way to, so the gemv's K
loop (no dot: its products are CUDA-core multiply-adds) ran with one trip of loads in flight per program.

``pipelined`` is the identity on its operand. Its Pallas Triton lowering also puts ``tt.num_stages`` on the
``scf.for`` whose body it sits in, so it must be called in the loop body itself, not in a branch inside it.
Everywhere else (interpret mode, XLA) it is the identity and nothing more. It registers a lowering rule in
jax's Pallas Triton lowering table, a private module: ``available()`` says whether that worked, and the kernels
leave the mark out where it did not (the loop is then unpipelined, as before).
"""

from __future__ import annotations

import jax
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.interpreters.mlir import ir

_stages_p = Primitive("qerl_loop_stages")
_stages_p.def_impl(lambda x, *, stages: x)
_stages_p.def_abstract_eval(lambda x, *, stages: x)
mlir.register_lowering(_stages_p, lambda ctx, x, *, stages: [x])


def _mark_enclosing_loop(ctx, x, *, stages: int):
  """Pallas Triton lowering: the operand unchanged, and ``tt.num_stages`` on the loop being built."""
  del ctx
  loop = ir.InsertionPoint.current.block.owner
  if loop.name != "scf.for":
    raise ValueError(f"loop_stages.pipelined must sit directly in a fori_loop body (found it in {loop.name})")
  loop.attributes["tt.num_stages"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), stages)
  return x


try:  # jax's Pallas Triton lowering table (jax 0.10.2 and 0.11.2 both keep it under this name)
  from jax._src.pallas.triton import lowering as _triton_lowering  # pylint: disable=import-outside-toplevel
  _triton_lowering.triton_lowering_rules[_stages_p] = _mark_enclosing_loop
  _REGISTERED = True
except (ImportError, AttributeError):
  _REGISTERED = False


def available() -> bool:
  """Whether the mark reaches Triton on this jax (its lowering rule is registered)."""
  return _REGISTERED


def pipelined(x: jax.Array, stages: int) -> jax.Array:
  """x, marking the enclosing loop for ``stages``-deep software pipelining (``stages`` >= 2)."""
  if not isinstance(stages, int) or stages < 2:
    raise ValueError(f"stages={stages!r}: a pipelined loop needs at least 2 stages")
  return _stages_p.bind(x, stages=stages)
