"""Sharding: mesh sizes from the config, the partition rules, and a sharded GRPO update on 8 CPU devices.

The pytest process already runs JAX on one CPU device, so the multi-device checks run this file as a
script in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8: it builds a tiny random
NVFP4 model, runs one micro-batched update unsharded and once on a data=2 x fsdp=2 x tensor=2 mesh, asserts
inside (a failing assert fails the test with its traceback) and prints the compared numbers as JSON.
"""

import json
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)


# ---------------------------------------------------------------- in-process (one device) checks

def test_mesh_shape_resolves_the_rest_and_names_bad_values():
  from qerl_jax.sharding import mesh_shape
  assert mesh_shape(None, 1) == (1, 1, 1)
  assert mesh_shape({"fsdp": -1}, 8) == (1, 8, 1)
  assert mesh_shape({"data": 2, "fsdp": -1, "tensor": 2}, 8) == (2, 2, 2)
  assert mesh_shape({"data": -1, "tensor": 4}, 16) == (4, 1, 4)
  with pytest.raises(ValueError, match="needs 4 devices"):
    mesh_shape({"data": 2, "fsdp": 2}, 8)
  with pytest.raises(ValueError, match="more than one -1"):
    mesh_shape({"data": -1, "fsdp": -1}, 8)
  with pytest.raises(ValueError, match="not divisible by 3"):
    mesh_shape({"data": 3, "fsdp": -1}, 8)
  with pytest.raises(ValueError, match=r"unknown mesh axes \['pipeline'\]"):
    mesh_shape({"pipeline": 2}, 2)


def test_fit_spec_pads_and_drops_axes_that_do_not_divide():
  from jax.sharding import PartitionSpec as P
  from qerl_jax.sharding import BATCH, fit_spec
  sizes = {"data": 2, "fsdp": 4, "tensor": 2}
  assert fit_spec(P(None, "tensor"), (3, 8, 5), sizes) == P(None, "tensor", None)
  assert fit_spec(P(BATCH), (16, 3), sizes) == P(("data", "fsdp"), None)
  assert fit_spec(P(BATCH), (6, 3), sizes) == P("data", None)  # 6 rows: fsdp=4 dropped, data=2 kept
  assert fit_spec(P(None, "tensor"), (4, 3), sizes) == P(None, None)
  with pytest.raises(ValueError, match="more entries than the leaf's rank 1"):
    fit_spec(P(None, "fsdp"), (4,), sizes)


def test_every_base_leaf_matches_its_intended_rule():
  """Paths of the NNX frozen state and of the base pytree, for NVFP4, NF4 and bf16 bases (shapes only)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P
  from qerl_jax.model import ModelConfig
  from qerl_jax.model.base import empty_base, schemes_for
  from qerl_jax.sharding import path_str, spec_for
  cfg = ModelConfig(arch="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=32, qkv_bias=True)
  sizes = {"data": 1, "fsdp": 2, "tensor": 2}
  expected = {
    "nvfp4": {"layers/q_proj/w/packed_NxKh": P(None, "tensor", "fsdp"),
              "layers/q_proj/w/scale_NxKb": P(None, "tensor", "fsdp"),
              "layers/down_proj/w/packed_NxKh": P(None, "fsdp", "tensor"),
              "layers/down_proj/w/scale_NxKb": P(None, "fsdp", "tensor"),
              "layers/up_proj/w/global_scale": P(None, None)},
    "nf4": {"layers/gate_proj/w/packed": P(None, "fsdp"), "layers/gate_proj/w/absmax": P(None, "fsdp")},
    "bf16": {"layers/v_proj/w": P(None, "fsdp", "tensor"), "layers/o_proj/w": P(None, "tensor", "fsdp"),
             "layers/v_proj/b": P(None, "tensor"), "embed_tokens": P(None, "fsdp"),
             "lm_head": P(None, "fsdp"), "layers/input_layernorm": P(None, None)},
  }
  for quant, want in expected.items():
    abstract = jax.eval_shape(lambda: empty_base(cfg, schemes_for(cfg, quant), dtype=jnp.bfloat16))
    got = {path_str(p): spec_for("frozen/" + path_str(p), leaf.shape, sizes)
           for p, leaf in jax.tree_util.tree_leaves_with_path(abstract)}
    for path, spec in want.items():
      assert got[path] == spec, (quant, path, got[path])
    # Nothing sizeable is left replicated by accident: every leaf of rank >= 2 except norms and the
    # replicated scale vectors is split somewhere.
    for path, spec in got.items():
      if not any(word in path for word in ("norm", "global_scale", "absmax_")):
        assert any(entry is not None for entry in spec), (quant, path, spec)


def test_local_bytes_counts_one_shard():
  from jax.sharding import PartitionSpec as P
  from qerl_jax.sharding import local_bytes
  sizes = {"data": 2, "fsdp": 4, "tensor": 2}
  assert local_bytes((80, 64, 32), np.uint8, P(None, "tensor", "fsdp"), sizes) == 80 * 32 * 8
  assert local_bytes((10, 7), np.float32, P(("data", "fsdp")), sizes) == 2 * 7 * 4  # ceil(10 / 8) rows
  assert local_bytes((3, 5), np.float32, P(), sizes) == 60


# ---------------------------------------------------------------- the 8-device subprocess

def _run_on_8_devices(*args, timeout=300):
  """python ``args`` with 8 virtual CPU devices, keeping the suite's XLA flags (conftest's compile level); fails the
  test, with the child's output, unless it exits 0."""
  flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  return proc


# The integer decode's twin of the "words" test below (the same comparisons and sharding code; ~40 s of CI's
# budget): CI keeps "words", the dequantization the GPU tuning file ships.
@pytest.mark.slow
def test_sharded_update_equals_unsharded_on_8_cpu_devices():
  proc = _run_on_8_devices(os.path.abspath(__file__))
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  print(result)
  assert result["devices"] == 8
  # The numbers themselves were compared inside; sanity: a real update happened (non-zero gradient,
  # parameters moved) and both runs saw the same loss.
  assert result["grad_norm"] > 0 and result["param_change"] > 0
  assert result["loss"] == pytest.approx(result["loss_sharded"], rel=1e-5, abs=1e-7)


def test_sharded_update_equals_unsharded_with_the_words_dequantization():
  # The Hopper file's "words" (shipped since the twelfth session) passes x and the weight through one barrier;
  # the same comparisons as the test above (slow), with every XLA-path matmul dequantizing that way.
  proc = _run_on_8_devices(os.path.abspath(__file__), "words")
  lines = proc.stdout.strip().splitlines()
  result, used = json.loads(lines[-2]), json.loads(lines[-1])
  assert result["devices"] == 8 and result["grad_norm"] > 0
  assert result["loss"] == pytest.approx(result["loss_sharded"], rel=1e-5, abs=1e-7)
  assert used["xla_path_modes"] == ["words"] and used["xla_path_calls"] > 0


def _batch(rng, rows, prompt_len, new, vocab):
  lengths = rng.integers(1, new + 1, rows)
  mask = np.arange(new)[None, :] < lengths[:, None]
  valid = np.ones((rows, prompt_len), bool)
  valid[:, : prompt_len // 2] = rng.random((rows, prompt_len // 2)) > 0.5  # some left padding
  valid[:, -1] = True
  return {
    "prompt_BxP": rng.integers(0, vocab, (rows, prompt_len)).astype(np.int32), "prompt_valid_BxP": valid,
    "completion_BxN": rng.integers(0, vocab, (rows, new)).astype(np.int32), "mask_BxN": mask,
    "truncated_B": lengths == new, "advantages_B": rng.standard_normal(rows).astype(np.float32),
    "old_logp_BxN": np.zeros((rows, new), np.float32),
    "rollout_logp_BxN": (-3.0 - rng.random((rows, new))).astype(np.float32) * mask,
  }


def _check_blocks_colocated(packed, scale, block):
  """Each device's shard of the codes covers exactly the K range of its shard of the block scales."""
  by_device = {s.device: s.index for s in scale.addressable_shards}
  for shard in packed.addressable_shards:
    p_idx, s_idx = shard.index, by_device[shard.device]
    assert p_idx[:2] == s_idx[:2], (p_idx, s_idx)  # same layers, same output rows
    kh, kb = p_idx[2], s_idx[2]
    k_from_codes = (2 * (kh.start or 0), 2 * (kh.stop if kh.stop is not None else packed.shape[2]))
    k_from_scales = (block * (kb.start or 0), block * (kb.stop if kb.stop is not None else scale.shape[2]))
    assert k_from_codes == k_from_scales, (shard.device, k_from_codes, k_from_scales)


def _main():
  import jax
  jax.config.update("jax_default_matmul_precision", "highest")
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import PartitionSpec as P
  from qerl_jax import sharding
  from qerl_jax.model import ModelConfig, Transformer, random_base, split_params
  from qerl_jax.model.linear import LoraConfig
  from qerl_jax.train.optim import OptimizerSettings
  from qerl_jax.train.state import init_train_state
  from qerl_jax.train.step import UpdateSettings, jit_update

  assert jax.device_count() == 8, jax.devices()
  seed = zlib.crc32(b"test_sharded_update_equals_unsharded_on_8_cpu_devices")
  rng = np.random.default_rng(seed)
  cfg = ModelConfig(arch="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, dtype=jnp.float32, remat=True)
  base = random_base(cfg, jax.random.key(seed), "nvfp4")
  model = Transformer(cfg, base, lora=LoraConfig(rank=4, alpha=8.0), train_norms=True, rngs=nnx.Rngs(seed))
  graphdef, trainable, frozen = split_params(model)
  params = trainable.to_pure_dict()
  # LoRA B starts at zero: give it values so the update's gradient reaches A as well.
  params = jax.tree_util.tree_map_with_path(
    lambda p, x: x + 0.05 * jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    if "lora_b" in sharding.path_str(p) else x, params)
  opt_settings = OptimizerSettings(learning_rate=1e-2, total_updates=4, warmup_ratio=0.0)
  settings = UpdateSettings(micro_batch_size=4, logprob_chunk=4, vocab_chunk=128, max_len=8)
  batch = _batch(rng, 8, 8, 8, cfg.vocab_size)

  # Unsharded reference (everything on device 0).
  update, optimizer, _ = jit_update(graphdef, opt_settings, settings)
  state0 = init_train_state(jax.tree.map(jnp.copy, params), optimizer, seed)
  state1, metrics1, logp1 = update(state0, frozen, batch, jnp.asarray(True))
  state1, metrics1, logp1 = jax.device_get((state1, metrics1, logp1))

  # Sharded: base placed by the rules, state born sharded under jit, batch split over (data, fsdp).
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": -1})
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  frozen_s = sharding.place(frozen, mesh, prefix="frozen")
  state_s = sharding.init_sharded(lambda p: init_train_state(p, optimizer, seed), mesh, params)
  batch_s = sharding.place(batch, mesh, prefix="batch")

  fspecs = sharding.specs_of(frozen_s)
  col, row = P(None, "tensor", "fsdp"), P(None, "fsdp", "tensor")
  for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
    assert fspecs[f"layers/{name}/weight/packed_NxKh"] == col, fspecs
    assert fspecs[f"layers/{name}/weight/scale_NxKb"] == col
  for name in ("o_proj", "down_proj"):
    assert fspecs[f"layers/{name}/weight/packed_NxKh"] == row
    assert fspecs[f"layers/{name}/weight/scale_NxKb"] == row
    w = frozen_s["layers"][name]["weight"].get_value()
    _check_blocks_colocated(w.packed_NxKh, w.scale_NxKb, 16)
  w = frozen_s["layers"]["q_proj"]["weight"].get_value()
  _check_blocks_colocated(w.packed_NxKh, w.scale_NxKb, 16)
  assert fspecs["layers/q_proj/bias"] == P(None, "tensor")
  assert fspecs["embed_tokens"] == P(None, "fsdp") and fspecs["norm"] == P(None)
  # Each device holds a quarter of a column-parallel weight's codes (tensor x fsdp), all layers.
  packed = frozen_s["layers"]["q_proj"]["weight"].get_value().packed_NxKh
  assert packed.addressable_shards[0].data.shape == (2, 32, 16)

  def check_state_specs(state):
    pspecs = sharding.specs_of(state.params)
    assert pspecs["layers/q_proj/lora_a"] == P(None, "fsdp", None), pspecs
    assert pspecs["layers/q_proj/lora_b"] == P(None, None, "tensor")
    assert pspecs["layers/down_proj/lora_a"] == P(None, "tensor", None)
    assert pspecs["layers/down_proj/lora_b"] == P(None, None, "fsdp")
    ospecs = sharding.specs_of(state.opt_state)
    for path, spec in pspecs.items():  # AdamW's moments follow their parameters
      moments = [s for p, s in ospecs.items() if p.endswith("/" + path)]
      assert len(moments) == 2 and all(s == spec for s in moments), (path, moments)

  check_state_specs(state_s)
  bspecs = sharding.specs_of(batch_s)
  assert bspecs["completion_BxN"] == P(("data", "fsdp"), None) and bspecs["advantages_B"] == P(("data", "fsdp"))

  update_s, _, _ = sharding.jit_update_sharded(graphdef, opt_settings, settings, mesh, state_s, frozen_s)
  state2, metrics2, logp2 = update_s(state_s, frozen_s, batch_s, jnp.asarray(True))
  check_state_specs(state2)  # the update keeps the layout (no drift, so no recompile at the next step)
  assert logp2.sharding.spec == P(("data", "fsdp"), None)
  host2 = jax.device_get((state2.params, state2.opt_state))  # state2 is donated to the next step
  # A second step with the kept layout: same program (one trace) and still equal to the unsharded chain.
  state3, metrics3, _ = update_s(state2, frozen_s, dict(batch_s, old_logp_BxN=logp2), jnp.asarray(False))
  ref3, ref_metrics3, _ = update(jax.tree.map(jnp.asarray, state1), frozen, dict(batch, old_logp_BxN=logp1),
                                 jnp.asarray(False))
  assert update_s._cache_size() == 1

  def close(a, b, rtol=2e-5, atol=2e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)

  for name in ("loss", "grad_norm", "entropy", "clip_frac", "ratio_mean"):
    close(metrics2[name], metrics1[name])
    close(metrics3[name], ref_metrics3[name])
  close(logp2, logp1)
  # AdamW's moments are linear / quadratic in the gradient: they carry the gradient comparison.
  jax.tree.map(lambda a, b: close(a, b, atol=1e-7), host2[1], state1.opt_state)
  # Adam's first step moves each parameter by about lr * g / (|g| + eps): for the few gradients near eps
  # a float32 reduction-order difference in g changes the step by ~1e-3 lr, so params get that tolerance.
  lr = opt_settings.learning_rate
  jax.tree.map(lambda a, b: close(a, b, atol=2e-3 * lr), host2[0], state1.params)
  jax.tree.map(lambda a, b: close(a, b, atol=4e-3 * lr), jax.device_get(state3.params),
               jax.device_get(ref3.params))
  change = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
               for a, b in zip(jax.tree.leaves(state1.params), jax.tree.leaves(params)))
  print(json.dumps({"devices": jax.device_count(), "loss": float(metrics1["loss"]),
                    "loss_sharded": float(metrics2["loss"]), "grad_norm": float(metrics1["grad_norm"]),
                    "param_change": change}))


def _main_loading():
  """A checkpoint loaded with a mesh: every base array born split by the rules, values equal to a plain load."""
  import tempfile

  import jax
  import jax.numpy as jnp
  from qerl_jax import sharding
  from qerl_jax.model import from_pretrained, split_params
  from qerl_jax.model.testing import save_tiny_hf

  assert jax.device_count() == 8, jax.devices()
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  seed = zlib.crc32(b"test_loading_with_a_mesh_writes_into_the_shards")
  checked = {}
  with tempfile.TemporaryDirectory() as d:
    save_tiny_hf("qwen2", d, seed)
    for quant in ("nvfp4", "bf16"):
      kw = dict(quant=quant, lora_rank=4, dtype=jnp.float32, load_tokenizer=False)
      plain, _ = from_pretrained(d, **kw)
      split, _ = from_pretrained(d, mesh=mesh, **kw)
      frozen0, frozen1 = split_params(plain)[2], split_params(split)[2]
      want = sharding.shardings_for(frozen1, mesh, prefix="frozen")  # what the trainer's place() asks for
      leaves0 = jax.tree_util.tree_leaves_with_path(frozen0)
      leaves1 = jax.tree.leaves(frozen1)
      assert len(leaves0) == len(leaves1) == len(jax.tree.leaves(want))
      split_leaves = 0
      for (path, a), b, sh in zip(leaves0, leaves1, jax.tree.leaves(want)):
        name = sharding.path_str(path)
        assert b.sharding.is_equivalent_to(sh, b.ndim), (name, b.sharding, sh)
        np.testing.assert_array_equal(np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b)),
                                      err_msg=name)
        # Split leaves hold less than the whole array on each device.
        if any(axis is not None for axis in sh.spec):
          split_leaves += 1
          assert all(shard.data.size < b.size for shard in b.addressable_shards), name
      checked[quant] = split_leaves
  print(json.dumps({"devices": jax.device_count(), "split_leaves": checked}))


def _main_kernel():
  """Under a context mesh the fused kernel runs per device on its rows (shard_map); values and gradients match."""
  import jax
  import jax.numpy as jnp
  import qerl_kernels as kernels
  from jax.sharding import NamedSharding, PartitionSpec as P
  from qerl_jax import quant, sharding

  assert jax.device_count() == 8, jax.devices()
  rng = np.random.default_rng(zlib.crc32(b"test_fused_kernel_maps_over_rows_under_a_mesh"))
  q = quant.quantize(jnp.asarray(rng.standard_normal((64, 48)), jnp.float32), "nvfp4")
  w_KxN = np.asarray(quant.dequantize(q, jnp.float32), np.float64)
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})

  def loss(x, q):
    return jnp.sum(jnp.sin(kernels.nvfp4_matmul(x, q, interpret=True).astype(jnp.float32)))

  out = {}
  for rows in (8, 6):  # 6 rows do not split over data x fsdp = 4: the kernel runs unmapped
    shape = (4, 2, 64) if rows == 8 else (2, 3, 64)  # [B, T, K], rows = B * T
    x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    x_f64 = np.asarray(x, np.float64).reshape(rows, 64)
    y_ref = x_f64 @ w_KxN
    g_ref = (np.cos(y_ref) @ w_KxN.T).reshape(x.shape)
    with sharding.mesh_context(mesh):
      xs = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp")) if rows == 8 else P()))
      text = str(jax.make_jaxpr(lambda x: kernels.nvfp4_matmul(x, q, interpret=True))(xs))
      y = jax.jit(lambda x: kernels.nvfp4_matmul(x, q, interpret=True))(xs)
      g = jax.jit(jax.grad(loss))(xs, q)
    scale = np.abs(y_ref).max()
    np.testing.assert_allclose(np.asarray(y, np.float64).reshape(rows, -1), y_ref, atol=2e-2 * scale)
    np.testing.assert_allclose(np.asarray(g, np.float64), g_ref, atol=2e-2 * np.abs(g_ref).max())
    out[rows] = "shard_map" in text
  plain = str(jax.make_jaxpr(lambda x: kernels.nvfp4_matmul(x, q, interpret=True))(jnp.zeros((8, 64), jnp.bfloat16)))
  # A stacked weight with a layer index (the model's layer scan): under the mesh, one layer is taken out of
  # the stack and gathered, then mapped over the rows like a single weight.
  q2 = quant.quantize(jnp.asarray(rng.standard_normal((64, 48)), jnp.float32), "nvfp4")
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), q, q2)
  x = jnp.asarray(rng.standard_normal((8, 64)), jnp.bfloat16)
  y_ref = np.asarray(x, np.float64) @ np.asarray(quant.dequantize(q2, jnp.float32), np.float64)
  with sharding.mesh_context(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"))))
    f = lambda x, layer: kernels.nvfp4_matmul(x, stacked, layer=layer, interpret=True)
    text = str(jax.make_jaxpr(f)(xs, jnp.int32(1)))
    y = jax.jit(f)(xs, jnp.int32(1))
  np.testing.assert_allclose(np.asarray(y, np.float64), y_ref, atol=2e-2 * np.abs(y_ref).max())
  # With the epilogue (bias + scale * xa @ B): xa splits over rows like x; values and all four gradients
  # match the unsharded XLA path.
  xa = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((4, 48)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal((48,)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((8, 48)), jnp.float32)  # a linear loss: gradients free of y's rounding

  def epi_loss(impl, x, xa, b, bias):
    y = kernels.nvfp4_matmul(x, q, bias=bias, lora=(xa, b, 0.5), implementation=impl, interpret=impl == "pallas")
    return jnp.sum(y.astype(jnp.float32) * dy)

  want = jax.grad(lambda *a: epi_loss("xla", *a), argnums=(0, 1, 2, 3))(x, xa, b, bias)
  with sharding.mesh_context(mesh):
    rows_spec = NamedSharding(mesh, P(("data", "fsdp")))
    xs, xas = jax.device_put(x, rows_spec), jax.device_put(xa, rows_spec)
    epi_text = str(jax.make_jaxpr(lambda *a: epi_loss("pallas", *a))(xs, xas, b, bias))
    got = jax.jit(jax.grad(lambda *a: epi_loss("pallas", *a), argnums=(0, 1, 2, 3)))(xs, xas, b, bias)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                               atol=3e-2 * np.abs(np.asarray(w, np.float64)).max())
  print(json.dumps({"devices": jax.device_count(), "mapped_8_rows": out[8], "mapped_6_rows": out[6],
                    "mapped_without_mesh": "shard_map" in plain, "mapped_stacked": "shard_map" in text,
                    "mapped_epilogue": "shard_map" in epi_text}))


def _main_words():
  """_main with the Hopper file's "words" dequantization forced on (the CPU otherwise takes the integer decode):
  its barrier with x must partition like the rest of the XLA path. Prints how many XLA-path matmuls used it."""
  import tempfile
  import qerl_kernels  # noqa: F401  (binds the module the patches below reach)
  mm = sys.modules["qerl_kernels.nvfp4_matmul"]
  path = os.path.join(tempfile.mkdtemp(), "words.json")
  with open(path, "w") as f:
    json.dump({"xla_dequant": "words"}, f)
  os.environ["QERL_KERNEL_TUNING"] = path
  mm._device_kind = lambda: "NVIDIA H200"  # pylint: disable=protected-access
  mm._gpu_supported = lambda: True  # pylint: disable=protected-access
  modes, traced = [], mm.xla_path_matmul
  def counting(x, q, **kw):
    modes.append(mm.xla_dequant())
    return traced(x, q, **kw)
  mm.xla_path_matmul = counting
  _main()
  print(json.dumps({"xla_path_modes": sorted(set(modes)), "xla_path_calls": len(modes)}))


if __name__ == "__main__":
  {"loading": _main_loading, "kernel": _main_kernel, "words": _main_words}.get((sys.argv[1:] or [""])[0], _main)()


def test_loading_with_a_mesh_writes_into_the_shards():
  proc = _run_on_8_devices(os.path.abspath(__file__), "loading")
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  # nvfp4: codes and scales of 7 projections, embed; bf16: 7 weights and embed (+ q/k/v biases over tensor).
  assert result["devices"] == 8 and result["split_leaves"]["nvfp4"] >= 15 and result["split_leaves"]["bf16"] >= 8


def test_fused_kernel_maps_over_rows_under_a_mesh():
  proc = _run_on_8_devices(os.path.abspath(__file__), "kernel")
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result == {"devices": 8, "mapped_8_rows": True, "mapped_6_rows": False, "mapped_without_mesh": False,
                    "mapped_stacked": True, "mapped_epilogue": True}


@pytest.mark.slow  # ~30 s; the sharded update against the unsharded one stays in CI
def test_trainer_runs_on_a_data_fsdp_tensor_mesh(tmp_path):
  # The smoke config end to end on 2 x 2 x 2 CPU devices: base, adapters and AdamW state split by the rules,
  # rollouts and updates over the mesh, a checkpoint, and the final evaluation.
  _run_on_8_devices("-m", "qerl_jax.main", "--config=configs/smollm2_135m.py:smoke", "--config.mesh.data=2",
                    "--config.mesh.fsdp=2", "--config.mesh.tensor=2", f"--workdir={tmp_path}")
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert all(np.isfinite(r["loss"]) and r["nonfinite/total"] == 0 for r in rows)
  assert os.listdir(tmp_path / "checkpoints") and os.path.exists(tmp_path / "eval" / "step_3" / "report.json")


def test_distributed_args_from_the_environment():
  from qerl_jax.sharding import distributed_args
  assert distributed_args({}) is None
  assert distributed_args({"SLURM_NTASKS": "1"}) is None
  assert distributed_args({"SLURM_NTASKS": "4"}) == {}  # JAX's own SLURM detection
  assert distributed_args({"OMPI_COMM_WORLD_SIZE": "2"}) == {}
  env = {"JAX_COORDINATOR_ADDRESS": "host0:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
  assert distributed_args(env) == {"coordinator_address": "host0:1234", "num_processes": 2, "process_id": 1}
  with pytest.raises(ValueError, match="JAX_PROCESS_ID"):
    distributed_args({"JAX_COORDINATOR_ADDRESS": "host0:1234", "JAX_NUM_PROCESSES": "2"})
