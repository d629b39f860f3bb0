"""Training-shape attention: the model's XLA `attend` against `jax.nn.dot_product_attention` (cuDNN's fused one).

    python experiments/bench_train_attention.py --out $OUT/attn.json

The log-prob pass and the GRPO update run full-sequence attention over every micro-batch (7B: 8 rows of 256 prompt
+ 1024 completion slots, 28 layers; the update runs it forward twice under remat and backward once). The model's
`attention.attend` forms float32 scores [B, Hkv, G, T, S] in memory; a fused kernel keeps them on chip. This
script asks whether that matters at the shapes the GRPO step uses, before the model is given a choice.

For each shape it first checks every implementation against `attend` on float32 inputs, on the query rows that
see something (left-padded prompts: padded query rows are garbage by design and dropped by the loss), forward
and the gradients of a random cotangent; then it times forward and
forward + backward (medians of `--reps` host-timed calls with `block_until_ready`). It prints a table and
writes the records to `--out` (and appends them to experiments/results/train_attention.jsonl with `--record`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments.provenance import append_records, commit as git_commit
from qerl_jax.model import attention as attn

SHAPES = {  # name: (query heads, kv heads, head dim)
  "qwen2.5-7b": (28, 4, 128),
  "qwen2.5-32b": (40, 8, 128),
}


def inputs(rng: np.random.Generator, b: int, s: int, h: int, kvh: int, dh: int, max_pad: int):
  """bf16 q [B, S, H, Dh], k and v [B, S, Hkv, Dh], the causal mask with left padding [B, S, S], and the
  rows that see something [B, S]."""
  q, k, v = (jnp.asarray(rng.standard_normal((b, s, n, dh)), jnp.bfloat16) for n in (h, kvh, kvh))
  pads = rng.integers(0, max_pad + 1, size=b)
  valid_BxS = jnp.asarray(np.arange(s)[None, :] >= pads[:, None])
  mask = attn.attention_mask(jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)), s, valid_BxS)
  return q, k, v, mask, valid_BxS


def implementations(query_chunk: int):
  """name -> f(q, k, v, mask) -> [B, T, H * Dh]."""
  def model(q, k, v, mask):
    return attn.attend(q, k, v, mask, query_chunk)

  def fused(impl, causal):
    return lambda q, k, v, mask: attn.fused_attend(q, k, v, mask, impl, causal)

  # "cudnn-causal" is what the model runs (ModelConfig.train_attention "cudnn", or "auto" on a GPU): the mask and the
  # causal type.
  return {"model": model, "jax-xla": fused("xla", False), "cudnn": fused("cudnn", False),
          "cudnn-causal": fused("cudnn", True)}


def check(fn, q, k, v, mask, valid_BxS, cot) -> dict:
  """Largest error of fn's output and q/k/v gradients on the valid query rows, relative to the largest
  reference value, against `attend` in float32."""
  rows = valid_BxS[:, :, None]

  def loss(f, q, k, v):
    return jnp.sum(jnp.where(rows, f(q, k, v, mask).astype(jnp.float32) * cot, 0.0))

  def ref_fn(q, k, v, mask):
    return attn.attend(q, k, v, mask, 0)

  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  ref_out = ref_fn(*f32, mask)
  ref_grads = jax.grad(lambda *a: loss(ref_fn, *a), argnums=(0, 1, 2))(*f32)
  out = jax.jit(fn)(q, k, v, mask).astype(jnp.float32)
  grads = jax.jit(jax.grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2)))(q, k, v)

  def rel(a, b, where=True):  # both the error and the scale over the rows that see something
    d = jnp.where(where, jnp.abs(a.astype(jnp.float32) - b), 0.0)
    return float(jnp.max(d) / jnp.max(jnp.where(where, jnp.abs(b), 0.0)))

  return {"out": rel(out, ref_out, rows), "dq": rel(grads[0], ref_grads[0], valid_BxS[:, :, None, None]),
          "dk": rel(grads[1], ref_grads[1]), "dv": rel(grads[2], ref_grads[2])}


def timed(f, args, reps: int) -> float:
  """Median microseconds of one call (compiled first)."""
  jax.block_until_ready(f(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append((time.perf_counter() - t0) * 1e6)
  return statistics.median(times)


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", nargs="+", default=["qwen2.5-7b"], choices=sorted(SHAPES))
  p.add_argument("--rows", type=int, default=8, help="rows per call (the update's micro-batch)")
  p.add_argument("--seq", type=int, default=1280, help="slots (prompt + completion)")
  p.add_argument("--max-pad", type=int, default=200, help="left padding of up to this many slots per row")
  p.add_argument("--query-chunk", type=int, default=1024, help="the model's attn_query_chunk")
  p.add_argument("--impls", nargs="+", default=["model", "jax-xla", "cudnn", "cudnn-causal"])
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--check-rows", type=int, default=2, help="rows of the float32 check (it holds [B, H, S, S])")
  p.add_argument("--out", default=None)
  p.add_argument("--record", action="store_true", help="append to experiments/results/train_attention.jsonl")
  args = p.parse_args(argv)
  rng = np.random.default_rng(0)
  fns = implementations(args.query_chunk)
  device = jax.devices()[0].device_kind
  records = []
  for model in args.models:
    h, kvh, dh = SHAPES[model]
    small = inputs(rng, args.check_rows, args.seq, h, kvh, dh, args.max_pad)
    cot = jnp.asarray(rng.standard_normal((args.check_rows, args.seq, h * dh)), jnp.float32)
    q, k, v, mask, _ = inputs(rng, args.rows, args.seq, h, kvh, dh, args.max_pad)
    for name in args.impls:
      fn = fns[name]
      rec = {"model": model, "impl": name, "rows": args.rows, "seq": args.seq, "device": device,
             "commit": git_commit(), "jax": jax.__version__}
      try:
        rec["error"] = check(fn, *small, cot)
      except Exception as e:  # pylint: disable=broad-except  # e.g. cuDNN absent on CPU: recorded, not timed
        rec["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
        records.append(rec)
        print(f"{model:12s} {name:8s} failed: {rec['failed']}", flush=True)
        continue
      fwd = jax.jit(fn)
      grad = jax.jit(jax.grad(lambda q, k, v, f=fn: jnp.sum(f(q, k, v, mask).astype(jnp.float32)),
                              argnums=(0, 1, 2)))
      rec["fwd_us"] = timed(lambda q, k, v: fwd(q, k, v, mask), (q, k, v), args.reps)
      rec["fwd_bwd_us"] = timed(grad, (q, k, v), args.reps)
      records.append(rec)
      print(f"{model:12s} {name:8s} fwd {rec['fwd_us']:9.1f} us  fwd+bwd {rec['fwd_bwd_us']:9.1f} us  "
            f"error {json.dumps({k: float(f'{v:.2e}') for k, v in rec['error'].items()})}", flush=True)
  print(f"\n{'model':12s} {'impl':8s} {'fwd us':>9s} {'fwd+bwd us':>11s}   rows={args.rows} seq={args.seq} {device}")
  for r in records:
    if "fwd_us" in r:
      print(f"{r['model']:12s} {r['impl']:8s} {r['fwd_us']:9.1f} {r['fwd_bwd_us']:11.1f}")
  if args.out:
    Path(args.out).write_text(json.dumps(records, indent=1))
  if args.record:
    append_records(str(Path(__file__).parent / "results" / "train_attention.jsonl"), records)
  return records


if __name__ == "__main__":
  main()
