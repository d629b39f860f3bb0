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
  # What stopped it, as vLLM reports it: the stop string, or the id from ``stop_token_ids`` (None for the
  # default end-of-sequence ids and for "length").
  stop_reason: int | str | None = None


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


def stop_strings(stop) -> tuple[str, ...]:
  """``stop`` (None, one string or a sequence of them) as a tuple of non-empty strings."""
  stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
  bad = [s for s in stops if not isinstance(s, str) or not s]
  if bad:
    raise ValueError(f"stop strings must be non-empty strings, got {bad!r}")
  return stops


def cut_at_stop_string(tokenizer, ids: Sequence[int], stops: Sequence[str]):
  """(tokens kept, text, the stop string) for the first stop string in the decoded ``ids``, else None.

  As vLLM does: the text ends before the stop string; the tokens run through the one that completed it. The
  decode loop only knows token ids, so a stop string is found after it, and the tokens it sampled past the
  string are dropped here."""
  text = tokenizer.decode(list(ids), skip_special_tokens=True)
  found = [(text.find(s), s) for s in stops if s in text]
  if not found:
    return None
  at, stop = min(found)
  lo, hi = 1, len(ids)  # the shortest prefix whose text holds the string (prefixes decode to prefixes)
  while lo < hi:
    mid = (lo + hi) // 2
    if stop in tokenizer.decode(list(ids[:mid]), skip_special_tokens=True):
      hi = mid
    else:
      lo = mid + 1
  return lo, text[:at], stop


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
             top_k: int = 0, seed: int = 0, stop_token_ids=None, stop=None, num_samples: int = 1,
             norm_noise=None, max_cache_len: int | None = None) -> list[Completion]:
  """Samples `num_samples` completions of each prompt; returns them prompt-major.

  temperature=0 is greedy. `stop_token_ids` end a row inside the decode loop (default: the tokenizer's EOS
  and chat end markers); `stop` strings (vLLM's) are looked for after the loop, and each completion is cut at
  the first one in its text.
  `norm_noise` (AQN) is added to the RMSNorm scales for this call only.
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
  stops = stop_strings(stop)
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
  explicit = set(stop_token_ids) if stop_token_ids is not None else set()
  completions = []
  for row, (p, s) in enumerate(rows):
    n = int(out.lengths_B[row])
    ids = [int(t) for t in out.tokens_BxN[row, :n]]
    finished = bool(out.finished_B[row])
    reason = ids[-1] if finished and ids and ids[-1] in explicit else None
    cut = cut_at_stop_string(tokenizer, ids, stops) if stops else None
    if cut is None:
      text = tokenizer.decode(ids, skip_special_tokens=True)
    else:
      n, text, reason = cut
      finished = True
    completions.append(Completion(
      prompt_index=p, sample_index=s, token_ids=ids[:n], logprobs=[float(x) for x in out.logprobs_BxN[row, :n]],
      text=text, finish_reason="stop" if finished else "length", stop_reason=reason))
  return completions
