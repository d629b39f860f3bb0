r"""`python -m qerl_jax.main`: QeRL training (or evaluation) from an ml_collections config file.

  python -m qerl_jax.main --config=configs/smollm2_135m.py --workdir=/tmp/qerl
  python -m qerl_jax.main --config=configs/qwen7b.py --workdir=/tmp/q7 --config.train.learning_rate=3e-5
  python -m qerl_jax.main --config=configs/qwen7b.py:smoke --workdir=/tmp/q7smoke
  python -m qerl_jax.main --config=configs/qwen7b.py --workdir=/tmp/q7 --config.mode=eval

Without --config the embedded default (SmolLM2-135M on the offline arithmetic task) runs. Config paths are
tried as given, then relative to this package's checkout, so the command works from any directory. A
workdir holding a checkpoint resumes from it.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DEFAULT_CONFIG = os.path.join(_REPO, "configs", "smollm2_135m.py")


def _resolve_config_arg(argv: list[str]) -> list[str]:
  """Rewrites --config=configs/x.py[:arg] to the checkout's file when the path is not found from the cwd."""
  out = []
  for a in argv:
    if a.startswith("--config=") and not a.startswith("--config=/"):
      path, sep, arg = a[len("--config="):].partition(":")
      if not os.path.exists(path) and os.path.exists(os.path.join(_REPO, path)):
        a = f"--config={os.path.join(_REPO, path)}{sep}{arg}"
    out.append(a)
  return out


config_flags.DEFINE_config_file("config", _DEFAULT_CONFIG, "ml_collections config file (path[:arg]).",
                                lock_config=True)
flags.DEFINE_string("workdir", "workdir_qerl", "Checkpoints, metrics.jsonl, TensorBoard, curves, eval.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from qerl_jax import sharding, train  # pylint: disable=import-outside-toplevel (after flag parsing: fast --help)
  sharding.initialize_distributed()  # multi-host only (SLURM / Open MPI / JAX_COORDINATOR_ADDRESS); else no-op
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  config = flags.FLAGS.config
  workdir = flags.FLAGS.workdir
  if config.mode == "eval":
    train.evaluate(config, workdir)
  else:
    train.train_and_evaluate(config, workdir)


if __name__ == "__main__":
  sys.path.insert(0, _REPO)  # `from configs import common` inside config files, from any cwd
  app.run(main, argv=_resolve_config_arg(sys.argv))
