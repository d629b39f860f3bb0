"""Where a decode step's time goes: GPU kernel time by kernel, from a profiler trace of a few decode steps.

    python experiments/profile_decode.py --quants bf16 nvfp4 --batches 1 8 64 --out $OUT/profile.json

For each (quant, batch, decode attention) it runs `--steps` decode steps of the rollout's body (one token
per row into a `--cache-len` cache at slot `--start`, temperature sampling) on random weights in a Qwen2.5
shape, times them without the profiler (median of `--reps`), then once under `jax.profiler.trace` and sums
the GPU kernel time per kernel name. It prints, per run, ms per step (wall), kernel-busy ms per step, the
gap (wall minus busy: launch overhead and idle) and the top kernels; the JSON holds every kernel's total.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import hashlib
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.bench_rollout import QWEN25, merged_groups, model_config, synthetic_base  # noqa: E402
from experiments.provenance import commit  # noqa: E402


def kernel_totals(trace_dir: str) -> tuple[dict[str, float], dict[str, float], float, dict[str, dict]]:
  """From a perfetto trace: ({kernel name: total us}, {device thread name: busy us}, device span us,
  {kernel name: what the trace says of it}).

  The last maps each kernel to its first event's arguments (e.g. the HLO op it ran for) plus, when the trace's
  "XLA Ops" line names that op, the op's long name (its HLO text), so a fusion can be traced to the model code.
  """
  events, procs, threads = _load_trace(trace_dir)
  totals, busy, calls = collections.Counter(), collections.Counter(), collections.Counter()
  details, long_names = {}, {}
  lo, hi = float("inf"), 0.0
  for e in events:
    if e.get("ph") != "X" or "GPU" not in procs.get(e["pid"], ""):
      continue
    thread = threads.get((e["pid"], e.get("tid")), "?")
    busy[thread] += e["dur"]
    if thread.startswith("Stream"):  # kernels and copies; "XLA Ops"/"XLA Modules" lines repeat them
      totals[e["name"]] += e["dur"]
      calls[e["name"]] += 1
      details.setdefault(e["name"], {k: str(v)[:300] for k, v in e.get("args", {}).items()})
      lo, hi = min(lo, e["ts"]), max(hi, e["ts"] + e["dur"])
    elif thread == "XLA Ops" and "long_name" in e.get("args", {}):
      long_names.setdefault(e["name"], str(e["args"]["long_name"])[:600])
  for info in details.values():
    if info.get("hlo_op") in long_names:
      info["long_name"] = long_names[info["hlo_op"]]
  for name, info in details.items():
    info["calls"] = calls[name]
  return dict(totals), dict(busy), (hi - lo if hi else 0.0), details


def quiet_trace(trace_dir: str):
  """`jax.profiler.trace` to a perfetto file without the Python tracer (a record of every Python call; the
  GPU kernels and their HLO module names are all this project reads from a trace)."""
  import jax  # pylint: disable=import-outside-toplevel
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  return jax.profiler.trace(trace_dir, create_perfetto_trace=True, profiler_options=options)


def module_kernel_us(trace_dir: str) -> dict[str, float]:
  """{HLO module (a jitted function's program, e.g. "jit_bench_3"): total GPU kernel us on the stream lines}."""
  events, procs, threads = _load_trace(trace_dir)
  totals = collections.Counter()
  for e in events:
    if (e.get("ph") == "X" and "GPU" in procs.get(e["pid"], "")
        and threads.get((e["pid"], e.get("tid")), "").startswith("Stream")):
      totals[e.get("args", {}).get("hlo_module", "?")] += e["dur"]
  return dict(totals)


MAX_WARPS_PER_SM = 64  # sm_90 (H100, H200)


def device_sms() -> int:
  """The first device's SM count (132 where jax does not say: the H100 SXM and H200 this project measures)."""
  import jax  # pylint: disable=import-outside-toplevel
  return getattr(jax.devices()[0], "core_count", 132) or 132


def _launch_fields(launch: str) -> dict[str, str]:
  """{"regs": "56", "grid": "1184,1,1", ...} of a trace's launch string."""
  return dict(f.split(":", 1) for f in launch.split() if ":" in f)


def launch_rounds(launch: str, num_sms: int) -> float | None:
  """Rounds of programs a launch runs: its programs over the ones that fit the GPU at once (occupancy's warps per
  SM over the warps per program, times the SMs), from a ``launch`` string ("grid:592,1,1 block:64,1,1
  occ_pct:12.5 ..."); None where the string lacks those fields. 1.12 rounds is a full round and a nearly empty
  one: at 64 rows 7B gate|up ran 84.2 us against 61.5 for one full round (H100, d4f251b)."""
  fields = _launch_fields(launch)
  try:
    programs = math.prod(int(v) for v in fields["grid"].split(","))
    warps = -(-int(fields["block"].split(",")[0]) // 32)
    per_sm = round(float(fields["occ_pct"]) / 100 * MAX_WARPS_PER_SM) // warps
  except (KeyError, ValueError):
    return None
  return round(programs / (per_sm * num_sms), 3) if per_sm else None


def launch_resources(launch: str) -> str:
  """ "80 regs 17.0 KB" from a ``launch`` string (registers per thread, static + dynamic shared memory per program);
  "" where it names neither. A gemv whose K loop Triton pipelined shows its stages' shared memory here (the
  unpipelined one-row gemv: 2 KB)."""
  fields = _launch_fields(launch)
  try:
    shared = int(fields.get("static_shared", 0)) + int(fields.get("dynamic_shared", 0))
    regs = f"{int(fields['regs'])} regs " if "regs" in fields else ""
  except ValueError:
    return ""
  return f"{regs}{shared / 1024:.1f} KB" if regs or "dynamic_shared" in fields else ""


def module_launches(trace_dir: str) -> dict[str, str]:
  """{HLO module: the launch of its longest-running GPU kernel, as the trace states it ("regs:56
  static_shared:0 dynamic_shared:512 grid:1184,1,1 block:128,1,1 occ_pct:56.25")}: the registers, shared
  memory and occupancy the GPU's compiler actually gave a Pallas kernel (an offline compile can differ)."""
  events, procs, threads = _load_trace(trace_dir)
  best = {}
  for e in events:
    args = e.get("args", {})
    if (e.get("ph") == "X" and "GPU" in procs.get(e["pid"], "") and "kernel_details" in args
        and threads.get((e["pid"], e.get("tid")), "").startswith("Stream")):
      module = args.get("hlo_module", "?")
      if e["dur"] > best.get(module, (-1.0, ""))[0]:
        best[module] = (e["dur"], args["kernel_details"])
  return {module: launch for module, (_, launch) in best.items()}


def _load_trace(trace_dir: str) -> tuple[list, dict, dict]:
  """A perfetto trace's events, {pid: process name} and {(pid, tid): thread name}."""
  path = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)[0]
  with gzip.open(path) as f:
    events = json.load(f)["traceEvents"]
  procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  return events, procs, threads


def lora_label(record: dict) -> str:
  """The --lora-epilogue choice a record ran with."""
  fused, xa = record["fused_lora"], record.get("gemv_lora_xa")
  return "fused+gemv-xa" if fused and xa else "fused" if fused else "gemv-xa" if xa else "xla"


def fused_computation(hlo_text: str, kernel: str, max_lines: int = 24) -> str:
  """The HLO of the fusion a trace kernel ran ("input_reduce_fusion_113" is instruction
  "input_reduce_fusion.113"): its instruction line, then the body of the computation it calls."""
  name = re.sub(r"_(\d+)$", r".\1", kernel)
  line = re.search(rf"^\s*(?:ROOT )?%?{re.escape(name)} = ([^\n]*)", hlo_text, re.M)
  if line is None:
    return f"{kernel}: not in the compiled HLO"
  out = [f"{name} = {line.group(1)[:400]}"]
  called = re.search(r"calls=%?([\w.\-]+)", line.group(1))
  if called:
    body = re.search(rf"^%?{re.escape(called.group(1))} [^\n]*\{{\n(.*?)\n\}}", hlo_text, re.M | re.S)
    if body:
      out += ["    " + line.strip()[:200] for line in body.group(1).splitlines()[:max_lines]]
  return "\n".join(out)


def output_digest(tree) -> str:
  """sha256 of every leaf's bytes (the last tokens and the whole KV cache after the traced steps): equal digests
  across processes that differ only in an XLA flag say the flag changed no value (a launch race would)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    h.update(np.asarray(leaf).tobytes())
  return h.hexdigest()[:16]


def decode_program(sampling):
  """The rollout's decode body (engine.rollout), `steps_arr.shape[0]` times, on the model's decode_layers.

  The KV cache is donated: pass the cache the previous call returned. Not donated, it was copied into the loop on
  every call (at 7B, 56 `memcpy128` per 16-step call, 3.5 per step: 144 us per step at batch 64 in the records
  before a2c9beb, none in those after it); made inside the program instead, its zeros are written every call (so
  the CPU compile shows). A rollout makes its cache once per 1024 steps, so neither cost belongs in a decode step's
  profile."""
  import functools
  import jax
  from flax import nnx
  from qerl_jax.model.transformer import forward
  from qerl_jax.rollout.engine import rollout_params
  from qerl_jax.rollout.sampling import sample

  @functools.partial(jax.jit, donate_argnums=2)
  def decode(graphdef_state, token_B, cache, start, valid_BxS, key, steps_arr):
    model = nnx.merge(*graphdef_state)
    params = rollout_params(model.params(), model.config)  # as the rollout makes them, before its loop
    fwd = functools.partial(forward, params, model.config, model.lora_scale)

    def body(i, carry):
      token_B, cache = carry
      logits, cache = fwd(token_B[:, None], None, cache=cache, cache_index=start + i, valid_BxS=valid_BxS)
      token_B, _ = sample(logits[:, 0], jax.random.fold_in(key, i), sampling)
      return token_B, cache

    return jax.lax.fori_loop(0, steps_arr.shape[0], body, (token_B, cache))
  return decode


def use_tuning(path: str) -> None:
  """The kernel tuning the next trace reads: ``path`` through QERL_KERNEL_TUNING, or the shipped file ("")."""
  if path:
    os.environ["QERL_KERNEL_TUNING"] = path
  else:
    os.environ.pop("QERL_KERNEL_TUNING", None)


def checked_tunings(paths: list[str] | None) -> list[str]:
  """--tunings as given, or else the QERL_KERNEL_TUNING in force ("" for none: the shipped file). Each file is
  read and checked here (FileNotFoundError or ValueError naming it), so a bad one fails before a model is built."""
  from qerl_kernels import config as config_lib  # pylint: disable=import-outside-toplevel
  paths = [os.environ.get("QERL_KERNEL_TUNING", "")] if paths is None else paths
  before = os.environ.get("QERL_KERNEL_TUNING", "")
  try:
    for path in paths:
      use_tuning(path)
      config_lib.load_tuning("NVIDIA H200")
  finally:
    use_tuning(before)
  return paths


def run(args):
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from qerl_jax.model import Transformer, init_cache
  from qerl_jax.model.linear import LoraConfig
  from qerl_jax.rollout.sampling import SamplingParams

  records = []
  num_sms = device_sms()
  for quant in args.quants:
    base = synthetic_base(model_config(args.model), quant)
    # bf16 has no kernel epilogue and nothing to merge
    variants = [(a, ly, f, g, t, pt, nf) for ly in args.decode_layers for a in args.decode_attention
                for f in (args.lora_epilogue if quant == "nvfp4" else ["xla"])
                for g in (args.merged_launches if quant == "nvfp4" else ["none"])
                for t in (args.tunings if quant == "nvfp4" else [""])
                for pt in (args.partials_tiles if quant == "nvfp4" else ["off"])
                for nf in (args.norm_fold if quant == "nvfp4" else ["off"])]
    for attention, layers, epilogue, groups, tuning, tiles, norm_fold in variants:
      use_tuning(tuning)
      config = model_config(args.model).replace(decode_attention=attention, decode_layers=layers,
                                                fused_lora=epilogue.startswith("fused"),
                                                gemv_lora_xa=epilogue.endswith("gemv-xa"),
                                                rollout_merged_launches=merged_groups(groups, quant),
                                                decode_partials_tiles=tiles == "on",
                                                decode_norm_fold=norm_fold == "on")
      lora = LoraConfig(rank=16, alpha=16, dtype=jnp.dtype(args.lora_dtype))
      model = Transformer(config, base, lora=lora, rngs=nnx.Rngs(0))
      gs = nnx.split(model)
      decode = decode_program(SamplingParams(temperature=1.0))
      steps_arr = jnp.zeros((args.steps,))
      for batch in args.batches:
        valid = jnp.ones((batch, args.cache_len), bool)
        token = jnp.zeros((batch,), jnp.int32)
        held = {"cache": init_cache(config, batch, args.cache_len, per_layer=layers == "unrolled")}

        def go(seed):  # each call donates the cache the last one returned
          out = decode(gs, token, held["cache"], jnp.int32(args.start), valid, jax.random.key(seed), steps_arr)
          held["cache"] = out[1]
          return out

        jax.block_until_ready(go(0))
        times = []
        for rep in range(args.reps):
          t0 = time.perf_counter()
          jax.block_until_ready(go(rep + 1))
          times.append(time.perf_counter() - t0)
        ms_step = statistics.median(times) / args.steps * 1e3
        with tempfile.TemporaryDirectory() as d:
          with quiet_trace(d):
            out = jax.block_until_ready(go(99))
          totals, busy, span, details = kernel_totals(d)
        kernel_ms = sum(totals.values()) / 1e3 / args.steps
        rec = dict(model=args.model, quant=quant, batch=batch, decode_attention=attention, decode_layers=layers,
                   fused_lora=config.fused_lora, gemv_lora_xa=config.gemv_lora_xa, lora_dtype=args.lora_dtype,
                   decode_partials_tiles=config.decode_partials_tiles, decode_norm_fold=config.decode_norm_fold,
                   rollout_merged_launches=",".join(config.merged_launch_groups), steps=args.steps,
                   cache_len=args.cache_len, start=args.start, ms_per_step=ms_step, kernel_ms_per_step=kernel_ms,
                   span_ms_per_step=span / 1e3 / args.steps,
                   kernels_us_per_step={k: v / args.steps for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
                   kernel_details={k: details[k] for k in sorted(totals, key=totals.get, reverse=True)[:60]},
                   busy_us_by_thread=busy, tuning=tuning or "shipped",
                   device=jax.devices()[0].device_kind, commit=commit(),
                   jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""),
                   output_sha=output_digest(out))
        rec["calls_per_step"] = {k: details[k]["calls"] / args.steps for k in rec["kernel_details"]}
        records.append(rec)
        print(f"\n{quant:6s} b{batch:<3d} attn={attention:6s} layers={layers:8s} lora={epilogue:5s} "
              f"merged={rec['rollout_merged_launches'] or 'none'} tuning={rec['tuning']} norm_fold={norm_fold} "
              f"{ms_step:7.2f} ms/step wall, kernels {kernel_ms:6.2f} ms/step, span {rec['span_ms_per_step']:6.2f} "
              f"output {rec['output_sha']}",
              flush=True)
        for name, us in list(rec["kernels_us_per_step"].items())[:args.top]:
          launch = details[name].get("kernel_details", "")
          rounds, resources = launch_rounds(launch, num_sms), launch_resources(launch)
          print(f"   {us:9.1f} us  {100 * us / 1e3 / max(kernel_ms, 1e-9):5.1f}%  "
                f"{details[name]['calls'] / args.steps:5.1f} calls  {'%5.2f rounds  ' % rounds if rounds else ''}"
                f"{resources + '  ' if resources else ''}{name[:100]}", flush=True)
        if args.show_hlo or args.hlo_out:  # what each top XLA fusion computes, to trace it to the model code
          hlo = decode.lower(gs, token, held["cache"], jnp.int32(args.start), valid, jax.random.key(0),
                             steps_arr).compile().as_text()
          xla_kernels = [k for k in rec["kernels_us_per_step"] if "fusion" in k][:args.show_hlo]
          print("\n\n".join(fused_computation(hlo, k) for k in xla_kernels), flush=True)
          if args.hlo_out:  # the whole optimized module, for reading offline
            path = args.hlo_out.format(quant=quant, batch=batch)
            with gzip.open(path, "wt") as f:
              f.write(hlo)
  return records


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="qwen2.5-7b", choices=sorted(QWEN25))
  p.add_argument("--quants", nargs="+", default=["bf16", "nvfp4"], choices=["bf16", "nvfp4"])
  p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
  p.add_argument("--decode-attention", nargs="+", default=["auto"], choices=["xla", "pallas", "auto"])
  p.add_argument("--decode-layers", nargs="+", default=["unrolled"], choices=["unrolled", "scan"])
  p.add_argument("--lora-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                 help="the adapters' dtype (bench_rollout's bf16; the trainer keeps float32 adapters)")
  p.add_argument("--lora-epilogue", nargs="+", choices=["xla", "fused", "gemv-xa", "fused+gemv-xa"],
                 default=["fused+gemv-xa"],
                 help="NVFP4: bias and LoRA added by XLA after the matmul, fused into the kernels' epilogue, "
                      "(gemv-xa) x @ A computed in the gemv's launch at decode rows (ModelConfig.gemv_lora_xa), or "
                      "both (the gemv's x @ A at 1-2 rows, the fused epilogue elsewhere: the model's and "
                      "bench_rollout's default, hence this one's; until 8f7f91c it was gemv-xa, so profiles at 3+ "
                      "rows ran XLA's LoRA dots that rollouts do not)")
  p.add_argument("--partials-tiles", nargs="+", default=["off"], choices=["off", "on"],
                 help="NVFP4: ModelConfig.decode_partials_tiles (the 3-16-row tile launches hand their partials to "
                      "the decode kernels that end each step); both values: an A/B in one process")
  p.add_argument("--norm-fold", nargs="+", default=["off"], choices=["off", "on"],
                 help="NVFP4: ModelConfig.decode_norm_fold (the gemv after a block's end reads its pending RMSNorm); "
                      "both values: an A/B in one process")
  p.add_argument("--merged-launches", nargs="+", default=["auto"], metavar="GROUPS",
                 help="NVFP4: comma-separated groups (qkv, gate_up) as one launch each "
                      "(ModelConfig.rollout_merged_launches; auto = both, the default; none = one per projection); "
                      "several values run one after another on the same weights, e.g. 'none auto'")
  p.add_argument("--tunings", nargs="+", default=None, metavar="PATH",
                 help="kernel tuning files to compare in one process (each through QERL_KERNEL_TUNING; \"\" is the "
                      "shipped one): each NVFP4 variant is traced and timed once per file (default: "
                      "QERL_KERNEL_TUNING if set, else the shipped file)")
  p.add_argument("--cache-len", type=int, default=1280)
  p.add_argument("--start", type=int, default=768, help="first cache slot written (mid-rollout)")
  p.add_argument("--steps", type=int, default=16)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--top", type=int, default=15)
  p.add_argument("--show-hlo", type=int, default=0, metavar="N",
                 help="print the HLO of the N most expensive XLA fusions (their names in the trace)")
  p.add_argument("--hlo-out", default="", metavar="PATH",
                 help="write each run's optimized HLO here, gzipped ({quant} and {batch} are filled in)")
  p.add_argument("--out", required=True, help="JSON file for the records")
  return p


def main():
  p = build_parser()
  args = p.parse_args()
  try:
    args.tunings = checked_tunings(args.tunings)
  except (OSError, ValueError) as err:
    p.error(f"--tunings: {err}")
  records = run(args)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(records, f)
  print(f"\n{'quant':6s} {'batch':>5s} {'attn':6s} {'layers':8s} {'lora':13s} {'merged':12s} {'wall ms':>8s} "
        f"{'kernel ms':>9s} tiles fold  tuning")
  for r in records:
    print(f"{r['quant']:6s} {r['batch']:5d} {r['decode_attention']:6s} {r['decode_layers']:8s} "
          f"{lora_label(r):13s} {r['rollout_merged_launches'] or 'none':12s} "
          f"{r['ms_per_step']:8.2f} {r['kernel_ms_per_step']:9.2f} "
          f"{'on' if r.get('decode_partials_tiles') else 'off':5s} {'on' if r.get('decode_norm_fold') else 'off':4s}  "
          f"{r['tuning']}  {r['output_sha']}")


if __name__ == "__main__":
  main()
