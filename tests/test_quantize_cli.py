"""python -m qerl_jax.quantize on tiny random transformers checkpoints, checked against compressed-tensors."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

from qerl_jax import quant
from qerl_jax import quantize as cli
from qerl_jax.quant import checkpoint
from qerl_jax.quant.safetensors_io import SafetensorsFile, TensorSpec, write_file
from test_quant_ct_reference import ct_decompress, ct_global_scale, ct_mxfp4, ct_nvfp4

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
EXTRA_FILES = {"tokenizer_config.json": '{"model_max_length": 64}', "tokenizer.json": "{}",
               "chat_template.jinja": "{{ messages }}"}


def _fresh_seed() -> int:
  return int.from_bytes(os.urandom(4), "little")


def _make_model(path, config_cls, seed, max_shard_size=None, **overrides):
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config_cls(**{**TINY, **overrides}))
  kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
  model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True, **kwargs)
  for name, text in EXTRA_FILES.items():
    with open(os.path.join(path, name), "w") as f:
      f.write(text)
  return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _read_all(out_dir):
  return dict(checkpoint.iter_ct_checkpoint(out_dir))


def _leftovers(parent, stem):
  return [e for e in os.listdir(parent) if e.startswith(f".{stem}.")]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  seed = _fresh_seed()
  path = str(tmp_path_factory.mktemp("llama") / "model")
  return path, _make_model(path, transformers.LlamaConfig, seed), seed


def test_nvfp4_checkpoint_matches_compressed_tensors(llama, tmp_path):
  model_dir, state, seed = llama
  out = str(tmp_path / "out")
  assert cli.main(["--model", model_dir, "--out", out, "--no-progress"]) == 0
  cfg = json.load(open(os.path.join(out, "config.json")))
  assert cfg["quantization_config"] == checkpoint.quantization_config("nvfp4", ["lm_head"])
  assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 16
  assert cfg["architectures"] == ["LlamaForCausalLM"]
  for name, text in EXTRA_FILES.items():
    assert open(os.path.join(out, name)).read() == text
  got = _read_all(out)
  quantized = [n for n in got if isinstance(got[n], quant.NVFP4Tensor)]
  assert len(quantized) == 7 * TINY["num_hidden_layers"]
  for layer in range(TINY["num_hidden_layers"]):
    p = f"model.layers.{layer}."
    groups = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
              ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
    for group in groups:
      gs = torch.min(torch.cat([ct_global_scale(state[f"{p}{m}.weight"]) for m in group])).reshape(1)
      for m in group:
        ref = ct_nvfp4(state[f"{p}{m}.weight"], gs=gs)
        mine = quant.to_ct_tensors(got[f"{p}{m}.weight"])
        for key in ref:
          np.testing.assert_array_equal(mine[key].view(np.uint8), ref[key].view(np.uint8),
                                        err_msg=f"{seed=} {p}{m}.{key}")
  for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
               "model.layers.1.input_layernorm.weight"):
    want = state[name].view(torch.uint16).numpy()
    np.testing.assert_array_equal(np.asarray(got[name]).view(np.uint16), want, err_msg=name)
  assert not _leftovers(str(tmp_path), "out")


def test_output_loads_through_transformers_and_compressed_tensors(llama, tmp_path):
  model_dir, _, seed = llama
  out = str(tmp_path / "out")
  assert cli.main(["--model", model_dir, "--out", out, "--no-progress"]) == 0
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
    out, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False),
    dtype=torch.bfloat16, output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  got = _read_all(out)
  for name in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
    ecosystem = model.get_submodule(name).weight.detach().float().numpy()
    mine = np.asarray(quant.dequantize_NxK(got[f"{name}.weight"], jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(mine, ecosystem, err_msg=f"{seed=} {name}")


def test_sharded_qwen2_to_mxfp4_sharded_output(tmp_path):
  seed = _fresh_seed()
  model_dir = str(tmp_path / "qwen")
  state = _make_model(model_dir, transformers.Qwen2Config, seed, max_shard_size="40KB",
                      tie_word_embeddings=False)
  assert os.path.exists(os.path.join(model_dir, "model.safetensors.index.json"))
  out = str(tmp_path / "out")
  rc = cli.main(["--model", model_dir, "--out", out, "--scheme", "mxfp4", "--ignore", "lm_head",
                 "re:.*\\.1\\.mlp\\.down_proj", "--max-shard-size", str(50e3 / 1024**3),
                 "--no-progress"])
  assert rc == 0
  index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
  assert len(set(index["weight_map"].values())) > 1
  cfg = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
  assert cfg["format"] == "mxfp4-pack-quantized" and cfg["ignore"][1] == "re:.*\\.1\\.mlp\\.down_proj"
  assert cfg["config_groups"]["group_0"]["weights"]["group_size"] == 32
  got = _read_all(out)
  # The ignored layer stays bf16 under its own name; Qwen2's q/k/v biases are copied.
  np.testing.assert_array_equal(np.asarray(got["model.layers.1.mlp.down_proj.weight"]).view(np.uint16),
                                state["model.layers.1.mlp.down_proj.weight"].view(torch.uint16).numpy())
  np.testing.assert_array_equal(np.asarray(got["model.layers.0.self_attn.q_proj.bias"]).view(np.uint16),
                                state["model.layers.0.self_attn.q_proj.bias"].view(torch.uint16).numpy())
  for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj",
               "model.layers.1.self_attn.o_proj", "model.layers.0.mlp.down_proj"):
    ref = ct_mxfp4(state[f"{name}.weight"])
    mine = quant.to_ct_tensors(got[f"{name}.weight"])
    for key in ref:
      np.testing.assert_array_equal(mine[key], ref[key], err_msg=f"{seed=} {name}.{key}")
    np.testing.assert_array_equal(
      np.asarray(quant.dequantize_NxK(got[f"{name}.weight"]).astype(jnp.float32)),
      ct_decompress(ref, "mxfp4"), err_msg=f"{seed=} {name}")


def test_reader_keeps_w4a4_input_global_scale(llama, tmp_path):
  model_dir, _, _ = llama
  out = str(tmp_path / "out")
  assert cli.main(["--model", model_dir, "--out", out, "--no-progress"]) == 0
  # Add an input_global_scale as the W4A4 "NVFP4" scheme stores it, and a newer-CT config.
  path = os.path.join(out, "model.safetensors")
  st = SafetensorsFile(path)
  arrays = {n: np.array(st.get(n)) for n in st.keys()}
  arrays["model.layers.0.self_attn.q_proj.input_global_scale"] = np.array([123.5], np.float32)
  del st
  write_file(path, [TensorSpec(n, a.dtype, a.shape, lambda a=a: a) for n, a in arrays.items()])
  cfg_path = os.path.join(out, "config.json")
  cfg = json.load(open(cfg_path))
  cfg["quantization_config"]["config_groups"]["group_0"]["weights"].update(
    scale_dtype="torch.float8_e4m3fn", zp_dtype="torch.float8_e4m3fn")
  json.dump(cfg, open(cfg_path, "w"))
  got = _read_all(out)
  assert got["model.layers.0.self_attn.q_proj.input_global_scale"].tolist() == [123.5]
  q = got["model.layers.0.self_attn.q_proj.weight"]
  assert isinstance(q, quant.NVFP4Tensor) and q.shape == (64, 64)
  assert np.asarray(q.scale_NxKb).dtype == ml_dtypes.float8_e4m3fn


def _bad_case(tmp_path, case):
  """(argv, expected message fragment) for one kind of bad input."""
  model_dir = str(tmp_path / "model")
  out = str(tmp_path / "out")
  seed = _fresh_seed()
  if case == "missing_dir":
    return ["--model", str(tmp_path / "nope"), "--out", out], "does not exist"
  if case == "k_not_divisible":
    _make_model(model_dir, transformers.LlamaConfig, seed, intermediate_size=72)
    return ["--model", model_dir, "--out", out], "model.layers.0.mlp.down_proj"
  _make_model(model_dir, transformers.LlamaConfig, seed)
  if case == "no_config":
    os.remove(os.path.join(model_dir, "config.json"))
    return ["--model", model_dir, "--out", out], "config.json not found"
  if case == "architecture":
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(os.path.join(model_dir, "config.json"), "w"))
    return ["--model", model_dir, "--out", out], "unsupported architecture"
  if case == "truncated":
    path = os.path.join(model_dir, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 100)
    return ["--model", model_dir, "--out", out], "truncated"
  if case in ("nan", "inf_in_norm"):
    path = os.path.join(model_dir, "model.safetensors")
    st = SafetensorsFile(path)
    arrays = {n: np.array(st.get(n)) for n in st.keys()}
    del st
    bad = ("model.layers.1.mlp.up_proj.weight" if case == "nan"
           else "model.layers.1.post_attention_layernorm.weight")
    arrays[bad].reshape(-1)[5] = np.nan if case == "nan" else np.inf
    write_file(path, [TensorSpec(n, a.dtype, a.shape, lambda a=a: a) for n, a in arrays.items()])
    return ["--model", model_dir, "--out", out], bad
  if case == "out_exists":
    os.makedirs(out)
    return ["--model", model_dir, "--out", out], "already exists"
  raise AssertionError(case)


@pytest.mark.parametrize("case", ["missing_dir", "no_config", "architecture", "truncated", "nan",
                                  "inf_in_norm", "k_not_divisible", "out_exists"])
def test_bad_input_gives_message_and_no_output(tmp_path, capsys, case):
  argv, fragment = _bad_case(tmp_path, case)
  capsys.readouterr()  # drop what building the model printed
  assert cli.main(argv + ["--no-progress"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and fragment in err, err
  if case == "k_not_divisible":
    assert "--ignore" in err
  if case == "out_exists":
    assert os.listdir(tmp_path / "out") == []  # untouched
  else:
    assert not os.path.exists(tmp_path / "out")
  assert not _leftovers(str(tmp_path), "out")


def test_k_not_divisible_succeeds_when_ignored(tmp_path):
  model_dir = str(tmp_path / "model")
  _make_model(model_dir, transformers.LlamaConfig, _fresh_seed(), intermediate_size=72)
  out = str(tmp_path / "out")
  assert cli.main(["--model", model_dir, "--out", out, "--ignore", "lm_head", "re:.*down_proj",
                   "--no-progress"]) == 0
  got = _read_all(out)
  assert isinstance(got["model.layers.0.mlp.up_proj.weight"], quant.NVFP4Tensor)
  assert got["model.layers.0.mlp.down_proj.weight"].shape == (64, 72)
  # A failing --overwrite run (down_proj no longer ignored) leaves the previous output intact.
  assert cli.main(["--model", model_dir, "--out", out, "--scheme", "nvfp4", "--overwrite",
                   "--no-progress"]) == 2
  assert isinstance(_read_all(out)["model.layers.0.mlp.up_proj.weight"], quant.NVFP4Tensor)
  assert not _leftovers(str(tmp_path), "out")


def test_module_entry_point_exit_code_and_stderr(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "qerl_jax.quantize", "--model", str(tmp_path / "none"),
                         "--out", str(tmp_path / "out")], capture_output=True, text=True,
                        cwd=str(tmp_path), timeout=120)
  assert proc.returncode == 2
  assert "error:" in proc.stderr and "does not exist" in proc.stderr
  assert "Traceback" not in proc.stderr
