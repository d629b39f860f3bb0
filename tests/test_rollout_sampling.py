"""Sampling statistics and log-probs of qerl_jax.rollout.sampling against NumPy formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax.rollout.sampling import SamplingParams, sample


def _seed():
  seed = int(np.random.SeedSequence().entropy % (2**31))
  print(f"seed={seed}")
  return seed


def _np_nucleus(logits_V, temperature, top_p, top_k):
  """Independent NumPy version of the truncated distribution: probabilities over V."""
  z = logits_V.astype(np.float64) / temperature
  keep = np.ones_like(z, bool)
  if top_k:
    keep &= z >= np.sort(z)[::-1][top_k - 1]
  p = np.exp(z - z[keep].max()) * keep
  p /= p.sum()
  if top_p < 1:
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    nucleus = np.zeros_like(keep)
    nucleus[order[before < top_p]] = True
    keep &= nucleus
  q = np.where(keep, p, 0.0)
  return q / q.sum()


def test_frequencies_match_softmax_chi_square():
  rng = np.random.default_rng(_seed())
  vocab, draws, temperature = 8, 40_000, 0.7
  logits_V = rng.normal(size=vocab).astype(np.float32)
  logits_BxV = jnp.broadcast_to(jnp.asarray(logits_V), (draws, vocab))
  tokens_B, _ = jax.jit(sample, static_argnums=2)(
    logits_BxV, jax.random.key(rng.integers(1 << 30)), SamplingParams(temperature=temperature))
  counts = np.bincount(np.asarray(tokens_B), minlength=vocab)
  expected = draws * _np_nucleus(logits_V, temperature, 1.0, 0)
  chi2 = float(((counts - expected) ** 2 / expected).sum())
  # 99.99% quantile of chi-square with 7 degrees of freedom is 29.88.
  assert chi2 < 29.88, (counts, expected, chi2)


@pytest.mark.parametrize("top_p,top_k", [(0.6, 0), (1.0, 5), (0.8, 7)])
def test_truncated_sampling_stays_inside_and_logprobs_are_renormalized(top_p, top_k):
  rng = np.random.default_rng(_seed())
  batch, vocab, temperature = 64, 50, 1.3
  logits_BxV = rng.normal(scale=2.0, size=(batch, vocab)).astype(np.float32)
  params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
  fn = jax.jit(sample, static_argnums=2)
  for rep in range(20):
    tokens_B, logp_B = fn(jnp.asarray(logits_BxV), jax.random.key(rep + rng.integers(1 << 30)), params)
    tokens_B, logp_B = np.asarray(tokens_B), np.asarray(logp_B)
    for b in range(batch):
      q = _np_nucleus(logits_BxV[b], temperature, top_p, top_k)
      assert q[tokens_B[b]] > 0, f"row {b} drew token {tokens_B[b]} outside the nucleus"
      np.testing.assert_allclose(logp_B[b], np.log(q[tokens_B[b]]), rtol=1e-5, atol=1e-5)


def test_untruncated_logprob_is_log_softmax_at_temperature_and_greedy_is_argmax():
  rng = np.random.default_rng(_seed())
  logits_BxV = rng.normal(size=(16, 30)).astype(np.float32)
  tokens_B, logp_B = sample(jnp.asarray(logits_BxV), jax.random.key(3), SamplingParams(temperature=0.5))
  ref = jax.nn.log_softmax(logits_BxV / 0.5, axis=-1)
  np.testing.assert_allclose(logp_B, np.take_along_axis(np.asarray(ref), np.asarray(tokens_B)[:, None], 1)[:, 0],
                             rtol=1e-5, atol=1e-6)
  greedy_B, greedy_logp_B = sample(jnp.asarray(logits_BxV), jax.random.key(0), SamplingParams(temperature=0))
  np.testing.assert_array_equal(greedy_B, logits_BxV.argmax(-1))
  np.testing.assert_allclose(greedy_logp_B, np.asarray(jax.nn.log_softmax(logits_BxV, -1)).max(-1), rtol=1e-6)


def test_same_key_same_tokens_different_key_different_tokens():
  logits_BxV = jnp.asarray(np.random.default_rng(_seed()).normal(size=(256, 40)), jnp.float32)
  params = SamplingParams(temperature=1.0)
  a, _ = sample(logits_BxV, jax.random.key(11), params)
  b, _ = sample(logits_BxV, jax.random.key(11), params)
  c, _ = sample(logits_BxV, jax.random.key(12), params)
  np.testing.assert_array_equal(a, b)
  assert (np.asarray(a) != np.asarray(c)).mean() > 0.5


@pytest.mark.parametrize("kwargs,match", [
  (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
  (dict(top_k=-1), "top_k")])
def test_bad_sampling_params(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SamplingParams(**kwargs)
