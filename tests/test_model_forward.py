"""The forward contract: KV-cache decoding, left padding, AQN norm noise, remat, trainable/frozen split."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qerl_jax.model import (
  LoraConfig, ModelConfig, Transformer, base_matmul, init_cache, random_base, split_params,
)
from qerl_jax.model.config import pick_train_attention
from qerl_jax.model.testing import fresh_seed
from qerl_jax.model.transformer import forward


def tiny_config(**kw):
  # Qwen3-style q/k norms plus q/k/v biases (a superset no real family has) so one small config
  # exercises every optional path; each distinct config costs compiles, so the tests share it.
  base = dict(arch="qwen3", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=16, rope_theta=10000.0, dtype="float32", qkv_bias=True, qk_norm=True)
  base.update(kw)
  return ModelConfig(**base)


def random_model(config, seed, *, lora=True, train_norms=False, quant="bf16", lora_dtype=jnp.float32):
  base = random_base(config, jax.random.key(seed), quant)
  lora_cfg = LoraConfig(rank=4, alpha=8, dtype=lora_dtype) if lora else None
  model = Transformer(config, base, lora=lora_cfg, train_norms=train_norms, rngs=nnx.Rngs(seed + 1))
  if lora:  # nonzero B so the adapters take part
    rng = np.random.default_rng(seed + 1)
    for name in lora_cfg.targets:
      proj = getattr(model.layers, name)
      proj.lora_b.set_value(jnp.asarray(0.1 * rng.standard_normal(proj.lora_b.get_value().shape), lora_dtype))
  return model


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, state, tokens, positions, cache, index, valid):
  model = nnx.merge(graphdef, state)
  return model(tokens, positions, cache=cache, cache_index=index, valid_BxS=valid)


@pytest.fixture(scope="module")
def model_and_seed():
  seed = fresh_seed()
  return random_model(tiny_config(), seed), seed


def test_prefill_and_decode_with_cache_equal_full_forward_on_left_padded_rows(model_and_seed):
  model, seed = model_and_seed
  config = model.config
  rng = np.random.default_rng(seed)
  lengths = [9, 6]  # row 1 is left-padded by 3 in the prompt
  prompt_len, steps = 9, 4
  seqs = [rng.integers(0, config.vocab_size, n + steps) for n in lengths]
  # Reference: each row unpadded from position 0, full causal forward (right padding is invisible to
  # the real tokens before it).
  right_padded = np.zeros((2, max(lengths) + steps), np.int32)
  for b, s in enumerate(seqs):
    right_padded[b, :len(s)] = s
  refs = np.asarray(model(jnp.asarray(right_padded)))

  prompt = np.zeros((2, prompt_len), np.int32)
  valid = np.zeros((2, prompt_len + steps), bool)
  for b, (s, n) in enumerate(zip(seqs, lengths)):
    prompt[b, prompt_len - n:] = s[:n]
    valid[b, prompt_len - n:] = True
  positions = np.maximum(np.cumsum(valid[:, :prompt_len], axis=1) - 1, 0)
  graphdef, state = nnx.split(model)
  cache = init_cache(config, 2, prompt_len + steps, jnp.float32)
  logits, cache = _step(graphdef, state, jnp.asarray(prompt), jnp.asarray(positions), cache, 0, jnp.asarray(valid))
  for b, n in enumerate(lengths):
    np.testing.assert_allclose(np.asarray(logits[b, prompt_len - n:]), refs[b][:n], rtol=2e-4, atol=2e-4,
                               err_msg=f"prefill row {b} {seed=}")
  for i in range(steps):
    tokens = np.array([[s[n + i]] for s, n in zip(seqs, lengths)], np.int32)
    pos = np.array([[n + i] for n in lengths], np.int32)
    logits, cache = _step(graphdef, state, jnp.asarray(tokens), jnp.asarray(pos), cache, prompt_len + i,
                          jnp.asarray(valid))
    for b, n in enumerate(lengths):
      np.testing.assert_allclose(np.asarray(logits[b, 0]), refs[b][n + i], rtol=2e-4, atol=2e-4,
                                 err_msg=f"decode step {i} row {b} {seed=}")
  assert cache["k"].shape == (2, 2, prompt_len + steps, 2, 16)


def test_valid_mask_without_cache_matches_unpadded_rows(model_and_seed):
  model, seed = model_and_seed
  config = model.config
  rng = np.random.default_rng(seed)
  seq = rng.integers(0, config.vocab_size, 10)
  # Row 0 is the sequence itself; row 1 the first 7 tokens after 3 pads (garbage ids, masked out).
  padded = np.stack([seq, np.concatenate([rng.integers(0, config.vocab_size, 3), seq[:7]])])
  valid = np.ones((2, 10), bool)
  valid[1, :3] = False
  positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0)
  out = np.asarray(model(jnp.asarray(padded), jnp.asarray(positions), valid_BxS=jnp.asarray(valid)))
  ref = np.asarray(model(jnp.asarray(seq)[None]))
  np.testing.assert_allclose(out[0], ref[0], rtol=2e-4, atol=2e-4, err_msg=f"{seed=}")
  np.testing.assert_allclose(out[1, 3:], ref[0, :7], rtol=2e-4, atol=2e-4, err_msg=f"{seed=}")
  assert np.all(np.isfinite(out))  # padded queries attend to nothing: finite, not NaN


def test_hidden_states_and_lm_head_give_the_logits():
  seed = fresh_seed()
  model = random_model(tiny_config(tie_word_embeddings=True), seed, lora=False)
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 128, (2, 6)))
  h = model(tokens, return_hidden=True)
  assert h.shape == (2, 6, 64)
  np.testing.assert_allclose(np.asarray(model.lm_head_logits(h)), np.asarray(model(tokens)), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(model.lm_head_weight()), np.asarray(model.embed_tokens.get_value()))


def _with_scaled_norms(model, noise):
  """The same model with the noise folded into its norm scales (the AQN definition)."""
  other = nnx.clone(model)
  for key, value in noise.items():
    var = getattr(other.layers, key)
    var.set_value(var.get_value() + value)
  return other


def test_norm_noise_is_added_to_the_norm_scales_in_float32():
  seed = fresh_seed()
  config = tiny_config(dtype="bfloat16")
  model = random_model(config, seed)
  key = jax.random.key(seed)
  k1, k2, k3 = jax.random.split(key, 3)
  noise = {"input_layernorm": 0.05 * jax.random.normal(k1, (2, 64)),
           "post_attention_layernorm": 0.05 * jax.random.normal(k2, (2, 64)),
           "q_norm": 0.05 * jax.random.normal(k3, (2, 16))}
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 128, (2, 7)))
  noisy = np.asarray(model(tokens, norm_noise=noise))
  folded = np.asarray(_with_scaled_norms(model, noise)(tokens))
  np.testing.assert_array_equal(noisy, folded, err_msg=f"{seed=}")
  clean = np.asarray(model(tokens))
  assert np.abs(noisy - clean).max() > 1e-3  # the noise reached the output
  # What the rollout does once before its decode loop (`with_norm_noise`): float32 scale + noise in place of each
  # noised scale, stacked or per layer, and no noise passed: the same float32 values, so the same logits as the
  # same layers given the noise (the unrolled loop's XLA program is another, so it is compared with itself).
  from qerl_jax.model.param_views import unstack_layers, with_norm_noise
  params = model.params()
  for layers in (params, unstack_layers(params)):
    want = np.asarray(forward(layers, config, model.lora_scale, tokens, norm_noise=noise))
    got = np.asarray(forward(with_norm_noise(layers, config, noise), config, model.lora_scale, tokens))
    np.testing.assert_array_equal(got, want, err_msg=f"{seed=}")
    assert np.abs(want - clean).max() > 1e-3
  assert with_norm_noise(params, config, None) is params
  # A tiny sigma survives: in bf16 the add 1 + 1e-4 would round away entirely.
  tiny = {key: jnp.full_like(value, 1e-4 if key == "input_layernorm" else 0.0) for key, value in noise.items()}
  assert np.abs(np.asarray(model(tokens, norm_noise=tiny)) - clean).max() > 0
  with pytest.raises(ValueError, match="norm_noise key 'bogus'"):
    model(tokens, norm_noise={"bogus": noise["q_norm"]})
  with pytest.raises(ValueError, match="expected \\(2, 64\\)"):
    model(tokens, norm_noise={"input_layernorm": noise["q_norm"]})


def test_split_params_separates_adapters_and_norms_and_remat_gives_the_same_gradients():
  seed = fresh_seed()
  config = tiny_config()
  model = random_model(config, seed, train_norms=True, quant="nvfp4")
  graphdef, trainable, frozen = split_params(model)
  paths = {"/".join(str(getattr(k, "key", k)) for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(
    nnx.to_pure_dict(trainable))}
  expected = {f"layers/{n}/lora_{ab}" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj") for ab in "ab"}
  expected |= {"layers/input_layernorm", "layers/post_attention_layernorm"}
  assert paths == expected
  assert any(x.dtype == jnp.uint8 for x in jax.tree.leaves(frozen))  # the packed NVFP4 base is frozen
  remat = Transformer(config.replace(remat=True), model.params(), lora=model.lora, train_norms=True)
  remat_graphdef = split_params(remat)[0]
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 128, (2, 5)))

  def loss(gd, t, f):
    return jnp.mean(jax.nn.log_softmax(nnx.merge(gd, t, f)(tokens))[..., :3])

  grad = jax.jit(jax.value_and_grad(loss, argnums=1), static_argnums=0)
  l0, g0 = grad(graphdef, trainable, frozen)
  l1, g1 = grad(remat_graphdef, trainable, frozen)
  np.testing.assert_allclose(float(l0), float(l1), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    assert np.abs(np.asarray(a)).sum() > 0  # every trainable leaf gets a gradient
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_bf16_base_matmul_differentiates_in_bf16_with_exact_products():
  # The backward multiplies the bf16 cotangent by the bf16 weight (float32 sums, one rounding), as the forward
  # does: no float32 copy of W and no float32 GEMM (JAX's own transpose of a float32-accumulating einsum makes
  # both). Values against float64 NumPy: within one bf16 rounding of the exact result.
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  bf16 = jnp.bfloat16
  x, w, dy = (jnp.asarray(rng.standard_normal(s), bf16) for s in ((2, 3, 64), (64, 48), (2, 3, 48)))
  y, vjp = jax.vjp(base_matmul, x, w)
  dx, dw = vjp(dy)
  assert y.dtype == dx.dtype == dw.dtype == bf16
  f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
  for got, want in ((y, f64(x) @ f64(w)), (dx, f64(dy) @ f64(w).T),
                    (dw, np.einsum("btk,btn->kn", f64(x), f64(dy)))):
    np.testing.assert_allclose(f64(got), want, rtol=2.0 ** -8, atol=1e-6 * np.abs(want).max(), err_msg=f"{seed=}")
  # Every dot of the backward (w frozen, as the model's base is) reads bf16 operands, and the forward's dot gives
  # bf16 itself (a float32 result then cast is an extra pass over every output on the GPU).
  hlo = jax.jit(lambda x, w, dy: jax.vjp(lambda x: base_matmul(x, w), x)[1](dy)).lower(x, w, dy).as_text()
  operands = re.findall(r"stablehlo.dot_general .*: \((tensor<[^>]+>), (tensor<[^>]+>)\)", hlo)
  assert operands and all(a.endswith("xbf16>") and b.endswith("xbf16>") for a, b in operands), operands
  fwd = jax.jit(base_matmul).lower(x, w).as_text()
  results = re.findall(r"stablehlo.dot_general .*-> (tensor<[^>]+>)", fwd)
  assert results and all(r.endswith("xbf16>") for r in results), results


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4", "nf4"])
def test_base_matmul_equals_dot_with_the_dequantized_weight(scheme):
  from qerl_jax import quant
  seed = fresh_seed()
  k1, k2 = jax.random.split(jax.random.key(seed))
  w = (0.05 * jax.random.normal(k1, (64, 48))).astype(jnp.bfloat16)
  x = jax.random.normal(k2, (2, 3, 64), jnp.float32)
  q = quant.quantize(w, scheme)
  w_hat = np.asarray(quant.dequantize(q, jnp.float32), np.float64)
  ref = np.asarray(x, np.float64) @ w_hat
  np.testing.assert_allclose(np.asarray(base_matmul(x, q)), ref, rtol=1e-4, atol=1e-5, err_msg=f"{seed=}")
  assert np.abs(w_hat - np.asarray(w, np.float64)).max() > 0  # it really is quantized


def test_linears_share_one_x_at_a_matmul_and_give_each_projections_numpy_output():
  from qerl_jax.model.linear import linears
  seed = fresh_seed()
  ks = jax.random.split(jax.random.key(seed), 8)
  x = jax.random.normal(ks[0], (2, 3, 32), jnp.float32)
  ps = []
  for i, (n, rank) in enumerate([(24, 4), (8, 4), (8, 2)]):  # q/k/v-like widths; ranks need not match
    p = {"w": jax.random.normal(ks[1 + i], (32, n)) * 0.1,
         "lora_a": jax.random.normal(ks[4 + i], (32, rank)), "lora_b": jax.random.normal(ks[7], (rank, n))[:rank]}
    if i == 0:
      p["b"] = jnp.arange(n, dtype=jnp.float32)
    ps.append(p)
  ys = linears(x, ps, 0.5)
  x64 = np.asarray(x, np.float64)
  for p, y in zip(ps, ys):
    f = lambda k: np.asarray(p[k], np.float64)
    ref = x64 @ f("w") + (f("b") if "b" in p else 0) + 0.5 * (x64 @ f("lora_a")) @ f("lora_b")
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-4, err_msg=f"{seed=}")
  # One x @ A for the three adapters ([.., 32] x [32, 10]), then one x @ W and one xa @ B per projection.
  dots = [e for e in jax.make_jaxpr(lambda x: linears(x, ps, 0.5))(x).eqns if e.primitive.name == "dot_general"]
  shapes = sorted(tuple(e.invars[1].aval.shape) for e in dots)
  assert shapes == sorted([(32, 10), (32, 24), (32, 8), (32, 8), (4, 24), (4, 8), (2, 8)]), shapes


def test_query_blocks_change_neither_logits_nor_gradients():
  # 11 positions in blocks of at most 4 (near-equal: 4, 4, 3 plus one padded query row), left-padded rows.
  seed = fresh_seed()
  config = tiny_config(remat=True)
  model = random_model(config, seed, train_norms=True)
  blocked = Transformer(config.replace(attn_query_chunk=4), model.params(), lora=model.lora, train_norms=True)
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 11)))
  valid = np.ones((2, 11), bool)
  valid[1, :5] = False
  positions = jnp.asarray(np.maximum(np.cumsum(valid, axis=1) - 1, 0))

  def loss(gd, t, f):
    logp = jax.nn.log_softmax(nnx.merge(gd, t, f)(tokens, positions, valid_BxS=jnp.asarray(valid)))
    return jnp.mean(logp[0, :, :5]) + jnp.mean(logp[1, 5:, :5]), logp

  grad = jax.jit(jax.value_and_grad(loss, argnums=1, has_aux=True), static_argnums=0)
  graphdef, trainable, frozen = split_params(model)
  (l0, logp0), g0 = grad(graphdef, trainable, frozen)
  (l1, logp1), g1 = grad(split_params(blocked)[0], trainable, frozen)  # same weights, blocked graph
  np.testing.assert_allclose(np.asarray(logp1[0]), np.asarray(logp0[0]), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(logp1[1, 5:]), np.asarray(logp0[1, 5:]), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    assert np.abs(np.asarray(a)).sum() > 0
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_fused_attend_gives_attends_outputs_and_gradients_on_left_padded_rows():
  # The wrapper ModelConfig.train_attention="cudnn" uses, run through jax.nn.dot_product_attention's XLA lowering
  # (cuDNN needs a GPU): the mask as a [B, 1, T, S] bias, GQA's head grouping, the [B, T, H * Dh] layout.
  from qerl_jax.model import attention as attn  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(fresh_seed())
  b, s, h, kvh, dh = 3, 13, 6, 2, 16
  q, k, v = (jnp.asarray(rng.standard_normal((b, s, n, dh)), jnp.float32) for n in (h, kvh, kvh))
  valid = np.ones((b, s), bool)
  valid[1, :5] = False
  valid[2, :1] = False
  mask = attn.attention_mask(jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)), s, jnp.asarray(valid))
  cot = jnp.asarray(rng.standard_normal((b, s, h * dh)), jnp.float32)
  rows = jnp.asarray(valid)[:, :, None]

  def loss(f, q, k, v):
    return jnp.sum(jnp.where(rows, f(q, k, v) * cot, 0.0))

  ref = lambda q, k, v: attn.attend(q, k, v, mask)  # noqa: E731
  g_ref = jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2))(q, k, v)
  for causal in (False, True):  # the causal type on top of a causal mask changes nothing
    fused = lambda q, k, v, c=causal: attn.fused_attend(q, k, v, mask, "xla", c)  # noqa: E731
    np.testing.assert_allclose(np.asarray(fused(q, k, v))[valid], np.asarray(ref(q, k, v))[valid], rtol=1e-5,
                               atol=1e-5)
    g_fused = jax.grad(functools.partial(loss, fused), argnums=(0, 1, 2))(q, k, v)
    for a, c in zip(g_ref, g_fused):
      assert np.abs(np.asarray(a)).max() > 0.1
      np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-4, atol=1e-5)
  # Each query head reads its own group's k and v: with the two kv heads swapped, some valid row differs from
  # attend's in every feature.
  swapped = attn.fused_attend(q, k[:, :, ::-1], v[:, :, ::-1], mask, "xla")
  assert np.abs(np.asarray(swapped) - np.asarray(ref(q, k, v)))[valid].min(axis=-1).max() > 1e-3


def test_auto_train_attention_picks_cudnn_only_where_its_fused_kernel_takes_the_shapes():
  hopper = dict(backend="gpu", compute_capability="9.0", dtype=jnp.bfloat16, head_dim=128)
  assert pick_train_attention("auto", **hopper) == "cudnn"
  assert pick_train_attention("auto", **{**hopper, "dtype": jnp.float16, "head_dim": 64}) == "cudnn"
  assert pick_train_attention("auto", **{**hopper, "compute_capability": "8.0"}) == "cudnn"
  assert pick_train_attention("auto", **{**hopper, "compute_capability": "10.0"}) == "cudnn"
  assert pick_train_attention("auto", **{**hopper, "head_dim": 256}) == "cudnn"  # Hopper's limit; Ampere's is 128
  for off in (dict(backend="cpu", compute_capability=None), dict(backend="gpu", compute_capability=None),  # ROCm
              dict(compute_capability="gfx90a"), dict(compute_capability="7.5"), dict(dtype=jnp.float32),
              dict(head_dim=100), dict(head_dim=264), dict(compute_capability="8.6", head_dim=256)):
    assert pick_train_attention("auto", **{**hopper, **off}) == "xla", off
  assert pick_train_attention("xla", **hopper) == "xla"
  assert pick_train_attention("cudnn", **{**hopper, "backend": "cpu"}) == "cudnn"  # named: attend refuses it
  # The default is "auto", which a float32 model takes (it resolves to xla); on the CPU it runs attend.
  config = tiny_config()
  assert config.train_attention == "auto" and config.dtype == jnp.float32
  assert config.train_attention_impl == "xla"
  capability = getattr(jax.devices()[0], "compute_capability", None)
  on_cuda = jax.default_backend() == "gpu" and capability is not None and float(capability) >= 8.0
  assert tiny_config(dtype="bfloat16").train_attention_impl == ("cudnn" if on_cuda else "xla")


def test_train_attention_is_checked_and_cudnn_needs_a_gpu():
  with pytest.raises(ValueError, match=r"train_attention='flash' must be one of \('auto', 'xla', 'cudnn'\)"):
    tiny_config(train_attention="flash")
  with pytest.raises(ValueError, match="train_attention='cudnn' needs dtype bfloat16 or float16"):
    tiny_config(train_attention="cudnn")  # the tiny config's float32
  config = tiny_config(train_attention="cudnn", dtype="bfloat16")
  model = random_model(config, 0)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 9)))  # odd: fused_attend pads
  positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
  if jax.default_backend() == "gpu":  # cuDNN runs: the XLA attention's logits, to bf16 rounding
    xla = random_model(config.replace(train_attention="xla"), 0)  # the same seed: the same base and adapters
    np.testing.assert_allclose(np.asarray(model(tokens, positions), np.float32),
                               np.asarray(xla(tokens, positions), np.float32), rtol=0.05, atol=0.05)
    return
  with pytest.raises(ValueError, match="needs a GPU with cuDNN; the backend is 'cpu': use 'auto' or 'xla'"):
    model(tokens, positions)


def test_prefill_at_a_static_cache_index_attends_only_to_visible_slots(model_and_seed):
  # cache_index a Python int: the prefill's attention covers slots [0, P) instead of the whole cache; the
  # result must equal the traced-index forward (which masks the later slots) on every real token.
  model, seed = model_and_seed
  config = model.config
  rng = np.random.default_rng(seed + 7)
  prompt_len, budget = 6, 10
  prompt = rng.integers(0, config.vocab_size, (2, prompt_len)).astype(np.int32)
  valid = np.zeros((2, prompt_len + budget), bool)
  valid[0, :prompt_len] = True
  valid[1, 2:prompt_len] = True  # row 1 left-padded by 2
  positions = np.maximum(np.cumsum(valid[:, :prompt_len], axis=1) - 1, 0)
  args = (jnp.asarray(prompt), jnp.asarray(positions))
  cache = init_cache(config, 2, prompt_len + budget, jnp.float32)
  static_logits, static_cache = model(*args, cache=cache, cache_index=0, valid_BxS=jnp.asarray(valid))
  graphdef, state = nnx.split(model)
  traced_logits, traced_cache = _step(graphdef, state, *args, cache, 0, jnp.asarray(valid))
  np.testing.assert_allclose(np.asarray(static_logits[0]), np.asarray(traced_logits[0]), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(static_logits[1, 2:]), np.asarray(traced_logits[1, 2:]), rtol=1e-5,
                             atol=1e-5)
  for key in ("k", "v"):
    np.testing.assert_allclose(np.asarray(static_cache[key][:, 0]), np.asarray(traced_cache[key][:, 0]),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(static_cache[key][:, :, prompt_len:]), 0.0)


def _nvfp4_bf16_case(lora_dtype=jnp.float32, qk_norm=True):
  """(seed, config, model, tokens, params): an NVFP4 model with bf16 activations and nonzero adapters."""
  seed = fresh_seed()
  config = tiny_config(dtype="bfloat16", qk_norm=qk_norm)
  model = random_model(config, seed, quant="nvfp4", lora_dtype=lora_dtype)
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 128, (2, 6)))
  return seed, config, model, tokens, model.params()


def test_nvfp4_layers_reach_the_kernels_whole_and_give_the_xla_logits(monkeypatch):
  # The layer scan hands each NVFP4 projection to the kernel as the whole stack plus the layer index
  # (`LayerOf`), so no layer of packed bytes is sliced (copied); the logits equal the XLA path's, which
  # dequantizes a sliced layer. The kernels run in Pallas interpret mode (bf16 activations).
  import qerl_kernels as kernels
  seed, config, model, tokens, params = _nvfp4_bf16_case()
  # Fresh functions (not the model's cached jit), so each traces the matmul path in force at the time.
  xla_logits = np.asarray(jax.jit(lambda p: forward(p, config, model.lora_scale, tokens))(params))
  monkeypatch.setattr(kernels, "nvfp4_matmul", functools.partial(kernels.nvfp4_matmul, interpret=True))
  run = lambda p: forward(p, config, model.lora_scale, tokens)
  kernel_logits = np.asarray(jax.jit(run)(params))
  scale = np.abs(xla_logits).max()
  np.testing.assert_allclose(kernel_logits, xla_logits, atol=0.03 * scale, err_msg=f"{seed=}")
  assert np.abs(kernel_logits - xla_logits).max() < 0.1 * np.abs(xla_logits - xla_logits.mean()).max()
  jaxpr = str(jax.make_jaxpr(run)(params))
  sliced = re.findall(r":u8\[[\d,]*\] = (?:dynamic_slice|slice|gather)", jaxpr)
  assert not sliced, f"packed NVFP4 bytes were sliced out of the stack: {sliced}"
  # The kernels' packed operands are both layers' rows: gate/up [2 x 96, 64 / 2], down [2 x 64, 96 / 2].
  assert "u8[192,32]" in jaxpr and "u8[128,48]" in jaxpr


def test_fused_lora_applies_at_decode_rows_only(monkeypatch):
  # ModelConfig.fused_lora: the epilogue takes bias and adapter at calls of at most fused_lora_max_rows rows
  # (a decode step), not in a prefill or training forward, where it made the 7B GRPO update 2 s slower on an
  # H200. Traced with the H200 dispatch forced on this CPU (nothing runs): bf16 adapters, so only rows decide.
  import importlib
  from tests.test_rollout_layers import _eqns  # (that module imports this one)
  mm = importlib.import_module("qerl_kernels.nvfp4_matmul")  # the module (the package exports its function by name)
  monkeypatch.setattr(mm, "_gpu_supported", lambda: True)
  monkeypatch.setattr(mm, "_device_kind", lambda: "NVIDIA H200")
  _, config, model, _, params = _nvfp4_bf16_case(lora_dtype=jnp.bfloat16)
  assert config.fused_lora and config.fused_lora_max_rows == 64

  def epilogue_calls(cfg, batch, t):
    tokens = jnp.zeros((batch, t), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p: forward(p, cfg, model.lora_scale, tokens))(params)
    calls = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]
    assert calls, "no NVFP4 kernel traced"
    return sum(len(e.invars) > 5 for e in calls)  # x, layer, 3 weight arrays; then xa, B (and bias: q/k/v)

  # 7 projections in the layer scan's body; 64 rows, as 2 x 32 or 4 x 16, fuse; 65 and 2 x 33 do not.
  assert epilogue_calls(config, 2, 32) == 7 and epilogue_calls(config, 4, 16) == 7
  assert epilogue_calls(config, 1, 65) == 0 and epilogue_calls(config, 2, 33) == 0
  assert epilogue_calls(config.replace(fused_lora_max_rows=66), 2, 33) == 7
  assert epilogue_calls(config.replace(fused_lora=False), 2, 32) == 0


@pytest.mark.slow  # ~11 s; CI is near its 10-minute limit
def test_fused_lora_epilogue_gives_the_same_logits_and_adapter_gradients(monkeypatch):
  # config.fused_lora: NVFP4 projections add the bias and (x @ A) @ B inside the matmul (kernels' epilogue);
  # logits equal the unfused model's on the XLA path and through the kernels (interpret mode), and so do the
  # adapters' gradients on the XLA path (the kernels' VJP: tests/test_kernels_epilogue.py). Biases (q/k/v)
  # and nonzero bf16 adapters (float32 ones stay out of the epilogue) on all seven projections take part.
  import qerl_kernels as kernels
  seed, config, model, tokens, params = _nvfp4_bf16_case(lora_dtype=jnp.bfloat16)
  config = config.replace(fused_lora=False)

  names = ("q_proj", "gate_proj", "down_proj")

  def loss(bs, cfg):
    layers = {**params["layers"], **{n: {**params["layers"][n], "lora_b": bs[n]} for n in names}}
    return jnp.mean(forward({**params, "layers": layers}, cfg, model.lora_scale, tokens)[..., :8] ** 2)

  def lora_grads(cfg):
    g = jax.jit(jax.grad(lambda bs: loss(bs, cfg)))({n: params["layers"][n]["lora_b"] for n in names})
    return {n: np.asarray(g[n], np.float32) for n in names}

  plain = np.asarray(jax.jit(lambda p: forward(p, config, model.lora_scale, tokens))(params))
  plain_grads = lora_grads(config)
  fused_cfg = config.replace(fused_lora=True)
  runs = {"xla": None, "kernels": functools.partial(kernels.nvfp4_matmul, interpret=True)}
  for name, patched in runs.items():
    if patched is not None:
      monkeypatch.setattr(kernels, "nvfp4_matmul", patched)
    fused = np.asarray(jax.jit(lambda p: forward(p, fused_cfg, model.lora_scale, tokens))(params))
    scale = np.abs(plain).max()
    np.testing.assert_allclose(fused, plain, atol=0.03 * scale, err_msg=f"{name} {seed=}")
    if patched is not None:
      continue
    for proj, g in lora_grads(fused_cfg).items():
      np.testing.assert_allclose(g, plain_grads[proj], atol=0.05 * np.abs(plain_grads[proj]).max(),
                                 err_msg=f"{name} {proj} {seed=}")
      assert np.abs(plain_grads[proj]).max() > 0


def test_gemv_lora_xa_gives_the_same_decode_logits_and_adapter_gradients(monkeypatch):
  # config.gemv_lora_xa: at one decode row each NVFP4 projection's gemv also computes its adapter's x @ A
  # (qerl_kernels.nvfp4_matmul_xa, interpret mode here). Logits equal the usual path's (XLA on this CPU), the
  # gradients of A and B the float32 path's as closely as bf16 allows, and the launches are the shared ones
  # (no concatenated A's). The gradients are held to float32 by norm, not to the usual bf16 path entry by entry:
  # where a gradient's entries cancel, the two bf16 paths' entries differed several-fold (seed 17316175). Where
  # a whole layer's gradient cancels, both bf16 paths drift together: seed 618920832 put v_proj's A of layer 1
  # 4.4% (usual) and 9.0% (shared) from float32. So each layer may be 6% off, or 3x the usual path's own error
  # if that is larger. Over 31 seeds the worst layer used 0.71 of that bound; a wrong scale, layer or adapter
  # is ~100% off while the usual path stays within a few %.
  import qerl_kernels as kernels
  seed, config, model, _, params = _nvfp4_bf16_case()
  token = jnp.asarray([[np.random.default_rng(seed).integers(0, 128)]])
  monkeypatch.setattr(kernels, "nvfp4_matmul_xa", functools.partial(kernels.nvfp4_matmul_xa, interpret=True))
  monkeypatch.setattr(kernels, "xa_shares_launch", functools.partial(kernels.xa_shares_launch, interpret=True))
  names = ("v_proj", "o_proj", "gate_proj", "down_proj")  # (one token attends to itself: q and k get no gradient)

  def loss(adapters, cfg):
    layers = {**params["layers"], **{n: {**params["layers"][n], **adapters[n]} for n in names}}
    return jnp.mean(forward({**params, "layers": layers}, cfg, model.lora_scale, token)[..., :8] ** 2)

  adapters = {n: {k: params["layers"][n][k] for k in ("lora_a", "lora_b")} for n in names}
  exact_grads = jax.jit(jax.grad(lambda a: loss(a, config.replace(dtype="float32"))))(adapters)
  results = {}
  for on in (False, True):
    cfg = config.replace(gemv_lora_xa=on)
    logits = np.asarray(jax.jit(lambda p: forward(p, cfg, model.lora_scale, token))(params), np.float32)
    grads = jax.jit(jax.grad(lambda a: loss(a, cfg)))(adapters)
    jaxpr = str(jax.make_jaxpr(lambda p: forward(p, cfg, model.lora_scale, token))(params))
    results[on] = logits, grads, jaxpr
  (plain, plain_grads, plain_jaxpr), (shared, shared_grads, shared_jaxpr) = results[False], results[True]
  np.testing.assert_allclose(shared, plain, atol=0.02 * np.abs(plain).max(), err_msg=f"{seed=}")

  def error(got, want):  # relative, by norm
    return np.linalg.norm(got - want) / np.linalg.norm(want)

  for n in names:
    for k in ("lora_a", "lora_b"):
      want, got, usual = (np.asarray(g[n][k], np.float32) for g in (exact_grads, shared_grads, plain_grads))
      for layer in range(len(want)):
        assert np.abs(want[layer]).max() > 0, (n, k, layer)
        bound = max(0.06, 3 * error(usual[layer], want[layer]))
        assert error(got[layer], want[layer]) < bound, (
            f"{n} {k} layer {layer}: {error(got[layer], want[layer]):.4f} from float32 by norm "
            f"(the usual bf16 path: {error(usual[layer], want[layer]):.4f}), {seed=}")
  # Each of the seven projections of the (scanned) layer is one shared launch; the usual path has none.
  assert len(re.findall(r"name=_shared_launch\b", shared_jaxpr)) == 7 and "nvfp4_gemv_xa" not in plain_jaxpr


def _prefill_then_decode(params, cfg, lora_scale, tokens, valid, noise, per_layer: bool, jit_calls: bool = False
                         ) -> list:
  """Logits of a prefill of the first 4 tokens (with a cache of 8 slots) and one decode step per later token, each
  row at its own RoPE position (``valid`` [B, 8] marks its padding).

  Unjitted, the cache index is a Python int, so each call sees only the slots written so far (a jaxpr of the whole
  run, for counting kernel calls). With ``jit_calls`` each call is jitted with a traced index, as in the rollout's
  loop: the decode steps share one program over the whole masked cache, and the compile (most of these tests' time
  on a CPU) is one prefill and one step, not one program of every call unrolled."""
  positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
  prompt, steps = tokens[:, :4], tokens[:, 4:]

  def call(params, tokens_BxT, positions_BxT, cache, index):
    return forward(params, cfg, lora_scale, tokens_BxT, positions_BxT, cache=cache, cache_index=index,
                   valid_BxS=valid, norm_noise=noise)

  call = jax.jit(call) if jit_calls else call
  logits, cache = call(params, prompt, positions[:, :4], init_cache(cfg, tokens.shape[0], 8, per_layer=per_layer), 0)
  out = [logits]
  for i in range(steps.shape[1]):
    logits, cache = call(params, steps[:, i:i + 1], positions[:, 4 + i:5 + i], cache, 4 + i)
    out.append(logits)
  return out


# The stacked scan (not the rollout's default loop) is a slow case: ~21 s of CI's budget on two cores.
@pytest.mark.parametrize("loop", [pytest.param("scan", marks=pytest.mark.slow), "per_layer", "per_layer_qkv"])
def test_decode_partials_to_pallas_give_the_xla_decode_logits(monkeypatch, loop):
  # config.decode_partials="pallas": at a cached decode step o_proj's and down_proj's gemvs hand their partial
  # sums to one kernel each that adds them, the adapter and the residual, then applies the next norm
  # (post_attention_layernorm; the next block's input_layernorm, or the final norm after the last block)
  # (qerl_kernels.decode_residual_norm), the gate|up launch its partials to qerl_kernels.decode_swiglu, and (with the
  # Pallas decode attention and no q/k norms) the q|k|v launch its partials to qerl_kernels.decode_qkv, which writes
  # the attention kernel's input with RoPE; all in interpret mode here, as the gemvs are. The per-layer loops
  # merge q|k|v and gate|up into one launch each, as rollouts do; "per_layer" keeps the q/k norms (Qwen3), so
  # its q|k|v stays with XLA. Logits of a prefill and two decode steps of two rows, with AQN noise on both
  # block norms (large, so that leaving it out, or taking another layer's, shows), equal the XLA path's; the
  # prefill (8 rows a call) keeps XLA's path. With config.decode_norm_fold the per-layer loops leave those norms
  # pending for the gemv that reads them (gate|up, the next q|k|v launch), with logits bit-equal to their launch.
  import qerl_kernels as kernels
  from qerl_jax.model.param_views import unstack_layers, with_merged_launches
  per_layer = loop != "scan"
  seed, config, model, tokens, params = _nvfp4_bf16_case(lora_dtype=jnp.bfloat16, qk_norm=loop != "per_layer_qkv")
  monkeypatch.setattr(kernels, "nvfp4_matmul_xa", functools.partial(kernels.nvfp4_matmul_xa, interpret=True))
  monkeypatch.setattr(kernels, "xa_shares_launch", functools.partial(kernels.xa_shares_launch, interpret=True))
  monkeypatch.setattr(kernels, "nvfp4_matmul_xa_partials",
                      functools.partial(kernels.nvfp4_matmul_xa_partials, interpret=True))
  monkeypatch.setattr(kernels, "partials_launch_applies",
                      functools.partial(kernels.partials_launch_applies, interpret=True))
  rng = np.random.default_rng(seed)
  noise = {name: jnp.asarray(0.5 * rng.standard_normal((config.num_layers, config.hidden_size)), jnp.float32)
           for name in ("input_layernorm", "post_attention_layernorm")}
  params = with_merged_launches(unstack_layers(params), ("qkv", "gate_up")) if per_layer else params
  attention = "pallas" if per_layer else "xla"
  steps = tokens[:, 4:]
  # Row 1's first slot is padding: the rows' RoPE positions differ, so a row given the other's shows.
  valid = jnp.asarray(np.arange(8)[None, :] >= np.asarray([[0], [1]]))

  def run(cfg, jit_calls=False):
    return _prefill_then_decode(params, cfg, model.lora_scale, tokens, valid, noise, per_layer, jit_calls)

  results = {}
  for mode in ("xla", "pallas", "fold"):
    cfg = config.replace(gemv_lora_xa=True, decode_partials="xla" if mode == "xla" else "pallas",
                         decode_attention=attention, decode_norm_fold=mode == "fold")
    results[mode] = [np.asarray(y, np.float32) for y in run(cfg, jit_calls=True)]
    results[mode + "-jaxpr"] = str(jax.make_jaxpr(lambda p, cfg=cfg: run(cfg))(params))
  # (Within the bf16 rounding flips that two orders of the same float32 sums make: the gemv_lora_xa test's
  # 0.02 of the largest logit, halved.)
  for want, got in zip(results["xla"], results["pallas"]):
    np.testing.assert_allclose(got, want, atol=0.01 * np.abs(want).max(), err_msg=f"{seed=}")
  for want, got in zip(results["pallas"], results["fold"]):
    np.testing.assert_array_equal(got, want, err_msg=f"{seed=}")
  # Per layer and decode step (the scan traces its body once) two residual-add and two norm kernels and, where
  # gate|up is one launch, one SwiGLU kernel, and one q|k|v kernel where it applies; none in the prefill or on
  # the XLA path. Folded, a norm launches only where no gemv reads it: the final norm, and (q/k norms: XLA's
  # q|k|v) each later block's input norm.
  names = ("residual_add", "pending_norm", "swiglu", "qkv_rows")
  calls = {mode: [len(re.findall(rf"jit\[\s*name={name}\b", results[mode + "-jaxpr"])) for name in names]
           for mode in ("pallas", "fold")}
  per_step, layers = (config.num_layers if per_layer else 1), config.num_layers
  want_calls = [2 * per_step, 2 * per_step, per_step if per_layer else 0, per_step if loop == "per_layer_qkv" else 0]
  folded_norms = {"scan": 2, "per_layer": layers, "per_layer_qkv": 1}[loop]
  assert calls == {"pallas": [steps.shape[1] * c for c in want_calls],
                   "fold": [steps.shape[1] * c for c in [want_calls[0], folded_norms, *want_calls[2:]]]}, calls
  assert not any(f"decode_{name}" in results["xla-jaxpr"] for name in ("residual", "swiglu", "qkv_rows"))


@pytest.mark.slow  # ~31 s on two cores, for a path that is off by default (config.decode_partials_tiles)
def test_decode_partials_tiles_give_the_same_decode_logits_at_tile_rows(monkeypatch):
  # config.decode_partials_tiles: at four rows (the tile kernels' rows, past the gemv's two) the q|k|v, o_proj,
  # gate|up and down_proj tile launches hand their split-K partials, and XLA's x @ A as one partial, to the
  # kernels that end each step (decode_qkv, decode_residual_norm, decode_swiglu), as the gemv's do at 1-2 rows.
  # Logits of a prefill and two decode steps, rows at different positions and with AQN noise on the norms, equal
  # those of the same config without it (the fused epilogue and XLA's steps), all in interpret mode; without it
  # no decode kernel runs at these rows. The 16-row prefill (4 rows x 4 tokens, with a cache) takes the norm and
  # SwiGLU kernels too; q|k|v's needs a one-token step.
  import qerl_kernels as kernels
  from qerl_jax.model.param_views import unstack_layers, with_merged_launches
  seed, config, model, tokens, params = _nvfp4_bf16_case(lora_dtype=jnp.bfloat16, qk_norm=False)
  for name in ("nvfp4_matmul", "nvfp4_matmul_xa", "xa_shares_launch", "nvfp4_matmul_xa_partials",
               "partials_launch_applies"):
    monkeypatch.setattr(kernels, name, functools.partial(getattr(kernels, name), interpret=True))
  rng = np.random.default_rng(seed)
  noise = {name: jnp.asarray(0.5 * rng.standard_normal((config.num_layers, config.hidden_size)), jnp.float32)
           for name in ("input_layernorm", "post_attention_layernorm")}
  params = with_merged_launches(unstack_layers(params), ("qkv", "gate_up"))
  tokens = jnp.concatenate([tokens, tokens[::-1]])  # 4 rows
  steps = tokens[:, 4:]
  valid = jnp.asarray(np.arange(8)[None, :] >= np.asarray([[0], [1], [2], [0]]))

  def run(cfg, jit_calls=False):
    return _prefill_then_decode(params, cfg, model.lora_scale, tokens, valid, noise, True, jit_calls)

  results = {}
  for tiles in (False, True):
    cfg = config.replace(gemv_lora_xa=True, decode_partials="pallas", decode_attention="pallas",
                         decode_partials_tiles=tiles)
    results[tiles] = [np.asarray(y, np.float32) for y in run(cfg, jit_calls=True)]
    results[f"{tiles}-jaxpr"] = str(jax.make_jaxpr(lambda p, cfg=cfg: run(cfg))(params))
  for want, got in zip(results[False], results[True]):
    np.testing.assert_allclose(got, want, atol=0.01 * np.abs(want).max(), err_msg=f"{seed=}")
  names = ("residual_add", "pending_norm", "swiglu", "qkv_rows")
  calls = {tiles: [len(re.findall(rf"jit\[\s*name={name}\b", results[f"{tiles}-jaxpr"])) for name in names]
           for tiles in (False, True)}
  layers, decode_steps = config.num_layers, steps.shape[1]
  norms = (decode_steps + 1) * 2 * layers
  assert calls == {False: [0, 0, 0, 0], True: [norms, norms, (decode_steps + 1) * layers,
                                               decode_steps * layers]}, calls


def test_decode_qkv_rows_are_the_xla_steps_rows(monkeypatch):
  # One layer's q|k|v at a decode step through qerl_kernels.decode_qkv (`_decode_qkv_rows`) against XLA's steps in
  # `_layer` (the group launch's outputs with each member's bias and adapter, RoPE at each row's own position,
  # k and v in the cache's dtype), for two rows at different positions: within one bf16 ulp, rarely apart.
  import qerl_kernels as kernels
  from qerl_jax.model import attention as attn
  from qerl_jax.model import linear as linear_lib
  from qerl_jax.model.param_views import unstack_layers, with_merged_launches
  from qerl_jax.model.transformer import _decode_qkv_rows
  seed, config, model, _, params = _nvfp4_bf16_case(lora_dtype=jnp.bfloat16, qk_norm=False)
  for name in ("nvfp4_matmul_xa", "xa_shares_launch", "nvfp4_matmul_xa_partials", "partials_launch_applies"):
    monkeypatch.setattr(kernels, name, functools.partial(getattr(kernels, name), interpret=True))
  p = with_merged_launches(unstack_layers(params), ("qkv",))["layers"][1]
  rng = np.random.default_rng(seed)
  h = jnp.asarray(rng.standard_normal((2, 1, config.hidden_size)), jnp.bfloat16)
  cos, sin = attn.rope_cos_sin(config, jnp.asarray([[5], [2]]))
  cfg = config.replace(gemv_lora_xa=True, decode_partials="pallas")
  got = np.asarray(_decode_qkv_rows(cfg, model.lora_scale, h, p, p["merged"]["qkv"], cos, sin, jnp.bfloat16, True))
  q, k, v = linear_lib.linears(h, [p["q_proj"], p["k_proj"], p["v_proj"]], model.lora_scale, False, True, None,
                               p["merged"]["qkv"])
  heads = [y.reshape(2, 1, -1, config.head_dim) for y in (q, k, v)]
  q, k = (attn.apply_rope(y, cos, sin) for y in heads[:2])
  zeros = jnp.zeros((2, got.shape[1] - config.num_heads - 2 * config.num_kv_heads, config.head_dim))
  want = np.asarray(jnp.concatenate([y[:, 0].astype(jnp.float32) for y in (q, k, heads[2])] + [zeros], axis=1))
  ulp = np.maximum(np.abs(want), 1e-30) * 2.0 ** -7
  apart = np.abs(got - want) / ulp
  assert got.shape == want.shape and (apart <= 1.01).all() and (apart > 0).mean() < 0.02, f"{seed=}: {apart.max()}"
  # q_norm / k_norm (Qwen3) are not in the kernel: XLA keeps those layers.
  assert _decode_qkv_rows(config.replace(gemv_lora_xa=True, decode_partials="pallas", qk_norm=True),
                          model.lora_scale, h, p, p["merged"]["qkv"], cos, sin, jnp.bfloat16, True) is None


def test_gemv_lora_xa_without_a_kernel_is_the_usual_program():
  # Where no kernel takes x @ A (here: the XLA path on this CPU), gemv_lora_xa changes nothing: the same
  # program, with the adapters' concatenated x @ A and its one-row barrier form (`linears`, `lora_xa`).
  _, config, model, _, params = _nvfp4_bf16_case()
  token = jnp.asarray([[3]])
  jaxprs = [str(jax.make_jaxpr(lambda p: forward(p, config.replace(gemv_lora_xa=on), model.lora_scale, token))(params))
            for on in (False, True)]
  assert jaxprs[0] == jaxprs[1] and "optimization_barrier" in jaxprs[0]


def test_pallas_decode_attention_gives_the_xla_decode_logits(model_and_seed):
  # The same weights with decode_attention="pallas": one-token steps read the stacked cache in place
  # (qerl_kernels.decode_attention, interpret mode here); prefill and logits match the XLA path.
  model, seed = model_and_seed
  config = model.config
  kernel_model = Transformer(config.replace(decode_attention="pallas"), model.params(), lora=model.lora)
  rng = np.random.default_rng(seed)
  prompt_len, steps = 7, 3
  prompt = jnp.asarray(rng.integers(0, config.vocab_size, (2, prompt_len)), jnp.int32)
  valid = np.ones((2, prompt_len + steps), bool)
  valid[1, :2] = False  # row 1 left-padded
  valid = jnp.asarray(valid)
  positions = jnp.asarray(np.maximum(np.cumsum(np.asarray(valid)[:, :prompt_len], axis=1) - 1, 0))
  _, state = nnx.split(model)
  outs = []
  for m in (model, kernel_model):
    graphdef = nnx.split(m)[0]  # the same weights (state) in both graphs
    cache = init_cache(config, 2, prompt_len + steps, jnp.float32)
    _, cache = _step(graphdef, state, prompt, positions, cache, 0, valid)
    step_logits = []
    for i in range(steps):
      tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 1)), jnp.int32) * 0 + i + 1
      pos = positions[:, -1:] + i + 1
      logits, cache = _step(graphdef, state, tokens, pos, cache, jnp.int32(prompt_len + i), valid)
      step_logits.append(np.asarray(logits))
    outs.append(np.stack(step_logits))
  np.testing.assert_allclose(outs[1], outs[0], rtol=1e-4, atol=1e-4, err_msg=f"{seed=}")
  for choice, kernel_expected in (("auto", False), ("pallas", True)):  # "auto": the kernel only on a GPU
    graphdef = nnx.split(Transformer(config.replace(decode_attention=choice), model.params(), lora=model.lora))[0]
    jaxpr = jax.make_jaxpr(lambda c: _step(graphdef, state, tokens, pos, c, jnp.int32(prompt_len), valid))(cache)
    assert ("decode_attention" in str(jaxpr)) == kernel_expected, choice
  with pytest.raises(ValueError, match="decode_attention='flash' must be"):
    config.replace(decode_attention="flash")
