"""One launch of the shipped gemv (7B gate, one row) and of its load-only probe, for Nsight Compute.

With ``--rows 8`` the dispatch launches the tile kernel instead (``nvfp4_matmul_fwd``: add it to the regex);
``QERL_KERNEL_TUNING`` picks the config, as in the model.

    ncu --clock-control none --kernel-name regex:"gemv|probe" --launch-count 4 \
        --section SpeedOfLight --section SchedulerStats --section InstructionStats --section WarpStateStats \
        python3 experiments/ncu_gemv.py > $OUT/ncu.txt

(ncu reads the H200's counters on the Firecracker machines: KINDS.md in the device tool's folder.) Each kernel
runs twice, so the second launch of each is past compilation and autotuning. The records it gave are in
experiments/results/ncu_gemv_*.txt and summarized in RESULTS.md ("Where the one-row gemv's time goes").

Stall reasons per issued instruction and the SMs' spread of active cycles (what results/ncu_tile8_*.txt hold):

    M=sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_elapsed.max,\
    smsp__issue_active.avg.pct_of_peak_sustained_active,\
    regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio
    ncu --clock-control none --kernel-name regex:nvfp4 --launch-count 2 --section LaunchStats --metrics $M \
        python3 experiments/ncu_gemv.py --rows 8 > $OUT/ncu8.txt

(In both calls that ran it this session, the first ncu run of the call ended in a segmentation fault with no
record, and a second run of the same command worked: retry once.)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments.probe_gemv_loads import PROBES, SHAPES, probe  # noqa: E402
from qerl_kernels import nvfp4_matmul  # noqa: E402
from qerl_jax.quant import quantize  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shape", default="qwen2.5-7b.gate", choices=SHAPES)
  parser.add_argument("--rows", type=int, default=1, help="rows of x (the dispatch picks gemv or tile kernel)")
  parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a CPU smoke run)")
  args = parser.parse_args(argv)
  k, n = SHAPES[args.shape]
  q = quantize(jax.random.normal(jax.random.key(0), (k, n), jnp.bfloat16), "nvfp4")
  x = jax.random.normal(jax.random.key(1), (args.rows, k), jnp.bfloat16)
  gemv = jax.jit(lambda x, q: nvfp4_matmul(x, q, interpret=args.interpret))
  scale_u8 = jax.lax.bitcast_convert_type(q.scale_NxKb, jnp.uint8)
  load_only = jax.jit(lambda p, s: probe("tile16x256", p, s, jnp.zeros((1,), jnp.int32), interpret=args.interpret,
                                         **PROBES["tile16x256"]))
  for _ in range(2):
    y = gemv(x, q).block_until_ready()
    load_only(q.packed_NxKh, scale_u8).block_until_ready()
  print(f"{args.shape}: y {y.shape} {y.dtype}")


if __name__ == "__main__":
  main()
