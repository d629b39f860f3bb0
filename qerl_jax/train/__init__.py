"""The QeRL trainer as a library: `train_and_evaluate(config, workdir)`, `evaluate(config, workdir)`.

Modules, one job each:
  logprobs   chunked per-token log-probs and entropies (never [B, T, V] float32)
  policy     completion log-probs of a merged model; the reference (adapters-off) params
  step       the jitted, micro-batched, donated policy update (and reference log-probs)
  optim      AdamW with masked weight decay, warmup + cosine, global-norm clipping
  state      the train state pytree
  rollouts   prompt padding/bucketing around the rollout engine, decoding
  checkpoint orbax checkpoints with config compatibility checks
  metrics_log metrics.jsonl, TensorBoard, progress bar, curves PNG
  validate   config and model checks before anything compiles
  setup      model, tokenizer and datasets from a config
  evaluate   pass@k evaluation
  loop       the training loop
"""

from qerl_jax.train.logprobs import token_logprobs, token_logprobs_reference  # noqa: F401
from qerl_jax.train.loop import NonFiniteUpdatesError, Trainer, evaluate, train_and_evaluate  # noqa: F401
from qerl_jax.train.state import TrainState, init_train_state  # noqa: F401
from qerl_jax.train.validate import ConfigError, validate_config  # noqa: F401
