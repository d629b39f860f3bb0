"""Rollout throughput: bf16 + LoRA vs NVFP4 + LoRA on random weights in the exact Qwen2.5 shapes.

    python experiments/bench_rollout.py --models qwen2.5-7b --batches 1 8 64       # on the GPU
    python experiments/bench_rollout.py --smoke                                    # tiny, any machine
    python experiments/bench_rollout.py --xla-flag-sets "|--xla_gpu_enable_command_buffer=..."   # A/B flags
    python experiments/bench_rollout.py --decode-attention xla      # XLA's one-token attention (A/B)
    python experiments/bench_rollout.py --decode-layers scan        # the stacked layer loop (A/B)

Each (model, quant, batch) runs in its own subprocess so that peak device memory is that run's alone.
Prompt 256 tokens, `--new-tokens` (1024) sampled at temperature 1 with stop tokens ignored, LoRA rank 16
unmerged on all seven projections. Prints tokens/s, ms per decode step, peak GPU memory and the
weight-streaming floor (weight + KV bytes per step over the copy bandwidth measured in the same process);
when torch is present, transformers' `generate` on the same shape (bf16, no LoRA) is the peer. One JSON line
per run is appended to experiments/results/rollout.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.provenance import append_records, commit, kernel_tuning  # noqa: E402  (after the path: run as a script too)

# Qwen2.5-*-Instruct shapes (config.json of the hub models); head_dim 128, qkv bias, rope_theta 1e6.
QWEN25 = {
  "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_layers=36, num_heads=16, num_kv_heads=2,
                     vocab_size=151936, tie_word_embeddings=True),
  "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
                     vocab_size=152064, tie_word_embeddings=False),
  "qwen2.5-14b": dict(hidden_size=5120, intermediate_size=13824, num_layers=48, num_heads=40, num_kv_heads=8,
                      vocab_size=152064, tie_word_embeddings=False),
  "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_layers=64, num_heads=40, num_kv_heads=8,
                      vocab_size=152064, tie_word_embeddings=False),
  "qwen2.5-72b": dict(hidden_size=8192, intermediate_size=29568, num_layers=80, num_heads=64, num_kv_heads=8,
                      vocab_size=152064, tie_word_embeddings=False),
  "smoke": dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                vocab_size=512, tie_word_embeddings=False),
}


def model_config(name: str):
  import jax.numpy as jnp
  from qerl_jax.model import ModelConfig
  return ModelConfig(arch="qwen2", head_dim=128 if name != "smoke" else 32, rope_theta=1e6, qkv_bias=True,
                     rms_norm_eps=1e-6, max_position_embeddings=32768, dtype=jnp.bfloat16, **QWEN25[name])


def synthetic_base(config, quant: str, seed: int = 0):
  """A random base in its final device layout, leaf by leaf, without a host copy or a bf16 detour.

  Quantized leaves get random codes and scales with a realistic magnitude (weights ~0.02): speed does not
  depend on the values, and drawing bytes directly lets 32B/72B shapes be built on one GPU.
  """
  import jax
  import jax.numpy as jnp
  from qerl_jax.model.base import empty_base, schemes_for

  abstract = jax.eval_shape(lambda: empty_base(config, schemes_for(config, quant)))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  out = []
  for (path, spec), key in zip(leaves, keys):
    name = jax.tree_util.keystr(path)
    shape, dtype = spec.shape, jnp.dtype(spec.dtype)
    fill = jax.jit(_filler(name, dtype), static_argnums=(1,))
    out.append(fill(key, shape))
  return jax.tree_util.tree_unflatten(treedef, out)


def _filler(name: str, dtype):
  import jax
  import jax.numpy as jnp

  def fill(key, shape):
    if dtype == jnp.uint8:
      return jax.random.bits(key, shape, jnp.uint8)
    if dtype == jnp.float8_e4m3fn:  # block scales; with global scale 100 the weights are ~0.01-0.05
      return jax.random.uniform(key, shape, jnp.float32, 0.5, 2.0).astype(dtype)
    if "global_scale" in name:
      return jnp.full(shape, 100.0, dtype)
    if "norm" in name:
      return jnp.ones(shape, dtype)
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
  return fill


def copy_bandwidth(gib: float = 4.0) -> float:
  """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of 20. Off a GPU (the benches' CPU
  smoke runs, whose rooflines mean nothing) over at most 16 MiB: 21 copies of 2 GiB took a smoke test ~70 s."""
  import jax
  import jax.numpy as jnp
  if jax.devices()[0].platform != "gpu":
    gib = min(gib, 1 / 64)
  x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
  copy = jax.jit(lambda a: a * 1.0000001)
  copy(x).block_until_ready()
  times = []
  for _ in range(20):
    t0 = time.perf_counter()
    copy(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2 * x.nbytes / statistics.median(times)


def run_one(args):
  """One (model, quant) in this process, batches in ascending order; yields a JSON record per batch.

  The model is built once; peak memory after each batch is that batch's (batches grow, so does the peak).
  """
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from qerl_jax.model import Transformer
  from qerl_jax.model.linear import LoraConfig
  from qerl_jax.quant.types import nbytes

  config = model_config(args.model).replace(decode_attention=args.decode_attention, decode_layers=args.decode_layers,
                                            fused_lora=args.fused_lora, gemv_lora_xa=args.gemv_lora_xa,
                                            decode_partials_tiles=args.decode_partials_tiles,
                                            decode_norm_fold=args.decode_norm_fold,
                                            rollout_base_dtype=args.rollout_base_dtype,
                                            rollout_merged_launches=merged_groups(args.merged_launches, args.quant))
  base = synthetic_base(config, args.quant)
  lora = LoraConfig(rank=16, alpha=16, dtype=jnp.bfloat16)
  model = Transformer(config, base, lora=lora, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  weight_bytes = nbytes(base)
  del base
  bw = copy_bandwidth() if jax.default_backend() == "gpu" else float("nan")
  for batch in sorted(args.batches):
    yield _time_rollout(args, config, graphdef, state, weight_bytes, bw, batch)


def _time_rollout(args, config, graphdef, state, weight_bytes, bw, batch):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import qerl_kernels as kernels
  from qerl_jax.rollout.engine import rollout
  from qerl_jax.rollout.sampling import SamplingParams
  prompt_len, new = args.prompt_len, args.new_tokens
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(0, config.vocab_size, (batch, prompt_len)), jnp.int32)
  valid = jnp.ones((batch, prompt_len), bool)
  sampling = SamplingParams(temperature=1.0)

  def go(seed):
    out = rollout(graphdef, state, prompt, valid, jax.random.key(seed), None, sampling=sampling,
                  max_new_tokens=new, stop_ids=(), pad_id=0)
    return out.tokens_BxN.block_until_ready()

  t0 = time.perf_counter()
  go(0)
  compile_s = time.perf_counter() - t0
  times = []
  for rep in range(args.reps):
    t0 = time.perf_counter()
    go(rep + 1)
    times.append(time.perf_counter() - t0)
  sec = statistics.median(times)
  stats = jax.devices()[0].memory_stats() or {}
  kv_bytes_avg = (2 * config.num_layers * batch * (prompt_len + new / 2) * config.num_kv_heads
                  * config.head_dim * 2)
  floor_ms = (weight_bytes + kv_bytes_avg) / bw * 1e3
  return dict(model=args.model, quant=args.quant, batch=batch, prompt_len=prompt_len, new_tokens=new,
              tokens_per_s=batch * new / sec, ms_per_step=sec / new * 1e3, rollout_s=sec, compile_s=compile_s,
              peak_gb=stats.get("peak_bytes_in_use", 0) / 1e9, weight_gb=weight_bytes / 1e9,
              floor_ms_per_step=floor_ms, copy_gbps=bw / 1e9, lora_rank=16, reps=args.reps,
              device=jax.devices()[0].device_kind, jax=jax.__version__,
              decode_attention=args.decode_attention, decode_layers=args.decode_layers, fused_lora=args.fused_lora,
              gemv_lora_xa=args.gemv_lora_xa, rollout_base_dtype=args.rollout_base_dtype,
              decode_partials_tiles=args.decode_partials_tiles, decode_norm_fold=args.decode_norm_fold,
              rollout_merged_launches=",".join(config.merged_launch_groups),
              xla_flags=os.environ.get("XLA_FLAGS", ""),
              kernel_tuning=kernel_tuning(), xla_dequant=kernels.xla_dequant())


def merged_groups(spec: str, quant: str) -> tuple[str, ...] | None:
  """--merged-launches as ModelConfig.rollout_merged_launches ("auto" -> None, the default; "none" -> ()), and
  () for a bf16 base, which has nothing to merge."""
  from qerl_jax.model.config import parse_merged_launches
  return parse_merged_launches(spec) if quant == "nvfp4" else ()


def run_hf(args):
  """transformers' generate on the same shape, bf16, random init, no LoRA (the peer); a record per batch."""
  import torch
  import transformers
  spec = QWEN25[args.model]
  cfg = transformers.Qwen2Config(
    vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"], intermediate_size=spec["intermediate_size"],
    num_hidden_layers=spec["num_layers"], num_attention_heads=spec["num_heads"],
    num_key_value_heads=spec["num_kv_heads"], tie_word_embeddings=spec["tie_word_embeddings"],
    rope_theta=1e6, max_position_embeddings=32768, torch_dtype=torch.bfloat16)
  torch.manual_seed(0)
  with torch.device(_torch_device()):
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
  for batch in sorted(args.batches):
    yield _time_hf(args, model, spec, batch)


def _torch_device() -> str:
  import torch
  return "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only for the smoke test


def _time_hf(args, model, spec, batch):
  import torch
  import transformers
  cuda = _torch_device() == "cuda"
  sync = torch.cuda.synchronize if cuda else lambda: None
  prompt = torch.randint(0, spec["vocab_size"], (batch, args.prompt_len), device=_torch_device())
  kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=True, temperature=1.0,
            top_k=0, top_p=1.0, pad_token_id=0)
  with torch.no_grad():
    model.generate(prompt, **dict(kw, max_new_tokens=8, min_new_tokens=8))
    sync()
    if cuda:
      torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(max(1, args.reps - 1)):
      t0 = time.perf_counter()
      model.generate(prompt, **kw)
      sync()
      times.append(time.perf_counter() - t0)
  sec = statistics.median(times)
  return dict(model=args.model, quant="hf-bf16", batch=batch, prompt_len=args.prompt_len,
              new_tokens=args.new_tokens, tokens_per_s=batch * args.new_tokens / sec,
              ms_per_step=sec / args.new_tokens * 1e3, rollout_s=sec,
              peak_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0, lora_rank=0, reps=len(times),
              device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
              transformers=transformers.__version__)


def add_per_run_flags(p: argparse.ArgumentParser) -> None:
  """The hidden flags the parent passes to each run's subprocess (``--one --model M --quant Q``)."""
  p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--model", help=argparse.SUPPRESS)
  p.add_argument("--quant", help=argparse.SUPPRESS)


def refuse_per_run_flags(p: argparse.ArgumentParser, args) -> None:
  """A --model or --quant typed for --models / --quants would be ignored and the defaults run: refuse it."""
  if not args.one and (args.model or args.quant):
    p.error("--model and --quant are the per-run flags of the subprocess; use --models and --quants")


def _joined_flag_values(argv: list[str]) -> list[str]:
  """argv with "--xla-flag-sets --xla_x=1" as "--xla-flag-sets=--xla_x=1": argparse takes a value that starts
  with "--" for an option and stops, so a lone flag set would otherwise need the "=" form."""
  out = list(argv)
  for i, arg in enumerate(out[:-1]):
    if arg == "--xla-flag-sets" and out[i + 1].startswith("--xla"):
      out[i:i + 2] = [f"{arg}={out[i + 1]}"]
      break
  return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  # No abbreviations (allow_abbrev=False): "--model" must not stand for "--models" or the reverse.
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                              allow_abbrev=False)
  p.add_argument("--models", nargs="+", default=["qwen2.5-7b"], choices=sorted(QWEN25))
  p.add_argument("--quants", nargs="+", default=["bf16", "nvfp4"], choices=["bf16", "nvfp4", "hf-bf16"])
  p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
  p.add_argument("--prompt-len", type=int, default=256)
  p.add_argument("--new-tokens", type=int, default=1024)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--out", default=None,
                 help="JSON lines file (default experiments/results/rollout.jsonl; with --smoke, none)")
  p.add_argument("--decode-attention", default="auto", choices=["xla", "pallas", "auto"],
                 help="one-token attention: XLA's, the Pallas kernel that reads the layer's cache in place "
                      "(qerl_kernels/decode_attention.py), or auto (the kernel on a GPU: ModelConfig's default)")
  p.add_argument("--decode-layers", default="unrolled", choices=["unrolled", "scan"],
                 help="the rollout's layer loop (ModelConfig.decode_layers): per-layer buffers or the stacked scan")
  p.add_argument("--fused-lora", action=argparse.BooleanOptionalAction, default=True,
                 help="NVFP4: bias and LoRA product in the matmul kernel's epilogue at decode rows "
                      "(ModelConfig.fused_lora; the default)")
  p.add_argument("--gemv-lora-xa", action=argparse.BooleanOptionalAction, default=True,
                 help="NVFP4: x @ A in the gemv's launch at decode rows (ModelConfig.gemv_lora_xa; the default)")
  p.add_argument("--decode-partials-tiles", action=argparse.BooleanOptionalAction, default=False,
                 help="NVFP4: the tile launches' partials to the decode kernels at 3-16 rows "
                      "(ModelConfig.decode_partials_tiles; off by default)")
  p.add_argument("--decode-norm-fold", action=argparse.BooleanOptionalAction, default=False,
                 help="NVFP4: the gemv after a block's end reads its pending RMSNorm (ModelConfig.decode_norm_fold; "
                      "off by default)")
  p.add_argument("--rollout-base-dtype", default="", choices=["", "bfloat16"],
                 help="NVFP4: dequantize the base once per rollout into a bf16 copy "
                      "(ModelConfig.rollout_base_dtype; '' = the fused kernels, the default)")
  p.add_argument("--merged-launches", default="auto", metavar="GROUPS",
                 help="NVFP4: comma-separated groups (qkv, gate_up) run as one launch each, the members read in "
                      "place (ModelConfig.rollout_merged_launches; auto = both, the default; none = one launch "
                      "per projection)")
  p.add_argument("--xla-flag-sets", default="", metavar="SETS",
                 help="'|'-separated sets of XLA flags, one run of everything per set, each added to XLA_FLAGS "
                      "and recorded as xla_flags; e.g. '|--xla_gpu_enable_command_buffer=FUSION,CUBLAS,WHILE' "
                      "runs the default, then the same with command buffers")
  p.add_argument("--smoke", action="store_true", help="tiny model, few tokens: checks the script runs")
  add_per_run_flags(p)
  args = p.parse_args(_joined_flag_values(sys.argv[1:] if argv is None else argv))
  refuse_per_run_flags(p, args)
  return args


def main():
  args = parse_args()
  if args.one:
    for record in (run_hf(args) if args.quant == "hf-bf16" else run_one(args)):
      print("RECORD " + json.dumps(record), flush=True)
    return
  if args.out is None and not args.smoke:  # smoke numbers are not results
    args.out = os.path.join(ROOT, "experiments", "results", "rollout.jsonl")
  if args.smoke:
    args.models, args.batches, args.new_tokens, args.prompt_len, args.reps = ["smoke"], [2], 8, 16, 1
  base_env = dict(os.environ,
                  XLA_PYTHON_CLIENT_MEM_FRACTION=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92"))
  rows = []
  flag_sets = [f.strip() for f in args.xla_flag_sets.split("|")]
  runs = [(flags, model, quant) for flags in flag_sets for model in args.models for quant in args.quants]
  for flags, model, quant in runs:
    env = dict(base_env, XLA_FLAGS=" ".join(f for f in (base_env.get("XLA_FLAGS", ""), flags) if f))
    cmd = [sys.executable, os.path.abspath(__file__), "--one", "--model", model, "--quant", quant,
           "--batches", *map(str, args.batches), "--prompt-len", str(args.prompt_len), "--new-tokens",
           str(args.new_tokens), "--reps", str(args.reps),
           "--decode-attention", args.decode_attention, "--decode-layers", args.decode_layers,
           "--fused-lora" if args.fused_lora else "--no-fused-lora",
           "--gemv-lora-xa" if args.gemv_lora_xa else "--no-gemv-lora-xa",
           "--decode-partials-tiles" if args.decode_partials_tiles else "--no-decode-partials-tiles",
           "--decode-norm-fold" if args.decode_norm_fold else "--no-decode-norm-fold",
           "--rollout-base-dtype", args.rollout_base_dtype, "--merged-launches", args.merged_launches]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # records arrive as each batch finishes, so a time-out keeps what ran
      if not line.startswith("RECORD "):
        continue
      record = json.loads(line[len("RECORD "):])
      record["commit"] = commit()
      rows.append(record)
      if args.out:
        append_records(args.out, [record])
      print(f"{args.decode_layers:8s} {model:12s} {quant:8s} b{record['batch']:<3d} "
            f"{record['tokens_per_s']:9.1f} tok/s {record['ms_per_step']:7.2f} ms/step "
            f"peak {record['peak_gb']:6.1f} GB {flags}", flush=True)
    if proc.wait():
      print(f"FAILED {model} {quant} {flags}:\n{proc.stderr.read()[-3000:]}", flush=True)
  print(f"\n{'model':12s} {'quant':8s} {'batch':>5s} {'tok/s':>9s} {'ms/step':>8s} {'floor':>7s} {'peak GB':>8s}"
        " XLA_FLAGS")
  for r in rows:
    floor = r.get("floor_ms_per_step", float("nan"))
    print(f"{r['model']:12s} {r['quant']:8s} {r['batch']:5d} {r['tokens_per_s']:9.1f} {r['ms_per_step']:8.2f} "
          f"{floor:7.2f} {r['peak_gb']:8.1f} {r.get('xla_flags', '')}")
  for flags in sorted({r.get("xla_flags", "") for r in rows}):
    for model in args.models:
      for batch in args.batches:
        by = {r["quant"]: r["tokens_per_s"] for r in rows
              if r["model"] == model and r["batch"] == batch and r.get("xla_flags", "") == flags}
        if "bf16" in by and "nvfp4" in by:
          print(f"{model} batch {batch} [{flags}]: nvfp4 / bf16 = {by['nvfp4'] / by['bf16']:.2f}x", end="")
          print(f", nvfp4 / hf-bf16 = {by['nvfp4'] / by['hf-bf16']:.2f}x" if "hf-bf16" in by else "")


if __name__ == "__main__":
  main()
