"""Probe: does a warp-specialized NVFP4 tile beat the bf16 dot at 8-128 rows on Hopper?

    python experiments/triton_ws_probe.py --out $OUT/triton_ws_probe.json          # on the GPU (torch + triton)
    python experiments/triton_ws_probe.py --jax --out $OUT/triton_ws_probe_jax.json  # on the GPU, through JAX
    python experiments/triton_ws_probe.py --sass                                    # CPU: what sm_90 gets
    TRITON_INTERPRET=1 python experiments/triton_ws_probe.py --check-only --shapes tiny   # CPU: correctness

Why: at 64 rows the project's tile kernel (Pallas Triton) runs ~0.84x the bf16 dot (qerl_kernels/NOTES.md), and
that is what keeps the batch-64 rollout at 0.93x bf16 on an H200 (RESULTS.md, 38be05a). One program is one
warpgroup that loads, decodes and waits on its wgmma in turn. Triton 3.6 can split such a loop into a producer
warp that issues TMA copies and consumer warps that decode and multiply (``tl.range(..., warp_specialize=True)``),
but Pallas cannot ask for it, and Triton does it only for loops whose loads are tensor descriptors (TMA): with
plain loads its pass manager failed at these tiles (an earlier, ``tl.load`` version, compiled for sm_90 on the
CPU). This script writes the swapped tile directly in Triton (y^T = dequant(W) @ x^T: the decoded weight is wgmma's
register operand, the rows are its N), with and without warp specialization, and times it beside torch's bf16
matmul on the same shape. It decides whether such a kernel is worth building into the model; it is not one.
``--jax`` launches it from JAX through the CUDA plugin's Triton launcher, which allocates the global scratch its
device-side descriptors need (jax-triton 0.3.1 does not).

First GPU run (an H100, 0d5b0d8; RESULTS.md): not worth it. The split loop is right only at 2 stages and there 2x
slower than the unsplit one, which is itself slower than the project's Pallas tile.

The kernel: y[m, n] = sum_k x[m, k] * dequant(W)[n, k] for M <= BLOCK_M rows of x (bf16) and W as NVFP4 (codes
[N, K/2] uint8, two per byte, low nibble first; e4m3 scales [N, K/16]; global scale 1). The codes decode to bf16
bits exactly (E2M1 from its sign, exponent and mantissa fields; 0 and 0.5 by a select), times the block scale
in bf16 (exact: 2 x 4 significant bits), one tl.dot per step accumulating float32.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import numpy as np

SHAPES = {  # name: (K, N) of the weight as y = x @ W^T reads it
  "7b.gate": (3584, 18944),
  "7b.gate_up": (3584, 37888),
  "7b.down": (18944, 3584),
  "7b.qkv": (3584, 4608),
  "7b.o": (3584, 3584),
  "tiny": (512, 128),  # CPU check: two K steps of 256, two column blocks of 64
}

try:  # the `sass` extra (pip install -e ".[sass]") or the GPU machine's image
  import triton
  import triton.language as tl
except ImportError:  # the CLI says what to install
  triton = None
else:
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _require_triton() -> None:
  if triton is None:
    raise SystemExit("triton_ws_probe needs Triton: pip install -e \".[sass]\" (or run it on the GPU machine)")


if triton is not None:
  @triton.jit
  def decode_tile(packed, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """[BLOCK_N, BLOCK_K // 2] packed codes and [BLOCK_N, BLOCK_K // 16] e4m3 bytes -> [BLOCK_N, BLOCK_K] bf16."""
    codes = tl.interleave(packed & 0xF, packed >> 4).to(tl.uint16)  # element 2j is byte j's low nibble
    em = codes & 7  # exponent and mantissa fields
    # bf16 bits: a normal E2M1 value 2**(e-1) (1 + m/2) is bf16 exponent e + 126 over the same mantissa bit; the
    # two subnormal codes (0, 0.5) are 0 and 0x3F00.
    bits = tl.where(em < 2, em * 0x3F00, (em << 6) + (126 << 7)) | ((codes & 8) << 12)
    w = bits.to(tl.bfloat16, bitcast=True)
    s = scale.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if INTERPRET:  # the CPU interpreter's bf16 products are wrong (checked at 3.6.0): the same in float32
      w = (tl.reshape(w.to(tl.float32), (BLOCK_N, BLOCK_K // 16, 16)) * s[:, :, None]).to(tl.bfloat16)
    else:
      w = tl.reshape(w, (BLOCK_N, BLOCK_K // 16, 16)) * s.to(tl.bfloat16)[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))

  @triton.jit
  def tile_kernel(x_ptr, packed_ptr, scale_ptr, y_ptr, M, N, K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr,
                  SCALES_KN: tl.constexpr, INTERPRET: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    # Device-side descriptors (TMA): the only loads Triton warp-specializes. Rows past M read zeros.
    w_desc = tl.make_tensor_descriptor(packed_ptr, [N, K // 2], [K // 2, 1], [BLOCK_N, BLOCK_K // 2])
    if SCALES_KN:  # a [K/16, N] copy of the scales: rows of BLOCK_N bytes, so K steps below 256 are legal for TMA
      s_desc = tl.make_tensor_descriptor(scale_ptr, [K // 16, N], [N, 1], [BLOCK_K // 16, BLOCK_N])
    else:
      s_desc = tl.make_tensor_descriptor(scale_ptr, [N, K // 16], [K // 16, 1], [BLOCK_N, BLOCK_K // 16])
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES, warp_specialize=WS):
      if SCALES_KN:
        scale = tl.trans(s_desc.load([k // 16, n0]))
      else:
        scale = s_desc.load([n0, k // 16])
      w = decode_tile(w_desc.load([n0, k // 2]), scale, BLOCK_N, BLOCK_K, INTERPRET)
      x_t = tl.trans(x_desc.load([0, k]))
      if INTERPRET:  # its bf16 dot is wrong too (float16 and float32 right; checked at 3.6.0)
        acc = tl.dot(w.to(tl.float32), x_t.to(tl.float32), acc)
      else:
        acc = tl.dot(w, x_t, acc)
    rows, cols = tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + rows[None, :] * N + cols[:, None], acc.to(tl.bfloat16), mask=rows[None, :] < M)


# Blocks: with the scales as stored ([N, K/16]) K steps of 256 keep the descriptor's rows at TMA's 16-byte minimum;
# a [K/16, N] copy ("kn") allows 64 and 128, with a smaller x tile per stage. Warp specialization compiled for sm_90
# at 64 columns and 4 warps; 128 columns failed (4 warps) or fell back to one partition (8 warps).
VARIANTS = ([dict(block_n=64, block_k=256, stages=s, num_warps=4, ws=ws, scales="nk") for ws in (False, True)
             for s in (2, 3, 4)]
            + [dict(block_n=64, block_k=bk, stages=s, num_warps=4, ws=True, scales="kn") for bk in (64, 128)
               for s in (3, 4)])


def _name(v) -> str:
  return f"ws={v['ws']} bk {v['block_k']} {v['scales']} stages {v['stages']}"


def make_case(rows: int, k: int, n: int, device, seed: int = 0):
  """The gemv probe's random NVFP4 weight (`triton_gemv_probe.random_nvfp4`), bf16 rows, and the float64 reference."""
  import torch  # pylint: disable=import-outside-toplevel
  from triton_gemv_probe import random_nvfp4  # pylint: disable=import-outside-toplevel
  packed, scale_bits, w = random_nvfp4(k, n, seed)
  x = torch.randn(rows, k, dtype=torch.float32).to(torch.bfloat16)
  t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
  return dict(x=x.to(device), packed=t(packed), scale=t(scale_bits), scale_kn=t(scale_bits.T), w=w,
              y_ref=x.double().numpy() @ w.T)


def _scratch_allocator(device):
  import torch  # pylint: disable=import-outside-toplevel
  triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))


def launch(case, out, *, block_n: int, block_k: int, stages: int, num_warps: int, ws: bool, scales: str):
  rows, k = case["x"].shape
  n = case["packed"].shape[0]
  block_m = max(16, triton.next_power_of_2(rows))
  scale = case["scale"] if scales == "nk" else case["scale_kn"]
  tile_kernel[(triton.cdiv(n, block_n),)](case["x"], case["packed"], scale, out, rows, n, K=k, BLOCK_M=block_m,
                                          BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, WS=ws,
                                          SCALES_KN=scales == "kn", num_warps=num_warps,
                                          INTERPRET=os.environ.get("TRITON_INTERPRET") == "1")


def check(case, variant) -> float:
  """Largest error in bf16 ulps of each reference output (one ulp: 2**-7 of it, plus 1e-5 of the largest for the
  float32 sums' error where outputs cancel to near zero). Rounding to nearest stays within half an ulp; the CPU
  interpreter's float32 -> bf16 conversion truncates (checked at 3.6.0), which stays within one."""
  import torch  # pylint: disable=import-outside-toplevel
  out = torch.full((case["x"].shape[0], case["packed"].shape[0]), float("nan"), dtype=torch.bfloat16,
                   device=case["x"].device)
  launch(case, out, **variant)
  y, ref = out.double().cpu().numpy(), case["y_ref"]
  err = ulps_error(y, ref)
  if err > 1.0:  # where it is wrong: which rows and columns (a pattern names the bug: one stage, one partition)
    bad = ~(ulps_apart(y, ref) <= 1.0)  # (not finite counts as wrong)
    rows_bad, cols_bad = np.nonzero(bad.any(1))[0], np.nonzero(bad.any(0))[0]
    print(f"  {_name(variant)}: {bad.mean():.4f} of outputs wrong; rows {rows_bad[:8].tolist()} of {len(rows_bad)}, "
          f"columns {cols_bad[:8].tolist()}.. of {len(cols_bad)}; column blocks of 64 wrong: "
          f"{len(np.unique(cols_bad // 64))} of {-(-y.shape[1] // 64)}; y[0,:4] {y[0, :4]} ref {ref[0, :4]}")
  return err


def ulps_error(y, ref) -> float:
  """The largest |y - ref| in bf16 ulps of ref (`check`); inf where y is not finite (a poisoned, unwritten tile)."""
  if not np.isfinite(y).all():
    return float("inf")
  return float(ulps_apart(y, ref).max())


def ulps_apart(y, ref):
  """|y - ref| per element in bf16 ulps of ref (`check`'s unit)."""
  return np.abs(y - ref) / (np.abs(ref) * 2.0 ** -7 + 1e-5 * np.abs(ref).max())


def sass_report(shape: str, rows: int) -> list[dict]:
  """Compile each variant for sm_90 without a GPU: whether the loop was split into partitions, registers, shared
  memory and the SASS's opcode counts (the whole kernel; the loop is not isolated)."""
  from experiments import kernel_sass  # pylint: disable=import-outside-toplevel
  k, _ = SHAPES[shape]
  out = []
  for v in VARIANTS:
    row = dict(v, shape=shape, rows=rows)
    try:
      compiled = compile_for(v, rows, k)
    except Exception as e:  # pylint: disable=broad-except  # Triton's pass failures: report, go on
      row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
      print(f"{shape} rows {rows} {v}: FAILED {row['failed']}")
      out.append(row)
      continue
    cubin = f"/tmp/triton_ws_probe_{os.getpid()}.cubin"
    with open(cubin, "wb") as f:
      f.write(compiled.asm["cubin"])
    sass, registers = kernel_sass.cuobjdump(cubin)
    os.remove(cubin)
    ptx = compiled.asm["ptx"]
    row.update(partitions="ttg.warp_specialize" in compiled.asm["ttgir"], shared=compiled.metadata.shared,
               registers=registers, wgmma_register_a=bool(re.search(r"wgmma\.mma_async[^;]*\}, \{%r", ptx)),
               tma_loads=ptx.count("cp.async.bulk.tensor"),
               opcodes=dict(kernel_sass.opcode_counts(sass).most_common(12)))
    print(f"{shape} rows {rows} {_name(v)}: partitions {row['partitions']}, {row['registers']} registers, "
          f"{row['shared']} B shared, TMA loads {row['tma_loads']}, "
          f"wgmma A in registers {row['wgmma_register_a']}")
    out.append(row)
  return out


def compile_for(variant, rows: int, k: int, capability: int = 90):
  """The variant compiled by this Triton for one shape and row count (what a JAX launch hands the CUDA plugin)."""
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
  sig = {"x_ptr": "*bf16", "packed_ptr": "*u8", "scale_ptr": "*u8", "y_ptr": "*bf16", "M": "i32", "N": "i32"}
  consts = dict(K=k, BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=variant["block_n"],
                BLOCK_K=variant["block_k"], STAGES=variant["stages"], WS=variant["ws"],
                SCALES_KN=variant["scales"] == "kn", INTERPRET=False)
  src = triton.compiler.ASTSource(fn=tile_kernel, signature={**sig, **{c: "constexpr" for c in consts}},
                                  constexprs=consts, attrs={(i,): [["tt.divisibility", 16]] for i in range(4)})
  return triton.compile(src, target=GPUTarget("cuda", capability, 32),
                        options=dict(num_warps=variant["num_warps"], num_stages=variant["stages"]))


def jax_tile(variant, rows: int, k: int, n: int, capability: int = 90):
  """f(x, packed, scale) -> y [rows, N] bf16 as one JAX custom call: this Triton's compiled kernel handed to the CUDA
  plugin's launcher (`triton_kernel_call_ffi`, the call jax-triton emits), which also allocates the global scratch
  the device-side descriptors are written to (jax-triton 0.3.1 passes none). `scale` is the [K/16, N] copy for the
  "kn" variants. Lowers on any machine whose jaxlib has the CUDA plugin; runs on a GPU only."""
  import zlib  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax._src.interpreters import mlir  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  from jax.extend.core import Primitive  # pylint: disable=import-outside-toplevel
  from jaxlib import gpu_triton  # pylint: disable=import-outside-toplevel
  if getattr(gpu_triton, "TritonKernel", None) is None:
    raise RuntimeError("this jaxlib has no CUDA plugin (jax-cuda12-plugin): no Triton launcher to hand the kernel to")
  compiled = compile_for(variant, rows, k, capability)
  meta = compiled.metadata
  kernel = gpu_triton.TritonKernel(meta.name, variant["num_warps"], 1, meta.shared, compiled.asm["ptx"],
                                   compiled.asm["ttir"], capability, meta.global_scratch_size,
                                   meta.global_scratch_align)
  params = ([gpu_triton.create_array_parameter(0, 16)] * 4  # x, packed, scale, then y (the call's result)
            + [gpu_triton.create_scalar_parameter(rows, "i32"), gpu_triton.create_scalar_parameter(n, "i32")])
  call = gpu_triton.TritonKernelCall(kernel, triton.cdiv(n, variant["block_n"]), 1, 1, params)
  opaque = zlib.compress(call.to_proto(meta.name, b""))
  prim = Primitive(f"triton_ws_probe_{meta.name}")
  prim.def_abstract_eval(lambda *avals: jax.core.ShapedArray((rows, n), jnp.bfloat16))

  def lowering(ctx, *operands):
    layouts = lambda avals: [list(reversed(range(len(a.shape)))) for a in avals]  # noqa: E731  # row-major
    out_type = mlir.aval_to_ir_type(ctx.module_context, ctx.avals_out[0])
    config = dict(name=ir.StringAttr.get(meta.name), opaque=ir.StringAttr.get(opaque))
    return mlir.custom_call("triton_kernel_call_ffi", result_types=[out_type], operands=list(operands),
                            backend_config=config, operand_layouts=layouts(ctx.avals_in),
                            result_layouts=layouts(ctx.avals_out)).results

  mlir.register_lowering(prim, lowering, platform="cuda")
  return prim.bind


def jax_run(shapes, rows_list, out_path) -> list[dict]:
  """Each variant through `jax_tile`: checked against NumPy, then timed as one jitted program of 16 launches over
  rotated weight copies (host-timed median of 30 runs, per launch), beside XLA's bf16 dot and the project's tile
  kernel (Pallas) in the same harness: what a model launch would cost, custom call included."""
  from triton_gemv_probe import host_us, rotations  # pylint: disable=import-outside-toplevel  # one jitted program
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import qerl_kernels  # pylint: disable=import-outside-toplevel
  from qerl_jax.quant.types import NVFP4Tensor  # pylint: disable=import-outside-toplevel
  capability = int(float(jax.devices()[0].compute_capability) * 10)
  records = []
  for shape in shapes:
    k, n = SHAPES[shape]
    for rows in rows_list:
      case = make_case(rows, k, n, "cpu")
      x = jnp.asarray(case["x"].float().numpy(), jnp.bfloat16)
      packed, scale_nk = jnp.asarray(case["packed"].numpy()), jnp.asarray(case["scale"].numpy())
      scale_kn = jnp.asarray(case["scale_kn"].numpy())
      # Rotated copies past the 50-60 MB L2, so that each launch streams its weight from HBM.
      copies = [(packed + jnp.uint8(0), scale_nk + jnp.uint8(0), scale_kn + jnp.uint8(0))
                for _ in range(rotations(n * k * 9 // 16))]
      w_bf16 = jnp.asarray(case["w"], jnp.bfloat16)
      bf16_copies = [(w_bf16 + 0,) for _ in range(rotations(n * k * 2))]
      bf16_us = host_us(lambda x, w: x @ w.T, x, bf16_copies)
      q = lambda p, s: NVFP4Tensor(p, jax.lax.bitcast_convert_type(s, jnp.float8_e4m3fn),  # noqa: E731
                                   jnp.ones((1,), jnp.float32))
      pallas_us = host_us(lambda x, p, s, s_kn: qerl_kernels.nvfp4_matmul(x, q(p, s)), x, copies)
      for v in VARIANTS:
        record = dict(v, shape=shape, rows=rows, k=k, n=n, bf16_us=bf16_us, pallas_us=pallas_us,
                      device=jax.devices()[0].device_kind, jax=jax.__version__, triton=triton.__version__,
                      commit=os.environ.get("QERL_COMMIT", ""))
        try:
          tile = jax_tile(v, rows, k, n, capability)
          op = (lambda x, p, s, s_kn, tile=tile: tile(x, p, s)) if v["scales"] == "nk" else (
            lambda x, p, s, s_kn, tile=tile: tile(x, p, s_kn))
          y = np.asarray(jax.jit(op)(x, packed, scale_nk, scale_kn), np.float64)
          record["err_ulps"] = ulps_error(y, case["y_ref"])
          if record["err_ulps"] <= 1.0:
            record["us"] = host_us(op, x, copies)
        except Exception as e:  # pylint: disable=broad-except  # a variant the plugin or the GPU refuses: say so
          record["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        records.append(record)
        print(f"jax {shape} rows {rows} {_name(v)}: " + (
          f"{record['us']:.1f} us, XLA bf16 {bf16_us:.1f}, Pallas tile {pallas_us:.1f}" if "us" in record
          else record.get("failed", f"WRONG: {record.get('err_ulps')} ulps")))
      if out_path:
        with open(out_path, "w") as f:
          json.dump(records, f, indent=1)
  return records


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", nargs="+", default=["7b.gate", "7b.gate_up", "7b.down", "7b.qkv", "7b.o"],
                 choices=sorted(SHAPES))
  p.add_argument("--rows", nargs="+", type=int, default=[8, 16, 64, 128])
  p.add_argument("--sass", action="store_true", help="compile for sm_90 here and report each variant")
  p.add_argument("--check-only", action="store_true")
  p.add_argument("--jax", action="store_true",
                 help="GPU: each variant as a JAX custom call through the CUDA plugin's Triton launcher, timed beside "
                      "XLA's bf16 dot and the project's tile kernel (run it in its own process: a launch the plugin "
                      "gets wrong can take the process down)")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  _require_triton()
  # The reference dequantizes with the project's JAX code; torch needs the GPU's memory, so JAX takes what it uses.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if args.jax:
    jax_run(args.shapes, args.rows, args.out)
    return 0
  if args.sass:
    rows = [r for s in args.shapes for m in args.rows for r in sass_report(s, m)]
    if args.out:
      with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0
  import torch  # pylint: disable=import-outside-toplevel
  from triton_gemv_probe import rotations, time_us  # pylint: disable=import-outside-toplevel  # CUDA-graph replays
  device = "cuda" if torch.cuda.is_available() else "cpu"
  _scratch_allocator(device)
  records, failed = [], []
  for shape in args.shapes:
    k, n = SHAPES[shape]
    for rows in args.rows:
      case = make_case(rows, k, n, device)
      variants = []
      for v in VARIANTS:
        try:
          err = check(case, v)
        except triton.runtime.errors.OutOfResources as e:  # shared memory past the SM's at many rows and stages
          print(f"{shape} rows {rows} {v}: not run ({e})")
          continue
        print(f"{shape} rows {rows} {_name(v)}: largest error {err:.3f} bf16 ulps")
        if err > 1.0:  # a wrong variant is a finding: it is reported, kept out of the timing, and fails the run
          failed.append(dict(v, shape=shape, rows=rows, check_ulps=err))
          continue
        variants.append(v)
      if args.check_only or device != "cuda":
        continue
      copies = rotations(n * k * 9 // 16)
      rot = [dict(case, packed=case["packed"].clone(), scale=case["scale"].clone(), scale_kn=case["scale_kn"].clone())
             for _ in range(copies)]
      calls = max(copies, 16)
      w_bf16 = [torch.randn(n, k, dtype=torch.bfloat16, device=device) for _ in range(max(2, copies // 4))]
      xb = case["x"]
      bf16_us = time_us([lambda w=w_bf16[j % len(w_bf16)]: torch.matmul(xb, w.T) for j in range(calls)])
      for v in variants:
        out = torch.empty((rows, n), dtype=torch.bfloat16, device=device)
        us = time_us([lambda c=rot[j % copies], v=v, out=out: launch(c, out, **v) for j in range(calls)])
        records.append(dict(v, shape=shape, rows=rows, k=k, n=n, us=us, bf16_us=bf16_us, speedup=bf16_us / us,
                            device=torch.cuda.get_device_name(), triton=triton.__version__,
                            commit=os.environ.get("QERL_COMMIT", "")))
        print(f"{shape} rows {rows} {_name(v)}: {us:.1f} us, bf16 {bf16_us:.1f}, {bf16_us / us:.2f}x")
  if records:
    print("\nshape        rows  best      us  bf16 us  speedup   (best WS / best plain)")
    for shape in args.shapes:
      for rows in args.rows:
        rs = [r for r in records if r["shape"] == shape and r["rows"] == rows]
        if not rs:
          continue
        best = min(rs, key=lambda r: r["us"])
        ws_best = min((r["us"] for r in rs if r["ws"]), default=float("nan"))
        plain_best = min((r["us"] for r in rs if not r["ws"]), default=float("nan"))
        print(f"{shape:12s} {rows:4d}  {'ws' if best['ws'] else 'plain':5s} {best['us']:7.1f} {best['bf16_us']:8.1f} "
              f"{best['speedup']:7.2f}x  {plain_best / ws_best:.2f}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(records + failed, f, indent=1)
  if failed:
    print(f"FAILED: {len(failed)} variant(s) do not match the reference (above)", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
