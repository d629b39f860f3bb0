"""Probe: does Triton's software pipeliner, asked per loop, raise the one-row NVFP4 gemv's bandwidth?

    python experiments/triton_gemv_probe.py --out $OUT/triton_gemv_probe.json    # on the GPU (torch + triton)
    python experiments/triton_gemv_probe.py --ptx                                 # CPU: what the PTX loads with
    TRITON_INTERPRET=1 python experiments/triton_gemv_probe.py --check-only --shapes tiny   # CPU: correctness

Why: the project's one-row gemv (qerl_kernels/nvfp4_gemv.py, Pallas Triton) streams 7B gate|up at ~2.5 TB/s and
down at ~2.1 (profile at 06aa422), against ~3.7 TB/s of copy bandwidth. Each warp waits for a trip's loads before
its math and issues the next trip's loads only after it (qerl_kernels/NOTES.md: "bytes in flight per SM").
Triton pipelines a loop's loads through shared memory (cp.async, ``num_stages`` deep) only where they feed a dot,
unless the loop itself carries ``num_stages`` (``tl.range(..., num_stages=n)``), which Pallas cannot set. This
script writes the same gemv directly in Triton, with and without that attribute, and times it beside a bf16
matrix-vector product and a copy. It decides whether a jax-triton gemv is worth building; it is not one.

The kernel: y[n] = sum_k x[k] * dequant(W)[n, k] for one row x (bf16), W as NVFP4 (codes [N, K/2] uint8, two per
byte, low nibble first; e4m3 scales [N, K/16]; the global scale left to the caller, 1 here). Two decodes: "int"
forms float16 bits (sign << 15 | magnitude << 9), E2M1 / 2**14 exactly (the subnormal codes too), in Triton's
integer ops; "asm" runs the project gemv's inline PTX (E2M1 / 64, each byte's two products fused). The products,
the 16-element block sums (float32) and the block scale follow the project's gemv; the caller multiplies by
``DECODE_FACTOR``. Columns split into BLOCK_N-wide programs, K optionally into SPLIT ranges of whole steps
(float32 partials, summed by the caller).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

SHAPES = {  # name: (K, N) of the weight as y = x @ W^T reads it
    "7b.gate_up": (3584, 37888),
    "7b.down": (18944, 3584),
    "7b.qkv": (3584, 4608),
    "7b.o": (3584, 3584),
    "tiny": (1280, 88),  # CPU check: ragged splits (5 steps of 256 in 2 or 3) and a ragged last column block
}


try:  # the `sass` extra (pip install -e ".[sass]") or the GPU machine's image
  import triton
  import triton.language as tl
except ImportError:  # the CLI says what to install
  triton = None
else:
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from qerl_kernels import nvfp4_tile  # noqa: E402  # the project gemv's PTX (decode = "asm")
  _ASM_PRODUCTS = tl.constexpr(nvfp4_tile._ASM_E4M3_PRODUCTS)  # pylint: disable=protected-access


def _require_triton() -> None:
  if triton is None:
    raise SystemExit("triton_gemv_probe needs Triton: pip install -e \".[sass]\" (or run it on the GPU machine)")


if triton is not None:
  @triton.jit
  def step_sums(acc, step, x_ptr, packed_ptr, scale_ptr, stride_p, stride_s, cols, col_ok,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TOTAL: tl.constexpr, ASM: tl.constexpr):
    half = tl.arange(0, BLOCK_K // 2)  # byte j of a step holds elements 2j (low nibble) and 2j + 1
    blocks = tl.arange(0, BLOCK_K // 16)
    k0 = step * BLOCK_K
    # The row strides arrive as arguments (Triton assumes 16-byte multiples for them, so the loads go 16 bytes
    # wide); K // 2 computed in the kernel loses that and the loads fall to one byte per thread.
    ok = col_ok[:, None] & (step < TOTAL)  # the last split's steps past K read nothing (zeros add nothing)
    p = tl.load(packed_ptr + cols[:, None] * stride_p + (k0 // 2 + half)[None, :], mask=ok, other=0)
    s = tl.load(scale_ptr + cols[:, None] * stride_s + (k0 // 16 + blocks)[None, :], mask=ok, other=0)
    x = tl.load(x_ptr + k0 + tl.arange(0, BLOCK_K), mask=step < TOTAL, other=0.0).to(tl.float32)
    xe, xo = tl.split(tl.reshape(x, (BLOCK_K // 2, 2)))
    if ASM:  # the project gemv's inline PTX: per byte lo * xe + hi * xo, lo and hi E2M1 / 64
      zeros = tl.zeros((BLOCK_N, BLOCK_K // 2), tl.float32)
      prod = tl.inline_asm_elementwise(_ASM_PRODUCTS, "=f,=f,=f,=f,r,f,f,f,f,f,f,f,f",
                                       [p, xe[None, :] + zeros, xo[None, :] + zeros],
                                       dtype=tl.float32, is_pure=True, pack=4)
    else:  # E2M1 / 2**14 as float16 bits, in Triton's integer ops
      p = p.to(tl.int16)
      lo = (((p & 8) << 12) | ((p & 7) << 9)).to(tl.float16, bitcast=True).to(tl.float32)
      hi = (((p & 128) << 8) | ((p & 112) << 5)).to(tl.float16, bitcast=True).to(tl.float32)
      prod = lo * xe[None, :] + hi * xo[None, :]
    sums = tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // 16, 8)), axis=2)
    return acc + sums * s.to(tl.float8e4nv, bitcast=True).to(tl.float32)

  @triton.jit
  def gemv_kernel(x_ptr, packed_ptr, scale_ptr, out_ptr, stride_p, stride_s, N, STEPS: tl.constexpr,
                  TOTAL: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_N, BLOCK_K // 16), tl.float32)
    first = pid_s * STEPS  # STEPS per split, the last split's past TOTAL masked
    if STAGES > 0:  # the loop carries num_stages: Triton pipelines its loads although no dot uses them
      for i in tl.range(0, STEPS, num_stages=STAGES):
        acc = step_sums(acc, first + i, x_ptr, packed_ptr, scale_ptr, stride_p, stride_s, cols, col_ok, BLOCK_N,
                         BLOCK_K, TOTAL, ASM)
    else:  # as Pallas lowers a fori_loop: no pipelining
      for i in tl.range(0, STEPS):
        acc = step_sums(acc, first + i, x_ptr, packed_ptr, scale_ptr, stride_p, stride_s, cols, col_ok, BLOCK_N,
                         BLOCK_K, TOTAL, ASM)
    y = tl.sum(acc, axis=1)
    tl.store(out_ptr + pid_s * N + cols, y, mask=col_ok)

  @triton.jit
  def gemv_kernel_jt(x_ptr, packed_ptr, scale_ptr, stride_p, stride_s, N, out_ptr, STEPS: tl.constexpr,
                     TOTAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                     ASM: tl.constexpr):
    """``gemv_kernel`` in jax-triton's order: the inputs (arrays, then scalars), then the output."""
    gemv_kernel(x_ptr, packed_ptr, scale_ptr, out_ptr, stride_p, stride_s, N, STEPS, TOTAL, BLOCK_N, BLOCK_K, STAGES,
                ASM)


def random_nvfp4(k: int, n: int, seed: int = 0):
  """Random NVFP4 bytes for a [N, K] weight: codes [N, K/2] (every code) and e4m3 scale bytes [N, K/16] (finite,
  positive, in [2**-4, 2**4)), with the float64 weight they stand for by the project's dequantization (exact in
  float32). Both probes' cases start here."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from qerl_jax.quant import dequantize_NxK  # pylint: disable=import-outside-toplevel
  from qerl_jax.quant.types import NVFP4Tensor  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
  # e4m3 bits with exponent field 3..10 (2**-4 .. 2**3) and any mantissa, positive
  scale_bits = (rng.integers(3, 11, (n, k // 16)) << 3 | rng.integers(0, 8, (n, k // 16))).astype(np.uint8)
  q = NVFP4Tensor(jnp.asarray(packed), jnp.asarray(scale_bits).view(jnp.float8_e4m3fn), jnp.ones((1,), jnp.float32))
  return packed, scale_bits, np.asarray(dequantize_NxK(q, jnp.float32), np.float64)


def make_case(k: int, n: int, device, seed: int = 0):
  """`random_nvfp4`'s weight, a bf16 row and the float64 reference y = W x."""
  import torch  # pylint: disable=import-outside-toplevel
  packed, scale_bits, w = random_nvfp4(k, n, seed)
  x = torch.randn(k, dtype=torch.float32).to(torch.bfloat16)
  y = w @ x.float().numpy().astype(np.float64)
  t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)
  return dict(x=x.to(device), packed=t(packed), scale=t(scale_bits), y_ref=y)


def launch(case, out, *, block_n: int, block_k: int, split: int, stages: int, num_warps: int, decode: str):
  k, n = case["x"].shape[0], case["packed"].shape[0]
  steps = k // block_k
  per = -(-steps // split)
  grid = (-(-n // block_n), -(-steps // per))  # no split without a step
  gemv_kernel[grid](case["x"], case["packed"], case["scale"], out, k // 2, k // 16, n, STEPS=per, TOTAL=steps,
                    BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, ASM=decode == "asm", num_warps=num_warps)
  return grid


VARIANTS = [dict(block_n=bn, block_k=bk, split=sp, stages=st, num_warps=w, decode=d)
            for d in ("int", "asm") for bn in (16, 32) for bk in (256, 512) for sp in (1, 2, 4, 8)
            for st in ((0, 3, 4) if d == "int" else (0, 2, 3)) for w in (4,)]
DECODE_FACTOR = {"int": 2.0 ** 14, "asm": 64.0}  # the decoded codes are E2M1 over this


def check(case, variant) -> float:
  import torch  # pylint: disable=import-outside-toplevel
  n = case["packed"].shape[0]
  out = torch.full((variant["split"], n), float("nan"), dtype=torch.float32, device=case["x"].device)
  grid = launch(case, out, **variant)
  y = out[:grid[1]].sum(0).double().cpu().numpy() * DECODE_FACTOR[variant["decode"]]
  return float(np.abs(y - case["y_ref"]).max() / np.abs(case["y_ref"]).max())


def ptx_report(shape: str, decodes) -> list[dict]:
  """Compile each variant for sm_90 without a GPU and count the loads its PTX issues (cp.async: pipelined)."""
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
  k, n = SHAPES[shape]
  rows = []
  for v in [v for v in VARIANTS if v["split"] == 1 and v["block_k"] == 512 and v["decode"] in decodes]:
    sig = {"x_ptr": "*bf16", "packed_ptr": "*u8", "scale_ptr": "*u8", "out_ptr": "*fp32", "stride_p": "i32",
           "stride_s": "i32", "N": "i32"}
    consts = {"STEPS": k // v["block_k"], "TOTAL": k // v["block_k"], "BLOCK_N": v["block_n"],
              "BLOCK_K": v["block_k"], "STAGES": v["stages"], "ASM": v["decode"] == "asm"}
    # What a launch on these shapes specializes: pointers and the strides divisible by 16.
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
    src = triton.compiler.ASTSource(fn=gemv_kernel, signature={**sig, **{c: "constexpr" for c in consts}},
                                    constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=v["num_warps"]))
    ptx = compiled.asm["ptx"]
    rows.append(dict(v, shape=shape, cp_async=ptx.count("cp.async.ca") + ptx.count("cp.async.cg"),
                     ld_global=ptx.count("ld.global"), shared=compiled.metadata.shared,
                     regs=getattr(compiled, "n_regs", None)))
    print(f"{shape} {v['decode']} bn{v['block_n']} bk{v['block_k']} stages {v['stages']}: "
          f"cp.async {rows[-1]['cp_async']}, "
          f"ld.global {rows[-1]['ld_global']}, shared {rows[-1]['shared']} B")
  return rows


def jax_triton_run(shapes, out_path) -> list[dict]:
  """The probe's kernel through jax-triton (the way a JAX model would call it): checked against NumPy, then timed
  as one jitted program of 16 launches over rotated weight copies (median of 30 runs, per launch)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import jax_triton as jt  # pylint: disable=import-outside-toplevel
  best = {  # call 11's fastest asm variants
      "7b.gate_up": dict(block_n=32, block_k=512, split=1, stages=3),
      "7b.down": dict(block_n=32, block_k=512, split=8, stages=3),
      "7b.qkv": dict(block_n=32, block_k=256, split=8, stages=0),
      "7b.o": dict(block_n=32, block_k=256, split=8, stages=0),
      "tiny": dict(block_n=32, block_k=256, split=2, stages=3),
  }
  records = []
  for shape in shapes:
    k, n = SHAPES[shape]
    v = best[shape]
    case = make_case(k, n, "cpu")
    steps = k // v["block_k"]
    per = -(-steps // v["split"])
    grid = (-(-n // v["block_n"]), -(-steps // per))

    def gemv_parts(x, packed, scale, v=v, grid=grid, per=per, steps=steps):  # float32 [splits, N]
      return jt.triton_call(x, packed, scale, k // 2, k // 16, n, kernel=gemv_kernel_jt,
                            out_shape=jax.ShapeDtypeStruct((grid[1], n), jnp.float32), grid=grid, num_warps=4,
                            STEPS=per, TOTAL=steps, BLOCK_N=v["block_n"], BLOCK_K=v["block_k"], STAGES=v["stages"],
                            ASM=True)

    x = jnp.asarray(case["x"].float().numpy(), jnp.bfloat16)
    packed = jnp.asarray(case["packed"].numpy())
    scale = jnp.asarray(case["scale"].numpy())
    y = np.asarray(jax.jit(gemv_parts)(x, packed, scale), np.float64).sum(0) * DECODE_FACTOR["asm"]
    err = float(np.abs(y - case["y_ref"]).max() / np.abs(case["y_ref"]).max())
    copies = [(packed + jnp.uint8(0), scale + jnp.uint8(0)) for _ in range(rotations(n * k * 9 // 16))]

    # The control: the shipped Pallas gemv on the same bytes in the same harness (its launches are XLA
    # fusions, which XLA's command buffers capture; a custom call's launch may not be).
    from qerl_jax.quant.types import NVFP4Tensor  # pylint: disable=import-outside-toplevel
    import qerl_kernels  # pylint: disable=import-outside-toplevel
    pallas = lambda x, p, s: qerl_kernels.nvfp4_matmul(  # noqa: E731
        x[None], NVFP4Tensor(p, jax.lax.bitcast_convert_type(s, jnp.float8_e4m3fn), jnp.ones((1,), jnp.float32)))
    records.append(dict(v, shape=shape, decode="asm", err=err, us_per_call_host=host_us(gemv_parts, x, copies),
                        pallas_us_per_call_host=host_us(pallas, x, copies),
                        device=jax.devices()[0].device_kind, jax=jax.__version__,
                        jax_triton=getattr(jt, "__version__", "?"), triton=triton.__version__,
                        commit=os.environ.get("QERL_COMMIT", "")))
    print(f"jax-triton {shape}: error {err:.2e}, {records[-1]['us_per_call_host']:.2f} us per launch, the Pallas "
          f"gemv {records[-1]['pallas_us_per_call_host']:.2f} (host-timed, 16 launches per program)")
    if out_path:
      json.dump(records, open(out_path, "w"), indent=1)
  return records


def rotations(nbytes: int) -> int:
  """Copies of an operand of ``nbytes`` that together pass 256 MB, so that each launch streams it from HBM (the
  L2 is 50-60 MB)."""
  return max(2, -(-256 * 2 ** 20 // nbytes))


def host_program(op, calls: int):
  """`host_us`'s jitted program: ``calls`` launches of ``op``, launch j on row j of the stacked x and on weight copy
  j mod (number of copies)."""
  import jax  # pylint: disable=import-outside-toplevel
  return jax.jit(lambda xs, cs: [op(xs[j], *cs[j % len(cs)]) for j in range(calls)])


def host_us(op, x, operands, calls: int = 16, runs: int = 30) -> float:
  """Per launch: the median over ``runs`` of one jitted program of ``calls`` launches of ``op(x_j, *operands[j])``,
  cycling through ``operands`` (rotated weight copies), host-timed. How a JAX model would pay for a launch.

  Each launch reads its own copy of x (x_j, a slice of a stacked input): with fewer weight copies than calls, XLA
  merges launches whose operands are all the same (CSE; a 16-dot program over 2 copies compiles to 2 dots), which
  made the bf16 dot look 8x cheaper in the warp-specialization probe's first GPU run."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from experiments.bench_train_attention import timed  # pylint: disable=import-outside-toplevel
  return timed(host_program(op, calls), (jnp.stack([x] * calls), operands), runs) / calls


def time_us(fns, replays: int = 30) -> float:
  """Per call: the median over ``replays`` CUDA-graph replays of the calls ``fns`` (each a launch on its own weight
  copy, in order), divided by their number. A graph keeps the host's launch cost (~10 us per Triton launch from
  Python) out of kernels that take 3-30 us."""
  import torch  # pylint: disable=import-outside-toplevel
  stream = torch.cuda.Stream()
  stream.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(stream):
    for fn in fns:  # warm-up: compile and load outside the capture
      fn()
  torch.cuda.current_stream().wait_stream(stream)
  torch.cuda.synchronize()
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    for fn in fns:
      fn()
  graph.replay()
  torch.cuda.synchronize()
  times = []
  for _ in range(replays):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end) * 1e3 / len(fns))
  return statistics.median(times)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--shapes", nargs="+", default=["7b.gate_up", "7b.down", "7b.qkv", "7b.o"], choices=sorted(SHAPES))
  p.add_argument("--ptx", action="store_true", help="compile for sm_90 here and count the PTX's loads")
  p.add_argument("--check-only", action="store_true")
  p.add_argument("--decodes", nargs="+", default=["int", "asm"], choices=["int", "asm"],
                 help="the codes' decode: Triton integer ops, or the project gemv's inline PTX (GPU only)")
  p.add_argument("--jax-triton", action="store_true",
                 help="GPU: the asm kernel through jax-triton (does it work with this jax; what it costs in JAX)")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  _require_triton()
  if args.jax_triton:
    jax_triton_run(args.shapes, args.out)
    return 0
  if args.ptx:
    rows = [r for s in args.shapes for r in ptx_report(s, args.decodes)]
    if args.out:
      json.dump(rows, open(args.out, "w"), indent=1)
    return 0
  import torch  # pylint: disable=import-outside-toplevel
  device = "cuda" if torch.cuda.is_available() else "cpu"
  records = []
  for shape in args.shapes:
    k, n = SHAPES[shape]
    case = make_case(k, n, device)
    variants = [v for v in VARIANTS if k % v["block_k"] == 0 and k // v["block_k"] >= v["split"]
                and v["decode"] in args.decodes and (device == "cuda" or v["decode"] == "int")]
    worst = max(check(case, v) for v in variants)
    print(f"{shape}: largest error {worst:.2e} of the largest output over {len(variants)} variants")
    if worst > 1e-5:
      print("FAILED: the gemv does not match its reference", file=sys.stderr)
      return 1
    if args.check_only or device != "cuda":
      continue
    # Rotate copies of the weight so that each call streams from HBM (gate|up's 76 MB alone exceeds the 60 MB L2;
    # the smaller shapes need the copies).
    copies = rotations(case["packed"].numel() * 9 // 8)
    rot = [dict(case, packed=case["packed"].clone(), scale=case["scale"].clone()) for _ in range(copies)]
    calls = max(copies, 16)  # launches per graph, cycling through the copies
    w_bf16 = [torch.randn(n, k, dtype=torch.bfloat16, device=device) for _ in range(max(2, copies // 4))]
    xb = case["x"]
    bytes_nvfp4 = n * k // 2 + n * k // 16
    bf16_us = time_us([lambda w=w_bf16[j % len(w_bf16)]: torch.mv(w, xb) for j in range(calls)])
    big = torch.empty(2 ** 30, dtype=torch.uint8, device=device)
    big2 = torch.empty_like(big)
    copy_us = time_us([lambda: big2.copy_(big)] * 4, replays=10)
    copy_gbps = 2 * big.numel() / copy_us / 1e3
    for v in variants:
      out = torch.empty((v["split"], n), dtype=torch.float32, device=device)
      us = time_us([lambda c=rot[j % copies], v=v, out=out: launch(c, out, **v) for j in range(calls)])
      records.append(dict(v, shape=shape, us=us, bf16_us=bf16_us, gbps=bytes_nvfp4 / us / 1e3, copy_gbps=copy_gbps,
                          device=torch.cuda.get_device_name(), triton=triton.__version__,
                          commit=os.environ.get("QERL_COMMIT", "")))
    if args.out:  # after each shape, so that a call cut short keeps what it measured
      json.dump(records, open(args.out, "w"), indent=1)
  if records:
    print(f"{'shape':12s} {'bn':>3s} {'bk':>4s} {'split':>5s} {'stages':>6s} {'us':>7s} {'TB/s':>5s} {'bf16 us':>8s}")
    best = {}
    for r in records:
      if r["shape"] not in best or r["us"] < best[r["shape"]]["us"]:
        best[r["shape"]] = r
    for r in records:
      if r["stages"] in (0, 3) or r is best[r["shape"]]:
        print(f"{r['shape']:12s} {r['block_n']:3d} {r['block_k']:4d} {r['split']:5d} {r['stages']:6d} {r['us']:7.2f} "
              f"{r['gbps'] / 1e3:5.2f} {r['bf16_us']:8.2f}{'  best' if r is best[r['shape']] else ''}")
    print(f"copy bandwidth {records[0]['copy_gbps'] / 1e3:.2f} TB/s (read + write)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
