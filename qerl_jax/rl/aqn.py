"""Adaptive Quantization Noise (AQN): the staged sigma schedule and the RMSNorm-scale noise it drives.

Training steps [0, T) are split into K equal stages; stage k holds steps with floor(step * K / T) == k
(the authors' `step // (T / K)`, in exact integer arithmetic). Stage 0 is noise-free; stages 1..K-1 walk
from sigma_start to sigma_end along the chosen curve, hitting both ends exactly. Steps past T stay in
the last stage.

Noise enters the model as Z ~ N(0, sigma^2 I) added to an RMSNorm scale, (w + Z) * x / rms(x): row-wise
multiplicative noise on the linears the norm feeds (input_layernorm -> q/k/v, post_attention_layernorm ->
gate/up). The model owns the addition; this module only draws Z. Keep w + Z in float32: a bf16 add of
sigma < 4e-3 to values near 1 mostly rounds away.
"""

import math
import zlib
from typing import Mapping, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

SCHEDULES = ("exponential", "linear", "cosine", "logarithmic")
DEFAULT_TARGETS = ("input_layernorm", "post_attention_layernorm")
# Base of the logarithmic curve: sigma falls by log(1 + (b - 1) p) / log(b) of its range at progress p,
# so most of the decay happens early (about 60% by a quarter of the way with b = 10).
_LOG_BASE = 10.0


def _check_schedule(sigma_start: float, sigma_end: float, num_stages: int, schedule: str):
  if schedule not in SCHEDULES:
    raise ValueError(f"{schedule=} must be one of {SCHEDULES}")
  if not isinstance(num_stages, int) or num_stages < 3:
    raise ValueError(f"{num_stages=} must be an int >= 3 (stage 0 is noise-free, then >= 2 noisy stages)")
  if not (sigma_start >= 0 and sigma_end >= 0):
    raise ValueError(f"sigmas must be >= 0, got {sigma_start=} {sigma_end=}")
  if schedule == "exponential" and (sigma_start <= 0 or sigma_end <= 0):
    raise ValueError(f"the exponential schedule needs sigma_start > 0 and sigma_end > 0, "
                     f"got {sigma_start=} {sigma_end=}")


def sigma_per_stage(sigma_start: float, sigma_end: float, num_stages: int,
                    schedule: str = "exponential") -> np.ndarray:
  """float32[K] noise std of each stage: 0 for stage 0, then sigma_start ... sigma_end (both exact).

  With p = (k - 1) / (K - 2) the progress of stage k >= 1:
    exponential  s_start * (s_end / s_start) ** p          (the paper's schedule)
    linear       s_start + (s_end - s_start) * p
    cosine       s_end + (s_start - s_end) * (1 + cos(pi p)) / 2
    logarithmic  s_start + (s_end - s_start) * log(1 + 9 p) / log(10)
  """
  _check_schedule(sigma_start, sigma_end, num_stages, schedule)
  p = np.arange(num_stages - 1, dtype=np.float64) / (num_stages - 2)
  if schedule == "exponential":
    noisy = sigma_start * (sigma_end / sigma_start) ** p
  elif schedule == "linear":
    noisy = sigma_start + (sigma_end - sigma_start) * p
  elif schedule == "cosine":
    noisy = sigma_end + (sigma_start - sigma_end) * 0.5 * (1.0 + np.cos(np.pi * p))
  else:
    noisy = sigma_start + (sigma_end - sigma_start) * np.log1p((_LOG_BASE - 1.0) * p) / math.log(_LOG_BASE)
  # The float64 curve lands within an ulp of the ends; pin them so the table reads back exactly.
  noisy[0], noisy[-1] = sigma_start, sigma_end
  return np.concatenate([[0.0], noisy]).astype(np.float32)


def stage(step, total_steps: int, num_stages: int):
  """Stage index of `step` (int32, jittable in step): min(floor(step * K / T), K - 1), step < 0 -> 0."""
  if not isinstance(total_steps, int) or total_steps < 1:
    raise ValueError(f"{total_steps=} must be a positive int")
  if not isinstance(num_stages, int) or num_stages < 1:
    raise ValueError(f"{num_stages=} must be a positive int")
  if isinstance(step, (int, np.integer)) and step < 0:
    raise ValueError(f"{step=} must be >= 0")
  # int64 is not available without jax_enable_x64, and step * K overflows int32 only past 2**31 / K
  # steps; clamping to T first keeps the product small for any realistic T.
  step = jnp.clip(jnp.asarray(step, jnp.int32), 0, total_steps)
  return jnp.minimum(step * num_stages // total_steps, num_stages - 1).astype(jnp.int32)


def sigma(step, total_steps: int, sigma_start: float, sigma_end: float, num_stages: int,
          schedule: str = "exponential"):
  """Noise std (float32 scalar) for a training step; jittable in `step`, the rest static.

  Defaults of the paper: sigma_start 1e-2, sigma_end 5e-4, num_stages 10 (authors' scripts: 1e-4).
  """
  table_K = jnp.asarray(sigma_per_stage(sigma_start, sigma_end, num_stages, schedule))
  return table_K[stage(step, total_steps, num_stages)]


def step_key(base_key, step):
  """PRNG key of a training step: fold_in(base_key, step), so a resumed run replays the same noise."""
  return jax.random.fold_in(base_key, jnp.asarray(step, jnp.uint32))


def _name_salt(name: str) -> int:
  # A stable per-name salt keeps each target's noise independent of which other targets are asked for.
  return zlib.crc32(name.encode()) & 0x7FFFFFFF


def _target_shapes(model_or_shapes, targets: Sequence[str]) -> dict:
  if isinstance(targets, str):
    raise ValueError(f"{targets=} must be a sequence of names, not a string")
  if isinstance(model_or_shapes, Mapping):
    missing = [t for t in targets if t not in model_or_shapes]
    if missing:
      raise ValueError(f"targets {missing} not in shapes {sorted(model_or_shapes)}")
    shapes = {t: tuple(int(d) for d in model_or_shapes[t]) for t in targets}
  else:
    num_layers = getattr(model_or_shapes, "num_layers", None)
    if num_layers is None:
      num_layers = getattr(model_or_shapes, "num_hidden_layers", None)
    hidden = getattr(model_or_shapes, "hidden_size", None)
    if num_layers is None or hidden is None:
      raise ValueError(f"{type(model_or_shapes).__name__} needs num_layers (or num_hidden_layers) and "
                       "hidden_size attributes, or pass a dict {name: (num_layers, dim)}")
    shapes = {t: (int(num_layers), int(hidden)) for t in targets}
  for name, shape in shapes.items():
    if len(shape) != 2 or min(shape) < 1:
      raise ValueError(f"shape of {name!r} is {shape}; expected (num_layers, dim) with both >= 1")
  return shapes


def norm_noise(key, step, model_or_shapes: Union[Mapping[str, Tuple[int, int]], object], sigma,
               targets: Sequence[str] = DEFAULT_TARGETS) -> dict:
  """Fresh AQN noise for one step: {target: float32[num_layers, dim]} with entries N(0, sigma^2).

  Args:
    key: the run's base PRNG key; the step's key is fold_in(key, step) (see `step_key`).
    step: training step (may be traced).
    model_or_shapes: {name: (num_layers, dim)} or a config with num_layers and hidden_size attributes.
    sigma: noise std, a float or a traced scalar (e.g. `sigma(step, ...)`). Exactly 0 gives exact zeros
      without drawing random numbers (a Python 0 skips the draw at trace time, a traced 0 through cond).
    targets: RMSNorm names in each decoder block; each gets its own independent draw.
  """
  shapes = _target_shapes(model_or_shapes, targets)
  zeros = {name: jnp.zeros(shape, jnp.float32) for name, shape in shapes.items()}
  if isinstance(sigma, (int, float, np.floating, np.integer)):
    if sigma < 0:
      raise ValueError(f"{sigma=} must be >= 0")
    if sigma == 0:
      return zeros
  k = step_key(key, step)

  def draw(s):
    return {name: s * jax.random.normal(jax.random.fold_in(k, _name_salt(name)), shape, jnp.float32)
            for name, shape in shapes.items()}

  s = jnp.asarray(sigma, jnp.float32)
  if isinstance(sigma, (int, float, np.floating, np.integer)):
    return draw(s)
  return jax.lax.cond(s == 0, lambda _: zeros, draw, s)
