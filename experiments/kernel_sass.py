"""What an NVFP4 kernel compiles to, on a machine without a GPU: Pallas -> Triton IR -> SASS for sm_90.

  pip install "triton==3.6.0"      # the `sass` extra; brings ptxas and cuobjdump for sm_90
  python3 -m experiments.kernel_sass --shape qwen2.5-7b.gate_up --rows 8
  python3 -m experiments.kernel_sass --shape qwen2.5-7b.down --rows 64 --direction bwd --dequant jnp

It lowers the kernel the dispatch would launch for that shape and row count on an H200 (the tuned config;
``--block`` and ``--dequant`` override it) to Triton IR the way jax does for a CUDA GPU, compiles that with
the pip Triton for sm_90 and prints the instruction mix of the K loop, per thread and per weight: global
loads (``LDG`` synchronous, ``LDGSTS`` async copies the software pipeline issues ahead), shared-memory
traffic and barriers, tensor-core ops and the ALU work of the decode. XLA on the GPU builds its own Triton
and pipeline, so the SASS is close to, not identical with, what runs there (registers differed by 0-20% at
a9618a4; a profiler trace states the GPU's: ``bench_kernels --trace`` records it as ``launch``); the IR is
jax's own. Files (ttir, the TTIR after Triton's passes as .opt.ttir, ttgir, ptx, sass, JSON summary) go to
``--out``.

``--mosaic`` (on a GPU only: Mosaic GPU compiles inside the CUDA plugin) compiles the Mosaic GPU forward kernel
(``qerl_kernels/nvfp4_mgpu.py``) with its dump switches on and reads the same mix from its SASS. The H200 machine
has no nvdisasm, so Mosaic GPU dumps PTX only; this tool assembles that PTX with the pip Triton's ptxas
(``assemble_ptx``; ``--ptx FILE`` does the same for a PTX file brought back). Mosaic GPU writes PTX ISA 9.0 and
Triton 3.6's ptxas reads 8.8: the version line is lowered, which at 584a6d9 gave the register count the GPU's
own ptxas reported (125).

Found with it at 61ea4fd: the few-row tile kernel spent ~6.6 instructions per weight in its K loop, read its
packed weights from shared memory two bytes at a time, and loaded block scales one byte at a time
synchronously (fixed with an alignment hint at 0dcb044, which changed no timing); the gemv engine's loop has
no async copies at all (Triton pipelines a loop without a dot only when the loop is marked). ``--pipeline``
compiles the gemv with that mark (``Nvfp4MatmulConfig.pipeline``, ``qerl_kernels/loop_stages.py``): at 7B gate,
one row (18th session), the codes', scales' and x's loads become LDGSTS, and the loop grows from 412 to 420 / 437
instructions per trip at 2 / 3 stages (71 registers against 74, 7.7 / 13.3 KB of shared memory).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import io
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp

from experiments.bench_kernels import MODELS
from qerl_kernels import config as config_lib, nvfp4_gemv
from qerl_kernels.nvfp4_matmul_bwd import nvfp4_matmul_bwd_pallas
from qerl_kernels.nvfp4_matmul_fwd import nvfp4_matmul_fwd_pallas

# SASS opcode (before the first '.') -> the class reported.
_CLASSES = {
  "LDG": "global load (sync)", "LDGSTS": "global->shared async copy", "LDS": "shared load", "STS": "shared store",
  "STSM": "shared store", "LDSM": "shared load", "BAR": "barrier", "HGMMA": "tensor core", "HMMA": "tensor core",
  "WARPGROUP": "tensor core sync", "DEPBAR": "async-copy wait", "LDGDEPBAR": "async-copy wait",
  "PRMT": "byte permute", "LOP3": "integer", "SHF": "integer", "IMAD": "integer", "IADD3": "integer",
  "LEA": "integer", "VIADD": "integer", "SEL": "integer", "ISETP": "integer",
  "HMUL2": "16-bit float", "HFMA2": "16-bit float", "HADD2": "16-bit float",
  "F2F": "conversion", "F2FP": "conversion", "I2F": "conversion", "F2I": "conversion",
  "FFMA": "32-bit float", "FMUL": "32-bit float", "FADD": "32-bit float",
}
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([.\w]*)")


def triton_ir(direction: str, rows: int, k: int, n: int, cfg: config_lib.Nvfp4MatmulConfig, xa_rank: int = 0,
              epilogue_rank: int = 0, group: tuple[int, ...] = (), norm: str = "") -> str:
  """The kernel's Triton IR as text Triton's own parser reads (jax's debug print, locations stripped).
  xa_rank: the gemv launch that also computes x @ A for a float32 adapter of this rank. epilogue_rank: the
  forward with the fused epilogue (bias and a bf16 adapter of this rank: ``fused_lora``). group: the forward
  over a group of weights of these widths (summing to n) in one launch (``qerl_kernels.Nvfp4Group``). norm
  ("plain" or "noise"; with xa_rank): that launch reading a pending RMSNorm of x (``nvfp4_gemv.NormPlan``)."""

  widths = group or (n,)
  packed = tuple(jax.ShapeDtypeStruct((w, k // 2), jnp.uint8) for w in widths)
  scale = tuple(jax.ShapeDtypeStruct((w, k // 16), jnp.float8_e4m3fn) for w in widths)
  gs = tuple(jax.ShapeDtypeStruct((), jnp.float32) for _ in widths)
  if not group:
    packed, scale, gs = packed[0], scale[0], gs[0]
  elif direction != "fwd" or sum(group) != n:
    raise ValueError(f"a group is a forward over widths summing to N={n}, got {group} ({direction})")
  if direction == "fwd" and xa_rank and norm:
    from qerl_kernels.decode_residual_norm import PendingNorm  # pylint: disable=import-outside-toplevel
    adapter = jnp.zeros((k, xa_rank), jnp.float32)
    noise = jnp.zeros((k,), jnp.float32) if norm == "noise" else None

    def f(a, p, s, g):
      pending = PendingNorm(a, jnp.ones((rows, k // 128), jnp.float32), jnp.ones((k,), jnp.bfloat16), noise,
                            eps=1e-6, shape=(rows, k), block_d=128, num_warps=2, interpret=False)
      return nvfp4_gemv.nvfp4_gemv_xa_partials(pending, p, s, g, adapter, config=cfg)
    a = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
  elif direction == "fwd" and xa_rank:
    adapter = jnp.zeros((k, xa_rank), jnp.float32)
    f = lambda a, p, s, g: nvfp4_gemv.nvfp4_gemv_xa_pallas(a, p, s, g, adapter, config=cfg)
    a = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
  elif direction == "fwd" and epilogue_rank:
    xa, b = jnp.zeros((rows, epilogue_rank), jnp.bfloat16), jnp.zeros((epilogue_rank, n), jnp.bfloat16)
    f = lambda a, p, s, g: nvfp4_matmul_fwd_pallas(a, p, s, g, config=cfg, xa_MxR=xa, b_RxN=b,
                                                   bias_N=jnp.zeros((n,), jnp.bfloat16), lora_scale=2.0)
    a = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
  elif direction == "fwd":
    f = lambda a, p, s, g: nvfp4_matmul_fwd_pallas(a, p, s, g, config=cfg)
    a = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
  else:
    f = lambda a, p, s, g: nvfp4_matmul_bwd_pallas(a, p, s, g, config=cfg)
    a = jax.ShapeDtypeStruct((rows, n), jnp.bfloat16)
  return lowered_ir(f, a, packed, scale, gs)


def lowered_ir(f, *args) -> str:
  """The Triton IR of the one Pallas kernel in jit(f) lowered for CUDA (jax's debug print, cleaned)."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  original, buf = pl.pallas_call, io.StringIO()
  pl.pallas_call = functools.partial(original, debug=True)  # the kernels look pallas_call up at call time
  try:
    with contextlib.redirect_stdout(buf):
      jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    pl.pallas_call = original
  return clean_ir(buf.getvalue())


def xla_dequant_ir(k: int, n: int, block_n: int, block_b: int, num_warps: int) -> str:
  """Triton IR of the XLA path's Pallas dequantization (`qerl_kernels.nvfp4_dequant`) of one [K, N] weight."""
  from qerl_jax.quant.types import NVFP4Tensor  # pylint: disable=import-outside-toplevel
  from qerl_kernels import nvfp4_dequant  # pylint: disable=import-outside-toplevel

  q = NVFP4Tensor(jax.ShapeDtypeStruct((n, k // 2), jnp.uint8), jax.ShapeDtypeStruct((n, k // 16), jnp.float8_e4m3fn),
                  jax.ShapeDtypeStruct((), jnp.float32))
  return lowered_ir(lambda q: nvfp4_dequant.dequantize_NxK(q, block_n=block_n, block_b=block_b, num_warps=num_warps),
                    q)


def xla_dequant_main(args, k: int, n: int) -> dict:
  """--xla-dequant: compile the dequantization kernel for sm_90; print its size per packed byte (no loop: each
  program runs its instructions once over block_n x block_b x 8 bytes)."""
  block_n, block_b, num_warps = map(int, args.xla_dequant.split(","))
  os.makedirs(args.out, exist_ok=True)
  base = os.path.join(args.out, f"{args.shape}.xla_dequant.{block_n}x{block_b}x{num_warps}")
  with open(base + ".ttir", "w") as f:
    f.write(xla_dequant_ir(k, n, block_n, block_b, num_warps))
  out = compile_sm90(base + ".ttir", num_warps, 1)
  with open(base + ".sass", "w") as f:
    f.write(out["sass"])
  opcodes = opcode_counts(out["sass"])
  total = sum(opcodes.values())
  per_byte = total * num_warps / (block_n * block_b * 8)  # warp instructions per packed byte
  occupancy = programs_per_sm(out["registers"], out["shared_bytes"], num_warps)
  summary = dict(shape=args.shape, kernel="nvfp4_dequant", block_n=block_n, block_b=block_b, num_warps=num_warps,
                 instructions=total, registers=out["registers"], shared_bytes=out["shared_bytes"],
                 warp_instructions_per_byte=round(per_byte, 3), occupancy=occupancy,
                 opcodes=dict(opcodes.most_common()))
  with open(base + ".json", "w") as f:
    json.dump(summary, f, indent=1)
  print(f"{args.shape} nvfp4_dequant {block_n}x{block_b} blocks, {num_warps} warps: {total} instructions per warp, "
        f"{out['registers']} registers, {per_byte:.3f} warp instructions per packed byte, "
        f"{occupancy['programs']} programs per SM; top opcodes {opcodes.most_common(8)}")
  return summary


def clean_ir(debug_text: str) -> str:
  """The module from pallas' debug print, without the location annotations jax's MLIR prints and Triton's
  parser rejects: ' [unknown]', ' "name:"(#locN)', ' loc(#locN)', and the '#locN = ...' table."""
  text = debug_text[debug_text.index("module @"):]
  text = re.sub(r" \[unknown\]", "", text)
  text = re.sub(r' "[^"\n]*":?\(#loc\d*\)', "", text)
  text = re.sub(r" \(#loc\d*\)| loc\(#loc\d*\)", "", text)
  lines = text.split("\n")
  end = max(i for i, line in enumerate(lines) if line == "}")
  return "\n".join(lines[:end + 1]) + "\n"


def compile_sm90(ttir_path: str, num_warps: int, num_stages: int) -> dict[str, str]:
  """Compiles a .ttir file with the pip Triton for sm_90; returns its ttgir, ptx and SASS texts."""
  import triton  # pylint: disable=import-outside-toplevel
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel

  target, options = GPUTarget("cuda", 90, 32), dict(num_warps=num_warps, num_stages=num_stages)
  optimized = os.path.splitext(ttir_path)[0] + ".opt.ttir"
  with open(optimized, "w") as f:
    f.write(make_ttir(ttir_path, target, options))
  kernel = triton.compile(optimized, target=target, options=options)
  cubin = os.path.splitext(ttir_path)[0] + ".cubin"
  with open(cubin, "wb") as f:
    f.write(kernel.asm["cubin"])
  sass, registers = cuobjdump(cubin)
  return {"ttgir": kernel.asm["ttgir"], "ptx": kernel.asm["ptx"], "sass": sass,
          "shared_bytes": kernel.metadata.shared, "registers": registers}


def cuobjdump(cubin_path: str) -> tuple[str, int]:
  """(SASS text, registers per thread) of a cubin, through the cuobjdump that the pip Triton ships."""
  import triton  # pylint: disable=import-outside-toplevel
  tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
  sass = subprocess.run([tool, "-sass", cubin_path], check=True, capture_output=True, text=True).stdout
  usage = subprocess.run([tool, "-res-usage", cubin_path], check=True, capture_output=True, text=True).stdout
  return sass, int(re.search(r"REG:(\d+)", usage).group(1))


def opcode_counts(sass: str) -> collections.Counter:
  """How often each opcode (without its suffixes) occurs in a SASS listing."""
  return collections.Counter(m.group(3) for m in _INSTR.finditer(sass))


def make_ttir(ttir_path: str, target, options: dict) -> str:
  """The module after Triton's TTIR passes (canonicalize, combine dot + add, CSE, loop unroll), as text.

  ``triton.compile`` skips the passes of the stage a source file is already in, so a .ttir file goes straight
  to the TTGIR stage; XLA's Triton pipeline (MakeTTIR in xla/backends/gpu/codegen/triton) runs them on the IR
  jax hands it. Until they ran here (2026-12-01), this tool compiled each tile dot from a zero accumulator
  plus a separate add, which XLA folds into the dot: the 64-row tile read 136 registers and 3 programs per
  SM here, 96 and 5 with the passes (the H200's trace: 115 registers, 4 programs).
  """
  from triton.compiler import compiler as tc  # pylint: disable=import-outside-toplevel

  backend = tc.make_backend(target)
  context = tc.ir.context()
  source = tc.IRSource(ttir_path, context, backend)
  opts = backend.parse_options(options)
  module = source.module
  module.context = context
  backend.make_ttir(module, {}, opts, target.arch)
  return str(module)


def programs_per_sm(registers: int, shared_bytes: int, num_warps: int) -> dict[str, int]:
  """How many programs (CTAs) of this kernel fit on one H100/H200 SM, and what limits it.

  Limits: 64K registers (allocated per warp in units of 256, i.e. per thread rounded up to 8), 228 KB of
  shared memory with 1 KB reserved per CTA, 64 warps, 32 CTAs.
  """
  per_warp_regs = -(-registers // 8) * 8 * 32
  limits = {"registers": 65536 // (per_warp_regs * num_warps),
            "shared memory": 233472 // (shared_bytes + 1024),
            "warps": 64 // num_warps, "ctas": 32}
  return dict(programs=min(limits.values()), limited_by=min(limits, key=limits.get),
              warps=min(limits.values()) * num_warps)


def loop_mix(sass: str) -> tuple[collections.Counter, collections.Counter, int]:
  """Opcode and class counts inside the largest backward branch's body (the K loop); and its length."""
  instrs = [(int(m.group(1), 16), m.group(3), m.group(3) + m.group(4)) for m in _INSTR.finditer(sass)]
  loops = []
  for addr, op, _ in instrs:
    if op == "BRA":
      target = re.search(rf"/\*{addr:04x}\*/[^\n]*BRA\s+(0x[0-9a-f]+)", sass)
      if target and int(target.group(1), 16) < addr:
        loops.append((int(target.group(1), 16), addr))
  if not loops:
    raise ValueError("no backward branch (loop) in this SASS")
  start, end = max(loops, key=lambda se: se[1] - se[0])
  body = [(op, full) for addr, op, full in instrs if start <= addr <= end]
  opcodes = collections.Counter(full for _, full in body)
  classes = collections.Counter(_CLASSES.get(op, "other") for op, _ in body)
  return opcodes, classes, len(body)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shape", default="qwen2.5-7b.gate_up", help="qwen2.5-<model>.<layer>, as in bench_kernels")
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--direction", default="fwd", choices=["fwd", "bwd"])
  p.add_argument("--block", default="", help="block_m,block_n,block_k,num_warps,num_stages (default: tuned)")
  p.add_argument("--dequant", default="", choices=["", *config_lib.DECODERS])
  p.add_argument("--prefetch", choices=["tuned", "on", "off", "2", "3"], default="tuned",
                 help="gemv: K trips loaded ahead: on = 1, off = 0, or 2, 3 (default: as the tuned config does)")
  p.add_argument("--ragged", action="store_true",
                 help="tile forward: re-split automatically in ragged K ranges (Nvfp4MatmulConfig.ragged_split; "
                      "with --block, from its block_k)")
  p.add_argument("--pipeline", action="store_true",
                 help="gemv: mark the K loop for Triton's software pipeliner, num_stages deep (--block sets the "
                      "depth; Nvfp4MatmulConfig.pipeline)")
  p.add_argument("--half", action="store_true",
                 help="gemv, e4m3-route decoder: float16 block sums (Nvfp4MatmulConfig.half_products)")
  p.add_argument("--epilogue", type=int, default=0, metavar="RANK",
                 help="tile forward: with the fused epilogue (bias and a bf16 adapter of this rank)")
  p.add_argument("--lora-xa", type=int, default=0, metavar="RANK",
                 help="gemv: the launch that also computes x @ A for an adapter of this rank (nvfp4_matmul_xa)")
  p.add_argument("--norm", default="", choices=["", "plain", "noise"],
                 help="gemv with --lora-xa: reading a pending RMSNorm of x, with or without AQN noise "
                      "(decode_residual_norm.PendingNorm)")
  p.add_argument("--group", default="", metavar="WIDTHS",
                 help="forward: one launch over a group of weights of these widths, e.g. 3584,512,512 for the "
                      "shape qkv (qerl_kernels.Nvfp4Group: a branch per member)")
  p.add_argument("--out", default="/tmp/kernel_sass")
  p.add_argument("--mosaic", default="", metavar="STAGES,TILE_K,DECODE,TILE_N",
                 help="on a GPU: the Mosaic GPU forward kernel with this config (e.g. 4,256,bits,64)")
  p.add_argument("--xla-dequant", default="", metavar="BLOCK_N,BLOCK_B,NUM_WARPS",
                 help="the XLA path's Pallas dequantization (qerl_kernels/nvfp4_dequant.py) of --shape instead")
  p.add_argument("--ptx", default="", metavar="FILE",
                 help="assemble this PTX file for sm_90a (e.g. Mosaic GPU's dump) and read its loop; no GPU needed")
  args = p.parse_args(argv)
  if args.ptx:
    return ptx_main(args.ptx, args.out)

  model, layer = args.shape.removeprefix("qwen2.5-").split(".")
  k, n = MODELS[model][layer]
  if args.mosaic:
    return mosaic_main(args, k, n)
  if args.xla_dequant:
    return xla_dequant_main(args, k, n)
  cfg = config_lib.get_config(args.direction, args.rows, k, n, "NVIDIA H200")
  if args.block:
    bm, bn, bk, warps, stages = map(int, args.block.split(","))
    cfg = config_lib.fit(dataclasses.replace(cfg, block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                                             num_stages=stages, split=1), args.direction, args.rows, k, n)
  if args.ragged:
    cfg = config_lib.fit(dataclasses.replace(cfg, ragged_split=True, split=1), args.direction, args.rows, k, n,
                         auto_split=True)
  if args.dequant:
    cfg = dataclasses.replace(cfg, dequant=args.dequant)
  if args.prefetch != "tuned":
    cfg = dataclasses.replace(cfg, prefetch=int({"on": "1", "off": "0"}.get(args.prefetch, args.prefetch)))
  if args.pipeline:
    cfg = dataclasses.replace(cfg, pipeline=True, prefetch=0)
  if args.half:
    cfg = config_lib.fit(dataclasses.replace(cfg, half_products=True), args.direction, args.rows, k, n)
    if not cfg.half_products:
      raise SystemExit(f"--half needs the gemv engine and an e4m3-route decoder; the config is {cfg}")
  os.makedirs(args.out, exist_ok=True)
  group = tuple(int(w) for w in args.group.split(",")) if args.group else ()
  base = os.path.join(args.out, f"{args.shape}.{args.direction}.{args.rows}" + (".group" if group else "")
                      + (f".norm_{args.norm}" if args.norm else ""))
  with open(base + ".ttir", "w") as f:
    f.write(triton_ir(args.direction, args.rows, k, n, cfg, args.lora_xa, args.epilogue, group, args.norm))
  out = compile_sm90(base + ".ttir", cfg.num_warps, cfg.num_stages)
  for ext in ("ttgir", "ptx", "sass"):
    with open(f"{base}.{ext}", "w") as f:
      f.write(out[ext])
  opcodes, classes, length = loop_mix(out["sass"])
  total = len(_INSTR.findall(out["sass"]))  # static count, the loop once: what runs once per program is the rest
  occupancy = programs_per_sm(out["registers"], out["shared_bytes"], cfg.num_warps)
  # Each trip of the K loop decodes a [block_n, block_k] weight tile (forward, backward and gemv alike),
  # spread over num_warps * 32 threads.
  per_thread = cfg.block_n * cfg.block_k / (cfg.num_warps * 32)
  summary = dict(shape=args.shape, direction=args.direction, rows=args.rows, group=group,
                 config=dataclasses.asdict(cfg),
                 loop_instructions=length, outside_loop_instructions=total - length,
                 weights_per_thread_per_trip=per_thread,
                 instructions_per_weight=round(length / per_thread, 2), shared_bytes=out["shared_bytes"],
                 registers=out["registers"], occupancy=occupancy,
                 classes=dict(classes.most_common()), opcodes=dict(opcodes.most_common()))
  with open(base + ".json", "w") as f:
    json.dump(summary, f, indent=1)
  print(f"{args.shape} {args.direction} rows={args.rows} {cfg}")
  print(f"K loop: {length} instructions per thread per trip, {per_thread:.0f} weights per thread -> "
        f"{length / per_thread:.2f} per weight; shared memory {out['shared_bytes']} bytes, "
        f"{out['registers']} registers per thread -> {occupancy['programs']} programs "
        f"({occupancy['warps']} warps) per SM, limited by {occupancy['limited_by']}; {total - length} "
        f"instructions outside the loop")
  print_mix(classes, opcodes, 12)
  print(f"files: {base}.{{ttir,ttgir,ptx,sass,json}}")
  return summary


def print_mix(classes: collections.Counter, opcodes: collections.Counter, top: int) -> None:
  """The K loop's instruction classes, then its ``top`` most frequent opcodes."""
  for name, count in classes.most_common():
    print(f"  {count:5d}  {name}")
  print("  top opcodes: " + ", ".join(f"{op} {c}" for op, c in opcodes.most_common(top)))


def ptx_at_version(ptx: str, version: str) -> str:
  """The PTX text with its ``.version`` line set to ``version`` (an older ptxas refuses a newer ISA number even
  where the instructions are all its own)."""
  out, count = re.subn(r"^\.version\s+\d+\.\d+", f".version {version}", ptx, count=1, flags=re.M)
  if not count:
    raise ValueError("no .version line: not PTX text")
  return out


def assemble_ptx(ptx: str, out_base: str) -> dict[str, str]:
  """Assembles PTX for sm_90a with the pip Triton's newest ptxas (lowering .version once if it asks) and returns
  the SASS (``cuobjdump -sass``) and ptxas' report; files go to ``out_base``.{ptx,cubin,sass}."""
  import triton  # pylint: disable=import-outside-toplevel
  tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
  ptxas = next(p for p in (os.path.join(tools, "ptxas-blackwell"), os.path.join(tools, "ptxas")) if os.path.exists(p))
  for _ in range(2):
    with open(out_base + ".ptx", "w") as f:
      f.write(ptx)
    run = subprocess.run([ptxas, "-arch=sm_90a", "-O3", "-v", out_base + ".ptx", "-o", out_base + ".cubin"],
                         capture_output=True, text=True)
    wanted = re.search(r"Unsupported \.version \d+\.\d+; current version is '(\d+\.\d+)'", run.stderr)
    if run.returncode == 0 or not wanted:
      break
    ptx = ptx_at_version(ptx, wanted.group(1))
  if run.returncode:
    raise RuntimeError(f"ptxas failed on {out_base}.ptx:\n{run.stderr[-2000:]}")
  sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", out_base + ".cubin"], check=True,
                        capture_output=True, text=True).stdout
  with open(out_base + ".sass", "w") as f:
    f.write(sass)
  return {"sass": sass, "ptxas": run.stderr}


def ptx_main(path: str, out_dir: str):
  """--ptx: one PTX file's K-loop mix, printed and returned."""
  os.makedirs(out_dir, exist_ok=True)
  with open(path) as f:
    out = assemble_ptx(f.read(), os.path.join(out_dir, os.path.splitext(os.path.basename(path))[0]))
  opcodes, classes, length = loop_mix(out["sass"])
  print(out["ptxas"].strip())
  print(f"K loop: {length} instructions per thread per trip")
  print_mix(classes, opcodes, 16)
  return dict(loop_instructions=length, classes=dict(classes), opcodes=dict(opcodes))


def mosaic_config(spec: str, rows: int, k: int, n: int):
  """The MgpuConfig "STAGES,TILE_K,DECODE,TILE_N" names at this shape (row tile and split as the dispatch picks)."""
  from qerl_kernels import nvfp4_mgpu  # pylint: disable=import-outside-toplevel
  try:
    stages, tile_k, decode, tile_n = spec.split(",")
    entry = config_lib.Nvfp4MatmulConfig(engine="mosaic", block_m=128, block_n=int(tile_n), block_k=int(tile_k),
                                         num_stages=int(stages))
  except ValueError as e:
    raise SystemExit(f"--mosaic {spec!r}: expected STAGES,TILE_K,DECODE,TILE_N such as 4,256,bits,64 ({e})") from e
  return dataclasses.replace(nvfp4_mgpu.from_matmul_config(entry, rows, k, n), decode=decode)


def mosaic_main(args, k: int, n: int):
  """Compiles and runs the Mosaic GPU kernel once with MOSAIC_GPU_DUMP_TO set, then reads its SASS."""
  import glob  # pylint: disable=import-outside-toplevel
  from qerl_kernels import nvfp4_mgpu  # pylint: disable=import-outside-toplevel
  from qerl_jax.quant.api import quantize_NxK  # pylint: disable=import-outside-toplevel
  cfg = mosaic_config(args.mosaic, args.rows, k, n)
  if jax.default_backend() != "gpu":
    raise SystemExit("--mosaic needs a GPU: Mosaic GPU compiles to PTX and SASS inside the CUDA plugin")
  tag = f"{args.shape}.fwd.{args.rows}.mosaic-s{cfg.stages}-k{cfg.tile_k}-{cfg.decode}-n{cfg.tile_n}"
  dump = os.path.join(os.path.abspath(args.out), tag)
  os.makedirs(dump, exist_ok=True)
  os.environ["MOSAIC_GPU_DUMP_TO"] = dump  # read when the kernel compiles, below
  w = quantize_NxK(jax.random.normal(jax.random.key(0), (n, k), jnp.float32) * 0.02, "nvfp4")
  x = jax.random.normal(jax.random.key(1), (args.rows, k), jnp.bfloat16)
  y = jax.jit(lambda x: nvfp4_mgpu.nvfp4_matmul_fwd_mgpu(x, w.packed_NxKh, w.scale_NxKb, w.global_scale,
                                                           config=cfg))(x)
  jax.block_until_ready(y)  # compiled (and dumped) by now
  sass_files = [f for f in glob.glob(os.path.join(dump, "*")) if "sass" in os.path.basename(f).lower()]
  ptx_files = glob.glob(os.path.join(dump, "*.ptx"))
  if sass_files:
    with open(max(sass_files, key=os.path.getsize)) as f:
      sass = f.read()
  elif ptx_files:  # no nvdisasm on the machine: Mosaic GPU wrote the PTX only
    with open(max(ptx_files, key=os.path.getsize)) as f:
      sass = assemble_ptx(f.read(), os.path.join(dump, "local"))["sass"]
  else:
    raise SystemExit(f"no SASS or PTX in {dump}: {sorted(os.listdir(dump))}")
  opcodes, classes, length = loop_mix(sass)
  per_thread = cfg.tile_n * cfg.tile_k / 128  # one warpgroup decodes the program's [tile_n, tile_k] codes per step
  summary = dict(shape=args.shape, direction="fwd", rows=args.rows, engine="mosaic", config=dataclasses.asdict(cfg),
                 loop_instructions=length, weights_per_thread_per_trip=per_thread,
                 instructions_per_weight=round(length / per_thread, 2), files=sorted(os.listdir(dump)),
                 classes=dict(classes.most_common()), opcodes=dict(opcodes.most_common()))
  with open(dump + ".json", "w") as f:
    json.dump(summary, f, indent=1)
  print(f"{args.shape} fwd rows={args.rows} {cfg}")
  print(f"K loop: {length} instructions per thread per step, {per_thread:.0f} weights per thread -> "
        f"{length / per_thread:.2f} per weight")
  print_mix(classes, opcodes, 16)
  print(f"files: {dump}/ ({', '.join(summary['files'])})")
  return summary


if __name__ == "__main__":
  sys.exit(0 if main() else 1)
