"""Tokenizers of model directories and GGUF files, with a GGUF's converted tokenizer cached on disk.

transformers rebuilds a GGUF's tokenizer from its vocabulary and merges on every load (about 10-20 s for
SmolLM2's 49k tokens). The result is saved once under ~/.cache/qerl_jax/tokenizers, keyed by the file's
absolute path, size and mtime, so an edited or replaced file gets a fresh conversion.
"""

from __future__ import annotations

import hashlib
import os
import shutil


def gguf_cache_dir(gguf: str) -> str:
  """Where the converted tokenizer of `gguf` is (or would be) cached."""
  stat = os.stat(gguf)
  tag = hashlib.sha1(f"{os.path.abspath(gguf)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "qerl_jax", "tokenizers", tag)


def load_gguf_tokenizer(gguf: str):
  """The tokenizer of a .gguf file: from the cache when present, else converted by transformers and cached."""
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel
  if not os.path.isfile(gguf):
    raise FileNotFoundError(f"tokenizer file {gguf} does not exist")
  cache = gguf_cache_dir(gguf)
  if os.path.isfile(os.path.join(cache, "tokenizer_config.json")):
    return AutoTokenizer.from_pretrained(cache)
  tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf) or ".", gguf_file=os.path.basename(gguf))
  tmp = f"{cache}.tmp-{os.getpid()}"
  try:  # write then rename, so a concurrent or killed writer never leaves a half-written cache
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    os.replace(tmp, cache)
  except OSError:  # a read-only home or a writer that won the race: this load still has its tokenizer
    shutil.rmtree(tmp, ignore_errors=True)
  return tokenizer
