"""A copy of a device's tuning file with one entry's config fields changed, for ``QERL_KERNEL_TUNING``.

  python3 -m experiments.tuning_variant --entry fwd:2 --set dequant=asm_e4m3 prefetch=0 num_warps=8 \
      --out /tmp/e4m3.json
  QERL_KERNEL_TUNING=/tmp/e4m3.json python3 experiments/profile_decode.py --quants nvfp4 --batches 1 ...
  python3 -m experiments.tuning_variant --entry fwd:1 --shapes 18944x3584 --set block_n=64 num_warps=8 --out ...
  python3 -m experiments.tuning_variant --entry decode:swiglu --set block_n=128 num_warps=2 --out ...
  python3 -m experiments.tuning_variant --base /tmp/a.json --entry fwd:1 --shapes 3584x37888 --set ... --out /tmp/b.json

The way to try a tuning in the model (profile_decode, bench_rollout) against the unchanged file in the same
GPU call, without editing ``qerl_kernels/tuning``. Values are parsed as JSON where they parse (8, true, 0.5), else
kept as strings; the result is checked by loading it as the kernels would.
"""

from __future__ import annotations

import argparse
import json
import sys

from qerl_kernels import config as config_lib


def variant(tuning: dict, direction: str, max_rows: int, changes: dict, shapes: list | None = None) -> dict:
  """``tuning`` with ``changes`` applied to the config of every (direction, max_rows) entry: the general one and
  any restricted to some shapes. With ``shapes`` ([K, N] pairs) those entries stay, and a changed copy of the
  entry that now applies to those shapes goes before all of them (the first matching entry wins), so a shape
  keeps the fields its own entry sets (e.g. the H200 file's one-row ``one_round`` for 7B down and q|k|v)."""
  out = json.loads(json.dumps(tuning))
  same = [i for i, e in enumerate(out["entries"]) if e["direction"] == direction and e["max_rows"] == max_rows]
  general = [i for i in same if out["entries"][i].get("shapes") is None]
  if len(general) != 1:
    have = sorted((e["direction"], e["max_rows"]) for e in out["entries"] if e.get("shapes") is None)
    raise ValueError(f"no single entry {direction}:{max_rows} for every shape in the tuning file; it has {have}")
  if shapes:
    def applies(kn):  # the entry get_config picks for shape kn among this row count's (the first that matches)
      return next(i for i in same if out["entries"][i].get("shapes") is None or list(kn) in out["entries"][i]["shapes"])

    origins = {applies(kn) for kn in shapes}
    if len(origins) != 1:
      raise ValueError(f"shapes {[list(kn) for kn in shapes]} are tuned by different {direction}:{max_rows} entries "
                       "now; make one variant per group of shapes that share an entry")
    copy = json.loads(json.dumps(out["entries"][origins.pop()]))
    copy["shapes"] = [list(kn) for kn in shapes]
    out["entries"].insert(same[0], copy)
    targets = [copy]
  else:
    targets = [out["entries"][i] for i in same]
  for entry in targets:
    entry["config"].update(changes)
    entry["source"] = f"variant of the tuned entry: {changes}" + (
        f" for shapes {entry['shapes']}" if entry.get("shapes") else "")
    config_lib.Nvfp4MatmulConfig(**entry["config"])  # a bad field or value fails here, naming itself
  return out


def decode_variant(tuning: dict, kernel: str, changes: dict) -> dict:
  """``tuning`` with the launch fields of decode kernel ``kernel`` (qerl_kernels.config.DECODE_KERNELS) changed."""
  out = json.loads(json.dumps(tuning))
  if kernel not in config_lib.DECODE_KERNELS:
    raise ValueError(f"unknown decode kernel {kernel!r} (known: {sorted(config_lib.DECODE_KERNELS)})")
  table = out.setdefault("decode_kernels", {})
  table[kernel] = {**table.get(kernel, {}), **changes}
  config_lib._check_decode_kernels("variant", table)  # pylint: disable=protected-access
  return out


def parse_shape(text: str) -> list[int]:
  """ "18944x3584" -> [18944, 3584] (K x N, as bench_kernels names a weight)."""
  try:
    k, n = (int(v) for v in text.lower().split("x"))
  except ValueError:
    raise argparse.ArgumentTypeError(f"a shape is KxN, e.g. 18944x3584, got {text!r}") from None
  return [k, n]


def _value(text: str):
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    return text


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--device", default="NVIDIA H200", help="the device kind whose tuning file to start from")
  p.add_argument("--entry", required=True,
                 help="direction:max_rows of the entry to change, e.g. fwd:2, or decode:KERNEL for a decode kernel's "
                      "launch fields, e.g. decode:swiglu")
  p.add_argument("--set", nargs="+", required=True, metavar="FIELD=VALUE")
  p.add_argument("--shapes", nargs="+", type=parse_shape, metavar="KxN",
                 help="change a copy of the entry that applies to these weight shapes only (put before it)")
  p.add_argument("--base", default="",
                 help="start from this tuning file (e.g. an earlier variant, to combine changes) instead of the "
                      "device's")
  p.add_argument("--out", required=True)
  args = p.parse_args(argv)
  direction, which = args.entry.split(":")  # fwd:2, bwd:16, or decode:KERNEL
  changes = {k: _value(v) for k, v in (item.split("=", 1) for item in args.set)}
  source = args.base or config_lib._device_file(args.device)  # pylint: disable=protected-access
  tuning = config_lib._read_json(source)  # pylint: disable=protected-access
  if direction == "decode":  # decode:swiglu etc.: a decode kernel's launch fields, not a matmul entry
    if args.shapes:
      p.error("--shapes applies to matmul entries (fwd:R, bwd:R), not to decode kernels")
    out = decode_variant(tuning, which, changes)
  else:
    out = variant(tuning, direction, int(which), changes, args.shapes)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  config_lib._read_json(args.out)  # pylint: disable=protected-access  # loads as the kernels would
  where = f" for shapes {args.shapes}" if args.shapes else ""
  start = args.base or f"the {args.device} file"
  print(f"{args.out}: {start} with {args.entry} changed by {changes}{where}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
