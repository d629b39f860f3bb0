"""The paper's reward functions: GSM8K exact answer (2.0), format (0.2), MATH equivalence (1.0).

Each takes raw completion text and returns a float; none raises, whatever the text (a rollout can be
empty, megabytes long, or binary junk decoded as unicode). Surprises are counted in `COUNTERS`
(gold answers that cannot be parsed, math-verify timeouts, internal errors) for the trainer to log.
"""

import collections
import logging
import re
import threading
from typing import Optional, Tuple

from qerl_jax.rewards.extract import (MAX_ANSWER_CHARS, answer_tag, extract_final_answer, last_boxed,
                                      parse_number)

GSM8K_CORRECT = 2.0
FORMAT_REWARD = 0.2
MATH_CORRECT = 1.0
# math-verify bounds each parse and each comparison with SIGALRM (whole seconds, main thread only).
MATH_VERIFY_TIMEOUT_S = 3

COUNTERS = collections.Counter()
_log = logging.getLogger(__name__)


def reset_counters():
  """Zero the reward counters (e.g. at the start of a logging interval)."""
  COUNTERS.clear()


def gsm8k_correctness(completion: str, gold: str, last_number_fallback: bool = False) -> float:
  """2.0 if the completion's final answer is the gold number, else 0.0.

  The answer comes from <answer>...</answer>, else the last '#### N', else the last \\boxed{}
  (`extract_final_answer`); both sides are read by `parse_number` (commas, $, units, trailing .0 and
  the like ignored) and compared exactly. A gold that is not a number is compared as stripped text.
  `last_number_fallback=True` also accepts the last number of an unmarked completion (the
  "gsm8k_lenient" reward, for models too small to follow the format at first).
  """
  try:
    answer = extract_final_answer(completion, last_number_fallback=last_number_fallback)
    if answer is None or not isinstance(gold, str):
      return 0.0
    gold_value = parse_number(gold)
    if gold_value is None:
      COUNTERS["gsm8k_gold_not_a_number"] += 1
      return GSM8K_CORRECT if answer.strip().lower() == gold.strip().lower() else 0.0
    return GSM8K_CORRECT if parse_number(answer) == gold_value else 0.0
  except Exception:  # never let a reward crash a training step
    COUNTERS["gsm8k_error"] += 1
    _log.debug("gsm8k_correctness failed", exc_info=True)
    return 0.0


_AFTER_THINK = re.compile(r"\s*<answer>")


def has_think_answer_format(completion: str) -> bool:
  """True when the text contains <think>...</think>, optional whitespace, then <answer>...</answer>.

  Same language as re.search(r"<think>.*?</think>\\s*<answer>.*?</answer>", text, re.DOTALL), the
  authors' soft format check, but decided with linear scans: that regex is quadratic on a text of many
  unclosed '<think>' tags.
  """
  first_think = completion.find("<think>")
  if first_think < 0:
    return False
  last_close = completion.rfind("</answer>")
  if last_close < 0:
    return False
  pos = completion.find("</think>", first_think + len("<think>"))
  while pos >= 0:
    match = _AFTER_THINK.match(completion, pos + len("</think>"))
    if match and completion.find("</answer>", match.end()) >= 0:
      return True
    pos = completion.find("</think>", pos + 1)
  return False


def format_reward(completion: str) -> float:
  """0.2 for the `<think>...</think> <answer>...</answer>` format (the authors' soft check), else 0.0."""
  try:
    if not isinstance(completion, str):
      return 0.0
    return FORMAT_REWARD if has_think_answer_format(completion) else 0.0
  except Exception:
    COUNTERS["format_error"] += 1
    _log.debug("format_reward failed", exc_info=True)
    return 0.0


def _timeouts() -> Optional[int]:
  # signal.alarm only works in the main thread; elsewhere math-verify must run without its timeout
  # (it raises otherwise), and the length cap on answers is what bounds the work.
  return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


class _TimeoutCounter(logging.Filter):
  """Counts math-verify's timeouts, which it swallows and reports only as a log warning."""

  def filter(self, record):
    if record.getMessage().startswith("Timeout during"):
      COUNTERS["math_timeout"] += 1
    return True


_TIMEOUT_COUNTER = _TimeoutCounter()


def _mv_parse(text: str, boxed: bool):
  from math_verify import parse  # imported lazily: it pulls in sympy
  for name in ("math_verify.parser", "math_verify.grader"):
    logger = logging.getLogger(name)
    if _TIMEOUT_COUNTER not in logger.filters:
      logger.addFilter(_TIMEOUT_COUNTER)
  return parse("\\boxed{" + text + "}" if boxed else text, parsing_timeout=_timeouts())


_GOLD_CACHE = {}
_GOLD_CACHE_SIZE = 4096


def _parse_gold(gold: str):
  """Parsed gold, cached (a group of G completions shares its gold). Empty tuple when unparsable.

  Failures are not cached: a parse that timed out on a busy machine gets another chance next time.
  """
  if gold in _GOLD_CACHE:
    return _GOLD_CACHE[gold]
  parsed = tuple(_mv_parse(gold, boxed=True))
  if parsed:
    if len(_GOLD_CACHE) >= _GOLD_CACHE_SIZE:
      _GOLD_CACHE.clear()
    _GOLD_CACHE[gold] = parsed
  return parsed


def _math_candidate(completion: str) -> Tuple[Optional[str], bool]:
  """(answer text, came from a box) for MATH: boxed inside <answer>, the <answer> text, or last box."""
  answer = answer_tag(completion)
  if answer is not None:
    boxed = last_boxed(answer)
    return (boxed, True) if boxed is not None else (answer, False)
  return last_boxed(completion), True


# A whole answer that is a numeral with its base as a subscript, as MATH writes them: 40_9, 4210_{5}.
_BASE_NUMERAL = re.compile(r"^\s*\$?\s*([0-9A-Za-z]+)\s*_\s*\{?\s*(\d+)\s*\}?\s*\$?\s*$")


def _numeral_base(answer: str) -> Optional[int]:
  """The base of an answer written as a numeral with a base subscript (2-36, every digit valid in it), else
  None. math-verify reads 40_9 as the number 40, so an answer in another base (or none: 10) would match it."""
  match = _BASE_NUMERAL.match(answer)
  if not match:
    return None
  digits, base = match.group(1), int(match.group(2))
  if not 2 <= base <= 36 or any(int(c, 36) >= base for c in digits):
    return None
  return base


def math_equivalence(completion: str, gold: str) -> float:
  """1.0 if math-verify finds the completion's answer equivalent to the gold LaTeX answer, else 0.0.

  The answer is the \\boxed{} inside <answer>, else the <answer> text, else the last \\boxed{} of the
  completion. Gold strings (MATH-500 `answer`, BigMath `solution`) are parsed as if boxed. An
  unparsable gold gives 0.0 and counts `math_gold_unparsable`; timeouts count `math_timeout`.
  """
  try:
    if not isinstance(completion, str) or not isinstance(gold, str) or len(gold) > MAX_ANSWER_CHARS:
      return 0.0
    gold_parsed = _parse_gold(gold)
    if not gold_parsed:
      COUNTERS["math_gold_unparsable"] += 1
      return 0.0
    candidate, from_box = _math_candidate(completion)
    if not candidate or len(candidate) > MAX_ANSWER_CHARS:
      return 0.0
    bases = _numeral_base(gold), _numeral_base(candidate)
    if bases != (None, None) and (bases[0] or 10) != (bases[1] or 10):  # 40_9 is not 40
      return 0.0
    from math_verify import verify
    from math_verify.errors import TimeoutException
    try:
      parsed = _mv_parse(candidate, boxed=from_box)
      if not parsed and not from_box:
        parsed = _mv_parse(candidate, boxed=True)
      if not parsed:
        return 0.0
      return MATH_CORRECT if verify(list(gold_parsed), parsed, timeout_seconds=_timeouts()) else 0.0
    except TimeoutException:
      COUNTERS["math_timeout"] += 1
      return 0.0
  except Exception:
    COUNTERS["math_error"] += 1
    _log.debug("math_equivalence failed", exc_info=True)
    return 0.0
