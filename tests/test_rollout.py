"""The rollout engine against transformers' greedy generate and a teacher-forced forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import qerl_jax
from qerl_jax.rollout import engine
from qerl_jax.rollout.generate import left_pad


class IdTokenizer:
  """The least a tokenizer needs for `generate` on id prompts (the tiny random models have no vocab)."""

  eos_token_id = 5
  pad_token_id = 0

  def get_vocab(self):
    return {}

  def decode(self, ids, skip_special_tokens=True):
    return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
  """A tiny random Qwen2 (qkv bias, GQA) saved by transformers, loaded by both sides in float32."""
  cfg = transformers.Qwen2Config(
    vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, rope_theta=10000.0)
  torch.manual_seed(int(np.random.SeedSequence().entropy % 2**31))
  hf = transformers.Qwen2ForCausalLM(cfg).eval()
  with torch.no_grad():  # sharper logits than the 0.02 init, so sampling and greedy are not all ties
    for p in hf.parameters():
      p.mul_(4.0) if p.ndim == 2 else None
  path = tmp_path_factory.mktemp("qwen2")
  hf.save_pretrained(path)
  model, _ = qerl_jax.from_pretrained(str(path), quant="bf16", dtype=jnp.float32, lora_rank=0,
                                      load_tokenizer=False)
  return hf, model


def _prompts(rng, n, vocab=97):
  return [list(map(int, rng.integers(6, vocab, size=int(rng.integers(3, 12))))) for _ in range(n)]


def test_greedy_matches_transformers_token_for_token(tiny_qwen2):
  hf, model = tiny_qwen2
  rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**31))
  prompts = _prompts(rng, 3)
  outs = qerl_jax.generate(model, IdTokenizer(), prompts, max_new_tokens=16, temperature=0, stop_token_ids=())
  for prompt, out in zip(prompts, outs):
    with torch.no_grad():
      ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == ref
    assert out.finish_reason == "length"


def test_logprobs_equal_teacher_forced_forward_with_noise(tiny_qwen2):
  _, model = tiny_qwen2
  rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**31))
  prompts = _prompts(rng, 3)
  cfg = model.config
  noise = {"input_layernorm": 0.05 * jnp.asarray(rng.normal(size=(cfg.num_layers, cfg.hidden_size)), jnp.float32),
           "post_attention_layernorm": 0.05 * jnp.asarray(rng.normal(size=(cfg.num_layers, cfg.hidden_size)),
                                                          jnp.float32)}
  temperature = 0.8
  outs = qerl_jax.generate(model, IdTokenizer(), prompts, max_new_tokens=12, temperature=temperature, seed=7,
                           stop_token_ids=(), norm_noise=noise)
  for prompt, out in zip(prompts, outs):
    seq = jnp.asarray([prompt + out.token_ids])
    logits = model(seq, norm_noise=noise)[0, len(prompt) - 1:-1] / temperature
    ref = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), jnp.asarray(out.token_ids)[:, None], 1)[:, 0]
    np.testing.assert_allclose(out.logprobs, np.asarray(ref), rtol=1e-4, atol=1e-4)
  # The noise reached the policy: without it the same seed gives other log-probs.
  plain = qerl_jax.generate(model, IdTokenizer(), prompts, max_new_tokens=12, temperature=temperature, seed=7,
                            stop_token_ids=())
  assert any(not np.allclose(a.logprobs[:1], b.logprobs[:1]) for a, b in zip(outs, plain))


def test_stop_tokens_lengths_and_padding(tiny_qwen2):
  _, model = tiny_qwen2
  rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**31))
  prompts = _prompts(rng, 6)
  # Greedy first: pick as stop id a token some row emits at step 3, so that row must stop there.
  free = qerl_jax.generate(model, IdTokenizer(), prompts, max_new_tokens=10, temperature=0, stop_token_ids=())
  stop = free[0].token_ids[3]
  outs = qerl_jax.generate(model, IdTokenizer(), prompts, max_new_tokens=10, temperature=0,
                           stop_token_ids=(stop,))
  for f, o in zip(free, outs):
    if stop in f.token_ids:
      cut = f.token_ids.index(stop) + 1
      assert o.token_ids == f.token_ids[:cut] and o.finish_reason == "stop" and o.stop_reason == stop
    else:
      assert o.token_ids == f.token_ids and o.finish_reason == "length" and o.stop_reason is None
  assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) <= 4


def test_stop_strings_cut_the_text_before_them_and_the_tokens_through_them(tiny_qwen2):
  # vLLM's `stop`: the text ends before the first stop string, the tokens (and log-probs) run through the one
  # that completed it; a row without any is untouched.
  _, model = tiny_qwen2
  rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**31))
  prompts = _prompts(rng, 6)
  tok = IdTokenizer()
  free = qerl_jax.generate(model, tok, prompts, max_new_tokens=10, temperature=0, stop_token_ids=())
  stop = f"{free[0].token_ids[3]} {free[0].token_ids[4]}"  # spans two tokens of row 0
  outs = qerl_jax.generate(model, tok, prompts, max_new_tokens=10, temperature=0, stop_token_ids=(),
                           stop=["no such text", stop])
  for f, o in zip(free, outs):
    if stop in f.text:
      k = len(o.token_ids)
      assert o.text == f.text[:f.text.index(stop)]
      assert o.token_ids == f.token_ids[:k] and o.logprobs == f.logprobs[:k]
      assert stop in tok.decode(o.token_ids) and stop not in tok.decode(o.token_ids[:-1])
      assert (o.finish_reason, o.stop_reason) == ("stop", stop)
    else:
      assert (o.token_ids, o.text, o.finish_reason, o.stop_reason) == (f.token_ids, f.text, "length", None)
  assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) <= 5


def test_decode_compiles_once_per_bucket_and_seeds_reproduce(tiny_qwen2):
  _, model = tiny_qwen2
  rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**31))
  kwargs = dict(max_new_tokens=8, temperature=1.0, stop_token_ids=(), num_samples=2)
  qerl_jax.generate(model, IdTokenizer(), _prompts(rng, 2), seed=1, **kwargs)
  before = engine.TRACE_COUNT["rollout"]
  qerl_jax.generate(model, IdTokenizer(), _prompts(rng, 2), seed=2, **kwargs)  # same bucket: 4 rows, <64
  b = qerl_jax.generate(model, IdTokenizer(), [[7, 8, 9]] * 2, seed=3, **kwargs)
  assert engine.TRACE_COUNT["rollout"] == before, "the decode loop was traced again inside one bucket"
  again = qerl_jax.generate(model, IdTokenizer(), [[7, 8, 9]] * 2, seed=3, **kwargs)
  assert [c.token_ids for c in again] == [c.token_ids for c in b]
  # Two samples of one prompt differ (different rows draw different noise).
  assert b[0].token_ids != b[1].token_ids


def test_left_padded_batch_equals_single_rows(tiny_qwen2):
  _, model = tiny_qwen2
  rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**31))
  prompts = _prompts(rng, 4)
  together = qerl_jax.generate(model, IdTokenizer(), prompts, max_new_tokens=6, temperature=0, stop_token_ids=())
  for p, t in zip(prompts, together):
    alone = qerl_jax.generate(model, IdTokenizer(), [p], max_new_tokens=6, temperature=0, stop_token_ids=())
    assert alone[0].token_ids == t.token_ids


def test_left_pad_layout():
  tokens, valid = left_pad([[1, 2], [3]], batch=3, length=4, pad_id=0)
  np.testing.assert_array_equal(tokens, [[0, 0, 1, 2], [0, 0, 0, 3], [0, 0, 0, 0]])
  np.testing.assert_array_equal(valid, [[0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 1]])


@pytest.mark.parametrize("prompts,kwargs,match", [
  ([], dict(max_new_tokens=4), "empty"),
  ([[]], dict(max_new_tokens=4), "empty"),
  ([[1, 2]], dict(max_new_tokens=0), "max_new_tokens"),
  ([[1, 2]], dict(max_new_tokens=4, temperature=-1.0), "temperature"),
  ([[1, 2]], dict(max_new_tokens=4, top_p=0.0), "top_p"),
  ([[1, 2]], dict(max_new_tokens=4, top_p=1.2), "top_p"),
  ([[1] * 250], dict(max_new_tokens=10), "exceeds"),
  ([[1, 2]], dict(max_new_tokens=4, stop=["</a>", ""]), "stop strings"),
  ([[1, 2]], dict(max_new_tokens=4, stop=[7]), "stop strings"),
])
def test_bad_input_is_refused_before_compiling(tiny_qwen2, prompts, kwargs, match):
  _, model = tiny_qwen2
  before = engine.TRACE_COUNT["rollout"]
  with pytest.raises(ValueError, match=match):
    qerl_jax.generate(model, IdTokenizer(), prompts, **kwargs)
  assert engine.TRACE_COUNT["rollout"] == before
