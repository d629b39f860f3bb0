r"""The paper's ablations at small scale: one registry of studies, each a few variants of config overrides.

Every variant is a list of (dotted config key, value) overrides on top of the embedded default
(configs/smollm2_135m.py: SmolLM2-135M, NVFP4 + LoRA + AQN, offline arithmetic task). Each (variant, seed)
trains in its own workdir through `qerl_jax.train.train_and_evaluate`, then its per-step metrics are
appended to one JSON-lines file, each line tagged with study, variant, seed and the git commit.

Commands:
  python -m experiments.ablations --study formats --seeds 3 --out experiments/results/ablations/formats.jsonl
  python -m experiments.ablations --study lora_rank --smoke   # CI: 2 variants x 1 seed x 2 steps, tiny random
  python -m experiments.ablations --study all --preset gpu --jobs 12   # one H200: every study, 3 seeds
  python -m experiments.plot_ablations experiments/results/ablations/*.jsonl

Machines: the `cpu` preset is sized for 2 CPU cores (about 19 s per step, 30 steps per run: ~10 minutes per
(variant, seed); "formats" with 3 seeds is ~2.5 hours). The `gpu` preset is the same model, task, steps and
schedules with 8 prompts x 8 samples per step (4x the CPU batch: less noise) and a 128-problem held-out
evaluation; `--jobs N` trains N runs at once in separate processes (a 135M model leaves one H200 mostly
idle), seeds in the outer loop so that an interrupted sweep has whole seeds. Runs whose configs coincide
across studies (the default is nvfp4+aqn in "formats", exponential in "aqn_schedules", r16 in "lora_rank",
nvfp4@1e-05 in "learning_rate") train once and are written to each study, tagged `same_run_as`.
A run killed midway resumes from its workdir (--workdir_root; run the same command again).
Re-running a (variant, seed) replaces its lines in --out, so the file never holds a run twice.

The paper's claims each study checks (at 7B-32B, hundreds of steps; a 135M model over 30 steps may not
show them, and RESULTS.md says so where it does not):
  formats        NVFP4 LoRA reaches higher reward than bf16 LoRA and NF4 QLoRA at equal steps; AQN helps more.
  aqn_schedules  an exponential decay of the noise beats linear / cosine / logarithmic, and all beat no noise.
  learning_rate  quantized (NVFP4) training tolerates a higher learning rate than bf16 LoRA.
  lora_rank      rank matters little (16 ~ 128) for reward growth.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Sequence

if __package__ in (None, ""):  # `python experiments/ablations.py`: make the repo root importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import common  # noqa: E402
from configs import smollm2_135m  # noqa: E402
from experiments import provenance  # noqa: E402

Override = tuple[str, Any]
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "ablations")

# The embedded default trains a 135M model for 30 steps at a rate far above the paper's NVFP4 rate of 1e-5
# for 7B+ models; the learning-rate study scales the paper's grid by the same factor, so its middle point is
# the default (read from the config, so the grid follows when the default is retuned).
_DEFAULT = smollm2_135m.get_config()
SMALL_LR = _DEFAULT.train.learning_rate
# The rank study keeps the default's LoRA scale alpha / rank, so only the rank changes.
LORA_SCALE = _DEFAULT.model.lora_alpha / _DEFAULT.model.lora_rank
LR_SCALE = SMALL_LR / common.PAPER_LR["nvfp4"]
PAPER_LRS = (5e-6, 1e-5, 3e-5)
SMOKE_STEPS = 2
# Overrides per machine preset; "cpu" is the embedded default itself.
PRESETS: dict[str, tuple[Override, ...]] = {
  "cpu": (),
  # Micro-batches of 16 as on CPU: one of 64 needs a 15 GB temporary, too much for 15 runs sharing a GPU.
  "gpu": (("train.batch_size", 64), ("train.micro_batch_size", 16), ("eval.num_examples", 128)),
}


@dataclasses.dataclass(frozen=True)
class Study:
  """One comparison of the paper: named variants (override lists) and the two that smoke mode runs."""

  name: str
  claim: str
  variants: dict[str, tuple[Override, ...]]
  smoke: tuple[str, str]


def _quant(quant: str, aqn: bool) -> tuple[Override, ...]:
  return (("model.quant", quant), ("aqn.enabled", aqn))


def _lr_name(quant: str, paper_lr: float) -> str:
  return f"{quant}@{paper_lr:.0e}"


STUDIES = {s.name: s for s in (
  Study("formats", "NVFP4 LoRA > bf16 LoRA >= NF4 QLoRA in reward at equal steps; AQN adds to NVFP4",
        {"bf16": _quant("bf16", False), "nf4": _quant("nf4", False), "mxfp4": _quant("mxfp4", False),
         "nvfp4": _quant("nvfp4", False), "nvfp4+aqn": _quant("nvfp4", True)},
        smoke=("bf16", "nvfp4+aqn")),
  Study("aqn_schedules", "exponential noise decay >= linear / cosine / logarithmic > no noise (NVFP4)",
        {**{s: (*_quant("nvfp4", True), ("aqn.schedule", s))
            for s in ("exponential", "linear", "cosine", "logarithmic")},
         "off": _quant("nvfp4", False)},
        smoke=("cosine", "off")),
  Study("learning_rate", f"NVFP4 tolerates a higher rate than bf16 LoRA (paper grid x{LR_SCALE:g} for 135M)",
        {_lr_name(q, lr): (*_quant(q, q == "nvfp4"), ("train.learning_rate", lr * LR_SCALE))
         for q in ("bf16", "nvfp4") for lr in PAPER_LRS},
        smoke=(_lr_name("bf16", 3e-5), _lr_name("nvfp4", 3e-5))),
  Study("lora_rank", "reward growth changes little with the LoRA rank, 16 to 128 (NVFP4 + AQN)",
        {f"r{r}": (("model.lora_rank", r), ("model.lora_alpha", LORA_SCALE * r)) for r in (16, 32, 64, 128)},
        smoke=("r16", "r32")),
)}


def apply_overrides(config, overrides: Sequence[Override]) -> None:
  """Sets each dotted key of `config` (an ml_collections ConfigDict), refusing keys it does not have."""
  for key, value in overrides:
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
      if part not in node:
        raise KeyError(f"override {key=}: the config has no {part!r}")
      node = node[part]
    if leaf not in node:
      raise KeyError(f"override {key=}: the config has no {leaf!r}")
    node[leaf] = value


def variant_config(study: str, variant: str, seed: int, *, smoke: bool, steps: int | None = None,
                   preset: str = "cpu"):
  """The config of one (study, variant, seed): the embedded default (or its smoke shrink), the machine
  preset's overrides (not in smoke mode), then the variant's."""
  if study not in STUDIES:
    raise ValueError(f"{study=} must be one of {sorted(STUDIES)}")
  variants = STUDIES[study].variants
  if variant not in variants:
    raise ValueError(f"{variant=} is not a variant of {study}; known: {list(variants)}")
  if preset not in PRESETS:
    raise ValueError(f"{preset=} must be one of {sorted(PRESETS)}")
  c = smollm2_135m.get_config("smoke" if smoke else None)
  if not smoke:
    apply_overrides(c, PRESETS[preset])
  apply_overrides(c, variants[variant])
  c.seed = seed
  if steps is not None:
    if steps <= 0:
      raise ValueError(f"{steps=} must be > 0")
    c.train.steps = steps
  elif smoke:
    c.train.steps = SMOKE_STEPS
  if smoke:  # only the curves matter here: no held-out eval, no samples file, one checkpoint at the end
    c.eval.at_end = False
    c.train.log_samples = 0
    c.train.checkpoint_every = c.train.steps  # (shrink_to_smoke keeps truncated completions in the loss)
  return c


def _replace_run_lines(out: str, study: str, variant: str, seed: int, rows: list[dict]) -> None:
  """Rewrites `out` without this (study, variant, seed)'s old lines, then appends its new ones."""
  kept = []
  if os.path.exists(out):
    with open(out) as f:
      for line in f:
        if not line.strip():
          continue
        row = json.loads(line)
        if (row.get("study"), row.get("variant"), row.get("seed")) != (study, variant, seed):
          kept.append(line if line.endswith("\n") else line + "\n")
  tmp = out + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(kept)
    for row in rows:
      f.write(json.dumps(row) + "\n")
  os.replace(tmp, out)


@dataclasses.dataclass(frozen=True)
class Job:
  """One training run: a seed and every (study, variant) whose config it is; the first one trains."""

  names: tuple[tuple[str, str], ...]
  seed: int


def plan_jobs(studies: Sequence[str], seeds: int, *, smoke: bool, steps: int | None = None, preset: str = "cpu",
              variants: Sequence[str] | None = None) -> list[Job]:
  """The runs of `studies` (smoke: each study's two smoke variants), one per distinct config, seeds outermost."""
  if seeds <= 0:
    raise ValueError(f"{seeds=} must be > 0")
  if variants and len(studies) != 1:
    raise ValueError(f"--variants {list(variants)} needs exactly one study, got {list(studies)}")
  by_config: dict[str, list[tuple[str, str]]] = {}
  for study in studies:
    if study not in STUDIES:
      raise ValueError(f"{study=} must be one of {sorted(STUDIES)}")
    for variant in variants or (STUDIES[study].smoke if smoke else STUDIES[study].variants):
      key = variant_config(study, variant, 0, smoke=smoke, steps=steps, preset=preset).to_json()
      by_config.setdefault(key, []).append((study, variant))
  return [Job(tuple(names), seed) for seed in range(seeds) for names in by_config.values()]


def train_run(study: str, variant: str, seed: int, *, workdir: str, smoke: bool, steps: int | None = None,
              preset: str = "cpu", commit: str | None = None) -> list[dict]:
  """Trains one (variant, seed) in `workdir`; returns its per-step lines, the final eval on the last one."""
  from qerl_jax.train import train_and_evaluate  # pylint: disable=import-outside-toplevel
  from qerl_jax.train.metrics_log import METRICS_FILE, read_metrics  # pylint: disable=import-outside-toplevel

  config = variant_config(study, variant, seed, smoke=smoke, steps=steps, preset=preset)
  last = train_and_evaluate(config, workdir)
  tag = {"study": study, "variant": variant, "seed": seed, "commit": commit or provenance.commit(),
         "smoke": smoke, "preset": preset, "quant": config.model.quant}
  rows = [{**tag, **row} for row in read_metrics(os.path.join(workdir, METRICS_FILE))]
  if not rows:
    raise RuntimeError(f"{workdir} has no metrics after training {study}/{variant} seed {seed}")
  report = last.get("eval") or {}
  for key, value in report.items():  # held-out pass@k of the final policy rides on the last step's line
    if key.startswith("pass@") or key == "mean_reward":
      rows[-1][f"eval/{key}"] = float(value)
  return rows


def write_run(rows: list[dict], job: Job, outs: dict[str, str]) -> None:
  """Writes a run's lines into the file of each (study, variant) it stands for, tagged with that name."""
  first = "/".join(job.names[0])
  for study, variant in job.names:
    same = {} if (study, variant) == job.names[0] else {"same_run_as": first}
    tagged = [{**r, "study": study, "variant": variant, **same} for r in rows]
    os.makedirs(os.path.dirname(os.path.abspath(outs[study])), exist_ok=True)
    _replace_run_lines(outs[study], study, variant, job.seed, tagged)


def _workdir(root: str, job: Job, multi: bool) -> str:
  study, variant = job.names[0]
  return os.path.join(root, (f"{study}." if multi else "") + f"{variant}_seed{job.seed}")


def _steps_written(outs: dict[str, str], preset: str, smoke: bool) -> collections.Counter:
  """{(study, variant, seed): step lines} already in the output files, for this preset and mode."""
  counts: collections.Counter = collections.Counter()
  for out in set(outs.values()):
    if os.path.exists(out):
      with open(out) as f:
        for line in f:
          r = json.loads(line) if line.strip() else {}
          if r and r.get("preset", "cpu") == preset and bool(r.get("smoke")) == smoke:
            counts[(r.get("study"), r.get("variant"), r.get("seed"))] += 1
  return counts


def _run_in_subprocess(job: Job, *, workdir: str, smoke: bool, steps: int | None, preset: str,
                       commit: str) -> list[dict]:
  """Trains `job` in a fresh Python process (its own device memory and compile) and returns its lines."""
  study, variant = job.names[0]
  os.makedirs(workdir, exist_ok=True)
  part = os.path.join(workdir, "lines.jsonl")
  cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--study", study, "--variants", variant,
         "--worker_seed", str(job.seed), "--preset", preset, "--out", part, "--workdir_root", workdir,
         "--commit", commit] + (["--steps", str(steps)] if steps is not None else [])
  cmd += ["--smoke"] if smoke else []
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # N processes share one GPU
  with open(os.path.join(workdir, "log.txt"), "w") as log:
    code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
  if code:
    with open(os.path.join(workdir, "log.txt")) as f:
      tail = f.read()[-3000:]
    raise RuntimeError(f"{study}/{variant} seed {job.seed} failed (exit {code}):\n{tail}")
  with open(part) as f:
    return [json.loads(line) for line in f if line.strip()]


def run_jobs(jobs: Sequence[Job], *, outs: dict[str, str], workdir_root: str, smoke: bool,
             steps: int | None = None, preset: str = "cpu", parallel: int = 1, time_budget_s: float | None = None,
             skip_done: bool = False, log=print) -> list[dict]:
  """Trains `jobs` (`parallel` at once, each in its own process when > 1) and writes their lines to `outs`.

  With `time_budget_s`, a job starts only while the time left exceeds the longest run so far (so the sweep
  ends inside the budget once one run has finished); `skip_done` passes over runs `outs` already holds in
  full. Returns the lines of the runs trained now (one copy per run, under its first name).
  """
  if parallel <= 0:
    raise ValueError(f"{parallel=} must be > 0")
  commit = provenance.commit()
  multi = len({s for job in jobs for s, _ in job.names}) > 1
  start = time.monotonic()
  run_steps = steps or (SMOKE_STEPS if smoke else smollm2_135m.get_config().train.steps)
  written_steps = _steps_written(outs, preset, smoke) if skip_done else collections.Counter()
  todo = [job for job in jobs if not (skip_done and all(
    written_steps[(s, v, job.seed)] >= run_steps for s, v in job.names))]
  if len(todo) < len(jobs):
    log(f"skipping {len(jobs) - len(todo)} runs already in the output files")
  lock = threading.Lock()
  written: list[dict] = []
  longest = [0.0]

  def one(job: Job) -> None:
    if time_budget_s is not None and time.monotonic() - start + longest[0] > time_budget_s:
      log(f"time budget: not starting {'/'.join(job.names[0])} seed {job.seed}")
      return
    workdir = _workdir(workdir_root, job, multi)
    t0 = time.monotonic()
    log(f"[{'/'.join(job.names[0])}] seed {job.seed} -> {workdir}")
    if parallel == 1:
      rows = train_run(*job.names[0], job.seed, workdir=workdir, smoke=smoke, steps=steps, preset=preset,
                       commit=commit)
    else:
      rows = _run_in_subprocess(job, workdir=workdir, smoke=smoke, steps=steps, preset=preset, commit=commit)
    with lock:
      write_run(rows, job, outs)
      written.extend(rows)
      longest[0] = max(longest[0], time.monotonic() - t0)
    also = ", ".join("/".join(name) for name in job.names[1:])
    log(f"done {'/'.join(job.names[0])} seed {job.seed} in {time.monotonic() - t0:.0f} s"
        + (f" (also {also})" if also else ""))

  if parallel == 1:
    for job in todo:
      one(job)
  else:  # a failed run does not stop the others; all failures are reported at the end
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
      futures = [pool.submit(one, job) for job in todo]
    failures = [f"{'/'.join(job.names[0])} seed {job.seed}: {future.exception()}"
                for job, future in zip(todo, futures) if future.exception() is not None]
    if failures:
      raise RuntimeError(f"{len(failures)} of {len(todo)} runs failed (the others' lines are written):\n"
                         + "\n".join(failures))
  return written


def run_study(study: str, *, seeds: int, out: str, workdir_root: str, smoke: bool, steps: int | None = None,
              variants: Sequence[str] | None = None, log=print) -> list[dict]:
  """Runs every (variant, seed) of a study (smoke: its two smoke variants) and returns all lines written."""
  jobs = plan_jobs([study], seeds, smoke=smoke, steps=steps, variants=variants)
  return run_jobs(jobs, outs={study: out}, workdir_root=workdir_root, smoke=smoke, steps=steps, log=log)


def main(argv: Sequence[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--study", required=True, choices=sorted(STUDIES) + ["all"])
  p.add_argument("--seeds", type=int, default=None, help="seeds per variant (default 3; smoke 1)")
  p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the config's; smoke 2)")
  p.add_argument("--smoke", action="store_true", help="tiny random model, 2 variants, 1 seed, 2 steps")
  p.add_argument("--preset", default="cpu", choices=sorted(PRESETS), help="machine preset (see the docstring)")
  p.add_argument("--jobs", type=int, default=1, help="runs trained at once, each in its own process")
  p.add_argument("--time_budget_s", type=float, default=None,
                 help="start a run only while the time left exceeds the longest run so far")
  p.add_argument("--skip_done", action="store_true", help="pass over runs the output files hold in full")
  p.add_argument("--variants", default="", help="comma-separated subset of the study's variants")
  p.add_argument("--out", default="",
                 help="JSON lines (default experiments/results/ablations/STUDY[_PRESET].jsonl); with "
                      "--study all, the folder for one file per study")
  p.add_argument("--workdir_root", default="",
                 help="per-run workdirs (checkpoints; default $TMPDIR/qerl_ablations/STUDY, outside the repo)")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one run, for --jobs > 1
  p.add_argument("--worker_seed", type=int, default=0, help=argparse.SUPPRESS)
  p.add_argument("--commit", default="", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  variants = [v.strip() for v in args.variants.split(",") if v.strip()] or None
  if args.worker:
    rows = train_run(args.study, variants[0], args.worker_seed, workdir=args.workdir_root, smoke=args.smoke,
                     steps=args.steps, preset=args.preset, commit=args.commit or None)
    with open(args.out, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
    return
  studies = sorted(STUDIES) if args.study == "all" else [args.study]
  suffix = "_smoke" if args.smoke else ("" if args.preset == "cpu" else f"_{args.preset}")
  if args.study == "all":
    folder = args.out or RESULTS_DIR
    outs = {s: os.path.join(folder, f"{s}{suffix}.jsonl") for s in studies}
  else:
    outs = {args.study: args.out or os.path.join(RESULTS_DIR, f"{args.study}{suffix}.jsonl")}
  root = args.workdir_root or os.path.join(tempfile.gettempdir(), "qerl_ablations", args.study + suffix)
  seeds = args.seeds if args.seeds is not None else (1 if args.smoke else 3)
  jobs = plan_jobs(studies, seeds, smoke=args.smoke, steps=args.steps, preset=args.preset, variants=variants)
  rows = run_jobs(jobs, outs=outs, workdir_root=root, smoke=args.smoke, steps=args.steps, preset=args.preset,
                  parallel=args.jobs, time_budget_s=args.time_budget_s, skip_done=args.skip_done)
  print(f"trained {len(rows)} step lines into {sorted(set(outs.values()))}")


if __name__ == "__main__":
  main()
