"""NVFP4 bytes against compressed-tensors itself, the NVFP4.md vectors, and round trips."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from qerl_jax import quant
from qerl_jax.quant import nvfp4
from test_quant_ct_reference import ct_decompress, ct_global_scale, ct_nvfp4, to_torch

DTYPES = {"bf16": (ml_dtypes.bfloat16, jnp.bfloat16), "fp32": (np.float32, jnp.float32)}


def _fresh_seed() -> int:
  return int.from_bytes(os.urandom(4), "little")


def _adversarial_weight(rng, n, k, std, np_dtype):
  """Gaussian rows plus the cases that break naive code: zero / tiny / -0.0 / subnormal-scale blocks,
  exact E2M1 ties, and rows of very different magnitude."""
  w = rng.standard_normal((n, k)) * std
  w[0, :16] = 0.0                                   # all-zero block -> scale 0x20
  w[1, :16] *= 1e-6                                 # scale rounds to 0 -> 0.125
  w[2, :16] *= 3e-3                                 # float8 subnormal scales
  w[3, :] = -0.0                                    # exact -0.0 -> code 0x0
  w[4, 3] = -0.0
  w[5, :16] = rng.integers(-24, 25, 16) / 4 * std   # lands on the E2M1 tie points
  w[5, 0] = 6 * std
  w[6, :] *= 50                                      # sets amax: the rest get small scales
  w[7, :16] = -rng.uniform(0, 1e-3, 16) * std       # small negatives that round to 0 -> 0x8
  return w.astype(np.float32).astype(np_dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("shape,std", [((8, 16), 1.0), ((48, 96), 0.02), ((64, 256), 3e-5),
                                       ((40, 160), 250.0)])
def test_bytes_match_compressed_tensors(shape, std, dtype):
  seed = _fresh_seed()
  rng = np.random.default_rng(seed)
  np_dtype, jnp_dtype = DTYPES[dtype]
  w_NxK = _adversarial_weight(rng, *shape, std, np_dtype)
  ref = ct_nvfp4(to_torch(w_NxK))
  q = quant.quantize(jnp.asarray(w_NxK).T, "nvfp4")  # the public API takes [K, N]
  mine = quant.to_ct_tensors(q)
  for key in ("weight_packed", "weight_scale", "weight_global_scale"):
    a, b = mine[key].view(np.uint8), ref[key].view(np.uint8)
    assert a.shape == b.shape, (key, a.shape, b.shape)
    bad = np.argwhere(a != b)
    assert bad.size == 0, f"{seed=} {key}: {len(bad)} of {a.size} bytes differ, first at {bad[:4]}"
  # Dequantization: compressed-tensors' decompression of the same bytes, bit for bit (bf16 output).
  ref_w = ct_decompress(ref, "nvfp4")
  got_w = np.asarray(quant.dequantize(q, jnp.bfloat16).T.astype(jnp.float32))
  np.testing.assert_array_equal(got_w.view(np.uint32), ref_w.view(np.uint32), err_msg=f"{seed=}")


def test_fused_shared_global_scale_matches_compressed_tensors():
  seed = _fresh_seed()
  rng = np.random.default_rng(seed)
  # q, k, v of different magnitudes: the shared scale is the smallest (largest amax) of the three.
  ws = [(rng.standard_normal((48, 96)) * s).astype(ml_dtypes.bfloat16) for s in (0.02, 0.05, 0.01)]
  shared = quant.shared_global_scale([jnp.asarray(w).T for w in ws])
  ref_gs = torch.min(torch.cat([ct_global_scale(to_torch(w)) for w in ws])).reshape(1)
  assert np.asarray(shared).view(np.uint32) == ref_gs.numpy().view(np.uint32), f"{seed=}"
  for w in ws:
    ref = ct_nvfp4(to_torch(w), gs=ref_gs)
    mine = quant.to_ct_tensors(quant.quantize(jnp.asarray(w).T, "nvfp4", global_scale=shared))
    for key in ref:
      np.testing.assert_array_equal(mine[key].view(np.uint8), ref[key].view(np.uint8),
                                    err_msg=f"{seed=} {key}")


def test_doc_vector_full_grid():
  w = jnp.asarray([[6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -1.25, -1.75, -2.5, -3.5, -5,
                    -6]], jnp.bfloat16)
  q = nvfp4.quantize_NxK(w)
  assert float(q.global_scale[0]) == 448.0
  assert np.asarray(q.scale_NxKb).view(np.uint8).tolist() == [[0x7E]]
  assert np.asarray(q.packed_NxKh).tobytes().hex() == "0722446 6a8caecfe".replace(" ", "")
  deq = np.asarray(nvfp4.dequantize_NxK(q, jnp.float32))[0]
  np.testing.assert_array_equal(deq, [6, 0, 1, 1, 2, 2, 4, 4, -0., -1, -1, -2, -2, -4, -4, -6])
  assert np.signbit(deq[8])  # code 0x8 decodes to -0.0


def test_e2m1_decode_is_ml_dtypes_float4_on_every_code():
  # The decode builds float32 bits from integer ops (no table); ml_dtypes' float4_e2m1fn is an independent reading
  # of the OCP format. Bit equality, so -0.0 for code 8 counts too.
  from qerl_jax.quant import e2m1
  codes = np.arange(16, dtype=np.uint8)
  want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
  got = np.asarray(jax.jit(e2m1.e2m1_decode)(jnp.asarray(codes)))
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_doc_vector_signs_of_zero():
  w = jnp.asarray([[-0.1, 0.1, -0.0, 0.0, 1, -1, .5, -.5, 6, -6, 2.9, -2.9, .3, -.3, 4.4, -4.4]],
                  jnp.bfloat16)
  q = nvfp4.quantize_NxK(w)
  assert np.asarray(q.packed_NxKh).tobytes().hex() == "0800a291f7d591e6"


@pytest.mark.parametrize("factor,scale_byte,packed_hex", [(1e-5, 0x20, "80" * 8),
                                                          (1e-4, 0x04, "f7d5" * 4)])
def test_doc_vector_tiny_blocks(factor, scale_byte, packed_hex):
  pattern = jnp.asarray([1.0, -1.0, 0.5, -0.5] * 4) * factor
  w = jnp.stack([jnp.full((16,), 6.0), pattern]).astype(jnp.bfloat16)  # amax 6 -> gs 448
  q = nvfp4.quantize_NxK(w)
  assert np.asarray(q.scale_NxKb).view(np.uint8)[1, 0] == scale_byte
  assert np.asarray(q.packed_NxKh)[1].tobytes().hex() == packed_hex


def test_global_scale_reciprocal_then_multiply():
  # bf16(2688 * bf16(1 / 0.9453125)) = 2832, where a single rounded division would give 2848.
  assert float(quant.nvfp4_global_scale(jnp.full((16, 16), 0.9453125, jnp.bfloat16))[0]) == 2832.0
  # fp32 weights round both steps to fp32.
  amax = np.float32(0.37)
  expect = np.float32(np.float32(2688.0) * np.float32(np.float32(1.0) / amax))
  assert float(quant.nvfp4_global_scale(jnp.full((4, 16), amax, jnp.float32))[0]) == expect
  # All-zero tensor: 2688 / tiny overflows; compressed-tensors falls back to 1.0.
  assert float(quant.nvfp4_global_scale(jnp.zeros((4, 16), jnp.bfloat16))[0]) == 1.0


def test_quantize_is_jittable_and_matches_eager():
  seed = _fresh_seed()
  w = jnp.asarray(np.random.default_rng(seed).standard_normal((96, 48)), jnp.bfloat16)  # [K, N]
  jitted = jax.jit(lambda x: quant.quantize(x, "nvfp4"))(w)
  eager = quant.quantize(w, "nvfp4")
  for a, b in zip(jax.tree_util.tree_leaves(jitted), jax.tree_util.tree_leaves(eager)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  assert quant.dequantize(jitted).shape == (96, 48)


@pytest.mark.slow
def test_many_seeds_all_dtypes_nvfp4_and_mxfp4():
  """Long sweep (run by hand: pytest -m slow): 40 seeds x 3 shapes x bf16/fp16/fp32, both FP4 formats."""
  from test_quant_ct_reference import ct_mxfp4  # pylint: disable=import-outside-toplevel
  base = _fresh_seed()
  for i in range(40):
    for np_dtype in (ml_dtypes.bfloat16, np.float16, np.float32):
      for shape, std in (((48, 96), 0.02), ((64, 256), 3e-3), ((40, 160), 250.0)):
        seed = base + i
        w = _adversarial_weight(np.random.default_rng(seed), *shape, std, np_dtype)
        wt = to_torch(w) if np_dtype != np.float16 else torch.from_numpy(w)
        for scheme, ref in (("nvfp4", ct_nvfp4(wt)), ("mxfp4", ct_mxfp4(wt))):
          mine = quant.to_ct_tensors(quant.quantize_NxK(jnp.asarray(w), scheme))
          for key in ref:
            np.testing.assert_array_equal(mine[key].view(np.uint8), ref[key].view(np.uint8),
                                          err_msg=f"{seed=} {scheme} {np_dtype} {shape} {key}")
