"""An NVFP4 weight to 16 bits in one Pallas launch, bit for bit `qerl_jax.quant.nvfp4.dequantize_NxK`.

From ``xla_min_rows`` on, an NVFP4 matmul dequantizes one layer and calls XLA's dot (`nvfp4_matmul.xla_path_matmul`).
At 16-2048 rows (2f6627a) XLA took that dequantization into no GEMM: for a 7B gate weight (68M values, 136 MB of
bf16) the XLA path cost 156-184 us more than the bf16 dot on an H100, about one dequantization at 0.7-0.9 TB/s,
where the bytes take ~65 us at the copy bandwidth (experiments/RESULTS.md, "Where the XLA path stands").

Each program writes a [block_n, block_b, 8] tile of uint32 words (`nvfp4.byte_words`): word (n, b, j) holds the
two 16-bit values of packed byte (n, 8 b + j), the low nibble's in the low half. Read as 16-bit values on a
little-endian GPU that is the weight's own [N, K] order (element 2i in the low nibble, compressed-tensors'), so
the kernel forms no interleave and XLA's bitcast and reshape after it move nothing. The float32 step of each block
(the e4m3 scale over the global scale) comes from XLA, [N, K/16]: it must be the correctly rounded quotient, which
Triton's float32 divide is not.

Timed on an H100 at 7c40c02 (`bench_xla_dequant`, 10240 rows): 7B gate|up alone in 472 us against XLA's 603 (and
302 for XLA's program over the same words), down 233 against 400; in the 7B NVFP4 GRPO step it moved nothing (18.70
-> 18.68 s). So it stays opt-in (the tuning file's "xla_dequant": "pallas").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qerl_jax.quant import nvfp4
from qerl_jax.quant.types import NVFP4Tensor
from qerl_kernels import config as config_lib, nvfp4_tile

BYTES_PER_BLOCK = nvfp4.NVFP4_BLOCK // 2  # packed bytes of one 16-value scale block
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def dequant_kernel(packed_ref, step_ref, words_ref, *, dtype):
  """One [block_n, block_b] tile of scale blocks: packed uint8 [bn, bb, 8] and each block's float32 step [bn, bb]
  -> uint32 words [bn, bb, 8], each two ``dtype`` values: float32(E2M1[code]) * step, rounded once."""
  words_ref[...] = nvfp4.byte_words(packed_ref[...], step_ref[...][:, :, None], dtype)


def supports(q: NVFP4Tensor, dtype, block_n: int, block_b: int) -> bool:
  """Whether one (unstacked) weight tiles evenly at these block sizes, for a 16-bit dtype the kernel writes."""
  n, kh = q.packed_NxKh.shape[-2:]
  return (q.packed_NxKh.ndim == 2 and jnp.dtype(dtype) in DTYPES and n % block_n == 0
          and (kh // BYTES_PER_BLOCK) % block_b == 0)


@functools.partial(jax.jit, static_argnames=("dtype", "block_n", "block_b", "num_warps", "interpret", "poison"))
def dequantize_NxK(q: NVFP4Tensor, dtype=jnp.bfloat16, *, block_n: int | None = None, block_b: int | None = None,
                   num_warps: int | None = None, interpret: bool = False, poison: bool = False) -> jax.Array:
  """[N, K] weight in ``dtype`` (bf16 or fp16), equal bit for bit to `qerl_jax.quant.nvfp4.dequantize_NxK`.

  block_n rows and block_b scale blocks (of 16 values) per program; they and num_warps default to the device's
  tuning (``config.decode_launch("dequant")``). N must be a multiple of block_n and K / 16 of block_b
  (``supports``); the caller falls back to XLA's dequantization elsewhere. poison (tests): the words start as two
  NaNs each (aliased in place), so a tile the kernel does not write shows up.
  """
  launch = config_lib.decode_launch("dequant", interpret, block_n=block_n, block_b=block_b, num_warps=num_warps)
  block_n, block_b = launch["block_n"], launch["block_b"]
  if not supports(q, dtype, block_n, block_b):
    raise ValueError(f"nvfp4_dequant: packed {q.packed_NxKh.shape} ({jnp.dtype(dtype)}) must be one [N, K/2] weight "
                     f"of a 16-bit dtype with N a multiple of {block_n=} and K/16 of {block_b=}")
  n, kh = q.packed_NxKh.shape
  nb = kh // BYTES_PER_BLOCK
  words_spec = pl.BlockSpec((block_n, block_b, BYTES_PER_BLOCK), lambda i, j: (i, j, 0))
  out_shape = jax.ShapeDtypeStruct((n, nb, BYTES_PER_BLOCK), jnp.uint32)
  kernel = functools.partial(dequant_kernel, dtype=jnp.dtype(dtype))
  operands = [q.packed_NxKh.reshape(n, nb, BYTES_PER_BLOCK), nvfp4.effective_scale(q.scale_NxKb, q.global_scale)]
  in_specs = [words_spec, pl.BlockSpec((block_n, block_b), lambda i, j: (i, j))]
  aliases = {}
  if poison:
    nan = int(np.array(np.nan, jnp.dtype(dtype)).view(np.uint16))
    operands.append(jnp.full(out_shape.shape, nan | (nan << 16), jnp.uint32))
    in_specs.append(words_spec)
    aliases = {2: 0}
    kernel = functools.partial(nvfp4_tile.drop_poison_refs, kernel, 1)
  words = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(n // block_n, nb // block_b),
      in_specs=in_specs,
      out_specs=words_spec,
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=launch["num_warps"], num_stages=1),
      interpret=interpret,
      name="nvfp4_dequant",
  )(*operands)
  # uint32 [N, K/16, 8] -> 16-bit [N, K/16, 8, 2] (the low half first) -> [N, K].
  return jax.lax.bitcast_convert_type(words, dtype).reshape(n, 2 * kh)
