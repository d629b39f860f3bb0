"""Prompt records, prompt datasets, chat-template prompt building and the over-long prompt filter."""

import dataclasses
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

# The paper's instruction: reasoning inside <think></think>, the final answer inside <answer></answer>,
# which is what `qerl_jax.rewards.format_reward` checks and where the answer extractors look first.
SYSTEM_PROMPT = (
  "Solve the following math problem step by step. The reasoning process and direct answer are enclosed "
  "within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process "
  "here </think> <answer> answer here </answer>:\n<think>\n...\n</think>\n<answer>\n...\n</answer>")


@dataclasses.dataclass(frozen=True)
class Example:
  """One RL prompt with its reference answer.

  Attributes:
    question: the problem text, sent as the user message.
    gold_answer: the reference final answer the reward compares against (GSM8K: the number after
      '####' without commas; MATH: the LaTeX answer).
    prompt_messages: a complete conversation to use instead of system prompt + question (chat dicts
      with 'role' and 'content'); None for the usual case.
    source: dataset name, for logging.
    uid: stable id within the source (row index or the dataset's own id).
    meta: anything else the source provides (solution text, level, subject).
  """
  question: str
  gold_answer: str
  prompt_messages: Optional[Tuple[Mapping[str, str], ...]] = None
  source: str = ""
  uid: str = ""
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class PromptDataset:
  """An immutable list of Examples with the bookkeeping of how it was built.

  Attributes:
    examples: the usable examples (never empty: an empty dataset is an error at construction).
    name: source name for messages and logs.
    num_malformed: rows skipped because they lacked a field, had the wrong type or were not JSON.
    num_filtered: examples dropped by filters (e.g. prompts over the token budget).
  """
  examples: Tuple[Example, ...]
  name: str = ""
  num_malformed: int = 0
  num_filtered: int = 0

  def __post_init__(self):
    if not self.examples:
      raise ValueError(f"dataset {self.name!r} is empty ({self.num_malformed} malformed rows, "
                       f"{self.num_filtered} filtered out)")
    object.__setattr__(self, "examples", tuple(self.examples))

  def __len__(self) -> int:
    return len(self.examples)

  def __getitem__(self, i: int) -> Example:
    return self.examples[i]

  def __iter__(self) -> Iterator[Example]:
    return iter(self.examples)


def prompt_messages(example: Example, system_prompt: Optional[str] = SYSTEM_PROMPT) -> List[Dict[str, str]]:
  """Chat messages for an example: its own prompt_messages if set, else [system,] user(question)."""
  if example.prompt_messages is not None:
    return [dict(m) for m in example.prompt_messages]
  messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
  messages.append({"role": "user", "content": example.question})
  return messages


def build_prompt(example: Example, tokenizer, system_prompt: Optional[str] = SYSTEM_PROMPT) -> str:
  """Prompt text through the tokenizer's chat template, ending with the assistant turn's opening.

  Args:
    example: the record; its prompt_messages, when set, replace system prompt + question.
    tokenizer: a Hugging Face tokenizer with a chat template.
    system_prompt: the system message (default: the paper's); None or "" for none.
  """
  if not getattr(tokenizer, "chat_template", None):
    raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat_template; set one "
                     "(tokenizer.chat_template = ...) or use an instruct model's tokenizer")
  return tokenizer.apply_chat_template(prompt_messages(example, system_prompt), tokenize=False,
                                       add_generation_prompt=True)


def prompt_token_counts(dataset: Sequence[Example], tokenizer,
                        system_prompt: Optional[str] = SYSTEM_PROMPT) -> List[int]:
  """Token count of each example's full templated prompt (special tokens included, as the model sees it)."""
  texts = [build_prompt(ex, tokenizer, system_prompt) for ex in dataset]
  # The template already wrote the special tokens as text; adding them again would double-count BOS.
  ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
  return [len(x) for x in ids]


def filter_long_prompts(dataset: PromptDataset, tokenizer, max_prompt_tokens: int,
                        system_prompt: Optional[str] = SYSTEM_PROMPT) -> PromptDataset:
  """Drop examples whose templated prompt exceeds max_prompt_tokens; the drop count adds to num_filtered.

  Raises ValueError if nothing is left (a budget too small for any prompt is a config error).
  """
  if not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1:
    raise ValueError(f"{max_prompt_tokens=} must be a positive int")
  counts = prompt_token_counts(dataset.examples, tokenizer, system_prompt)
  kept = tuple(ex for ex, n in zip(dataset.examples, counts) if n <= max_prompt_tokens)
  dropped = len(dataset) - len(kept)
  if not kept:
    raise ValueError(f"all {len(dataset)} prompts of {dataset.name!r} exceed {max_prompt_tokens=} "
                     f"(shortest has {min(counts)} tokens)")
  return dataclasses.replace(dataset, examples=kept, num_filtered=dataset.num_filtered + dropped)
