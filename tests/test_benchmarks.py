"""The GPU benchmark scripts run end to end on tiny shapes on the CPU and write the fields the issues ask for.

The numbers themselves only mean something on a GPU; these runs keep the scripts from rotting between GPU
sessions (a broken benchmark costs device time to discover) and check that every kernel they time passed
its float32 check first.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_bench_kernels_times_tile_gemv_and_xla_paths_after_checking_them(tmp_path, monkeypatch):
  from experiments import bench_kernels
  monkeypatch.setattr(bench_kernels, "GEMV_CANDIDATES", bench_kernels.GEMV_CANDIDATES[:1])  # interpret mode is slow
  out = tmp_path / "kernels.jsonl"
  # 8 rows: the tile kernel's default forward, every gemv candidate (<= 16 rows) and the XLA path.
  bench_kernels.main(["--interpret", "--models", "tiny", "--layers", "down", "--rows", "8",
                      "--gemv", "--xla", "--out", str(out)])
  records = _lines(out)
  engines = {(r["direction"], r["config"].get("engine", "tensorcore")) for r in records}
  assert {("fwd", "tensorcore"), ("fwd", "gemv"), ("fwd", "xla"), ("bwd", "tensorcore"), ("bwd", "xla")} <= engines
  for r in records:
    for field in ("shape", "rows", "k", "n", "direction", "us", "bf16_us", "roofline_frac", "implementation",
                  "commit", "device"):
      assert field in r, field
    assert r["shape"] == "qwen2.5-tiny.down" and (r["k"], r["n"]) == (96, 64)
    if r["implementation"] == "pallas":
      assert r["check_rel_err"] < 1e-2


def test_bench_layer_slicing_counts_the_slices_of_each_form(tmp_path):
  from experiments import bench_layer_slicing
  out = tmp_path / "slicing.jsonl"
  records = bench_layer_slicing.main(["--layers", "2", "--k", "64", "--n", "128", "--rows", "1", "--passes", "1",
                                      "--out", str(out)])
  forms = {(r["format"], r["form"]): r for r in records}
  assert set(forms) == {("bf16", "scan"), ("bf16", "list"), ("nvfp4", "scan"), ("nvfp4", "list"),
                        ("nvfp4", "in_place")}
  assert forms[("bf16", "scan")]["hlo"]["dynamic_slice"] > 0  # the scan slices its stacked weights
  assert forms[("bf16", "list")]["hlo"]["dynamic_slice"] == 0
  assert len(_lines(out)) == 5


def _run(script, tmp_path, name):
  out = tmp_path / f"{name}.jsonl"
  subprocess.run([sys.executable, os.path.join(ROOT, "experiments", script), "--smoke", "--out", str(out)],
                 check=True, cwd=ROOT, env=dict(os.environ, QERL_COMMIT="test"), capture_output=True, text=True)
  return _lines(out)


# The two subprocess smoke runs take ~55 s together: run by hand (`pytest -m slow tests/test_benchmarks.py`).
@pytest.mark.slow
def test_bench_rollout_smoke_writes_one_line_per_quant(tmp_path):
  records = _run("bench_rollout.py", tmp_path, "rollout")
  assert sorted(r["quant"] for r in records) == ["bf16", "nvfp4"]
  for r in records:
    for field in ("model", "quant", "batch", "new_tokens", "tokens_per_s", "peak_gb", "commit", "device"):
      assert field in r, field
    assert r["commit"] == "test" and r["tokens_per_s"] > 0 and r["batch"] == 2


@pytest.mark.slow
def test_bench_grpo_step_smoke_writes_the_phase_split(tmp_path):
  records = _run("bench_grpo_step.py", tmp_path, "grpo")
  assert sorted(r["quant"] for r in records) == ["bf16", "nvfp4"]
  for r in records:
    for field in ("model", "quant", "devices", "step_s", "rollout_s", "logprob_s", "update_s", "peak_gb",
                  "commit", "device", "loss", "plan_gb"):
      assert field in r, field
    assert r["step_s"] >= r["rollout_s"] > 0 and r["commit"] == "test"
