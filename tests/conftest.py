"""Shared test setup: repo root on sys.path, float32 matmuls on CPU, paths to offline data."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

# ../shared/data beside the checkout (CI lays a copy of shared/ beside its clone).
SHARED_DATA = os.environ.get("QERL_SHARED_DATA", os.path.join(os.path.dirname(ROOT), "shared", "data"))

# On a CPU machine the suite is compile-bound: XLA's CPU backend without LLVM's optimization passes compiles the
# suite's many small programs faster than their slower code costs (two workers: tests/test_rollout_layers.py
# with tests/test_kernels.py 100.7 -> 68.2 s, level 1 98.9 s; the whole suite 575 -> 466 s, though the GGUF
# model's generation runs 18 -> 39 s). XLA's older CPU fusion emitters (LLVM IR, not the MLIR ones) compile faster
# again (one process, jax 0.10.2: tests/test_rollout_layers.py 90.1 -> 58.1 s, test_kernels.py with
# test_train_loop.py 158.1 -> 129.4 s; jaxlib 0.11.2's library names the flag too, not run there). Set before jax
# starts, so the subprocesses tests run inherit them; a GPU machine keeps its flags.
import shutil  # noqa: E402

CPU_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
if shutil.which("nvidia-smi") is None and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *CPU_COMPILE_FLAGS]).strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# One persistent compilation cache for the whole run, shared with the subprocesses tests start (the CLI,
# ablation workers, the notebook): many tests compile a program another test or process compiled already
# (tests/test_experiments.py: 117 -> 102 s on the 2-core machine).
import atexit  # noqa: E402
import tempfile  # noqa: E402

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # ours: removed when the run ends
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="qerl-jax-cache-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _sm90_for_triton_lowering(monkeypatch):
  """jax 0.11 asks the machine's GPU for its compute capability when it lowers a Triton-backend pallas_call, so
  on a CPU machine the tests that lower the kernels for CUDA fail there ("No supported GPU devices found"); name
  an H100's (sm_90, as the H200) instead. jax 0.10.2 (CI) asks nothing; on a GPU nothing is patched."""
  try:
    from jax._src.pallas.triton import gpu_info, pallas_call_registration  # pylint: disable=C0415
  except ImportError:
    return
  if not hasattr(pallas_call_registration, "gpu_info_lib") or jax.default_backend() == "gpu":
    return
  info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: info)
