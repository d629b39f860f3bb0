"""Checkpoints survive kill -9 during a save: the previous one stays loadable (orbax's atomic rename)."""

import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np

from qerl_jax.train.checkpoint import Checkpointer
from qerl_jax.train.optim import OptimizerSettings, make_optimizer
from qerl_jax.train.state import init_train_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Saves step 1, then starts a large step-2 save (about 0.8 GB with the Adam moments) that the test kills.
SCRIPT = r"""
import sys
import jax.numpy as jnp, numpy as np
from configs.qwen7b import get_config
from qerl_jax.train.checkpoint import Checkpointer
from qerl_jax.train.optim import OptimizerSettings, make_optimizer
from qerl_jax.train.state import init_train_state
opt, _ = make_optimizer(OptimizerSettings(1e-3, 10))
params = {"lora_a": jnp.ones((64, 1024, 1024), jnp.float32)}
state = init_train_state(params, opt, 0, {"position": np.int64(7)})
ckpt = Checkpointer(sys.argv[1], keep=5)
ckpt.save(state.replace(step=jnp.int32(1)), get_config("smoke"))
print("saved 1", flush=True)
ckpt.save(state.replace(step=jnp.int32(2), params={"lora_a": params["lora_a"] * 2}), get_config("smoke"))
print("saved 2", flush=True)
"""


def _run_and_kill_mid_save(workdir: str) -> bool:
  """Runs SCRIPT; kills it (SIGKILL) while a temporary step-2 directory exists. Whether it was killed so."""
  ckpt_dir = os.path.join(workdir, "checkpoints")
  proc = subprocess.Popen([sys.executable, "-c", SCRIPT, workdir], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
  try:
    assert proc.stdout.readline().strip() == "saved 1"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
      if any("tmp" in name for name in os.listdir(ckpt_dir)):
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return True
      time.sleep(0.005)
    proc.wait(timeout=30)
    return False
  finally:
    if proc.poll() is None:
      proc.kill()


def _restore(workdir: str, step: int):
  opt, _ = make_optimizer(OptimizerSettings(1e-3, 10))
  template = init_train_state({"lora_a": jnp.zeros((64, 1024, 1024), jnp.float32)}, opt, 0)
  return Checkpointer(workdir).restore(step, template)


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
  # The kill races the save: the poll may see the temporary directory just before orbax renames it, so the
  # step-2 save can complete before the signal lands. Such an attempt must leave a complete step 2; the test
  # retries (fresh workdir) until one kill lands mid-save, and then step 1 must be the latest and intact.
  for attempt in range(4):
    workdir = str(tmp_path / f"attempt{attempt}")
    killed = _run_and_kill_mid_save(workdir)
    latest = Checkpointer(workdir).latest_step()
    if killed and latest == 1:
      break
    assert latest == 2, f"attempt {attempt}: {killed=}, latest step {latest}"  # the save won the race
    np.testing.assert_array_equal(np.asarray(_restore(workdir, 2).params["lora_a"][::16, ::256, ::256]), 2.0)
  else:
    raise AssertionError("the step-2 save finished before it could be interrupted, 4 times")
  state = _restore(workdir, 1)
  assert int(state.step) == 1 and int(state.data["position"]) == 7
  np.testing.assert_array_equal(np.asarray(state.params["lora_a"][::16, ::256, ::256]), 1.0)
