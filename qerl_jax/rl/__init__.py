"""RL core: group advantages, clipped policy losses (GRPO / DAPO / Dr.GRPO / GSPO) and the AQN noise.

Every function here is pure and jittable; notebooks and the trainer import them from `qerl_jax.rl`.
"""

from qerl_jax.rl import aqn
from qerl_jax.rl.advantages import group_advantages, group_reward_stats
from qerl_jax.rl.aqn import norm_noise, sigma, sigma_per_stage, stage, step_key
from qerl_jax.rl.losses import LOSS_TYPES, effective_mask, loss_normalizers, policy_loss

__all__ = [
  "LOSS_TYPES",
  "aqn",
  "effective_mask",
  "group_advantages",
  "group_reward_stats",
  "loss_normalizers",
  "norm_noise",
  "policy_loss",
  "sigma",
  "sigma_per_stage",
  "stage",
  "step_key",
]
