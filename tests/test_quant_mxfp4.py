"""MXFP4 bytes against compressed-tensors itself, hand-computed E8M0 scales, and round trips."""

import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qerl_jax import quant
from qerl_jax.quant import mxfp4
from test_quant_ct_reference import ct_decompress, ct_mxfp4, to_torch


def _fresh_seed() -> int:
  return int.from_bytes(os.urandom(4), "little")


@pytest.mark.parametrize("np_dtype", [ml_dtypes.bfloat16, np.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape,std", [((48, 96), 0.02), ((40, 160), 1e-30), ((16, 64), 300.0)])
def test_bytes_match_compressed_tensors(shape, std, np_dtype):
  seed = _fresh_seed()
  rng = np.random.default_rng(seed)
  w = rng.standard_normal(shape) * std
  w[0, :32] = 0.0                                   # all-zero block -> byte 0
  w[1, :] = -0.0
  w[2, :32] = rng.integers(-28, 29, 32) / 4 * std    # E2M1 tie points after the power-of-two scale
  w[3, :32] *= 1e-3
  w = w.astype(np.float32).astype(np_dtype)
  ref = ct_mxfp4(to_torch(w))
  q = quant.quantize(jnp.asarray(w).T, "mxfp4")
  mine = quant.to_ct_tensors(q)
  for key in ("weight_packed", "weight_scale"):
    assert mine[key].dtype == np.uint8 and mine[key].shape == ref[key].shape
    bad = np.argwhere(mine[key] != ref[key])
    assert bad.size == 0, f"{seed=} {key}: {len(bad)} bytes differ, first at {bad[:4]}"
  ref_w = ct_decompress(ref, "mxfp4")
  got_w = np.asarray(quant.dequantize(q, jnp.bfloat16).T.astype(jnp.float32))
  np.testing.assert_array_equal(got_w.view(np.uint32), ref_w.view(np.uint32), err_msg=f"{seed=}")


@pytest.mark.parametrize("amax,byte", [
  (1.0, 125),          # p = 1, scale 1/4 = 2^-2
  (1.7421875, 125),    # largest bf16 mantissa below 1.75 keeps the exponent
  (1.75, 126),         # m >= 1.75 rounds up to the next power of two
  (6.0, 127),          # 6 = 1.5 * 2^2 -> p = 4 -> scale 1
  (0.0, 0),            # all-zero block
])
def test_scale_byte_by_hand(amax, byte):
  w = jnp.zeros((1, 32), jnp.bfloat16).at[0, 7].set(-amax)
  assert int(mxfp4.scale_bytes(w)[0, 0]) == byte


def test_elements_and_round_trip():
  # amax 6 -> scale 1: the E2M1 grid itself comes back exactly, values off the grid round to it.
  grid = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)
  row = np.concatenate([grid, -grid, grid + 0.1, -grid - 0.1]).astype(ml_dtypes.bfloat16)
  q = mxfp4.quantize_NxK(jnp.asarray(row[None]))
  assert int(q.scale_NxKb[0, 0]) == 127
  back = np.asarray(mxfp4.dequantize_NxK(q, jnp.float32))[0]
  np.testing.assert_array_equal(back[:16], np.concatenate([grid, -grid]))
  # x + 0.1 is closest to x on this grid for every grid point.
  np.testing.assert_array_equal(back[16:], np.concatenate([grid, -grid]))
  assert np.asarray(q.packed_NxKh)[0, :4].tobytes().hex() == "10325476"
