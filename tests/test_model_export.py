"""PEFT adapters both ways, merged checkpoints, and compressed-tensors NVFP4 directories."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers

from qerl_jax import quant
from qerl_jax.model.export import load_peft_adapter, merged_weight, save_merged, save_peft_adapter
from qerl_jax.model.loading import from_pretrained
from qerl_jax.model.testing import fresh_seed, hf_logits, save_tiny_hf

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
  """A tiny Qwen2 (qkv biases, tied embeddings) saved in float32 and in bfloat16."""
  seed = fresh_seed()
  root = tmp_path_factory.mktemp("qwen2")
  dirs = {}
  for dtype in ("float32", "bfloat16"):
    dirs[dtype] = str(root / dtype)
    save_tiny_hf("qwen2", dirs[dtype], seed, dtype)
  tokens = np.random.default_rng(seed).integers(0, 256, (2, 12))
  return dirs, tokens, seed


def _randomize_adapters(model, seed):
  rng = np.random.default_rng(seed)
  for name in model.lora.targets:
    proj = getattr(model.layers, name)
    for var in (proj.lora_a, proj.lora_b):
      var.set_value(jnp.asarray(0.1 * rng.standard_normal(var.get_value().shape), var.get_value().dtype))


def test_adapter_made_here_loads_in_peft_with_the_same_logits(tiny_qwen2, tmp_path):
  dirs, tokens, seed = tiny_qwen2
  model, _ = from_pretrained(dirs["float32"], quant="bf16", dtype=jnp.float32, lora_rank=4, lora_alpha=8,
                             lora_targets="q_proj|v_proj|down_proj|gate", train_norms=True)
  assert model.lora.targets == ("q_proj", "v_proj", "gate_proj", "down_proj")
  _randomize_adapters(model, seed)
  norm = model.layers.post_attention_layernorm
  norm.set_value(norm.get_value() * 1.25)  # a trained norm, exported through modules_to_save
  out = np.asarray(model(jnp.asarray(tokens)))
  save_peft_adapter(model, str(tmp_path), base_model_name_or_path=dirs["float32"])
  cfg = json.load(open(tmp_path / "adapter_config.json"))
  assert cfg["r"] == 4 and cfg["lora_alpha"] == 8 and set(cfg["target_modules"]) == set(model.lora.targets)
  hf = transformers.AutoModelForCausalLM.from_pretrained(dirs["float32"], dtype=torch.float32)
  peft_model = peft.PeftModel.from_pretrained(hf, str(tmp_path)).eval()
  ref = hf_logits(peft_model, tokens)
  with peft_model.disable_adapter():
    base_ref = hf_logits(peft_model, tokens)
  assert np.abs(ref - base_ref).max() > 1e-2  # the adapter changes the model
  np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(), err_msg=f"{seed=}")


def test_adapter_made_with_peft_loads_here_with_the_same_logits(tiny_qwen2, tmp_path):
  dirs, tokens, seed = tiny_qwen2
  torch.manual_seed(seed)
  hf = transformers.AutoModelForCausalLM.from_pretrained(dirs["bfloat16"], dtype=torch.float32)
  config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["k_proj", "o_proj", "up_proj"], use_rslora=True)
  peft_model = peft.get_peft_model(hf, config).eval()
  with torch.no_grad():
    for name, p in peft_model.named_parameters():
      if "lora_B" in name:
        p.normal_(0.0, 0.05)
  ref = hf_logits(peft_model, tokens)
  peft_model.save_pretrained(str(tmp_path))
  model, _ = from_pretrained(dirs["bfloat16"], quant="bf16", dtype=jnp.bfloat16, lora_rank=2,
                             lora_targets="q_proj")
  load_peft_adapter(model, str(tmp_path))
  assert model.lora.targets == ("k_proj", "o_proj", "up_proj") and model.lora.rank == 8
  assert model.lora.scale == pytest.approx(16 / 8 ** 0.5)
  out = np.asarray(model(jnp.asarray(tokens)))
  err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
  assert err < 2e-2, f"{seed=} relative error {err} (bf16 base)"
  with peft_model.disable_adapter():
    base_ref = hf_logits(peft_model, tokens)
  assert np.linalg.norm(base_ref - ref) / np.linalg.norm(ref) > 5 * err  # the adapter mattered


def test_merged_bf16_checkpoint_is_the_same_model_in_transformers(tiny_qwen2, tmp_path):
  dirs, tokens, seed = tiny_qwen2
  model, _ = from_pretrained(dirs["float32"], quant="bf16", dtype=jnp.float32, lora_rank=4, lora_alpha=16)
  _randomize_adapters(model, seed)
  out = np.asarray(model(jnp.asarray(tokens)))
  save_merged(model, str(tmp_path), scheme="bf16", max_shard_bytes=100_000)  # forces several shards
  shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
  assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").exists(), shards
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
  ref = hf_logits(hf, tokens)
  np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max(), err_msg=f"{seed=}")
  # ... and the sharded directory loads back here as the same (adapter-free) model.
  again, _ = from_pretrained(str(tmp_path), quant="bf16", dtype=jnp.float32, lora_rank=None)
  np.testing.assert_allclose(np.asarray(again(jnp.asarray(tokens))), out, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def _write_ct_dir(src: str, out: str) -> None:
  """An NVFP4 compressed-tensors directory built independently of the loader: every decoder linear of
  `src` through quant.quantize_NxK (q/k/v and gate/up sharing the minimum global scale)."""
  from safetensors.numpy import save_file
  from qerl_jax.model.safetensors_io import SafetensorsDir
  source = SafetensorsDir(src)
  tensors = {}
  groups = [("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)]
  linears = {k[: -len(".weight")] for k in source.keys() if k.endswith("_proj.weight")}
  for name in source.keys():
    if name[: -len(".weight")] not in linears:
      tensors[name] = source.get(name)
  for stem in sorted({s.rsplit(".", 1)[0] for s in linears}):
    for group in groups:
      names = [f"{stem}.{p}" for p in group if f"{stem}.{p}" in linears]
      if not names:
        continue
      ws = [jnp.asarray(source.get(f"{n}.weight")) for n in names]
      gs = quant.shared_global_scale(ws)
      for n, w in zip(names, ws):
        for part, value in quant.to_ct_tensors(quant.quantize_NxK(w, "nvfp4", global_scale=gs)).items():
          tensors[f"{n}.{part}"] = value
  os.makedirs(out)
  save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
  config = json.load(open(os.path.join(src, "config.json")))
  config["quantization_config"] = {
    "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                                         "weights": {"num_bits": 4, "type": "float",
                                                                     "group_size": 16}}}}
  json.dump(config, open(os.path.join(out, "config.json"), "w"))


def test_nvfp4_from_compressed_tensors_dir_equals_quantized_at_load(tiny_qwen2, tmp_path):
  dirs, tokens, seed = tiny_qwen2
  ct_dir = str(tmp_path / "ct")
  _write_ct_dir(dirs["bfloat16"], ct_dir)
  at_load, _ = from_pretrained(dirs["bfloat16"], quant="nvfp4", dtype=jnp.bfloat16, lora_rank=4, seed=seed)
  from_ct, _ = from_pretrained(ct_dir, quant="nvfp4", dtype=jnp.bfloat16, lora_rank=4, seed=seed)
  for a, b in zip(jax.tree.leaves(at_load.params()), jax.tree.leaves(from_ct.params())):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  q = at_load.layers.q_proj.weight.get_value()
  assert isinstance(q, quant.NVFP4Tensor) and q.global_scale.shape == (2, 1)
  np.testing.assert_array_equal(q.global_scale, at_load.layers.v_proj.weight.get_value().global_scale)
  tokens = jnp.asarray(tokens)
  np.testing.assert_array_equal(np.asarray(at_load(tokens)), np.asarray(from_ct(tokens)))
  bf16, _ = from_pretrained(ct_dir, quant="bf16", dtype=jnp.bfloat16, lora_rank=None)  # dequantized on load
  np.testing.assert_array_equal(np.asarray(bf16.layers.q_proj.weight.get_value()[1]),
                                np.asarray(quant.dequantize(jax.tree.map(lambda x: x[1], q), jnp.bfloat16)))


def test_merged_nvfp4_checkpoint_decompresses_in_compressed_tensors_to_our_weights(tiny_qwen2, tmp_path):
  dirs, tokens, seed = tiny_qwen2
  model, _ = from_pretrained(dirs["bfloat16"], quant="nvfp4", dtype=jnp.bfloat16, lora_rank=4)
  _randomize_adapters(model, seed)
  save_merged(model, str(tmp_path), scheme="nvfp4")
  cfg = json.load(open(tmp_path / "config.json"))["quantization_config"]
  assert cfg["format"] == "nvfp4-pack-quantized" and cfg["ignore"] == ["lm_head"]
  ours, _ = from_pretrained(str(tmp_path), quant="nvfp4", dtype=jnp.bfloat16, lora_rank=None)
  hf = transformers.AutoModelForCausalLM.from_pretrained(
    str(tmp_path), dtype=torch.bfloat16,
    quantization_config=transformers.CompressedTensorsConfig(run_compressed=False)).eval()
  for layer in range(2):
    for name in TARGETS:
      path = f"model.layers.{layer}.{'self_attn' if name in TARGETS[:4] else 'mlp'}.{name}.weight"
      theirs = hf.get_parameter(path).detach().float().numpy()
      mine = np.asarray(merged_weight(ours, name, layer)).T
      np.testing.assert_array_equal(mine.astype(jnp.bfloat16).astype(np.float32), theirs, err_msg=path)
  # The merged NVFP4 weights are the NVFP4 rounding of the merged float weights.
  merged = np.asarray(merged_weight(model, "down_proj", 0))
  requant = np.asarray(merged_weight(ours, "down_proj", 0))
  rel = np.linalg.norm(requant - merged) / np.linalg.norm(merged)
  assert 1e-3 < rel < 0.2, rel
  # Logits: ours (bf16) err no more than transformers' bf16 forward, against float32 arithmetic.
  ref_bf16 = hf_logits(hf, tokens)
  exact = hf_logits(hf.to(torch.float32), tokens)
  out = np.asarray(ours(jnp.asarray(tokens)))
  err, theirs = (np.linalg.norm(x - exact) / np.linalg.norm(exact) for x in (out, ref_bf16))
  assert err < 2 * theirs + 1e-3, f"{seed=} ours {err} vs transformers bf16 {theirs}"
