"""Clipped policy-gradient losses of GRPO, DAPO (bnpo), Dr.GRPO and GSPO over completion tokens.

Conventions (those of TRL's GRPOTrainer, which the QeRL authors train with):
  rho_t     = exp(logp_t - old_logp_t)                    token importance ratio
              (GSPO: exp of the masked mean of the log-ratio over the sequence, one per row)
  loss_t    = -min(rho_t * A, clip(rho_t, 1 - eps_low, 1 + eps_high) * A) + beta * kl_t
  kl_t      = exp(ref_t - logp_t) - (ref_t - logp_t) - 1  k3 estimator of KL(pi || pi_ref)
and the mask-weighted sum of loss_t is divided by an aggregation-specific normalizer:
  "grpo"          each row by its own token count, then the rows are averaged   (sum_b mean_t) / B
  "bnpo" / "dapo" all tokens of the batch at once                              sum_bt / N_tokens
  "dr_grpo"       a constant                                                   sum_bt / (B * max_len)

Gradient accumulation: when a batch is split into micro-batches, pass the FULL batch's counts as
`num_tokens` (bnpo / dapo) and `num_sequences` (grpo, dr_grpo; also `max_len` for dr_grpo) to every
micro-batch call. Each micro-batch loss is then the partial sum of the full-batch loss, so summing the
micro-batch losses (and their gradients) gives exactly the full-batch loss (and gradient).
`loss_normalizers` computes these counts from the full batch's mask.
"""

from typing import Optional

import jax
import jax.numpy as jnp

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
IS_LEVELS = ("token", "sequence")


def effective_mask(mask_BxT, truncated_B=None, mask_truncated_completions: bool = False):
  """Completion-token mask in float32, with truncated rows zeroed when asked.

  A completion is truncated when it hit the length limit without a stop token; DAPO drops such rows from
  the loss because their reward judges an unfinished answer.
  """
  mask_BxT = jnp.asarray(mask_BxT).astype(jnp.float32)
  if mask_truncated_completions:
    if truncated_B is None:
      raise ValueError("mask_truncated_completions=True needs truncated_B (True where no stop token)")
    truncated_B = jnp.asarray(truncated_B)
    if truncated_B.shape != mask_BxT.shape[:1]:
      raise ValueError(f"truncated_B shape {truncated_B.shape} must be ({mask_BxT.shape[0]},)")
    mask_BxT = mask_BxT * (1.0 - truncated_B.astype(jnp.float32))[:, None]
  return mask_BxT


def loss_normalizers(mask_BxT, truncated_B=None, mask_truncated_completions: bool = False):
  """Global counts of a full batch, to pass to `policy_loss` for each of its micro-batches.

  Returns {"num_tokens": float32 count of loss tokens (after truncation masking),
           "num_sequences": int rows, including empty or truncated ones, as TRL's batch mean does,
           "max_len": int T}.
  """
  mask_BxT = effective_mask(mask_BxT, truncated_B, mask_truncated_completions)
  return {"num_tokens": mask_BxT.sum(), "num_sequences": int(mask_BxT.shape[0]),
          "max_len": int(mask_BxT.shape[1])}


def _masked_mean(x_BxT, mask_BxT):
  return (x_BxT * mask_BxT).sum() / jnp.maximum(mask_BxT.sum(), 1.0)


def _check_inputs(logp_BxT, old_logp_BxT, advantages_B, mask_BxT, ref_logp_BxT, entropy_BxT, loss_type,
                  importance_sampling_level, eps_low, eps_high, beta):
  if loss_type not in LOSS_TYPES:
    raise ValueError(f"{loss_type=} must be one of {LOSS_TYPES}")
  if importance_sampling_level not in IS_LEVELS:
    raise ValueError(f"{importance_sampling_level=} must be one of {IS_LEVELS}")
  if logp_BxT.ndim != 2:
    raise ValueError(f"logp_BxT must be [B, T], got shape {logp_BxT.shape}")
  for name, x in (("old_logp_BxT", old_logp_BxT), ("mask_BxT", mask_BxT), ("ref_logp_BxT", ref_logp_BxT),
                  ("entropy_BxT", entropy_BxT)):
    if x is not None and x.shape != logp_BxT.shape:
      raise ValueError(f"{name} shape {x.shape} must equal logp_BxT shape {logp_BxT.shape}")
  if advantages_B.shape != logp_BxT.shape[:1]:
    raise ValueError(f"advantages_B shape {advantages_B.shape} must be ({logp_BxT.shape[0]},)")
  if not (eps_low >= 0 and eps_high >= 0):
    raise ValueError(f"clip ranges must be >= 0, got {eps_low=} {eps_high=}")
  if beta < 0:
    raise ValueError(f"{beta=} must be >= 0")
  if beta > 0 and ref_logp_BxT is None:
    raise ValueError(f"{beta=} > 0 needs ref_logp_BxT (log-probs of the reference policy)")


def policy_loss(logp_BxT, old_logp_BxT, advantages_B, mask_BxT, *, loss_type: str = "bnpo",
                eps_low: float = 0.2, eps_high: float = 0.28, beta: float = 0.0, ref_logp_BxT=None,
                max_len: Optional[int] = None, num_tokens=None, num_sequences=None,
                importance_sampling_level: str = "token", truncated_B=None,
                mask_truncated_completions: bool = False, entropy_BxT=None, delta: Optional[float] = None):
  """Clipped surrogate loss to minimise, and its metrics (formulas in the module docstring).

  Jittable (the keyword options are static Python values; `num_tokens` may be traced) and differentiable
  w.r.t. `logp_BxT`. `old_logp_BxT`, `ref_logp_BxT` and `advantages_B` are treated as constants.

  Args:
    logp_BxT: log-probs of the completion tokens under the policy being optimised.
    old_logp_BxT: log-probs under the rollout policy (stored at rollout, needed when num_iterations > 1);
      None means on-policy: stop_gradient(logp_BxT), so rho = 1 with the right gradient.
    advantages_B: one advantage per completion (see `group_advantages`).
    mask_BxT: 1 on completion tokens that count (0 on padding, after EOS).
    loss_type: "grpo" | "bnpo" | "dapo" | "dr_grpo" (aggregation; "dapo" is "bnpo" with global counts).
    eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high] (DAPO's clip-higher: 0.2, 0.28).
    beta: weight of the k3 KL to `ref_logp_BxT` (0 in the paper's DAPO runs).
    max_len: dr_grpo's constant length (the max completion length); defaults to T.
    num_tokens: bnpo/dapo normalizer, the loss-token count of the FULL batch (for micro-batching);
      defaults to this call's count. Clamped to >= 1.
    num_sequences: grpo/dr_grpo normalizer, the FULL batch's row count; defaults to B.
    importance_sampling_level: "token" (GRPO/DAPO) or "sequence" (GSPO: one length-normalised ratio
      per completion, clipped as a whole).
    truncated_B, mask_truncated_completions: drop rows without a stop token from the loss.
    entropy_BxT: per-token policy entropy, only reported (no entropy bonus, as in the paper).
    delta: optional upper bound on the unclipped ratio (TRL's two-sided clipping); None disables it.

  Returns:
    (loss: float32 scalar, metrics: dict of float32 scalars). Metrics are means over this call's loss
    tokens: clip_frac_low (rho < 1 - eps_low with A < 0), clip_frac_high (rho > 1 + eps_high with A > 0),
    clip_frac, ratio_mean/min/max, kl (when a reference is given), entropy (when given), num_tokens.
  """
  logp_BxT = jnp.asarray(logp_BxT, jnp.float32)
  old_logp_BxT = (jax.lax.stop_gradient(logp_BxT) if old_logp_BxT is None
                  else jnp.asarray(old_logp_BxT, jnp.float32))
  advantages_B = jnp.asarray(advantages_B, jnp.float32)
  mask_BxT = jnp.asarray(mask_BxT)
  _check_inputs(logp_BxT, old_logp_BxT, advantages_B, mask_BxT, ref_logp_BxT, entropy_BxT, loss_type,
                importance_sampling_level, eps_low, eps_high, beta)
  batch, length = logp_BxT.shape
  mask_BxT = effective_mask(mask_BxT, truncated_B, mask_truncated_completions)
  old_logp_BxT = jax.lax.stop_gradient(old_logp_BxT)
  advantages_Bx1 = jax.lax.stop_gradient(advantages_B)[:, None]

  log_ratio_BxT = logp_BxT - old_logp_BxT
  if importance_sampling_level == "sequence":
    tokens_B = jnp.maximum(mask_BxT.sum(axis=1), 1.0)
    log_ratio_Bx1 = ((log_ratio_BxT * mask_BxT).sum(axis=1) / tokens_B)[:, None]
    ratio_BxT = jnp.broadcast_to(jnp.exp(log_ratio_Bx1), (batch, length))
  else:
    ratio_BxT = jnp.exp(log_ratio_BxT)
  clipped_BxT = jnp.clip(ratio_BxT, 1.0 - eps_low, 1.0 + eps_high)
  unclipped_BxT = ratio_BxT if delta is None else jnp.minimum(ratio_BxT, delta)
  per_token_BxT = -jnp.minimum(unclipped_BxT * advantages_Bx1, clipped_BxT * advantages_Bx1)

  metrics = {}
  if ref_logp_BxT is not None:
    ref_diff_BxT = jax.lax.stop_gradient(jnp.asarray(ref_logp_BxT, jnp.float32)) - logp_BxT
    kl_BxT = jnp.exp(ref_diff_BxT) - ref_diff_BxT - 1.0
    if beta > 0:
      per_token_BxT = per_token_BxT + beta * kl_BxT
    metrics["kl"] = _masked_mean(jax.lax.stop_gradient(kl_BxT), mask_BxT)

  summed = (per_token_BxT * mask_BxT).sum()
  if loss_type == "grpo":
    rows = num_sequences if num_sequences is not None else batch
    per_row_B = (per_token_BxT * mask_BxT).sum(axis=1) / jnp.maximum(mask_BxT.sum(axis=1), 1.0)
    loss = per_row_B.sum() / rows
  elif loss_type in ("bnpo", "dapo"):
    tokens = mask_BxT.sum() if num_tokens is None else jnp.asarray(num_tokens, jnp.float32)
    loss = summed / jnp.maximum(tokens, 1.0)
  else:  # dr_grpo
    rows = num_sequences if num_sequences is not None else batch
    loss = summed / (rows * (max_len if max_len is not None else length))

  ratio_sg_BxT = jax.lax.stop_gradient(ratio_BxT)
  low_BxT = ((ratio_sg_BxT < 1.0 - eps_low) & (advantages_Bx1 < 0)).astype(jnp.float32)
  high_BxT = ((ratio_sg_BxT > 1.0 + eps_high) & (advantages_Bx1 > 0)).astype(jnp.float32)
  has_tokens = mask_BxT > 0
  metrics.update({
    "clip_frac_low": _masked_mean(low_BxT, mask_BxT),
    "clip_frac_high": _masked_mean(high_BxT, mask_BxT),
    "clip_frac": _masked_mean(jnp.maximum(low_BxT, high_BxT), mask_BxT),
    "ratio_mean": _masked_mean(ratio_sg_BxT, mask_BxT),
    "ratio_min": jnp.where(has_tokens.any(), jnp.min(jnp.where(has_tokens, ratio_sg_BxT, jnp.inf)), 1.0),
    "ratio_max": jnp.where(has_tokens.any(), jnp.max(jnp.where(has_tokens, ratio_sg_BxT, -jnp.inf)), 1.0),
    "num_tokens": mask_BxT.sum(),
  })
  if entropy_BxT is not None:
    metrics["entropy"] = _masked_mean(jax.lax.stop_gradient(jnp.asarray(entropy_BxT, jnp.float32)),
                                      mask_BxT)
  return loss, metrics
