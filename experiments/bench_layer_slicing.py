"""Does a scan over stacked layer weights cost a copy of each layer's slice? (decode-sized matmuls, one GPU)

The model keeps each weight kind stacked over layers ([L, K, N]) and runs the layers as a `lax.scan`, which
slices one layer per iteration. If XLA materializes that slice before the matmul, a decode step streams
each weight three times (read, write the copy, read it) instead of once. This benchmark times one pass
over L layers of the Qwen2.5-7B MLP shape (x[B, 3584] @ up[3584, 18944] -> tanh -> @ down[18944, 3584])
in the two forms, for bf16 weights (XLA dot) and NVFP4 (the fused kernel):
  scan: `lax.scan` over the stacked weights, the model's form;
  list: a Python loop over L separately stored weights, where nothing is sliced;
  in_place (NVFP4): the scan passes the layer index and the kernels read that layer of the stack in place.
It prints microseconds per pass, the weight-streaming floor, and how many dynamic-slice and copy
instructions the optimized HLO holds; XLA_FLAGS (e.g. --xla_gpu_enable_dynamic_slice_fusion=true) apply.

    python -m experiments.bench_layer_slicing --out experiments/results/layer_slicing.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_rollout import copy_bandwidth
from experiments.provenance import append_records, commit
from qerl_jax import quant


def _weights(key, num_layers, k, n, fmt):
  """[L, K, N] bf16 or the stacked NVFP4 tensor of it (values ~0.02 like a trained model's)."""
  w = (0.02 * jax.random.normal(key, (num_layers, k, n), jnp.float32)).astype(jnp.bfloat16)
  if fmt == "bf16":
    return w
  return jax.jit(jax.vmap(lambda w: quant.quantize(w, "nvfp4")))(w)


def _matmul(x, w):
  if isinstance(w, quant.types.NVFP4Tensor):
    from qerl_kernels import nvfp4_matmul  # pylint: disable=import-outside-toplevel
    return nvfp4_matmul(x, w)
  return jnp.dot(x, w)


def _layer(x, up, down):
  return jnp.tanh(_matmul(jnp.tanh(_matmul(x, up)), down))


def _scan_pass(x, ups, downs):
  def body(x, ws):
    return _layer(x, *ws), None
  return jax.lax.scan(body, x, (ups, downs))[0]


def _in_place_pass(x, ups, downs):
  """NVFP4 only: the scan carries the layer index and the kernels read that layer of the stack in place."""
  from qerl_kernels import nvfp4_matmul  # pylint: disable=import-outside-toplevel

  def body(x, layer):
    h = jnp.tanh(nvfp4_matmul(x, ups, layer=layer))
    return jnp.tanh(nvfp4_matmul(h, downs, layer=layer)), None
  return jax.lax.scan(body, x, jnp.arange(ups.packed_NxKh.shape[0], dtype=jnp.int32))[0]


def _list_pass(x, ups, downs):
  for up, down in zip(ups, downs):
    x = _layer(x, up, down)
  return x


def _split(stacked, num_layers):
  return [jax.tree.map(lambda a: a[i], stacked) for i in range(num_layers)]


def _time(fn, x, ups, downs, passes, reps=5):
  """Median seconds of one pass: `passes` passes inside one jitted loop, so no host work between them."""
  @jax.jit
  def run(x, ups, downs):
    return jax.lax.fori_loop(0, passes, lambda i, x: fn(x, ups, downs), x)
  compiled = run.lower(x, ups, downs).compile()
  text = compiled.as_text()
  counts = {"dynamic_slice": len(re.findall(r"= \S+ dynamic-slice\(", text)),
            "copy": len(re.findall(r"= \S+ copy\(", text)),
            "fusions": len(re.findall(r"= \S+ fusion\(", text))}
  jax.block_until_ready(compiled(x, ups, downs))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(x, ups, downs))
    times.append(time.perf_counter() - t0)
  return float(np.median(times)) / passes, counts


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--layers", type=int, default=28)
  p.add_argument("--k", type=int, default=3584)
  p.add_argument("--n", type=int, default=18944)
  p.add_argument("--rows", default="1,8")
  p.add_argument("--formats", default="bf16,nvfp4")
  p.add_argument("--passes", type=int, default=20)
  p.add_argument("--out", default="experiments/results/layer_slicing.jsonl")
  args = p.parse_args(argv)
  device = jax.devices()[0].device_kind
  bw = copy_bandwidth(2.0)
  flags = os.environ.get("XLA_FLAGS", "")
  print(f"device={device} copy_bandwidth={bw / 1e12:.3f} TB/s XLA_FLAGS={flags!r}", flush=True)
  key = jax.random.key(0)
  rows_out = []
  for fmt in args.formats.split(","):
    ups = _weights(jax.random.fold_in(key, 1), args.layers, args.k, args.n, fmt)
    downs = _weights(jax.random.fold_in(key, 2), args.layers, args.n, args.k, fmt)
    nbytes = sum(a.nbytes for a in jax.tree.leaves((ups, downs)))
    for rows in map(int, args.rows.split(",")):
      x = jax.random.normal(key, (rows, args.k), jnp.float32).astype(jnp.bfloat16)
      for form in ("scan", "list") + (("in_place",) if fmt == "nvfp4" else ()):
        if form == "scan":
          s, counts = _time(_scan_pass, x, ups, downs, args.passes)
        elif form == "in_place":
          s, counts = _time(_in_place_pass, x, ups, downs, args.passes)
        else:
          u_list, d_list = _split(ups, args.layers), _split(downs, args.layers)
          s, counts = _time(_list_pass, x, u_list, d_list, args.passes)
          del u_list, d_list
        rec = dict(format=fmt, rows=rows, form=form, layers=args.layers, k=args.k, n=args.n,
                   us_per_pass=round(s * 1e6, 1), floor_us=round(nbytes / bw * 1e6, 1),
                   floor_frac=round(nbytes / bw / s, 3), hlo=counts, xla_flags=flags, commit=commit(),
                   device=device)
        print(json.dumps(rec), flush=True)
        rows_out.append(rec)
    del ups, downs
  append_records(args.out, rows_out)
  print(f"\n{'format':<7}{'rows':>5}  {'form':<9}{'us/pass':>10}{'floor us':>10}{'floor %':>9}  hlo")
  for r in rows_out:
    print(f"{r['format']:<7}{r['rows']:>5}  {r['form']:<9}{r['us_per_pass']:>10.1f}{r['floor_us']:>10.1f}"
          f"{100 * r['floor_frac']:>8.0f}%  {r['hlo']}")
  return rows_out


if __name__ == "__main__":
  main()
