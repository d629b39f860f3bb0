"""GPU check of the tile kernels' inline-PTX decoder ("asm") against the jnp one ("halves") on the same config.

    python experiments/check_tile_decoders.py --out $OUT/tile_decoder_check.json
    python experiments/check_tile_decoders.py --interpret --out /tmp/check.json   # CPU smoke run, small shape

Both decode every weight exactly (E2M1 * scale, up to a power of two that the float32 accumulator's multiplier
takes back), so the outputs must be bit-equal, forward (8 and 64 rows) and backward (256 rows) at Qwen2.5-7B's
shapes with the tuned configs (the forward also with x split in registers, ``x_in_place``). It also records
each output's relative error against a float32 product with the dequantized weight. Interpret mode runs
"halves" for both (the PTX needs a GPU), so it checks only the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.provenance import commit, kernel_tuning  # noqa: E402
from qerl_kernels import config as config_lib  # noqa: E402
from qerl_kernels.nvfp4_matmul_bwd import nvfp4_matmul_bwd_pallas  # noqa: E402
from qerl_kernels.nvfp4_matmul_fwd import nvfp4_matmul_fwd_pallas  # noqa: E402
from qerl_jax.quant import dequantize, quantize  # noqa: E402

SHAPES_7B = {"qkv": (3584, 4608), "o": (3584, 3584), "gate_up": (3584, 37888), "down": (18944, 3584)}
CASES = (("fwd", 8), ("fwd", 64), ("bwd", 256))


def check(name: str, k: int, n: int, interpret: bool) -> dict:
  q = quantize(jax.random.normal(jax.random.key(k + n), (k, n), jnp.bfloat16) * 0.02, "nvfp4")
  w_KxN = dequantize(q, jnp.float32)
  out = {}
  for direction, rows in CASES:
    cfg = config_lib.fit(dataclasses.replace(config_lib.get_config(direction, rows, k, n, "NVIDIA H200"),
                                             engine="tensorcore", dequant="asm"),
                         direction, rows, k, n, num_sms=132, auto_split=True)
    a = jax.random.normal(jax.random.key(rows), (rows, k if direction == "fwd" else n), jnp.bfloat16)
    kernel = nvfp4_matmul_fwd_pallas if direction == "fwd" else nvfp4_matmul_bwd_pallas
    got = {}
    # The forward also with x split in registers (x_in_place) instead of XLA's reordered copy.
    variants = (("asm", False), ("halves", False)) + ((("asm", True),) if direction == "fwd" else ())
    for dequant, in_place in variants:
      c = dataclasses.replace(cfg, dequant=dequant, x_in_place=in_place)
      op = jax.jit(lambda a, c=c: kernel(a, q.packed_NxKh, q.scale_NxKb, q.global_scale, config=c,
                                         interpret=interpret, poison=True))
      got[dequant + ("_x_in_place" if in_place else "")] = np.asarray(op(a).astype(jnp.float32))
    ref = np.asarray(a.astype(jnp.float32) @ (w_KxN if direction == "fwd" else w_KxN.T))
    out[f"{name} {direction} {rows}"] = dict(
        config=dataclasses.asdict(cfg), bit_equal=all(np.array_equal(v, got["halves"]) for v in got.values()),
        max_abs_diff=max(float(np.nanmax(np.abs(v - got["halves"]))) for v in got.values()),
        rel_err_vs_f32=float(np.linalg.norm(got["asm"] - ref) / np.linalg.norm(ref)))
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--interpret", action="store_true", help="Pallas interpret mode on a small shape (CPU)")
  p.add_argument("--out", required=True)
  args = p.parse_args(argv)
  shapes = {"small": (512, 256)} if args.interpret else SHAPES_7B
  cases = {}
  for name, (k, n) in shapes.items():
    cases.update(check(name, k, n, args.interpret))
  for key, v in cases.items():
    print(f"{key:20s} bit_equal={v['bit_equal']} max_abs_diff={v['max_abs_diff']:.3g} "
          f"rel_err_vs_f32={v['rel_err_vs_f32']:.3g}")
  ok = all(v["bit_equal"] for v in cases.values())
  with open(args.out, "w") as f:
    json.dump(dict(commit=commit(), device=jax.devices()[0].device_kind, jax=jax.__version__,
                   kernel_tuning=kernel_tuning(), all_bit_equal=ok, cases=cases),
              f, indent=1)
  print("all bit-equal" if ok else "MISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
