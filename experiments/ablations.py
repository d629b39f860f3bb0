r"""The paper's ablations at small scale: one registry of studies, each a few variants of config overrides.

Every variant is a list of (dotted config key, value) overrides on top of the embedded default
(configs/smollm2_135m.py: SmolLM2-135M, NVFP4 + LoRA + AQN, offline arithmetic task). Each (variant, seed)
trains in its own workdir through `qerl_jax.train.train_and_evaluate`, then its per-step metrics are
appended to one JSON-lines file, each line tagged with study, variant, seed and the git commit.

Commands:
  python -m experiments.ablations --study formats --seeds 3 --out experiments/results/ablations/formats.jsonl
  python -m experiments.ablations --study lora_rank --smoke   # CI: 2 variants x 1 seed x 2 steps, tiny random
  python -m experiments.plot_ablations experiments/results/ablations/*.jsonl

Machine: the full mode is sized for 2 CPU cores (about 19 s per step, 30 steps per run: ~10 minutes per
(variant, seed); "formats" with 3 seeds is ~2.5 hours). A run killed midway resumes from its workdir
(--workdir_root; run the same command again).
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
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Sequence

if __package__ in (None, ""):  # `python experiments/ablations.py`: make the repo root importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import common  # noqa: E402
from configs import smollm2_135m  # noqa: E402

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


def variant_config(study: str, variant: str, seed: int, *, smoke: bool, steps: int | None = None):
  """The config of one (study, variant, seed): the embedded default (or its smoke shrink) + overrides."""
  if study not in STUDIES:
    raise ValueError(f"{study=} must be one of {sorted(STUDIES)}")
  variants = STUDIES[study].variants
  if variant not in variants:
    raise ValueError(f"{variant=} is not a variant of {study}; known: {list(variants)}")
  c = smollm2_135m.get_config("smoke" if smoke else None)
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


def git_commit() -> str:
  """The repository's HEAD (with "-dirty" when tracked files differ), or "unknown" outside a checkout."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "qerl_jax", "configs"], cwd=root).returncode
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head + ("-dirty" if dirty else "")


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


def run_one(study: str, variant: str, seed: int, *, out: str, workdir: str, smoke: bool,
            steps: int | None = None, commit: str | None = None) -> list[dict]:
  """Trains one (variant, seed) in `workdir` and writes its per-step lines to `out`; returns them."""
  from qerl_jax.train import train_and_evaluate  # pylint: disable=import-outside-toplevel
  from qerl_jax.train.metrics_log import METRICS_FILE, read_metrics  # pylint: disable=import-outside-toplevel

  config = variant_config(study, variant, seed, smoke=smoke, steps=steps)
  last = train_and_evaluate(config, workdir)
  tag = {"study": study, "variant": variant, "seed": seed, "commit": commit or git_commit(),
         "smoke": smoke, "quant": config.model.quant}
  rows = [{**tag, **row} for row in read_metrics(os.path.join(workdir, METRICS_FILE))]
  if not rows:
    raise RuntimeError(f"{workdir} has no metrics after training {study}/{variant} seed {seed}")
  report = last.get("eval") or {}
  for key, value in report.items():  # held-out pass@k of the final policy rides on the last step's line
    if key.startswith("pass@") or key == "mean_reward":
      rows[-1][f"eval/{key}"] = float(value)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  _replace_run_lines(out, study, variant, seed, rows)
  return rows


def run_study(study: str, *, seeds: int, out: str, workdir_root: str, smoke: bool, steps: int | None = None,
              variants: Sequence[str] | None = None, log=print) -> list[dict]:
  """Runs every (variant, seed) of a study (smoke: its two smoke variants) and returns all lines written."""
  if study not in STUDIES:
    raise ValueError(f"{study=} must be one of {sorted(STUDIES)}")
  if seeds <= 0:
    raise ValueError(f"{seeds=} must be > 0")
  names = list(variants or (STUDIES[study].smoke if smoke else STUDIES[study].variants))
  commit = git_commit()
  rows = []
  for variant in names:
    for seed in range(seeds):
      workdir = os.path.join(workdir_root, f"{variant}_seed{seed}")
      log(f"[{study}] {variant} seed {seed} -> {workdir}")
      rows += run_one(study, variant, seed, out=out, workdir=workdir, smoke=smoke, steps=steps, commit=commit)
  return rows


def main(argv: Sequence[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--study", required=True, choices=sorted(STUDIES))
  p.add_argument("--seeds", type=int, default=None, help="seeds per variant (default 3; smoke 1)")
  p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the config's; smoke 2)")
  p.add_argument("--smoke", action="store_true", help="tiny random model, 2 variants, 1 seed, 2 steps")
  p.add_argument("--variants", default="", help="comma-separated subset of the study's variants")
  p.add_argument("--out", default="", help="JSON lines (default experiments/results/ablations/STUDY.jsonl)")
  p.add_argument("--workdir_root", default="",
                 help="per-run workdirs (checkpoints; default $TMPDIR/qerl_ablations/STUDY, outside the repo)")
  args = p.parse_args(argv)
  suffix = "_smoke" if args.smoke else ""
  out = args.out or os.path.join(RESULTS_DIR, f"{args.study}{suffix}.jsonl")
  root = args.workdir_root or os.path.join(tempfile.gettempdir(), "qerl_ablations", args.study + suffix)
  seeds = args.seeds if args.seeds is not None else (1 if args.smoke else 3)
  variants = [v.strip() for v in args.variants.split(",") if v.strip()] or None
  rows = run_study(args.study, seeds=seeds, out=out, workdir_root=root, smoke=args.smoke, steps=args.steps,
                   variants=variants)
  print(f"wrote {len(rows)} lines to {out}")


if __name__ == "__main__":
  main()
