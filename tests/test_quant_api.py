"""The public quant API: orientation, validation messages, compressed-tensors tensor copies."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qerl_jax import quant


def _w(shape, dtype=jnp.bfloat16):
  # NumPy draws: jax.random would compile a program per shape.
  rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
  return jnp.asarray((rng.standard_normal(shape) * 0.02).astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4", "nf4"])
def test_orientation_and_round_trip_error(scheme):
  w_KxN = _w((64, 48))
  q = quant.quantize(w_KxN, scheme)
  assert q.shape == (64, 48)
  back = quant.dequantize(q, jnp.float32)
  assert back.shape == (64, 48)
  # The [K, N] API quantizes the transpose: identical bytes to the [N, K] entry point.
  q2 = quant.quantize_NxK(w_KxN.T, scheme)
  for a, b in zip(jax.tree_util.tree_leaves(q), jax.tree_util.tree_leaves(q2)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  w = np.asarray(w_KxN.astype(jnp.float32))
  rel_mse = np.mean((np.asarray(back) - w) ** 2) / np.mean(w ** 2)
  assert 1e-3 < rel_mse < 3e-2, rel_mse  # 4-bit error on Gaussian weights: about 1e-2


def test_nan_and_inf_are_rejected_by_name():
  w = _w((64, 48)).at[3, 4].set(jnp.nan)
  with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight contains NaN or Inf"):
    quant.quantize(w, "nvfp4", name="model.layers.0.mlp.up_proj.weight")
  with pytest.raises(ValueError, match="w_inf contains NaN or Inf"):
    quant.quantize(_w((64, 48)).at[0, 0].set(jnp.inf), "mxfp4", name="w_inf")


@pytest.mark.parametrize("scheme,k", [("nvfp4", 24), ("mxfp4", 48)])
def test_k_not_divisible_names_the_layer(scheme, k):
  with pytest.raises(ValueError, match=r"layer model.layers.2.mlp.down_proj: in_features k=%d .*"
                                       r"add it to --ignore" % k):
    quant.quantize(_w((k, 16)), scheme, name="model.layers.2.mlp.down_proj")


def test_option_errors():
  with pytest.raises(ValueError, match="unknown quantization scheme='int4'"):
    quant.quantize(_w((16, 16)), "int4")
  with pytest.raises(ValueError, match="global_scale only applies to nvfp4"):
    quant.quantize(_w((32, 16)), "mxfp4", global_scale=jnp.ones((1,)))
  with pytest.raises(ValueError, match="expected a 2-D weight"):
    quant.quantize(_w((16,)), "nvfp4")
  with pytest.raises(ValueError, match="no compressed-tensors format"):
    quant.to_ct_tensors(quant.quantize(_w((64, 48)), "nf4"))


def test_ct_tensors_are_exact_copies():
  q = quant.quantize(_w((64, 48)), "nvfp4")
  d = quant.to_ct_tensors(q)
  assert d["weight_packed"].dtype == np.uint8 and d["weight_packed"].shape == (48, 32)
  assert d["weight_scale"].dtype == ml_dtypes.float8_e4m3fn and d["weight_scale"].shape == (48, 4)
  assert d["weight_global_scale"].dtype == np.float32 and d["weight_global_scale"].shape == (1,)
  back = quant.from_ct_tensors(d, "nvfp4")
  for a, b in zip(jax.tree_util.tree_leaves(q), jax.tree_util.tree_leaves(back)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  # Raw float8 bytes (as some readers return them) are accepted as well.
  raw = dict(d, weight_scale=d["weight_scale"].view(np.uint8))
  np.testing.assert_array_equal(quant.from_ct_tensors(raw, "nvfp4").scale_NxKb, d["weight_scale"])
  m = quant.quantize(_w((64, 48)), "mxfp4")
  dm = quant.to_ct_tensors(m)
  assert set(dm) == {"weight_packed", "weight_scale"} and dm["weight_scale"].dtype == np.uint8
  np.testing.assert_array_equal(quant.from_ct_tensors(dm, "mxfp4").scale_NxKb, dm["weight_scale"])
  with pytest.raises(ValueError, match="missing \\['weight_global_scale'\\]"):
    quant.from_ct_tensors({"weight_packed": d["weight_packed"], "weight_scale": d["weight_scale"]},
                          "nvfp4")


def test_dequantize_order_is_divide_first():
  q = quant.quantize(_w((64, 48), jnp.float32), "nvfp4")
  from qerl_jax.quant import e2m1  # pylint: disable=import-outside-toplevel
  codes = np.asarray(e2m1.unpack_low_first(q.packed_NxKh))
  vals = np.asarray(e2m1.e2m1_decode(jnp.asarray(codes)))
  eff = np.asarray(q.scale_NxKb).astype(np.float32) / np.asarray(q.global_scale)[0]
  want = (vals * np.repeat(eff, 16, axis=1)).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(quant.dequantize_NxK(q, jnp.float32)), want)
