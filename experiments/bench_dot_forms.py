"""Does a bf16 dot that asks for a float32 result and is cast afterwards cost more than a bf16 dot? (one GPU)

Until 5ea2f34 the bf16 base matmul (`qerl_jax.model.linear.base_matmul` on a dense weight) was
`jnp.einsum(..., preferred_element_type=float32).astype(bf16)`; the NVFP4 path's XLA dot, over its dequantized
weight, is a plain bf16 `jnp.matmul`. Both sum in float32 and round once. If XLA's GPU pipeline does not fold the
cast into the GEMM, the first form writes a float32 result and reads it back: 4 more bytes per output element.
This times both forms on the 7B training shapes (rows = micro-batch 8 x 1280 positions), forward and
forward + input gradient (the update's backward for a frozen weight: for "f32_then_cast" JAX's own transpose,
a float32 dot, which the model's custom VJP replaced by a 16-bit one at 0554259), after checking each against float64
NumPy on a row sample, and counts the entry computation's kernels in the optimized HLO.

    python -m experiments.bench_dot_forms --out experiments/results/dot_forms.jsonl
"""

from __future__ import annotations

import argparse
import json
import re

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_train_attention import timed
from experiments.provenance import append_records, commit

SHAPES = {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)}
FORMS = {
  "f32_then_cast": lambda x, w: jnp.einsum("mk,kn->mn", x, w, preferred_element_type=jnp.float32).astype(x.dtype),
  "bf16_dot": jnp.matmul,
}


def _programs(form):
  """(forward, forward + input gradient) of one dot form, jitted; the weight is frozen as the model's base is."""
  f = FORMS[form]

  def fwd_bwd(x, w, dy):
    y, vjp = jax.vjp(lambda x: f(x, w), x)
    return y, vjp(dy)[0]
  return jax.jit(f), jax.jit(fwd_bwd)


def _kernels(text: str) -> int:
  """Fusions and custom calls (cuBLAS GEMMs among them) in the optimized HLO's entry computation: the launches one
  call makes. A cuBLAS GEMM's result is a tuple (output, workspace), so a result type may be parenthesized."""
  entry = text[text.index("ENTRY"):]
  entry = entry[:entry.index("\n}")]
  return len(re.findall(r"= (?:\([^()]*\)|\S+) (?:fusion|custom-call)\(", entry))


def hlo_launches(text: str) -> tuple[int, bool]:
  """(kernels one call launches, whether XLA emitted a dot as a Triton GEMM fusion, which can take an operand's
  producer such as a dequantization into its tile loop) from an optimized HLO module's text."""
  return _kernels(text), "__triton_gemm" in text


def check_error(y, x, w) -> float:
  """Largest |y - x @ w| over 8 sampled rows, in units of what a float32 sum rounded once to bf16 may be off by:
  2**-8 |x @ w| (the rounding) plus sqrt(K) 2**-24 (|x| @ |w|) (the float32 sum's roundings as a random walk; the
  worst case, K instead of sqrt(K), needs every rounding to err the same way), both from float64. A 16-bit dot that
  sums in float32 reads at most 1; one that keeps its running sum in bf16 reads ~2**15 / sqrt(K) times more.
  (Before 2026-12-07 the second term was 1e-6 of the largest output: long sums over outputs that cancel then read
  as 4-9 "roundings" on the GPU, `results/dot_forms.jsonl` at 8fccad6.)"""
  rows = np.linspace(0, x.shape[0] - 1, 8).astype(int)
  x64, w64 = np.asarray(x[rows], np.float64), np.asarray(w, np.float64)
  ref = x64 @ w64
  bound = np.abs(ref) * 2.0 ** -8 + np.sqrt(x64.shape[-1]) * 2.0 ** -24 * (np.abs(x64) @ np.abs(w64))
  return float((np.abs(np.asarray(y[rows], np.float64) - ref) / bound).max())


def training_shapes_cli(doc: str, out: str, argv=None):
  """(args, {name: (K, N)}, a fresh key) for a bench over the 7B training shapes; --smoke: one tiny shape, 2 reps."""
  p = argparse.ArgumentParser(description=doc.split("\n")[0])
  p.add_argument("--shapes", default=",".join(SHAPES))
  p.add_argument("--rows", type=int, default=10240, help="rows per call (the update's micro-batch x 1280 slots)")
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--out", default=out)
  p.add_argument("--smoke", action="store_true", help="small shapes (CPU): checks the script runs; writes nothing")
  args = p.parse_args(argv)
  shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
  if args.smoke:
    shapes, args.rows, args.reps = {"tiny": (64, 96)}, 40, 2
  return args, shapes, jax.random.key(np.random.SeedSequence().entropy % 2 ** 31)


def main(argv=None):
  args, shapes, key = training_shapes_cli(__doc__, "experiments/results/dot_forms.jsonl", argv)
  device = jax.devices()[0].device_kind
  records = []
  for name, (k, n) in shapes.items():
    kx, kw, kd = jax.random.split(jax.random.fold_in(key, k * n), 3)
    x = jax.random.normal(kx, (args.rows, k), jnp.float32).astype(jnp.bfloat16)
    w = (0.02 * jax.random.normal(kw, (k, n), jnp.float32)).astype(jnp.bfloat16)
    dy = jax.random.normal(kd, (args.rows, n), jnp.float32).astype(jnp.bfloat16)
    for form in FORMS:
      fwd, fwd_bwd = _programs(form)
      y, dx = fwd_bwd(x, w, dy)
      rec = dict(shape=f"qwen2.5-7b.{name}" if name in SHAPES else name, rows=args.rows, k=k, n=n, form=form,
                 err_roundings=round(check_error(y, x, w), 3), dx_err_roundings=round(check_error(dx, dy, w.T), 3),
                 out_dtype=str(y.dtype), dx_dtype=str(dx.dtype),
                 fwd_ms=round(timed(fwd, (x, w), args.reps) / 1e3, 3),
                 fwd_bwd_ms=round(timed(fwd_bwd, (x, w, dy), args.reps) / 1e3, 3),
                 fwd_kernels=_kernels(fwd.lower(x, w).compile().as_text()),
                 fwd_bwd_kernels=_kernels(fwd_bwd.lower(x, w, dy).compile().as_text()), commit=commit(), device=device)
      print(json.dumps(rec), flush=True)
      records.append(rec)
  if not args.smoke:
    append_records(args.out, records)
  print(f"\n{'shape':<22}{'form':<15}{'fwd ms':>9}{'fwd+dx ms':>11}{'kernels':>9}{'roundings':>11}")
  for r in records:
    print(f"{r['shape']:<22}{r['form']:<15}{r['fwd_ms']:>9.3f}{r['fwd_bwd_ms']:>11.3f}"
          f"{r['fwd_kernels']:>5}/{r['fwd_bwd_kernels']:<3}{max(r['err_roundings'], r['dx_err_roundings']):>11.3f}")
  return records


if __name__ == "__main__":
  main()
