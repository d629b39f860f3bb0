"""The memory planner: peak device memory of a GRPO step, per device, before anything is compiled.

    p = plan(model_config, "nvfp4", batch=64, prompt_len=256, max_new_tokens=1024, mesh_shape=(1, 1, 1),
             lora_rank=32, micro_batch=8, remat=True)
    print(p.table()); check_fits(p, device_capacity())

A step has two phases that never overlap in time (the KV cache is a temporary of the rollout program and is
freed before the update runs): rollout (weights + adapters + optimizer state + KV cache + prefill and
sampling buffers, plus the "unrolled" decode loop's per-layer parameter copies) and update (the same
persistent state + gradient buffers + one micro-batch's activations + the chunked log-prob buffers). The
peak is the larger of the two.

Exact parts: weights (shapes from `jax.eval_shape` of the base, split per device by the partition rules of
`qerl_jax.sharding`), adapters, AdamW moments, KV cache, batch. Modelled parts: activations (the residual
stream saved per layer under remat, plus one layer's forward + backward working set: the attention scores
[b, H, block, S] in float32 (query blocks of attention.attend; with ModelConfig.train_attention='cudnn' the
mask as a bf16 bias [b, 1, S, S] and float32 softmax statistics instead), the MLP's float32 gate/up and their
gradients, ~12 hidden-sized buffers; without remat, every layer's residuals as JAX saves them and, on the XLA
path, every layer's dequantized weights) and the log-prob slices. XLA's buffer assignment reuses and fuses, so
those are an upper-bound style estimate; tests/test_memory.py measures the gap against
`compiled.memory_analysis()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from qerl_jax import sharding
from qerl_jax.model.base import empty_base, proj_shapes, schemes_for
from qerl_jax.model.config import ModelConfig
from qerl_jax.model.linear import PROJ_NAMES
from qerl_jax.model.transformer import SHARED_INPUT
from qerl_jax.quant.types import NVFP4Tensor, is_quantized

GB = 1e9


class PlanTooLarge(ValueError):
  """A plan's peak exceeds the device memory; the message names the knob to turn."""


@dataclasses.dataclass(frozen=True)
class Plan:
  """Bytes per device of each part of a GRPO step (see the module docstring)."""

  weights: int  # frozen base incl. block / global scales, embeddings, lm_head
  lora: int  # trainable adapters (+ trainable norm scales)
  optimizer: int  # AdamW mu and nu
  kv_cache: int  # rollout KV cache, prompt + new tokens
  rollout_work: int  # prefill activations (attention scores), decode logits and sampling buffers
  grads: int  # float32 accumulator + one micro-batch's gradients + the optimizer's update tree
  activations: int  # one micro-batch of the update, forward + backward
  logprob_buffers: int  # [b, chunk, vocab_chunk] float32 slices of the chunked log-probs
  batch: int  # the update's rollout batch (token ids, masks, log-probs)
  dequant: int  # transient dequantized weights where no fused kernel reads the packed ones
  layer_copies: int = 0  # the "unrolled" rollout's per-layer copies of what the kernels cannot read in place
  base_copy: int = 0  # the rollout's dequantized copy of the quantized base (ModelConfig.rollout_base_dtype)
  notes: tuple[str, ...] = ()

  @property
  def persistent(self) -> int:
    return self.weights + self.lora + self.optimizer

  @property
  def rollout_peak(self) -> int:
    return self.persistent + self.kv_cache + self.rollout_work + self.dequant + self.layer_copies + self.base_copy

  @property
  def update_peak(self) -> int:
    return self.persistent + self.grads + self.activations + self.logprob_buffers + self.batch + self.dequant

  @property
  def peak(self) -> int:
    return max(self.rollout_peak, self.update_peak)

  def as_dict(self) -> dict[str, float]:
    parts = {f.name: getattr(self, f.name) / GB for f in dataclasses.fields(self) if f.name != "notes"}
    return dict(parts, rollout_peak=self.rollout_peak / GB, update_peak=self.update_peak / GB,
                peak=self.peak / GB)

  def table(self) -> str:
    """A few lines for the log: every part in GB, then the two phase peaks."""
    rows = [f"  {name:16s} {value:9.3f} GB" for name, value in self.as_dict().items()]
    return "memory plan (per device):\n" + "\n".join(rows)


def _sizes(mesh_shape: Sequence[int] | Mapping[str, int] | None) -> dict[str, int]:
  if mesh_shape is None:
    return {a: 1 for a in sharding.MESH_AXES}
  if isinstance(mesh_shape, Mapping):
    return {a: int(mesh_shape.get(a, 1)) for a in sharding.MESH_AXES}
  if len(mesh_shape) != len(sharding.MESH_AXES):
    raise ValueError(f"{mesh_shape=} must give sizes for {sharding.MESH_AXES}")
  return dict(zip(sharding.MESH_AXES, map(int, mesh_shape)))


def _tree_bytes(abstract: Any, prefix: str, sizes: Mapping[str, int]) -> int:
  total = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
    name = f"{prefix}/{sharding.path_str(path)}"
    spec = sharding.spec_for(name, leaf.shape, sizes)
    total += sharding.local_bytes(leaf.shape, leaf.dtype, spec, sizes)
  return total


def _query_block(t: int, query_chunk: int) -> int:
  """Query rows per attention block for T queries (the near-equal blocks of attention.attend)."""
  if query_chunk <= 0 or t <= query_chunk:
    return t
  return _ceil_div(t, _ceil_div(t, query_chunk))


def _ceil_div(a: int, b: int) -> int:
  return -(-a // b)


def plan(model_config: ModelConfig, quant: str, batch: int, prompt_len: int, max_new_tokens: int,
         mesh_shape: Sequence[int] | Mapping[str, int] | None = None, lora_rank: int = 32,
         micro_batch: int = 8, remat: bool = True, *, rollout_batch: int = 0,
         lora_targets: Sequence[str] = PROJ_NAMES, train_norms: bool = True, lora_dtype: Any = np.float32,
         logprob_chunk: int = 256, vocab_chunk: int = 16384, fused_kernel: bool | None = None,
         update_len: int | None = None, xla_min_rows: int | None = None) -> Plan:
  """Estimated bytes per device of one GRPO step.

  batch: completions per step (prompts x samples); rollout_batch: rows per rollout call (0 = batch).
  mesh_shape: (data, fsdp, tensor) sizes or a {axis: size} mapping (default one device).
  micro_batch: completions per update forward/backward. remat: per-layer rematerialization.
  fused_kernel: whether NVFP4 matmuls read the packed weights (default: quant == "nvfp4"); without one the
    XLA path dequantizes one layer's weights at a time. update_len: completion columns the update sees
    (default max_new_tokens). xla_min_rows: the device's crossover (`qerl_kernels.xla_min_rows()`) from which
    NVFP4 matmuls take the XLA path even with a fused kernel; an update micro-batch or prefill that large
    dequantizes one layer at a time.
  """
  for name, value in (("batch", batch), ("prompt_len", prompt_len), ("max_new_tokens", max_new_tokens),
                      ("lora_rank", lora_rank), ("micro_batch", micro_batch)):
    if value <= 0:
      raise ValueError(f"{name}={value} must be > 0")
  if batch % micro_batch:
    raise ValueError(f"{batch=} must be divisible by {micro_batch=}")
  sizes = _sizes(mesh_shape)
  cfg = model_config
  it = np.dtype(cfg.dtype).itemsize
  lora_it = np.dtype(lora_dtype).itemsize
  rows_split = sizes["data"] * sizes["fsdp"]
  tensor = sizes["tensor"]
  fused = (quant == "nvfp4") if fused_kernel is None else fused_kernel
  notes = []

  abstract = jax.eval_shape(lambda: empty_base(cfg, schemes_for(cfg, quant)))
  weights = _tree_bytes(abstract, "frozen", sizes)
  # ModelConfig.decode_layers == "unrolled": the rollout copies every layer parameter except the stacked
  # NVFP4 weights, which the kernels (or the XLA path, a layer at a time) read from the stack.
  copied = {name: ({k: v for k, v in p.items() if k != "w"} if isinstance(p, dict)
                   and isinstance(p.get("w"), NVFP4Tensor) else p) for name, p in abstract["layers"].items()}

  shapes = proj_shapes(cfg)
  lora_tree = {"layers": {name: {
    "lora_a": jax.ShapeDtypeStruct((cfg.num_layers, shapes[name][0], lora_rank), lora_dtype),
    "lora_b": jax.ShapeDtypeStruct((cfg.num_layers, lora_rank, shapes[name][1]), lora_dtype)}
    for name in lora_targets}}
  if train_norms:
    for name in ("input_layernorm", "post_attention_layernorm"):
      lora_tree["layers"][name] = jax.ShapeDtypeStruct((cfg.num_layers, cfg.hidden_size), np.float32)
  lora = _tree_bytes(lora_tree, "params", sizes)
  # The unrolled rollout also holds each layer's A's of q|k|v and gate|up side by side (`unstack_layers`).
  shared = [[name for name in group if name in lora_targets] for group in SHARED_INPUT.values()]
  shared_a = {name: {"lora_a": lora_tree["layers"][name]["lora_a"]} for names in shared if len(names) > 1
              for name in names}
  # ModelConfig.rollout_lora_dtype: the rollout casts the adapters once (a stacked copy in that dtype), and the
  # unrolled layers copy the cast ones.
  cast_copy, layer_lora = 0, lora
  if cfg.rollout_lora_dtype and np.dtype(cfg.rollout_lora_dtype) != np.dtype(lora_dtype):
    recast = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, cfg.rollout_lora_dtype), t)  # noqa: E731
    adapters = {"layers": {n: p for n, p in lora_tree["layers"].items() if n in lora_targets}}
    cast_copy = _tree_bytes(recast(adapters), "params", sizes)
    layer_lora = lora - _tree_bytes(adapters, "params", sizes) + cast_copy
    shared_a = recast(shared_a)
  layer_copies = cast_copy + (_tree_bytes({"layers": copied}, "frozen", sizes) + layer_lora
                              + _tree_bytes({"layers": shared_a}, "params", sizes)
                              if cfg.decode_layers == "unrolled" else 0)
  # ModelConfig.rollout_base_dtype: the rollout's dequantized copy of each quantized projection weight (per
  # layer when unrolled, stacked in the scan: the same bytes), split as a 16-bit base would be.
  base_copy = 0
  if cfg.rollout_base_dtype:
    dense_copy = {name: {"w": jax.ShapeDtypeStruct((cfg.num_layers, *shapes[name]), cfg.rollout_base_dtype)}
                  for name, p in abstract["layers"].items() if isinstance(p, dict) and is_quantized(p.get("w"))}
    base_copy = _tree_bytes({"layers": dense_copy}, "frozen", sizes)
  lora_f32 = lora * 4 // lora_it if lora_it != 4 else lora
  optimizer = 2 * lora
  grads = 2 * lora_f32 + lora  # f32 accumulator, one micro-batch's grads (f32 inside), the update tree

  # Rollout: KV cache [L, B, P+N, Hkv, Dh] over (data, fsdp) rows and tensor heads.
  r_rows = _ceil_div(rollout_batch or batch, rows_split)
  cache_len = prompt_len + max_new_tokens
  kv_heads = cfg.num_kv_heads // tensor if cfg.num_kv_heads % tensor == 0 else cfg.num_kv_heads
  heads = cfg.num_heads // tensor if cfg.num_heads % tensor == 0 else cfg.num_heads
  ffn = cfg.intermediate_size // tensor if cfg.intermediate_size % tensor == 0 else cfg.intermediate_size
  kv_cache = 2 * cfg.num_layers * r_rows * cache_len * kv_heads * cfg.head_dim * it
  # Prefill of one layer: scores f32 + probs, float32 gate/up, ~8 hidden buffers;
  # decode: float32 logits with a few sort/cumsum copies for top-p.
  # The prefill's queries see the prompt's slots only, in query blocks (transformer.forward, attention.attend).
  q_block = _query_block(prompt_len, cfg.attn_query_chunk)
  prefill = r_rows * (q_block * heads * prompt_len * (4 + it) + prompt_len * (2 * ffn * 4 + 8 * cfg.hidden_size * it))
  decode = 4 * r_rows * cfg.vocab_size * 4
  rollout_work = max(prefill, decode) + 2 * r_rows * cache_len * 4  # + token / log-prob buffers

  # Update: one micro-batch of b rows, S = P + N positions.
  b = _ceil_div(micro_batch, rows_split)
  n_cols = update_len or max_new_tokens
  seq = prompt_len + n_cols
  d = cfg.hidden_size
  if cfg.train_attention_impl == "cudnn":  # fused: the mask as a [b, 1, S, S] bias, float32 softmax statistics
    attn_saved = b * seq * seq * it + b * heads * seq * 4
  else:
    attn_saved = b * heads * _query_block(seq, cfg.attn_query_chunk) * seq * (4 + it)  # f32 scores and probs
  mlp_saved = b * seq * ffn * (2 * 4 + it)  # f32 gate, up; their product in the model dtype
  hidden_saved = b * seq * (8 * d + 2 * cfg.q_size + 2 * cfg.kv_size) * it  # norms, q/k/v, o, residuals
  lora_saved = b * seq * lora_rank * len(lora_targets) * lora_it
  one_layer = attn_saved + mlp_saved + hidden_saved + lora_saved
  # The backward of one layer holds its saved values plus gradients of about the same size.
  working = 2 * one_layer
  if remat and cfg.remat_policy != "nothing_saveable":
    # A policy that saves some values (dots, names) holds at most what no remat holds: plan that bound.
    notes.append(f"remat_policy={cfg.remat_policy!r} saves values: the activations are planned as without remat")
    remat = False
  if remat:
    activations = cfg.num_layers * b * seq * d * it + working
  else:
    activations = cfg.num_layers * _residuals_per_layer(cfg, b, seq, heads, ffn, lora_rank * len(lora_targets),
                                                        lora_it) + working
  activations += 2 * b * seq * d * 4  # final hidden states and their float32 gradient
  vc = min(vocab_chunk, cfg.vocab_size)
  chunk = min(logprob_chunk, n_cols)
  logprob_buffers = 4 * b * chunk * vc * 4  # logits, exp, and both again in the backward
  batch_bytes = _ceil_div(batch, rows_split) * (prompt_len * 5 + n_cols * (4 + 1 + 4 * 3) + 16)

  # The largest matmul batches: an update micro-batch, or a rollout's prefill.
  most_rows = max(b * seq, r_rows * prompt_len)
  large = fused and quant == "nvfp4" and xla_min_rows is not None and most_rows >= xla_min_rows
  if quant != "bf16" and (not fused or large):
    dense = sum(k * n for k, n in shapes.values()) * it
    # One layer's weights at a time: the recomputed forward and the backward of a layer share them. On the
    # H200 (7B, 10240-row update micro-batches on the XLA path, a78fc51) the peak was 0.4 GB below the
    # fused-kernel run's, so no second dequantized layer is alive at the peak.
    dequant = dense // (sizes["fsdp"] * tensor)
    notes.append("no fused kernel: one layer's weights are dequantized at a time" if not fused else
                 f"matmuls of {most_rows} rows >= xla_min_rows={xla_min_rows} dequantize one layer's weights "
                 "at a time")
    if not remat and (not fused or b * seq >= xla_min_rows):
      # The update's matmuls dequantize (not only a prefill's), and without remat the backward reads each layer's
      # dequantized weights, so the forward keeps them all.
      dequant *= cfg.num_layers
      notes.append("without remat every layer's dequantized weights are saved for the backward")
  else:
    dequant = 0
  return Plan(weights=weights, lora=lora, optimizer=optimizer, kv_cache=kv_cache, rollout_work=rollout_work,
              grads=grads, activations=activations, logprob_buffers=logprob_buffers, batch=batch_bytes,
              dequant=dequant, layer_copies=layer_copies, base_copy=base_copy, notes=tuple(notes))


def _residuals_per_layer(cfg: ModelConfig, b: int, seq: int, heads: int, ffn: int, lora_cols: int,
                         lora_it: int) -> int:
  """Bytes one layer's forward saves for its backward without remat, as `jax.ad_checkpoint.saved_residuals`
  lists them for the update's loss (7B shapes, bf16, one row; listed at 49158f2): six float32 [b, S, ffn] MLP
  values (gate, up, their adapter sums, SiLU, the product), eight float32 [b, S, d] ones (norms, residual
  stream, adapter sums), the attention's inputs and what it keeps (below), and the adapters' x @ A. A 7B
  update of 4-row micro-batches without remat asked the H100 for 93.6 GiB where the per-layer working set
  alone had planned 48.6 GB."""
  it = np.dtype(cfg.dtype).itemsize
  qkv = b * seq * (cfg.q_size + 2 * cfg.kv_size) * it
  if cfg.train_attention_impl == "cudnn":  # q, k, v, the output, softmax statistics, the mask as a bias
    attention = qkv + b * seq * cfg.q_size * it + b * heads * seq * 4 + b * seq * seq * it
  elif cfg.attn_query_chunk <= 0 or seq <= cfg.attn_query_chunk:  # one block: float32 scores and probabilities
    attention = qkv + b * heads * seq * seq * (4 + it)
  else:  # query blocks are rematerialized (attention.attend): their inputs and the mask
    attention = qkv + b * seq * seq
  return 6 * b * seq * ffn * 4 + 8 * b * seq * cfg.hidden_size * 4 + attention + b * seq * lora_cols * lora_it


def device_capacity(device: Any = None) -> int | None:
  """Bytes the allocator may use on `device` (default the first), or None where the backend does not say
  (CPU)."""
  device = device or jax.local_devices()[0]
  try:
    stats = device.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    return None
  limit = stats.get("bytes_limit")
  return int(limit) if limit else None


def check_fits(p: Plan, capacity: int | None, *, headroom: float = 0.95) -> None:
  """Raises PlanTooLarge naming the knob to turn when the plan's peak exceeds headroom * capacity."""
  if capacity is None:
    return
  limit = int(capacity * headroom)
  if p.peak <= limit:
    return
  gb = lambda x: f"{x / GB:.1f} GB"  # noqa: E731
  head = (f"the step needs about {gb(p.peak)} per device (rollout {gb(p.rollout_peak)}, update "
          f"{gb(p.update_peak)}) but {gb(limit)} of {gb(capacity)} is usable")
  if p.persistent > limit:
    knob = (f"the weights, adapters and optimizer state alone take {gb(p.persistent)}: shard the base over "
            f"more devices (raise mesh.fsdp) or use a 4-bit model.quant")
  elif p.rollout_peak >= p.update_peak and p.base_copy > max(p.kv_cache, p.rollout_work, p.layer_copies):
    knob = (f"the rollout's dequantized copy of the base takes {gb(p.base_copy)}: set "
            f"model.rollout_base_dtype='' (the fused kernels read the 4-bit weights in place)")
  elif p.rollout_peak >= p.update_peak and p.layer_copies > max(p.kv_cache, p.rollout_work):
    knob = (f"the rollout's per-layer copies of the 16-bit layer parameters take {gb(p.layer_copies)}: set "
            f"model.decode_layers='scan' (slower decode, no copy) or use a 4-bit model.quant")
  elif p.rollout_peak >= p.update_peak:
    knob = (f"the rollout's KV cache is {gb(p.kv_cache)} and its prefill/sampling buffers "
            f"{gb(p.rollout_work)}: lower rollout.batch_size (rows per rollout call) or "
            f"rollout.max_new_tokens, or split rows over more devices (mesh.data / mesh.fsdp)")
  elif p.activations >= p.logprob_buffers:
    knob = (f"the update's activations are {gb(p.activations)}: lower train.micro_batch_size, set "
            f"model.remat=True, or lower rollout.max_new_tokens")
  else:
    knob = (f"the log-prob slices take {gb(p.logprob_buffers)}: lower train.logprob_chunk or "
            f"train.vocab_chunk (or train.micro_batch_size)")
  raise PlanTooLarge(f"{head}; {knob}.")


def plan_from_config(config, model_config: ModelConfig, mesh_shape=None) -> Plan:
  """`plan` for a trainer config (configs/common.py fields)."""
  c = config
  from qerl_jax.model.linear import resolve_targets  # pylint: disable=import-outside-toplevel
  fused = c.model.quant == "nvfp4" and jax.default_backend() == "gpu"
  xla_rows = None
  if fused:
    import qerl_kernels as kernels  # pylint: disable=import-outside-toplevel
    xla_rows = kernels.xla_min_rows()
  return plan(model_config, c.model.quant, c.train.batch_size, c.data.max_prompt_tokens,
              c.rollout.max_new_tokens, mesh_shape, c.model.lora_rank, c.train.micro_batch_size, c.model.remat,
              rollout_batch=c.rollout.batch_size, lora_targets=resolve_targets(c.model.lora_targets),
              train_norms=c.model.train_norms, logprob_chunk=c.train.logprob_chunk,
              vocab_chunk=c.train.vocab_chunk, fused_kernel=fused, xla_min_rows=xla_rows)
