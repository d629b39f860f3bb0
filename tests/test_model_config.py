"""ModelConfig from HF configs and GGUF metadata, RoPE frequencies vs transformers, LoRA init and targets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_jax.model import LoraConfig, ModelConfig
from qerl_jax.model.config import rope_inv_freq
from qerl_jax.model.linear import PROJ_NAMES, init_lora, resolve_targets
from qerl_jax.model.testing import fresh_seed, tiny_hf_config

ROPES = {
  "default": None,
  "linear": {"rope_type": "linear", "factor": 2.5},
  "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 64},
  "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
  "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16,
                  "beta_slow": 2, "mscale": 0.7, "mscale_all_dim": 0.9},
}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_rope_frequencies_match_transformers(name):
  import torch
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  hf = tiny_hf_config("qwen3", rope_scaling=ROPES[name], rope_theta=50000.0, head_dim=32)
  config = ModelConfig.from_hf(hf)
  inv, scale = rope_inv_freq(config)
  if ROPES[name] is None:
    dim = 32
    ref = 1.0 / (50000.0 ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    ref_scale = 1.0
  else:
    ref, ref_scale = ROPE_INIT_FUNCTIONS[ROPES[name]["rope_type"]](hf, "cpu")
  np.testing.assert_allclose(inv, ref.numpy(), rtol=1e-6)
  assert scale == pytest.approx(ref_scale, rel=1e-6)


def test_from_hf_reads_each_family():
  llama = ModelConfig.from_hf(tiny_hf_config("llama"))
  assert (llama.arch, llama.qkv_bias, llama.o_bias, llama.mlp_bias, llama.qk_norm) == ("llama", True, True, True, False)
  assert llama.rope_theta == 500000.0 and dict(llama.rope_scaling)["rope_type"] == "llama3"
  qwen2 = ModelConfig.from_hf(tiny_hf_config("qwen2").to_dict())
  assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.tie_word_embeddings, qwen2.head_dim) == (True, False, True, 16)
  qwen3 = ModelConfig.from_hf(tiny_hf_config("qwen3"), dtype="float32", remat=True)
  assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.head_dim, qwen3.num_kv_heads) == (True, False, 32, 2)
  assert qwen3.dtype == jnp.float32 and qwen3.remat
  # The 4.x layout (rope_theta + rope_scaling with "type") reads the same.
  old = {**tiny_hf_config("llama").to_dict(), "rope_theta": 1234.0,
         "rope_scaling": {"type": "linear", "factor": 2.0}}
  old.pop("rope_parameters", None)
  cfg = ModelConfig.from_hf(old)
  assert cfg.rope_theta == 1234.0 and cfg.rope_scaling_dict == {"rope_type": "linear", "factor": 2.0}
  hash(cfg)  # static under jit
  again = ModelConfig.from_hf(qwen3.to_hf_dict(), dtype="float32", remat=True)
  assert again.replace(hf_config_json="") == qwen3.replace(hf_config_json="")


def test_from_gguf_metadata():
  meta = {"general.architecture": "qwen2", "qwen2.block_count": 3, "qwen2.context_length": 4096,
          "qwen2.embedding_length": 128, "qwen2.feed_forward_length": 256, "qwen2.attention.head_count": 4,
          "qwen2.attention.head_count_kv": 2, "qwen2.rope.freq_base": 1e6,
          "qwen2.attention.layer_norm_rms_epsilon": 1e-6, "tokenizer.ggml.tokens.count": 300,
          "tokenizer.ggml.eos_token_id": 7}
  cfg = ModelConfig.from_gguf_metadata(meta, tied=True)
  assert (cfg.vocab_size, cfg.num_layers, cfg.head_dim, cfg.qkv_bias, cfg.eos_token_ids) == (300, 3, 32, True, (7,))
  with pytest.raises(ValueError, match="lacks 'qwen2.block_count'"):
    ModelConfig.from_gguf_metadata({k: v for k, v in meta.items() if k != "qwen2.block_count"}, tied=True)


def test_lora_init_is_peft_like_and_scale():
  seed = fresh_seed()
  cfg = LoraConfig(rank=8, alpha=32)
  a, b = init_lora(jax.random.key(seed), 3, 256, 48, cfg)
  a = np.asarray(a)
  assert a.shape == (3, 256, 8) and b.shape == (3, 8, 48) and not np.asarray(b).any()
  bound = 1 / np.sqrt(256)
  assert np.abs(a).max() <= bound and np.abs(a).max() > 0.95 * bound, seed
  assert np.std(a) == pytest.approx(bound / np.sqrt(3), rel=0.05), seed  # uniform(-bound, bound)
  assert len({float(a[i, 0, 0]) for i in range(3)}) == 3  # layers differ
  assert cfg.scale == 4.0 and LoraConfig(rank=16, alpha=16, use_rslora=True).scale == 4.0
  assert LoraConfig(dtype="bfloat16").dtype == jnp.bfloat16


def test_lora_targets():
  assert resolve_targets("all-linear") == PROJ_NAMES
  assert resolve_targets("q_proj|v_proj") == ("q_proj", "v_proj")
  assert resolve_targets("self_attn") == ("q_proj", "k_proj", "v_proj", "o_proj")
  assert resolve_targets(["down_proj", "gate_proj"]) == ("gate_proj", "down_proj")
  assert resolve_targets(r"mlp\.(up|down)") == ("up_proj", "down_proj")
  for bad in ("embed_tokens", ["q_proj", "lm_head"], []):
    with pytest.raises(ValueError):
      resolve_targets(bad)
