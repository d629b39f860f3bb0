"""qerl-jax: QeRL (NVFP4 base + LoRA + adaptive quantization noise, GRPO/DAPO) in JAX.

Top-level names are imported lazily so that `import qerl_jax` stays cheap and a notebook can pull in
only what it uses.
"""

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
  "from_pretrained": "qerl_jax.model.loading",
  "save_peft_adapter": "qerl_jax.model.export",
  "load_peft_adapter": "qerl_jax.model.export",
  "save_merged": "qerl_jax.model.export",
  "generate": "qerl_jax.rollout.generate",
  "Completion": "qerl_jax.rollout.generate",
}


def __getattr__(name):
  if name in _LAZY:
    return getattr(importlib.import_module(_LAZY[name]), name)
  if name in ("quant", "rl", "rewards", "data", "model", "rollout", "train"):
    return importlib.import_module(f"qerl_jax.{name}")
  raise AttributeError(f"module 'qerl_jax' has no attribute {name!r}")


def __dir__():
  return sorted(list(globals()) + list(_LAZY))
