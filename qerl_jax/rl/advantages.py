"""Group-relative advantages for GRPO / DAPO / Dr.GRPO.

A batch of B completions holds B / G groups of G completions of the same prompt, stored contiguously:
rows [g * G, (g + 1) * G) belong to prompt g. This is the layout the rollout produces when each prompt
is repeated G times, and the layout every function here assumes.
"""

from typing import Union

import jax.numpy as jnp

ScaleMode = Union[bool, str]

_SCALE_MODES = ("group", "batch", "none")


def _scale_mode(scale: ScaleMode) -> str:
  if scale is True:
    return "group"
  if scale is False:
    return "none"
  if scale not in _SCALE_MODES:
    raise ValueError(f"{scale=} must be True, False or one of {_SCALE_MODES}")
  return scale


def _check_groups(rewards_B, group_size: int):
  if rewards_B.ndim != 1:
    raise ValueError(f"rewards_B must be 1-D, got shape {rewards_B.shape}")
  if not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f"{group_size=} must be a positive int")
  if rewards_B.shape[0] % group_size:
    raise ValueError(f"batch size {rewards_B.shape[0]} must be divisible by {group_size=}")


def group_advantages(rewards_B, group_size: int, scale: ScaleMode = True, eps: float = 1e-4):
  """Advantage of each completion relative to the other completions of its prompt.

  A_i = (r_i - mean_group) / (std_group + eps), std with ddof=1 as torch.std (TRL, the QeRL code).

  Args:
    rewards_B: float rewards, groups contiguous (see module docstring).
    group_size: completions per prompt G (static).
    scale: True / "group": divide by the group std (GRPO, DAPO); False / "none": no division (Dr.GRPO);
      "batch": divide by the std over the whole batch (ddof=1), a TRL option robust to flat groups.
    eps: added to the std, so a group whose rewards are all equal gets advantage 0, not NaN.

  Returns:
    float32[B] advantages.
  """
  rewards_B = jnp.asarray(rewards_B, jnp.float32)
  _check_groups(rewards_B, group_size)
  mode = _scale_mode(scale)
  if mode == "group" and group_size < 2:
    raise ValueError(f"{group_size=} must be >= 2 to scale by the group std (ddof=1)")
  rewards_NxG = rewards_B.reshape(-1, group_size)
  centered_NxG = rewards_NxG - rewards_NxG.mean(axis=1, keepdims=True)
  if mode == "group":
    std_Nx1 = jnp.std(rewards_NxG, axis=1, ddof=1, keepdims=True)
    centered_NxG = centered_NxG / (std_Nx1 + eps)
  elif mode == "batch":
    if rewards_B.shape[0] < 2:
      raise ValueError(f"batch of {rewards_B.shape[0]} rewards is too small for a ddof=1 std")
    centered_NxG = centered_NxG / (jnp.std(rewards_B, ddof=1) + eps)
  return centered_NxG.reshape(-1)


def group_reward_stats(rewards_B, group_size: int):
  """Scalars to log about a rollout batch's rewards.

  Returns a dict with the reward mean and std (ddof=1 when B > 1, else 0), the mean within-group std, and
  `frac_zero_std`: the fraction of groups whose rewards are all equal, which carry no learning signal
  under group-normalised advantages (what DAPO's dynamic sampling filters out).
  """
  rewards_B = jnp.asarray(rewards_B, jnp.float32)
  _check_groups(rewards_B, group_size)
  rewards_NxG = rewards_B.reshape(-1, group_size)
  spread_N = rewards_NxG.max(axis=1) - rewards_NxG.min(axis=1)
  group_std_N = (jnp.std(rewards_NxG, axis=1, ddof=1) if group_size > 1
                 else jnp.zeros(rewards_NxG.shape[0], jnp.float32))
  batch_std = jnp.std(rewards_B, ddof=1) if rewards_B.shape[0] > 1 else jnp.float32(0.0)
  return {
    "reward_mean": rewards_B.mean(),
    "reward_std": batch_std,
    "group_std_mean": group_std_N.mean(),
    "frac_zero_std": (spread_N == 0).mean(),
  }
