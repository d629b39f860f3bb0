"""policy_loss against an independent NumPy implementation (values) and torch autograd (gradients) of
the TRL / QERL.md formulas, hand-computed cases, and micro-batch accumulation == full batch."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from qerl_jax.rl import loss_normalizers, policy_loss

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
LEVELS = ("token", "sequence")


@pytest.fixture
def rng():
  seed = int(np.random.SeedSequence().entropy % 2**31)
  print(f"seed={seed}")  # shown by pytest when a test fails
  return np.random.default_rng(seed)


def make_batch(rng, batch=6, length=7, with_ref=True):
  """Random inputs where clipping is active on both sides, with an empty row and ragged lengths."""
  logp = rng.normal(-1.5, 0.6, (batch, length)).astype(np.float32)
  old = (logp + rng.normal(0.0, 0.5, (batch, length))).astype(np.float32)
  adv = rng.normal(0.0, 1.0, batch).astype(np.float32)
  adv[0], adv[1] = 1.3, -0.7  # both signs present whatever the draw
  # Rows 0 and 1 are full and hold one surely clipped token each: ratio e^0.5 with A > 0 (high side),
  # ratio e^-0.5 with A < 0 (low side); the other tokens are random.
  old[0, 0], old[1, 0] = logp[0, 0] - 0.5, logp[1, 0] + 0.5
  lengths = rng.integers(1, length + 1, batch)
  lengths[:2] = length
  lengths[2] = 0  # an empty row
  mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32)
  ref = (logp + rng.normal(0.0, 0.3, (batch, length))).astype(np.float32) if with_ref else None
  truncated = rng.random(batch) < 0.4
  truncated[0] = truncated[3] = False  # both halves of the batch keep loss tokens
  return logp, old, adv, mask, ref, truncated


def numpy_loss(logp, old, adv, mask, *, loss_type, eps_low=0.2, eps_high=0.28, beta=0.0, ref=None,
               max_len=None, level="token", truncated=None, num_tokens=None, num_sequences=None):
  """The formulas of QERL.md, written out in float64 NumPy."""
  logp, old, adv, mask = (np.asarray(x, np.float64) for x in (logp, old, adv, mask))
  if truncated is not None:
    mask = mask * (~truncated)[:, None]
  b, t = logp.shape
  if level == "sequence":
    row_ratio = np.exp((mask * (logp - old)).sum(1) / np.maximum(mask.sum(1), 1))
    ratio = np.repeat(row_ratio[:, None], t, axis=1)
  else:
    ratio = np.exp(logp - old)
  a = adv[:, None]
  per_token = -np.minimum(ratio * a, np.clip(ratio, 1 - eps_low, 1 + eps_high) * a)
  kl = None
  if ref is not None:
    d = np.asarray(ref, np.float64) - logp
    kl = np.exp(d) - d - 1
    per_token = per_token + beta * kl
  rows = b if num_sequences is None else num_sequences
  if loss_type == "grpo":
    loss = ((per_token * mask).sum(1) / np.maximum(mask.sum(1), 1)).sum() / rows
  elif loss_type in ("bnpo", "dapo"):
    loss = (per_token * mask).sum() / max(mask.sum() if num_tokens is None else num_tokens, 1)
  else:
    loss = (per_token * mask).sum() / (rows * (t if max_len is None else max_len))
  n = max(mask.sum(), 1)
  low = (ratio < 1 - eps_low) & (a < 0)
  high = (ratio > 1 + eps_high) & (a > 0)
  metrics = {"clip_frac_low": (low * mask).sum() / n, "clip_frac_high": (high * mask).sum() / n,
             "clip_frac": ((low | high) * mask).sum() / n, "ratio_mean": (ratio * mask).sum() / n,
             "ratio_min": ratio[mask > 0].min(), "ratio_max": ratio[mask > 0].max(), "num_tokens": mask.sum()}
  if kl is not None:
    metrics["kl"] = (kl * mask).sum() / n
  return loss, metrics


def torch_grad(logp, old, adv, mask, *, loss_type, eps_low=0.2, eps_high=0.28, beta=0.0, ref=None,
               max_len=None, level="token", truncated=None):
  """d loss / d logp by torch autograd of a TRL-style torch implementation (float64)."""
  lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
  old_t, m = torch.tensor(old, dtype=torch.float64), torch.tensor(mask, dtype=torch.float64)
  a = torch.tensor(adv, dtype=torch.float64)[:, None]
  if truncated is not None:
    m = m * torch.tensor(~truncated, dtype=torch.float64)[:, None]
  log_ratio = lp - old_t
  if level == "sequence":
    log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]
  coef = torch.exp(log_ratio)
  per_token = -torch.min(coef * a, torch.clamp(coef, 1 - eps_low, 1 + eps_high) * a)
  if beta:
    d = torch.tensor(ref, dtype=torch.float64) - lp
    per_token = per_token + beta * (torch.exp(d) - d - 1)
  per_token = per_token.expand_as(m)
  if loss_type == "grpo":
    loss = ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
  elif loss_type in ("bnpo", "dapo"):
    loss = (per_token * m).sum() / m.sum().clamp(min=1.0)
  else:
    loss = (per_token * m).sum() / (m.shape[0] * (m.shape[1] if max_len is None else max_len))
  loss.backward()
  return lp.grad.numpy()


@pytest.mark.parametrize("loss_type,level,beta", list(itertools.product(LOSS_TYPES, LEVELS, (0.0, 0.04))))
def test_matches_numpy_and_torch_grad(rng, loss_type, level, beta):
  logp, old, adv, mask, ref, _ = make_batch(rng)
  kwargs = dict(loss_type=loss_type, beta=beta, importance_sampling_level=level)
  loss, metrics = policy_loss(logp, old, adv, mask, ref_logp_BxT=ref, **kwargs)
  want, want_metrics = numpy_loss(logp, old, adv, mask, loss_type=loss_type, beta=beta, ref=ref, level=level)
  np.testing.assert_allclose(float(loss), want, rtol=2e-5, atol=1e-6)
  for name, value in want_metrics.items():
    np.testing.assert_allclose(float(metrics[name]), value, rtol=2e-5, atol=1e-6, err_msg=name)
  if level == "token":  # the inputs really exercise both clip sides
    assert want_metrics["clip_frac_low"] > 0 and want_metrics["clip_frac_high"] > 0
  grad = jax.grad(lambda lp: policy_loss(lp, old, adv, mask, ref_logp_BxT=ref, **kwargs)[0])(logp)
  want_grad = torch_grad(logp, old, adv, mask, loss_type=loss_type, beta=beta, ref=ref, level=level)
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=2e-5, atol=1e-7)
  assert np.all(np.asarray(grad)[mask == 0] == 0)  # padding gets no gradient


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_mask_truncated_completions(rng, loss_type):
  logp, old, adv, mask, _, truncated = make_batch(rng)
  truncated[3] = True
  got, metrics = policy_loss(logp, old, adv, mask, loss_type=loss_type, truncated_B=truncated,
                             mask_truncated_completions=True, max_len=9)
  want, _ = numpy_loss(logp, old, adv, mask, loss_type=loss_type, truncated=truncated, max_len=9)
  np.testing.assert_allclose(float(got), want, rtol=2e-5, atol=1e-6)
  assert float(metrics["num_tokens"]) == mask[~truncated].sum()
  grad = jax.grad(lambda lp: policy_loss(lp, old, adv, mask, loss_type=loss_type, truncated_B=truncated,
                                         mask_truncated_completions=True, max_len=9)[0])(logp)
  assert np.all(np.asarray(grad)[truncated] == 0)
  np.testing.assert_allclose(np.asarray(grad), torch_grad(logp, old, adv, mask, loss_type=loss_type,
                                                          truncated=truncated, max_len=9), rtol=2e-5, atol=1e-7)
  # Without the flag the truncated rows count again (so the flag matters for this draw).
  unflagged, _ = policy_loss(logp, old, adv, mask, loss_type=loss_type, truncated_B=truncated, max_len=9)
  np.testing.assert_allclose(float(unflagged), numpy_loss(logp, old, adv, mask, loss_type=loss_type,
                                                          max_len=9)[0], rtol=2e-5, atol=1e-6)


def test_hand_computed_clipping():
  # ratios 1.5 and 0.5 (old logp 0); clip range [0.8, 1.28].
  logp = np.log(np.array([[1.5, 0.5]], np.float32))
  old, mask = np.zeros((1, 2), np.float32), np.ones((1, 2), np.float32)
  pos, m = policy_loss(logp, old, np.array([1.0]), mask, loss_type="bnpo")
  # A = +1: token 1 takes the clipped 1.28 (min of 1.5, 1.28), token 2 the unclipped 0.5.
  assert float(pos) == pytest.approx(-(1.28 + 0.5) / 2, abs=1e-6)
  assert float(m["clip_frac_high"]) == 0.5 and float(m["clip_frac_low"]) == 0.0
  # A = -1: token 1 unclipped -1.5 -> 1.5, token 2 clipped -0.8 -> 0.8.
  neg, m = policy_loss(logp, old, np.array([-1.0]), mask, loss_type="grpo")
  assert float(neg) == pytest.approx((1.5 + 0.8) / 2, abs=1e-6)
  assert float(m["clip_frac_low"]) == 0.5 and float(m["clip_frac_high"]) == 0.0
  dr, _ = policy_loss(logp, old, np.array([1.0]), mask, loss_type="dr_grpo", max_len=4)
  assert float(dr) == pytest.approx(-(1.28 + 0.5) / 4, abs=1e-6)
  # Gradient: the clipped token gets none, the other d(-rho)/dlogp / 2 = -0.5 / 2.
  g = jax.grad(lambda lp: policy_loss(lp, old, np.array([1.0]), mask, loss_type="bnpo")[0])(logp)
  np.testing.assert_allclose(np.asarray(g), [[0.0, -0.25]], atol=1e-6)
  # k3 KL with ref - logp = ln 2 on both tokens: 2 - ln 2 - 1.
  ref = logp + np.log(2.0).astype(np.float32)
  _, m = policy_loss(logp, old, np.array([1.0]), mask, loss_type="bnpo", beta=0.1, ref_logp_BxT=ref)
  assert float(m["kl"]) == pytest.approx(1.0 - np.log(2.0), abs=1e-6)
  kl_loss, _ = policy_loss(logp, old, np.array([1.0]), mask, loss_type="bnpo", beta=0.1, ref_logp_BxT=ref)
  assert float(kl_loss) == pytest.approx(-(1.28 + 0.5) / 2 + 0.1 * (1.0 - np.log(2.0)), abs=1e-6)


def test_hand_computed_gspo_and_on_policy():
  # GSPO: row ratio exp(mean(log 1.5, log 0.5)) = sqrt(0.75) = 0.866 lies inside [0.8, 1.28].
  logp = np.log(np.array([[1.5, 0.5, 7.0]], np.float32))
  mask = np.array([[1.0, 1.0, 0.0]], np.float32)
  loss, m = policy_loss(logp, np.zeros((1, 3)), np.array([2.0]), mask, loss_type="grpo",
                        importance_sampling_level="sequence")
  assert float(loss) == pytest.approx(-2.0 * np.sqrt(0.75), abs=1e-6)
  assert float(m["ratio_mean"]) == pytest.approx(np.sqrt(0.75), abs=1e-6)
  # On-policy (old=None): rho = 1, loss = -mean A, gradient -A / tokens per token.
  loss, m = policy_loss(logp, None, np.array([2.0]), mask, loss_type="bnpo")
  assert float(loss) == pytest.approx(-2.0) and float(m["ratio_max"]) == 1.0
  g = jax.grad(lambda lp: policy_loss(lp, None, np.array([2.0]), mask, loss_type="bnpo")[0])(logp)
  np.testing.assert_allclose(np.asarray(g), [[-1.0, -1.0, 0.0]], atol=1e-6)


@pytest.mark.parametrize("loss_type,level", list(itertools.product(LOSS_TYPES, LEVELS)))
def test_microbatch_accumulation_equals_full_batch(rng, loss_type, level):
  logp, old, adv, mask, ref, truncated = make_batch(rng)
  kw = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.05,
            mask_truncated_completions=True)
  norms = loss_normalizers(mask, truncated, mask_truncated_completions=True)
  cut_sets = ((0, 3, 6), (0, 2, 4, 6), (0, 1, 6))

  def loss_of(lp, lo, hi, **extra):
    return policy_loss(lp, old[lo:hi], adv[lo:hi], mask[lo:hi], ref_logp_BxT=ref[lo:hi],
                       truncated_B=truncated[lo:hi], **kw, **extra)[0]

  # Everything in one jit: eager dispatch would compile each op once per micro-batch shape (~1 s each).
  @jax.jit
  def run(lp, num_tokens):
    full = jax.value_and_grad(lambda x: loss_of(x, 0, 6))(lp)
    micro = []
    for cuts in cut_sets:
      parts = [jax.value_and_grad(lambda x, lo=lo, hi=hi: loss_of(
        x, lo, hi, num_tokens=num_tokens, num_sequences=norms["num_sequences"], max_len=norms["max_len"]))(
          lp[lo:hi]) for lo, hi in zip(cuts[:-1], cuts[1:])]
      micro.append((sum(v for v, _ in parts), jnp.concatenate([g for _, g in parts])))
    naive = loss_of(lp[:3], 0, 3) + loss_of(lp[3:], 3, 6)
    return full, micro, naive

  (full_loss, full_grad), micro, naive = run(logp, norms["num_tokens"])
  for total, grad in micro:
    np.testing.assert_allclose(float(total), float(full_loss), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(full_grad), rtol=1e-5, atol=1e-7)
  # The global counts are what makes it exact: per-micro-batch normalisation differs. Relative to the losses' size:
  # for "grpo" the naive sum is twice the full loss, which a random batch can put within 1e-4 of zero.
  assert abs(float(naive) - float(full_loss)) > 1e-3 * max(abs(float(naive)), abs(float(full_loss))), (naive, full_loss)


def test_jit_matches_eager_and_empty_batch(rng):
  logp, old, adv, mask, ref, _ = make_batch(rng)
  fn = jax.jit(policy_loss, static_argnames=("loss_type", "beta", "importance_sampling_level"))
  got, gm = fn(logp, old, adv, mask, loss_type="dapo", beta=0.04, ref_logp_BxT=ref, num_tokens=mask.sum())
  want, wm = policy_loss(logp, old, adv, mask, loss_type="dapo", beta=0.04, ref_logp_BxT=ref)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  assert gm.keys() == wm.keys()
  empty = np.zeros_like(mask)
  for loss_type in LOSS_TYPES:
    loss, m = policy_loss(logp, old, adv, empty, loss_type=loss_type, entropy_BxT=np.ones_like(logp))
    assert float(loss) == 0.0
    assert all(np.isfinite(float(v)) for v in m.values())
    assert float(m["num_tokens"]) == 0.0 and float(m["entropy"]) == 0.0


def test_entropy_metric_and_delta(rng):
  logp, old, adv, mask, _, _ = make_batch(rng)
  ent = rng.random(logp.shape).astype(np.float32)
  _, m = policy_loss(logp, old, adv, mask, entropy_BxT=ent)
  assert float(m["entropy"]) == pytest.approx((ent * mask).sum() / mask.sum(), rel=1e-5)
  # delta caps the unclipped ratio: with A < 0 a huge ratio's loss is bounded by delta * |A|.
  loss, _ = policy_loss(np.array([[5.0, 0.0]]), np.zeros((1, 2)), np.array([-1.0]),
                        np.array([[1.0, 0.0]]), loss_type="bnpo", delta=3.0)
  assert float(loss) == pytest.approx(3.0)


def test_bad_inputs_raise():
  x, a, m = np.zeros((2, 3)), np.zeros(2), np.ones((2, 3))
  with pytest.raises(ValueError, match="loss_type"):
    policy_loss(x, x, a, m, loss_type="ppo")
  with pytest.raises(ValueError, match="ref_logp_BxT"):
    policy_loss(x, x, a, m, beta=0.1)
  with pytest.raises(ValueError, match="advantages_B"):
    policy_loss(x, x, np.zeros(3), m)
  with pytest.raises(ValueError, match="mask_BxT"):
    policy_loss(x, x, a, np.ones((2, 4)))
  with pytest.raises(ValueError, match="truncated_B"):
    policy_loss(x, x, a, m, mask_truncated_completions=True)
  with pytest.raises(ValueError, match="importance_sampling_level"):
    policy_loss(x, x, a, m, importance_sampling_level="segment")
