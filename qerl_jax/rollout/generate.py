"""`qerl_jax.generate`: notebook-friendly generation on top of the jitted rollout.

Prompts may be strings, chat message lists (run through the tokenizer's chat template) or token-id lists.
Batches and prompt lengths are padded up to buckets, so repeated calls with similar inputs reuse the same
compiled program.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from qerl_jax.rollout.engine import rollout
from qerl_jax.rollout.sampling import SamplingParams

PROMPT_BUCKET = 64  # prompt lengths are padded up to a multiple of this


@dataclasses.dataclass
class Completion:
  prompt_index: int
  sample_index: int
  token_ids: list[int]
  logprobs: list[float]
  text: str
  finish_reason: str  # "stop" or "length"


def bucket_batch(n: int) -> int:
  """Smallest power of two >= n: a few batch shapes cover every call."""
  return 1 << max(0, (n - 1).bit_length())


def bucket_length(n: int, multiple: int = PROMPT_BUCKET) -> int:
  return -(-n // multiple) * multiple


def default_stop_ids(tokenizer) -> tuple[int, ...]:
  """EOS plus the chat end markers of the ChatML/Qwen family when the vocabulary has them."""
  ids = set()
  if getattr(tokenizer, "eos_token_id", None) is not None:
    ids.add(int(tokenizer.eos_token_id))
  vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
  for marker in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
    if marker in vocab:
      ids.add(int(vocab[marker]))
  return tuple(sorted(ids))


def encode_prompt(tokenizer, prompt: Any) -> list[int]:
  if isinstance(prompt, str):
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
  if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
    ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
      ids = ids["input_ids"]
    return [int(t) for t in ids]
  if isinstance(prompt, (list, tuple, np.ndarray)):
    return [int(t) for t in prompt]
  raise TypeError(f"a prompt must be a string, a list of chat messages or a list of token ids, got "
                  f"{type(prompt).__name__}")


def left_pad(prompts: Sequence[Sequence[int]], batch: int, length: int, pad_id: int):
  """int32 [batch, length] ids and bool validity, each prompt right-aligned; extra rows are 1-token dummies."""
  tokens = np.full((batch, length), pad_id, np.int32)
  valid = np.zeros((batch, length), bool)
  for row, ids in enumerate(prompts):
    tokens[row, length - len(ids):] = ids
    valid[row, length - len(ids):] = True
  valid[len(prompts):, -1] = True  # filler rows: one valid token so attention is never empty
  return tokens, valid


def generate(model, tokenizer, prompts, *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int = 0, seed: int = 0, stop_token_ids=None, num_samples: int = 1, norm_noise=None,
             max_cache_len: int | None = None) -> list[Completion]:
  """Samples `num_samples` completions of each prompt; returns them prompt-major.

  temperature=0 is greedy. `norm_noise` (AQN) is added to the RMSNorm scales for this call only.
  """
  if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (dict, int, np.integer))):
    prompts = [prompts]  # a single prompt: a string, a chat, or one list of ids
  if not prompts:
    raise ValueError("prompts is empty: pass at least one prompt")
  if max_new_tokens <= 0:
    raise ValueError(f"{max_new_tokens=} must be > 0")
  if num_samples <= 0:
    raise ValueError(f"{num_samples=} must be > 0")
  sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)  # validates
  encoded = [encode_prompt(tokenizer, p) for p in prompts]
  for i, ids in enumerate(encoded):
    if not ids:
      raise ValueError(f"prompt {i} is empty after tokenization")
  longest = max(len(ids) for ids in encoded)
  limit = max_cache_len or getattr(model.config, "max_position_embeddings", None)
  if limit is not None and longest + max_new_tokens > limit:
    raise ValueError(f"prompt of {longest} tokens + {max_new_tokens=} exceeds the cache limit {limit}")
  stop_ids = tuple(stop_token_ids) if stop_token_ids is not None else default_stop_ids(tokenizer)
  pad_id = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else 0

  rows = [(p, s) for p in range(len(encoded)) for s in range(num_samples)]
  batch = bucket_batch(len(rows))
  length = bucket_length(longest)
  if limit is not None:
    length = min(length, limit - max_new_tokens)
  tokens, valid = left_pad([encoded[p] for p, _ in rows], batch, length, pad_id)
  graphdef, state = nnx.split(model)
  out = rollout(graphdef, state, tokens, valid, jax.random.key(seed), norm_noise, sampling=sampling,
                max_new_tokens=max_new_tokens, stop_ids=stop_ids, pad_id=int(pad_id))
  out = jax.device_get(out)
  completions = []
  for row, (p, s) in enumerate(rows):
    n = int(out.lengths_B[row])
    ids = [int(t) for t in out.tokens_BxN[row, :n]]
    completions.append(Completion(
      prompt_index=p, sample_index=s, token_ids=ids,
      logprobs=[float(x) for x in out.logprobs_BxN[row, :n]],
      text=tokenizer.decode(ids, skip_special_tokens=True),
      finish_reason="stop" if bool(out.finished_B[row]) else "length"))
  return completions
