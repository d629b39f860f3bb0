"""An offline task: integer arithmetic word problems with a difficulty knob and exact integer answers.

Needs no download, and is scored by the same `qerl_jax.rewards.gsm8k_correctness` as GSM8K (the gold
is the integer as text), so the whole RL loop can run and learn on a CPU with a 135M model.

Difficulty:
  0  "What is 7 + 5?": one addition of single digits (a 135M instruct model gets some right).
  1  one operation (+, -, *) on numbers up to 20 (products of small factors).
  d >= 2  a story with d operations (gains, losses, doublings) on numbers up to 10 * d, result >= 0.
"""

from typing import Optional, Tuple

import numpy as np

from qerl_jax.data.example import Example, PromptDataset

_NAMES = ("Tom", "Ana", "Ravi", "Mei", "Sam", "Lea", "Omar", "Ines", "Kofi", "Yuki")
_ITEMS = ("apples", "marbles", "stickers", "coins", "books", "shells", "pencils", "cards")
MAX_DIFFICULTY = 8


def _one_step(rng: np.random.Generator) -> Tuple[str, int]:
  op = rng.integers(3)
  if op == 0:
    a, b = (int(x) for x in rng.integers(1, 21, size=2))
    return f"What is {a} + {b}?", a + b
  if op == 1:
    a, b = sorted(int(x) for x in rng.integers(1, 21, size=2))
    return f"What is {b} - {a}?", b - a
  a, b = (int(x) for x in rng.integers(2, 10, size=2))
  return f"What is {a} * {b}?", a * b


def _story(rng: np.random.Generator, steps: int) -> Tuple[str, int]:
  name, item = _NAMES[rng.integers(len(_NAMES))], _ITEMS[rng.integers(len(_ITEMS))]
  top = 10 * steps
  value = int(rng.integers(2, top + 1))
  sentences = [f"{name} has {value} {item}."]
  for _ in range(steps):
    kind = rng.integers(3)
    if kind == 2 and value <= 50:
      factor = int(rng.integers(2, 4))
      sentences.append(f"Then the number of {item} {name} has is multiplied by {factor}.")
      value *= factor
    elif kind == 1 and value > 1:
      lost = int(rng.integers(1, min(value, top) + 1))
      sentences.append(f"{name} gives away {lost} {item}.")
      value -= lost
    else:
      gained = int(rng.integers(1, top + 1))
      sentences.append(f"{name} gets {gained} more {item}.")
      value += gained
  sentences.append(f"How many {item} does {name} have now?")
  return " ".join(sentences), value


def arithmetic_problem(rng: np.random.Generator, difficulty: int) -> Tuple[str, int]:
  """(question text, integer answer) for one problem of the given difficulty (see module docstring)."""
  if not isinstance(difficulty, (int, np.integer)) or not 0 <= difficulty <= MAX_DIFFICULTY:
    raise ValueError(f"{difficulty=} must be an int in [0, {MAX_DIFFICULTY}]")
  if difficulty == 0:
    a, b = (int(x) for x in rng.integers(1, 10, size=2))
    return f"What is {a} + {b}?", a + b
  if difficulty == 1:
    return _one_step(rng)
  return _story(rng, int(difficulty))


def make_arithmetic_dataset(num_examples: int = 1000, difficulty: int = 0, seed: int = 0,
                            system_prompt: Optional[str] = None) -> PromptDataset:
  """A PromptDataset of `num_examples` synthetic problems; the same arguments give the same problems.

  Args:
    num_examples: how many problems (>= 1).
    difficulty: 0 (single-digit addition) to MAX_DIFFICULTY (stories of that many steps).
    seed: generator seed.
    system_prompt: stored in each example as its conversation (system + user) when given; None leaves
      the choice to `build_prompt` (the paper's SYSTEM_PROMPT by default).
  """
  if not isinstance(num_examples, int) or num_examples < 1:
    raise ValueError(f"{num_examples=} must be a positive int")
  rng = np.random.default_rng([seed, difficulty])
  examples = []
  for i in range(num_examples):
    question, answer = arithmetic_problem(rng, difficulty)
    messages = None
    if system_prompt is not None:
      messages = ({"role": "system", "content": system_prompt}, {"role": "user", "content": question})
    examples.append(Example(question=question, gold_answer=str(answer), prompt_messages=messages,
                            source=f"arithmetic/d{difficulty}", uid=str(i),
                            meta={"difficulty": int(difficulty)}))
  return PromptDataset(tuple(examples), name=f"arithmetic/d{difficulty}")


