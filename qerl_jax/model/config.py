"""Model configuration: one frozen dataclass for the Llama / Qwen2 / Qwen3 decoder family.

The three architectures share one code path; what differs is data here:
  llama  (incl. SmolLM2): optional `attention_bias` on q/k/v/o, optional `mlp_bias`.
  qwen2  (and Qwen2.5):   bias on q/k/v (always, as transformers hard-codes it), none on o.
  qwen3:                  RMSNorm on each q and k head before RoPE, `attention_bias` (normally False).

`ModelConfig.from_hf` reads a transformers config (a dict, a config object or a config.json path) in
both the 4.x layout (`rope_theta` + `rope_scaling`) and the 5.x layout (`rope_parameters`);
`ModelConfig.from_gguf_metadata` reads llama.cpp metadata. The dataclass is hashable, so it rides in
an NNX graphdef as static data.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MERGEABLE_GROUPS = ("qkv", "gate_up")  # transformer.SHARED_INPUT: projections of one input
TRAIN_ATTENTION = ("auto", "xla", "cudnn")  # ModelConfig.train_attention
_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # what cuDNN's fused attention takes
# Model types that are the Llama graph under another name.
_ARCH_ALIASES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a decoder; hashable (static under jit)."""

  arch: str  # one of SUPPORTED_ARCHS
  vocab_size: int
  hidden_size: int  # D
  intermediate_size: int  # F, the MLP width
  num_layers: int  # L
  num_heads: int  # H, query heads
  num_kv_heads: int  # Hkv (GQA: H % Hkv == 0)
  head_dim: int  # Dh
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  # Frozen (key, value) pairs of the HF rope scaling dict minus rope_theta, or () for plain RoPE.
  rope_scaling: tuple[tuple[str, Any], ...] = ()
  max_position_embeddings: int = 32768
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
  # Runtime choices (not architecture): activation / bf16-weight dtype, rematerialisation per layer.
  dtype: Any = jnp.bfloat16
  remat: bool = False  # jax.checkpoint around each scanned layer (training memory)
  remat_policy: str = "nothing_saveable"  # a name in jax.checkpoint_policies
  # Queries per attention block for long sequences (0: all at once); see attention.attend.
  attn_query_chunk: int = 1024
  # Attention of a forward without a KV cache (the log-prob pass and the update): "xla" (attention.attend:
  # float32 scores in memory, in attn_query_chunk blocks), "cudnn" (jax.nn.dot_product_attention's fused
  # cuDNN kernel, GPU only: the scores stay on chip) or "auto" (cudnn where pick_train_attention says cuDNN
  # takes the shapes, xla elsewhere). On an H100 at c619f2e (experiments/bench_train_attention.py, 7B, 8 x 1280)
  # cudnn took fwd+bwd 11.09 -> 2.28 ms per layer call, and the 7B GRPO step 22.97 -> 18.85 s (NVFP4), 25.17 ->
  # 21.13 s (bf16).
  train_attention: str = "auto"
  # One-token decode steps: "xla" (attention.attend over the layer's whole cache), "pallas"
  # (qerl_kernels.decode_attention reads the layer's cache in place, up to the token's own slot; interpret mode
  # off the GPU) or "auto" (pallas on a GPU, xla elsewhere). On an H200 at e7ec3b0 (7B, slot 768 of 1280)
  # pallas took the NVFP4 step 10.52 -> 9.76 ms at batch 64, 6.21 -> 6.03 at 8, and bf16 8.39 -> 7.41 at 64;
  # 5.31 vs 5.38 at batch 1 (noise).
  decode_attention: str = "auto"
  # Where a cached one-token decode step's gemv partial sums go, for the projections whose gemv computes the
  # adapter's x @ A (gemv_lora_xa): "pallas" to the kernel that ends the step they feed (kernels/
  # decode_residual_norm.py after o_proj and down_proj: sum, adapter, residual add and the next RMSNorm;
  # qerl_kernels/decode_swiglu.py after the gate|up launch; interpret mode off the GPU), "xla" to XLA's kernels (nine
  # per layer at a 7B batch-1 step), "auto" pallas on a GPU. On an H200, 7B NVFP4 kernel ms per step: e7ddf94
  # 3.24 / 4.33 at batch 1 / 2, e127210 (this and the gemvs reading x in place) 3.06 / 4.15; x in place alone
  # was -0.14 / -0.06 (86dbcd0).
  decode_partials: str = "auto"
  # With decode_partials on, the same kernels also end the step at the few rows the tile kernels take (3-16 on
  # an H200): those launches hand over their split-K partial sums, and x @ A comes from XLA as one partial (the
  # tile kernels have no x @ A programs), in place of the fused epilogue, XLA's sums of the partials and its
  # SwiGLU / RoPE / norm steps. Off until timed on a GPU (built at 8f7f91c, CPU-checked only).
  decode_partials_tiles: bool = False
  # With decode_partials on and the unrolled layer loop, the RMSNorm that ends a block (after o_proj and
  # down_proj) is not launched: the next gemv (gate|up, the next layer's q|k|v) reads the residual stream and
  # its blocks' sums of squares and normalizes x as it loads it (`qerl_kernels.nvfp4_gemv.NormPlan`), with the
  # same roundings; wherever that gemv does not apply the norm's own launch runs as before. Two launches fewer
  # per layer at 1-2 rows; on the CPU (kernel_sass, 7B gate|up at one row) the gemv's K loop grows 412 -> 434
  # instructions per trip (446 with a separate AQN noise vector, which rollouts no longer pass: they add the noise
  # to the norm scales once, `param_views.with_norm_noise`). Off until timed on a GPU.
  decode_norm_fold: bool = False
  # The rollout's layer loop (`qerl_jax.rollout.engine`): "unrolled" copies, once per rollout, every layer
  # parameter the NVFP4 kernels cannot read in place (16-bit weights, adapters, norms, biases) into its own
  # buffer and keeps the KV cache per layer, so a decode step slices nothing; "scan" slices the stacked
  # arrays inside the step, which costs XLA a copy of each slice per token (the whole bf16 weight set per
  # token on an H200: experiments/RESULTS.md) but no extra memory.
  decode_layers: str = "unrolled"
  # NVFP4 projections add their bias and LoRA product in the matmul kernel's epilogue (one kernel instead of
  # several small ones per projection; qerl_kernels/nvfp4_epilogue.py), at calls of at most fused_lora_max_rows rows
  # (decode), except where gemv_lora_xa below takes the call (1-2 rows). On an H200 at e2d8b42 (7B): decode step
  # 9.21 -> 8.67 ms at batch 64 and 5.21 -> 5.19 at batch 8 (profile); rollout 7075.8 -> 7441.8 tok/s at batch
  # 64. Applied at every row count (with the trainer's float32 adapters), the GRPO step lost: update 9.81 ->
  # 11.83 s, log-probs 2.94 -> 3.15 s; the row limit alone brought both back (28aefa1). Past 64 rows with bf16
  # adapters it is untimed, so the limit keeps it to the rows where it was measured to win.
  # Adapters not in x's dtype (the trainer's float32 ones) stay with XLA: with them the batch-64 step went 9.00
  # -> 10.40 ms (28aefa1); see rollout_lora_dtype.
  fused_lora: bool = True
  fused_lora_max_rows: int = 64
  # NVFP4 projections at decode rows (the gemv engine, 1-2 rows) compute the adapter's x @ A inside the gemv's
  # launch (qerl_kernels/nvfp4_matmul_xa.py) instead of XLA's own small kernels for it (~21 us per 7B layer at batch
  # 1). On an H200 at 06e7c3c: 7B batch-1 step 4.60 -> 4.47 ms (profile), batch 2 6.21 -> 5.65 ms; rollout
  # 226.5 -> 234.8 tok/s. Elsewhere (more rows, CPU, a mesh) it changes nothing. It takes precedence over
  # fused_lora where both apply (fused_lora's gemv epilogue lost to it at one row, e0f3129).
  gemv_lora_xa: bool = True
  # The adapters' dtype inside a rollout: "" keeps theirs; "bfloat16" casts them once per rollout (as vLLM
  # holds LoRA weights in the model's dtype), so float32 adapters (the trainer's) reach the fused epilogue
  # above and the bf16 x @ A. The rollout then samples from the bf16-rounded adapters; the update still
  # differentiates the float32 ones (its old log-probs come from its own forward, not from the rollout).
  rollout_lora_dtype: str = ""
  # The quantized base weights' form inside a rollout: "" keeps them (NVFP4 through the fused kernels);
  # "bfloat16" dequantizes each once per rollout, before the decode loop, into a copy that lives for that
  # rollout only (the planner counts it). At a trainer's rollout batch the decode matmuls are no longer
  # weight-streaming bound, and there the kernels lose to XLA's bf16 dot: on an H200 (7B) the NVFP4 rollout
  # ran 0.71x bf16's tokens/s at batch 128 (41186a8), 0.83x at 64 and 1.04x at 8 (e2d8b42); with the copy
  # 0.98x at 128 and 0.99x at 64 (73f3cb7), for 10.5-13.8 GB more peak memory. The copy's weights are the XLA
  # path's (`quant.dequantize` to bf16, the training forward's from kernels' xla_min_rows rows on).
  rollout_base_dtype: str = ""
  # NVFP4 projection groups that share an input ("qkv", "gate_up") run as one matmul launch inside a rollout,
  # as vLLM merges them at load time, but with no merged copy: the launch reads each member's weight in place,
  # with its own global scale (`qerl_kernels.Nvfp4Group`). On an H200 at 276b6ce (7B NVFP4, `profile_decode
  # --merged-launches none auto`, same weights) this took the decode step 3.77 -> 3.45 ms at 1 row, 5.20 -> 4.94
  # at 8 and 12.75 -> 12.20 at 128, against one launch per projection.
  # None (the default) merges both groups wherever they can be: an NVFP4 base read in place (not
  # rollout_base_dtype's copy) by decode_layers="unrolled". A tuple asks for exactly those groups (and refuses
  # the scan); () merges nothing.
  rollout_merged_launches: tuple[str, ...] | None = None
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None
  # The source HF config as JSON (minus quantization_config), for export; "" when built from GGUF.
  hf_config_json: str = ""

  def __post_init__(self):
    # A numpy dtype compares and hashes consistently whether given as jnp.bfloat16, "bfloat16", ...
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    if self.arch not in SUPPORTED_ARCHS:
      raise ValueError(f"unsupported architecture {self.arch=}; supported: {SUPPORTED_ARCHS}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive int")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    if not callable(getattr(jax.checkpoint_policies, str(self.remat_policy), None)):
      raise ValueError(f"remat_policy={self.remat_policy!r} is not a policy in jax.checkpoint_policies "
                       "(e.g. 'nothing_saveable', 'dots_saveable')")
    if self.train_attention not in TRAIN_ATTENTION:
      raise ValueError(f"train_attention={self.train_attention!r} must be one of {TRAIN_ATTENTION}")
    if self.train_attention == "cudnn" and self.dtype not in _CUDNN_DTYPES:
      raise ValueError(f"train_attention='cudnn' needs dtype bfloat16 or float16 (cuDNN's fused attention), not "
                       f"{self.dtype}: use train_attention='xla'")
    if self.decode_attention not in ("xla", "pallas", "auto"):
      raise ValueError(f"decode_attention={self.decode_attention!r} must be 'xla', 'pallas' or 'auto'")
    if self.decode_partials not in ("xla", "pallas", "auto"):
      raise ValueError(f"decode_partials={self.decode_partials!r} must be 'xla', 'pallas' or 'auto'")
    if self.decode_layers not in ("unrolled", "scan"):
      raise ValueError(f"decode_layers={self.decode_layers!r} must be 'unrolled' or 'scan'")
    if not isinstance(self.fused_lora_max_rows, int) or self.fused_lora_max_rows < 0:
      raise ValueError(f"fused_lora_max_rows={self.fused_lora_max_rows!r} must be an int >= 0 (rows per call)")
    if self.rollout_lora_dtype not in ("", "bfloat16", "float16", "float32"):
      raise ValueError(f"rollout_lora_dtype={self.rollout_lora_dtype!r} must be '' (the adapters' own), "
                       "'bfloat16', 'float16' or 'float32'")
    if self.rollout_base_dtype not in ("", "bfloat16", "float16"):
      raise ValueError(f"rollout_base_dtype={self.rollout_base_dtype!r} must be '' (the stored base), "
                       "'bfloat16' or 'float16'")
    if self.rollout_merged_launches is not None:
      self._check_merged_launches()
    rope_type = self.rope_scaling_dict.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(f"unsupported {rope_type=}; supported: {SUPPORTED_ROPE_TYPES}")

  def _check_merged_launches(self):
    if isinstance(self.rollout_merged_launches, str):  # "qkv" would otherwise become ("q", "k", "v")
      raise ValueError(f"rollout_merged_launches={self.rollout_merged_launches!r} must be a tuple of groups "
                       f"such as {MERGEABLE_GROUPS}, () or None (the default)")
    object.__setattr__(self, "rollout_merged_launches", tuple(self.rollout_merged_launches))
    unknown = [g for g in self.rollout_merged_launches if g not in MERGEABLE_GROUPS]
    if unknown:
      raise ValueError(f"rollout_merged_launches={self.rollout_merged_launches!r}: {unknown} are not among the "
                       f"groups that share an input, {MERGEABLE_GROUPS}")
    if self.rollout_merged_launches and self.decode_layers != "unrolled":
      raise ValueError("rollout_merged_launches needs decode_layers='unrolled' (the merged weights are made "
                       "once per rollout, before the per-layer decode loop)")

  @property
  def rope_scaling_dict(self) -> dict[str, Any]:
    return dict(self.rope_scaling)

  @property
  def merged_launch_groups(self) -> tuple[str, ...]:
    """The groups a rollout merges (`rollout_merged_launches`; None: both where the layer loop allows it)."""
    if self.rollout_merged_launches is not None:
      return self.rollout_merged_launches
    return MERGEABLE_GROUPS if self.decode_layers == "unrolled" and not self.rollout_base_dtype else ()

  @property
  def train_attention_impl(self) -> str:
    """"xla" or "cudnn": train_attention with "auto" resolved for this process's first device."""
    device = jax.devices()[0]
    return pick_train_attention(self.train_attention, backend=jax.default_backend(),
                                compute_capability=getattr(device, "compute_capability", None), dtype=self.dtype,
                                head_dim=self.head_dim)

  @property
  def q_size(self) -> int:
    return self.num_heads * self.head_dim

  @property
  def kv_size(self) -> int:
    return self.num_kv_heads * self.head_dim

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_hf(cls, hf: Any, **overrides) -> "ModelConfig":
    """Builds a config from a transformers config object, its dict, or a config.json / model dir path.

    `overrides` set runtime fields (dtype, remat, ...). Unknown model types raise ValueError.
    """
    d = _as_dict(hf)
    model_type = d.get("model_type")
    if model_type not in _ARCH_ALIASES:
      raise ValueError(f"unsupported architecture {model_type=} (architectures={d.get('architectures')}); "
                       f"supported: {SUPPORTED_ARCHS}")
    arch = _ARCH_ALIASES[model_type]
    act = d.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"unsupported hidden_act={act!r}; only 'silu' (SwiGLU) is implemented")
    if d.get("use_sliding_window"):
      raise ValueError("use_sliding_window=True is not supported (full attention only)")
    hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    head_dim = d.get("head_dim") or hidden // heads
    theta, scaling = _rope_from_hf(d)
    attention_bias = bool(d.get("attention_bias", False))
    kw = dict(
      arch=arch,
      vocab_size=int(d["vocab_size"]),
      hidden_size=hidden,
      intermediate_size=int(d["intermediate_size"]),
      num_layers=int(d["num_hidden_layers"]),
      num_heads=heads,
      num_kv_heads=int(d.get("num_key_value_heads") or heads),
      head_dim=int(head_dim),
      rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
      rope_theta=theta,
      rope_scaling=scaling,
      max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
      tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
      qkv_bias=True if arch == "qwen2" else attention_bias,
      o_bias=attention_bias if arch in ("llama", "qwen3") else False,
      mlp_bias=bool(d.get("mlp_bias", False)) if arch == "llama" else False,
      qk_norm=arch == "qwen3",
      bos_token_id=d.get("bos_token_id"),
      eos_token_ids=_int_tuple(d.get("eos_token_id")),
      pad_token_id=d.get("pad_token_id"),
      hf_config_json=json.dumps({k: v for k, v in d.items() if k != "quantization_config"}, sort_keys=True,
                                default=str),
    )
    kw.update(overrides)
    return cls(**kw)

  @classmethod
  def from_gguf_metadata(cls, meta: dict[str, Any], *, tied: bool, **overrides) -> "ModelConfig":
    """Builds a config from llama.cpp GGUF metadata (`{arch}.block_count`, ...).

    `tied`: whether the file lacks `output.weight` (the lm_head then reuses the embedding).
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
      raise ValueError(f"unsupported GGUF architecture {arch=}; supported: {SUPPORTED_ARCHS}")

    def get(key, default=None):
      value = meta.get(f"{arch}.{key}", default)
      if value is None:
        raise ValueError(f"GGUF metadata lacks '{arch}.{key}'")
      return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                   or hidden // heads)
    vocab = meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens.count") or 0
    scaling: dict[str, Any] = {}
    stype = meta.get(f"{arch}.rope.scaling.type")
    if stype and stype != "none":
      scaling = {"rope_type": stype, "factor": float(get("rope.scaling.factor"))}
      if meta.get(f"{arch}.rope.scaling.original_context_length"):
        scaling["original_max_position_embeddings"] = int(meta[f"{arch}.rope.scaling.original_context_length"])
    kw = dict(
      arch=arch,
      vocab_size=int(vocab),
      hidden_size=hidden,
      intermediate_size=int(get("feed_forward_length")),
      num_layers=int(get("block_count")),
      num_heads=heads,
      num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
      head_dim=head_dim,
      rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
      rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
      rope_scaling=tuple(sorted(scaling.items())),
      max_position_embeddings=int(get("context_length", 32768)),
      tie_word_embeddings=tied,
      qkv_bias=arch == "qwen2",
      qk_norm=arch == "qwen3",
      bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
      eos_token_ids=_int_tuple(meta.get("tokenizer.ggml.eos_token_id")),
      pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    kw.update(overrides)
    return cls(**kw)

  def to_hf_dict(self) -> dict[str, Any]:
    """The transformers config.json dict of this model (the source's own when it came from HF)."""
    if self.hf_config_json:
      d = json.loads(self.hf_config_json)
    else:
      d = {"model_type": self.arch, "hidden_act": "silu", "initializer_range": 0.02, "use_cache": True}
      d["architectures"] = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                             "qwen3": "Qwen3ForCausalLM"}[self.arch]]
    rope = {"rope_type": "default", **self.rope_scaling_dict, "rope_theta": self.rope_theta}
    d.update(
      vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
      num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
      num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
      max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=self.tie_word_embeddings,
      rope_theta=self.rope_theta)
    if "rope_parameters" in d or not self.hf_config_json:
      d["rope_parameters"] = rope
    if self.rope_scaling:
      d["rope_scaling"] = rope
    if self.arch in ("llama", "qwen3"):
      d["attention_bias"] = self.qkv_bias
    if self.arch == "llama":
      d["mlp_bias"] = self.mlp_bias
    for key, value in (("bos_token_id", self.bos_token_id), ("pad_token_id", self.pad_token_id)):
      if value is not None:
        d[key] = value
    if self.eos_token_ids:
      d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
    return d


def parse_merged_launches(text: str) -> tuple[str, ...] | None:
  """`rollout_merged_launches` from text (a config file's, a flag's): "auto" -> None (both groups where they
  can be merged), "" or "none" -> (), "qkv,gate_up" -> ("qkv", "gate_up")."""
  text = str(text).strip()
  if text == "auto":
    return None
  return () if text in ("", "none") else tuple(g.strip() for g in text.split(","))


def rope_inv_freq(config: ModelConfig) -> tuple[np.ndarray, float]:
  """float32 inverse frequencies [Dh/2] of RoPE and the cos/sin multiplier (HF's attention_scaling)."""
  dim, base = config.head_dim, config.rope_theta
  inv = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim))
  s = config.rope_scaling_dict
  rope_type = s.get("rope_type", "default")
  scale = 1.0
  if rope_type == "linear":
    inv = inv / float(s["factor"])
  elif rope_type == "llama3":
    factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old_ctx / lo, inv / factor, inv)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    inv = np.where(medium, blended, scaled)
  elif rope_type == "yarn":
    inv, scale = _yarn(config, inv, s)
  return inv.astype(np.float32), float(scale)


def _yarn(config: ModelConfig, inv: np.ndarray, s: dict[str, Any]) -> tuple[np.ndarray, float]:
  # YaRN (arXiv 2309.00071): keep high frequencies, interpolate low ones, blend with a linear ramp
  # between the dimensions that make beta_fast and beta_slow full rotations over the original context.
  dim, base = config.head_dim, config.rope_theta
  orig = float(s.get("original_max_position_embeddings") or config.max_position_embeddings)
  factor = s.get("factor") or config.max_position_embeddings / orig
  factor = float(factor)

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  attention = s.get("attention_factor")
  if attention is None:
    if s.get("mscale") and s.get("mscale_all_dim"):
      attention = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
    else:
      attention = mscale(factor)
  fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

  def corr_dim(rotations):
    return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

  lo, hi = corr_dim(fast), corr_dim(slow)
  if s.get("truncate", True):
    lo, hi = math.floor(lo), math.ceil(hi)
  lo, hi = max(lo, 0), min(hi, dim - 1)
  if lo == hi:
    hi += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
  keep = 1 - ramp
  inv = (inv / factor) * (1 - keep) + inv * keep
  return inv, float(attention)


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, tuple[tuple[str, Any], ...]]:
  params = d.get("rope_parameters") or d.get("rope_scaling") or {}
  if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
    raise ValueError(f"per-layer-type rope_parameters are not supported: {sorted(params)}")
  params = dict(params)
  theta = float(params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
  if "type" in params and "rope_type" not in params:
    params["rope_type"] = params.pop("type")
  params.pop("type", None)
  if params.get("rope_type", "default") == "default":
    return theta, ()
  if params["rope_type"] in ("yarn", "llama3") and not params.get("original_max_position_embeddings"):
    params["original_max_position_embeddings"] = int(d.get("max_position_embeddings", 32768))
  return theta, tuple(sorted((k, v) for k, v in params.items() if v is not None))


def pick_train_attention(choice: str, *, backend: str, compute_capability: str | None, dtype: Any,
                         head_dim: int) -> str:
  """What train_attention=choice runs: "auto" is "cudnn" where cuDNN's fused attention takes the shapes (a CUDA GPU
  of compute capability 8.0 or later, bf16 or fp16, a head dim that is a multiple of 8 up to 128, or 256 from
  Hopper on: the flash kernel's limits as jax.nn.dot_product_attention checks them; odd lengths are padded by
  attention.fused_attend), "xla" elsewhere (the CPU, ROCm, float32)."""
  if choice != "auto":
    return choice
  try:
    major_minor = tuple(int(x) for x in str(compute_capability).split("."))
  except ValueError:  # None (the CPU) or a ROCm target such as "gfx90a"
    return "xla"
  fits = (backend == "gpu" and major_minor >= (8, 0)
          and jnp.dtype(dtype) in _CUDNN_DTYPES
          and head_dim % 8 == 0 and head_dim <= (256 if major_minor >= (9, 0) else 128))
  return "cudnn" if fits else "xla"


def _as_dict(hf: Any) -> dict[str, Any]:
  if isinstance(hf, dict):
    return dict(hf)
  if isinstance(hf, (str, os.PathLike)):
    path = os.fspath(hf)
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"no config.json at {path}")
    with open(path) as f:
      return json.load(f)
  if hasattr(hf, "to_dict"):
    return hf.to_dict()
  raise TypeError(f"cannot read a model config from {type(hf).__name__}")


def _int_tuple(value: Any) -> tuple[int, ...]:
  if value is None:
    return ()
  if isinstance(value, (list, tuple)):
    return tuple(int(v) for v in value)
  return (int(value),)
