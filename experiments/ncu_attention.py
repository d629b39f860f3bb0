"""Launches of the decode-attention kernel alone, at Qwen2.5-7B's heads mid-rollout, for Nsight Compute or timing.

One stack-of-one cache per layer as the unrolled decode loop passes it (28 query heads, 4 kv heads, 128 dims,
1280 slots, `--visible` of them visible), the token's own k and v written by the same launch
(`decode_attention_rows`, as a decode step calls it). Each batch's program runs twice, so the second launch is past
compilation, and its output is checked against the model's float32 attention (the error is printed and returned).
``QERL_KERNEL_TUNING`` picks the launch fields, as in the model.

    ncu --clock-control none --kernel-name regex:decode_attention --launch-skip 2 --launch-count 6 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        python3 experiments/ncu_attention.py --batches 1 8 > $OUT/ncu.txt

(the regex matches the attention and its merge, two launches per run: skipping 2 leaves the first batch's second
run and both of the next batch's; results/ncu_attention_h100_261a53c.txt is that command's record.)

``--time N`` instead times N launches of each batch in one jitted program (no ncu): host-timed medians of us per
call, and the cache bytes read over that time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from qerl_kernels.decode_attention import decode_attention_rows  # noqa: E402
from qerl_kernels.decode_qkv import padded_heads  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, CACHE_LEN = 28, 4, 128, 1280


def inputs(b: int, visible: int, seed: int = 0):
  """(rows, k, v, mask) for `decode_attention_rows` at 7B's heads: slots < visible are visible in every row."""
  rng = np.random.default_rng(seed)
  n_rows = HEADS + 2 * KV_HEADS + padded_heads(HEADS, KV_HEADS)
  rows = jnp.asarray(rng.standard_normal((b, n_rows, HEAD_DIM)), jnp.bfloat16).astype(jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((1, b, CACHE_LEN, KV_HEADS, HEAD_DIM)), jnp.bfloat16) for _ in range(2))
  mask = jnp.asarray(np.arange(CACHE_LEN)[None, :] <= visible).repeat(b, 0)
  return rows, k, v, mask


def reference(rows, k, v, mask, visible: int):
  """The model's attention in float32 after writing this token's k and v at slot ``visible``: [B, H * Dh]."""
  from qerl_jax.model import attention as attn  # pylint: disable=import-outside-toplevel
  q = rows[:, :HEADS]
  k_new, v_new = (rows[:, HEADS + i * KV_HEADS:HEADS + (i + 1) * KV_HEADS].astype(k.dtype) for i in (0, 1))
  k_full, v_full = (c[0].at[:, visible].set(new).astype(jnp.float32) for c, new in ((k, k_new), (v, v_new)))
  return attn.attend(q[:, None], k_full, v_full, mask[:, None, :])[:, 0]  # attend gives [B, T, H * Dh]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
  p.add_argument("--visible", nargs="+", type=int, default=[776],
                 help="the new token's slot (slots before it are read); each is run per batch")
  p.add_argument("--time", type=int, default=0, metavar="N", help="time N launches per batch instead")
  p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a CPU smoke run)")
  args = p.parse_args(argv)

  @jax.jit
  def step(rows, k, v, mask, slot):
    return decode_attention_rows(rows, k, v, 0, slot, mask, heads=HEADS, dtype=jnp.bfloat16,
                                 interpret=args.interpret)

  @jax.jit
  def loop(rows, k, v, mask, slot):  # N launches in one program, unrolled: no loop condition between them
    outs = []
    for _ in range(args.time):
      out, k, v = step(rows, k, v, mask, slot)
      outs.append(out[0, 0])
    return jnp.stack(outs), k, v

  return [run(b, visible, step, loop, args.time) for b in args.batches for visible in args.visible]


def run(b: int, visible: int, step, loop, n: int):
  rows, k, v, mask = inputs(b, visible)
  slot = jnp.int32(visible)
  if not n:
    want = reference(rows, k, v, mask, visible)
    for _ in range(2):
      out, k, v = step(rows, k, v, mask, slot)
      out.block_until_ready()
    err = float(jnp.abs(out.astype(jnp.float32) - want).max() / jnp.abs(want).max())
    print(f"batch {b}, slot {visible}: out {out.shape} {out.dtype}, max error {err:.2e} of the largest output")
    return err
  jax.block_until_ready(loop(rows, k, v, mask, slot))
  walls = []
  for _ in range(7):
    t0 = time.perf_counter()
    jax.block_until_ready(loop(rows, k, v, mask, slot))
    walls.append((time.perf_counter() - t0) / n * 1e6)
  us = float(np.median(walls))
  cache_bytes = 2 * b * visible * KV_HEADS * HEAD_DIM * 2
  print(f"batch {b}, slot {visible}: {us:.2f} us per call (attention and merge), "
        f"{cache_bytes / us / 1e6:.2f} TB/s of cache read")


if __name__ == "__main__":
  main()
