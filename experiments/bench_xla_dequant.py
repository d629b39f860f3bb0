"""How fast is the NVFP4 XLA path's dequantization, and is its table lookup or its transpose what costs? (one GPU)

From `xla_min_rows` on (1024 rows; 2048 when this was written), and so in the whole log-prob pass and update, an
NVFP4 matmul dequantizes one layer to bf16 and calls XLA's dot (`qerl_kernels.nvfp4_matmul.xla_path_matmul`). At
d36bfd6 that cost 354 us over the bf16 dot at 7B gate|up and 8192 rows on an H200, four times the ~87 us that
writing 271 MB of bf16 and reading 76 MB of codes and scales takes at ~4 TB/s. Two suspects in the jaxpr: the E2M1
decode is a gather from an 8-entry table, and the [N, K] result is transposed to [K, N] before the dot. This times,
on the 7B training shapes:

  "table" / "arith": the decode as a gather from the 8-value table (`table_decode`, shipped until this bench
    came), or as integer ops that build each value's float32 bits (`qerl_jax.quant.e2m1.e2m1_decode` since);
  "words": the integer decode with each packed byte's two values formed as one uint32 word (no interleave;
    `nvfp4.dequantize_NxK(words=True)`), and "pallas": the same words in one Pallas launch
    (`qerl_kernels.nvfp4_dequant`);
  "kn" / "nk": the dot over the transposed [K, N] weight (`jnp.matmul`, shipped until then) or over [N, K];

each form's dequantization alone, and the bf16 dot over an already-bf16 weight as the floor. Every form is
checked first: its dequantized weight bit for bit against the shipped one, its product against float64 on sampled
rows within one bf16 rounding of a float32 sum (`bench_dot_forms.check_error`).

    python -m experiments.bench_xla_dequant --out experiments/results/xla_dequant.jsonl
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_dot_forms import SHAPES, check_error, hlo_launches, training_shapes_cli
from experiments.bench_train_attention import timed
from experiments.provenance import append_records, commit
from qerl_jax import quant
from qerl_jax.quant import e2m1, nvfp4
from qerl_kernels import config as config_lib, nvfp4_dequant


def table_decode(codes: jax.Array) -> jax.Array:
  """float32 value of each E2M1 code by a gather from the 8 magnitudes, then the sign."""
  mag = jnp.asarray(e2m1.E2M1_VALUES, jnp.float32)[(codes & 7).astype(jnp.int32)]
  return jnp.where((codes & 8) != 0, -mag, mag)


# The dequantization's forms: its decode, and (words) each packed byte's two values formed as one uint32 word.
DECODES = {"table": {"decode": table_decode}, "arith": {}, "words": {"words": True}}
LAYOUTS = {"kn": lambda x, w_NxK: jnp.matmul(x, w_NxK.T), "nk": lambda x, w_NxK: jnp.einsum("mk,nk->mn", x, w_NxK)}


def launch_fields(f, *args) -> dict:
  """launches / fused_gemm of the jitted f's compiled program: whether the dequantization is a kernel of its own or
  XLA took it into a Triton GEMM (at 16-2048 rows it did not, RESULTS "Where the XLA path stands")."""
  launches, fused = hlo_launches(f.lower(*args).compile().as_text())
  return {"launches": launches, "fused_gemm": fused}


def forms(base: dict, q) -> dict:
  """{name: (q -> bf16 [N, K] weight, the dot layouts to time it under)}: DECODES with both layouts, and where its
  blocks tile the shape the Pallas dequantization (`qerl_kernels.nvfp4_dequant`, opt-in as "xla_dequant": "pallas";
  interpret mode on a CPU) under the shipped [N, K] dot, its launch fields recorded."""
  out = {name: (lambda q, kw=kw: nvfp4.dequantize_NxK(q, **kw), tuple(LAYOUTS), {}) for name, kw in DECODES.items()}
  interpret = jax.devices()[0].platform == "cpu"
  launch = config_lib.decode_launch("dequant", interpret)
  if interpret:  # the smoke test's tiny shape: the largest power-of-two blocks that tile it
    launch = dict(launch, block_n=math.gcd(launch["block_n"], base["n"]),
                  block_b=math.gcd(launch["block_b"], base["k"] // 16))
  if nvfp4_dequant.supports(q, jnp.bfloat16, launch["block_n"], launch["block_b"]):
    blocks = dict(block_n=launch["block_n"], block_b=launch["block_b"], interpret=interpret)
    out["pallas"] = (lambda q: nvfp4_dequant.dequantize_NxK(q, jnp.bfloat16, **blocks), ("nk",), {"launch": launch})
  return out


def time_form(base: dict, name: str, dequant, layouts, extra: dict, x, q, shipped, w_bf16, bf16_us, reps) -> list:
  """One form's records: its dequantization alone (checked bit for bit against the shipped weight first), then
  under each dot layout (checked within one bf16 rounding of float64 first)."""
  moved = q.packed_NxKh.size + q.scale_NxKb.size + 2 * shipped.size  # bytes: codes, scales in; bf16 out
  deq = jax.jit(dequant)
  if not np.array_equal(np.asarray(deq(q)).view(np.uint16), np.asarray(shipped).view(np.uint16)):
    raise SystemExit(f"{base['shape']}: the {name} form's weight differs from the shipped dequantization")
  deq_us = timed(deq, (q,), reps)
  records = [dict(base, form=f"{name}_dequant_only", us=round(deq_us, 1), gb_per_s=round(moved / deq_us / 1e3, 1),
                  **launch_fields(deq, q), **extra)]
  for lname in layouts:
    f = jax.jit(lambda x, q, dot=LAYOUTS[lname]: dot(x, dequant(q)))
    err = check_error(f(x, q), x, w_bf16)
    if err > 1.01:
      raise SystemExit(f"{base['shape']}: {name}_{lname} is {err:.2f} bf16 roundings from float64")
    us = timed(f, (x, q), reps)
    records.append(dict(base, form=f"{name}_{lname}", us=round(us, 1), over_bf16_us=round(us - bf16_us, 1),
                        err_roundings=round(err, 3), **launch_fields(f, x, q)))
  return records


def main(argv=None) -> list[dict]:
  args, shapes, key = training_shapes_cli(__doc__, "experiments/results/xla_dequant.jsonl", argv)
  device = jax.devices()[0].device_kind
  records = []
  for name, (k, n) in shapes.items():
    kx, kw = jax.random.split(jax.random.fold_in(key, k * n))
    x = jax.random.normal(kx, (args.rows, k), jnp.float32).astype(jnp.bfloat16)
    q = quant.quantize(0.02 * jax.random.normal(kw, (k, n), jnp.float32), "nvfp4")
    shipped = jax.jit(lambda q: nvfp4.dequantize_NxK(q, jnp.bfloat16))(q)
    w_bf16 = jnp.asarray(shipped.T)
    base = dict(shape=f"qwen2.5-7b.{name}" if name in SHAPES else name, rows=args.rows, k=k, n=n, commit=commit(),
                device=device)
    bf16_us = timed(jax.jit(jnp.matmul), (x, w_bf16), args.reps)
    shape_records = [dict(base, form="bf16_weight", us=round(bf16_us, 1))]
    for form, (dequant, layouts, extra) in forms(base, q).items():
      shape_records += time_form(base, form, dequant, layouts, extra, x, q, shipped, w_bf16, bf16_us, args.reps)
    for r in shape_records:
      print(json.dumps(r), flush=True)
    records += shape_records
  if not args.smoke:
    append_records(args.out, records)
  print(f"\n{'shape':<22}{'form':<22}{'us':>10}{'over bf16':>11}{'GB/s':>8}")
  for r in records:
    print(f"{r['shape']:<22}{r['form']:<22}{r['us']:>10.1f}{r.get('over_bf16_us', ''):>11}{r.get('gb_per_s', ''):>8}")
  return records


if __name__ == "__main__":
  main()
