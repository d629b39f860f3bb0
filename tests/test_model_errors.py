"""Bad input fails early with an error that names the problem."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from qerl_jax.model import LoraConfig, ModelConfig
from qerl_jax.model.export import load_peft_adapter, save_peft_adapter
from qerl_jax.model.loading import from_pretrained
from qerl_jax.model.safetensors_io import SafetensorsDir
from qerl_jax.model.testing import fresh_seed, save_tiny_hf, tiny_hf_config


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("llama") / "model")
  save_tiny_hf("llama", path, fresh_seed(), "float32")
  return path


def _copy_with(src, dst, *, drop=(), replace=None, config=None):
  """A copy of checkpoint `src` without the tensors in `drop`, with `replace` tensors and config edits."""
  os.makedirs(dst)
  source = SafetensorsDir(src)
  tensors = {k: source.get(k) for k in source.keys() if k not in drop}
  tensors.update(replace or {})
  save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
  cfg = json.load(open(os.path.join(src, "config.json")))
  cfg.update(config or {})
  json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
  return dst


def test_unknown_architecture(tiny_llama, tmp_path):
  path = _copy_with(tiny_llama, str(tmp_path / "m"), config={"model_type": "gpt2"})
  with pytest.raises(ValueError, match="unsupported architecture model_type='gpt2'"):
    from_pretrained(path, quant="bf16")
  with pytest.raises(ValueError, match="unsupported rope_type='longrope'"):
    ModelConfig.from_hf({**tiny_hf_config("qwen2").to_dict(), "rope_parameters": {"rope_type": "longrope"}})
  with pytest.raises(ValueError, match="hidden_act='gelu'"):
    ModelConfig.from_hf({**tiny_hf_config("qwen2").to_dict(), "hidden_act": "gelu"})


def test_missing_tensor(tiny_llama, tmp_path):
  path = _copy_with(tiny_llama, str(tmp_path / "m"), drop={"model.layers.1.mlp.up_proj.weight"})
  with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
    from_pretrained(path, quant="nvfp4")


def test_shape_mismatch(tiny_llama, tmp_path):
  path = _copy_with(tiny_llama, str(tmp_path / "m"), config={"intermediate_size": 96})
  with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \(128, 64\), "
                                       r"expected \(96, 64\)"):
    from_pretrained(path, quant="nvfp4")


def test_nan_weight_is_refused_when_quantizing(tiny_llama, tmp_path):
  w = SafetensorsDir(tiny_llama).get("model.layers.0.self_attn.k_proj.weight").copy()
  w[3, 5] = np.nan
  path = _copy_with(tiny_llama, str(tmp_path / "m"), replace={"model.layers.0.self_attn.k_proj.weight": w})
  with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight contains NaN or Inf"):
    from_pretrained(path, quant="nvfp4")


def test_lora_target_that_matches_nothing_and_bad_options(tiny_llama, tmp_path):
  with pytest.raises(ValueError, match="lora target 'lm_head' matches none of the projections"):
    from_pretrained(tiny_llama, quant="bf16", lora_targets="lm_head")
  with pytest.raises(ValueError, match="lora target 'qproj' matches none"):
    LoraConfig(targets=["q_proj", "qproj"])
  with pytest.raises(ValueError, match="unknown quant='int8'"):
    from_pretrained(tiny_llama, quant="int8")
  with pytest.raises(FileNotFoundError, match="does not exist"):
    from_pretrained(str(tmp_path / "nowhere"), quant="bf16")
  not_a_model = tmp_path / "empty"
  not_a_model.mkdir()
  with pytest.raises(FileNotFoundError, match="no config.json"):
    from_pretrained(str(not_a_model), quant="bf16")


def test_compressed_tensors_dir_is_not_requantized(tiny_llama, tmp_path):
  # Only the layout matters before the scheme check: give q_proj of layer 0 packed tensors.
  w = SafetensorsDir(tiny_llama).get("model.layers.0.self_attn.q_proj.weight")
  ct = {"model.layers.0.self_attn.q_proj.weight_packed": np.zeros((w.shape[0], w.shape[1] // 2), np.uint8)}
  path = _copy_with(tiny_llama, str(tmp_path / "m"), replace=ct, config={"quantization_config": {
    "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed"}})
  with pytest.raises(ValueError, match="would re-quantize it"):
    from_pretrained(path, quant="mxfp4")
  gptq = _copy_with(tiny_llama, str(tmp_path / "g"), config={"quantization_config": {"quant_method": "gptq"}})
  with pytest.raises(ValueError, match="quant_method='gptq'"):
    from_pretrained(gptq, quant="bf16")


def test_peft_adapter_for_another_shape_is_rejected(tiny_llama, tmp_path):
  model, _ = from_pretrained(tiny_llama, quant="bf16", dtype=jnp.float32, lora_rank=4, lora_targets="q_proj")
  save_peft_adapter(model, str(tmp_path / "a"))
  cfg_path = tmp_path / "a" / "adapter_config.json"
  cfg = json.load(open(cfg_path))
  json.dump({**cfg, "r": 8}, open(cfg_path, "w"))
  with pytest.raises(ValueError, match=r"lora_A \(4, 64\).*expected \(8, 64\)"):
    load_peft_adapter(model, str(tmp_path / "a"))
  json.dump({**cfg, "use_dora": True}, open(cfg_path, "w"))
  with pytest.raises(ValueError, match="use_dora=True"):
    load_peft_adapter(model, str(tmp_path / "a"))
