"""Datasets: real row counts, malformed-row accounting, prompt building through SmolLM2's chat template,
over-long prompt filtering, the resumable sampler, the synthetic arithmetic task, offline hub errors."""

import json
import os
import random
import re
import time

import numpy as np
import pytest
from conftest import SHARED_DATA

from qerl_jax import data as D
from qerl_jax import rewards as R


@pytest.fixture
def seed():
  value = random.SystemRandom().randrange(2**31)
  print(f"seed={value}")
  return value


@pytest.fixture(scope="module")
def tokenizer():
  from transformers import AutoTokenizer

  from qerl_jax.assets import smollm2_gguf_path
  path = smollm2_gguf_path()
  return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def test_real_row_counts_and_golds():
  train = D.load_gsm8k("train", os.path.join(SHARED_DATA, "gsm8k"))
  test = D.load_gsm8k("test", os.path.join(SHARED_DATA, "gsm8k", "test.jsonl"))
  math = D.load_math500(os.path.join(SHARED_DATA, "math500"))
  assert (len(train), len(test), len(math)) == (7473, 1319, 500)
  assert train.num_malformed == test.num_malformed == math.num_malformed == 0
  assert test[0].gold_answer == "18" and test[0].question.startswith("Janet")
  # Every GSM8K gold is a plain integer once its thousands commas are gone ("1,080" -> "1080").
  assert all(re.fullmatch(r"-?\d+", ex.gold_answer) for ex in list(train) + list(test))
  assert any(ex.gold_answer == "1080" for ex in train)
  assert math[1].gold_answer == "p - q" and math[1].meta["level"] == 5
  assert len({ex.uid for ex in math}) == 500


def test_malformed_rows_are_counted(tmp_path):
  good = {"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"}
  lines = [
    json.dumps(good),
    "{not json",
    json.dumps([1, 2]),                                         # not an object
    json.dumps({"question": "Q", "answer": "no hash marks"}),   # no '####'
    json.dumps({"question": "", "answer": "#### 1"}),           # empty question
    json.dumps({"question": "Q", "answer": "####   "}),         # empty gold
    json.dumps({"question": 3, "answer": "#### 1"}),            # wrong type
    "",                                                          # blank lines are not rows
    json.dumps(dict(good, answer="so #### 1,250")),
  ]
  path = tmp_path / "train.jsonl"
  path.write_text("\n".join(lines) + "\n")
  ds = D.load_gsm8k("train", str(path))
  assert len(ds) == 2 and ds.num_malformed == 6
  assert [ex.gold_answer for ex in ds] == ["4", "1250"]
  math_path = tmp_path / "math.jsonl"
  math_path.write_text(json.dumps({"problem": "P", "answer": "\\frac12"}) + "\n" +
                       json.dumps({"problem": "P"}) + "\n")
  ds = D.load_math500(str(math_path))
  assert len(ds) == 1 and ds.num_malformed == 1


def test_empty_dataset_is_an_error(tmp_path):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  with pytest.raises(ValueError, match="empty"):
    D.load_gsm8k("test", str(empty))
  junk = tmp_path / "junk.jsonl"
  junk.write_text("garbage\n[]\n")
  with pytest.raises(ValueError, match="2 malformed"):
    D.load_math500(str(junk))
  with pytest.raises(FileNotFoundError):
    D.load_gsm8k("test", str(tmp_path / "missing.jsonl"))
  with pytest.raises(ValueError, match="split"):
    D.load_gsm8k("validation", str(empty))


def test_build_prompt_and_filter(tokenizer):
  ds = D.load_gsm8k("test", os.path.join(SHARED_DATA, "gsm8k"))
  small = D.PromptDataset(ds.examples[:40], name="gsm8k/test[:40]")
  text = D.build_prompt(small[0], tokenizer)
  assert text == ("<|im_start|>system\n" + D.SYSTEM_PROMPT + "<|im_end|>\n<|im_start|>user\n" +
                  small[0].question + "<|im_end|>\n<|im_start|>assistant\n")
  assert "<think>" in D.SYSTEM_PROMPT and "<answer>" in D.SYSTEM_PROMPT
  # Without a system prompt the template's own default system message (SmolLM's) takes its place.
  bare = D.build_prompt(small[0], tokenizer, system_prompt=None)
  assert D.SYSTEM_PROMPT not in bare and "named SmolLM" in bare and small[0].question in bare
  counts = D.prompt_token_counts(small, tokenizer)
  assert counts[0] == len(tokenizer(text, add_special_tokens=False)["input_ids"])
  limit = int(np.median(counts))
  kept = D.filter_long_prompts(small, tokenizer, limit)
  assert len(kept) == sum(c <= limit for c in counts) and kept.num_filtered == 40 - len(kept)
  assert all(n <= limit for n in D.prompt_token_counts(kept, tokenizer))
  with pytest.raises(ValueError, match="exceed"):
    D.filter_long_prompts(small, tokenizer, min(counts) - 1)
  # An example carrying its own conversation is rendered as given.
  own = D.Example("ignored", "1", prompt_messages=({"role": "user", "content": "Hi"},))
  rendered = D.build_prompt(own, tokenizer)
  assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
  assert D.SYSTEM_PROMPT not in rendered and "ignored" not in rendered


def _ids(batch):
  return [ex.uid for ex in batch]


def test_sampler_determinism_epochs_and_resume(seed):
  ds = D.make_arithmetic_dataset(30, 1, seed=seed % 1000)
  a, b = D.PromptSampler(ds, 7, seed), D.PromptSampler(ds, 7, seed)
  first = [_ids(a.next_batch()) for _ in range(9)]
  assert first == [_ids(b.next_batch()) for _ in range(9)]
  assert all(len(x) == 7 for x in first)
  flat = [u for batch in first for u in batch]
  # Each epoch is a permutation keyed by (seed, epoch); batches run across epoch boundaries.
  assert sorted(flat[:30]) == sorted(flat[30:60]) == sorted(ex.uid for ex in ds)
  assert flat[:30] != flat[30:60]
  assert flat[:30] == [str(i) for i in D.epoch_order(30, seed, 0)]
  assert _ids(next(iter(D.PromptSampler(ds, 7, seed + 1)))) != first[0]
  # Resume: a fresh sampler restored from a JSON round-trip of the state continues identically.
  c = D.PromptSampler(ds, 7, seed)
  for _ in range(5):
    c.next_batch()
  state = json.loads(json.dumps(c.state()))
  assert state["epoch"] == 1 and state["position"] == 5
  d = D.PromptSampler(ds, 7, seed)
  d.restore(state)
  assert [_ids(d.next_batch()) for _ in range(4)] == first[5:9]
  with pytest.raises(ValueError, match="seed"):
    D.PromptSampler(ds, 7, seed + 1).restore(state)
  ordered = D.PromptSampler(ds, 30, shuffle=False)
  assert _ids(ordered.next_batch()) == [str(i) for i in range(30)]
  with pytest.raises(ValueError, match="batch_prompts"):
    D.PromptSampler(ds, 0)


def _solve(question: str) -> int:
  """Independent reading of a synthetic problem: evaluate what the text says."""
  m = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", question)
  if m:
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return {"+": a + b, "-": a - b, "*": a * b}[op]
  value = int(re.match(r"\w+ has (\d+) ", question).group(1))
  for sentence in re.split(r"(?<=\.) ", question)[1:]:
    if m := re.search(r"gets (\d+) more", sentence):
      value += int(m.group(1))
    elif m := re.search(r"gives away (\d+)", sentence):
      value -= int(m.group(1))
    elif m := re.search(r"multiplied by (\d+)", sentence):
      value *= int(m.group(1))
  return value


@pytest.mark.parametrize("difficulty", [0, 1, 2, 5])
def test_synthetic_task(seed, difficulty):
  ds = D.make_arithmetic_dataset(200, difficulty, seed=seed)
  assert [ex.question for ex in ds] == [ex.question for ex in D.make_arithmetic_dataset(200, difficulty, seed=seed)]
  for ex in ds:
    answer = _solve(ex.question)
    assert ex.gold_answer == str(answer) and answer >= 0
    assert R.gsm8k_correctness(f"<think>...</think><answer>{answer}</answer>", ex.gold_answer) == 2.0
    assert R.gsm8k_correctness(f"<answer>{answer + 1}</answer>", ex.gold_answer) == 0.0
  if difficulty == 0:
    assert all(re.fullmatch(r"What is [1-9] \+ [1-9]\?", ex.question) for ex in ds)
  else:
    # Varied problems: difficulty 1 has 674 distinct questions, so 200 draws give ~159 +- 5 distinct ones.
    assert len({ex.question for ex in ds}) > 120
  if difficulty >= 2:
    assert all(ex.question.count(".") == difficulty + 1 for ex in ds)
  with pytest.raises(ValueError, match="difficulty"):
    D.make_arithmetic_dataset(5, D.MAX_DIFFICULTY + 1)


def test_hub_offline_fails_fast_and_clearly(monkeypatch):
  # Port 9 on localhost refuses connections: the situation of a machine without network.
  monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
  for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
    monkeypatch.delenv(var, raising=False)
  for loader in (D.load_bigmath, D.load_dapo_math, D.load_gsm8k_hub, D.load_math500_hub):
    start = time.perf_counter()
    with pytest.raises(ConnectionError, match="cannot reach the Hugging Face hub"):
      loader()
    assert time.perf_counter() - start < 10
  with pytest.raises(ValueError, match="levels"):
    D.load_bigmath("1-2")


def test_hub_rows_become_examples(monkeypatch):
  # Only the network layer is replaced: rows shaped like the hub datasets' go through the real adapters.
  served = {}

  def fake_rows(name, config, split):
    served[name] = (config, split)
    return {
      "openai/gsm8k": [{"question": "Q1", "answer": "w\n#### 1,234"}, {"question": "Q2"}],
      "HuggingFaceH4/MATH-500": [{"problem": "P", "answer": "\\frac{1}{2}", "level": 3, "unique_id": "u1"}],
      "open-r1/Big-Math-RL-Verified-Processed": [{"prompt": "B", "solution": "42", "source": "amc"},
                                                 {"prompt": "B2", "solution": None}],
      "open-r1/DAPO-Math-17k-Processed": [{"prompt": "D", "solution": "7",
                                           "source_prompt": [{"role": "user", "content": "D. Answer: $Answer"}]}],
    }[name]

  monkeypatch.setattr(D.hub, "load_hub_rows", fake_rows)
  gsm = D.load_gsm8k_hub("test")
  assert served["openai/gsm8k"] == ("main", "test")
  assert [ex.gold_answer for ex in gsm] == ["1234"] and gsm.num_malformed == 1
  math = D.load_math500_hub()
  assert math[0].gold_answer == "\\frac{1}{2}" and math[0].uid == "u1" and math[0].meta["level"] == 3
  big = D.load_bigmath("4-5")
  assert served["open-r1/Big-Math-RL-Verified-Processed"] == ("level_4_5", "train")
  assert (big[0].question, big[0].gold_answer, big.num_malformed) == ("B", "42", 1)
  dapo = D.load_dapo_math()
  assert served["open-r1/DAPO-Math-17k-Processed"] == ("en", "train")
  assert dapo[0].prompt_messages is None and dapo[0].meta["source_prompt"][0]["role"] == "user"


def test_default_paths(monkeypatch, tmp_path):
  monkeypatch.setenv("QERL_DATA_DIR", SHARED_DATA)
  assert len(D.load_gsm8k("test")) == 1319 and len(D.load_math500()) == 500
  # No local copy: the loader turns to the hub, which here is unreachable -> a clear error.
  monkeypatch.setenv("QERL_DATA_DIR", str(tmp_path))
  monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
  for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
    monkeypatch.delenv(var, raising=False)
  with pytest.raises(ConnectionError, match="path="):
    D.load_gsm8k("test")
