"""Quantize a Hugging Face checkpoint to a compressed-tensors NVFP4 (or MXFP4) checkpoint.

  python -m qerl_jax.quantize --model DIR --out DIR [--scheme nvfp4|mxfp4] [--ignore lm_head ...]
      [--overwrite]

The output loads in vLLM and compressed-tensors like llm-compressor's NVFP4A16 / MXFP4A16 output, and
back into qerl_jax. All the work is in qerl_jax.quant.checkpoint.
"""

from __future__ import annotations

import argparse
import sys

from qerl_jax.quant import checkpoint
from qerl_jax.quant.safetensors_io import SafetensorsError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m qerl_jax.quantize", description=__doc__.split("\n")[0])
  p.add_argument("--model", required=True, help="Hugging Face checkpoint directory (safetensors)")
  p.add_argument("--out", required=True, help="output directory (written atomically)")
  p.add_argument("--scheme", default="nvfp4", choices=sorted(checkpoint.FORMATS))
  p.add_argument("--ignore", nargs="*", default=["lm_head"],
                 help="modules to keep unquantized: exact names or re:<regex> (default: lm_head)")
  p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
  p.add_argument("--max-shard-size", type=float, default=5.0, help="GiB per safetensors shard")
  p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    summary = checkpoint.quantize_checkpoint(
      args.model, args.out, scheme=args.scheme, ignore=args.ignore, overwrite=args.overwrite,
      max_shard_bytes=int(args.max_shard_size * 1024**3), progress=not args.no_progress)
  except (checkpoint.CheckpointError, SafetensorsError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {summary['out_dir']}: {len(summary['quantized'])} {summary['scheme']} layers, "
        f"{summary['shards']} shard(s), {summary['bytes'] / 1e6:.1f} MB")
  return 0


if __name__ == "__main__":
  sys.exit(main())
