"""Datasets from the Hugging Face hub through `datasets`, failing fast and clearly when offline.

`datasets.load_dataset` retries unreachable hosts for a long time before it gives up. Here the hub is
probed first with one short TCP connect, so an offline machine gets a clear error in seconds. Setting
HF_HUB_OFFLINE=1 (or HF_DATASETS_OFFLINE=1) skips the probe and reads the local datasets cache.
"""

import dataclasses
import functools
import os
import socket
import urllib.parse
from typing import Optional

from qerl_jax.data.example import PromptDataset
from qerl_jax.data.local import examples_from_rows, gsm8k_example, math_example

PROBE_TIMEOUT_S = 5.0
BIGMATH_LEVELS = {"3-5": "level_3_4_5", "4-5": "level_4_5", "all": "all"}


def _offline_mode() -> bool:
  return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
             for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_endpoint() -> str:
  """The hub URL: $HF_ENDPOINT or https://huggingface.co."""
  return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def check_hub_reachable(timeout_s: float = PROBE_TIMEOUT_S):
  """Raise ConnectionError (with what to do instead) if the hub's host does not accept a TCP connection."""
  url = urllib.parse.urlparse(hub_endpoint())
  host = url.hostname or ""
  port = url.port or (443 if url.scheme == "https" else 80)
  try:
    with socket.create_connection((host, port), timeout=timeout_s):
      return
  except OSError as e:
    raise ConnectionError(
      f"cannot reach the Hugging Face hub at {hub_endpoint()} ({e.__class__.__name__}: {e}). Offline, "
      "pass path= to a local JSONL copy (GSM8K / MATH-500), use the synthetic arithmetic task, or set "
      "HF_HUB_OFFLINE=1 to read a dataset already in the datasets cache.") from None


def load_hub_rows(name: str, config: Optional[str], split: str):
  """Rows of a hub dataset split (an iterable of dicts), after the reachability probe."""
  if not _offline_mode():
    check_hub_reachable()
  import datasets  # imported lazily: slow, and not needed offline
  try:
    return datasets.load_dataset(name, config, split=split)
  except Exception as e:
    raise RuntimeError(f"datasets.load_dataset({name!r}, {config!r}, split={split!r}) failed: {e}") from e


def load_gsm8k_hub(split: str = "train") -> PromptDataset:
  """openai/gsm8k (config "main") `split` as a PromptDataset."""
  rows = load_hub_rows("openai/gsm8k", "main", split)
  return examples_from_rows(rows, functools.partial(gsm8k_example, source="openai/gsm8k"),
                            name=f"openai/gsm8k/{split}")


def load_math500_hub() -> PromptDataset:
  """HuggingFaceH4/MATH-500 (split "test") as a PromptDataset."""
  rows = load_hub_rows("HuggingFaceH4/MATH-500", None, "test")
  return examples_from_rows(rows, functools.partial(math_example, source="HuggingFaceH4/MATH-500"),
                            name="HuggingFaceH4/MATH-500")


def load_bigmath(levels: str = "3-5") -> PromptDataset:
  """open-r1/Big-Math-RL-Verified-Processed: "3-5" (the paper's BigMath) or "4-5" (hard), or "all".

  Rows are {prompt, solution}; `solution` is the final answer (scored with math_equivalence).
  """
  if levels not in BIGMATH_LEVELS:
    raise ValueError(f"{levels=} must be one of {sorted(BIGMATH_LEVELS)}")
  rows = load_hub_rows("open-r1/Big-Math-RL-Verified-Processed", BIGMATH_LEVELS[levels], "train")
  make = functools.partial(math_example, source=f"bigmath/{levels}", question_key="prompt",
                           answer_key="solution")
  return examples_from_rows(rows, make, name=f"bigmath/{levels}")


def load_dapo_math(config: str = "en") -> PromptDataset:
  """open-r1/DAPO-Math-17k-Processed (config "en", "cn" or "all"): {prompt, solution} rows.

  The problem text (`prompt`) goes under the paper's system prompt like every other source, so the
  answer is read from <answer> tags; the original conversation stays in meta["source_prompt"].
  """
  if config not in ("en", "cn", "all"):
    raise ValueError(f"{config=} must be 'en', 'cn' or 'all'")
  rows = load_hub_rows("open-r1/DAPO-Math-17k-Processed", config, "train")

  def make(row, index):
    ex = math_example(row, index, source=f"dapo_math/{config}", question_key="prompt",
                      answer_key="solution")
    if ex is not None and "source_prompt" in row:
      ex = dataclasses.replace(ex, meta={**ex.meta, "source_prompt": row["source_prompt"]})
    return ex

  return examples_from_rows(rows, make, name=f"dapo_math/{config}")
