"""Sharding through JAX: a device mesh from the config and ONE table of partition rules.

Mesh axes (`config.mesh`, sizes; -1 = the devices left over; all 1 = one device, the default):
  data:   data parallelism. Rollout rows and update rows are split over it; parameters are replicated.
  fsdp:   fully-sharded data parallelism. Rows are split over it too, and the frozen base, the adapters and
          the optimizer state are stored split over it (gathered layer by layer where they are used).
  tensor: Megatron-style model parallelism: column-parallel projections (q, k, v, gate, up) split their
          outputs N, row-parallel ones (o, down) their inputs K, and the KV cache its heads.

Rules are (regex, PartitionSpec) pairs searched, first match wins, in a leaf's path, written
"frozen/layers/q_proj/weight/packed_NxKh" (the tree's keys joined by "/", with a prefix naming the tree:
frozen, params, opt_state, batch, cache). A spec shorter than the leaf's rank leaves the trailing dims
unsharded; a dim that a spec's axes do not divide evenly falls back to fewer axes (so the same rules serve
a 2-head toy and Qwen2.5-72B). Unmatched leaves are replicated.

Quantized weights: NVFP4 / MXFP4 packed codes [L, N, K/2] and block scales [L, N, K/B] carry the same
spec, so each device holds the codes of a block together with that block's scale (N rows are split
whole; K is split in whole blocks as long as K/B is divisible, else the fallback leaves K unsplit). The
per-tensor global scale [L, 1] is replicated. The LoRA A [L, K, r] and B [L, r, N] follow the K and N
of their weight; AdamW's mu and nu follow the params (their paths end in the param's path).

Applying the rules: `shardings_for(tree, mesh, rules, prefix)` -> a pytree of NamedSharding like `tree`
(works on arrays and on `jax.ShapeDtypeStruct`s from `jax.eval_shape`), `place` to `jax.device_put` a
tree, and `init_sharded` to run an initializer under `jit(out_shardings=...)` so a large tree is born
split and no full copy lands on one device.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
# Rows of a batch (rollout prompts, update completions) are split over both data-parallel axes.
BATCH = ("data", "fsdp")

_COL = r"(q_proj|k_proj|v_proj|gate_proj|up_proj)"  # output N split over "tensor"
_ROW = r"(o_proj|down_proj)"  # input K split over "tensor"
_W = r"(w|weight)"  # the base pytree calls it "w", the NNX module "weight"

# The one table. Order matters: the first regex found in the path decides.
RULES: tuple[tuple[str, P], ...] = (
  # Quantized base weights, file layout [L, N, K/2] codes and [L, N, K/B] scales: identical specs.
  (rf"{_COL}/{_W}/(packed_NxKh|scale_NxKb)$", P(None, "tensor", "fsdp")),
  (rf"{_ROW}/{_W}/(packed_NxKh|scale_NxKb)$", P(None, "fsdp", "tensor")),
  (r"/global_scale$", P()),
  # NF4 flattens [N, K] into blocks of 64: codes and absmax split along the same flat axis.
  (rf"/{_W}/(packed|absmax)$", P(None, "fsdp")),
  (rf"/{_W}/absmax_(scale|offset|code)$", P()),
  # Unquantized base weights [L, K, N] (bf16 LoRA, or layers whose K is not a multiple of the block).
  (rf"{_COL}/{_W}$", P(None, "fsdp", "tensor")),
  (rf"{_ROW}/{_W}$", P(None, "tensor", "fsdp")),
  (rf"{_COL}/(b|bias)$", P(None, "tensor")),
  (rf"{_ROW}/(b|bias)$", P()),
  # LoRA adapters (and, through their paths, AdamW's mu / nu): A [L, K, r], B [L, r, N].
  (rf"{_COL}/lora_a$", P(None, "fsdp", None)),
  (rf"{_COL}/lora_b$", P(None, None, "tensor")),
  (rf"{_ROW}/lora_a$", P(None, "tensor", None)),
  (rf"{_ROW}/lora_b$", P(None, None, "fsdp")),
  # Embedding and output matrix [V, D]: hidden split over fsdp. Not the vocabulary: the chunked
  # log-probs slice it dynamically, which would gather it whole at every slice.
  (r"(embed_tokens|lm_head)$", P(None, "fsdp")),
  (r"norm$", P()),  # RMSNorm scales: tiny, replicated
  # KV cache [L, B, S, Hkv, Dh]: rows over the batch axes, heads over tensor.
  (r"^cache/(k|v)$", P(None, BATCH, None, "tensor", None)),
  # Batches: every leaf has its rows first (names ending _B or _Bx...).
  (r"^batch/.*_B(x|$)", P(BATCH)),
)


def mesh_shape(spec: Mapping[str, int] | None, num_devices: int) -> tuple[int, int, int]:
  """(data, fsdp, tensor) sizes from a {axis: size} mapping; one -1 takes the devices left over.

  Missing axes are 1. The product must equal `num_devices`.
  """
  spec = dict(spec or {})
  unknown = sorted(set(spec) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"unknown mesh axes {unknown}; expected a subset of {MESH_AXES}")
  sizes = [int(spec.get(axis, 1)) for axis in MESH_AXES]
  if sum(s == -1 for s in sizes) > 1:
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} has more than one -1")
  for axis, size in zip(MESH_AXES, sizes):
    if size == 0 or size < -1:
      raise ValueError(f"mesh axis {axis}={size} must be a positive size or -1")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))}: {num_devices=} is not divisible by {known}")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                     f"but {num_devices=} (set one axis to -1 to take the rest)")
  return tuple(sizes)


def make_mesh(spec: Mapping[str, int] | None = None, devices: Sequence[Any] | None = None) -> Mesh:
  """The (data, fsdp, tensor) mesh over `devices` (default: all of them, across hosts)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(spec, len(devices))
  # Auto axes: GSPMD propagates shardings from the inputs and inserts the collectives, as MaxText does.
  axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  return jax.make_mesh(shape, MESH_AXES, axis_types, devices=devices)


def is_trivial(mesh: Mesh | None) -> bool:
  return mesh is None or mesh.devices.size == 1


def path_str(path) -> str:
  """'layers/q_proj/weight/packed_NxKh' for a jax key path (NNX `.value` hops dropped).

  The project's one path-to-name function: partition rules, weight-decay masks and the LoRA-B switch all
  match their regexes against it.
  """
  name = jax.tree_util.keystr(path, simple=True, separator="/")
  return "/".join(part for part in name.split("/") if part != "value")


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _sizes(mesh: Mesh | Mapping[str, int]) -> Mapping[str, int]:
  return mesh.shape if isinstance(mesh, Mesh) else mesh


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh | Mapping[str, int]) -> P:
  """`spec` padded to the rank of `shape`, each dim keeping the longest prefix of its axes that divides it.

  `mesh` may be a Mesh or just its {axis: size} (the memory planner has no devices).
  """
  sizes = _sizes(mesh)
  entries = list(spec)
  if len(entries) > len(shape):
    raise ValueError(f"partition spec {spec} has more entries than the leaf's rank {len(shape)} ({shape=})")
  entries += [None] * (len(shape) - len(entries))
  out = []
  for dim, entry in zip(shape, entries):
    axes = _axes(entry)
    while axes and dim % math.prod(sizes.get(a, 1) for a in axes):
      axes = axes[:-1]
    if len(axes) != len(_axes(entry)):
      logging.debug("dim %d does not split over %s; kept over %s", dim, entry, axes)
    out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*out)


def spec_for(path: str, shape: Sequence[int], mesh: Mesh | Mapping[str, int],
             rules: Sequence[tuple[str, P]] = RULES) -> P:
  """The fitted PartitionSpec of one leaf: the first rule whose regex is found in `path`, else replicated."""
  for pattern, spec in rules:
    if re.search(pattern, path):
      return fit_spec(spec, shape, mesh)
  return P()


def shardings_for(tree: Any, mesh: Mesh, rules: Sequence[tuple[str, P]] = RULES, prefix: str = "") -> Any:
  """A pytree of NamedSharding like `tree` (arrays or ShapeDtypeStructs), from the rules.

  `prefix` names the tree in the paths the rules see ("frozen", "params", "opt_state", "batch", "cache").
  Scalars and non-array leaves are replicated.
  """
  def one(path, leaf):
    shape = tuple(getattr(leaf, "shape", ()))
    name = "/".join(p for p in (prefix, path_str(path)) if p)
    return NamedSharding(mesh, spec_for(name, shape, mesh, rules) if shape else P())

  return jax.tree_util.tree_map_with_path(one, tree)


def specs_of(tree: Any) -> dict[str, P]:
  """{path: PartitionSpec} of a placed tree (for tests and logs)."""
  return {path_str(p): leaf.sharding.spec for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def place(tree: Any, mesh: Mesh, rules: Sequence[tuple[str, P]] = RULES, prefix: str = "") -> Any:
  """`tree` moved onto `mesh` by the rules (each device receives only its shards)."""
  return jax.device_put(tree, shardings_for(tree, mesh, rules, prefix))


def init_sharded(init: Callable[..., Any], mesh: Mesh, *args, rules: Sequence[tuple[str, P]] = RULES,
                 prefix: str = "", static_argnums: Sequence[int] = ()) -> Any:
  """Runs `init(*args)` so its outputs are born sharded: abstract shapes through `jax.eval_shape`, the
  shardings from the rules, then `jit(init, out_shardings=...)`. No device ever holds the whole tree.
  """
  abstract = jax.eval_shape(init, *args)
  out = shardings_for(abstract, mesh, rules, prefix)
  return jax.jit(init, out_shardings=out, static_argnums=tuple(static_argnums))(*args)


def batch_sharding(mesh: Mesh, rank: int = 1) -> NamedSharding:
  """Rows over (data, fsdp), the other `rank - 1` dims whole."""
  return NamedSharding(mesh, P(BATCH, *([None] * (rank - 1))))


def micro_batch_sharding(mesh: Mesh) -> NamedSharding:
  """Micro-batched leaves [M, b, ...]: the micro-batch index whole, each micro-batch's rows split, so every
  device works on its slice of every micro-batch (instead of whole micro-batches living on one device)."""
  return NamedSharding(mesh, P(None, BATCH))


def local_bytes(shape: Sequence[int], dtype, spec: P, mesh_sizes: Mapping[str, int]) -> int:
  """Bytes one device holds of a leaf of `shape` under `spec` (dims rounded up, as padding would)."""
  n = 1
  entries = list(spec) + [None] * (len(shape) - len(spec))
  for dim, entry in zip(shape, entries):
    parts = math.prod(mesh_sizes.get(a, 1) for a in _axes(entry))
    n *= -(-int(dim) // parts)
  return n * np.dtype(dtype).itemsize


def mesh_context(mesh: Mesh | None):
  """`with mesh_context(mesh):` makes `mesh` the context mesh (`jax.set_mesh`) of the programs traced inside,
  so code that cannot be partitioned automatically (the fused NVFP4 kernel) can map itself over the rows;
  a no-op for None."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def describe(mesh: Mesh) -> str:
  return " x ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names) + f" ({mesh.devices.size} devices)"


def jit_update_sharded(graphdef, optimizer_settings, settings, mesh: Mesh, state, frozen,
                       rules: Sequence[tuple[str, P]] = RULES):
  """`train.step.update_step` jitted for `mesh`: the train state keeps the rules' shardings across steps
  (out_shardings pinned, state donated), micro-batches split their rows over (data, fsdp).

  state, frozen: the (placed or abstract) train state without its host part, and the frozen base; only
  their shapes are read. Returns (jitted update, optimizer, schedule), like `train.step.jit_update`.
  """
  import dataclasses  # pylint: disable=import-outside-toplevel
  from qerl_jax.train.optim import make_optimizer  # pylint: disable=import-outside-toplevel
  from qerl_jax.train.step import update_step  # pylint: disable=import-outside-toplevel

  settings = dataclasses.replace(settings, micro_sharding=micro_batch_sharding(mesh))
  optimizer, schedule = make_optimizer(optimizer_settings)
  state_sh = shardings_for(state, mesh, rules)
  frozen_sh = shardings_for(frozen, mesh, rules, "frozen")
  fn = lambda state, frozen, batch, first: update_step(  # noqa: E731
    state, frozen, batch, first, graphdef=graphdef, optimizer=optimizer, schedule=schedule, settings=settings)
  replicated = NamedSharding(mesh, P())
  jitted = jax.jit(fn, in_shardings=(state_sh, frozen_sh, None, replicated),
                   out_shardings=(state_sh, replicated, batch_sharding(mesh, 2)), donate_argnums=(0,))
  return jitted, optimizer, schedule


def distributed_args(env=None) -> dict | None:
  """Arguments for `jax.distributed.initialize` on a multi-host run, or None for a single process.

  Every host runs the same command. SLURM and Open MPI jobs of more than one task are detected by JAX
  itself (no arguments needed); by hand, set JAX_COORDINATOR_ADDRESS=host0:port, JAX_NUM_PROCESSES and
  JAX_PROCESS_ID on each host.
  """
  env = os.environ if env is None else env
  if env.get("JAX_COORDINATOR_ADDRESS"):
    missing = [k for k in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if k not in env]
    if missing:
      raise ValueError(f"JAX_COORDINATOR_ADDRESS is set but {missing} are not: set all three on every host")
    return {"coordinator_address": env["JAX_COORDINATOR_ADDRESS"],
            "num_processes": int(env["JAX_NUM_PROCESSES"]), "process_id": int(env["JAX_PROCESS_ID"])}
  if int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
    return {}
  return None


def initialize_distributed(env=None) -> bool:
  """Calls `jax.distributed.initialize` when the environment describes several processes; True if it did."""
  args = distributed_args(env)
  if args is None:
    return False
  jax.distributed.initialize(**args)
  return True
