"""GSM8K and MATH-500 from local JSONL files (the offline path), and the row parsers the hub shares.

Files hold one JSON object per line with the fields of the original datasets:
  GSM8K:    {"question": str, "answer": "<worked solution>\\n#### <number>"}
  MATH-500: {"problem": str, "answer": str (LaTeX), "solution", "subject", "level", "unique_id"}
Rows that are not JSON objects or lack a usable field are skipped and counted (`num_malformed`);
blank lines are ignored.
"""

import json
import os
from typing import Callable, List, Mapping, Optional, Tuple

from qerl_jax.data.example import Example, PromptDataset

DATA_DIR_ENV = "QERL_DATA_DIR"
GSM8K_SPLITS = ("train", "test")


def default_data_dir() -> Optional[str]:
  """$QERL_DATA_DIR, else the project's shared/data folder beside the checkout, if it exists."""
  env = os.environ.get(DATA_DIR_ENV)
  if env:
    return env
  repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  candidate = os.path.join(os.path.dirname(repo_root), "shared", "data")
  return candidate if os.path.isdir(candidate) else None


def read_jsonl(path: str) -> Tuple[List[dict], int]:
  """(rows that parse as JSON objects, count of lines that do not). Missing file -> FileNotFoundError."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path=} is not a file")
  rows, bad = [], 0
  with open(path, encoding="utf-8", errors="replace") as f:
    for line in f:
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        bad += 1
        continue
      if isinstance(row, dict):
        rows.append(row)
      else:
        bad += 1
  return rows, bad


def gsm8k_gold(solution: str) -> Optional[str]:
  """The number after the last '####' of a GSM8K solution, commas removed; None if absent or empty."""
  if not isinstance(solution, str) or "####" not in solution:
    return None
  gold = solution.rsplit("####", 1)[1].strip().replace(",", "")
  return gold or None


def _nonempty_str(row: Mapping, key: str) -> Optional[str]:
  value = row.get(key)
  return value if isinstance(value, str) and value.strip() else None


def gsm8k_example(row: Mapping, index: int, source: str = "gsm8k") -> Optional[Example]:
  """Example from a GSM8K row, or None when the row is malformed."""
  question, solution = _nonempty_str(row, "question"), _nonempty_str(row, "answer")
  gold = gsm8k_gold(solution) if solution else None
  if question is None or gold is None:
    return None
  return Example(question=question.strip(), gold_answer=gold, source=source, uid=str(index),
                 meta={"solution": solution})


def math_example(row: Mapping, index: int, source: str = "math500", question_key: str = "problem",
                 answer_key: str = "answer") -> Optional[Example]:
  """Example from a MATH-style row ({problem, answer, ...}), or None when the row is malformed."""
  question, gold = _nonempty_str(row, question_key), _nonempty_str(row, answer_key)
  if question is None or gold is None:
    return None
  meta = {k: row[k] for k in ("solution", "subject", "level", "unique_id", "source") if k in row}
  uid = str(row.get("unique_id", index))
  return Example(question=question.strip(), gold_answer=gold.strip(), source=source, uid=uid, meta=meta)


def examples_from_rows(rows, make: Callable[[Mapping, int], Optional[Example]], name: str,
                       num_malformed: int = 0) -> PromptDataset:
  """PromptDataset of make(row, index) over rows; rows for which it returns None count as malformed."""
  examples = []
  for i, row in enumerate(rows):
    ex = make(row, i) if isinstance(row, Mapping) else None
    if ex is None:
      num_malformed += 1
    else:
      examples.append(ex)
  return PromptDataset(tuple(examples), name=name, num_malformed=num_malformed)


def _resolve(path: Optional[str], default_rel: str) -> Optional[str]:
  if path is None:
    base = default_data_dir()
    if base is None:
      return None
    path = os.path.join(base, default_rel)
    return path if os.path.isfile(path) else None
  return path


def load_gsm8k(split: str = "train", path: Optional[str] = None) -> PromptDataset:
  """GSM8K `split` ("train": 7473 rows, "test": 1319) as a PromptDataset.

  Args:
    split: "train" or "test".
    path: a JSONL file, or a folder holding {split}.jsonl. None: <data dir>/gsm8k/{split}.jsonl (see
      `default_data_dir`), else the hub dataset openai/gsm8k (needs network or the datasets cache).
  """
  if split not in GSM8K_SPLITS:
    raise ValueError(f"{split=} must be one of {GSM8K_SPLITS}")
  if path is not None and os.path.isdir(path):
    path = os.path.join(path, f"{split}.jsonl")
  resolved = _resolve(path, os.path.join("gsm8k", f"{split}.jsonl"))
  if resolved is None:
    from qerl_jax.data.hub import load_gsm8k_hub
    return load_gsm8k_hub(split)
  rows, bad = read_jsonl(resolved)
  return examples_from_rows(rows, gsm8k_example, name=f"gsm8k/{split}", num_malformed=bad)


def load_math500(path: Optional[str] = None) -> PromptDataset:
  """MATH-500 (500 test problems) as a PromptDataset.

  Args:
    path: a JSONL file, or a folder holding test.jsonl. None: <data dir>/math500/test.jsonl, else the
      hub dataset HuggingFaceH4/MATH-500.
  """
  if path is not None and os.path.isdir(path):
    path = os.path.join(path, "test.jsonl")
  resolved = _resolve(path, os.path.join("math500", "test.jsonl"))
  if resolved is None:
    from qerl_jax.data.hub import load_math500_hub
    return load_math500_hub()
  rows, bad = read_jsonl(resolved)
  return examples_from_rows(rows, math_example, name="math500", num_malformed=bad)
