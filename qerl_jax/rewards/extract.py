"""Pulling the final answer out of a completion, and reading it as a number.

Everything here runs on untrusted model output of any size (a degenerate rollout can be megabytes of
repeated tags), so it is written with `str.find` scans and regexes that cannot backtrack quadratically,
and it never raises on text.
"""

import re
from fractions import Fraction
from typing import Optional

# Answers longer than this are not answers; capping also bounds the cost of any later parsing.
MAX_ANSWER_CHARS = 1000
# A "number" with more digits than this is noise (and int() refuses > 4300 digits anyway).
_MAX_NUMBER_CHARS = 64

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_MAX_BOX_TRIES = 8


def answer_tag(text: str) -> Optional[str]:
  """Content of the last complete <answer>...</answer> block, stripped; None when there is none."""
  end = text.rfind("</answer>")
  if end < 0:
    return None
  start = text.rfind("<answer>", 0, end)
  if start < 0:
    return None
  return text[start + len("<answer>"):end].strip()


def hash_answer(text: str) -> Optional[str]:
  """What follows the last '####' on its line (GSM8K's gold format), stripped; None when absent/empty."""
  pos = text.rfind("####")
  if pos < 0:
    return None
  rest = text[pos + 4:]
  newline = rest.find("\n")
  rest = (rest if newline < 0 else rest[:newline]).strip()
  return rest or None


def _braced(text: str, open_pos: int) -> Optional[str]:
  """Content of the brace group opening at text[open_pos] == '{', nesting respected.

  None if it does not close within MAX_ANSWER_CHARS: a longer box is not an answer, and the bound keeps
  a text full of unclosed boxes from costing quadratic time.
  """
  depth = 0
  for i in range(open_pos, min(len(text), open_pos + MAX_ANSWER_CHARS + 2)):
    c = text[i]
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return text[open_pos + 1:i]
  return None


def last_boxed(text: str) -> Optional[str]:
  """Content of the last \\boxed{...} (or \\fbox{...}, or '\\boxed 5'), nested braces kept; else None.

  Scans backwards over the last few occurrences, so an unclosed last box falls back to the previous
  complete one; past _MAX_BOX_TRIES broken boxes the text is garbage and gets None.
  """
  end = len(text)
  for _ in range(_MAX_BOX_TRIES):
    pos = max(text.rfind(cmd, 0, end) for cmd in _BOX_COMMANDS)
    if pos < 0:
      return None
    cmd_len = len("\\boxed") if text.startswith("\\boxed", pos) else len("\\fbox")
    after = pos + cmd_len
    if after < len(text) and text[after] == "{":
      content = _braced(text, after)
      if content is not None:
        return content.strip()
    elif text.startswith(" ", after):
      # "\boxed 5": the argument is the next space-free token (up to "$" closing the math).
      match = re.match(r" +([^\s$]+)", text[after:after + MAX_ANSWER_CHARS])
      if match:
        return match.group(1)
    end = pos
  return None


def last_number(text: str) -> Optional[str]:
  """The last number written in the text's final MAX_ANSWER_CHARS characters, as written; else None."""
  tail = _THOUSANDS.sub("", text[-MAX_ANSWER_CHARS:].translate(_MINUS_SIGNS))
  found = None
  for found in _NUMBER.finditer(tail):
    pass
  return found.group(0).strip().rstrip(".") if found else None


def extract_final_answer(completion: str, last_number_fallback: bool = False) -> Optional[str]:
  """The completion's final answer: <answer> tag, else the last '#### N', else the last \\boxed{}.

  Inside an <answer> tag, a \\boxed{} is unwrapped. With `last_number_fallback`, a completion with none
  of these markers answers with its last number (lenient scoring for small models that do not follow
  the format yet). Returns None when nothing is found or the answer is implausibly long
  (> MAX_ANSWER_CHARS).
  """
  if not isinstance(completion, str):
    return None
  answer = answer_tag(completion)
  if answer is not None:
    boxed = last_boxed(answer)
    answer = boxed if boxed is not None else answer
  else:
    answer = hash_answer(completion)
    if answer is None:
      answer = last_boxed(completion)
    if answer is None and last_number_fallback:
      answer = last_number(completion)
  if answer is None or len(answer) > MAX_ANSWER_CHARS:
    return None
  return answer


_TEXT_COMMAND = re.compile(r"\\(?:text|mathrm|textbf|mbox|operatorname)\{([^{}]*)\}")
_FRAC = re.compile(r"\\[dt]?frac\{\s*([-+]?[0-9.]+)\s*\}\{\s*([-+]?[0-9.]+)\s*\}")
_THOUSANDS = re.compile(r"(?<=[0-9]),(?=[0-9]{3}(?![0-9]))")
_NUMBER = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:\s*/\s*(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))?")
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2014": "-", "\uff0d": "-"})


def _to_fraction(token: str) -> Optional[Fraction]:
  token = token.replace(" ", "")
  if len(token) > _MAX_NUMBER_CHARS:
    return None
  try:
    if "/" in token:
      num, den = token.split("/")
      den_value = Fraction(den.rstrip("."))
      return None if den_value == 0 else Fraction(num.rstrip(".")) / den_value
    return Fraction(token.rstrip("."))
  except (ValueError, ZeroDivisionError):
    return None


def _numbers(text: str) -> list:
  return [_to_fraction(m.group(0)) for m in _NUMBER.finditer(text)]


def parse_number(answer: Optional[str]) -> Optional[Fraction]:
  """The single number an answer states, as an exact Fraction; None if it states none or several.

  Tolerated around the number: thousands commas, '$' and '\\$', '%', units and other words, LaTeX
  \\text{}, \\frac{a}{b}, a trailing period, trailing zeros ('18.0' == '18'), unicode minus signs, and a
  left-hand side ('x = 18': the part after the last '=' decides when the whole has several numbers).
  Several different numbers ('17 or 18', '3, 4') give None: a hedged answer earns nothing.
  """
  if not isinstance(answer, str) or len(answer) > MAX_ANSWER_CHARS:
    return None
  text = answer.translate(_MINUS_SIGNS)
  boxed = last_boxed(text)
  if boxed is not None:
    text = boxed
  text = _TEXT_COMMAND.sub(r" \1 ", text)
  text = _FRAC.sub(r" \1/\2 ", text)
  text = text.replace("\\$", " ").replace("$", " ").replace("\\%", " ").replace("%", " ")
  text = _THOUSANDS.sub("", text)
  for candidate in (text, text.rsplit("=", 1)[-1] if "=" in text else None):
    if candidate is None:
      continue
    values = _numbers(candidate)
    if values and None not in values and len(set(values)) == 1:
      return values[0]
  return None
