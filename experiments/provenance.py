"""Which code a result came from: the commit every benchmark and study records with its numbers."""

from __future__ import annotations

import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commit() -> str:
  """QERL_COMMIT when set, else git HEAD (with "-dirty" when the library, kernels or configs differ from it).

  The variable comes first because the GPU machine's copy of the tree can carry a .git whose HEAD is not the
  commit of the files it runs. "unknown" outside a checkout.
  """
  if os.environ.get("QERL_COMMIT"):
    return os.environ["QERL_COMMIT"]
  try:
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "qerl_jax", "qerl_kernels", "configs"],
                           cwd=ROOT, capture_output=True).returncode
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head + ("-dirty" if dirty else "")


def kernel_tuning() -> str:
  """The kernels' tuning a run used: the QERL_KERNEL_TUNING file when set (a variant tried without editing the
  shipped one, e.g. "xla_dequant": "pallas"), else "shipped". A/B records tell their arms apart by it."""
  return os.environ.get("QERL_KERNEL_TUNING", "") or "shipped"


def append_records(path: str, records) -> None:
  """Appends each record as one JSON line to ``path`` (folders made as needed): how every benchmark keeps its
  results, so a later run adds to a file and never rewrites what an earlier one measured."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "a") as f:
    for record in records:
      f.write(json.dumps(record) + "\n")
