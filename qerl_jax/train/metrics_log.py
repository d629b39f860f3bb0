"""Where a run's numbers go: a progress bar, workdir/metrics.jsonl, TensorBoard events, and a PNG of curves.

One JSON object per step (all floats, plus "step"); on resume the file is cut back to the checkpoint's
step first, so it reads like one uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
from typing import Mapping

import tqdm

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
# What the progress bar shows (metric name -> short label).
BAR_FIELDS = {"reward/mean": "reward", "accuracy": "acc", "response_length/mean": "len", "tokens_per_s": "tok/s"}


def read_metrics(path: str) -> list[dict]:
  """The metric lines of a metrics.jsonl (a missing file is an empty run)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def truncate_metrics(path: str, last_step: int) -> int:
  """Drops lines with step > last_step (written after the checkpoint a run resumes from); returns kept count."""
  rows = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
  if os.path.exists(path):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      for r in rows:
        f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)
  return len(rows)


def _json_float(x: float):
  x = float(x)
  return x if math.isfinite(x) else str(x)  # JSON has no NaN/Inf; keep them visible as strings


class MetricsLogger:
  """Writes each step's metrics to metrics.jsonl and TensorBoard and advances the progress bar."""

  def __init__(self, workdir: str, total_steps: int, start_step: int = 0, tensorboard: bool = True,
               progress: bool = True):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, METRICS_FILE)
    truncate_metrics(self.path, start_step)
    self._file = open(self.path, "a")
    self._writer = None
    if tensorboard:
      from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
      self._writer = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=start_step + 1)
    self._bar = tqdm.tqdm(total=total_steps, initial=start_step, desc="qerl", dynamic_ncols=True,
                          disable=not progress)

  def write(self, step: int, metrics: Mapping[str, float]) -> dict:
    row = {"step": int(step), **{k: _json_float(v) for k, v in sorted(metrics.items())}}
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    if self._writer is not None:
      for name, value in metrics.items():
        self._writer.add_scalar(name, float(value), int(step))
      self._writer.flush()
    shown = {label: f"{float(metrics[name]):.3g}" for name, label in BAR_FIELDS.items() if name in metrics}
    self._bar.set_postfix(shown, refresh=False)
    self._bar.update(int(step) - self._bar.n)
    return row

  def message(self, text: str) -> None:
    self._bar.write(text)

  def close(self) -> None:
    self._bar.close()
    self._file.close()
    if self._writer is not None:
      self._writer.close()


def plot_curves(metrics_path: str, out_png: str,
                names: tuple[str, ...] = ("reward/mean", "accuracy", "entropy", "response_length/mean")) -> str:
  """A PNG with one panel per metric against the step (Agg backend: no display needed). Returns its path."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  rows = read_metrics(metrics_path)
  fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.2), squeeze=False)
  for ax, name in zip(axes[0], names):
    pts = [(r["step"], r[name]) for r in rows if isinstance(r.get(name), (int, float))]
    if pts:
      xs, ys = zip(*pts)
      ax.plot(xs, ys, lw=1, alpha=0.5)
      if len(ys) >= 5:  # a centred moving average makes the trend readable over noisy RL steps
        w = max(2, len(ys) // 10)
        smooth = [sum(ys[max(0, i - w):i + w + 1]) / len(ys[max(0, i - w):i + w + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, lw=2)
    ax.set_title(name)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out_png, dpi=100)
  plt.close(fig)
  return out_png
