r"""Ablation JSON lines -> one PNG per study (mean over seeds, min-max band) and a markdown table.

  python -m experiments.plot_ablations experiments/results/ablations/*.jsonl [--outdir DIR] [--window 10]
  python -m experiments.plot_ablations --entropy experiments/results/entropy.jsonl   # its table only

Each input line is one training step of one (study, variant, seed), as experiments/ablations.py writes
them. The table has, per variant, the number of seeds and the mean (± std over seeds) of reward, accuracy
and entropy averaged over the first and the last `window` steps: paste it into experiments/RESULTS.md.
Every seed that ran is counted; none is dropped.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from typing import Iterable, Sequence

import numpy as np

if __package__ in (None, ""):  # `python experiments/plot_ablations.py`: make the repo root importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.ablations import STUDIES  # noqa: E402

PANELS = (("reward/mean", "reward"), ("accuracy", "accuracy"), ("entropy", "entropy (nats)"),
          ("response_length/mean", "response length"))
REQUIRED = ("study", "variant", "seed", "step")


def read_lines(paths: Iterable[str]) -> list[dict]:
  """Every JSON line of `paths`, checked for the fields a plot needs (names the file and line if not)."""
  rows = []
  for path in paths:
    with open(path) as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        row = json.loads(line)
        missing = [k for k in REQUIRED if k not in row]
        if missing:
          raise ValueError(f"{path}:{n} lacks {missing}: not an ablation line")
        rows.append(row)
  return rows


def curves(rows: list[dict], study: str, metric: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """{variant: (steps_S, values_NxS)} of one study, N seeds, on the steps every seed of the variant logged."""
  by_variant = collections.defaultdict(lambda: collections.defaultdict(dict))
  for r in rows:
    if r["study"] == study and metric in r:
      by_variant[r["variant"]][r["seed"]][int(r["step"])] = float(r[metric])
  out = {}
  for variant, seeds in by_variant.items():
    steps = sorted(set.intersection(*(set(s) for s in seeds.values())))
    out[variant] = (np.array(steps), np.array([[seeds[s][t] for t in steps] for s in sorted(seeds)]))
  return out


def _variant_order(rows: list[dict], study: str) -> list[str]:
  """The study's variants in registry order (experiments/ablations.py), then any others as first seen."""
  seen = []
  for r in rows:
    if r["study"] == study and r["variant"] not in seen:
      seen.append(r["variant"])
  registry = list(STUDIES[study].variants) if study in STUDIES else []
  return [v for v in registry if v in seen] + [v for v in seen if v not in registry]


def _png_name(rows: list[dict], study: str) -> str:
  """STUDY.png for CPU-preset lines, STUDY_PRESET.png otherwise, so the presets' figures sit side by side."""
  presets = sorted({r.get("preset", "cpu") for r in rows if r["study"] == study})
  return f"{study}.png" if presets == ["cpu"] else f"{study}_{'_'.join(presets)}.png"


def plot_study(rows: list[dict], study: str, path: str) -> str:
  """Writes the study's PNG: one panel per metric, each variant's mean over seeds with its min-max band."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  order = _variant_order(rows, study)
  fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
  for ax, (metric, label) in zip(axes, PANELS):
    per_variant = curves(rows, study, metric)
    for variant in order:
      if variant not in per_variant:
        continue
      steps_S, values_NxS = per_variant[variant]
      n = values_NxS.shape[0]
      line, = ax.plot(steps_S, values_NxS.mean(0), label=f"{variant} (n={n})")
      if n > 1:
        ax.fill_between(steps_S, values_NxS.min(0), values_NxS.max(0), color=line.get_color(), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_title(label)
  axes[0].legend(fontsize=7)
  commits = sorted({r.get("commit", "?") for r in rows if r["study"] == study})
  fig.suptitle(f"{study} (mean over seeds, band = min..max; commit {', '.join(commits)})", fontsize=9)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def summary(rows: list[dict], study: str, window: int) -> list[dict]:
  """Per variant: seeds, and mean/std over seeds of each metric averaged over the first/last `window` steps."""
  out = []
  for variant in _variant_order(rows, study):
    entry = {"variant": variant}
    for metric in ("reward/mean", "accuracy", "entropy"):
      steps_S, values_NxS = curves(rows, study, metric)[variant]
      k = max(1, min(window, len(steps_S)))
      entry["seeds"] = values_NxS.shape[0]
      if metric == "reward/mean":  # the whole curve's height: how fast reward grew, not only where it ended
        per_seed_all = values_NxS.mean(1)
        entry["reward/mean/all"] = float(per_seed_all.mean())
        entry["reward/mean/all_std"] = float(per_seed_all.std(ddof=1)) if len(per_seed_all) > 1 else 0.0
      for where, cols in (("first", values_NxS[:, :k]), ("last", values_NxS[:, -k:])):
        per_seed = cols.mean(1)
        entry[f"{metric}/{where}"] = float(per_seed.mean())
        entry[f"{metric}/{where}_std"] = float(per_seed.std(ddof=1)) if len(per_seed) > 1 else 0.0
    evals = [r["eval/pass@1"] for r in rows
             if r["study"] == study and r["variant"] == variant and "eval/pass@1" in r]
    entry["eval/pass@1"] = float(np.mean(evals)) if evals else None
    out.append(entry)
  return out


def markdown_table(rows: list[dict], study: str, window: int) -> str:
  """The study's summary as a markdown table (mean ± std over seeds)."""
  def cell(e, key):
    return f"{e[key]:.3f} ± {e[key + '_std']:.3f}" if e["seeds"] > 1 else f"{e[key]:.3f}"

  lines = [f"**{study}** (first / last {window} steps; mean ± std over seeds)", "",
           "| variant | seeds | reward first | reward last | accuracy last | entropy first | entropy last "
           "| eval pass@1 | reward, all steps |",
           "|---|---|---|---|---|---|---|---|---|"]
  for e in summary(rows, study, window):
    pass1 = "n/a" if e["eval/pass@1"] is None else f"{e['eval/pass@1']:.3f}"
    lines.append(f"| {e['variant']} | {e['seeds']} | {cell(e, 'reward/mean/first')} | "
                 f"{cell(e, 'reward/mean/last')} | {cell(e, 'accuracy/last')} | {cell(e, 'entropy/first')} | "
                 f"{cell(e, 'entropy/last')} | {pass1} | {cell(e, 'reward/mean/all')} |")
  return "\n".join(lines)


def entropy_table(path: str) -> str:
  """The lines of experiments/entropy.py (one per format) as a markdown table."""
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  missing = [n for n, r in enumerate(rows, 1) if "format" not in r or "entropy" not in r]
  if missing:
    raise ValueError(f"{path}: lines {missing} are not experiments/entropy.py lines")
  lines = ["| format | mean token entropy | first-token entropy | sampled NLL | reward | accuracy | completions |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['format']} | {r['entropy']:.4f} | {r['first_token_entropy']:.4f} | "
                 f"{r['sampled_nll']:.4f} | {r['reward/mean']:.4f} | {r['accuracy']:.3f} | {r['num_completions']} |")
  return "\n".join(lines)


def plot_all(paths: Sequence[str], outdir: str, window: int = 10) -> tuple[list[str], str]:
  """A PNG per study found in `paths` (written to outdir/STUDY.png) and the markdown of all their tables."""
  rows = read_lines(paths)
  if not rows:
    raise ValueError(f"no ablation lines in {list(paths)}")
  studies = []
  for r in rows:
    if r["study"] not in studies:
      studies.append(r["study"])
  pngs = [plot_study(rows, s, os.path.join(outdir, _png_name(rows, s))) for s in studies]
  return pngs, "\n\n".join(markdown_table(rows, s, window) for s in studies)


def main(argv: Sequence[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("paths", nargs="*", help="JSON-lines files written by experiments/ablations.py")
  p.add_argument("--entropy", default="", help="also print the table of an experiments/entropy.py output")
  p.add_argument("--outdir", default="", help="where the PNGs go (default: beside the first input)")
  p.add_argument("--window", type=int, default=10, help="steps averaged at the start and the end")
  args = p.parse_args(argv)
  if args.window <= 0:
    raise ValueError(f"{args.window=} must be > 0")
  if not args.paths and not args.entropy:
    p.error("give ablation JSON-lines files and/or --entropy PATH")
  if args.entropy:
    print(entropy_table(args.entropy) + "\n")
  if args.paths:
    outdir = args.outdir or os.path.dirname(os.path.abspath(args.paths[0]))
    pngs, table = plot_all(args.paths, outdir, args.window)
    print(table)
    for png in pngs:
      print(f"wrote {png}", file=sys.stderr)


if __name__ == "__main__":
  main()
