"""The rollout's two layer loops: "unrolled" (per-layer buffers, the default) against "scan" (stacked)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qerl_jax.model.linear import PROJ_NAMES
from qerl_jax.model.testing import fresh_seed
from qerl_jax.rollout import engine
from qerl_jax.rollout.sampling import SamplingParams
from tests.test_model_forward import random_model, tiny_config


def _rollout(model, prompt, valid, key, noise, **kw):
  graphdef, state = nnx.split(model)
  return engine.rollout(graphdef, state, prompt, valid, key, noise, sampling=SamplingParams(temperature=1.0),
                        max_new_tokens=6, stop_ids=(), pad_id=0, **kw)


def _rollouts_by(model, config, field, values, rng, pads, key, noise=None):
  """{value: the rollout of `model` with config.<field> = value}, on one left-padded prompt batch."""
  length = max(pads) + 3
  prompt = jnp.asarray(rng.integers(1, config.vocab_size, (len(pads), length)), jnp.int32)
  valid = jnp.asarray(np.arange(length)[None, :] >= np.array(pads)[:, None])
  outs = {}
  for value in values:
    model.config = config.replace(**{field: value})
    outs[value] = _rollout(model, prompt, valid, key, noise)
  return outs


@pytest.mark.parametrize("quant,remat", [("bf16", False), ("nvfp4", True)])
def test_unrolled_and_scanned_decode_sample_the_same_tokens(quant, remat):
  seed = fresh_seed()
  config = tiny_config(remat=remat)
  model = random_model(config, seed, quant=quant)
  rng = np.random.default_rng(seed)
  noise = {name: jnp.asarray(0.05 * rng.standard_normal((config.num_layers, dim)), jnp.float32)
           for name, dim in (("input_layernorm", config.hidden_size), ("q_norm", config.head_dim))}
  outs = _rollouts_by(model, config, "decode_layers", ("unrolled", "scan"), rng, (0, 2, 4), jax.random.key(seed),
                      noise)
  np.testing.assert_array_equal(outs["unrolled"].tokens_BxN, outs["scan"].tokens_BxN)
  np.testing.assert_allclose(outs["unrolled"].logprobs_BxN, outs["scan"].logprobs_BxN, rtol=1e-5, atol=1e-5)
  assert float(jnp.abs(outs["scan"].logprobs_BxN).sum()) > 0


def test_pallas_decode_attention_on_per_layer_caches_samples_the_same_tokens():
  # The unrolled loop hands the kernel each layer's own cache (as a stack of one) and the causal limit;
  # the samples equal XLA attention's (interpret mode here).
  seed = fresh_seed()
  config = tiny_config()  # float32: the two attentions agree to ~1e-6, so no sample can flip
  outs = _rollouts_by(random_model(config, seed), config, "decode_attention", ("xla", "pallas"),
                      np.random.default_rng(seed), (0, 3), jax.random.key(seed))
  np.testing.assert_array_equal(outs["pallas"].tokens_BxN, outs["xla"].tokens_BxN)
  np.testing.assert_allclose(outs["pallas"].logprobs_BxN, outs["xla"].logprobs_BxN, rtol=1e-4, atol=1e-4)


def _while_bodies(jaxpr):
  """The body jaxprs of every while loop in a (closed) jaxpr, searched through nested calls."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "while":
      found.append(eqn.params["body_jaxpr"].jaxpr)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _while_bodies(sub)
  return found


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


def test_unrolled_decode_step_slices_no_stacked_array():
  # In the decode loop of the "unrolled" rollout no operation takes a slice of an array stacked over the
  # layers (the per-token copy XLA makes of such slices); the "scan" loop does, through its scan.
  config = tiny_config(num_layers=3)
  model = random_model(config, fresh_seed())
  prompt = jnp.ones((2, 5), jnp.int32)
  valid = jnp.ones((2, 5), bool)
  for layers in ("unrolled", "scan"):
    model.config = config.replace(decode_layers=layers)
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s: engine.rollout(
        graphdef, s, prompt, valid, jax.random.key(0), sampling=SamplingParams(temperature=1.0),
        max_new_tokens=4, stop_ids=()))(state)
    (body,) = _while_bodies(jaxpr.jaxpr)
    eqns = list(_eqns(body))
    sliced = [eqn for eqn in eqns if eqn.primitive.name in ("dynamic_slice", "slice", "gather")
              and eqn.invars[0].aval.ndim >= 2 and eqn.invars[0].aval.shape[0] == config.num_layers]
    scans = [eqn for eqn in eqns if eqn.primitive.name == "scan"]
    if layers == "unrolled":
      assert not scans and not sliced, [str(e)[:200] for e in sliced]
    else:
      assert scans


@pytest.mark.parametrize("layers", ["unrolled", "scan"])
def test_decode_step_concatenates_no_adapter(layers):
  # The A's that share an input (q/k/v, gate/up) run as one x @ [A1 | A2 | ...]. The "unrolled" rollout
  # concatenates them once, before its decode loop: XLA did not hoist the concatenation out of the loop (two
  # ~1.7 us kernels per layer and token on an H200, 7B batch 8); the "scan" loop still concatenates per step.
  config = tiny_config(num_layers=3)
  model = random_model(config, fresh_seed())  # LoRA rank 4 on all seven projections
  model.config = config.replace(decode_layers=layers)
  graphdef, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(lambda s: engine.rollout(
      graphdef, s, jnp.ones((2, 5), jnp.int32), jnp.ones((2, 5), bool), jax.random.key(0),
      sampling=SamplingParams(temperature=1.0), max_new_tokens=4, stop_ids=()))(state)
  (body,) = _while_bodies(jaxpr.jaxpr)
  shapes = ((config.hidden_size, 3 * 4), (config.hidden_size, 2 * 4))  # [K, q|k|v ranks], [K, gate|up ranks]

  def concats(jaxpr):
    return [eqn for eqn in _eqns(jaxpr) if eqn.primitive.name == "concatenate"
            and eqn.outvars[0].aval.shape[-2:] in shapes]
  in_loop = concats(body)
  assert len(in_loop) == (0 if layers == "unrolled" else 2), [str(e)[:200] for e in in_loop]
  # The prefill and the per-layer buffers: once per layer and group in the unrolled rollout, once per group
  # in each of the scan's bodies (prefill and decode) otherwise.
  assert len(concats(jaxpr.jaxpr)) - len(in_loop) == (2 * config.num_layers if layers == "unrolled" else 2)


def test_decode_layers_must_be_known():
  with pytest.raises(ValueError, match="decode_layers='loop' must be"):
    tiny_config(decode_layers="loop")


def _rollouts_equal(model, ref, config, seed, pads):
  """Rolls out `model` (with `config`) and `ref` on one left-padded batch with one key; asserts the same
  tokens and log-probs. Returns (model's rollout, prompt, valid, key)."""
  rng = np.random.default_rng(seed)
  prompt = jnp.asarray(rng.integers(1, config.vocab_size, (len(pads), 5)), jnp.int32)
  valid = jnp.asarray(np.arange(5)[None, :] >= np.array(pads)[:, None])
  key = jax.random.key(seed)
  model.config = config
  out = _rollout(model, prompt, valid, key, None)
  ref_out = _rollout(ref, prompt, valid, key, None)
  np.testing.assert_array_equal(out.tokens_BxN, ref_out.tokens_BxN)
  np.testing.assert_array_equal(out.logprobs_BxN, ref_out.logprobs_BxN)
  return out, prompt, valid, key


def _decode_body_eqns(model, config, prompt, valid, key):
  """Every equation in the decode loop's body of `model`'s rollout with `config`."""
  model.config = config
  graphdef, state = nnx.split(model)
  jaxpr = jax.make_jaxpr(lambda s: engine.rollout(
      graphdef, s, prompt, valid, key, sampling=SamplingParams(temperature=1.0), max_new_tokens=4,
      stop_ids=()))(state)
  (body,) = _while_bodies(jaxpr.jaxpr)
  return list(_eqns(body))


# The stacked scan (not the rollout's default loop) is a slow case: ~13 s of CI's budget.
@pytest.mark.parametrize("layers", ["unrolled", pytest.param("scan", marks=pytest.mark.slow)])
def test_rollout_lora_dtype_samples_from_the_cast_adapters_cast_once(layers):
  # ModelConfig.rollout_lora_dtype = "bfloat16": a model with float32 adapters rolls out exactly as one whose
  # adapters were rounded to bf16 beforehand (same tokens, same log-probs); the cast happens before the decode
  # loop, not in it. bf16 activations, as in the trainer's rollouts.
  seed = fresh_seed()
  config = tiny_config(dtype="bfloat16", decode_layers=layers)
  model = random_model(config, seed)  # float32 adapters, nonzero B
  rounded = random_model(config, seed, lora_dtype=jnp.bfloat16)
  for name in PROJ_NAMES:  # the same adapters, rounded to bf16, on all seven projections
    for ab in ("lora_a", "lora_b"):
      value = getattr(getattr(model.layers, name), ab).get_value()
      getattr(getattr(rounded.layers, name), ab).set_value(value.astype(jnp.bfloat16))
  cast, prompt, valid, key = _rollouts_equal(model, rounded, config.replace(rollout_lora_dtype="bfloat16"), seed,
                                             (0, 1, 3))
  model.config = config
  own = _rollout(model, prompt, valid, key, None)  # float32 adapters: other rounding, other log-probs
  assert not np.array_equal(np.asarray(own.logprobs_BxN), np.asarray(cast.logprobs_BxN))

  body = _decode_body_eqns(model, config.replace(rollout_lora_dtype="bfloat16"), prompt, valid, key)
  a_shape = (config.hidden_size, 4)  # an A [K, r] (per layer, or stacked [L, K, r])
  f32_reads = [e for e in body if e.primitive.name == "convert_element_type"
               and e.invars[0].aval.dtype == jnp.float32 and e.invars[0].aval.shape[-2:] == a_shape]
  assert not f32_reads, [str(e)[:200] for e in f32_reads]


def test_rollout_lora_dtype_and_fused_rows_must_be_valid():
  with pytest.raises(ValueError, match="rollout_lora_dtype='int8' must be"):
    tiny_config(rollout_lora_dtype="int8")
  for rows in (-1, 8.5, "64"):
    with pytest.raises(ValueError, match="fused_lora_max_rows=.* must be an int >= 0"):
      tiny_config(fused_lora_max_rows=rows)


@pytest.mark.parametrize("quant,layers", [("nvfp4", "unrolled"), ("nvfp4", "scan"),  # the other formats: slow
                                          pytest.param("nf4", "unrolled", marks=pytest.mark.slow),
                                          pytest.param("mxfp4", "scan", marks=pytest.mark.slow)])
def test_rollout_base_dtype_samples_from_the_dequantized_base_dequantized_once(quant, layers):
  # ModelConfig.rollout_base_dtype = "bfloat16": a quantized model rolls out exactly as a model whose base was
  # replaced by `quant.dequantize(w, bf16)` beforehand (same tokens, same log-probs), and its decode loop
  # reads no 4-bit codes (the dequantization happens once, before the loop); without it, the loop does.
  from qerl_jax.quant import dequantize
  seed = fresh_seed()
  config = tiny_config(dtype="bfloat16", decode_layers=layers)
  model = random_model(config, seed, quant=quant)
  dense = random_model(config, seed, quant=quant)
  for name in PROJ_NAMES:
    proj = getattr(dense.layers, name)
    proj.weight.set_value(jax.vmap(lambda q: dequantize(q, jnp.bfloat16))(proj.weight.get_value()))
  copied, prompt, valid, key = _rollouts_equal(model, dense, config.replace(rollout_base_dtype="bfloat16"), seed,
                                               (0, 2, 3))
  assert float(jnp.abs(copied.logprobs_BxN).sum()) > 0

  def code_reads(cfg):
    return [e for e in _decode_body_eqns(model, cfg, prompt, valid, key)
            if any(getattr(v.aval, "dtype", None) == jnp.uint8 for v in e.invars)]

  assert not code_reads(config.replace(rollout_base_dtype="bfloat16"))
  assert code_reads(config)


def test_rollout_base_dtype_must_be_known():
  with pytest.raises(ValueError, match="rollout_base_dtype='int4' must be"):
    tiny_config(rollout_base_dtype="int4")


def _decode_logits(params, config, scale, tokens):
  """One forward over the params as the rollout prepares them (`engine.rollout_params`), jitted afresh."""
  from qerl_jax.model.transformer import forward
  return np.asarray(jax.jit(lambda p: forward(engine.rollout_params(p, config), config, scale, tokens))(params),
                    np.float32)


@pytest.mark.parametrize("rows", [1, 6])  # the gemv with x @ A in its launch; the tile kernel's fused epilogue
def test_merged_launches_give_the_separate_launches_logits_in_one_launch_per_group(monkeypatch, rows):
  # ModelConfig.rollout_merged_launches: q|k|v and gate|up as one NVFP4 launch each over the members' weights
  # read in place (qerl_kernels.Nvfp4Group), each with its own global scale (up and k get others here). Through the
  # kernels (interpret mode) the logits equal the separate launches' (bf16 activations, q/k/v biases, nonzero
  # bf16 adapters), with 4 matmul launches per layer where there were 7, and no weight concatenated.
  import functools
  import re
  import qerl_kernels as kernels
  seed = fresh_seed()
  config = tiny_config(dtype="bfloat16")
  model = random_model(config, seed, quant="nvfp4", lora_dtype=jnp.bfloat16)
  for w in (model.layers.up_proj.weight, model.layers.k_proj.weight):  # 16x the weights
    w.set_value(w.get_value().replace(global_scale=w.get_value().global_scale / 16))
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 128, (1, rows)))
  for name in ("nvfp4_matmul", "nvfp4_matmul_xa", "xa_shares_launch"):
    monkeypatch.setattr(kernels, name, functools.partial(getattr(kernels, name), interpret=True))
  merged_cfg = config.replace(rollout_merged_launches=("qkv", "gate_up"))
  config = config.replace(rollout_merged_launches=())  # one launch per projection
  params = model.params()
  separate = _decode_logits(params, config, model.lora_scale, tokens)
  merged = _decode_logits(params, merged_cfg, model.lora_scale, tokens)
  np.testing.assert_allclose(merged, separate, atol=0.02 * np.abs(separate).max(), err_msg=f"{seed=}")
  assert np.abs(merged - separate).max() < 0.1 * np.abs(separate - separate.mean()).max(), f"{seed=}"

  def launches(cfg):
    from qerl_jax.model.transformer import forward
    jaxpr = str(jax.make_jaxpr(lambda p: forward(engine.rollout_params(p, cfg), cfg, model.lora_scale, tokens))(
        params))
    # No packed weights (uint8) are concatenated: the group is read in place.
    assert not [line for line in jaxpr.splitlines() if "concatenate" in line and "u8[" in line]
    # Each NVFP4 matmul is one call: with x @ A in the gemv's launch (one row), or the tile kernel's.
    return {name: len(re.findall(rf"name={name}\b", jaxpr)) for name in ("_shared_launch", "_nvfp4_matmul_jit")}

  one_launch = "_shared_launch" if rows == 1 else "_nvfp4_matmul_jit"
  assert launches(config) == {"_shared_launch": 0, "_nvfp4_matmul_jit": 0, one_launch: 7 * config.num_layers}
  assert launches(merged_cfg) == {"_shared_launch": 0, "_nvfp4_matmul_jit": 0, one_launch: 4 * config.num_layers}
  # The default (None) merges both groups.
  default_cfg = config.replace(rollout_merged_launches=None)
  assert default_cfg.merged_launch_groups == ("qkv", "gate_up")
  assert launches(default_cfg) == launches(merged_cfg)


def test_merged_launches_sample_the_same_tokens_with_each_members_global_scale():
  # On the XLA path (this CPU) the merged rollout (the default, None, and by name) samples what the separate
  # one does, also where the group's members have their own global scales (a checkpoint quantized without
  # llm-compressor's shared scale per fused group).
  seed = fresh_seed()
  config = tiny_config()
  model = random_model(config, seed, quant="nvfp4")
  up = model.layers.up_proj.weight
  up.set_value(up.get_value().replace(global_scale=2 * up.get_value().global_scale))
  values = ((), ("qkv", "gate_up"), None)
  outs = _rollouts_by(model, config, "rollout_merged_launches", values, np.random.default_rng(seed), (0, 2),
                      jax.random.key(seed))
  for value in values[1:]:
    np.testing.assert_array_equal(outs[()].tokens_BxN, outs[value].tokens_BxN)
    np.testing.assert_allclose(outs[()].logprobs_BxN, outs[value].logprobs_BxN, rtol=1e-5, atol=1e-5)


def test_rollout_merged_launches_must_be_known_groups_of_the_unrolled_loop():
  with pytest.raises(ValueError, match=r"\['qk'\] are not among the groups"):
    tiny_config(rollout_merged_launches=("qkv", "qk"))
  with pytest.raises(ValueError, match="needs decode_layers='unrolled'"):
    tiny_config(rollout_merged_launches=("qkv",), decode_layers="scan")
  assert tiny_config(rollout_merged_launches=["qkv"]).rollout_merged_launches == ("qkv",)
  with pytest.raises(ValueError, match="must be a tuple of groups"):
    tiny_config(rollout_merged_launches="qkv")
  # A config file's text (model.rollout_merged_launches) and bench flags.
  from qerl_jax.model.config import parse_merged_launches
  assert [parse_merged_launches(t) for t in ("auto", "none", "", "qkv, gate_up")] == [None, (), (), ("qkv", "gate_up")]
  assert tiny_config(decode_layers="scan").merged_launch_groups == ()
  assert tiny_config(rollout_base_dtype="bfloat16").merged_launch_groups == ()
