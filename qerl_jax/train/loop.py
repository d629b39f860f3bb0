"""The QeRL training loop: `train_and_evaluate(config, workdir)` and `evaluate(config, workdir)`.

Each step: the next prompts from the resumable sampler -> G rollouts per prompt from the policy with this
step's AQN noise on its RMSNorm scales (key fold_in(aqn_key, step); sampling key fold_in(sample_key,
step)) -> rewards -> group advantages -> `num_iterations` jitted, micro-batched AdamW updates of the
noise-free policy -> metrics. A run is a pure function of its config and seed, so a resumed run
continues exactly where a checkpoint left it.
"""

from __future__ import annotations

import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qerl_jax import memory, sharding
from qerl_jax.data import PromptSampler
from qerl_jax.model import split_params
from qerl_jax.rewards import compute_rewards
from qerl_jax.rl import aqn, group_advantages, group_reward_stats
from qerl_jax.rollout.generate import default_stop_ids
from qerl_jax.rollout.sampling import SamplingParams
from qerl_jax.train import rollouts as rollouts_lib
from qerl_jax.train import setup
from qerl_jax.train.checkpoint import Checkpointer, IncompatibleCheckpointError
from qerl_jax.train.evaluate import run_eval
from qerl_jax.train.metrics_log import CURVES_FILE, MetricsLogger, plot_curves, truncate_metrics
from qerl_jax.train.optim import OptimizerSettings, make_optimizer
from qerl_jax.train.policy import count_lora_b, reference_params
from qerl_jax.train.state import data_position, device_part, init_train_state, sampler_state
from qerl_jax.train.step import UpdateSettings, jit_logprobs, jit_update
from qerl_jax.train.validate import aqn_targets, validate_config, validate_model


class NonFiniteUpdatesError(FloatingPointError):
  """Too many consecutive updates had a NaN/Inf loss or gradient (each was skipped, none was saved)."""


class Trainer:
  """Everything a run holds between steps. Built by `Trainer.create`; `train_and_evaluate` drives it."""

  def __init__(self, config, workdir: str, model, tokenizer, checkpointer: Checkpointer, resume_step,
               mesh=None):
    # `model` itself is not kept: its variables are the buffers of the first state, which the update donates.
    self.config, self.workdir = config, workdir
    self.model_config, self.tokenizer = model.config, tokenizer
    self.checkpointer = checkpointer
    c = config
    self.graphdef, trainable, self.frozen = split_params(model)
    if c.model.dequantize_base:
      self.frozen = setup.dequantize_frozen(self.frozen, model.config.dtype)
    params = trainable.to_pure_dict()
    self.ref_params = reference_params(params) if c.train.kl_beta > 0 else None
    if self.ref_params is not None and not count_lora_b(params):
      raise ValueError("kl_beta > 0 needs LoRA B matrices to switch the adapters off; none were found")
    self.group = c.rollout.samples_per_prompt
    self.dataset = setup.load_train_dataset(c, tokenizer)
    self.sampler = PromptSampler(self.dataset, c.train.batch_size // self.group, seed=c.seed)
    self.settings = UpdateSettings.from_config(c)
    self.update, self.optimizer, self.schedule = jit_update(
      self.graphdef, OptimizerSettings.from_config(c), self.settings)
    self.state = init_train_state(params, self.optimizer, c.seed, data_position(self.sampler.state()))
    if resume_step is not None:
      self.state = checkpointer.restore(resume_step, self.state)
      self.sampler.restore(sampler_state(self.state.data))
    self.mesh = mesh  # `mesh_from_config(config)`, built once by `create` (the base was loaded into it)
    if self.mesh is not None:  # split base, state and (per step) batches over the devices by the rules
      self.frozen = sharding.place(self.frozen, self.mesh, prefix="frozen")
      self.state = sharding.place(device_part(self.state), self.mesh).replace(data=self.state.data)
      self.update, self.optimizer, self.schedule = sharding.jit_update_sharded(
        self.graphdef, OptimizerSettings.from_config(c), self.settings, self.mesh, device_part(self.state),
        self.frozen)
    self.ref_logprobs = jit_logprobs(self.graphdef, self.settings) if self.ref_params is not None else None
    self.sampling = SamplingParams(temperature=c.rollout.temperature, top_p=c.rollout.top_p,
                                   top_k=c.rollout.top_k)
    self.stop_ids = default_stop_ids(tokenizer)
    self.pad_id = setup.pad_id(tokenizer)
    self.system = setup.system_prompt(c)
    self.noise_targets = aqn_targets(c)

  @classmethod
  def create(cls, config, workdir: str, log=print) -> "Trainer":
    """Validates, opens the workdir's checkpoints (refusing an incompatible one), loads model and data."""
    validate_config(config)
    os.makedirs(workdir, exist_ok=True)
    checkpointer = Checkpointer(workdir, keep=config.train.keep_checkpoints)
    resume = checkpointer.latest_step()
    if resume is not None:
      try:
        checkpointer.check_compatible(resume, config)
      except IncompatibleCheckpointError:
        if not config.train.restart:
          raise
        log(f"train.restart=True: moved the incompatible checkpoints to {checkpointer.move_aside()}")
        resume = None
    mesh = mesh_from_config(config)
    model, tokenizer = setup.build_model(config, mesh=mesh)
    validate_model(config, model.config, tokenizer)
    check_memory(config, model.config)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json_best_effort(indent=2))
    trainer = cls(config, workdir, model, tokenizer, checkpointer, resume, mesh)
    if resume is not None:
      log(f"resuming from step {resume}")
      logging.info("resuming from step %d", resume)
    return trainer

  # -- one step, split so the previous step's metrics are read while this step's rollout runs --

  def policy_state(self):
    """The full model state (current trainable params + frozen base) for the rollout engine."""
    return nnx.merge_state(nnx.State(self.state.params), self.frozen)

  def noise(self, step: int):
    """This step's AQN noise {norm: f32[L, D]} (zeros in stage 0), or None with AQN off."""
    a = self.config.aqn
    if not a.enabled:
      return None, 0.0
    sigma = float(aqn.sigma(step, self.config.train.steps, a.sigma_start, a.sigma_end, a.num_stages,
                            a.schedule))
    noise = aqn.norm_noise(self.state.aqn_key, step, self.model_config, jnp.float32(sigma),
                           self.noise_targets)
    return noise, sigma

  def start_rollout(self, step: int):
    examples = self.sampler.next_batch()
    encoded = setup.encode_examples(examples, self.tokenizer, self.system)
    prompts = [ids for ids in encoded for _ in range(self.group)]
    golds = [ex.gold_answer for ex in examples for _ in range(self.group)]
    noise, sigma = self.noise(step)
    pending = rollouts_lib.dispatch(
      self.graphdef, self.policy_state(), prompts, key=jax.random.fold_in(self.state.sample_key, step),
      norm_noise=noise, sampling=self.sampling, max_new_tokens=self.config.rollout.max_new_tokens,
      stop_ids=self.stop_ids, pad_id=self.pad_id, prompt_bucket=self.config.rollout.prompt_bucket,
      chunk=self.config.rollout.batch_size,
      rows_sharding=None if self.mesh is None else sharding.batch_sharding(self.mesh, 2))
    return pending, golds, sigma

  def finish_step(self, step: int, pending, golds, sigma):
    """Reads the rollout, scores it and dispatches the updates. Returns (host metrics, device metrics)."""
    c = self.config
    out = rollouts_lib.collect(pending, self.tokenizer)
    rewards_B, per_fn = compute_rewards(out.texts, golds, dict(c.rewards))
    scale = {"group": True, "none": False}.get(c.train.scale_rewards, c.train.scale_rewards)
    advantages_B = np.asarray(group_advantages(rewards_B, self.group, scale=scale))
    n = rollouts_lib.trimmed_length(out.lengths_B, c.rollout.max_new_tokens, c.train.length_bucket)
    batch = {
      "prompt_BxP": out.prompt_BxP, "prompt_valid_BxP": out.prompt_valid_BxP,
      "completion_BxN": out.completion_BxN[:, :n], "mask_BxN": out.mask_BxN[:, :n],
      "truncated_B": ~out.finished_B, "advantages_B": advantages_B.astype(np.float32),
      "old_logp_BxN": np.zeros_like(out.logprobs_BxN[:, :n]), "rollout_logp_BxN": out.logprobs_BxN[:, :n],
    }
    if self.mesh is not None:
      batch = sharding.place(batch, self.mesh, prefix="batch")
    update_start = time.perf_counter()
    if self.ref_logprobs is not None:
      batch["ref_logp_BxN"] = self.ref_logprobs(self.ref_params, self.frozen, batch)
    device_metrics = []
    state = device_part(self.state)
    for iteration in range(c.train.num_iterations):
      state, metrics, logp_BxN = self.update(state, self.frozen, batch, jnp.asarray(iteration == 0))
      batch["old_logp_BxN"] = logp_BxN
      device_metrics.append(metrics)
    self.state = state.replace(step=state.step + 1, data=data_position(self.sampler.state()))

    if c.train.log_samples:
      with open(os.path.join(self.workdir, "samples.jsonl"), "a") as f:
        for i in range(min(c.train.log_samples, len(out.texts))):
          f.write(json.dumps({"step": step + 1, "gold": golds[i], "completion": out.texts[i],
                              "reward": float(rewards_B[i]), "finished": bool(out.finished_B[i])}) + "\n")
    stats = group_reward_stats(rewards_B, self.group)
    host = {
      "reward/mean": float(rewards_B.mean()), "reward/std": float(rewards_B.std(ddof=1)) if rewards_B.size > 1
      else 0.0, "reward/frac_zero_std_groups": float(stats["frac_zero_std"]),
      "accuracy": float((per_fn[c.correctness_reward] > 0).mean()),
      "response_length/mean": float(out.lengths_B.mean()), "response_length/max": float(out.lengths_B.max()),
      "truncated_frac": float(1.0 - out.finished_B.mean()), "aqn/sigma": sigma,
      "time/rollout_s": out.seconds, "tokens_per_s": out.num_tokens / max(out.seconds, 1e-9),
      "update_length": float(n), "_update_start": update_start,
    }
    for name, values in per_fn.items():
      host[f"reward/{name}/mean"] = float(values.mean())
      host[f"reward/{name}/std"] = float(values.std(ddof=1)) if values.size > 1 else 0.0
    return host, device_metrics

  def read_metrics(self, host: dict, device_metrics: list) -> dict:
    """Blocks on a step's update metrics and merges them: entropy and rollout KL from the first iteration
    (the rollout-time policy), clip fractions, ratios, loss, grad norm and lr from the last."""
    first, last = jax.device_get(device_metrics[0]), jax.device_get(device_metrics[-1])
    metrics = dict(host)
    update_start = metrics.pop("_update_start")
    metrics["time/update_s"] = time.perf_counter() - update_start
    metrics["entropy"] = float(first["entropy"])
    metrics["aqn/rollout_kl"] = float(first["rollout_kl"])
    for name in ("loss", "grad_norm", "lr", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean",
                 "ratio_min", "ratio_max", "kl", "update_finite"):
      if name in last:
        metrics[name] = float(last[name])
    nonfinite = np.asarray(jax.device_get(self.state.nonfinite))
    metrics["nonfinite/consecutive"], metrics["nonfinite/total"] = float(nonfinite[0]), float(nonfinite[1])
    return metrics


def mesh_from_config(config):
  """The device mesh of `config.mesh`, or None for the single-device default (all sizes 1)."""
  spec = dict(config.mesh) if "mesh" in config else {}
  if all(int(v) == 1 for v in spec.values()):
    return None
  mesh = sharding.make_mesh(spec)
  logging.info("mesh: %s", sharding.describe(mesh))
  return mesh


def check_memory(config, model_config) -> memory.Plan:
  """Logs the memory plan of one step and refuses one that cannot fit the device (before compiling)."""
  spec = dict(config.mesh) if "mesh" in config else {}
  shape = sharding.mesh_shape(spec, jax.device_count()) if any(int(v) != 1 for v in spec.values()) else None
  plan = memory.plan_from_config(config, model_config, shape)
  logging.info("%s", plan.table())
  logging.info("log-prob and update attention: %s (model.train_attention=%r)", model_config.train_attention_impl,
               model_config.train_attention)
  memory.check_fits(plan, memory.device_capacity())
  return plan


def _check_nonfinite(metrics: dict, config, step: int) -> None:
  consecutive = int(metrics["nonfinite/consecutive"])
  if consecutive >= config.train.max_nonfinite:
    raise NonFiniteUpdatesError(
      f"{consecutive} consecutive updates up to step {step} had a NaN/Inf loss or gradient norm "
      f"(grad_norm={metrics.get('grad_norm')}, loss={metrics.get('loss')}; "
      f"{int(metrics['nonfinite/total'])} skipped in all). Each was skipped, so the parameters and the "
      "checkpoints stay finite; lower train.learning_rate or check the data, then resume from the workdir.")


def train_and_evaluate(config, workdir: str) -> dict:
  """Trains per `config`, checkpointing into `workdir` (resuming from it), then evaluates if eval.at_end.

  Returns the last step's metrics (and the eval report under "eval" when one ran).
  """
  trainer = Trainer.create(config, workdir)
  c = config
  start = int(trainer.state.step)
  logger = MetricsLogger(workdir, c.train.steps, start_step=start)
  truncate_metrics(os.path.join(workdir, "samples.jsonl"), start)  # same step-keyed lines as metrics.jsonl
  last: dict = {}
  pending_metrics = None  # (step, host, device) of the previous step, read while this step's rollout runs

  def flush():
    nonlocal pending_metrics, last
    if pending_metrics is None:
      return
    done, host, device = pending_metrics
    pending_metrics = None
    metrics = trainer.read_metrics(host, device)
    metrics["time/step_s"] = metrics["time/rollout_s"] + metrics["time/update_s"]
    if done % c.train.log_every == 0 or done == c.train.steps:
      logger.write(done, metrics)
    last = {"step": done, **metrics}
    _check_nonfinite(metrics, c, done)

  # Traced under the trainer's mesh, so the fused NVFP4 kernel maps itself over each device's rows.
  with sharding.mesh_context(trainer.mesh):
    try:
      for step in range(start, c.train.steps):
        rollout = trainer.start_rollout(step)
        flush()
        host, device = trainer.finish_step(step, *rollout)
        pending_metrics = (step + 1, host, device)
        if (step + 1) % c.train.checkpoint_every == 0 or step + 1 == c.train.steps:
          flush()  # never save before knowing the update was finite (a skipped one keeps the old params)
          trainer.checkpointer.save(trainer.state, c)
        if c.eval.every and (step + 1) % c.eval.every == 0 and step + 1 < c.train.steps:
          flush()
          _eval(trainer, step + 1, logger)
      flush()
    except NonFiniteUpdatesError:
      trainer.checkpointer.save(trainer.state, c)  # the kept (finite) params, so nothing is lost
      raise
    finally:
      logger.close()
      if os.path.exists(logger.path):
        plot_curves(logger.path, os.path.join(workdir, CURVES_FILE))
    if c.eval.at_end:
      last["eval"] = _eval(trainer, int(trainer.state.step), None)
  trainer.checkpointer.close()
  return last


def _trained_model(trainer: Trainer):
  return nnx.merge(trainer.graphdef, nnx.State(trainer.state.params), trainer.frozen)


def _eval(trainer: Trainer, step: int, logger) -> dict:
  out_dir = os.path.join(trainer.workdir, "eval", f"step_{step}")
  report = run_eval(_trained_model(trainer), trainer.tokenizer, trainer.config, out_dir, step=step)
  line = {k: v for k, v in report.items() if k.startswith("pass@") or k == "mean_reward"}
  (logger.message if logger is not None else print)(f"eval at step {step}: {json.dumps(line)}")
  return report


def evaluate(config, workdir: str) -> dict:
  """Evaluates the workdir's latest checkpoint (or the untrained model when there is none)."""
  validate_config(config)
  os.makedirs(workdir, exist_ok=True)
  checkpointer = Checkpointer(workdir, keep=config.train.keep_checkpoints)
  step = checkpointer.latest_step()
  if step is not None:
    checkpointer.check_compatible(step, config)
  model, tokenizer = setup.build_model(config)
  validate_model(config, model.config, tokenizer)
  graphdef, trainable, frozen = split_params(model)
  if config.model.dequantize_base:
    frozen = setup.dequantize_frozen(frozen, model.config.dtype)
  params = trainable.to_pure_dict()
  if step is not None:
    optimizer, _ = make_optimizer(OptimizerSettings.from_config(config))
    params = checkpointer.restore(step, init_train_state(params, optimizer, config.seed)).params
    print(f"evaluating the checkpoint at step {step}")
  model = nnx.merge(graphdef, nnx.State(params), frozen)
  checkpointer.close()
  out_dir = os.path.join(workdir, "eval", f"step_{step or 0}")
  report = run_eval(model, tokenizer, config, out_dir, step=step or 0)
  print(json.dumps({k: v for k, v in report.items() if k != "seconds"}, indent=2))
  return report
