"""`python -m qerl_jax.main` from another directory: flags, locked configs, errors before any model loads."""

import os
import subprocess
import sys


def _run(args, cwd):
  return subprocess.run([sys.executable, "-m", "qerl_jax.main", *args], cwd=cwd, capture_output=True,
                        text=True, timeout=300)


def test_unknown_config_key_fails_at_parse(tmp_path):
  out = _run(["--config=configs/qwen7b.py:smoke", "--config.train.lernig_rate=1e-5",
              f"--workdir={tmp_path}/w"], cwd=tmp_path)
  assert out.returncode != 0
  assert "lernig_rate" in out.stderr
  assert not os.path.exists(tmp_path / "w")


def test_out_of_range_value_fails_before_loading(tmp_path):
  out = _run(["--config=configs/qwen7b.py:smoke", "--config.train.batch_size=10", f"--workdir={tmp_path}/w"],
             cwd=tmp_path)
  assert out.returncode != 0
  assert "train.batch_size=10 must be a positive multiple of rollout.samples_per_prompt=4" in out.stderr
  assert not os.path.exists(tmp_path / "w")
