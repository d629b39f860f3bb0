"""The project's importable names against those of what it installs."""

import importlib.metadata
import importlib.util
import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _our_packages() -> list[str]:
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
  return [pattern.rstrip("*") for pattern in include]


def test_no_package_of_ours_takes_an_installed_distributions_import_name():
  # Our GPU kernels were the top-level package `kernels` until transformers 5.25 began to require Hugging Face's
  # `kernels` and import it at start-up: with both installed, one of the two imports failed (every test that loads
  # transformers did). No name this project installs may be another installed distribution's import name.
  owners = importlib.metadata.packages_distributions()
  ours = _our_packages()
  assert "qerl_kernels" in ours and "kernels" not in ours
  clashes = {name: owners[name] for name in ours if set(owners.get(name, ())) - {"qerl-jax", "qerl_jax"}}
  assert not clashes, f"import names shared with other distributions: {clashes}"


def test_transformers_and_our_kernels_import_together():
  import qerl_kernels
  import transformers.modeling_utils  # noqa: F401  # what failed while our kernels were named `kernels`
  assert os.path.dirname(qerl_kernels.__file__) == os.path.join(ROOT, "qerl_kernels")
  spec = importlib.util.find_spec("kernels")
  assert spec is None or not spec.origin.startswith(ROOT)
