"""Shared test setup: repo root on sys.path, float32 matmuls on CPU, paths to offline data."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

# ../shared/data beside the checkout (CI lays a copy of shared/ beside its clone).
SHARED_DATA = os.environ.get("QERL_SHARED_DATA", os.path.join(os.path.dirname(ROOT), "shared", "data"))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
