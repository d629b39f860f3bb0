"""experiments/: the ablation registry and its smoke runs, the entropy-per-format script, the plot script
and the walkthrough notebook (executed in smoke mode).

Budget: < 100 s on 2 CPU cores. Smoke runs share compiled programs (the CPU configs keep a dequantized base,
so every format has the same shapes): formats, aqn_schedules and learning_rate (one recompile of the update
for the new lr schedule) run end to end here, in this process; lora_rank recompiles every program for each
adapter shape (~23 s) and `--jobs` starts worker processes that compile from scratch (~35 s), so those two
smoke runs are marked slow; every variant's config of every study is built and validated here.
"""

import json
import math
import os
import zlib

import numpy as np
import pytest

from configs import smollm2_135m
from experiments import ablations, entropy, plot_ablations
from qerl_jax.train import validate_config

STEP_FIELDS = ("study", "variant", "seed", "commit", "step", "reward/mean", "accuracy", "entropy",
               "response_length/mean", "aqn/sigma", "loss", "grad_norm", "lr")


def _rng(name):
  seed = zlib.crc32(name.encode())
  print(f"seed {seed}")
  return np.random.default_rng(seed)


def _read(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def smoke_ablations(tmp_path_factory):
  """The CLI's smoke mode of a study, run on first use into one results folder: study -> (out path, lines)."""
  root = tmp_path_factory.mktemp("ablations")
  out = {}

  def run(study):
    if study not in out:
      path = str(root / f"{study}.jsonl")
      # In this process, sharing compiled programs; --jobs (worker processes) is the slow test below.
      ablations.main(["--study", study, "--smoke", "--out", path, "--workdir_root", str(root / f"{study}_runs")])
      out[study] = (path, _read(path))
    return out[study]
  return run


# aqn_schedules runs the same CLI over other variants (~12 s): with `pytest -m slow`, CI being near its limit.
@pytest.mark.parametrize("study", ["formats", pytest.param("aqn_schedules", marks=pytest.mark.slow)])
def test_smoke_study_writes_step_lines(smoke_ablations, study):
  path, rows = smoke_ablations(study)
  smoke = ablations.STUDIES[study].smoke
  # 2 variants x 1 seed x 2 steps, in registry order.
  assert [(r["variant"], r["seed"], r["step"]) for r in rows] == [(v, 0, s) for v in smoke for s in (1, 2)]
  for r in rows:
    missing = [k for k in STEP_FIELDS if k not in r]
    assert not missing, missing
    assert r["study"] == study and r["smoke"] is True
    assert r["commit"] and r["commit"] != "unknown"
    numeric = {k: v for k, v in r.items() if isinstance(v, float)}
    assert all(math.isfinite(v) for v in numeric.values()), numeric
    # A tiny random policy is near uniform over SmolLM2's 49152 tokens.
    assert r["entropy"] > 0.9 * math.log(49152)
  by_variant = {v: [r for r in rows if r["variant"] == v] for v in smoke}
  if study == "formats":  # bf16 without AQN vs NVFP4 with it: the overrides reached the trainer
    assert {r["quant"] for r in by_variant["bf16"]} == {"bf16"}
    assert [r["aqn/sigma"] for r in by_variant["bf16"]] == [0.0, 0.0]
    assert {r["quant"] for r in by_variant["nvfp4+aqn"]} == {"nvfp4"}
  else:  # cosine AQN: stage 0 noise-free, then sigma_start (smoke: 3 stages over 2 steps); "off": none
    assert [r["aqn/sigma"] for r in by_variant["off"]] == [0.0, 0.0]
    assert by_variant["cosine"][0]["aqn/sigma"] == 0.0
    assert by_variant["cosine"][1]["aqn/sigma"] == pytest.approx(1e-2)
  # Each (variant, seed) trained in its own workdir next to the output.
  runs = os.path.join(os.path.dirname(path), f"{study}_runs")
  assert sorted(os.listdir(runs)) == sorted(f"{v}_seed0" for v in smoke)


def test_rerun_replaces_a_runs_lines_instead_of_duplicating(smoke_ablations, tmp_path):
  path, rows = smoke_ablations("formats")
  copy = tmp_path / "formats.jsonl"
  copy.write_text(open(path).read())
  new = [{**r, "reward/mean": 123.0} for r in rows if r["variant"] == "bf16"]
  ablations._replace_run_lines(str(copy), "formats", "bf16", 0, new)
  after = _read(copy)
  assert len(after) == len(rows)
  assert [r["reward/mean"] for r in after if r["variant"] == "bf16"] == [123.0, 123.0]
  assert [r for r in after if r["variant"] != "bf16"] == [r for r in rows if r["variant"] != "bf16"]


def test_registry_configs_are_valid_and_carry_their_overrides():
  # The paper's grid (5e-6, 1e-5, 3e-5) scaled so that its 1e-5 is the embedded default's rate.
  default_lr = smollm2_135m.get_config().train.learning_rate
  expected_lrs = {f"{q}@{lr}": factor * default_lr for q in ("bf16", "nvfp4")
                  for lr, factor in (("5e-06", 0.5), ("1e-05", 1.0), ("3e-05", 3.0))}
  assert set(ablations.STUDIES["learning_rate"].variants) == set(expected_lrs)
  assert list(ablations.STUDIES["formats"].variants) == ["bf16", "nf4", "mxfp4", "nvfp4", "nvfp4+aqn"]
  for study in ablations.STUDIES.values():
    assert set(study.smoke) <= set(study.variants)
    for variant in study.variants:
      for smoke in (True, False):
        c = ablations.variant_config(study.name, variant, 2, smoke=smoke)
        validate_config(c)
        assert c.seed == 2
        assert c.train.steps == (ablations.SMOKE_STEPS if smoke else smollm2_135m.get_config().train.steps)
        if study.name == "learning_rate":
          assert c.train.learning_rate == pytest.approx(expected_lrs[variant])
          assert c.model.quant == variant.split("@")[0] and c.aqn.enabled == (c.model.quant == "nvfp4")
        if study.name == "lora_rank":
          default = smollm2_135m.get_config().model
          assert c.model.lora_rank == int(variant[1:])
          assert c.model.lora_alpha / c.model.lora_rank == pytest.approx(default.lora_alpha / default.lora_rank)
        if study.name == "aqn_schedules":
          assert c.aqn.enabled == (variant != "off")
          if variant != "off":
            assert c.aqn.schedule == variant


def test_bad_names_raise_naming_the_value():
  with pytest.raises(ValueError, match="study='nope'"):
    ablations.variant_config("nope", "bf16", 0, smoke=True)
  with pytest.raises(ValueError, match="variant='fp8'"):
    ablations.variant_config("formats", "fp8", 0, smoke=True)
  c = smollm2_135m.get_config("smoke")
  with pytest.raises(KeyError, match="model.nonexistent"):
    ablations.apply_overrides(c, [("model.nonexistent", 1)])
  with pytest.raises(ValueError, match="preset='tpu'"):
    ablations.variant_config("formats", "bf16", 0, smoke=False, preset="tpu")
  with pytest.raises(ValueError, match="needs exactly one study"):
    ablations.plan_jobs(["formats", "lora_rank"], 1, smoke=False, variants=["bf16"])


def test_plan_trains_each_distinct_config_once_seeds_outermost():
  jobs = ablations.plan_jobs(sorted(ablations.STUDIES), 2, smoke=False, preset="gpu")
  # 20 (study, variant) names; the default stands for four of them and nvfp4-without-AQN and bf16 for two.
  names = [n for job in jobs if job.seed == 0 for n in job.names]
  assert sorted(names) == sorted((s.name, v) for s in ablations.STUDIES.values() for v in s.variants)
  assert len(jobs) == 2 * 15 and [j.seed for j in jobs] == [0] * 15 + [1] * 15
  shared = {frozenset(j.names) for j in jobs if len(j.names) > 1}
  assert shared == {
    frozenset({("formats", "nvfp4+aqn"), ("aqn_schedules", "exponential"), ("learning_rate", "nvfp4@1e-05"),
               ("lora_rank", "r16")}),
    frozenset({("formats", "nvfp4"), ("aqn_schedules", "off")}),
    frozenset({("formats", "bf16"), ("learning_rate", "bf16@1e-05")})}
  for job in jobs:  # names that share a run really have one config
    configs = {ablations.variant_config(s, v, job.seed, smoke=False, preset="gpu").to_json() for s, v in job.names}
    assert len(configs) == 1
  gpu = ablations.variant_config("formats", "bf16", 0, smoke=False, preset="gpu")
  cpu = ablations.variant_config("formats", "bf16", 0, smoke=False)
  assert (gpu.train.batch_size, cpu.train.batch_size) == (64, 16)
  assert gpu.train.steps == cpu.train.steps and gpu.aqn.to_json() == cpu.aqn.to_json()


def test_shared_run_is_written_to_every_study_and_skipped_when_done(tmp_path):
  job = ablations.Job((("formats", "nvfp4"), ("aqn_schedules", "off")), 1)
  rows = [{"study": "formats", "variant": "nvfp4", "seed": 1, "step": t, "preset": "cpu", "smoke": True,
           "reward/mean": float(t)} for t in (1, 2)]
  outs = {s: str(tmp_path / f"{s}.jsonl") for s in ("formats", "aqn_schedules")}
  ablations.write_run(rows, job, outs)
  formats, aqn = _read(outs["formats"]), _read(outs["aqn_schedules"])
  assert formats == rows
  assert [(r["study"], r["variant"], r["same_run_as"], r["reward/mean"]) for r in aqn] == [
    ("aqn_schedules", "off", "formats/nvfp4", 1.0), ("aqn_schedules", "off", "formats/nvfp4", 2.0)]
  # Both names hold the 2 smoke steps: nothing is trained again (training would need a model and fail here).
  trained = ablations.run_jobs([job], outs=outs, workdir_root=str(tmp_path / "runs"), smoke=True,
                               skip_done=True, log=lambda *_: None)
  assert trained == [] and not os.path.exists(tmp_path / "runs")


# lora_rank recompiles every program per adapter shape (~23 s): slow-marked to keep CI under its 10 minutes
# (every variant's config is still built and validated below).
@pytest.mark.parametrize("study", ["learning_rate", pytest.param("lora_rank", marks=pytest.mark.slow)])
def test_smoke_study_recompiling_variants(tmp_path, study):
  path = str(tmp_path / f"{study}.jsonl")
  ablations.main(["--study", study, "--smoke", "--out", path, "--workdir_root", str(tmp_path / "runs")])
  rows = _read(path)
  assert [(r["variant"], r["step"]) for r in rows] == [(v, s) for v in ablations.STUDIES[study].smoke for s in (1, 2)]
  if study == "learning_rate":  # warmup: lr rises linearly to the peak, then decays
    peak = 3.0 * smollm2_135m.get_config().train.learning_rate
    assert all(0 < r["lr"] <= peak * (1 + 1e-6) for r in rows)


@pytest.mark.slow  # two worker processes, each importing jax and compiling from scratch (~35 s on 2 cores)
def test_formats_study_trains_in_worker_processes(tmp_path):
  path = str(tmp_path / "formats.jsonl")
  ablations.main(["--study", "formats", "--smoke", "--out", path, "--workdir_root", str(tmp_path / "runs"),
                  "--jobs", "2"])
  rows = _read(path)
  assert [(r["variant"], r["step"]) for r in rows] == [(v, s) for v in ablations.STUDIES["formats"].smoke
                                                       for s in (1, 2)]


def test_entropy_smoke_writes_one_line_per_format(tmp_path):
  out = str(tmp_path / "entropy.jsonl")
  entropy.main(["--smoke", "--formats", "bf16,nvfp4,nf4", "--out", out])
  rows = _read(out)
  assert [r["format"] for r in rows] == ["bf16", "nvfp4", "nf4"]
  for r in rows:
    assert r["num_completions"] == 8 and r["smoke"] is True
    # Random weights at init_std 0.02: a nearly uniform policy over 49152 tokens, entropy just below log V.
    assert 0.97 * math.log(49152) < r["entropy"] <= math.log(49152)
    assert r["first_token_entropy"] <= math.log(49152)
    # The sampled tokens' NLL is a Monte Carlo estimate of the same entropy (8 x 8 tokens).
    assert r["sampled_nll"] == pytest.approx(r["entropy"], abs=0.15)
    assert 0.0 <= r["accuracy"] <= 1.0 and r["response_length/mean"] == 8.0
  # Same prompts, keys and random base: the formats differ only by their 4-bit rounding.
  assert rows[0]["entropy"] != rows[1]["entropy"] or rows[0]["sampled_nll"] != rows[1]["sampled_nll"]
  table = plot_ablations.entropy_table(out).splitlines()
  assert len(table) == 2 + 3 and table[3].startswith("| nvfp4 | ")
  assert table[3].split("|")[2].strip() == f"{rows[1]['entropy']:.4f}"


def _synthetic_lines(rng, study, variants, seeds, steps):
  rows = []
  for v in variants:
    for s in range(seeds):
      for t in range(1, steps + 1):
        rows.append({"study": study, "variant": v, "seed": s, "step": t, "commit": "abc",
                     "reward/mean": float(rng.normal()), "accuracy": float(rng.uniform()),
                     "entropy": float(rng.uniform(0, 3)), "response_length/mean": float(rng.integers(1, 24))})
  return rows


def test_plot_writes_png_and_table_matching_numpy(tmp_path, capsys):
  rng = _rng("test_plot_writes_png_and_table_matching_numpy")
  rows = _synthetic_lines(rng, "formats", ["bf16", "nvfp4"], 3, 12)
  rows += _synthetic_lines(rng, "lora_rank", ["r16"], 1, 5)
  rows[-1]["eval/pass@1"] = 0.25
  path = tmp_path / "lines.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  plot_ablations.main([str(path), "--outdir", str(tmp_path / "png"), "--window", "4"])
  table = capsys.readouterr().out
  for study in ("formats", "lora_rank"):
    png = tmp_path / "png" / f"{study}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
  # The table's "reward last" of nvfp4: mean over seeds of each seed's mean over its last 4 steps.
  reward_SxT = np.array([[r["reward/mean"] for r in rows if r["variant"] == "nvfp4" and r["seed"] == s]
                         for s in range(3)])
  per_seed = reward_SxT[:, -4:].mean(1)
  line = next(row for row in table.splitlines() if row.startswith("| nvfp4 |"))
  cells = [c.strip() for c in line.strip("|").split("|")]
  assert cells[1] == "3"
  assert cells[3] == f"{per_seed.mean():.3f} ± {per_seed.std(ddof=1):.3f}"
  entropy_first = np.array([[r["entropy"] for r in rows if r["variant"] == "nvfp4" and r["seed"] == s][:4]
                            for s in range(3)]).mean(1)
  assert cells[5] == f"{entropy_first.mean():.3f} ± {entropy_first.std(ddof=1):.3f}"
  assert cells[7] == "n/a"
  # The last column: each seed's mean reward over all its steps, mean ± std over seeds.
  per_seed_all = reward_SxT.mean(1)
  assert cells[8] == f"{per_seed_all.mean():.3f} ± {per_seed_all.std(ddof=1):.3f}"
  r16 = next(row for row in table.splitlines() if row.startswith("| r16 |"))
  assert [c.strip() for c in r16.strip("|").split("|")][7] == "0.250"


@pytest.mark.slow  # it reads both studies' runs (aqn_schedules is slow-marked above)
def test_plot_reads_the_smoke_runs(smoke_ablations, tmp_path):
  paths = [smoke_ablations(study)[0] for study in ("formats", "aqn_schedules")]
  pngs, table = plot_ablations.plot_all(paths, str(tmp_path), window=10)
  assert sorted(os.path.basename(p) for p in pngs) == ["aqn_schedules.png", "formats.png"]
  assert "| nvfp4+aqn | 1 |" in table and "| off | 1 |" in table


def test_plot_rejects_lines_that_are_not_ablation_steps(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps({"step": 1, "reward/mean": 0.0}) + "\n")
  with pytest.raises(ValueError, match="bad.jsonl:1 lacks"):
    plot_ablations.read_lines([str(path)])


@pytest.mark.slow  # ~32 s: CI is near its 10-minute limit; run with `pytest -m slow`
def test_walkthrough_notebook_runs_in_smoke_mode(monkeypatch):
  import nbclient
  import nbformat
  monkeypatch.setenv("QERL_NOTEBOOK_SMOKE", "1")
  here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments")
  nb = nbformat.read(os.path.join(here, "qerl_walkthrough.ipynb"), as_version=4)
  nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                          resources={"metadata": {"path": here}}).execute()
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
  assert "smoke mode: True" in text
  # The quantization error of each format is printed, and NVFP4's fp8 scales beat MXFP4's powers of two.
  mse = {s: float(text.split(f"{s}: relative MSE ")[1].split(",")[0]) for s in ("nvfp4", "mxfp4", "nf4")}
  assert 0.0 < mse["nvfp4"] < mse["mxfp4"] < 0.05
  assert "2 steps logged" in text
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
  assert len(images) == 1
