"""Rewards on real GSM8K / MATH-500 gold answers with correct, wrong and adversarial completions."""

import json
import os
import random
import re
import threading
import time

import numpy as np
import pytest
from conftest import SHARED_DATA

from qerl_jax import rewards as R


@pytest.fixture
def rnd():
  seed = random.SystemRandom().randrange(2**31)
  print(f"seed={seed}")
  return random.Random(seed)


def _rows(rel):
  with open(os.path.join(SHARED_DATA, rel)) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def gsm8k_golds():
  # The raw gold as the file writes it ("1,080" keeps its comma: the reward must cope).
  return [row["answer"].split("####")[-1].strip() for row in _rows("gsm8k/test.jsonl")]


@pytest.fixture(scope="module")
def math_rows():
  return _rows("math500/test.jsonl")


def with_commas(n: int) -> str:
  return f"{n:,}"


def test_gsm8k_real_golds(gsm8k_golds, rnd):
  picked = rnd.sample(gsm8k_golds, 40) + ["1,080", "-3", "0"]
  for gold in picked:
    n = int(gold.replace(",", ""))
    good = [
      f"<think>add them</think>\n<answer>{n}</answer>",
      f"<think>x</think><answer>\\boxed{{{n}}}</answer>",
      f"so the total is\n#### {n}",
      f"The answer is \\boxed{{{n}}}.",
      f"<answer>{with_commas(n)}</answer>",
      f"<answer>${n}</answer>",
      f"<answer>\\${n}.00</answer>",
      f"<answer>{n} dollars</answer>",
      f"<answer>{n}.0</answer>",
      f"<answer>{n}.</answer>",
      f"<answer>x = {n}</answer>",
      f"<answer>\\boxed{{\\boxed{{{n}}}}}</answer>",
      f"<answer>\\text{{{n} apples}}</answer>",
      f"<answer>{n - 1}</answer> wait, no: <answer>{n}</answer>",
      f"<answer>{str(n).replace('-', chr(0x2212))}</answer>",
    ]
    for completion in good:
      assert R.gsm8k_correctness(completion, gold) == 2.0, (completion, gold)
    bad = [
      f"<answer>{n + 1}</answer>",
      f"<answer>{n} or {n + 1}</answer>",      # hedging with several answers earns nothing
      f"<answer>{n + 1}, {n}</answer>",
      f"<answer>{n}</answer> then <answer>{n + 7}</answer>",  # the last answer counts
      f"<answer>{n}5</answer>",
      f"<answer>{n}.5</answer>",
      f"{n}",                                  # no marker at all (strict mode)
      f"<answer></answer> {n}",
      f"#### {n + 2}\n\\boxed{{{n}}}",           # '####' outranks the box
    ]
    for completion in bad:
      assert R.gsm8k_correctness(completion, gold) == 0.0, (completion, gold)
    # Lenient mode accepts an unmarked last number, but never over a marked wrong answer.
    assert R.gsm8k_correctness(f"so it is {n}.", gold, last_number_fallback=True) == 2.0
    assert R.gsm8k_correctness(f"{n} ... <answer>{n + 1}</answer>", gold, last_number_fallback=True) == 0.0


def test_adversarial_completions_never_raise(rnd):
  gold = "18"
  huge = "".join(rnd.choice("ab <>/{}\\#$0123456789\n") for _ in range(1 << 20))
  cases = {
    "empty": "",
    "whitespace": " \n\t ",
    "huge_random": huge,
    "huge_then_answer": huge + "<think>t</think><answer>18</answer>",
    "many_think_tags": "<think>" * 150_000 + "</answer>",
    "many_unclosed_boxes": "\\boxed{" * 150_000,
    "many_answer_tags": "<answer>" * 100_000,
    "deep_nesting": "\\boxed{" * 5000 + "18" + "}" * 5000,
    "unicode": "答案是 <think>😀 ∑ x²</think> <answer>１８ ✓</answer>",
    "unicode_digits": "<answer>١٨</answer>",
    "null_bytes": "\x00<answer>\x00</answer>\x00",
    "giant_number": "<answer>" + "9" * 10_000 + "</answer>",
    "not_a_string": None,
    "bytes": b"<answer>18</answer>",
  }
  for name, completion in cases.items():
    start = time.perf_counter()
    scores = (R.gsm8k_correctness(completion, gold), R.format_reward(completion),
              R.math_equivalence(completion, gold), R.gsm8k_correctness(completion, gold, True))
    elapsed = time.perf_counter() - start
    assert all(isinstance(s, float) for s in scores), name
    assert elapsed < 3.0, (name, elapsed)
    if name == "huge_then_answer":
      assert scores[:3] == (2.0, 0.2, 1.0), name
    elif name == "deep_nesting":
      assert scores[:3] == (2.0, 0.0, 1.0), name  # the innermost (last) box holds the answer
    else:
      assert scores[0] == 0.0 and scores[2] == 0.0, (name, scores)


def test_format_reward_matches_regex_on_random_texts(rnd):
  # The linear-time check must accept exactly what the authors' regex accepts.
  pattern = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
  pieces = ["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "x", "<", ">", "think"]
  tags = ["<think>", "</think>", "<answer>", "</answer>"]

  def filler():
    return [rnd.choice(pieces) for _ in range(rnd.randrange(0, 3))]

  accepted = 0
  for _ in range(3000):
    if rnd.random() < 0.5:
      parts = [rnd.choice(pieces) for _ in range(rnd.randrange(0, 12))]
    else:  # the well-formed skeleton with random filler, then maybe one piece dropped or swapped
      parts = []
      for tag in tags:
        parts += filler() if tag != "<answer>" else rnd.choice([[], [" "], ["\n", " "], filler()])
        parts.append(tag)
      parts += filler()
      if rnd.random() < 0.5:
        i = rnd.randrange(len(parts))
        parts[i:i + 1] = rnd.choice([[], [rnd.choice(pieces)]])
    text = "".join(parts)
    want = bool(pattern.search(text))
    assert R.has_think_answer_format(text) == want, repr(text)
    accepted += want
  assert 300 < accepted < 2700  # both outcomes are well represented
  assert R.format_reward("<think>a</think>\n\n<answer>b</answer>") == 0.2
  assert R.format_reward("<think>a</think> text <answer>b</answer>") == 0.0
  assert R.format_reward("<answer>b</answer><think>a</think>") == 0.0


def _same_gold(a: str, b: str) -> bool:
  """Two MATH golds that are one answer: equal but for spaces, a degree mark and a dollar sign (MATH's graders drop
  "^\\circ" and "\\$", so 120^\\circ answers a problem whose gold is 120, and the reward counts it: seed 1161237615
  drew that pair, and seed 764947940 \\$36 against 36^\\circ)."""
  def bare(t: str) -> str:
    return re.sub(r"\^\s*\{?\\circ\}?", "", t).replace("\\$", "").replace(" ", "")
  return bare(a) == bare(b)


def test_math500_real_golds(math_rows, rnd):
  rows = rnd.sample(math_rows, 25)
  for row in rows:
    gold = row["answer"]
    for completion in (f"<think>work</think><answer>\\boxed{{{gold}}}</answer>",
                       f"<think>work</think><answer>${gold}$</answer>",
                       f"Therefore the answer is $\\boxed{{{gold}}}$."):
      assert R.math_equivalence(completion, gold) == 1.0, (completion, gold)
    assert R.math_equivalence("<answer>\\boxed{}</answer>", gold) == 0.0
    assert R.math_equivalence("I have no idea.", gold) == 0.0
  # Wrong answers: another problem's gold that math-verify does not consider equal.
  wrong = 0
  for row in rows:
    other = rnd.choice(math_rows)["answer"]
    if _same_gold(other, row["answer"]):
      continue
    wrong += 1
    assert R.math_equivalence(f"<answer>\\boxed{{{other}}}</answer>", row["answer"]) == 0.0, (other, row["answer"])
  assert wrong >= 20


@pytest.mark.parametrize("completion,gold,want", [
  ("<answer>\\boxed{14/3}</answer>", "\\frac{14}{3}", 1.0),
  ("<answer>$\\dfrac{14}{3}$</answer>", "\\frac{14}{3}", 1.0),
  ("<answer>4.666</answer>", "\\frac{14}{3}", 0.0),
  ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
  ("\\boxed{(3, \\pi/2)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
  ("\\boxed{(3, \\pi)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 0.0),
  ("\\boxed{p - q}", "p - q", 1.0),
  ("\\boxed{-q + p}", "p - q", 1.0),
  ("\\boxed{\\boxed{2\\sqrt{2}}}", "\\sqrt{8}", 1.0),
  ("\\boxed{1} then \\boxed{2}", "2", 1.0),
  ("\\boxed{2} then \\boxed{1}", "2", 0.0),
])
def test_math_equivalence_hand_cases(completion, gold, want):
  assert R.math_equivalence(completion, gold) == want


def test_unparsable_gold_is_counted_not_raised():
  R.reset_counters()
  assert R.math_equivalence("\\boxed{1}", "") == 0.0
  assert R.math_equivalence("\\boxed{1}", "}{") == 0.0
  assert R.COUNTERS["math_gold_unparsable"] == 2


def test_math_equivalence_off_main_thread():
  # math-verify's SIGALRM timeouts only work in the main thread; elsewhere it must still score.
  out = []
  worker = threading.Thread(target=lambda: out.append(R.math_equivalence("\\boxed{\\frac{1}{2}}", "0.5")))
  worker.start()
  worker.join(30)
  assert out == [1.0]


def test_compute_rewards_registry(gsm8k_golds):
  golds = gsm8k_golds[:3]
  n = [int(g.replace(",", "")) for g in golds]
  completions = [f"<think>t</think><answer>{n[0]}</answer>", f"<answer>{n[1]}</answer>",
                 f"<think>t</think> <answer>{n[2] + 1}</answer>"]
  total, per_fn = R.compute_rewards(completions, golds, R.GSM8K_WEIGHTS)
  np.testing.assert_array_equal(per_fn["gsm8k_correctness"], [2.0, 2.0, 0.0])
  np.testing.assert_allclose(per_fn["format"], [0.2, 0.0, 0.2])
  np.testing.assert_allclose(total, [2.2, 2.0, 0.2], rtol=1e-6)
  total, per_fn = R.compute_rewards(completions, golds, {"gsm8k_correctness": 0.5, "format": 0.0})
  np.testing.assert_allclose(total, [1.0, 1.0, 0.0])
  assert list(per_fn) == ["gsm8k_correctness"]
  with pytest.raises(ValueError, match="unknown rewards"):
    R.compute_rewards(completions, golds, {"gsm8k": 1.0})
  with pytest.raises(ValueError, match="len"):
    R.compute_rewards(completions, golds[:2], R.GSM8K_WEIGHTS)


@pytest.mark.parametrize("answer,gold,want", [
  ("40_9", "40", 0.0),  # math-verify alone reads 40_9 as 40 (a MATH-500 pair that failed seed 1251731463)
  ("40", "40_9", 0.0),
  ("36", "40_9", 0.0),  # the same value in base 10 is not the base-9 answer asked for
  ("40_{9}", "40_9", 1.0),
  ("4210_5", "4210_{5}", 1.0),
  ("40_{10}", "40", 1.0),  # base 10 written out
  ("52_8", "52_9", 0.0),
  ("x_1", "x_1", 1.0),  # subscripts that are not bases are math-verify's to compare
  ("x_2", "x_1", 0.0),
])
def test_math_numerals_with_a_base_subscript_match_only_in_that_base(answer, gold, want):
  for completion in (f"<answer>\\boxed{{{answer}}}</answer>", f"<answer>${answer}$</answer>",
                     f"Therefore the answer is $\\boxed{{{answer}}}$."):
    assert R.math_equivalence(completion, gold) == want, (completion, gold)
