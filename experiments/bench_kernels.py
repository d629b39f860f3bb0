"""Benchmark of the fused NVFP4 matmul kernels against the bf16 XLA dot, on every Qwen2.5 linear shape.

Run on a GPU from the repo root (it checks every timed kernel against a float32 reference first):
  QERL_COMMIT=$(git rev-parse --short HEAD) python3 -m experiments.bench_kernels \
      --out experiments/results/kernels.jsonl
  python3 -m experiments.bench_kernels --sweep --models 7b --rows 1,16,64,256,2048   # tile candidates
Each measurement is one JSON line (shape, rows, k, n, direction, us, bf16_us, ratio, roofline_frac,
implementation, config, commit, device, ...); a summary table is printed last. The roofline is the packed
weight + scale bytes over the device-to-device copy bandwidth measured at the start of the same run.
Timing: each op runs inside one jitted loop over several weight copies (more bytes than L2 holds), so
launches go back to back without Python in between; the per-call time is the median of 5 runs / calls.
That wall time includes the loop's own overhead (a few us per pass, large next to a 3-30 us decode kernel);
``--trace`` also records ``device_us``: the GPU kernel time per call from a profiler trace of the same
runs (every kernel the op launches, e.g. a split's partial sums, and the loop's one small add per pass).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments import provenance
from experiments.bench_dot_forms import hlo_launches
from experiments.bench_rollout import copy_bandwidth
from experiments.profile_decode import device_sms, launch_rounds
from qerl_kernels import xla_backward_layout, xla_dequant
from qerl_kernels import config as config_lib
from qerl_kernels.config import Nvfp4MatmulConfig
from qerl_kernels.nvfp4_matmul_bwd import nvfp4_matmul_bwd_pallas
from qerl_kernels.nvfp4_matmul_fwd import nvfp4_matmul_fwd_pallas


def _qwen_shapes(hidden, inter, heads, kv_heads, head_dim=128):
  """(K, N) of each decoder linear, y = x @ W[K, N]: q|k|v and gate|up fused as vLLM runs them (the default
  layers), and the calls this project's model makes, one per projection ("q", "kv" for k and v, "gate" for
  gate and up; profile_decode at 3c549d8 shows seven kernels per layer)."""
  return {
    "qkv": (hidden, (heads + 2 * kv_heads) * head_dim),
    "o": (heads * head_dim, hidden),
    "gate_up": (hidden, 2 * inter),
    "down": (inter, hidden),
    "q": (hidden, heads * head_dim),
    "kv": (hidden, kv_heads * head_dim),
    "gate": (hidden, inter),
  }


MODELS = {
  "7b": _qwen_shapes(3584, 18944, 28, 4),
  "14b": _qwen_shapes(5120, 13824, 40, 8),
  "32b": _qwen_shapes(5120, 27648, 40, 8),
  "tiny": _qwen_shapes(64, 96, 2, 1, head_dim=16),  # CPU smoke test of this script (--interpret)
}
ROWS = (1, 8, 16, 64, 256, 2048, 8192)
# The launches the model makes, one per projection: an A/B meant for the model times these (at 4064ae3,
# one_round left the fused gate_up's time alone but slowed the model's separate 18944-wide gate and up 16%).
LAUNCHES = ("q", "kv", "o", "gate", "down")
_L2_BYTES_x4 = 200 * 2**20  # rotate weight copies until this many bytes are in play (L2 is ~50-60 MB)
_INTERPRET = False  # --interpret: Pallas interpret mode, a CPU smoke test (one weight copy, one timing rep)
_L2_WARM = False  # --l2-warm: one weight copy, so every call after the first finds it in L2 (what a prefetch buys)
_TRACE = False  # --trace: each timed op also runs once as its own program, whose kernels a trace sums

# Tile candidates per direction and row bucket, for --sweep.
_C = Nvfp4MatmulConfig
CANDIDATES = {
  ("fwd", 16): [_C(16, 64, 256, num_warps=4, num_stages=4), _C(16, 128, 256, num_warps=4, num_stages=3),
                _C(16, 64, 512, num_warps=4, num_stages=3), _C(16, 32, 512, num_warps=4, num_stages=4),
                _C(16, 128, 128, num_warps=4, num_stages=4), _C(16, 256, 128, num_warps=8, num_stages=3),
                # Two stages: less shared memory, more programs per SM (kernel_sass at 0dcb044: 16/64/128
                # fits 5 per SM, 20 warps, against 3 for the tuned 16/64/256 with 4 stages)
                _C(16, 64, 128, num_warps=4, num_stages=2), _C(16, 64, 256, num_warps=4, num_stages=2),
                # More programs by split-K: 7B gate at 8 rows ran 296 programs (127 registers, 60 KB: 3 fit per SM)
                _C(16, 64, 256, num_warps=4, num_stages=4, programs_per_sm=4, ragged_split=True),
                _C(16, 64, 256, num_warps=4, num_stages=2, programs_per_sm=4, ragged_split=True),
                _C(16, 64, 256, num_warps=4, num_stages=2, programs_per_sm=8, ragged_split=True),
                # 2 warps: mma.sync, whose operand layout reads the packed bytes 8 at a time (the H200 file since
                # 8f7f91c: 7B batch 8, 4.72 -> 4.16 kernel ms per step in the model)
                _C(16, 64, 256, num_warps=2, num_stages=3, programs_per_sm=6, ragged_split=True),
                _C(16, 64, 256, num_warps=2, num_stages=2, programs_per_sm=4, ragged_split=True),
                _C(16, 64, 256, num_warps=2, num_stages=2, programs_per_sm=8, ragged_split=True)],
  ("fwd", 64): [_C(64, 64, 128, num_warps=4, num_stages=4), _C(64, 128, 128, num_warps=4, num_stages=3),
                _C(64, 64, 256, num_warps=4, num_stages=3), _C(32, 64, 256, num_warps=4, num_stages=4),
                _C(64, 128, 128, num_warps=8, num_stages=3), _C(32, 128, 128, num_warps=4, num_stages=4),
                # (kernel_sass at 0dcb044: the tuned 64/64/256 with 3 stages fits 1 program per SM, 4 warps;
                # these 3-4 programs, 12-16 warps)
                _C(64, 64, 128, num_warps=4, num_stages=2), _C(32, 64, 256, num_warps=4, num_stages=2),
                # Eight warps (two warpgroups) per tile: half the decode work per thread, the same bytes
                _C(64, 64, 256, num_warps=8, num_stages=3), _C(64, 128, 128, num_warps=8, num_stages=2),
                # More programs by split-K: the tuned tile gives 7B gate 296 programs against the 4 per SM
                # (528) its launch fits (115 registers, 37 KB; the trace at a9618a4)
                _C(64, 64, 128, num_warps=4, num_stages=2, programs_per_sm=4),
                _C(64, 64, 128, num_warps=4, num_stages=2, programs_per_sm=8),
                # 2 warps: mma.sync, operands in registers (no shared-memory store of the decoded tile before
                # wgmma). kernel_sass, 7B gate at 64 rows: 6.05 instructions per weight against 7.30 for the tuned
                # 4-warp tile; 236 / 175 registers, 4 / 5 programs per SM
                _C(64, 64, 128, num_warps=2, num_stages=3), _C(64, 64, 64, num_warps=2, num_stages=4),
                # Ragged K ranges: 7B down_proj's 148 K steps admit no even split past 4 (224 programs, 1.7 per SM in
                # the batch-64 trace at 7c40c02: 54.9 us per call, 0.7 TB/s); ragged, 448-560
                _C(64, 64, 128, num_warps=4, num_stages=3, programs_per_sm=3, ragged_split=True),
                _C(64, 64, 128, num_warps=2, num_stages=3, programs_per_sm=4, ragged_split=True),
                # 2 warps (shipped since 483586a's profile) over 128 columns: each program reads x's K range for
                # twice the columns, so x's re-reads from L2 halve (gate|up: 272 -> 136 MB per call against 76 MB
                # of weights). kernel_sass, 7B gate: 5.20 instructions per weight against 6.05, 253 registers, 4
                # programs per SM, no spills (the gate|up group with the epilogue: 255, 16 bytes spilled)
                _C(64, 128, 64, num_warps=2, num_stages=3), _C(64, 128, 64, num_warps=2, num_stages=4)],
  ("fwd", 256): [_C(64, 128, 64, num_warps=4, num_stages=4), _C(128, 128, 64, num_warps=8, num_stages=3),
                 _C(64, 128, 128, num_warps=4, num_stages=3), _C(128, 64, 128, num_warps=4, num_stages=3)],
  ("fwd", 1 << 30): [_C(128, 128, 64, num_warps=8, num_stages=3), _C(128, 256, 64, num_warps=8, num_stages=3),
                     _C(256, 128, 64, num_warps=8, num_stages=3), _C(128, 128, 128, num_warps=8, num_stages=3)],
  ("bwd", 16): [_C(16, 256, 64, num_warps=4, num_stages=4), _C(16, 128, 128, num_warps=4, num_stages=4),
                _C(16, 256, 128, num_warps=4, num_stages=3), _C(16, 512, 64, num_warps=4, num_stages=3)],
  ("bwd", 64): [_C(64, 128, 64, num_warps=4, num_stages=4), _C(64, 128, 128, num_warps=4, num_stages=3),
                _C(64, 64, 128, num_warps=4, num_stages=4), _C(32, 256, 64, num_warps=4, num_stages=4)],
  ("bwd", 256): [_C(64, 64, 128, num_warps=4, num_stages=4), _C(128, 64, 128, num_warps=8, num_stages=3),
                 _C(64, 128, 128, num_warps=4, num_stages=3), _C(128, 128, 64, num_warps=8, num_stages=3)],
  ("bwd", 1 << 30): [_C(128, 64, 128, num_warps=8, num_stages=3), _C(128, 64, 256, num_warps=8, num_stages=3),
                     _C(256, 64, 128, num_warps=8, num_stages=3), _C(128, 128, 128, num_warps=8, num_stages=3)],
}


# Few-row (gemv engine) candidates for --gemv: (block_n, block_k, num_warps, num_stages, prefetch, decoder), each
# split to aim at 8 programs per SM (in-model at 1 row, d55cfc8: 8 per SM beat 2 and 4 by 0.29 / 0.12 ms per step).
GEMV_CANDIDATES = [_C(block_n=bn, block_k=bk, num_warps=w, num_stages=st, engine="gemv", prefetch=pf, dequant=dq,
                      programs_per_sm=8)
                   for bn, bk, w, st, pf, dq in [
                       (32, 256, 4, 3, False, "jnp"), (64, 256, 4, 3, False, "jnp"), (32, 512, 4, 3, False, "jnp"),
                       (64, 128, 4, 3, False, "jnp"), (16, 512, 4, 3, False, "jnp"), (64, 256, 8, 3, False, "jnp"),
                       (128, 128, 8, 2, False, "jnp"), (16, 512, 4, 3, True, "jnp"), (32, 256, 4, 3, True, "jnp"),
                       # prefetch took 15-25% off the e4m3 decoder at 1-2 rows (f391df6); with the PTX decoder:
                       (16, 512, 4, 3, True, "asm"), (32, 256, 4, 3, True, "asm"), (16, 256, 4, 3, True, "asm"),
                       (64, 128, 4, 3, True, "asm"), (32, 512, 8, 3, True, "asm"),
                       # two trips loaded ahead (untimed at 73521b2)
                       (16, 256, 4, 3, 2, "asm"), (16, 512, 4, 3, 2, "asm")]]
# The e4m3-route PTX decoder (kernel_sass, 7B gate at 1 row): 5.34 instructions per weight without prefetch
# (54 registers, 9 programs per SM) and 5.56 with 8 warps (32 registers, 8 per SM), against 9.53 for the tuned
# "asm" gemv with prefetch; prefetching costs it 1.75 per weight (the carried bytes are re-packed). With 8
# warps a split aiming at 16 per SM avoids 1.12 waves of 1184 programs (7B gate) at 8 per SM.
GEMV_CANDIDATES += [_C(block_n=bn, block_k=bk, num_warps=w, num_stages=3, engine="gemv", prefetch=pf,
                       dequant="asm_e4m3", programs_per_sm=ppsm)
                    for bn, bk, w, pf, ppsm in [(16, 256, 4, 0, 8), (16, 256, 4, 1, 8), (16, 256, 8, 0, 8),
                                                (16, 256, 8, 0, 16), (32, 256, 8, 0, 8), (16, 512, 8, 0, 16)]]
# Float16 block sums (half_products; kernel_sass, 7B gate at 1 row: 4.12 instructions per weight, 44 registers,
# 10 programs per SM, against 5.34 / 54 / 9; at 2 rows with prefetch 7.31 / 64 / 8 against 9.22 / 96 / 5). With 8
# warps: 16/16/256 4.12 per weight and 30 registers, 16/32/256 3.53 and 32, both 64 warps per SM (the most).
GEMV_CANDIDATES += [_C(block_n=bn, block_k=256, num_warps=w, num_stages=3, engine="gemv", prefetch=pf,
                       dequant="asm_e4m3", programs_per_sm=ppsm, half_products=True)
                    for bn, w, pf, ppsm in [(16, 4, 0, 8), (16, 4, 1, 8), (16, 4, 0, 10), (16, 8, 0, 8),
                                            (32, 8, 0, 8), (32, 8, 0, 4)]]

# More bytes in flight per thread (--gemv-set in_flight). probe_gemv_loads at 276b6ce (H200, 7B gate at 1 row):
# load-only kernels read the weight in 12.6-13.9 us in every tile pattern, against 20.3 for the gemv, and XLA's
# bf16 gemv streams 4.1 TB/s. The gemv keeps one trip in flight per program (16 bytes of codes per thread at
# 16/256 with 4 warps, 10 programs per SM); these load 32-64 bytes per thread per trip, or two trips ahead.
# Timed at 0d9c40a (7B, 1 row, --trace), the best against the tuned config: gate -3% (32/256), down -7% (64/256,
# 8 warps), q -6% (16/512), kv -5% (32/128); two trips ahead 1.1-1.5x slower. Bytes per thread are not what
# holds the gemv at ~20 us (RESULTS.md, "Where the one-row gemv's time goes").
GEMV_SETS = {"all": GEMV_CANDIDATES,
             "in_flight": [_C(block_n=bn, block_k=bk, num_warps=w, num_stages=3, engine="gemv", prefetch=pf,
                              dequant="asm_e4m3", programs_per_sm=8)
                           for bn, bk, w, pf in [(16, 256, 4, 0), (16, 512, 4, 0), (32, 256, 4, 0), (16, 1024, 4, 0),
                                                 (32, 512, 4, 0), (16, 256, 4, 2), (16, 512, 4, 1), (64, 256, 8, 0)]]}

_TAGS = itertools.count()


@dataclasses.dataclass(frozen=True)
class Timing:
  us: float  # median wall microseconds per op call
  module: str  # with --trace: the HLO module name of one more run, which a profiler trace files kernels under
  calls: int  # op calls in that run, to turn its kernel time into a per-call one
  replay: Any = dataclasses.field(default=None, compare=False)  # with --trace: that run, compiled, to call traced


def _time_loop(op, x, ws, min_ms: float = 5.0, reps: int = 5) -> Timing:
  """Median microseconds of one op(x, w) call, timed inside a jitted loop over the weight copies ws."""
  reps = 1 if _INTERPRET else reps  # interpret mode (a CPU smoke test) times nothing worth repeating
  zero = jnp.zeros((), jnp.float32)

  def loop(x, ws, passes, zero):
    def body(i, ys):
      # A runtime zero keeps each pass from being hoisted out of the loop as loop-invariant.
      xi = x + (i.astype(jnp.float32) * zero).astype(x.dtype)
      return tuple(op(xi, w) for w in ws)
    init = tuple(jax.eval_shape(op, x, w) for w in ws)
    init = tuple(jnp.zeros(s.shape, s.dtype) for s in init)
    return jax.lax.fori_loop(0, passes, body, init)

  def program(name):  # the jitted loop as an HLO module of its own name
    fn = lambda *args: loop(*args)  # noqa: E731
    fn.__name__ = fn.__qualname__ = name
    return jax.jit(fn)

  run = program("bench_loop")
  jax.block_until_ready(run(x, ws, 1, zero))  # compile + warm-up
  t0 = time.perf_counter()
  jax.block_until_ready(run(x, ws, 1, zero))
  one = time.perf_counter() - t0
  passes = max(1, min(200, math.ceil(min_ms * 1e-3 / max(one, 1e-6))))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(run(x, ws, passes, zero))
    times.append(time.perf_counter() - t0)
  us = float(np.median(times)) / (passes * len(ws)) * 1e6
  if not _TRACE:
    return Timing(us, "", 0)
  # One more run under a name of its own, so a trace holds exactly its kernels (its compile reuses the first
  # one's autotuning, so no autotuning kernels land under that name). Compiled here, run later inside a trace
  # that holds only these runs (`_run_case`).
  name = f"bench_{next(_TAGS)}"
  compiled = program(name).lower(x, ws, passes, zero).compile()
  return Timing(us, f"jit_{name}", passes * len(ws), lambda: jax.block_until_ready(compiled(x, ws, passes, zero)))


def _random_weight(key, k, n, c):
  """Copy c of (packed uint8 [N, K/2], scale e4m3 [N, K/16], global_scale f32 [1]), all bytes random."""
  k1, k2, k3 = jax.random.split(jax.random.fold_in(key, c), 3)
  packed = jax.random.randint(k1, (n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
  scale = jnp.exp2(jax.random.uniform(k2, (n, k // 16), minval=-9.0, maxval=8.7)).astype(
      jnp.float8_e4m3fn)
  gs = jax.random.uniform(k3, (1,), minval=100.0, maxval=3000.0)
  return packed, scale, gs


def _rotation(make, nbytes: int) -> list:
  """The weight copies a timed loop calls its op on, ``make(c)`` for copy c of ``nbytes`` bytes: 2-16 distinct
  ones, more bytes than L2 holds; with --l2-warm one copy 16 times over (every call after the first finds it in
  L2, and the loop's own kernels weigh per call as they do rotated); one in interpret mode."""
  if _INTERPRET:
    return [make(0)]
  if _L2_WARM:
    return [make(0)] * 16
  return [make(c) for c in range(int(np.clip(math.ceil(_L2_BYTES_x4 / nbytes), 2, 16)))]


@jax.jit
def _dequant_f32_KxN(packed, scale, gs):
  e2m1 = jnp.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], jnp.float32)
  codes = jnp.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)
  w = e2m1[codes] * jnp.repeat(scale.astype(jnp.float32), 16, axis=1) / gs[0]
  return w.T


def _weight_bytes(k, n):
  return n * k // 2 + n * k // 16 + 4


def _kernel_op(direction, cfg, poison=False):
  fn = nvfp4_matmul_fwd_pallas if direction == "fwd" else nvfp4_matmul_bwd_pallas
  return lambda a, w: fn(a, *w, config=cfg, poison=poison, interpret=_INTERPRET)


def _members(w, widths: tuple[int, ...]):
  """One weight's (packed, scale, global scale) as a group's: tuples of its column ranges of these widths."""
  packed, scale, gs = w
  ends = np.cumsum(widths)[:-1]
  return tuple(jnp.split(packed, ends)), tuple(jnp.split(scale, ends)), (gs,) * len(widths)


def _rel_err(direction, out, a, w) -> float:
  """Relative Frobenius error of ``out`` against a float32 reference of a @ W (fwd) or a @ W^T (bwd); NaN
  anywhere in ``out`` (an unwritten tile) gives NaN."""
  out = out.astype(jnp.float32)
  w_KxN = _dequant_f32_KxN(*w)
  a32 = a.astype(jnp.float32)
  hi = jax.lax.Precision.HIGHEST
  ref = jnp.dot(a32, w_KxN, precision=hi) if direction == "fwd" else jnp.dot(a32, w_KxN.T, precision=hi)
  if bool(jnp.isnan(out).any()):
    return float("nan")
  return float(jnp.linalg.norm(out - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


def _case(direction, k, n, rows, key, dtype):
  """The weight copies of one case (``_rotation``) and its activations."""
  ws = _rotation(lambda c: _random_weight(key, k, n, c), _weight_bytes(k, n))
  in_dim = k if direction == "fwd" else n
  a = jax.random.normal(jax.random.fold_in(key, 99), (rows, in_dim), jnp.float32).astype(dtype)
  return ws, a


def _record(direction, k, n, rows, timed: Timing, bf16: Timing | None, bw, **extra):
  """A JSON record; "_programs" (dropped before writing) names the timed programs for ``add_device_us``."""
  roof_us = _weight_bytes(k, n) / bw * 1e6
  us, bf16_us = timed.us, bf16.us if bf16 else float("nan")
  return dict(rows=rows, k=k, n=n, direction=direction, us=round(us, 2), bf16_us=round(bf16_us, 2),
              speedup=round(bf16_us / us, 3), roofline_frac=round(roof_us / us, 3), roofline_us=round(roof_us, 2),
              **extra, _programs=(timed, bf16))


def add_device_us(records: list, module_us: dict[str, float], bw: float,
                  launches: dict[str, str] | None = None, num_sms: int = 132) -> None:
  """Adds device_us / bf16_device_us (GPU kernel time per call, from a trace's {module: us}) and the speedup
  and roofline fraction by them, and ``launch`` (the timed kernel's registers, shared memory, grid and
  occupancy, from the trace's {module: launch}) with its ``rounds`` (``launch_rounds`` on ``num_sms``); drops
  "_programs". A program the trace did not see gets no field."""
  for r in records:
    timed, bf16 = r.pop("_programs")
    if launches and timed.module in launches:
      r["launch"] = launches[timed.module]
      if (rounds := launch_rounds(r["launch"], num_sms)) is not None:
        r["rounds"] = rounds
    per_call = {name: module_us[t.module] / t.calls for name, t in (("device_us", timed), ("bf16_device_us", bf16))
                if t is not None and module_us.get(t.module)}
    r.update({name: round(us, 2) for name, us in per_call.items()})
    if "device_us" in per_call:
      r["device_roofline_frac"] = round(r["roofline_us"] / per_call["device_us"], 3)
      if "bf16_device_us" in per_call:
        r["device_speedup"] = round(per_call["bf16_device_us"] / per_call["device_us"], 3)


def bench_one(direction, k, n, rows, cfg, key, bf16_cache, bw, dtype=jnp.bfloat16, widths=()):
  """Checks and times one kernel config and (cached per shape) the bf16 dot; returns a record. widths: the
  forward over the same weight as a group of members of these widths, each its own array, in one launch
  (``qerl_kernels.Nvfp4Group``, the model's merged launches)."""
  ws, a = _case(direction, k, n, rows, key, dtype)
  reference = ws[0]
  if widths:
    ws = [_members(w, widths) for w in ws]
  candidate = dataclasses.asdict(cfg)
  cfg = config_lib.fit(cfg, direction, rows, k, n, auto_split=cfg.split == 1)
  t0 = time.perf_counter()
  err = _rel_err(direction, jax.jit(_kernel_op(direction, cfg, poison=True))(a, ws[0]), a, reference)
  compile_s = time.perf_counter() - t0
  if not err < 1e-2:
    raise RuntimeError(f"{direction} k={k} n={n} rows={rows} {cfg}: relative error {err}")
  timed = _time_loop(_kernel_op(direction, cfg), a, ws)
  del ws
  return _record(direction, k, n, rows, timed, bf16_timing(direction, k, n, rows, a, key, bf16_cache), bw,
                 check_rel_err=float(f"{err:.3g}"),
                 config=dataclasses.asdict(cfg), candidate=candidate, first_call_s=round(compile_s, 2),
                 **({"group": list(widths)} if widths else {}))


def bf16_timing(direction, k, n, rows, a, key, bf16_cache, dtype=jnp.bfloat16) -> Timing:
  """The bf16 XLA dot on the case's shape (x @ W forward, dy @ W^T backward), timed once per case and cached."""
  bkey = (direction, k, n, rows)
  if bkey not in bf16_cache:
    wb = _rotation(lambda c: jax.random.normal(jax.random.fold_in(key, 1000 + c), (k, n), jnp.float32).astype(dtype),
                   2 * k * n)
    if direction == "fwd":
      bop = lambda x, w: jnp.dot(x, w)  # noqa: E731
    else:
      bop = lambda dy, w: jax.lax.dot_general(dy, w, (((1,), (1,)), ((), ())))  # noqa: E731
    bf16_cache[bkey] = _time_loop(bop, a, wb)
  return bf16_cache[bkey]


def bench_xla(direction, k, n, rows, key, bf16_cache, bw, dtype=jnp.bfloat16):
  """Checks and times the shipped XLA path (`nvfp4_matmul(..., implementation="xla")`: dequantize one weight to
  bf16, then XLA's dot) on the same shape; returns a record.

  At thousands of rows the dot is compute-bound and the dequantization (one pass over the weight) is small
  next to it, so this path may beat a fused kernel there; `--xla` measures where. The backward is what the
  model's autodiff gives: the forward's transpose, dy @ dequant(W)^T. The record's ``launches`` counts the
  kernels of one call and ``fused_gemm`` says whether XLA emitted the dot as a Triton GEMM fusion (which can take
  the dequantization in as its operand's producer) rather than a separate dequantization and a cuBLAS call.
  """
  from qerl_jax.quant.types import NVFP4Tensor  # pylint: disable=import-outside-toplevel
  ws, a = _case(direction, k, n, rows, key, dtype)
  reference = ws[0]
  ws = [NVFP4Tensor(*w) for w in ws]
  op = xla_path_op(direction, rows, k)
  err = _rel_err(direction, jax.jit(op)(a, ws[0]), a, reference)
  if not err < 1e-2:
    raise RuntimeError(f"xla path {direction} k={k} n={n} rows={rows}: relative error {err}")
  launches, fused = hlo_launches(jax.jit(op).lower(a, ws[0]).compile().as_text())
  timed = _time_loop(op, a, ws)
  del ws
  return _record(direction, k, n, rows, timed, bf16_timing(direction, k, n, rows, a, key, bf16_cache), bw,
                 check_rel_err=float(f"{err:.3g}"), launches=launches, fused_gemm=fused,
                 config={"block_n": 0, "block_k": 0, "split": 0, "num_warps": 0, "engine": "xla"})


def xla_path_op(direction: str, rows: int, k: int):
  """op(a, q) of the shipped XLA path: the forward x @ dequant(W), or the backward as JAX transposes it."""
  from qerl_kernels import nvfp4_matmul  # pylint: disable=import-outside-toplevel
  fwd = lambda x, q: nvfp4_matmul(x, q, implementation="xla")  # noqa: E731
  if direction == "fwd":
    return fwd
  def bwd(dy, q):
    # jax.vjp, as the model's jax.grad: not jax.linear_transpose, which rejects the path wherever the weight's
    # dequantization waits for x behind an optimization_barrier (the "words" and "pallas" modes): it takes a weight
    # that depends on x for a second linear operand. The forward dot, unused, is dead code under jit.
    _, vjp = jax.vjp(lambda x: fwd(x, q), jnp.zeros((rows, k), dy.dtype))
    (dx,) = vjp(dy)
    return dx
  return bwd


# Mosaic GPU kernel candidates for --mosaic (qerl_kernels/nvfp4_mgpu.py; untimed at its first commit): pipeline depth,
# K per step, decoder and output columns per program; the row tile and K split are what the dispatch would pick
# (``nvfp4_mgpu.from_matmul_config``).
MOSAIC_CANDIDATES = [(2, 256, "bits", 64), (3, 256, "bits", 64), (4, 256, "bits", 64), (2, 512, "bits", 64),
                     (3, 512, "bits", 64), (2, 256, "bits", 128), (3, 256, "bits", 128),
                     (2, 256, "arith", 64)]  # "arith": no bf16 subnormal, should "bits" fail its check


def bench_mosaic(k, n, rows, stages, tile_k, decode, tile_n, key, bf16_cache, bw, dtype=jnp.bfloat16):
  """Checks (float32 reference, relative error < 1e-2) and times the Mosaic GPU forward kernel; returns a record."""
  from qerl_kernels import nvfp4_mgpu  # pylint: disable=import-outside-toplevel
  entry = _C(engine="mosaic", block_m=128, block_n=tile_n, block_k=tile_k, num_stages=stages)
  cfg = dataclasses.replace(nvfp4_mgpu.from_matmul_config(entry, rows, k, n, num_sms=device_sms()), decode=decode)
  ws, a = _case("fwd", k, n, rows, key, dtype)
  op = lambda x, w: nvfp4_mgpu.nvfp4_matmul_fwd_mgpu(x, *w, config=cfg, interpret=_INTERPRET)  # noqa: E731
  t0 = time.perf_counter()
  err = _rel_err("fwd", jax.jit(op)(a, ws[0]), a, ws[0])
  compile_s = time.perf_counter() - t0
  if not err < 1e-2:
    raise RuntimeError(f"mosaic k={k} n={n} rows={rows} {cfg}: relative error {err}")
  timed = _time_loop(op, a, ws)
  config = dict(dataclasses.asdict(cfg), block_n=cfg.tile_n, block_k=cfg.tile_k, num_warps=4, engine="mosaic")
  return _record("fwd", k, n, rows, timed, bf16_cache.get(("fwd", k, n, rows)), bw,
                 check_rel_err=float(f"{err:.3g}"), config=config, first_call_s=round(compile_s, 2))


def _bucket(direction, rows):
  for (d, max_rows) in sorted(CANDIDATES, key=lambda t: (t[0], t[1])):
    if d == direction and rows <= max_rows:
      return max_rows
  raise AssertionError


def _summary(records):
  """The table printed last: wall us per call and, when traced, the device us and ratios by them."""
  traced = any("device_us" in r for r in records)
  head = f"{'dev us':>9}{'bf16 dev':>9}{'x bf16':>8}{'roof':>7}" if traced else ""
  lines = [f"{'shape':<18}{'dir':<5}{'rows':>6}{'us':>10}{'bf16_us':>10}{'x bf16':>8}{'roof':>7}{head}  engine"]
  nan = float("nan")
  for r in records:
    c = r["config"]
    dev = (f"{r.get('device_us', nan):>9.1f}{r.get('bf16_device_us', nan):>9.1f}{r.get('device_speedup', nan):>8.2f}"
           f"{r.get('device_roofline_frac', nan):>7.2f}") if traced else ""
    lines.append(f"{r['shape']:<18}{r['direction']:<5}{r['rows']:>6}{r['us']:>10.1f}{r['bf16_us']:>10.1f}"
                 f"{r['speedup']:>8.2f}{r['roofline_frac']:>7.2f}{dev}  {'group ' if r.get('group') else ''}"
                 f"{c.get('engine', 'tensorcore')} "
                 f"n{c['block_n']} k{c['block_k']} s{c['split']} w{c['num_warps']}"
                 f"{' r%.2f' % r['rounds'] if 'rounds' in r else ''}")
  return "\n".join(lines)


def parse_shapes(spec: str, parser: argparse.ArgumentParser) -> list[tuple[int, int]]:
  """--shapes as (K, N) pairs; a malformed one, or K not a multiple of the 16-wide NVFP4 block, stops the run
  before any GPU work."""
  shapes = []
  for item in spec.split(","):
    k, sep, n = item.strip().lower().partition("x")
    if not (sep and k.isdigit() and n.isdigit() and int(k) > 0 and int(n) > 0):
      parser.error(f"--shapes {item!r}: expected KxN with positive integers, e.g. 3584x33792")
    if int(k) % 16:
      parser.error(f"--shapes {item!r}: K={k} must be a multiple of 16 (the NVFP4 block)")
    shapes.append((int(k), int(n)))
  return shapes


def layer_names(spec: str, parser: argparse.ArgumentParser) -> tuple[str, ...]:
  """--layers as layer names ('launches': the model's); an unknown name stops the run before any GPU work."""
  names = LAUNCHES if spec == "launches" else tuple(spec.split(","))
  unknown = [n for n in names if n not in MODELS["7b"]]
  if unknown:
    parser.error(f"unknown --layers {unknown}; known: {sorted(MODELS['7b'])} or 'launches'")
  return names


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", default="7b,14b,32b")
  p.add_argument("--layers", default="qkv,o,gate_up,down",
                 help="comma-separated, or 'launches' for the shapes the model launches (" + ",".join(LAUNCHES) + ")")
  p.add_argument("--shapes", default="",
                 help="comma-separated KxN weights (e.g. 3584x33792) to time instead of --models x --layers; "
                      "their records' shape is 'KxN'")
  p.add_argument("--rows", default=",".join(map(str, ROWS)))
  p.add_argument("--directions", default="fwd,bwd")
  p.add_argument("--sweep", action="store_true", help="time every tile candidate; print the winners")
  p.add_argument("--out", default="experiments/results/kernels.jsonl")
  p.add_argument("--tuning-out", default="", help="with --sweep: write the winners as tuning JSON here")
  p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU smoke test only)")
  p.add_argument("--xla", action="store_true",
                 help="also time the XLA path (dequantize, then XLA's dot) after each kernel, same shape")
  p.add_argument("--xla-only", action="store_true",
                 help="time the XLA path and the bf16 dot only, no tile kernel: training rows (>= the tuning file's "
                      "xla_min_rows, where the model dispatches to that path) at a third of the device time")
  p.add_argument("--gemv", action="store_true",
                 help="at forward rows <= 16 also time every gemv-engine candidate; the fastest is reported")
  p.add_argument("--gemv-set", default="all", choices=sorted(GEMV_SETS),
                 help="with --gemv: which list of gemv candidates (in_flight: more bytes loaded per thread)")
  p.add_argument("--gemv-decoders", default="",
                 help="with --gemv: only the gemv candidates of these decoders (comma-separated, e.g. asm_e4m3)")
  p.add_argument("--trace", action="store_true",
                 help="also record each op's GPU kernel time per call (device_us) from a profiler trace, and rank "
                      "candidates by it")
  p.add_argument("--l2-warm", action="store_true",
                 help="one weight copy instead of a rotation past L2: the time of a call whose weight is already "
                      "in L2 (the bf16 dot's too, where it fits); records carry l2_warm")
  p.add_argument("--mosaic", action="store_true",
                 help="also time the Mosaic GPU forward kernel (qerl_kernels/nvfp4_mgpu.py) candidates, same shape")
  p.add_argument("--group", action="store_true",
                 help="forward, qkv and gate_up: also time the tuned config over the layer's projections as one "
                      "group launch (qerl_kernels.Nvfp4Group: q, k, v or gate, up read in place; implementation "
                      "'group')")
  p.add_argument("--decoders", default="",
                 help="comma-separated tile decoders to time on each tuned config, or with --sweep on each "
                      "candidate (e.g. jnp,halves,asm)")
  args = p.parse_args(argv)
  layers = layer_names(args.layers, p)
  if args.xla_only and (args.sweep or args.gemv or args.mosaic or args.group or args.decoders):
    p.error("--xla-only times no kernel: it does not combine with --sweep, --gemv, --mosaic, --group or --decoders")
  args.xla = args.xla or args.xla_only
  cases = ([("", f"{k}x{n}", (k, n)) for k, n in parse_shapes(args.shapes, p)] if args.shapes else
           [(model, layer, MODELS[model][layer]) for model in args.models.split(",") for layer in layers])
  if args.group and args.sweep:
    p.error("--group times the tuned config; it does not combine with --sweep")
  if args.group and args.shapes:
    p.error("--group times a model's fused layers; it does not combine with --shapes")
  global _INTERPRET, _TRACE, _L2_WARM
  _INTERPRET, _TRACE, _L2_WARM = args.interpret, args.trace, args.l2_warm

  dev = jax.devices()[0]
  device = dev.device_kind
  commit = provenance.commit()
  bw = copy_bandwidth(2.0)
  print(f"device={device} commit={commit} copy_bandwidth={bw / 1e12:.3f} TB/s", flush=True)
  key = jax.random.key(0)
  decoders = args.decoders.split(",") if args.decoders else []
  gemv_decoders = args.gemv_decoders.split(",") if args.gemv_decoders else []
  records, swept, bf16_cache = [], [], {}
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "a") as f:
    for model, layer, (k, n) in cases:
      for direction in args.directions.split(","):
        for rows in map(int, args.rows.split(",")):
          if args.xla_only:
            cands = []
          elif args.sweep:  # every candidate with each of --decoders (by default, the candidate's own)
            cands = [c if d is None else dataclasses.replace(c, dequant=d)
                     for c in CANDIDATES[(direction, _bucket(direction, rows))] for d in decoders or [None]]
          else:
            cfg = config_lib.get_config(direction, rows, k, n, device)
            cands = [dataclasses.replace(cfg, dequant=d) for d in decoders or [cfg.dequant]]
            if args.gemv and direction == "fwd" and rows <= config_lib.GEMV_MAX_ROWS:
              cands += [c for c in GEMV_SETS[args.gemv_set] if not gemv_decoders or c.dequant in gemv_decoders]
          tag = dict(shape=f"qwen2.5-{model}.{layer}" if model else layer, commit=commit, device=device,
                     copy_tbps=round(bw / 1e12, 3), kernel_tuning=provenance.kernel_tuning(),
                     xla_dequant=xla_dequant(), xla_backward_layout=xla_backward_layout(),
                     **({"l2_warm": True} if _L2_WARM else {}))
          widths = group_widths(model, layer) if args.group and direction == "fwd" else ()
          case = _run_case(direction, k, n, rows, cands, key, bf16_cache, bw, args, tag, widths)
          for rec in case:
            f.write(json.dumps(rec) + "\n")
            print(json.dumps(rec), flush=True)
          f.flush()
          kernels = [r for r in case if r["implementation"] == "pallas"]
          swept += kernels
          if kernels:
            records.append(min(kernels, key=_rank_us))
          records += [r for r in case if r["implementation"] in ("xla", "group")]
          mosaic = [r for r in case if r["implementation"] == "mosaic"]
          if mosaic:
            records.append(min(mosaic, key=_rank_us))
  print(_summary(records))
  if args.sweep and args.tuning_out:
    with open(args.tuning_out, "w") as g:
      json.dump({"device_kind": device, "commit": commit, "entries": tuning_entries(swept)}, g, indent=1)
  return records


def _rank_us(r) -> float:
  """The time a candidate is ranked by: its device time when traced, else its wall time."""
  return r.get("device_us", r["us"])


def group_widths(model: str, layer: str) -> tuple[int, ...]:
  """The widths of the projections a fused layer is made of (q, k, v or gate, up); () for the others."""
  shapes = MODELS[model]
  return {"qkv": (shapes["q"][1], shapes["kv"][1], shapes["kv"][1]),
          "gate_up": (shapes["gate"][1],) * 2}.get(layer, ())


def _run_case(direction, k, n, rows, cands, key, bf16_cache, bw, args, tag, widths=()) -> list:
  """Times every candidate (and with --xla the XLA path, with widths the first candidate as a group launch)
  on one case; with --trace, each timed program then runs once more inside one profiler trace, whose kernel
  time per program becomes each record's device_us."""
  if args.trace:
    bf16_cache = {}  # the bf16 dot's traced run belongs to this case
  case = []
  for cfg in cands:
    try:
      rec = bench_one(direction, k, n, rows, cfg, key, bf16_cache, bw)
    except Exception as e:  # keep going: one bad candidate must not lose the run
      print(f"FAILED {tag['shape']} {direction} rows={rows} {cfg}: {type(e).__name__}: {str(e)[:400]}",
            flush=True)
      continue
    case.append(dict(rec, **tag, implementation="pallas", sweep="gemv" if args.gemv else bool(args.sweep)))
  if args.mosaic and direction == "fwd":
    for stages, tile_k, decode, tile_n in MOSAIC_CANDIDATES:
      if k % tile_k or n % tile_n:
        continue
      try:
        rec = bench_mosaic(k, n, rows, stages, tile_k, decode, tile_n, key, bf16_cache, bw)
      except Exception as e:  # keep going: an unsupported layout or shape must not lose the run
        print(f"FAILED {tag['shape']} mosaic rows={rows} stages={stages} tile_k={tile_k} {decode} tile_n={tile_n}: "
              f"{type(e).__name__}: {str(e)[:400]}", flush=True)
        continue
      case.append(dict(rec, **tag, implementation="mosaic", sweep="mosaic"))
  if widths and cands:
    try:
      rec = bench_one(direction, k, n, rows, cands[0], key, bf16_cache, bw, widths=widths)
      case.append(dict(rec, **tag, implementation="group", sweep=False))
    except Exception as e:  # keep going
      print(f"FAILED {tag['shape']} group {widths} rows={rows}: {type(e).__name__}: {str(e)[:400]}", flush=True)
  if args.xla:
    case.append(dict(bench_xla(direction, k, n, rows, key, bf16_cache, bw), **tag, implementation="xla",
                     sweep="xla"))
  module_us = {}
  if args.trace:
    from experiments.profile_decode import (  # pylint: disable=import-outside-toplevel
      module_kernel_us, module_launches, quiet_trace)
    programs = {t.module: t for r in case for t in r["_programs"] if t is not None and t.replay is not None}
    trace_dir = tempfile.mkdtemp(prefix="bench_kernels_trace_")
    # Only the replays run under the profiler: at e0f3129, tracing each case's compiles and timing loops too
    # (with the Python tracer on) took ~50 s per case on an H200.
    with quiet_trace(trace_dir):
      for t in programs.values():
        t.replay()
    traced = _has_trace(trace_dir)
    module_us = module_kernel_us(trace_dir) if traced else {}
    launches = module_launches(trace_dir) if traced else {}
    shutil.rmtree(trace_dir, ignore_errors=True)
  add_device_us(case, module_us, bw, launches if args.trace else None, num_sms=device_sms())
  return case


def _has_trace(trace_dir: str) -> bool:
  return any(name == "perfetto_trace.json.gz" for _, _, names in os.walk(trace_dir) for name in names)


def tuning_entries(swept):
  """Per (direction, row bucket): the candidate with the least summed time relative to each case's best.

  Only candidates timed on every case of their bucket compete: one that failed on a shape would otherwise
  win by having one term fewer in its sum (it did at b38e8cc).
  """
  best_us, scores, cases, timed = {}, {}, {}, {}
  for r in swept:
    case = (r["shape"], r["direction"], r["rows"])
    best_us[case] = min(best_us.get(case, float("inf")), _rank_us(r))
  for r in swept:
    cfg = dict(r["candidate"])
    cfg.pop("split")
    bucket = (r["direction"], _bucket(r["direction"], r["rows"]))
    key = (*bucket, json.dumps(cfg, sort_keys=True))
    case = (r["shape"], r["direction"], r["rows"])
    cases.setdefault(bucket, set()).add(case)
    timed.setdefault(key, set()).add(case)
    scores[key] = scores.get(key, 0.0) + _rank_us(r) / best_us[case]
  entries = {}
  for (direction, bucket, cfg), score in sorted(scores.items(), key=lambda t: t[1]):
    if timed[(direction, bucket, cfg)] == cases[(direction, bucket)]:
      entries.setdefault((direction, bucket), {"direction": direction, "max_rows": bucket,
                                               "config": json.loads(cfg), "score": round(score, 3)})
  return [entries[k] for k in sorted(entries)]


if __name__ == "__main__":
  sys.exit(0 if main() is not None else 1)
