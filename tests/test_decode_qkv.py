"""qerl_kernels/decode_qkv.py in interpret mode: against its jnp reference, an independent NumPy one, and the decode
attention kernel fed its rows."""


import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qerl_kernels.decode_attention import decode_attention_rows, decode_attention_update
from qerl_kernels.decode_qkv import padded_heads, qkv_rows, qkv_rows_reference
from qerl_jax.model.testing import fresh_seed
from tests.test_decode_residual_norm import _rare, _ulps_apart
from tests.triton_lowering import lower_for_cuda

# (M, H, Hkv, Dh, S, parts dtype, rank, R, P, bias, cache dtype): Qwen2.5-7B's heads at one row (the padded rank
# 3 x 16 -> 64, split 4, 7 x @ A programs), two rows with every term and a small head, a finished bf16 output
# (S = 1) and an e4m3 cache (k and v rounded again), none of the adapters.
CASES = [
  (1, 28, 4, 128, 4, jnp.float32, 16, 64, 7, True, jnp.bfloat16),
  (2, 4, 2, 16, 3, jnp.float32, 4, 16, 2, True, jnp.bfloat16),
  (1, 8, 8, 32, 1, jnp.bfloat16, 2, 8, 1, False, jnp.float8_e4m3fn),
  (3, 6, 2, 16, 2, jnp.float32, 0, 0, 0, True, jnp.bfloat16),
]


def _inputs(rng, m, h, kvh, d, s, parts_dtype, rank, r_cols, p, bias, cache_dtype):
  bf16 = jnp.bfloat16
  widths = [h * d, kvh * d, kvh * d]
  n = sum(widths)
  angles = rng.uniform(0, 2 * np.pi, (m, d // 2))
  args = dict(parts=jnp.asarray(rng.standard_normal((s, m, n)) * 2, parts_dtype),
              cos_MxR=jnp.asarray(np.cos(angles), jnp.float32), sin_MxR=jnp.asarray(np.sin(angles), jnp.float32),
              heads=h, kv_heads=kvh, head_dim=d, dtype=bf16, cache_dtype=cache_dtype)
  if rank:
    xa = rng.standard_normal((p, m, r_cols))
    xa[:, :, 3 * rank:] = 0.0  # the group's zero columns up to a power-of-two rank
    b = np.zeros((r_cols, n))  # block-diagonal, as with_merged_launches makes it
    starts = np.cumsum([0] + widths)
    for i in range(3):
      b[i * rank:(i + 1) * rank, starts[i]:starts[i + 1]] = rng.standard_normal((rank, widths[i])) * 0.1
    args.update(xa_PxMxR=jnp.asarray(xa, jnp.float32), b_RxN=jnp.asarray(b, bf16), rank=rank, lora_scale=2.0)
  if bias:
    args["bias_N"] = jnp.asarray(rng.standard_normal(n), bf16)
  return args


def _numpy(parts, cos_MxR, sin_MxR, heads, kv_heads, head_dim, dtype, cache_dtype, xa_PxMxR=None, b_RxN=None,
           rank=0, lora_scale=1.0, bias_N=None):
  """The same steps in float64 NumPy with per-member B's, rounding to bf16 where the model does."""
  del dtype
  f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  bf = lambda a: np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)
  m, d = parts.shape[1], head_dim
  y = bf(f64(parts).sum(0))
  if bias_N is not None:
    y = bf(y + f64(bias_N))
  if b_RxN is not None:
    xa = bf(f64(xa_PxMxR).sum(0))
    bounds = np.cumsum([0, heads * d, kv_heads * d, kv_heads * d])
    ups = [xa[:, i * rank:(i + 1) * rank] @ f64(b_RxN)[i * rank:(i + 1) * rank, bounds[i]:bounds[i + 1]]
           for i in range(3)]
    y = bf(y + bf(lora_scale * np.concatenate(ups, axis=1)))
  heads_MxJxD = y.reshape(m, heads + 2 * kv_heads, d)
  x1, x2 = heads_MxJxD[..., :d // 2], heads_MxJxD[..., d // 2:]
  c, s = f64(cos_MxR)[:, None], f64(sin_MxR)[:, None]
  rotated = bf(np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1))
  out = np.concatenate([rotated[:, :heads + kv_heads], heads_MxJxD[:, heads + kv_heads:]], axis=1)
  cached = np.asarray(out[:, heads:], np.float32).astype(jnp.dtype(cache_dtype)).astype(np.float64)
  out = np.concatenate([out[:, :heads], cached], axis=1)
  return np.concatenate([out, np.zeros((m, padded_heads(heads, kv_heads), d))], axis=1)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_qkv_rows_match_the_unfused_steps(case):
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  m, h, kvh, d, *_ = CASES[case]
  args = _inputs(rng, *CASES[case])
  got = qkv_rows(**args, interpret=True)
  want, want64 = qkv_rows_reference(**args), _numpy(**args)
  assert got.shape == (m, h + 2 * kvh + padded_heads(h, kvh), d) and got.dtype == jnp.float32
  assert (np.asarray(got)[:, h + 2 * kvh:] == 0).all()  # the zero rows are written, not left as they were
  apart = _ulps_apart(got, want)
  assert (apart <= 1.01).all() and (apart > 0).mean() < 0.02, f"{seed=}: {apart.max()}"
  # Against float64 NumPy: where float32 and float64 land on either side of an earlier bf16 rounding, RoPE's
  # output moves by one ulp of an input times |cos| + |sin| (at most sqrt 2) relative to its own size, which
  # can be several of its ulps where it is small; rare.
  apart64 = _ulps_apart(got, want64)
  assert _rare(apart64 > 1.01, 2e-3), f"{seed=}: {apart64.max()}"


def test_qkv_rows_leave_out_no_term_and_rotate_only_q_and_k():
  rng = np.random.default_rng(fresh_seed())
  args = _inputs(rng, *CASES[1])
  got = np.asarray(qkv_rows(**args, interpret=True))
  for names in (("bias_N",), ("xa_PxMxR", "b_RxN")):
    want = qkv_rows_reference(**{k: v for k, v in args.items() if k not in names})
    assert (_ulps_apart(got, want) > 1.01).any(), names
  h, kvh = args["heads"], args["kv_heads"]
  # Another row's angles move every rotated head (q and k), and no v head.
  swapped = np.asarray(qkv_rows_reference(**{**args, "cos_MxR": args["cos_MxR"][::-1],
                                             "sin_MxR": args["sin_MxR"][::-1]}))
  moved = (_ulps_apart(got, swapped) > 1.01).any(axis=-1)  # [M, heads]
  assert moved[:, :h + kvh].all() and not moved[:, h + kvh:].any()


def test_qkv_rows_reject_mismatched_inputs():
  rng = np.random.default_rng(fresh_seed())
  args = _inputs(rng, *CASES[1])
  with pytest.raises(ValueError, match=r"partials \(3, 2, 128\) must be \[S, M, \(H \+ 2 Hkv\) Dh\] with H=5"):
    qkv_rows(**{**args, "heads": 5}, interpret=True)
  with pytest.raises(ValueError, match=r"cos \(2, 4\) and sin \(2, 8\) must be \[M=2, Dh/2=8\]"):
    qkv_rows(**{**args, "cos_MxR": args["cos_MxR"][:, :4]}, interpret=True)
  with pytest.raises(ValueError, match="both x @ A partials and the block-diagonal B"):
    qkv_rows(**{k: v for k, v in args.items() if k != "b_RxN"}, interpret=True)
  with pytest.raises(ValueError, match=r"B \(16, 128\) must be \[>= 3r, 128\].*rank r=8"):
    qkv_rows(**{**args, "rank": 8}, interpret=True)
  with pytest.raises(ValueError, match=r"bias \(127,\) must be \[128\]"):
    qkv_rows(**{**args, "bias_N": args["bias_N"][:127]}, interpret=True)


def test_attention_from_the_rows_is_the_update_from_q_k_v():
  # decode_attention_rows on qkv_rows' output = decode_attention_update on its q, k and v (the XLA path's
  # operands): the same outputs and caches, bit for bit.
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  m, h, kvh, d = 2, 8, 2, 16
  args = _inputs(rng, m, h, kvh, d, 3, jnp.float32, 4, 16, 2, True, jnp.bfloat16)
  rows = qkv_rows(**args, interpret=True)
  q, k_new, v_new = (rows[:, a:b].astype(jnp.bfloat16) for a, b in ((0, h), (h, h + kvh), (h + kvh, h + 2 * kvh)))
  k, v = (jnp.asarray(rng.standard_normal((2, m, 24, kvh, d)), jnp.bfloat16) for _ in range(2))
  slot = 9
  mask = jnp.asarray(np.arange(24)[None, :] <= np.asarray([[slot], [slot]])).at[1, :3].set(False)
  want = decode_attention_update(q, k_new, v_new, k, v, 1, slot, mask, block_s=16, interpret=True)
  got = decode_attention_rows(rows, k, v, 1, slot, mask, heads=h, dtype=jnp.bfloat16, block_s=16, interpret=True)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32), err_msg=f"{seed=}")
  with pytest.raises(ValueError, match=r"rows \(2, 28, 16\) must be \[B, H \+ 2 Hkv \+ Gp, Dh\] for H=6"):
    decode_attention_rows(rows, k, v, 1, slot, mask, heads=6, dtype=jnp.bfloat16, interpret=True)


def test_qkv_rows_lower_to_one_triton_kernel():
  # The Pallas -> Triton step interpret mode skips, for a CUDA GPU; a module that does not verify prints in
  # MLIR's generic form ("builtin.module"(...)).
  rng = np.random.default_rng(fresh_seed())
  args = _inputs(rng, *CASES[0])
  static = {k: args.pop(k) for k in ("heads", "kv_heads", "head_dim", "dtype", "cache_dtype", "rank", "lora_scale")}
  text, module = lower_for_cuda(lambda a: qkv_rows(**a, **static), args)
  assert text.count("__gpu$xla.gpu.triton") == 1 and "decode_qkv_rows" in text
  assert "module @" in module and '"builtin.module"' not in module, module[-3000:]
