"""The AQN schedule (the authors' step -> sigma mapping for T=600, K=10) and the noise it draws."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax.rl import aqn


def authors_sigma(step, total_steps, sigma_start, sigma_end, num_stages):
  """The authors' mapping (trl_trainer/noise_scheduler.py + grpo_trainer.py), re-derived in NumPy."""
  trend = sigma_start * (sigma_end / sigma_start) ** (np.arange(num_stages - 1) / (num_stages - 2))
  step = min(step, total_steps)
  interval = int(step // (total_steps / num_stages))
  if interval == 0:
    return 0.0
  return trend[min(interval - 1, len(trend) - 1)]


def test_schedule_table_t600_k10():
  steps = np.arange(600)
  stages = np.asarray(jax.vmap(lambda s: aqn.stage(s, 600, 10))(steps))
  sigmas = np.asarray(jax.vmap(lambda s: aqn.sigma(s, 600, 1e-2, 5e-4, 10))(steps))
  print("stage  steps      sigma")
  for k in range(10):
    sel = stages == k
    print(f"{k:5d}  {steps[sel].min():3d}-{steps[sel].max():3d}  {sigmas[sel][0]:.6g}")
  np.testing.assert_array_equal(stages, steps // 60)
  per_stage = sigmas[::60]
  assert per_stage[0] == 0.0 and np.all(sigmas[:60] == 0.0)
  assert per_stage[1] == np.float32(1e-2)
  assert per_stage[9] == np.float32(5e-4)
  # Geometric between: a constant ratio (5e-4 / 1e-2) ** (1 / 8) from stage to stage.
  np.testing.assert_allclose(per_stage[2:] / per_stage[1:-1], 0.05 ** (1 / 8), rtol=1e-6)
  np.testing.assert_allclose(per_stage[1:], 1e-2 * 0.05 ** (np.arange(9) / 8), rtol=1e-6)
  for k in range(10):  # constant within a stage
    assert np.all(sigmas[60 * k:60 * (k + 1)] == per_stage[k])
  want = np.array([authors_sigma(int(s), 600, 1e-2, 5e-4, 10) for s in steps], np.float32)
  np.testing.assert_allclose(sigmas, want, rtol=1e-6)
  # Past the end the last stage holds; the authors' code agrees.
  for s in (600, 601, 10_000):
    ours = float(aqn.sigma(s, 600, 1e-2, 5e-4, 10))
    assert ours == np.float32(5e-4) == np.float32(authors_sigma(s, 600, 1e-2, 5e-4, 10))


@pytest.mark.parametrize("total_steps,num_stages", [(100, 3), (7, 3), (1000, 7), (45, 10), (13, 5)])
def test_stage_matches_authors_for_uneven_splits(total_steps, num_stages):
  steps = np.arange(total_steps + 3)
  got = np.asarray(jax.vmap(lambda s: aqn.sigma(s, total_steps, 1e-2, 1e-4, num_stages))(steps))
  want = np.array([authors_sigma(int(s), total_steps, 1e-2, 1e-4, num_stages) for s in steps], np.float32)
  np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("schedule", aqn.SCHEDULES)
def test_every_schedule_hits_both_ends_and_decays(schedule):
  table = aqn.sigma_per_stage(2e-2, 1e-3, 6, schedule)
  assert table[0] == 0.0 and table[1] == np.float32(2e-2) and table[-1] == np.float32(1e-3)
  assert np.all(np.diff(table[1:]) < 0)
  p = np.arange(5) / 4
  want = {"exponential": 2e-2 * (1e-3 / 2e-2) ** p, "linear": 2e-2 + (1e-3 - 2e-2) * p,
          "cosine": 1e-3 + (2e-2 - 1e-3) * (1 + np.cos(np.pi * p)) / 2,
          "logarithmic": 2e-2 + (1e-3 - 2e-2) * np.log(1 + 9 * p) / np.log(10)}[schedule]
  np.testing.assert_allclose(table[1:], want, rtol=1e-6)
  jitted = jax.jit(lambda s: aqn.sigma(s, 60, 2e-2, 1e-3, 6, schedule))
  assert float(jitted(35)) == table[3]


def test_schedule_errors():
  with pytest.raises(ValueError, match="num_stages"):
    aqn.sigma(0, 100, 1e-2, 5e-4, 2)
  with pytest.raises(ValueError, match="schedule"):
    aqn.sigma(0, 100, 1e-2, 5e-4, 10, schedule="step")
  with pytest.raises(ValueError, match="exponential"):
    aqn.sigma_per_stage(1e-2, 0.0, 10)
  with pytest.raises(ValueError, match="total_steps"):
    aqn.stage(0, 0, 10)
  with pytest.raises(ValueError, match="step"):
    aqn.stage(-1, 100, 10)


SHAPES = {"input_layernorm": (4, 2048), "post_attention_layernorm": (4, 2048)}


def test_noise_statistics_and_independence():
  seed = int(np.random.SeedSequence().entropy % 2**31)
  print(f"seed={seed}")
  key = jax.random.key(seed)
  sigma = 1e-2
  a = aqn.norm_noise(key, 7, SHAPES, sigma)
  b = aqn.norm_noise(key, 8, SHAPES, sigma)
  assert set(a) == set(SHAPES)
  n = 4 * 2048
  for name, z in a.items():
    z = np.asarray(z, np.float64)
    assert z.dtype == np.float64 and a[name].dtype == jnp.float32 and z.shape == SHAPES[name]
    # 5-sigma bounds: mean of n draws has std sigma / sqrt(n); the std estimate has rel. std 1/sqrt(2n).
    assert abs(z.mean()) < 5 * sigma / np.sqrt(n)
    assert abs(z.std() / sigma - 1) < 5 / np.sqrt(2 * n)
  flat = lambda d, k: np.asarray(d[k]).ravel()
  # Independent across steps and across the two norms (correlation ~ N(0, 1/n)).
  for x, y in ((flat(a, "input_layernorm"), flat(b, "input_layernorm")),
               (flat(a, "input_layernorm"), flat(a, "post_attention_layernorm"))):
    assert abs(np.corrcoef(x, y)[0, 1]) < 5 / np.sqrt(n)
  # Layers differ from each other too (stacked draws, not one vector broadcast).
  assert not np.allclose(a["input_layernorm"][0], a["input_layernorm"][1])


def test_noise_is_deterministic_per_step_and_resumable():
  key = jax.random.key(3)
  first = aqn.norm_noise(key, 41, SHAPES, 5e-3)
  again = aqn.norm_noise(jax.random.key(3), 41, SHAPES, 5e-3)
  for name in SHAPES:
    np.testing.assert_array_equal(np.asarray(first[name]), np.asarray(again[name]))
  # The step key is fold_in(base, step): the same draw under jit with a traced step and sigma (XLA
  # may fuse the scaling differently, hence the last-ulp tolerance; another key differs at O(1)).
  jitted = jax.jit(lambda k, s, sg: aqn.norm_noise(k, s, SHAPES, sg))(key, jnp.int32(41), jnp.float32(5e-3))
  for name in SHAPES:
    np.testing.assert_allclose(np.asarray(jitted[name]), np.asarray(first[name]), rtol=1e-6, atol=1e-12)
  # The noise of a target does not depend on which other targets are drawn.
  only = aqn.norm_noise(key, 41, SHAPES, 5e-3, targets=("post_attention_layernorm",))
  assert list(only) == ["post_attention_layernorm"]
  np.testing.assert_array_equal(np.asarray(only["post_attention_layernorm"]),
                                np.asarray(first["post_attention_layernorm"]))
  other = aqn.norm_noise(jax.random.key(4), 41, SHAPES, 5e-3)
  assert not np.allclose(np.asarray(other["input_layernorm"]), np.asarray(first["input_layernorm"]))


def test_zero_sigma_and_config_objects():
  key = jax.random.key(0)
  cfg = types.SimpleNamespace(num_layers=3, hidden_size=16)
  zeros = aqn.norm_noise(key, 5, cfg, 0.0)
  assert {k: v.shape for k, v in zeros.items()} == {"input_layernorm": (3, 16), "post_attention_layernorm": (3, 16)}
  assert all(np.all(np.asarray(v) == 0.0) for v in zeros.values())
  traced = jax.jit(lambda s: aqn.norm_noise(key, 5, cfg, s))(jnp.float32(0.0))
  assert all(np.all(np.asarray(v) == 0.0) for v in traced.values())
  # The schedule's stage 0 gives zeros through the traced path.
  scheduled = jax.jit(lambda st: aqn.norm_noise(key, st, cfg, aqn.sigma(st, 600, 1e-2, 5e-4, 10)))
  assert all(np.all(np.asarray(v) == 0.0) for v in scheduled(jnp.int32(10)).values())
  assert all(float(jnp.abs(v).max()) > 0 for v in scheduled(jnp.int32(70)).values())
  hf_style = types.SimpleNamespace(num_hidden_layers=2, hidden_size=8)
  assert aqn.norm_noise(key, 0, hf_style, 1e-3)["input_layernorm"].shape == (2, 8)
  with pytest.raises(ValueError, match="hidden_size"):
    aqn.norm_noise(key, 0, types.SimpleNamespace(num_layers=2), 1e-3)
  with pytest.raises(ValueError, match="not in shapes"):
    aqn.norm_noise(key, 0, {"input_layernorm": (2, 8)}, 1e-3)
  with pytest.raises(ValueError, match="sigma"):
    aqn.norm_noise(key, 0, cfg, -1.0)
