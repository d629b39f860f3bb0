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


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
  workdir = str(tmp_path)
  ckpt_dir = os.path.join(workdir, "checkpoints")
  proc = subprocess.Popen([sys.executable, "-c", SCRIPT, workdir], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
  try:
    assert proc.stdout.readline().strip() == "saved 1"
    deadline = time.time() + 60
    killed_mid_save = False
    while time.time() < deadline and proc.poll() is None:
      if any("tmp" in name for name in os.listdir(ckpt_dir)):
        os.kill(proc.pid, signal.SIGKILL)
        killed_mid_save = True
        break
      time.sleep(0.005)
    proc.wait(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert killed_mid_save, "the step-2 save finished before it could be interrupted"
  assert proc.returncode == -signal.SIGKILL
  ckpt = Checkpointer(workdir)
  assert ckpt.latest_step() == 1
  opt, _ = make_optimizer(OptimizerSettings(1e-3, 10))
  template = init_train_state({"lora_a": jnp.zeros((64, 1024, 1024), jnp.float32)}, opt, 0)
  state = ckpt.restore(1, template)
  assert int(state.step) == 1 and int(state.data["position"]) == 7
  np.testing.assert_array_equal(np.asarray(state.params["lora_a"][::16, ::256, ::256]), 1.0)
