"""token_logprobs (chunked over sequence and vocabulary) against NumPy formulas, values and gradients."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax.train.logprobs import token_logprobs


def _rng(name):
  return np.random.default_rng(zlib.crc32(name.encode()))


def _numpy_logprobs(h, w, t, temperature):
  logits = (h.astype(np.float64) @ w.astype(np.float64)) / temperature
  logits -= logits.max(-1, keepdims=True)
  logp_all = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  p = np.exp(logp_all)
  logp = np.take_along_axis(logp_all, t[..., None], -1)[..., 0]
  entropy = -(p * logp_all).sum(-1)
  # d logp[b, i] / d h[b, i] = (w[:, t] - w @ p) / temperature
  grad_h = (w.T[t] - p @ w.T) / temperature
  return logp, entropy, grad_h


@pytest.mark.parametrize("batch,length,hidden,vocab,chunk,vocab_chunk,temperature", [
  (2, 7, 16, 50, 3, 16, 1.0),     # ragged: T % chunk != 0 and V % vocab_chunk != 0 (shifted last slice)
  (3, 8, 8, 64, 8, 64, 0.7),      # one chunk, one slice, temperature
  (1, 5, 12, 33, 2, 5, 1.3),      # many small slices
])
def test_chunked_equals_numpy(request, batch, length, hidden, vocab, chunk, vocab_chunk, temperature):
  rng = _rng(request.node.name)
  h = rng.normal(size=(batch, length, hidden)).astype(np.float32)
  w = (rng.normal(size=(hidden, vocab)) * 0.7).astype(np.float32)
  t = rng.integers(0, vocab, size=(batch, length))
  t[0, 0] = vocab - 1  # the last column sits in the shifted slice
  want_logp, want_ent, want_grad = _numpy_logprobs(h, w, t, temperature)

  fn = lambda h: token_logprobs(h, jnp.asarray(w.T), jnp.asarray(t), chunk=chunk, vocab_chunk=vocab_chunk,
                                temperature=temperature)
  logp, ent = jax.jit(fn)(jnp.asarray(h))
  np.testing.assert_allclose(np.asarray(logp), want_logp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent), want_ent, rtol=1e-5, atol=1e-5)
  grad = jax.jit(jax.grad(lambda h: fn(h)[0].sum()))(jnp.asarray(h))
  np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-4, atol=1e-5)


def test_bf16_inputs_accumulate_in_float32(request):
  rng = _rng(request.node.name)
  h = rng.normal(size=(2, 6, 32)).astype(np.float32)
  w = (rng.normal(size=(32, 40)) * 0.3).astype(np.float32)
  t = rng.integers(0, 40, size=(2, 6))
  h16, w16 = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  want_logp, want_ent, _ = _numpy_logprobs(np.asarray(h16, np.float32), np.asarray(w16, np.float32), t, 1.0)
  logp, ent = token_logprobs(h16, w16.T, jnp.asarray(t), chunk=4, vocab_chunk=16)
  assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(logp), want_logp, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(ent), want_ent, rtol=1e-4, atol=1e-4)


def test_no_full_logits_buffer():
  """The compiled forward+backward never holds [B, T, V] float32 logits."""
  batch, length, hidden, vocab = 4, 64, 16, 4096
  h = jnp.ones((batch, length, hidden), jnp.float32)
  w = jnp.ones((vocab, hidden), jnp.float32)
  t = jnp.zeros((batch, length), jnp.int32)
  f = jax.jit(jax.grad(lambda h: token_logprobs(h, w, t, chunk=16, vocab_chunk=512)[0].sum()))
  stats = f.lower(h).compile().memory_analysis()
  full = batch * length * vocab * 4
  assert stats.temp_size_in_bytes < full / 4, (stats.temp_size_in_bytes, full)


def test_bad_shapes_raise():
  with pytest.raises(ValueError, match="lm_head_VxD.shape"):
    token_logprobs(jnp.ones((1, 2, 3)), jnp.ones((5, 4)), jnp.zeros((1, 2), jnp.int32))
  with pytest.raises(ValueError, match="temperature"):
    token_logprobs(jnp.ones((1, 2, 3)), jnp.ones((5, 3)), jnp.zeros((1, 2), jnp.int32), temperature=0.0)
