"""GGUF: the real SmolLM2-135M-Instruct file against transformers loading the same file; bad GGUF input."""

import functools
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from qerl_jax.assets import smollm2_gguf_path
from qerl_jax.model.gguf_io import unpermute_rows
from qerl_jax.model.loading import from_pretrained
from qerl_jax.model.testing import fresh_seed, hf_logits

PROMPTS = [
  "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many",
  "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
  "The capital of France is Paris, and the capital of Germany is Berlin. Both cities are known for their",
]


@pytest.fixture(scope="module")
def smollm2():
  """The real SmolLM2 GGUF loaded by both sides in float32 (shared: each load takes seconds).

  While loading, the gguf package's file parse and its tensor-name table are memoized: transformers parses the file
  twice and builds the table once per tensor (397 times); setup 44-60 -> 22-23 s on this project's 2-core machine.
  Both are functions of their arguments alone, so each side still reads the file through the gguf package."""
  import gguf  # pylint: disable=import-outside-toplevel
  path = smollm2_gguf_path()
  with pytest.MonkeyPatch.context() as patch:
    for name in ("GGUFReader", "get_tensor_name_map"):
      patch.setattr(gguf, name, functools.lru_cache(maxsize=None)(getattr(gguf, name)))
    model, tokenizer = from_pretrained(path, quant="bf16", dtype=jnp.float32, lora_rank=None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
  return model, tokenizer, hf


def test_smollm2_gguf_top1_agrees_with_transformers(smollm2):
  model, tokenizer, hf = smollm2
  assert model.config.arch == "llama" and model.config.num_layers == 30 and model.config.tie_word_embeddings
  assert model.config.num_kv_heads == 3 and model.config.rope_theta == 100000.0
  agree, total = 0, 0
  for prompt in PROMPTS:
    ids = np.asarray(tokenizer(prompt)["input_ids"])[None]
    assert 20 <= ids.shape[1] <= 40
    ref = hf_logits(hf, ids)
    out = np.asarray(model(jnp.asarray(ids)))
    agree += int((out.argmax(-1) == ref.argmax(-1)).sum())
    total += ids.shape[1]
    # Same dequantized weights, float32 on both sides: far tighter than the top-1 criterion.
    assert np.abs(out - ref).max() < 1e-3 * np.abs(ref).max(), prompt
  assert agree / total >= 0.99, f"top-1 agreement {agree}/{total}"


CHATS = [
  [{"role": "user", "content": "What is 12 + 30? Answer with a number."}],
  [{"role": "user", "content": "Write one sentence about the sea."}],
  [{"role": "user", "content": "List three colors."}],
]


def test_smollm2_greedy_generation_matches_transformers(smollm2):
  """The rollout engine's greedy decode (KV cache, left padding of a batch) == transformers' generate."""
  import qerl_jax  # pylint: disable=import-outside-toplevel
  model, tokenizer, hf = smollm2
  outs = qerl_jax.generate(model, tokenizer, CHATS, max_new_tokens=32, temperature=0, stop_token_ids=())
  for chat, out in zip(CHATS, outs):
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.no_grad():
      ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(ids):].tolist()
    assert out.token_ids == ref, (tokenizer.decode(out.token_ids), tokenizer.decode(ref))


def test_stop_string_cut_with_the_real_tokenizer(smollm2):
  """A stop string that starts inside one BPE token and ends inside the next: the text stops before it, the
  tokens run through the one that completed it."""
  from qerl_jax.rollout.generate import cut_at_stop_string  # pylint: disable=import-outside-toplevel
  _, tokenizer, _ = smollm2
  ids = list(tokenizer("The sea is calm tonight. Waves roll in slowly.", add_special_tokens=False)["input_ids"])
  kept, text, stop = cut_at_stop_string(tokenizer, ids, [" slowly", ". Wav"])
  assert (text, stop) == ("The sea is calm tonight", ". Wav")
  assert ". Wav" in tokenizer.decode(ids[:kept]) and ". Wav" not in tokenizer.decode(ids[:kept - 1])
  assert kept < len(ids)
  assert cut_at_stop_string(tokenizer, ids, ["storm"]) is None


def test_unpermute_rows_inverts_the_llama_cpp_permutation():
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  for heads, head_dim in ((4, 8), (3, 64)):
    w = rng.standard_normal((heads * head_dim, 5)).astype(np.float32)
    # llama.cpp's convert script: per head, rows (half, pair) -> (pair, half).
    permuted = w.reshape(heads, 2, head_dim // 2, 5).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rows(permuted, heads), w, err_msg=f"{seed=}")


def _write_gguf(path, arch="llama", weight_type=None):
  """A tiny GGUF with one layer; `weight_type` sets the quant type of attn_q (raw bytes)."""
  import gguf
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(1)
  writer.add_context_length(64)
  writer.add_embedding_length(32)
  writer.add_feed_forward_length(64)
  writer.add_head_count(2)
  writer.add_head_count_kv(2)
  writer.add_layer_norm_rms_eps(1e-6)
  writer.add_rope_freq_base(10000.0)
  rng = np.random.default_rng(0)
  shapes = {"token_embd.weight": (16, 32), "output_norm.weight": (32,), "blk.0.attn_norm.weight": (32,),
            "blk.0.ffn_norm.weight": (32,), "blk.0.attn_q.weight": (32, 32), "blk.0.attn_k.weight": (32, 32),
            "blk.0.attn_v.weight": (32, 32), "blk.0.attn_output.weight": (32, 32),
            "blk.0.ffn_gate.weight": (64, 32), "blk.0.ffn_up.weight": (64, 32), "blk.0.ffn_down.weight": (32, 64)}
  for name, shape in shapes.items():
    if name == "blk.0.attn_q.weight" and weight_type is not None:
      block, nbytes = gguf.GGML_QUANT_SIZES[weight_type]
      raw = rng.integers(0, 255, (shape[0], shape[1] // block * nbytes), dtype=np.uint8)
      writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=weight_type)
    else:
      writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def test_gguf_unsupported_quant_type_and_architecture_are_clear_errors(tmp_path):
  import gguf
  good = tmp_path / "good.gguf"
  _write_gguf(good)
  model, _ = from_pretrained(str(good), quant="bf16", dtype=jnp.float32, lora_rank=None, load_tokenizer=False)
  assert model.config.vocab_size == 16 and model.config.tie_word_embeddings
  bad = tmp_path / "q8_1.gguf"
  _write_gguf(bad, weight_type=gguf.GGMLQuantizationType.Q8_1)  # gguf-py has no Q8_1 dequantizer
  with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight.*Q8_1"):
    from_pretrained(str(bad), quant="bf16", lora_rank=None, load_tokenizer=False)
  other = tmp_path / "gpt2.gguf"
  _write_gguf(other, arch="gpt2")
  with pytest.raises(ValueError, match="unsupported GGUF architecture arch='gpt2'"):
    from_pretrained(str(other), quant="bf16", lora_rank=None, load_tokenizer=False)


def test_gguf_tokenizer_cache_round_trips_and_follows_the_file(tmp_path, monkeypatch):
  """The converted GGUF tokenizer, saved and reloaded from the cache, encodes and templates like the conversion
  itself; a touched file (new mtime) is converted afresh."""
  import shutil  # pylint: disable=import-outside-toplevel
  from qerl_jax.model.tokenizer import gguf_cache_dir, load_gguf_tokenizer  # pylint: disable=import-outside-toplevel
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  gguf = tmp_path / "smollm2.gguf"
  shutil.copyfile(smollm2_gguf_path(), gguf)
  converted = load_gguf_tokenizer(str(gguf))
  cache = gguf_cache_dir(str(gguf))
  assert os.path.isfile(os.path.join(cache, "tokenizer_config.json"))
  assert not [p for p in os.listdir(os.path.dirname(cache)) if ".tmp-" in p]  # no half-written copy left
  cached = load_gguf_tokenizer(str(gguf))
  assert os.path.abspath(cached.name_or_path) == os.path.abspath(cache)  # read from the cache, not converted
  rng = np.random.default_rng(fresh_seed())
  words = ["the", " sea", "Ünïcode", "12345", "3.14", "\n\n", "  ", "def f(x):", "é", "日本", "<|im_end|>", "?!"]
  for _ in range(20):
    text = "".join(rng.choice(words, size=rng.integers(1, 30)))
    assert cached(text)["input_ids"] == converted(text)["input_ids"], text
    chat = [{"role": "user", "content": text}]
    assert (cached.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == converted.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
  ids = rng.integers(0, converted.vocab_size, size=200).tolist()
  assert cached.decode(ids) == converted.decode(ids)
  assert (cached.eos_token_id, cached.bos_token_id) == (converted.eos_token_id, converted.bos_token_id)
  os.utime(gguf, ns=(os.stat(gguf).st_atime_ns, os.stat(gguf).st_mtime_ns + 10**9))
  assert gguf_cache_dir(str(gguf)) != cache


def test_gguf_tokenizer_of_a_missing_file_names_it(tmp_path):
  from qerl_jax.model.tokenizer import load_gguf_tokenizer  # pylint: disable=import-outside-toplevel
  with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
    load_gguf_tokenizer(str(tmp_path / "nowhere.gguf"))
