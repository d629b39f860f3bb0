"""Host side of a rollout: pad prompts into a bucketed batch, run the jitted engine in chunks, decode.

Prompt lengths are padded up to a multiple of `prompt_bucket` and the batch is cut into fixed-size
chunks, so a run compiles one rollout program per prompt-length bucket.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from qerl_jax.rollout.engine import rollout
from qerl_jax.rollout.generate import bucket_length, left_pad
from qerl_jax.rollout.sampling import SamplingParams


@dataclasses.dataclass
class Rollouts:
  """Completions of B prompt rows (host numpy), row b continuing prompt row b."""

  prompt_BxP: np.ndarray  # int32, left-padded
  prompt_valid_BxP: np.ndarray  # bool
  completion_BxN: np.ndarray  # int32, pad after the stop token
  logprobs_BxN: np.ndarray  # float32, under the (noisy) sampling policy
  mask_BxN: np.ndarray  # bool, completion tokens incl. the stop token
  lengths_B: np.ndarray  # int32
  finished_B: np.ndarray  # bool, emitted a stop token
  texts: list  # decoded completions (special tokens skipped)
  seconds: float  # wall time of generation and transfer

  @property
  def num_tokens(self) -> int:
    return int(self.lengths_B.sum())


@dataclasses.dataclass
class Pending:
  """Rollout chunks dispatched to the device, not yet read back."""

  outs: list
  prompt_BxP: np.ndarray
  prompt_valid_BxP: np.ndarray
  rows: int
  start: float


def dispatch(graphdef, state, prompts: list[list[int]], *, key, norm_noise, sampling: SamplingParams,
             max_new_tokens: int, stop_ids: tuple[int, ...], pad_id: int, prompt_bucket: int,
             chunk: int = 0, rows_sharding=None) -> Pending:
  """Starts sampling one completion per prompt row (repeat a prompt G times for a group); returns at once.

  chunk: rows per rollout call (0 = all); the batch is padded with filler rows up to a multiple of it, and
  chunk c uses the key fold_in(key, c). rows_sharding: where to place each chunk's prompt rows on a
  multi-device mesh (`qerl_jax.sharding.batch_sharding(mesh, 2)`); the rollout program follows it.
  """
  start = time.perf_counter()
  rows = len(prompts)
  chunk = chunk or rows
  padded_rows = -(-rows // chunk) * chunk
  length = bucket_length(max(len(p) for p in prompts), prompt_bucket)
  tokens, valid = left_pad(prompts, padded_rows, length, pad_id)
  outs = []
  for c in range(padded_rows // chunk):
    sl = slice(c * chunk, (c + 1) * chunk)
    chunk_tokens, chunk_valid = tokens[sl], valid[sl]
    if rows_sharding is not None:
      chunk_tokens, chunk_valid = jax.device_put((chunk_tokens, chunk_valid), rows_sharding)
    outs.append(rollout(graphdef, state, chunk_tokens, chunk_valid, jax.random.fold_in(key, c), norm_noise,
                        sampling=sampling, max_new_tokens=max_new_tokens, stop_ids=stop_ids, pad_id=pad_id))
  return Pending(outs, tokens[:rows], valid[:rows], rows, start)


def collect(pending: Pending, tokenizer) -> Rollouts:
  """Waits for a dispatched rollout, reads it back and decodes the completions."""
  outs = jax.device_get(pending.outs)
  rows = pending.rows
  cat = lambda name: np.concatenate([getattr(o, name) for o in outs])[:rows]  # noqa: E731
  completion, lengths = cat("tokens_BxN"), cat("lengths_B")
  texts = tokenizer.batch_decode([completion[i, :lengths[i]].tolist() for i in range(rows)],
                                 skip_special_tokens=True)
  return Rollouts(
    prompt_BxP=pending.prompt_BxP, prompt_valid_BxP=pending.prompt_valid_BxP, completion_BxN=completion,
    logprobs_BxN=cat("logprobs_BxN"), mask_BxN=cat("mask_BxN"), lengths_B=lengths,
    finished_B=cat("finished_B"), texts=list(texts), seconds=time.perf_counter() - pending.start)


def generate(graphdef, state, prompts: list[list[int]], *, tokenizer, **kwargs) -> Rollouts:
  """`dispatch` then `collect`: the completions of `prompts` (see `dispatch` for the arguments)."""
  return collect(dispatch(graphdef, state, prompts, **kwargs), tokenizer)


def trimmed_length(lengths_B: np.ndarray, max_new_tokens: int, bucket: int) -> int:
  """Columns the update needs: the longest completion rounded up to `bucket`, at most max_new_tokens.

  The rollout's buffers are max_new_tokens wide; when every completion stopped early the update runs on
  fewer columns (a few buckets, so a few compiles, and much less work on long budgets).
  """
  longest = int(lengths_B.max()) if lengths_B.size else 1
  return min(max_new_tokens, max(1, -(-longest // bucket) * bucket))
