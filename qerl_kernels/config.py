"""Tile configurations for the NVFP4 matmul kernels: a frozen dataclass, heuristic defaults, tuned data.

Tuned values are data, not literals: ``qerl_kernels/tuning/<device kind>.json`` (e.g. ``nvidia_h200.json`` for
jax's device_kind 'NVIDIA H200'; the H100 and H800 read the H200's) holds a list of entries
``{"direction": "fwd"|"bwd", "max_rows": R, "config": {...}}``; the first entry of the right direction whose
``max_rows`` covers the row count wins, and any field it leaves out comes from the heuristic. Shapes are always
re-fitted (``fit``) so that a tuned entry can never produce an invalid launch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

_TUNING_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning")
# Streaming multiprocessors to fill with programs when there are few rows (132 on the H100/H200 SXM).
_DEFAULT_NUM_SMS = 132
DECODERS = ("jnp", "halves", "asm", "asm_e4m3", "asm_fma")
HALVES_DECODERS = ("halves", "asm")  # the decoders that split x (or dx) into even and odd columns
GEMV_DECODERS = ("asm_e4m3", "asm_fma")  # inline PTX of the gemv engine only
ENGINES = ("tensorcore", "gemv", "mosaic")
# The gemv engine unrolls its rows (one accumulator each); past this many the tensor-core kernel runs.
GEMV_MAX_ROWS = 16


@dataclasses.dataclass(frozen=True)
class Nvfp4MatmulConfig:
  """Static tiling of one NVFP4 matmul launch.

  Forward (y[M, N] = x[M, K] @ W[K, N]): block_m x block_n output tiles, block_k the contraction step.
  Backward (dx[M, K] = dy[M, N] @ W[K, N]^T): block_m x block_k output tiles, block_n the contraction step.
  split: programs along the contraction axis (split-K forward, split-N backward) whose float32 partial sums
  are added afterwards; more programs keep all SMs streaming weights when there are few rows.
  group_m: row tiles visited together so neighbouring programs share weight tiles in L2.
  dequant: how tiles are decoded: "jnp" (decode, then interleave the two nibbles of each byte into logical
  order), "halves" (no interleave: the even and odd columns of x are split outside the kernel and each
  nibble plane meets its half; needs block_k >= 32), or "asm" (the "halves" layout decoded by inline PTX:
  a few bit operations and paired multiply-adds per packed word; GPU only, interpret mode runs "halves"),
  or, for the gemv engine only, "asm_e4m3" (the e4m3 route in inline PTX on whole packed words: each nibble
  plane becomes four e4m3 bytes in five bit operations and two hardware conversions to 16-bit floats; GPU
  only, interpret mode runs "jnp"; a tile config gets "asm"), or "asm_fma" (gemv only: the same decode with
  each byte's two products formed in the same PTX as one multiply and one fused multiply-add; interpret mode
  runs "jnp", a tile config "asm").
  programs_per_sm: with an automatic split, how many programs per SM to aim for. The tile kernels aim for 2;
  a gemv program is small (4 warps, ~56 registers: 9 fit on an H200 SM), so it may aim for a full wave.
  ragged_split: a tile forward's K ranges may be ragged (the last one shorter), so its automatic split can
  reach ``programs_per_sm`` whatever the factors of the K steps; off, it is a power of two that divides them.
  The ragged plan is kept only where it gives more programs than the even one. The gemv's are always ragged.
  one_round: the automatic split is the largest whose programs fit one round of ``programs_per_sm`` per SM,
  not the smallest that reaches it. At compute-bound rows a few programs past the round start a second, mostly
  idle one (7B at 128 rows, 41186a8: qkv 288 programs, o 392, gate_up 296 for 264 slots, and those three ran
  0.48-0.69x the bf16 dot; down, 224, 0.74x). On in the H200 file only for the one-row gemv of 7B down and q|k|v,
  whose ragged splits ran 1.08-1.11 rounds (-7% / -5% per call on an H100, c61662a); at 8 rows it lost everywhere.
  half_products: for the gemv engine with an e4m3-route decoder ("asm_e4m3", "jnp"), each NVFP4 block's 16
  products (E2M1 / 64 times x, exact in float16 once the kernel scales the block's x by a power of two into
  float16's range) and their sum are float16; the sum is then scaled and accumulated in float32. ``fit`` drops
  it for other engines and decoders.
  tail_slots: a tile forward whose output fits one row tile: how many of its programs run at once (programs per
  SM x SMs, e.g. 4 x 132 for the 2-warp 64-row tile). Tiles past the last whole round of slots then run split
  along K in short programs that fill the next round, and their float32 partial sums are added after the launch
  (``nvfp4_matmul_fwd.tail_plan``). At 64 rows on an H100 (d4f251b) 7B gate|up's 592 programs took 84.2 us against
  61.5 for 528: the 64 past one round ran alone. 528 in the H200 file's 17-64-row entry since the fifteenth
  session (bare 7B gate|up 83.5 -> 73.1 us, H200, bf9eb66); 0 (off) elsewhere.
  pipeline: for the gemv engine, its K loop carries Triton's ``tt.num_stages`` mark (``loop_stages``), so Triton's
  pipeliner streams the weights and block scales through shared memory by asynchronous copies ``num_stages - 1``
  trips ahead. Unmarked (the default), Triton pipelines only loops with a dot, and each gemv program had one
  trip of loads in flight: the load-only probes read 7B gate in ~13 us where the gemv took ~20 (RESULTS "Where
  the one-row gemv's time goes"); a raw-Triton probe of the same gemv with cp.async ran gate_up and down 7% faster
  and the short-K q|k|v and o slower (RESULTS "The one-row gemv written directly in Triton"). Offline SASS
  (kernel_sass, pip Triton 3.6, 7B gate, one row): the codes', scales' and x's loads become LDGSTS (x in place
  then loads as whole pairs, ``nvfp4_gemv_kernel``), +2% / +6% instructions per trip at 2 / 3 stages. Untimed in
  Pallas; off in the H200 file. The tile kernels' loops have dots and are pipelined by ``num_stages`` alone.
  engine: "tensorcore" (the tile kernels above) or "gemv" (forward only, at most GEMV_MAX_ROWS rows: each
  decoded weight meets its x element in a float32 multiply-add on the CUDA cores; block_m is unused there
  and dequant is "asm" or the e4m3 route). ``fit`` turns a gemv config into a tensor-core one where gemv
  does not apply. "mosaic" (experimental, untimed): the Pallas Mosaic GPU forward kernel (``nvfp4_mgpu``),
  bf16 x, N a multiple of 64 and K of 256; it reads block_m as its largest row tile (8-128), block_k as its K
  step (256 or 512), num_stages as its pipeline depth, and splits K itself. ``fit`` gives the heuristic
  config where it does not apply; so does the forward for other dtypes and stacked weights.
  """

  block_m: int = 16
  block_n: int = 64
  block_k: int = 256
  split: int = 1
  group_m: int = 8
  num_warps: int = 4
  num_stages: int = 3
  dequant: str = "jnp"  # "jnp" | "halves" (portable) | "asm" | "asm_e4m3", "asm_fma" (gemv) (PTX, GPU only)
  engine: str = "tensorcore"  # "tensorcore" | "gemv" | "mosaic" (experimental)
  prefetch: int = 0  # gemv: K trips whose weights are loaded ahead of the math (True = 1; see nvfp4_gemv)
  programs_per_sm: int = 2  # the automatic split's goal: this many programs per SM (``fit``)
  ragged_split: bool = False  # tile forward: ragged K ranges (the gemv's always are)
  one_round: bool = False  # automatic split: at most one round of programs_per_sm x SMs (``fit``)
  half_products: bool = False  # gemv, e4m3-route decoders: each block's products and sum in float16
  tail_slots: int = 0  # tile forward, one row tile: programs that run at once; the tiles past them split (0: off)
  # gemv: read x where it lies, each nibble plane's columns by a stride-2 load; tile forward with a halves
  # decoder: load x's run as it lies and split its even / odd columns in registers (no reordered copy)
  x_in_place: bool = False
  # gemv: mark the K loop for Triton's software pipeliner, num_stages deep (``qerl_kernels.loop_stages``)
  pipeline: bool = False

  def __post_init__(self):
    if self.engine not in ENGINES:
      raise ValueError(f"{self.engine=} must be one of {ENGINES}")
    if self.dequant not in DECODERS:
      raise ValueError(f"{self.dequant=} must be one of {DECODERS}")
    for name in ("block_m", "block_n", "block_k"):
      v = getattr(self, name)
      if v < 16 or v & (v - 1):
        raise ValueError(f"{name}={v} must be a power of two >= 16 (Triton dot tiles)")
    if not isinstance(self.prefetch, int) or not 0 <= self.prefetch <= 4:
      raise ValueError(f"prefetch={self.prefetch!r} must be a number of K trips from 0 to 4")
    object.__setattr__(self, "prefetch", int(self.prefetch))  # a bool (the H200 file has true) is 0 or 1
    if min(self.split, self.group_m, self.num_warps, self.num_stages, self.programs_per_sm) < 1:
      raise ValueError(f"bad config {self}")
    if not isinstance(self.tail_slots, int) or self.tail_slots < 0:
      raise ValueError(f"tail_slots={self.tail_slots!r} must be a count of programs (0: off)")
    if self.pipeline and (self.prefetch or self.num_stages < 2):
      raise ValueError(f"pipeline needs num_stages >= 2 and no manual prefetch, got num_stages={self.num_stages}, "
                       f"prefetch={self.prefetch}")


def _pow2_at_most(v: int) -> int:
  return 1 << (max(int(v), 1).bit_length() - 1)


def _largest_pow2_divisor_block(dim: int, block: int) -> int:
  """The largest power of two <= block that divides dim (dim is a multiple of 16 here)."""
  block = _pow2_at_most(block)
  while block > 16 and dim % block:
    block //= 2
  return block


def heuristic_config(direction: str, m: int, k: int, n: int, num_sms: int = _DEFAULT_NUM_SMS):
  """Defaults from the shape alone (no tuning data)."""
  if direction == "fwd":
    if m <= 2:  # decode: the gemv engine (H200, 1 row: 1.1-1.7x the bf16 dot; the tile kernel 0.5-0.9x)
      cfg = Nvfp4MatmulConfig(block_n=16, block_k=512, num_warps=4, num_stages=3, engine="gemv")
    elif m <= 16:
      cfg = Nvfp4MatmulConfig(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=4)
    elif m <= 64:
      cfg = Nvfp4MatmulConfig(block_m=max(16, _pow2_at_most(2 * m - 1)), block_n=64, block_k=128,
                              num_warps=4, num_stages=4)
    elif m <= 256:
      cfg = Nvfp4MatmulConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
    else:
      cfg = Nvfp4MatmulConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
  elif direction == "bwd":
    if m <= 16:
      cfg = Nvfp4MatmulConfig(block_m=16, block_n=256, block_k=64, num_warps=4, num_stages=4)
    elif m <= 64:
      cfg = Nvfp4MatmulConfig(block_m=max(16, _pow2_at_most(2 * m - 1)), block_n=128, block_k=64,
                              num_warps=4, num_stages=4)
    elif m <= 256:
      cfg = Nvfp4MatmulConfig(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
    else:
      cfg = Nvfp4MatmulConfig(block_m=128, block_n=64, block_k=128, num_warps=8, num_stages=3)
  else:
    raise ValueError(f"{direction=} must be 'fwd' or 'bwd'")
  return fit(cfg, direction, m, k, n, num_sms=num_sms, auto_split=True)


def fit(cfg: Nvfp4MatmulConfig, direction: str, m: int, k: int, n: int, *,
        num_sms: int = _DEFAULT_NUM_SMS, auto_split: bool = False) -> Nvfp4MatmulConfig:
  """Shrinks tiles to the problem and makes the split valid.

  block_k always divides K (the packed and scale tiles then never straddle the end of a row); rows and N
  columns beyond the array are masked in the kernels. With auto_split, the split grows until about
  ``programs_per_sm`` programs run per SM: in ragged K ranges with no empty one (``split_trips``) for the gemv
  and with ``ragged_split``, else in powers of two that divide the K steps. A forward whose K steps admit no
  such split (e.g. 7B down_proj at 16 rows, unragged) halves block_k, down to 128, while that allows more.
  """
  if k % 16:
    raise ValueError(f"{k=} must be a multiple of 16 (the NVFP4 block)")
  if cfg.engine == "mosaic":
    return cfg if mosaic_applies(cfg, direction, k, n) else heuristic_config(direction, m, k, n, num_sms=num_sms)
  engine = cfg.engine
  if engine == "gemv" and (direction != "fwd" or m > GEMV_MAX_ROWS):
    engine = "tensorcore"
  block_k = block_k_max = _largest_pow2_divisor_block(k, cfg.block_k)
  block_m = max(16, min(cfg.block_m, _pow2_at_most(2 * m - 1) if m > 1 else 16))
  block_n = max(16, min(cfg.block_n, _pow2_at_most(2 * n - 1) if n > 1 else 16))
  num_m = 1 if engine == "gemv" else -(-m // block_m)  # gemv: every row in each program
  tiles = num_m * (-(-n // block_n) if direction == "fwd" else k // block_k)
  target = cfg.programs_per_sm * num_sms
  ragged = direction == "fwd" and (engine == "gemv" or cfg.ragged_split)
  block_k, split = _plan_split(cfg, tiles, k, n, block_n, block_k, direction, target, auto_split, ragged)
  if ragged and auto_split and engine != "gemv":
    # A tile split ragged into fewer programs than the even one lost on an H200 (7B o_proj, 8 rows, e0f3129:
    # 7 even ranges 8.3 us per call, 5 ragged 9.6 us); into more it won (down_proj: 4 even ranges of block_k
    # 128, 43.1 us, against 5 ragged of 256, 35.8 us). So the ragged plan is taken only when it has more.
    even = _plan_split(cfg, tiles, k, n, block_n, block_k_max, direction, target, auto_split, False)
    if even[1] >= split:
      block_k, split = even
  # The e4m3-route PTX decoders are the gemv's; a tile kernel decodes the same weights with "asm".
  dequant = "asm" if cfg.dequant in GEMV_DECODERS and engine != "gemv" else cfg.dequant
  # "halves" contracts block_k / 2 columns per dot, and Triton's dots need at least 16.
  dequant = "jnp" if dequant in HALVES_DECODERS and block_k < 32 else dequant
  half = cfg.half_products and engine == "gemv" and dequant in ("asm_e4m3", "jnp")
  return dataclasses.replace(cfg, block_m=block_m, block_n=block_n, block_k=block_k, split=split,
                             dequant=dequant, engine=engine, half_products=half)


def mosaic_applies(cfg: Nvfp4MatmulConfig, direction: str, k: int, n: int) -> bool:
  """Whether the Mosaic GPU kernel takes this call (forward; N a multiple of 64, K of its K step)."""
  return direction == "fwd" and n % 64 == 0 and cfg.block_k in (256, 512) and k % cfg.block_k == 0


def _plan_split(cfg: Nvfp4MatmulConfig, tiles: int, k: int, n: int, block_n: int, block_k: int, direction: str,
                target: int, auto_split: bool, ragged: bool) -> tuple[int, int]:
  """(block_k, split) for `fit`: the split for ``block_k``, then, for a few-row forward short of the target,
  shorter K steps while they allow a larger split."""
  split = _split(cfg.split, tiles, k, n, block_n, block_k, direction, target, auto_split, ragged, cfg.one_round)
  # With few rows a forward is latency-bound when too few programs stream the weight. On an H200 the 7B
  # down_proj ran, at 1 row (gemv, 4aae426), 83 us unsplit (224 programs) and 64-69 us split 2-4 with shorter
  # K steps; at 16 rows (tile kernel, 5c4c18a), 218 us with 56 programs and 109 us with 112.
  while direction == "fwd" and auto_split and tiles * split < target and block_k > 128:
    finer = _split(cfg.split, tiles, k, n, block_n, block_k // 2, direction, target, auto_split, ragged,
                   cfg.one_round)
    if finer <= split:  # shorter steps alone buy nothing
      break
    block_k, split = block_k // 2, finer
  return block_k, split


def _split(split: int, tiles: int, k: int, n: int, block_n: int, block_k: int, direction: str, target: int,
           auto: bool, ragged: bool = False, one_round: bool = False) -> int:
  """The contraction split: the given one, or (auto) the one that gives ~``target`` programs (tile kernels: a
  power of two up to 32); capped by the contraction steps. Forward: ragged (gemv), lowered until no K range
  is empty; otherwise lowered until it divides the steps (split-K cuts K into whole block_k steps).
  one_round (auto): the largest such split with at most ``target`` programs (1 if even one split has more)."""
  steps = k // block_k if direction == "fwd" else -(-n // block_n)
  if auto and one_round:  # the largest split whose programs fit one round (1 where none does)
    if direction == "fwd" and ragged:
      splits = {split_trips(steps, s)[1] for s in range(1, min(steps, 32) + 1)}
    else:
      splits = {s for s in (1, 2, 4, 8, 16, 32) if s <= steps and (direction != "fwd" or steps % s == 0)}
    return max((s for s in splits if tiles * s <= target), default=1)
  if auto and ragged:  # the fewest ranges that reach the target once empty ones are dropped
    split = needed = -(-target // tiles)
    while split < steps and split_trips(steps, split)[1] < needed:
      split += 1
  elif auto:
    split = 1
    while tiles * split < target and split * 2 <= min(steps, 32):
      split *= 2
  split = max(1, min(split, steps))
  if direction == "fwd" and ragged:
    split = split_trips(steps, split)[1]
  elif direction == "fwd":
    while steps % split:
      split -= 1
  return split


def split_trips(steps: int, split: int) -> tuple[int, int]:
  """(K steps per range, ranges) of a ragged forward split: ceil(steps / split) each, the last the remainder.

  A requested split that would leave a range empty (14 steps in 6 ranges of 3) shrinks to the ranges that
  have steps (5)."""
  per = -(-steps // split)
  return per, -(-steps // per)


# The decode step's small kernels (qerl_kernels/decode_*.py) and the launch fields a tuning file may set for each,
# with the values they take where it sets none. Each is a few microseconds of latency per call at batch 1-2, so
# programs and warps per program are what moves them; the file's "decode_kernels" object holds the tuned values.
DECODE_KERNELS = {
    "residual_norm": {"block_d": 256, "num_warps": 4},  # decode_residual_norm: columns per program, both launches
    "swiglu": {"block_n": 512, "num_warps": 4},  # decode_swiglu: columns per program
    "qkv_rows": {"num_warps": 1},  # decode_qkv: one program per output head row
    # decode_attention: cache slots per block; splits (which share the visible blocks) aimed at this many programs
    # per SM; blocks of k and v in flight (Triton's software pipelining of the slot loop)
    "attention": {"block_s": 64, "num_warps": 4, "programs_per_sm": 2, "num_stages": 2},
    # nvfp4_dequant (the XLA path's weight, opt-in through "xla_dequant"): rows and 16-value scale blocks per program
    "dequant": {"block_n": 32, "block_b": 32, "num_warps": 4},
}


def _check_decode_kernels(where: str, table) -> None:
  if not isinstance(table, dict):
    raise ValueError(f"{where}: \"decode_kernels\" must be an object of kernel name -> fields, got {table!r}")
  for name, fields in table.items():
    if name not in DECODE_KERNELS:
      raise ValueError(f"{where}: unknown decode kernel {name!r} (known: {sorted(DECODE_KERNELS)})")
    if not isinstance(fields, dict) or set(fields) - set(DECODE_KERNELS[name]):
      raise ValueError(f"{where}: decode kernel {name!r} takes fields {sorted(DECODE_KERNELS[name])}, got {fields!r}")
    for field, v in fields.items():
      bad = not isinstance(v, int) or isinstance(v, bool) or v < 1
      if field == "num_stages":  # a pipeline depth: any positive count
        if bad:
          raise ValueError(f"{where}: decode kernel {name!r} field 'num_stages' must be a positive integer, got {v!r}")
      elif bad or v & (v - 1):  # block sizes, warps, programs per SM
        raise ValueError(f"{where}: decode kernel {name!r} field {field!r} must be a power of two, got {v!r}")


def decode_kernel_params(name: str, device_kind: str | None) -> dict:
  """Launch fields of the decode kernel ``name`` (a key of DECODE_KERNELS): the device's tuning file's
  "decode_kernels" over the defaults; the defaults alone without a device kind (interpret mode)."""
  if name not in DECODE_KERNELS:
    raise ValueError(f"unknown decode kernel {name!r} (known: {sorted(DECODE_KERNELS)})")
  tuned = _tuning_file(device_kind).get("decode_kernels", {}).get(name, {}) if device_kind else {}
  return {**DECODE_KERNELS[name], **tuned}


def decode_launch(name: str, interpret: bool, **given) -> dict:
  """The launch fields one call of decode kernel ``name`` runs with: those the caller gives (not None), else the
  GPU's tuned ones (``decode_kernel_params``); interpret mode takes the defaults. The kernels call this, so a
  caller passes nothing to get the tuned launch."""
  fields = decode_kernel_params(name, None if interpret else device_kind())
  if set(given) - set(fields):
    raise ValueError(f"decode kernel {name!r} takes launch fields {sorted(fields)}, got {sorted(given)}")
  return {**fields, **{k: v for k, v in given.items() if v is not None}}


def device_kind() -> str:
  """The kind of the first device (its tuning file's name, e.g. 'NVIDIA H200')."""
  import jax  # pylint: disable=import-outside-toplevel  # the rest of this module is plain data
  return jax.devices()[0].device_kind


# Device kinds without a file of their own that take another's: the H100 and H800 are the H200's chip (sm_90: the
# same SM design, registers and shared memory) with less and slower memory; the H100 PCIe has 114 SMs, not 132,
# and only the SXM was measured. On an H100 SXM (2026-12-05, 7B NVFP4 decode,
# profile_decode) the H200 file took the kernel ms per step from the defaults' 4.40 / 7.17 / 9.59 to 3.01 / 3.91 /
# 8.01 at batch 1 / 8 / 64, with the H200's output digests.
_SAME_CHIP = {"nvidia_h100": "nvidia_h200", "nvidia_h800": "nvidia_h200"}


def _device_file(device_kind: str) -> str:
  """The device kind's tuning file, e.g. 'NVIDIA H200' -> tuning/nvidia_h200.json (which may not exist: then the
  heuristic defaults apply); a kind with no file of its own whose name starts as one in ``_SAME_CHIP`` gets that
  chip's ('NVIDIA H100 80GB HBM3' -> nvidia_h200.json)."""
  name = "".join(c if c.isalnum() else "_" for c in device_kind.lower()).strip("_")
  path = os.path.join(_TUNING_DIR, f"{name}.json")
  if not os.path.exists(path):
    for prefix, chip in _SAME_CHIP.items():
      if name == prefix or name.startswith(prefix + "_"):
        return os.path.join(_TUNING_DIR, f"{chip}.json")
  return path


def _tuning_path(device_kind: str) -> str:
  """The device kind's tuning file; QERL_KERNEL_TUNING=path replaces it (to try a tuning without editing it)."""
  override = os.environ.get("QERL_KERNEL_TUNING")
  if override and not os.path.exists(override):
    raise FileNotFoundError(f"QERL_KERNEL_TUNING={override!r} does not exist")
  return override or _device_file(device_kind)


def _tuning_file(device_kind: str) -> dict:
  """The device kind's tuning data (``_tuning_path``'s file; empty where it does not exist)."""
  return _read_json(_tuning_path(device_kind))


def tuning_version(device_kind: str | None) -> tuple:
  """Which tuning data a trace reads: the file's path and modification time (None for a missing file; () for no
  device kind).
  Jitted wrappers that read the file while tracing take it as a static argument, so a file changed or replaced
  in the same process (QERL_KERNEL_TUNING, a notebook's variant) traces again instead of reusing the first
  program."""
  if not device_kind:
    return ()
  path = _tuning_path(device_kind)
  return (path, _mtime_ns(path))


def _mtime_ns(path: str) -> int | None:
  """The file's modification time, the version its readers key on; None where it does not exist."""
  return os.stat(path).st_mtime_ns if os.path.exists(path) else None


def _read_json(path: str) -> dict:
  """A tuning file, checked once per version of it: a bad one fails here, naming itself, not later inside a
  trace. The cache is keyed on the file's modification time, so a file rewritten in place (a notebook trying a
  variant through QERL_KERNEL_TUNING) is read again."""
  mtime_ns = _mtime_ns(path)
  return {} if mtime_ns is None else _read_json_version(path, mtime_ns)


@functools.lru_cache(maxsize=None)
def _read_json_version(path: str, mtime_ns: int) -> dict:
  del mtime_ns  # the cache key only
  with open(path) as f:
    try:
      data = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"tuning file {path}: not JSON ({e})") from None
  if "decode_kernels" in data:
    _check_decode_kernels(f"tuning file {path}", data["decode_kernels"])
  if data.get("xla_dequant", "xla") not in XLA_DEQUANT:
    raise ValueError(f"tuning file {path}: \"xla_dequant\" must be one of {XLA_DEQUANT}, got {data['xla_dequant']!r}")
  if data.get("xla_backward_layout", "NxK") not in XLA_BACKWARD_LAYOUTS:
    raise ValueError(f"tuning file {path}: \"xla_backward_layout\" must be one of {XLA_BACKWARD_LAYOUTS}, "
                     f"got {data['xla_backward_layout']!r}")
  fields = {f.name for f in dataclasses.fields(Nvfp4MatmulConfig)}
  for i, e in enumerate(data.get("entries", ())):
    where = f"tuning file {path}, entry {i}"
    if (e.get("direction") not in ("fwd", "bwd") or not isinstance(e.get("max_rows"), int)
        or not isinstance(e.get("config"), dict)):
      raise ValueError(f"{where}: needs \"direction\" fwd|bwd, an integer \"max_rows\" and a \"config\" "
                       f"object, got {e}")
    shapes = e.get("shapes")
    if shapes is not None and (not isinstance(shapes, list) or not shapes or not all(
        isinstance(kn, list) and len(kn) == 2 and all(isinstance(v, int) and v > 0 for v in kn) for kn in shapes)):
      raise ValueError(f"{where}: \"shapes\" must be a non-empty list of [K, N] pairs of positive integers, "
                       f"got {shapes!r}")
    unknown = set(e["config"]) - fields
    if unknown:
      raise ValueError(f"{where}: unknown config fields {sorted(unknown)} (known: {sorted(fields)})")
    try:
      Nvfp4MatmulConfig(**e["config"])
    except (TypeError, ValueError) as err:
      raise ValueError(f"{where}: {err}") from None
  return data


def load_tuning(device_kind: str) -> tuple:
  """The tuned entries for a device kind (empty when there is no file): (direction, max_rows, config items,
  shapes), shapes a frozenset of (K, N) the entry is restricted to, or None for every shape."""
  return tuple((e["direction"], int(e["max_rows"]), tuple(sorted(e["config"].items())),
                None if e.get("shapes") is None else frozenset(tuple(kn) for kn in e["shapes"]))
               for e in _tuning_file(device_kind).get("entries", ()))


def xla_min_rows(device_kind: str | None) -> int | None:
  """Rows from which dequantize-then-dot (XLA) beats the fused kernels on this device kind, if measured.

  At thousands of rows the matmul is compute-bound: XLA's bf16 dot on a once-dequantized layer costs one extra
  pass over the weight, while the fused kernels' tile decode makes them several times slower. The tuning file's
  top-level "xla_min_rows" records the crossover; None (no entry) keeps the kernels at every size.
  """
  value = _tuning_file(device_kind).get("xla_min_rows") if device_kind else None
  return None if value is None else int(value)


XLA_DEQUANT = ("xla", "words", "pallas")
XLA_BACKWARD_LAYOUTS = ("NxK", "KxN")


def xla_dequant(device_kind: str | None) -> str:
  """How the XLA path dequantizes a layer on this device kind, the tuning file's top-level "xla_dequant": "xla"
  (XLA's fusion of the integer decode, the default without a file), "words" (XLA's fusion forming each packed
  byte's two values as one uint32 word, `nvfp4.dequantize_NxK(words=True)`; the H200 file's, which the H100 reads
  too) or "pallas" (`qerl_kernels.nvfp4_dequant`, those words in one launch, opt-in). The same bits in all three.
  On an H100 at 7c40c02 (7B, alone) the words ran gate|up in 302 us and the Pallas launch in 472 against XLA's 603,
  but the Pallas launch moved the 7B GRPO step by -0.02 s (18.70 -> 18.68). On an H200 at 483586a "words" ran 7B
  gate/down at 2048 rows at 0.85-0.90x the bf16 dot's speed against 0.66-0.71x; the step's peak rose 14.4 -> 22.4 GB
  until the XLA path's barrier (14.8 GB with it, H100, fdbd31f)."""
  return _tuning_file(device_kind).get("xla_dequant", "xla") if device_kind else "xla"


def xla_backward_layout(device_kind: str | None) -> str:
  """The layout the XLA path's backward dequantizes a layer into, the tuning file's top-level
  "xla_backward_layout": "NxK" (the stored order; JAX's transpose of the forward, dy @ W[N, K]: the default) or
  "KxN" (a physical transposed copy, dy @ W[K, N]^T: the bench's bf16 backward's operand order).
  Opt-in: on an H200 at bf9eb66 at 2048 rows "KxN" took 7B q|k|v 131.7 -> 110.8 us and o 105.7 -> 87.5 (0.83 ->
  0.98-1.00x the bf16 dot) and left 7B down and 32B q|k|v / o / down within 0.5%, but the 7B GRPO step with
  768-row update micro-batches went 12.40 -> 12.77 s (update 6.40 -> 6.77), one run each, not profiled."""
  return _tuning_file(device_kind).get("xla_backward_layout", "NxK") if device_kind else "NxK"


def get_config(direction: str, m: int, k: int, n: int, device_kind: str | None = None,
               num_sms: int = _DEFAULT_NUM_SMS) -> Nvfp4MatmulConfig:
  """Tuned config for the device kind when one covers the shape, else the heuristic one.

  The first entry of the tuning file for the direction whose max_rows covers m and, if it names "shapes"
  ([K, N] pairs), whose shapes include (k, n): per-shape entries go before the row count's general one (the
  best gemv at one row differs between 7B down and q, and the 256-row backward tile between gate_up and o)."""
  base = heuristic_config(direction, m, k, n, num_sms=num_sms)
  if device_kind:
    for d, max_rows, items, shapes in load_tuning(device_kind):
      if d == direction and m <= max_rows and (shapes is None or (k, n) in shapes):
        tuned = dict(items)
        auto = "split" not in tuned
        cfg = dataclasses.replace(base, **tuned)
        return fit(cfg, direction, m, k, n, num_sms=num_sms, auto_split=auto)
  return base
