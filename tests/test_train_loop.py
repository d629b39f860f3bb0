"""The trainer end to end on CPU: every smoke config, kill-and-resume == uninterrupted, compile counts,
non-finite updates, incompatible checkpoints.

Smoke models are tiny and random, so their completions are noise: the tests that need a learning signal
(resume, NaN) add a reward with variance on noise (the parity of the completion's length) to the
registry, instead of the math rewards that a random model never earns.
"""

import importlib
import json
import math
import os

import jax
import numpy as np
import ml_collections
import pytest

from qerl_jax import rewards as rewards_lib
from qerl_jax.rollout import engine
from qerl_jax.train import NonFiniteUpdatesError, train_and_evaluate
from qerl_jax.train import step as step_lib
from qerl_jax.train.checkpoint import Checkpointer, IncompatibleCheckpointError
from qerl_jax.train.loop import Trainer

CONFIGS = ("qwen3b", "qwen7b", "qwen14b", "qwen32b", "qwen72b", "smollm2_135m")
REQUIRED = (
  "reward/mean", "reward/std", "accuracy", "entropy", "response_length/mean", "clip_frac", "clip_frac_low",
  "clip_frac_high", "aqn/sigma", "aqn/rollout_kl", "grad_norm", "lr", "loss", "time/rollout_s",
  "time/update_s", "tokens_per_s", "nonfinite/total")


def smoke(name):
  return importlib.import_module(f"configs.{name}").get_config("smoke")


def read_rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
  """A config's smoke mode (3 steps, checkpoint, eval), run once on first use; the tests below read the results."""
  out = {}

  def run(name):
    if name not in out:
      workdir = str(tmp_path_factory.mktemp(name))
      out[name] = (workdir, train_and_evaluate(smoke(name), workdir))
    return out[name]
  return run


# CI runs the embedded default and one paper config; the other four (the same code at other shapes, ~6 s each)
# run with `pytest -m slow`: the suite is near CI's 10-minute limit.
@pytest.mark.parametrize("name", [n if n in ("qwen7b", "smollm2_135m") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in CONFIGS])
def test_smoke_config_runs_end_to_end(smoke_runs, name):
  workdir, last = smoke_runs(name)
  rows = read_rows(workdir)
  assert [r["step"] for r in rows] == [1, 2, 3]
  for row in rows:
    missing = [k for k in REQUIRED if k not in row]
    assert not missing, missing
    bad = {k: v for k, v in row.items() if not (isinstance(v, (int, float)) and math.isfinite(v))}
    assert not bad, bad
    assert row["nonfinite/total"] == 0
  # AQN: stage 0 is noise-free, the later stages are not (3 stages over 3 steps in smoke mode).
  assert [r["aqn/sigma"] for r in rows] == pytest.approx([0.0, 1e-2, 5e-4])
  # A near-uniform random policy: entropy close to log(vocab).
  assert rows[0]["entropy"] > 0.9 * math.log(49152)
  assert Checkpointer(workdir).all_steps() == [2, 3]
  assert os.path.getsize(os.path.join(workdir, "curves.png")) > 1000
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(workdir, "tensorboard")))
  report = json.load(open(os.path.join(workdir, "eval", "step_3", "report.json")))
  assert report["num_samples"] == 2 and 0.0 <= report["pass@1"] <= report["pass@2"] <= 1.0
  samples = open(os.path.join(workdir, "eval", "step_3", "samples.jsonl")).read().splitlines()
  assert len(samples) == 2 * report["num_problems"]
  assert last["eval"]["pass@1"] == report["pass@1"]


def _noise_reward(completion, gold):
  return float(len(completion) % 2)


@pytest.fixture
def noise_reward(monkeypatch):
  monkeypatch.setitem(rewards_lib.REWARDS, "length_parity", _noise_reward)


def _signal_config(**train):
  c = smoke("qwen7b")
  c.rewards = ml_collections.ConfigDict({"length_parity": 1.0, "gsm8k_correctness": 1.0})
  c.eval.at_end = False  # the smoke runs above cover eval
  for k, v in train.items():
    c.train[k] = v
  return c


class _Interrupt(Exception):
  pass


def test_kill_and_resume_equals_uninterrupted(tmp_path, noise_reward, monkeypatch, capsys):
  traces_before = dict(step_lib.TRACE_COUNT), dict(engine.TRACE_COUNT)
  full = str(tmp_path / "full")
  train_and_evaluate(_signal_config(), full)
  want = read_rows(full)
  assert any(r["grad_norm"] > 0 for r in want), "the test needs real updates"

  # The same 3-step run (its compiled programs are shared with the smoke run above), interrupted during
  # step 3, after the step-2 checkpoint, then resumed from the workdir.
  part = str(tmp_path / "part")
  original = Trainer.finish_step

  def crash_at_step_3(self, step, *args):
    if step == 2:
      raise _Interrupt()
    return original(self, step, *args)

  monkeypatch.setattr(Trainer, "finish_step", crash_at_step_3)
  with pytest.raises(_Interrupt):
    train_and_evaluate(_signal_config(), part)
  monkeypatch.setattr(Trainer, "finish_step", original)
  assert Checkpointer(part).latest_step() == 2
  train_and_evaluate(_signal_config(), part)
  assert "resuming from step 2" in capsys.readouterr().out

  got = read_rows(part)
  assert [r["step"] for r in got] == [1, 2, 3]
  for a, b in zip(want, got):
    for key in a:
      if key.startswith("time/") or key == "tokens_per_s":
        continue
      assert a[key] == b[key], (a["step"], key, a[key], b[key])
  ckpt_a = Checkpointer(full)
  ckpt_b = Checkpointer(part)
  template = Trainer.create(_signal_config(), str(tmp_path / "template")).state
  pa, pb = ckpt_a.restore(3, template).params, ckpt_b.restore(3, template).params
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), pa, pb)

  # 9 update calls and 9 rollouts over one bucket: at most one trace of each in this test.
  assert step_lib.TRACE_COUNT["update"] - traces_before[0]["update"] <= 1
  assert engine.TRACE_COUNT["rollout"] - traces_before[1]["rollout"] <= 1


def test_nonfinite_updates_are_skipped_counted_and_stop_the_run(tmp_path, monkeypatch):
  monkeypatch.setitem(rewards_lib.REWARDS, "length_parity", lambda c, g: float("nan"))
  workdir = str(tmp_path / "nan")
  before = Trainer.create(_signal_config(), str(tmp_path / "init")).state.params
  with pytest.raises(NonFiniteUpdatesError, match="2 consecutive updates"):
    train_and_evaluate(_signal_config(max_nonfinite=2), workdir)
  rows = read_rows(workdir)
  assert [r["nonfinite/consecutive"] for r in rows] == [1, 2]
  assert all(r["update_finite"] == 0 for r in rows)
  ckpt = Checkpointer(workdir)
  saved = ckpt.restore(ckpt.latest_step(), Trainer.create(_signal_config(), str(tmp_path / "t2")).state)
  # Skipped updates leave the parameters exactly as they were, and the checkpoint finite.
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), before, saved.params)
  assert int(saved.nonfinite[1]) == 2


def test_incompatible_checkpoint_is_refused_then_moved_aside(tmp_path, noise_reward):
  workdir = str(tmp_path / "run")
  train_and_evaluate(_signal_config(checkpoint_every=1), workdir)
  other = _signal_config()
  other.model.lora_rank = 8
  with pytest.raises(IncompatibleCheckpointError, match=r"model.lora_rank: checkpoint 4 vs config 8"):
    Trainer.create(other, workdir)
  assert Checkpointer(workdir).all_steps() == [1, 2, 3]  # nothing lost
  other.train.restart = True
  trainer = Trainer.create(other, workdir)
  assert int(trainer.state.step) == 0
  moved = [d for d in os.listdir(workdir) if d.startswith("checkpoints.old-")]
  assert len(moved) == 1 and sorted(os.listdir(os.path.join(workdir, moved[0]))) == ["1", "2", "3"]


def test_positions_beyond_the_model_are_refused_before_compiling(tmp_path):
  c = smoke("qwen7b")
  c.rollout.max_new_tokens = c.model.random.max_position_embeddings
  before = dict(step_lib.TRACE_COUNT)
  with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=2048"):
    Trainer.create(c, str(tmp_path / "w"))
  assert step_lib.TRACE_COUNT == before
