"""How fast can a Pallas (Triton) kernel read an NVFP4 weight? Load-only probes of the one-row gemv's pattern.

    python experiments/probe_gemv_loads.py --out $OUT/probe.json

At one row every gemv tuning tried reads 7B gate (3584 x 18944: 38 MB of codes and scales) in ~20 us on an H200
(1.9 TB/s; qerl_kernels/NOTES.md item D), whatever its instruction count. Each probe here reads the same bytes in one
access pattern and only sums them as integers, so its time is that pattern's load time. The peers in the same
trace: XLA's sum over the same bytes, XLA's bf16 gemv on the weight's bf16 shape, and the shipped gemv.
Device microseconds per call come from a profiler trace, over enough weight copies that none sits in L2.
Measured at 276b6ce (RESULTS.md): every probe 12.6-13.9 us for 7B gate, XLA's sum 20.8, the gemv 20.3.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from experiments.profile_decode import module_kernel_us, quiet_trace  # noqa: E402
from experiments import provenance  # noqa: E402

SHAPES = {"qwen2.5-7b.gate": (3584, 18944), "qwen2.5-7b.down": (18944, 3584), "tiny": (512, 64)}


def _tile_probe(salt_ref, packed_ref, scale_ref, o_ref, *, block_n: int, inner: int, block_b: int, steps: int):
  """The gemv's pattern: block_n weight rows, trips of block_b rows of ``inner`` bytes (packed viewed [N, K/2 /
  inner, inner]) and their scales (bytes [N, K/16])."""
  pid = pl.program_id(0)
  rows = pl.ds(pid * block_n, block_n)
  scales_per_trip = block_b * inner // 8

  def trip(i, accs):
    acc_p, acc_s = accs
    p = packed_ref[rows, pl.ds(pl.multiple_of(i * block_b, block_b), block_b), :]
    s = scale_ref[rows, pl.ds(pl.multiple_of(i * scales_per_trip, scales_per_trip), scales_per_trip)]
    return acc_p + p.astype(jnp.int32), acc_s + s.astype(jnp.int32)

  zeros = (jnp.zeros((block_n, block_b, inner), jnp.int32), jnp.zeros((block_n, scales_per_trip), jnp.int32))
  acc_p, acc_s = jax.lax.fori_loop(0, steps, trip, zeros)
  o_ref[pid] = jnp.sum(acc_p) + jnp.sum(acc_s) + salt_ref[0]


def _rows_probe(salt_ref, packed_ref, scale_ref, o_ref, *, block_n: int, rows_per_trip: int, width: int,
                scale_width: int):
  """Whole rows, contiguous: block_n weight rows in trips of rows_per_trip rows of all K/2 bytes (padded to a
  power of two and masked), as a row-per-warp gemv reads them."""
  k_half, kb = packed_ref.shape[1], scale_ref.shape[1]
  cols, scols = jnp.arange(width), jnp.arange(scale_width)
  pid = pl.program_id(0)  # read here: interpret mode does not resolve program ids inside the loop

  def trip(i, accs):
    acc_p, acc_s = accs
    rows = pl.ds(pid * block_n + i * rows_per_trip, rows_per_trip)
    p = plgpu.load(packed_ref.at[rows, pl.ds(0, width)], mask=(cols < k_half)[None], other=0)
    s = plgpu.load(scale_ref.at[rows, pl.ds(0, scale_width)], mask=(scols < kb)[None], other=0)
    return acc_p + p.astype(jnp.int32), acc_s + s.astype(jnp.int32)

  zeros = (jnp.zeros((rows_per_trip, width), jnp.int32), jnp.zeros((rows_per_trip, scale_width), jnp.int32))
  acc_p, acc_s = jax.lax.fori_loop(0, block_n // rows_per_trip, trip, zeros)
  o_ref[pid] = jnp.sum(acc_p) + jnp.sum(acc_s) + salt_ref[0]


def probe(name: str, packed_NxKh, scale_bytes_NxKb, salt, *, interpret: bool, num_warps: int = 4, **kw):
  """One load-only probe over one weight; returns int32 [programs] (so nothing is dead code)."""
  n, k_half = packed_NxKh.shape
  if kw["kind"] == "tile":
    block_n, inner, block_k = kw["block_n"], kw["inner"], kw["block_k"]
    kernel = functools.partial(_tile_probe, block_n=block_n, inner=inner, block_b=block_k // 2 // inner,
                               steps=k_half * 2 // block_k)
    operand = packed_NxKh.reshape(n, k_half // inner, inner)
  else:
    block_n, rpt = kw["block_n"], kw["rows_per_trip"]
    kernel = functools.partial(_rows_probe, block_n=block_n, rows_per_trip=rpt,
                               width=pl.next_power_of_2(k_half), scale_width=pl.next_power_of_2(k_half // 8))
    operand = packed_NxKh
  programs = n // block_n
  return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((programs,), jnp.int32), grid=(programs,),
                        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
                        interpret=interpret, name=f"probe_{name}")(salt, operand, scale_bytes_NxKb)


PROBES = {  # name: probe arguments
    "tile16x256": dict(kind="tile", block_n=16, inner=8, block_k=256),  # the shipped gemv's loads
    "tile16x256_16B": dict(kind="tile", block_n=16, inner=16, block_k=256),  # 16 contiguous bytes per thread
    "tile16x512": dict(kind="tile", block_n=16, inner=8, block_k=512),
    "tile32x256_8w": dict(kind="tile", block_n=32, inner=8, block_k=256, num_warps=8),
    "rows16x2": dict(kind="rows", block_n=16, rows_per_trip=2),
    "rows16x4": dict(kind="rows", block_n=16, rows_per_trip=4),
}


# What each op reads from a weight copy.
_KEYS = {"xla_sum": ("packed", "scale_u8"), "bf16_dot": ("bf16",), "gemv": ("q",)}


def _probes(k: int) -> dict:
  """The probes for K: whole-row ones only up to 4096 (their per-thread tiles grow with K)."""
  return {name: kw for name, kw in PROBES.items() if kw["kind"] == "tile" or k <= 4096}


def _ops(k: int, interpret: bool):
  """{name: fn(weight arrays, salt int32 [1], x [1, K]) -> anything} for every probe and peer."""
  from qerl_kernels import nvfp4_matmul  # pylint: disable=import-outside-toplevel

  ops = {name: lambda w, salt, x, name=name, kw=kw: probe(name, w["packed"], w["scale_u8"], salt,
                                                          interpret=interpret, **kw)
         for name, kw in _probes(k).items()}
  ops["xla_sum"] = lambda w, salt, x: (jnp.sum(w["packed"], dtype=jnp.int32)
                                       + jnp.sum(w["scale_u8"], dtype=jnp.int32) + salt[0])
  ops["bf16_dot"] = lambda w, salt, x: x @ w["bf16"]
  ops["gemv"] = lambda w, salt, x: nvfp4_matmul(x, w["q"], interpret=interpret)
  return ops


def _weights(k: int, n: int, copies: int) -> list[dict]:
  """copies of {"q": the NVFP4 weight, "packed", "scale_u8": its bytes, "bf16": the bf16 weight [K, N]}."""
  from qerl_jax.quant import quantize  # pylint: disable=import-outside-toplevel
  out = []
  for c in range(copies):
    w_KxN = jax.random.normal(jax.random.key(c), (k, n), jnp.bfloat16)
    q = quantize(w_KxN, "nvfp4")
    out.append({"q": q, "packed": q.packed_NxKh, "scale_u8": jax.lax.bitcast_convert_type(q.scale_NxKb, jnp.uint8),
                "bf16": w_KxN})
  return out


def check_probes(w: dict, interpret: bool) -> None:
  """Every probe read every byte: its programs' sums add up to the sum of all code and scale bytes."""
  want = int(jnp.sum(w["packed"], dtype=jnp.int32) + jnp.sum(w["scale_u8"], dtype=jnp.int32))
  for name, kw in _probes(2 * w["packed"].shape[1]).items():
    got = int(jnp.sum(probe(name, w["packed"], w["scale_u8"], jnp.zeros((1,), jnp.int32), interpret=interpret,
                            **kw)))
    if got != want:
      raise AssertionError(f"probe {name} summed {got}, the bytes sum to {want}: it skipped or re-read some")


def time_ops(shape: str, copies: int, passes: int, interpret: bool) -> dict[str, float]:
  """{op: device us per call}, each op's program traced on its own (HLO module ``jit_probe_<op>``)."""
  k, n = SHAPES[shape]
  ws = _weights(k, n, copies)
  check_probes(ws[0], interpret)
  x = jax.random.normal(jax.random.key(99), (1, k), jnp.bfloat16)
  programs = {}
  for name, op in _ops(k, interpret).items():
    arrays = [{key: w[key] for key in _KEYS.get(name, ("packed", "scale_u8"))} for w in ws]

    def loop(arrays, x, zero, op=op):
      def body(i, carry):
        del carry
        salt = (i * zero)[None]  # a runtime zero: keeps each call inside the loop
        xi = x + (i * zero).astype(x.dtype)
        return tuple(op(a, salt, xi) for a in arrays)
      init = tuple(jnp.zeros(s.shape, s.dtype) for s in jax.eval_shape(body, 0, None))
      return jax.lax.fori_loop(0, passes, body, init)

    fn = lambda *a, loop=loop: loop(*a)  # noqa: E731
    fn.__name__ = fn.__qualname__ = f"probe_{name}"
    try:  # one probe that the GPU's compiler refuses should not cost the others' device time
      compiled = jax.jit(fn).lower(arrays, x, jnp.int32(0)).compile()
      jax.block_until_ready(compiled(arrays, x, jnp.int32(0)))
    except Exception as e:  # pylint: disable=broad-except
      print(f"{shape} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    programs[name] = (compiled, arrays)
  with tempfile.TemporaryDirectory() as trace_dir:
    with quiet_trace(trace_dir):
      for compiled, arrays in programs.values():
        jax.block_until_ready(compiled(arrays, x, jnp.int32(0)))
    per_module = module_kernel_us(trace_dir)
  return {name: per_module.get(f"jit_probe_{name}", float("nan")) / (passes * copies) for name in programs}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", nargs="+", default=["qwen2.5-7b.gate", "qwen2.5-7b.down"], choices=SHAPES)
  parser.add_argument("--copies", type=int, default=6, help="weight copies rotated (6 x 38 MB: past the 50 MB L2)")
  parser.add_argument("--passes", type=int, default=20)
  parser.add_argument("--reps", type=int, default=3, help="traced runs per shape; the median is kept")
  parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a CPU smoke run)")
  parser.add_argument("--out", help="JSON file for the records")
  args = parser.parse_args(argv)
  commit, device = provenance.commit(), jax.devices()[0].device_kind
  records = []
  for shape in args.shapes:
    k, n = SHAPES[shape]
    mb = (n * k // 2 + n * k // 16) / 1e6
    runs = [time_ops(shape, args.copies, args.passes, args.interpret) for _ in range(args.reps)]
    for name in runs[0]:
      us = statistics.median(r[name] for r in runs)
      read_mb = n * k * 2 / 1e6 if name == "bf16_dot" else mb
      records.append(dict(shape=shape, op=name, device_us=round(us, 2), mb=round(read_mb, 1),
                          tbps=round(read_mb / us, 3), commit=commit, device=device))
  print(f"{'shape':18} {'op':16} {'device us':>10} {'MB':>7} {'TB/s':>6}")
  for r in records:
    print(f"{r['shape']:18} {r['op']:16} {r['device_us']:10.2f} {r['mb']:7.1f} {r['tbps']:6.3f}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(records, f, indent=1)
  return records


if __name__ == "__main__":
  main()
