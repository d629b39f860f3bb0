"""GGUF (llama.cpp) files as a tensor source with Hugging Face names and layouts.

Tensors are dequantized one at a time with the `gguf` package's own NumPy dequantizers, so every quant
type it implements works and the numbers are llama.cpp's. llama.cpp stores the q and k projections of
Llama models with the rows of each head reordered (its convert script interleaves the two RoPE halves);
`unpermute_rows` restores the Hugging Face order, as transformers' GGUF loader does.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

_BLOCK_NAMES = {
  "input_layernorm.weight": "attn_norm.weight",
  "post_attention_layernorm.weight": "ffn_norm.weight",
  "self_attn.q_norm.weight": "attn_q_norm.weight",
  "self_attn.k_norm.weight": "attn_k_norm.weight",
  "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
  "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
  "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
_LAYER_RX = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Metadata arrays that can be huge and are not needed to build the model.
_SKIP_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.scores")


def gguf_name(hf_name: str) -> str:
  """The GGUF tensor name of a Hugging Face parameter name."""
  if hf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[hf_name]
  m = _LAYER_RX.fullmatch(hf_name)
  if m:
    layer, rest = m.groups()
    if rest in _BLOCK_NAMES:
      return f"blk.{layer}.{_BLOCK_NAMES[rest]}"
    for suffix in (".weight", ".bias"):
      if rest.endswith(suffix) and rest[: -len(suffix)] in _BLOCK_NAMES:
        return f"blk.{layer}.{_BLOCK_NAMES[rest[: -len(suffix)]]}{suffix}"
  raise KeyError(f"no GGUF name for {hf_name!r}")


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row permutation for `n_head` heads (rows = n_head * head_dim).

  llama.cpp stores, within each head, rows in the order (pair index, half) where HF has (half, pair
  index): view the rows as [head, pair, half] and swap the last two axes back.
  """
  rows = w.shape[0]
  if rows % (2 * n_head):
    raise ValueError(f"cannot unpermute {rows} rows into {n_head=} heads of even size")
  half = rows // n_head // 2
  return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource:
  """Tensors of a .gguf file under Hugging Face names, dequantized to float32 [N, K] on request."""

  def __init__(self, path: str):
    from gguf import GGUFReader  # pylint: disable=import-outside-toplevel
    if not os.path.isfile(path):
      raise FileNotFoundError(f"no GGUF file at {path}")
    self.path = path
    self.reader = GGUFReader(path)
    self.tensors = {t.name: t for t in self.reader.tensors}
    self.metadata = read_metadata(self.reader)
    self.arch = self.metadata.get("general.architecture")
    self._heads: dict[str, int] = {}

  def set_heads(self, num_heads: int, num_kv_heads: int) -> None:
    """Enables the q/k unpermutation (Llama only; Qwen GGUFs are not permuted)."""
    if self.arch == "llama":
      self._heads = {"self_attn.q_proj": num_heads, "self_attn.k_proj": num_kv_heads}

  def __contains__(self, hf_name: str) -> bool:
    try:
      return gguf_name(hf_name) in self.tensors
    except KeyError:
      return False

  def shape(self, hf_name: str) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-first (ne[0] = K); NumPy / PyTorch order is the reverse.
    return tuple(int(d) for d in reversed(self._tensor(hf_name).shape.tolist()))

  def check_supported(self, hf_name: str) -> None:
    """Raises ValueError if the `gguf` package cannot dequantize this tensor's type."""
    t = self._tensor(hf_name)
    try:
      self._dequantize(t, t.data[:1])
    except NotImplementedError:
      raise ValueError(f"GGUF tensor {t.name!r} ({hf_name}) has quant type {t.tensor_type.name}, which the "
                       "gguf package cannot dequantize") from None

  def get(self, hf_name: str) -> np.ndarray:
    """float32 tensor in Hugging Face layout ([N, K] for weights)."""
    t = self._tensor(hf_name)
    w = self._dequantize(t, t.data).reshape(self.shape(hf_name))
    m = _LAYER_RX.fullmatch(hf_name)
    if m and self._heads:
      for prefix, heads in self._heads.items():
        if m.group(2).startswith(prefix + "."):
          w = unpermute_rows(w, heads)
    return w

  @staticmethod
  def _dequantize(t, data) -> np.ndarray:
    from gguf import quants  # pylint: disable=import-outside-toplevel
    if t.tensor_type.name in ("I8", "I16", "I32", "I64"):
      raise NotImplementedError(t.tensor_type.name)  # integer tensors are not weights
    return np.asarray(quants.dequantize(np.asarray(data), t.tensor_type), np.float32)

  def _tensor(self, hf_name: str):
    name = gguf_name(hf_name)
    if name not in self.tensors:
      raise KeyError(f"tensor {name!r} ({hf_name}) not found in {self.path}")
    return self.tensors[name]


def read_metadata(reader) -> dict[str, Any]:
  """Scalar and small-array metadata of a GGUF file as Python values (big token tables as lengths)."""
  meta: dict[str, Any] = {}
  for key, field in reader.fields.items():
    if key.startswith("GGUF."):
      continue
    if key in _SKIP_FIELDS:
      meta[key + ".count"] = len(field.data)
      continue
    try:
      meta[key] = field.contents()
    except Exception:  # pylint: disable=broad-except
      continue  # a field type this gguf version cannot decode is not one the model needs
  return meta
