"""The decode-attention kernel (Pallas interpret mode) against the model's XLA attention on the same layer."""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qerl_kernels.decode_attention import decode_attention, decode_attention_update
from qerl_jax.model import attention as attn


def _case(name, num_layers, b, h, kvh, d, cache_len, seq):
  rng = np.random.default_rng(zlib.crc32(name.encode()))
  q = jnp.asarray(rng.standard_normal((b, h, d)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((num_layers, b, cache_len, kvh, d)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((num_layers, b, cache_len, kvh, d)), jnp.bfloat16)
  # Left padding of random length per row, then visible slots up to each row's own query slot.
  mask = np.zeros((b, seq), bool)
  for row in range(b):
    start, end = rng.integers(0, seq // 2), rng.integers(seq // 2, seq)
    mask[row, start:end + 1] = True
  return q, k, v, jnp.asarray(mask)


@pytest.mark.parametrize("num_layers,b,h,kvh,d,cache_len,seq,block_s,splits", [
  (3, 2, 28, 4, 64, 200, 200, 64, None),  # Qwen2.5-7B's 7 heads per kv head; ragged slots, auto splits
  (2, 3, 8, 8, 32, 96, 70, 16, 2),  # no grouping; only the first 70 of 96 cached slots are read
  (2, 1, 32, 2, 128, 48, 48, 32, 1),  # 16 heads per kv head, one split
])
def test_decode_attention_matches_the_models_attention(request, num_layers, b, h, kvh, d, cache_len, seq,
                                                       block_s, splits):
  q, k, v, mask = _case(request.node.name, num_layers, b, h, kvh, d, cache_len, seq)
  for layer in range(num_layers):
    got = decode_attention(q, k, v, jnp.int32(layer), mask, block_s=block_s, splits=splits, interpret=True)
    want = attn.attend(q[:, None], k[layer, :, :seq], v[layer, :, :seq], mask[:, None, :])[:, 0]
    assert got.shape == (b, h * d) and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)
  other = decode_attention(q, k, v, jnp.int32(0), mask, block_s=block_s, splits=splits, interpret=True)
  assert np.abs(np.asarray(other, np.float32) - np.asarray(got, np.float32)).max() > 0.1  # layers differ


@pytest.mark.parametrize("num_visible,splits", [(37, None), (33, 4), (1, 3), (200, 2)])
def test_blocks_past_the_visible_slots_are_not_read(request, num_visible, splits):
  # Slots from num_visible on are invisible (a decode step's causal limit); NaN in k and v from the first
  # block wholly past it would poison any block that read them (0 x NaN = NaN), so a finite result equal to
  # the XLA attention shows those blocks were skipped, including whole splits past the limit.
  q, k, v, _ = _case(request.node.name, 1, 2, 28, 4, 64, 200, 200)
  rng = np.random.default_rng(zlib.crc32(request.node.name.encode()) + 1)
  mask = np.zeros((2, 200), bool)
  mask[0, :num_visible] = True
  mask[1, rng.integers(0, num_visible):num_visible] = True  # left padding on row 1
  mask = jnp.asarray(mask)
  want = attn.attend(q[:, None], k[0], v[0], mask[:, None, :])[:, 0]
  past = -(-num_visible // 16) * 16  # block_s = 16: the block holding the limit is read, masked
  k, v = (a.at[:, :, past:].set(jnp.nan) for a in (k, v))
  got = decode_attention(q, k, v, 0, mask, num_visible=jnp.int32(num_visible), block_s=16, splits=splits,
                         interpret=True)
  assert np.isfinite(np.asarray(got, np.float32)).all()
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)


def test_decode_attention_rejects_shapes_that_do_not_fit():
  q = jnp.zeros((2, 8, 32), jnp.bfloat16)
  k = jnp.zeros((2, 2, 40, 4, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match="do not fit together"):
    decode_attention(q, k, k, 0, jnp.ones((2, 41), bool), interpret=True)  # more slots than cached
  with pytest.raises(ValueError, match="do not fit together"):
    decode_attention(q[:1], k, k, 0, jnp.ones((1, 40), bool), interpret=True)  # batch mismatch
  with pytest.raises(ValueError, match="must be powers of two"):
    decode_attention(q, k, k, 0, jnp.ones((2, 40), bool), block_s=24, interpret=True)


def test_decode_attention_lowers_to_triton_for_cuda():
  """The Pallas -> Triton lowering that interpret mode skips, done for a CUDA GPU on this CPU machine."""
  q, k, v, mask = _case("lowering", 2, 2, 28, 4, 64, 96, 80)
  f = lambda q, k, v, mask, n: decode_attention(q, k, v, jnp.int32(1), mask, num_visible=n, block_s=16)
  text = jax.jit(f).trace(q, k, v, mask, jnp.int32(40)).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 2  # the attention and the merge of its splits
  k_new = k[0, :, 0]
  g = lambda q, kn, vn, k, v, mask, n: decode_attention_update(q, kn, vn, k, v, jnp.int32(1), n, mask, block_s=16)
  text = jax.jit(g).trace(q, k_new, k_new, k, v, mask, jnp.int32(40)).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 2
  assert "output_operand_aliases" in text  # the caches are written in place


@pytest.mark.parametrize("splits,merges", [(1, False), (3, True)])
def test_one_split_leaves_nothing_to_merge(splits, merges):
  # With one split per (row, kv head) the kernel's normalized output is the answer; with more, a second
  # kernel merges them, not XLA's softmax over the splits (~6 small kernels per layer on a GPU).
  q, k, v, mask = _case("one_split", 1, 2, 8, 2, 32, 96, 96)
  jaxpr = jax.make_jaxpr(lambda q: decode_attention(q, k, v, 0, mask, block_s=16, splits=splits, interpret=True))(q)
  outside = [e.primitive.name for e in jaxpr.jaxpr.eqns]
  assert outside.count("pallas_call") == 1 + merges, outside
  assert not {"exp", "reduce_max", "reduce_sum", "div"} & set(outside), outside


@pytest.mark.parametrize("b,programs_per_sm,want", [
  (1, 2, 20),  # 7B at batch 1: 4 (row, kv head) pairs, 66 splits asked, one per 64-slot block of 1280
  (8, 2, 7),  # batch 8: 264 programs wanted over 32 pairs, 9 splits asked, 3 blocks each -> 7
  (8, 8, 20),
  (64, 2, 2),
  (64, 16, 7),  # 2112 programs over 256 pairs -> 9 asked -> 7
])
def test_the_split_plan_aims_at_the_programs_per_sm(b, programs_per_sm, want):
  from qerl_kernels.decode_attention import _split_plan
  assert _split_plan(b, 4, 1280, 64, None, programs_per_sm) == want
  assert _split_plan(b, 4, 1280, 64, 3, programs_per_sm) == 3  # a caller's splits win
  assert _split_plan(b, 4, 100, 64, 5, programs_per_sm) == 2  # never more splits than blocks


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 20])
def test_the_splits_share_the_visible_blocks_evenly(splits):
  # Every block before the visible limit is read by exactly one split, and no split walks more than its share
  # (a plan over the whole 1280-slot budget had split 0 walk 10 blocks and split 1 three, at 776 visible slots).
  from qerl_kernels.decode_attention import split_blocks
  for visible in (1, 63, 64, 65, 257, 776, 1280):
    visible_blocks = -(-visible // 64)
    ranges = [tuple(int(a) for a in split_blocks(jnp.int32(visible), jnp.int32(s), block_s=64, splits=splits))
              for s in range(splits)]
    read = [first + i for first, n in ranges for i in range(n)]
    assert sorted(read) == list(range(visible_blocks)), (visible, ranges)
    assert max(n for _, n in ranges) == -(-visible_blocks // splits), (visible, ranges)


def test_a_tuned_programs_per_sm_reaches_the_launch(tmp_path, monkeypatch):
  # The tuning file's "decode_kernels" -> "attention" -> "programs_per_sm" sets the grid's splits on a GPU (traced
  # here, not run: the jaxpr's pallas_call carries the grid); a caller's splits still win.
  import json
  from qerl_kernels import config as config_lib
  tuning = tmp_path / "t.json"
  tuning.write_text(json.dumps({"entries": [], "decode_kernels": {"attention": {"programs_per_sm": 8}}}))
  monkeypatch.setenv("QERL_KERNEL_TUNING", str(tuning))
  monkeypatch.setattr(config_lib, "device_kind", lambda: "NVIDIA H200")
  q, k, v, mask = _case("tuned_splits", 1, 8, 28, 4, 32, 1280, 1280)

  def grids(**kw):
    jaxpr = jax.make_jaxpr(lambda q: decode_attention(q, k, v, 0, mask, **kw))(q)
    return [e.params["grid_mapping"].grid for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]

  assert grids() == [(32, 20), (8 * 28,)]  # 8 * 132 programs wanted: one 64-slot block per split
  assert grids(splits=5) == [(32, 5), (8 * 28,)]
  assert grids(interpret=True) == [(32, 7), (8 * 28,)]  # interpret mode: the defaults (2 per SM)


def test_a_tuned_num_stages_reaches_the_launch_and_a_bad_one_is_refused(tmp_path, monkeypatch):
  # "num_stages" (the slot loop's pipeline depth) goes to the attention launch's compiler params; any positive
  # count is a valid depth (3 is not a power of two), zero or a bool names the field.
  import json
  from qerl_kernels import config as config_lib
  tuning = tmp_path / "t.json"
  monkeypatch.setenv("QERL_KERNEL_TUNING", str(tuning))
  monkeypatch.setattr(config_lib, "device_kind", lambda: "NVIDIA H200")
  q, k, v, mask = _case("tuned_stages", 1, 2, 28, 4, 32, 256, 256)

  def stages():
    jaxpr = jax.make_jaxpr(lambda q: decode_attention(q, k, v, 0, mask))(q)
    calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "pallas_call"]
    return [str(e.params["compiler_params"]) for e in calls if "decode_attention" == e.params["name"]]

  for n in (3, 5):
    tuning.write_text(json.dumps({"entries": [], "decode_kernels": {"attention": {"num_stages": n}}}))
    got = stages()
    assert len(got) == 1 and f"num_stages={n}" in got[0], got
  for bad in (0, True):
    tuning.write_text(json.dumps({"entries": [], "decode_kernels": {"attention": {"num_stages": bad}}}))
    with pytest.raises(ValueError, match=f"field 'num_stages' must be a positive integer, got {bad}"):
      config_lib.decode_kernel_params("attention", "NVIDIA H200")


@pytest.mark.parametrize("num_layers,layer,b,h,kvh,d,cache_len,seq,slot,block_s,splits", [
  (3, 2, 2, 28, 4, 64, 200, 200, 130, 16, None),  # 7B's grouping, many splits, the slot mid-block
  (2, 0, 3, 8, 8, 32, 96, 70, 64, 16, 2),  # the slot opens a block; only 70 of 96 slots are masked in
  (1, 0, 1, 32, 2, 128, 48, 48, 0, 32, 1),  # the first slot: only the new token, one split
  (2, 1, 2, 28, 4, 64, 80, 80, 79, 16, 3),  # the last slot
])
def test_update_is_a_cache_write_then_attention(request, num_layers, layer, b, h, kvh, d, cache_len, seq, slot,
                                                block_s, splits):
  q, k, v, mask = _case(request.node.name, num_layers, b, h, kvh, d, cache_len, seq)
  rng = np.random.default_rng(zlib.crc32(request.node.name.encode()) + 2)
  k_new, v_new = (jnp.asarray(rng.standard_normal((b, kvh, d)), jnp.bfloat16) for _ in range(2))
  mask = np.asarray(mask).copy()
  mask[:, slot + 1:] = False  # a decode step: nothing past the token's own slot
  mask[:, slot] = True
  mask[0, slot] = slot == 0  # row 0 cannot see its own slot (unless nothing else is visible to it)
  mask[0, max(0, slot - 3):slot] = True
  mask = jnp.asarray(mask)
  # Stale values in the slot and NaN past it: the kernel must use k_new / v_new and read nothing later.
  k, v = (a.at[:, :, slot].set(7.0).at[:, :, slot + 1:].set(jnp.nan) for a in (k, v))
  want_k = k.at[layer, :, slot].set(k_new)
  want_v = v.at[layer, :, slot].set(v_new)
  want = attn.attend(q[:, None], want_k[layer, :, :slot + 1], want_v[layer, :, :slot + 1],
                     mask[:, None, :slot + 1])[:, 0]
  got, got_k, got_v = jax.jit(functools.partial(decode_attention_update, block_s=block_s, splits=splits,
                                                interpret=True))(q, k_new, v_new, k, v, jnp.int32(layer),
                                                                 jnp.int32(slot), mask)
  np.testing.assert_array_equal(np.asarray(got_k, np.float32), np.asarray(want_k, np.float32))
  np.testing.assert_array_equal(np.asarray(got_v, np.float32), np.asarray(want_v, np.float32))
  assert got.shape == (b, h * d) and np.isfinite(np.asarray(got, np.float32)).all()
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)


def test_update_rejects_new_kv_of_the_wrong_shape():
  q, k, v, mask = _case("bad_update", 1, 2, 8, 2, 32, 40, 40)
  with pytest.raises(ValueError, match=r"new k \(2, 2, 16\).*\[B, Hkv, Dh\]"):
    decode_attention_update(q, k[0, :, 0, :, :16], k[0, :, 0, :, :16], k, v, 0, 3, mask, interpret=True)
