"""Config checks that run before anything is loaded or compiled, each error naming the offending value.

`validate_config` needs only the config (so a typo costs a second, not a model load); `validate_model`
checks what depends on the loaded model and tokenizer (positions, vocabulary) before the first compile.
Unknown keys never get this far: configs are locked, so `--config.train.lernig_rate=1` fails at parse.
"""

from __future__ import annotations

import math
import os

from qerl_jax.model.config import MERGEABLE_GROUPS, TRAIN_ATTENTION, parse_merged_launches
from qerl_jax.rl import LOSS_TYPES
from qerl_jax.rl.aqn import DEFAULT_TARGETS, SCHEDULES, sigma_per_stage
from qerl_jax.train.setup import BUILTIN_SMOLLM2, EVAL_DATASETS, TRAIN_DATASETS

QUANTS = ("bf16", "nf4", "mxfp4", "nvfp4")
DTYPES = ("bfloat16", "float32", "float16")
AQN_TARGETS = DEFAULT_TARGETS + ("q_norm", "k_norm")


class ConfigError(ValueError):
  """A config value out of range or a file that does not exist."""


def _need(ok: bool, message: str) -> None:
  if not ok:
    raise ConfigError(message)


def _check_source(path: str, what: str) -> None:
  """A local path must exist; `owner/name` is a hub id (checked when downloaded); builtin:smollm2 a wheel."""
  if path == BUILTIN_SMOLLM2:
    from qerl_jax.assets import smollm2_gguf_path  # pylint: disable=import-outside-toplevel
    smollm2_gguf_path()  # raises FileNotFoundError with the install command
    return
  local = os.path.expanduser(path)
  looks_local = local.startswith((".", "/", "~")) or local.endswith(".gguf") or local.count("/") != 1
  if looks_local and not os.path.exists(local):
    raise FileNotFoundError(f"{what}={path!r} does not exist (give a model directory, a .gguf file, a hub id "
                            f"owner/name, or {BUILTIN_SMOLLM2!r})")


def aqn_targets(config) -> tuple[str, ...]:
  return tuple(t.strip() for t in config.aqn.targets.split(",") if t.strip())


def validate_config(config) -> None:
  """Raises ConfigError (or FileNotFoundError) for the first bad value found."""
  _need(config.mode in ("train", "eval"), f"mode={config.mode!r} must be 'train' or 'eval'")
  _need(isinstance(config.seed, int) and config.seed >= 0, f"seed={config.seed!r} must be an int >= 0")

  m = config.model
  _need(m.quant in QUANTS, f"model.quant={m.quant!r} must be one of {QUANTS}")
  _need(m.dtype in DTYPES, f"model.dtype={m.dtype!r} must be one of {DTYPES}")
  _need(m.lora_rank >= 1, f"model.lora_rank={m.lora_rank} must be >= 1 (the trainer trains LoRA adapters)")
  _need(m.lora_alpha > 0, f"model.lora_alpha={m.lora_alpha} must be > 0")
  _need(m.get("decode_layers", "unrolled") in ("unrolled", "scan"),
        f"model.decode_layers={m.get('decode_layers')!r} must be 'unrolled' or 'scan'")
  _need(m.get("train_attention", "auto") in TRAIN_ATTENTION,
        f"model.train_attention={m.get('train_attention')!r} must be one of {TRAIN_ATTENTION}")
  merged = parse_merged_launches(m.get("rollout_merged_launches", "auto"))
  _need(merged is None or set(merged) <= set(MERGEABLE_GROUPS),
        f"model.rollout_merged_launches={m.get('rollout_merged_launches')!r} must be 'auto', 'none' or "
        f"comma-separated groups of {MERGEABLE_GROUPS}")
  _need(not merged or m.get("decode_layers", "unrolled") == "unrolled",
        f"model.rollout_merged_launches={m.get('rollout_merged_launches')!r} needs model.decode_layers='unrolled'")
  if m.random.model_type:
    _need(m.random.model_type in ("llama", "qwen2", "qwen3"),
          f"model.random.model_type={m.random.model_type!r} must be llama, qwen2 or qwen3")
    _need(bool(m.tokenizer), "model.random.model_type is set, so model.tokenizer must name a tokenizer")
    _need(m.random.hidden_size % m.random.num_attention_heads == 0,
          f"model.random.hidden_size={m.random.hidden_size} must be divisible by "
          f"num_attention_heads={m.random.num_attention_heads}")
  else:
    _need(bool(m.path), "model.path is empty: give a model (or model.random.model_type for random weights)")
    _check_source(m.path, "model.path")
  if m.tokenizer:
    _check_source(m.tokenizer, "model.tokenizer")

  d, r, t, e = config.data, config.rollout, config.train, config.eval
  _need(d.name in TRAIN_DATASETS, f"data.name={d.name!r} must be one of {TRAIN_DATASETS}")
  if d.path:
    _need(os.path.exists(os.path.expanduser(d.path)), f"data.path={d.path!r} does not exist")
  _need(d.max_prompt_tokens >= 1, f"data.max_prompt_tokens={d.max_prompt_tokens} must be >= 1")
  _need(d.num_examples >= 0, f"data.num_examples={d.num_examples} must be >= 0")
  _need(d.few_shot >= 0, f"data.few_shot={d.few_shot} must be >= 0")
  _need(d.few_shot == 0 or d.name == "arithmetic",
        f"data.few_shot={d.few_shot} needs data.name='arithmetic' (demonstrations come from that generator)")

  g = r.samples_per_prompt
  _need(g >= 1, f"rollout.samples_per_prompt={g} must be >= 1")
  _need(t.scale_rewards in ("group", "batch", "none"),
        f"train.scale_rewards={t.scale_rewards!r} must be group, batch or none")
  if t.scale_rewards == "group":
    _need(g >= 2, f"rollout.samples_per_prompt={g} must be >= 2 to scale advantages by the group std")
  _need(r.temperature > 0, f"rollout.temperature={r.temperature} must be > 0 (training needs sampling)")
  _need(0 < r.top_p <= 1, f"rollout.top_p={r.top_p} must be in (0, 1]")
  _need(r.top_k >= 0, f"rollout.top_k={r.top_k} must be >= 0")
  _need(r.max_new_tokens >= 1, f"rollout.max_new_tokens={r.max_new_tokens} must be >= 1")
  _need(r.prompt_bucket >= 1, f"rollout.prompt_bucket={r.prompt_bucket} must be >= 1")

  _need(t.steps >= 1, f"train.steps={t.steps} must be >= 1")
  _need(t.batch_size >= 1 and t.batch_size % g == 0,
        f"train.batch_size={t.batch_size} must be a positive multiple of rollout.samples_per_prompt={g}")
  _need(t.micro_batch_size >= 1 and t.batch_size % t.micro_batch_size == 0,
        f"train.batch_size={t.batch_size} must be divisible by train.micro_batch_size={t.micro_batch_size}")
  _need(r.batch_size >= 0 and (r.batch_size == 0 or t.batch_size % r.batch_size == 0),
        f"train.batch_size={t.batch_size} must be divisible by rollout.batch_size={r.batch_size} (0 = all)")
  _need(t.num_iterations >= 1, f"train.num_iterations={t.num_iterations} must be >= 1")
  _need(t.learning_rate > 0 and math.isfinite(t.learning_rate),
        f"train.learning_rate={t.learning_rate} must be finite and > 0")
  _need(0 <= t.warmup_ratio < 1, f"train.warmup_ratio={t.warmup_ratio} must be in [0, 1)")
  _need(0 <= t.final_lr_ratio <= 1, f"train.final_lr_ratio={t.final_lr_ratio} must be in [0, 1]")
  for name in ("adam_b1", "adam_b2"):
    _need(0 <= t[name] < 1, f"train.{name}={t[name]} must be in [0, 1)")
  _need(t.adam_eps > 0, f"train.adam_eps={t.adam_eps} must be > 0")
  _need(t.weight_decay >= 0, f"train.weight_decay={t.weight_decay} must be >= 0")
  _need(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip} must be >= 0 (0 = off)")
  _need(t.loss_type in LOSS_TYPES, f"train.loss_type={t.loss_type!r} must be one of {LOSS_TYPES}")
  _need(t.importance_sampling_level in ("token", "sequence"),
        f"train.importance_sampling_level={t.importance_sampling_level!r} must be token or sequence")
  _need(t.eps_low >= 0 and t.eps_high >= 0, f"train.eps_low={t.eps_low} and eps_high={t.eps_high} must be >= 0")
  _need(t.kl_beta >= 0, f"train.kl_beta={t.kl_beta} must be >= 0")
  _need(t.tis_cap >= 0, f"train.tis_cap={t.tis_cap} must be >= 0 (0 = off)")
  _need(not (t.tis_cap > 0 and t.loss_type == "grpo"),
        "train.tis_cap > 0 weights tokens, which loss_type='grpo' would fold into its per-row normaliser; "
        "use bnpo, dapo or dr_grpo with it")
  _need(t.log_samples >= 0, f"train.log_samples={t.log_samples} must be >= 0")
  for name in ("logprob_chunk", "vocab_chunk", "length_bucket", "checkpoint_every", "keep_checkpoints",
               "max_nonfinite", "log_every"):
    _need(t[name] >= 1, f"train.{name}={t[name]} must be >= 1")

  a = config.aqn
  if a.enabled:
    _need(a.num_stages >= 3, f"aqn.num_stages={a.num_stages} must be >= 3 (stage 0 is noise-free, then at "
                             "least two noisy stages)")
    _need(a.schedule in SCHEDULES, f"aqn.schedule={a.schedule!r} must be one of {SCHEDULES}")
    try:
      sigma_per_stage(a.sigma_start, a.sigma_end, a.num_stages, a.schedule)
    except ValueError as err:
      raise ConfigError(f"aqn: {err}") from err
    targets = aqn_targets(config)
    _need(bool(targets) and set(targets) <= set(AQN_TARGETS),
          f"aqn.targets={a.targets!r} must be a comma-separated subset of {AQN_TARGETS}")

  from qerl_jax.rewards import REWARDS  # pylint: disable=import-outside-toplevel
  weights = dict(config.rewards)
  unknown = sorted(set(weights) - set(REWARDS))
  _need(not unknown, f"rewards {unknown} are not reward functions; known: {sorted(REWARDS)}")
  _need(all(math.isfinite(w) for w in weights.values()), f"reward weights {weights} must be finite")
  _need(config.correctness_reward in weights,
        f"correctness_reward={config.correctness_reward!r} must be one of the rewards {sorted(weights)}")

  _need(e.dataset in EVAL_DATASETS, f"eval.dataset={e.dataset!r} must be one of {EVAL_DATASETS}")
  if e.path:
    _need(os.path.exists(os.path.expanduser(e.path)), f"eval.path={e.path!r} does not exist")
  _need(e.num_examples >= 0, f"eval.num_examples={e.num_examples} must be >= 0")
  _need(e.num_samples >= 1, f"eval.num_samples={e.num_samples} must be >= 1")
  _need(e.temperature >= 0, f"eval.temperature={e.temperature} must be >= 0 (0 = greedy)")
  _need(0 < e.top_p <= 1, f"eval.top_p={e.top_p} must be in (0, 1]")
  _need(e.max_new_tokens >= 1, f"eval.max_new_tokens={e.max_new_tokens} must be >= 1")
  _need(e.batch_size >= 1, f"eval.batch_size={e.batch_size} must be >= 1")
  _need(e.every >= 0, f"eval.every={e.every} must be >= 0")


def max_prompt_len(config) -> int:
  """Longest padded prompt a step can have: max_prompt_tokens rounded up to the prompt bucket."""
  bucket = config.rollout.prompt_bucket
  return -(-config.data.max_prompt_tokens // bucket) * bucket


def validate_model(config, model_config, tokenizer) -> None:
  """Checks that need the model: prompt + response within its positions, the tokenizer within its vocab."""
  limit = model_config.max_position_embeddings
  prompt = max_prompt_len(config)
  for where, new in (("rollout", config.rollout.max_new_tokens), ("eval", config.eval.max_new_tokens)):
    _need(prompt + new <= limit,
          f"data.max_prompt_tokens={config.data.max_prompt_tokens} (padded to {prompt}) + {where}.max_new_tokens="
          f"{new} = {prompt + new} exceeds the model's max_position_embeddings={limit}")
  _need(len(tokenizer) <= model_config.vocab_size,
        f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {model_config.vocab_size}")
  if config.aqn.enabled and not model_config.qk_norm:
    extra = sorted(set(aqn_targets(config)) & {"q_norm", "k_norm"})
    _need(not extra, f"aqn.targets names {extra}, but this {model_config.arch} model has no q/k norms")
