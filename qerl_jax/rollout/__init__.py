"""Rollout engine: jitted batched generation with a KV cache (`rollout`) and `generate` for notebooks."""

from qerl_jax.rollout.engine import RolloutBatch, rollout  # noqa: F401
from qerl_jax.rollout.generate import Completion, generate  # noqa: F401
from qerl_jax.rollout.sampling import SamplingParams, sample, sampling_logits  # noqa: F401
