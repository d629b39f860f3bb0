"""group_advantages and group_reward_stats against NumPy formulas and hand-computed values."""

import jax
import numpy as np
import pytest

from qerl_jax.rl import group_advantages, group_reward_stats


@pytest.fixture
def rng():
  seed = int(np.random.SeedSequence().entropy % 2**31)
  print(f"seed={seed}")
  return np.random.default_rng(seed)


def numpy_advantages(rewards, group_size, mode, eps=1e-4):
  r = np.asarray(rewards, np.float64).reshape(-1, group_size)
  centered = r - r.mean(axis=1, keepdims=True)
  if mode == "group":
    centered = centered / (r.std(axis=1, ddof=1, keepdims=True) + eps)
  elif mode == "batch":
    centered = centered / (np.asarray(rewards, np.float64).std(ddof=1) + eps)
  return centered.reshape(-1)


@pytest.mark.parametrize("group_size", [2, 4, 8])
@pytest.mark.parametrize("scale,mode", [(True, "group"), (False, "none"), ("batch", "batch")])
def test_matches_numpy(rng, group_size, scale, mode):
  # Paper-like rewards: correctness 2.0 / 0, format 0.2 / 0, plus a continuous part.
  rewards = (2.0 * rng.integers(0, 2, 4 * group_size) + 0.2 * rng.integers(0, 2, 4 * group_size)
             + rng.normal(0, 0.1, 4 * group_size)).astype(np.float32)
  got = np.asarray(group_advantages(rewards, group_size, scale=scale))
  # float32 rounding of the group mean (a few ulps of the rewards) is divided by the scaling, so an
  # advantage near zero in a group of similar rewards carries an absolute error of ulps / std.
  groups = rewards.reshape(-1, group_size).astype(np.float64)
  divisor = groups.std(1, ddof=1) + 1e-4 if mode == "group" else np.ones(len(groups))
  if mode == "batch":
    divisor = np.full(len(groups), rewards.astype(np.float64).std(ddof=1) + 1e-4)
  ulps_GxN = np.repeat(4 * np.finfo(np.float32).eps * np.abs(groups).max(1) / divisor, group_size)
  want = numpy_advantages(rewards, group_size, mode)
  bad = np.abs(got - want) > 1e-5 * np.abs(want) + ulps_GxN
  assert not bad.any(), (got[bad], want[bad], ulps_GxN[bad])
  # Advantages sum to zero inside each group whatever the scaling, up to the same rounding per member.
  tol = 4 * group_size * np.finfo(np.float32).eps * np.abs(groups).max(1) / divisor
  assert np.all(np.abs(got.reshape(-1, group_size).sum(1)) <= tol), (got, tol)


def test_hand_computed():
  # Group [1, 0, 0, 1]: mean 0.5, ddof=1 std sqrt(1/3); group [2, 2, 2, 2] is flat.
  got = np.asarray(group_advantages(np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), 4))
  a = 0.5 / (np.sqrt(1.0 / 3.0) + 1e-4)
  np.testing.assert_allclose(got, [a, -a, -a, a, 0, 0, 0, 0], rtol=1e-6)
  assert np.all(got[4:] == 0.0)  # exactly zero, no NaN, for a flat group
  # Dr.GRPO: no division.
  np.testing.assert_allclose(np.asarray(group_advantages(np.array([3.0, 1.0]), 2, scale=False)), [1.0, -1.0])
  stats = group_reward_stats(np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]), 4)
  assert float(stats["frac_zero_std"]) == 0.5
  assert float(stats["reward_mean"]) == pytest.approx(1.25)
  assert float(stats["group_std_mean"]) == pytest.approx(np.sqrt(1.0 / 3.0) / 2, rel=1e-6)


def test_jittable_and_errors():
  fn = jax.jit(group_advantages, static_argnums=(1, 2))
  np.testing.assert_allclose(np.asarray(fn(np.array([0.0, 2.0, 2.0, 0.0]), 2, True)),
                             np.asarray(group_advantages(np.array([0.0, 2.0, 2.0, 0.0]), 2)))
  with pytest.raises(ValueError, match="divisible"):
    group_advantages(np.zeros(6), 4)
  with pytest.raises(ValueError, match="group_size"):
    group_advantages(np.zeros(4), 1)
  with pytest.raises(ValueError, match="scale"):
    group_advantages(np.zeros(4), 2, scale="std")
  with pytest.raises(ValueError, match="1-D"):
    group_advantages(np.zeros((2, 2)), 2)
