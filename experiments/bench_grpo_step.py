"""One full GRPO step (rollout + log-probs + update) on random weights in the exact Qwen2.5 shapes.

    python experiments/bench_grpo_step.py --models qwen2.5-7b qwen2.5-32b --quants bf16 nvfp4   # one GPU
    python experiments/bench_grpo_step.py --models qwen2.5-72b --quants nvfp4
    python experiments/bench_grpo_step.py --models qwen2.5-7b --mesh 1,2,1                       # two GPUs
    python experiments/bench_grpo_step.py --smoke                                               # CPU, < 60 s

Each (model, quant) runs in its own subprocess, so its peak device memory is its own. The step: 8 prompts x 8
samples (64 rows), prompt 256 tokens, `--new-tokens` (1024) sampled at temperature 1 with stop tokens ignored
(every row runs to the budget: the worst case); then one no-gradient log-prob pass over the batch (what the KL
reference or an extra policy iteration costs); then one micro-batched AdamW update with remat (`--no-remat`:
without), LoRA rank 16 on all seven projections and trainable block norms. The step is run twice and the
second is timed (the first compiles); `--steps 1` runs it once, for memory-only runs of the largest shapes,
and then the times include compilation (the record says so: `includes_compile`). Before compiling, the memory
planner's estimate is printed and recorded beside the measured peak (`device.memory_stats()`, maximum over the
local devices); `--memory-analysis` adds XLA's own byte counts of each phase's program (arguments, outputs,
temporaries), to check the planner phase by phase. One JSON line per run is appended to
experiments/results/grpo_step.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "experiments", "results", "grpo_step.jsonl")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rollout import (QWEN25, _filler, add_per_run_flags, merged_groups, model_config,  # noqa: E402
                           refuse_per_run_flags, synthetic_base)
from experiments.provenance import append_records, commit, kernel_tuning  # noqa: E402
from qerl_jax.model.config import TRAIN_ATTENTION  # noqa: E402


def sharded_synthetic_base(config, quant: str, mesh, seed: int = 0):
  """`synthetic_base`, each leaf drawn directly into its shards (jit with out_shardings by the rules)."""
  import jax
  import jax.numpy as jnp
  from qerl_jax import sharding
  from qerl_jax.model.base import empty_base, schemes_for

  abstract = jax.eval_shape(lambda: empty_base(config, schemes_for(config, quant)))
  shardings = sharding.shardings_for(abstract, mesh, prefix="frozen")
  leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  out = []
  for (path, spec), key, sh in zip(leaves, keys, jax.tree_util.tree_leaves(shardings)):
    fill = jax.jit(_filler(jax.tree_util.keystr(path), jnp.dtype(spec.dtype)), static_argnums=(1,),
                   out_shardings=sh)
    out.append(fill(key, spec.shape))
  return jax.tree_util.tree_unflatten(treedef, out)


def _xla_bytes(jitted, *args, **kwargs) -> dict | None:
  """`compiled.memory_analysis()` of one jitted phase (lowered and compiled again for the analysis)."""
  analysis = jitted.lower(*args, **kwargs).compile().memory_analysis()
  if analysis is None:
    return None
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")
  return {f: int(getattr(analysis, f)) for f in fields}


def _peak_gb() -> float:
  import jax
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.local_devices()]
  return max(peaks) / 1e9


def run_one(args) -> dict:
  """The step for one (model, quant) in this process; returns its record."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  import qerl_kernels as kernels
  from qerl_jax import memory, sharding
  from qerl_jax.model import Transformer, split_params
  from qerl_jax.model.linear import LoraConfig
  from qerl_jax.rollout.engine import rollout
  from qerl_jax.rollout.sampling import SamplingParams
  from qerl_jax.train.optim import OptimizerSettings
  from qerl_jax.train.state import init_train_state
  from qerl_jax.train.step import UpdateSettings, jit_logprobs, jit_update

  config = model_config(args.model).replace(remat=args.remat, decode_attention=args.decode_attention,
                                            decode_layers=args.decode_layers, fused_lora=args.fused_lora,
                                            rollout_lora_dtype=args.rollout_lora_dtype,
                                            rollout_base_dtype=args.rollout_base_dtype,
                                            train_attention=args.train_attention,
                                            rollout_merged_launches=merged_groups(args.merged_launches, args.quant))
  rows = args.prompts * args.samples
  mesh_spec = dict(zip(sharding.MESH_AXES, map(int, args.mesh.split(","))))
  mesh = None if all(v == 1 for v in mesh_spec.values()) else sharding.make_mesh(mesh_spec)
  mesh_shape = sharding.mesh_shape(mesh_spec, jax.device_count()) if mesh is not None else (1, 1, 1)
  on_gpu = jax.default_backend() == "gpu"
  xla_min_rows = kernels.xla_min_rows() if on_gpu else None
  plan = memory.plan(config, args.quant, rows, args.prompt_len, args.new_tokens, mesh_shape, args.lora_rank,
                     args.micro_batch, args.remat, logprob_chunk=args.logprob_chunk, vocab_chunk=args.vocab_chunk,
                     fused_kernel=args.quant == "nvfp4" and on_gpu,
                     xla_min_rows=xla_min_rows)
  print(plan.table(), file=sys.stderr, flush=True)
  memory.check_fits(plan, memory.device_capacity())

  base = synthetic_base(config, args.quant) if mesh is None else sharded_synthetic_base(config, args.quant, mesh)
  model = Transformer(config, base, lora=LoraConfig(rank=args.lora_rank, alpha=float(args.lora_rank)),
                      train_norms=True, rngs=nnx.Rngs(0))
  del base
  graphdef, trainable, frozen = split_params(model)
  params = trainable.to_pure_dict()
  settings = UpdateSettings(micro_batch_size=args.micro_batch, max_len=args.new_tokens,
                            logprob_chunk=args.logprob_chunk, vocab_chunk=args.vocab_chunk)
  opt = OptimizerSettings(learning_rate=1e-5, total_updates=10)
  logprobs = jit_logprobs(graphdef, settings)
  if mesh is None:
    update, optimizer, _ = jit_update(graphdef, opt, settings)
    state = init_train_state(params, optimizer, 0)
  else:
    frozen = sharding.place(frozen, mesh, prefix="frozen")
    _, optimizer, _ = jit_update(graphdef, opt, settings)
    state = sharding.init_sharded(lambda p: init_train_state(p, optimizer, 0), mesh, params)
    update, _, _ = sharding.jit_update_sharded(graphdef, opt, settings, mesh, state, frozen)
  del model, trainable, params

  rng = np.random.default_rng(0)
  prompt = rng.integers(0, config.vocab_size, (rows, args.prompt_len)).astype(np.int32)
  valid = np.ones((rows, args.prompt_len), bool)
  if mesh is not None:
    prompt, valid = jax.device_put((prompt, valid), sharding.batch_sharding(mesh, 2))
  sampling = SamplingParams(temperature=1.0)

  last_batch = {}
  # The device's peak after each phase of the first step: the peak only grows, so the phase where it jumps is the
  # one that set it (the "words" run at 483586a peaked 8 GB over its plan with no way to tell which phase).
  phase_peak_gb = {}

  def step(seed, state):
    timings = {}
    t0 = time.perf_counter()
    policy = nnx.merge_state(nnx.State(state.params), frozen)
    out = rollout(graphdef, policy, prompt, valid, jax.random.key(seed), None, sampling=sampling,
                  max_new_tokens=args.new_tokens, stop_ids=(), pad_id=0)
    out = jax.block_until_ready(out)
    timings["rollout_s"] = time.perf_counter() - t0
    phase_peak_gb.setdefault("rollout", _peak_gb())
    batch = {"prompt_BxP": prompt, "prompt_valid_BxP": valid, "completion_BxN": out.tokens_BxN,
             "mask_BxN": out.mask_BxN, "truncated_B": ~out.finished_B,
             "advantages_B": jnp.asarray(rng.standard_normal(rows), jnp.float32),
             "old_logp_BxN": jnp.zeros_like(out.logprobs_BxN), "rollout_logp_BxN": out.logprobs_BxN}
    if mesh is not None:
      batch = sharding.place(batch, mesh, prefix="batch")
    last_batch["batch"] = batch
    t0 = time.perf_counter()
    jax.block_until_ready(logprobs(state.params, frozen, batch))
    timings["logprob_s"] = time.perf_counter() - t0
    phase_peak_gb.setdefault("logprob", _peak_gb())
    t0 = time.perf_counter()
    state, metrics, _ = update(state, frozen, batch, jnp.asarray(True))
    metrics = jax.device_get(metrics)
    timings["update_s"] = time.perf_counter() - t0
    phase_peak_gb.setdefault("update", _peak_gb())
    return state, timings, metrics

  with sharding.mesh_context(mesh):  # as in the trainer: the fused kernel maps over each device's rows
    t0 = time.perf_counter()
    state, timings, metrics = step(1, state)
    first_s = time.perf_counter() - t0
    if args.steps == 2:
      state, timings, metrics = step(2, state)
    xla_memory = None
    if args.memory_analysis:  # XLA's own per-phase byte counts, to set beside the planner's phases
      policy = nnx.merge_state(nnx.State(state.params), frozen)
      xla_memory = {
        "rollout": _xla_bytes(rollout, graphdef, policy, prompt, valid, jax.random.key(0), None,
                              sampling=sampling, max_new_tokens=args.new_tokens, stop_ids=(), pad_id=0),
        "logprob": _xla_bytes(logprobs, state.params, frozen, last_batch["batch"]),
        "update": _xla_bytes(update, state, frozen, last_batch["batch"], jnp.asarray(True))}
  step_s = sum(timings.values())
  return dict(
    model=args.model, quant=args.quant, devices=jax.device_count(), mesh=mesh_shape, step_s=step_s,
    **timings, first_step_s=first_s, includes_compile=args.steps == 1, peak_gb=_peak_gb(), phase_peak_gb=phase_peak_gb,
    plan_gb=plan.peak / 1e9,
    plan=plan.as_dict(), loss=float(metrics["loss"]), grad_norm=float(metrics["grad_norm"]), prompts=args.prompts,
    samples=args.samples, prompt_len=args.prompt_len, new_tokens=args.new_tokens, micro_batch=args.micro_batch,
    lora_rank=args.lora_rank, tokens_per_s=rows * args.new_tokens / timings["rollout_s"], xla_memory=xla_memory,
    device=jax.devices()[0].device_kind, jax=jax.__version__, commit=commit(),
    remat=args.remat,
    decode_attention=args.decode_attention, decode_layers=args.decode_layers, fused_lora=args.fused_lora,
    rollout_lora_dtype=args.rollout_lora_dtype, rollout_base_dtype=args.rollout_base_dtype,
    train_attention=args.train_attention, train_attention_impl=config.train_attention_impl,
    rollout_merged_launches=",".join(config.merged_launch_groups) if args.quant == "nvfp4" else "",
    kernel_tuning=kernel_tuning(), xla_min_rows=xla_min_rows, xla_dequant=kernels.xla_dequant())


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                              allow_abbrev=False)
  p.add_argument("--models", nargs="+", default=["qwen2.5-7b"], choices=sorted(QWEN25))
  p.add_argument("--quants", nargs="+", default=["bf16", "nvfp4"], choices=["bf16", "nvfp4"])
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--samples", type=int, default=8)
  p.add_argument("--prompt-len", type=int, default=256)
  p.add_argument("--new-tokens", type=int, default=1024)
  p.add_argument("--micro-batch", type=int, default=8)
  p.add_argument("--lora-rank", type=int, default=16)
  p.add_argument("--logprob-chunk", type=int, default=256)
  p.add_argument("--vocab-chunk", type=int, default=16384)
  p.add_argument("--steps", type=int, default=2, choices=[1, 2], help="2: time the second step; 1: memory only")
  p.add_argument("--memory-analysis", action="store_true",
                 help="also record XLA's memory_analysis() of the rollout, log-prob and update programs")
  p.add_argument("--mesh", default="1,1,1", help="data,fsdp,tensor sizes (-1 = the rest)")
  p.add_argument("--decode-attention", default="auto", choices=["xla", "pallas", "auto"],
                 help="one-token attention in the rollout (see bench_rollout.py)")
  p.add_argument("--decode-layers", default="unrolled", choices=["unrolled", "scan"],
                 help="the rollout's layer loop (see bench_rollout.py)")
  p.add_argument("--fused-lora", action=argparse.BooleanOptionalAction, default=True,
                 help="bias and LoRA in the NVFP4 kernels' epilogue at decode rows (ModelConfig.fused_lora; "
                      "the default)")
  p.add_argument("--rollout-lora-dtype", default="", choices=["", "bfloat16"],
                 help="the adapters' dtype in the rollout (ModelConfig.rollout_lora_dtype; '' = float32, theirs)")
  p.add_argument("--rollout-base-dtype", default="", choices=["", "bfloat16"],
                 help="NVFP4: the rollout dequantizes the base once into a bf16 copy "
                      "(ModelConfig.rollout_base_dtype; '' = the fused kernels)")
  p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True,
                 help="rematerialize each layer in the update's backward (ModelConfig.remat; the default). "
                      "--no-remat drops the second forward where the activations fit (the planner says); measured "
                      "no faster at 7B (RESULTS.md, 38be05a)")
  p.add_argument("--train-attention", default="auto", choices=TRAIN_ATTENTION,
                 help="the log-prob pass's and the update's attention (ModelConfig.train_attention)")
  p.add_argument("--merged-launches", default="auto", metavar="GROUPS",
                 help="NVFP4: q|k|v and gate|up as one launch each in the rollout "
                      "(ModelConfig.rollout_merged_launches; auto = both, the default; none = one per projection)")
  p.add_argument("--out", default=None,
                 help="JSON lines file (default experiments/results/grpo_step.jsonl; with --smoke, none)")
  p.add_argument("--smoke", action="store_true", help="tiny model and lengths: checks the script runs (CPU)")
  add_per_run_flags(p)
  args = p.parse_args()
  refuse_per_run_flags(p, args)
  if args.one:
    print("RECORD " + json.dumps(run_one(args)), flush=True)
    return
  if args.smoke:
    args.models, args.prompts, args.samples, args.prompt_len, args.new_tokens = ["smoke"], 2, 4, 16, 8
    args.micro_batch, args.logprob_chunk, args.vocab_chunk = 4, 8, 256
  env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95"))
  rows, failed = [], False
  for model in args.models:
    for quant in args.quants:
      cmd = [sys.executable, os.path.abspath(__file__), "--one", "--model", model, "--quant", quant]
      for flag in ("prompts", "samples", "prompt_len", "new_tokens", "micro_batch", "lora_rank", "logprob_chunk",
                   "vocab_chunk", "mesh", "steps", "decode_attention", "decode_layers", "train_attention"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
      cmd += ["--memory-analysis"] if args.memory_analysis else []
      cmd += ["--fused-lora" if args.fused_lora else "--no-fused-lora"]
      cmd += ["--remat" if args.remat else "--no-remat"]
      cmd += ["--rollout-lora-dtype", args.rollout_lora_dtype] if args.rollout_lora_dtype else []
      cmd += ["--rollout-base-dtype", args.rollout_base_dtype] if args.rollout_base_dtype else []
      cmd += ["--merged-launches", args.merged_launches]
      proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
      records = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RECORD ")]
      if proc.returncode or not records:
        failed = True
        print(f"FAILED {model} {quant}:\n{proc.stderr[-3000:]}", flush=True)
        continue
      record = records[0]
      rows.append(record)
      out = args.out or (None if args.smoke else DEFAULT_OUT)  # smoke numbers are not results
      if out:
        append_records(out, [record])
  print(f"{'model':12s} {'quant':6s} {'dev':>3s} {'step s':>8s} {'rollout':>8s} {'logprob':>8s} {'update':>8s} "
        f"{'peak GB':>8s} {'plan GB':>8s}")
  for r in rows:
    print(f"{r['model']:12s} {r['quant']:6s} {r['devices']:3d} {r['step_s']:8.2f} {r['rollout_s']:8.2f} "
          f"{r['logprob_s']:8.2f} {r['update_s']:8.2f} {r['peak_gb']:8.2f} {r['plan_gb']:8.2f}"
          + ("  (times include compilation)" if r["includes_compile"] else ""))
  for model in args.models:
    by = {r["quant"]: r["step_s"] for r in rows if r["model"] == model and not r["includes_compile"]}
    if "bf16" in by and "nvfp4" in by:
      print(f"{model}: nvfp4 / bf16 step time = {by['nvfp4'] / by['bf16']:.2f}x (target <= 0.6x on 7B)")
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
