"""A deterministic, resumable stream of prompt batches.

Epoch e visits the dataset in the order permutation(seed, e): a fresh shuffle per epoch that depends
only on (seed, epoch), so the stream is a pure function of (seed, position). A batch that reaches the
end of an epoch continues into the next one, so every batch has exactly `batch_prompts` prompts and no
example is skipped. `state()` is a small dict of ints to store in a checkpoint; `restore(state)`
continues at the same place.
"""

from typing import Dict, List

import numpy as np

from qerl_jax.data.example import Example


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
  """int64[num_examples] visiting order of an epoch: a permutation keyed by (seed, epoch)."""
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


class PromptSampler:
  """Yields lists of `batch_prompts` Examples forever (iterate, or call `next_batch`).

  Args:
    dataset: a sequence of Examples (e.g. a PromptDataset), not empty.
    batch_prompts: prompts per batch (each is later repeated G times for its group).
    seed: the shuffle seed (an int >= 0).
    shuffle: False visits the dataset in file order every epoch (evaluation).
  """

  def __init__(self, dataset, batch_prompts: int, seed: int = 0, shuffle: bool = True):
    if len(dataset) == 0:
      raise ValueError("dataset is empty")
    if not isinstance(batch_prompts, int) or batch_prompts < 1:
      raise ValueError(f"{batch_prompts=} must be a positive int")
    if not isinstance(seed, int) or seed < 0:
      raise ValueError(f"{seed=} must be an int >= 0")
    self._dataset = dataset
    self._batch = batch_prompts
    self._seed = seed
    self._shuffle = shuffle
    self._epoch = 0
    self._pos = 0
    self._order = self._make_order(0)

  def _make_order(self, epoch: int) -> np.ndarray:
    n = len(self._dataset)
    return epoch_order(n, self._seed, epoch) if self._shuffle else np.arange(n)

  @property
  def epoch(self) -> int:
    """Current epoch (0-based): the epoch of the next prompt to be served."""
    return self._epoch

  def next_batch(self) -> List[Example]:
    """The next `batch_prompts` examples."""
    out = []
    while len(out) < self._batch:
      if self._pos == len(self._order):
        self._epoch += 1
        self._pos = 0
        self._order = self._make_order(self._epoch)
      take = min(self._batch - len(out), len(self._order) - self._pos)
      out.extend(self._dataset[int(i)] for i in self._order[self._pos:self._pos + take])
      self._pos += take
    return out

  def __iter__(self):
    return self

  def __next__(self) -> List[Example]:
    return self.next_batch()

  def state(self) -> Dict[str, int]:
    """Position to checkpoint: {seed, epoch, position, num_examples, batch_prompts, shuffle}."""
    return {"seed": self._seed, "epoch": self._epoch, "position": self._pos,
            "num_examples": len(self._dataset), "batch_prompts": self._batch, "shuffle": int(self._shuffle)}

  def restore(self, state: Dict[str, int]):
    """Continue from a `state()`; the dataset, seed and shuffle flag must match the saved ones."""
    for key, mine in (("seed", self._seed), ("num_examples", len(self._dataset)),
                      ("shuffle", int(self._shuffle))):
      if int(state[key]) != mine:
        raise ValueError(f"sampler state has {key}={state[key]} but this sampler has {key}={mine}")
    epoch, position = int(state["epoch"]), int(state["position"])
    if epoch < 0 or not 0 <= position <= len(self._dataset):
      raise ValueError(f"bad sampler state {epoch=} {position=} for {len(self._dataset)} examples")
    # batch_prompts may change on resume (a different batch size continues from the same prompt).
    self._epoch, self._pos = epoch, position
    self._order = self._make_order(epoch)
