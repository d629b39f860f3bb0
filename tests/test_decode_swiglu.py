"""qerl_kernels/decode_swiglu.py in interpret mode: against its jnp reference and an independent NumPy one."""


import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qerl_kernels import config as config_lib
from qerl_kernels.decode_swiglu import swiglu, swiglu_reference
from qerl_jax.model.testing import fresh_seed
from tests.test_decode_residual_norm import _rare, _ulps_apart
from tests.triton_lowering import lower_for_cuda

# (M, N, S, parts dtype, rank, R, P, bias, block_n): a 7B-like N that no block divides (18944 = 37 x 512) with
# padded x @ A columns (R > 2r), two rows with biases and a small block, a finished bf16 output, no adapter.
_H200 = config_lib.decode_kernel_params("swiglu", "NVIDIA H200")  # the launch fields the GPU model takes
CASES = [
  (1, 18944, 5, jnp.float32, 16, 32, 37, False, 512),
  (2, 200, 3, jnp.float32, 8, 32, 2, True, 64),
  (1, 96, 1, jnp.bfloat16, 4, 8, 1, False, 512),
  (3, 160, 4, jnp.float32, 0, 0, 0, True, 128),
  (1, 18944, 5, jnp.float32, 16, 32, 37, True, _H200["block_n"]),  # 7B at the H200 tuning's block
]


def _inputs(rng, m, n, s, parts_dtype, rank, r_cols, p, bias):
  bf16 = jnp.bfloat16
  args = dict(parts_Sx_Mx2N=jnp.asarray(rng.standard_normal((s, m, 2 * n)) * 2, parts_dtype), n=n, dtype=bf16)
  if rank:
    xa = rng.standard_normal((p, m, r_cols))
    xa[:, :, 2 * rank:] = 0.0  # the group's zero columns up to a power-of-two rank
    args.update(xa_PxMxR=jnp.asarray(xa, jnp.float32), lora_scale=2.0,
                b_gate_RxN=jnp.asarray(rng.standard_normal((rank, n)) * 0.1, bf16),
                b_up_RxN=jnp.asarray(rng.standard_normal((rank, n)) * 0.1, bf16))
  if bias:
    args.update(bias_gate_N=jnp.asarray(rng.standard_normal(n), bf16),
                bias_up_N=jnp.asarray(rng.standard_normal(n), bf16))
  return args


def _bf16_ulp(v):
  """One bf16 ulp at |v| (8 significant bits), float64."""
  return np.exp2(np.floor(np.log2(np.maximum(np.abs(v), 2.0 ** -126))) - 7)


def _numpy(parts_Sx_Mx2N, n, dtype, xa_PxMxR=None, b_gate_RxN=None, b_up_RxN=None, lora_scale=1.0,
           bias_gate_N=None, bias_up_N=None):
  """The same steps in float64 NumPy, rounding to bf16 where the model does. Returns (output, g, (ratio_g,
  ratio_u)): per element, how far g (or u) of a path that rounds the same steps from float32 sums can be from
  this one's, in its own ulps: the sum of the bf16 steps on the way (each rounding can land one step apart; 1
  with no step before the last, several where a sum cancels)."""
  del dtype
  f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  bf = lambda a: np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)
  y = bf(f64(parts_Sx_Mx2N).sum(0))
  halves = [y[:, :n], y[:, n:]]
  steps = [_bf16_ulp(h) for h in halves]  # the rounding steps met so far, summed per half
  if bias_gate_N is not None:
    halves = [bf(h + f64(b)) for h, b in zip(halves, (bias_gate_N, bias_up_N))]
    steps = [f + _bf16_ulp(h) for f, h in zip(steps, halves)]
  if b_gate_RxN is not None:
    r = b_gate_RxN.shape[0]
    xa = bf(f64(xa_PxMxR).sum(0))
    out = []
    for i, (h, first, b) in enumerate(zip(halves, (0, r), (b_gate_RxN, b_up_RxN))):
      xa_r, b_rn = xa[:, first:first + r], np.abs(f64(b))
      term = bf(lora_scale * (xa_r @ f64(b)))
      xa_steps = lora_scale * (_bf16_ulp(xa_r) @ b_rn)  # each x @ A entry one step apart, through B
      out.append(bf(h + term))
      steps[i] = steps[i] + xa_steps + _bf16_ulp(term) + _bf16_ulp(out[-1])
    halves = out
  g, u = halves
  ratios = tuple(f / _bf16_ulp(h) for f, h in zip(steps, halves))
  return bf(g / (1 + np.exp(-g)) * u), g, ratios


@pytest.mark.parametrize("case", range(len(CASES)))
def test_swiglu_matches_the_unfused_steps(case):
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  *shape, block_n = CASES[case]
  args = _inputs(rng, *shape)
  got = swiglu(**args, block_n=block_n, interpret=True)
  want, (want64, g64, (ratio_g, ratio_u)) = swiglu_reference(**args), _numpy(**args)
  assert got.shape == (shape[0], shape[1]) and got.dtype == jnp.bfloat16
  apart = _ulps_apart(got, want)
  assert (apart <= 1.01).all() and (apart > 0).mean() < 0.02, f"{seed=}: {apart.max()}"
  # Against float64 NumPy, rounding at the same places: where float32 and float64 land on either side of bf16
  # roundings on the way to g or u, u moves by those steps (ratio_u of its ulps) and g too, each ulp of g moving
  # the output by d log SiLU / d log g (at most 1 + |g| ulps); the output's own rounding adds one; elsewhere the
  # same. (The bound was 2 + |g|, one step of g or u: seeds 22 of case 0 and 4 of case 4 broke it, at 3.5 and
  # 15.6 ulps, with two roundings on the way to g landing apart.)
  apart64 = _ulps_apart(got, want64)
  bound = 1 + ratio_u + (1 + np.abs(g64)) * ratio_g
  assert (apart64 <= bound).all() and _rare(apart64 > 1.01, 1e-3), f"{seed=}: {apart64.max()}"


def test_swiglu_leaves_out_no_term():
  rng = np.random.default_rng(fresh_seed())
  args = _inputs(rng, 2, 200, 3, jnp.float32, 8, 32, 2, True)
  got = swiglu(**args, block_n=64, interpret=True)
  for names in (("bias_gate_N", "bias_up_N"), ("xa_PxMxR", "b_gate_RxN", "b_up_RxN")):
    want = swiglu_reference(**{k: v for k, v in args.items() if k not in names})
    assert (_ulps_apart(got, want) > 1.01).any(), names
  swapped = swiglu_reference(**{**args, "b_gate_RxN": args["b_up_RxN"], "b_up_RxN": args["b_gate_RxN"]})
  assert (_ulps_apart(got, swapped) > 1.01).any()


def test_swiglu_rejects_mismatched_inputs():
  rng = np.random.default_rng(fresh_seed())
  args = _inputs(rng, 2, 200, 3, jnp.float32, 8, 32, 2, True)
  with pytest.raises(ValueError, match=r"partials \(3, 2, 400\) must be \[S, M, 2N\] with N=199"):
    swiglu(**{**args, "n": 199}, interpret=True)
  with pytest.raises(ValueError, match="x @ A partials and both B's"):
    swiglu(**{k: v for k, v in args.items() if k != "b_up_RxN"}, interpret=True)
  with pytest.raises(ValueError, match=r"must both be \[r, N=200\]"):
    swiglu(**{**args, "b_up_RxN": args["b_up_RxN"][:4]}, interpret=True)
  with pytest.raises(ValueError, match="both projections"):
    swiglu(**{k: v for k, v in args.items() if k != "bias_up_N"}, interpret=True)


def test_swiglu_lowers_to_one_triton_kernel():
  # The Pallas -> Triton step interpret mode skips, for a CUDA GPU; a module that does not verify prints in
  # MLIR's generic form ("builtin.module"(...)).
  rng = np.random.default_rng(fresh_seed())
  args = _inputs(rng, 1, 18944, 5, jnp.float32, 16, 32, 37, True)
  static = {k: args.pop(k) for k in ("n", "dtype", "lora_scale")}
  text, module = lower_for_cuda(lambda a: swiglu(**a, **static), args)
  assert text.count("__gpu$xla.gpu.triton") == 1 and "decode_swiglu" in text
  assert "module @" in module and '"builtin.module"' not in module, module[-3000:]
