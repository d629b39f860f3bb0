"""GPU check of the decode step's Pallas kernels before any timing is trusted (CPU: interpret mode, small shapes).

    python experiments/check_decode_kernels.py --out $OUT/decode_check.json

1. Each kernel against its jnp reference at Qwen2.5-7B's decode shapes, one and two rows: decode_residual_norm
   (o_proj / down_proj's end), decode_swiglu (gate|up's) and decode_qkv (q|k|v's, with RoPE at each row's own
   position). It records the largest distance in bf16 ulps and the fraction of outputs that differ.
2. decode_attention at 7B's heads over a 1280-slot cache, 776 slots visible (mid-rollout), at 1, 8 and 64 rows,
   with the tuned splits and with one 64-slot block per split, against the model's XLA attention in float32:
   the largest error over the largest output (splits change the order of the softmax's sums, so not bit-equal).
3. The norm fold (ModelConfig.decode_norm_fold): the gate|up group gemv reading a pending RMSNorm against the
   norm's own launch followed by the same gemv, at 7B's shapes, one and two rows (bit-equal expected).
4. A small random NVFP4 Qwen2-style model, per-layer loop with q|k|v and gate|up merged as rollouts run it:
   logits of a prefill and decode steps with config.decode_partials "xla" against "pallas" (the Pallas decode
   attention in both) and "pallas" with the norm fold, and how many of each kernel the decode step traced.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.provenance import commit, kernel_tuning  # noqa: E402


def ulps_apart(got, want) -> dict:
  """Largest distance in bf16 ulps of ``want`` and the fraction of elements that differ at all."""
  got, want = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (got, want))
  ulps = np.abs(got - want) / (np.maximum(np.abs(want), 1e-30) * 2.0 ** -7)
  return dict(max_ulps=float(ulps.max()), frac_differ=float((got != want).mean()))


def kernel_checks(rng, interpret: bool, small: bool) -> dict:
  from qerl_kernels.decode_qkv import qkv_rows, qkv_rows_reference
  from qerl_kernels.decode_residual_norm import residual_norm, residual_norm_reference
  from qerl_kernels.decode_swiglu import swiglu, swiglu_reference
  bf16, f32 = jnp.bfloat16, jnp.float32
  d, n, (h, kvh, dh) = (64, 96, (4, 2, 16)) if small else (3584, 18944, (28, 4, 128))
  out = {}
  for m in (1, 2):
    args = dict(x_MxD=jnp.asarray(rng.standard_normal((m, d)) * 4, bf16),
                parts_SxMxD=jnp.asarray(rng.standard_normal((5, m, d)), f32),
                norm_D=jnp.asarray(1 + 0.1 * rng.standard_normal(d), bf16),
                xa_PxMxR=jnp.asarray(rng.standard_normal((7, m, 16)), f32),
                b_RxD=jnp.asarray(rng.standard_normal((16, d)) * 0.1, bf16), lora_scale=2.0,
                bias_D=jnp.asarray(rng.standard_normal(d), bf16),
                noise_D=jnp.asarray(1e-2 * rng.standard_normal(d), f32))
    got = residual_norm(**args, eps=1e-6, interpret=interpret)
    for name, g, w in zip(("x", "h"), got, residual_norm_reference(**args, eps=1e-6)):
      out[f"residual_norm_m{m}_{name}"] = ulps_apart(g, w)
    sargs = dict(parts_Sx_Mx2N=jnp.asarray(rng.standard_normal((2, m, 2 * n)), f32), n=n, dtype=bf16,
                 xa_PxMxR=jnp.asarray(rng.standard_normal((37, m, 32)), f32), lora_scale=2.0,
                 b_gate_RxN=jnp.asarray(rng.standard_normal((16, n)) * 0.1, bf16),
                 b_up_RxN=jnp.asarray(rng.standard_normal((16, n)) * 0.1, bf16))
    out[f"swiglu_m{m}"] = ulps_apart(swiglu(**sargs, interpret=interpret), swiglu_reference(**sargs))
    widths = [h * dh, kvh * dh, kvh * dh]
    b = np.zeros((64, sum(widths)))
    starts = np.cumsum([0] + widths)
    for i in range(3):
      b[i * 16:(i + 1) * 16, starts[i]:starts[i + 1]] = rng.standard_normal((16, widths[i])) * 0.1
    angles = rng.integers(0, 1280, (m, 1)) * 10000.0 ** (-np.arange(dh // 2) / (dh // 2))
    qargs = dict(parts=jnp.asarray(rng.standard_normal((4, m, sum(widths))) * 2, f32),
                 cos_MxR=jnp.asarray(np.cos(angles), f32), sin_MxR=jnp.asarray(np.sin(angles), f32), heads=h,
                 kv_heads=kvh, head_dim=dh, dtype=bf16, cache_dtype=bf16,
                 xa_PxMxR=jnp.asarray(rng.standard_normal((7, m, 64)), f32).at[:, :, 48:].set(0.0),
                 b_RxN=jnp.asarray(b, bf16), rank=16, lora_scale=2.0,
                 bias_N=jnp.asarray(rng.standard_normal(sum(widths)), bf16))
    out[f"qkv_rows_m{m}"] = ulps_apart(qkv_rows(**qargs, interpret=interpret), qkv_rows_reference(**qargs))
  return out


def norm_fold_checks(rng, interpret: bool, small: bool) -> dict:
  """The gate|up group launch's partials from a pending norm against those of the norm's launch, then the
  launch (x @ A's partials too): bit-equal unless the two kernels sum the blocks' squares in another order."""
  import qerl_kernels as kernels
  from qerl_kernels.decode_residual_norm import residual_add
  from qerl_jax.quant import api as quant_api
  d, n = (64, 96) if small else (3584, 18944)
  group = kernels.Nvfp4Group(tuple(quant_api.quantize(jnp.asarray(rng.standard_normal((d, n)) * 0.02, jnp.bfloat16),
                                                      "nvfp4") for _ in range(2)))
  a = jnp.asarray(rng.standard_normal((d, 32)) / np.sqrt(d), jnp.bfloat16)
  out = {}
  for m in (1, 2):
    pending = residual_add(jnp.asarray(rng.standard_normal((m, d)) * 4, jnp.bfloat16),
                           jnp.asarray(rng.standard_normal((5, m, d)), jnp.float32),
                           jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.bfloat16), eps=1e-6,
                           noise_D=jnp.asarray(1e-2 * rng.standard_normal(d), jnp.float32), interpret=interpret)
    got = kernels.nvfp4_matmul_xa_partials(pending, group, a, interpret=interpret)
    want = kernels.nvfp4_matmul_xa_partials(pending.materialize(), group, a, interpret=interpret)
    for name, g, w in zip(("y", "xa"), got, want):
      g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
      out[f"norm_fold_m{m}_{name}"] = dict(max_abs_over_max=float(np.abs(g - w).max() / np.abs(w).max()),
                                          frac_differ=float((g != w).mean()))
  return out


def attention_checks(rng, interpret: bool, small: bool) -> dict:
  from qerl_kernels.decode_attention import decode_attention
  from qerl_jax.model import attention as attn
  h, kvh, dh, cache_len, visible = (4, 2, 16, 96, 57) if small else (28, 4, 128, 1280, 776)
  out = {}
  for b in ((1, 3) if small else (1, 8, 64)):
    q = jnp.asarray(rng.standard_normal((b, h, dh)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((1, b, cache_len, kvh, dh)), jnp.bfloat16) for _ in range(2))
    mask = jnp.asarray(np.arange(cache_len)[None, :] < visible).repeat(b, 0)
    f32 = lambda a: a.astype(jnp.float32)
    want = np.asarray(attn.attend(f32(q)[:, None], f32(k[0]), f32(v[0]), mask[:, None, :])[:, 0], np.float64)
    for label, splits in (("tuned", None), ("block_per_split", cache_len // 16 if small else cache_len // 64)):
      got = decode_attention(q, k, v, 0, mask, num_visible=jnp.int32(visible), splits=splits,
                             block_s=16 if small else None, interpret=interpret)
      err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
      out[f"attention_b{b}_{label}"] = dict(max_err_over_max=float(err))
  return out


def model_check(seed: int, interpret: bool) -> dict:
  """Logits of the per-layer rollout loop with decode_partials "xla" against "pallas" on a small random model."""
  from flax import nnx
  import qerl_kernels as kernels
  from qerl_jax.model import LoraConfig, ModelConfig, Transformer, init_cache, random_base
  from qerl_jax.model.param_views import unstack_layers, with_merged_launches
  from qerl_jax.model.transformer import forward
  patched = {}
  if interpret:  # the gemv launches' interpret mode, as the tests run them (put back on return)
    import functools
    for name in ("nvfp4_matmul_xa", "xa_shares_launch", "nvfp4_matmul_xa_partials", "partials_launch_applies"):
      patched[name] = getattr(kernels, name)
      setattr(kernels, name, functools.partial(patched[name], interpret=True))
  config = ModelConfig(arch="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10000.0, dtype="bfloat16",
                       qkv_bias=True, gemv_lora_xa=True, decode_attention="pallas")
  model = Transformer(config, random_base(config, jax.random.key(seed), "nvfp4"),
                      lora=LoraConfig(rank=16, alpha=16, dtype=jnp.bfloat16), rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  for name in model.lora.targets if hasattr(model, "lora") and model.lora else ():
    proj = getattr(model.layers, name)
    proj.lora_b.set_value(jnp.asarray(0.05 * rng.standard_normal(proj.lora_b.get_value().shape), jnp.bfloat16))
  params = with_merged_launches(unstack_layers(model.params()), ("qkv", "gate_up"))
  tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, 12)), jnp.int32)
  valid = jnp.asarray(np.arange(16)[None, :] >= np.asarray([[0], [3]]))  # row 1 left-padded by 3
  positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)

  def run(cfg):
    cache = init_cache(config, 2, 16, per_layer=True)
    logits, cache = forward(params, cfg, model.lora_scale, tokens[:, :8], positions[:, :8], cache=cache,
                            cache_index=0, valid_BxS=valid)
    out = [logits]
    for i in range(8, 12):
      logits, cache = forward(params, cfg, model.lora_scale, tokens[:, i:i + 1], positions[:, i:i + 1], cache=cache,
                              cache_index=i, valid_BxS=valid)
      out.append(logits)
    return out

  logits, jaxprs = {}, {}
  for mode in ("xla", "pallas", "fold"):
    cfg = config.replace(decode_partials="xla" if mode == "xla" else "pallas", decode_norm_fold=mode == "fold")
    logits[mode] = [np.asarray(y, np.float32) for y in jax.jit(lambda p, cfg=cfg: run(cfg))(params)]
    jaxprs[mode] = str(jax.make_jaxpr(lambda p, cfg=cfg: run(cfg))(params))
  for name, fn in patched.items():
    setattr(kernels, name, fn)

  def apart(a, b):
    return max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(logits[a], logits[b]))

  names = ("residual_add", "pending_norm", "swiglu", "qkv_rows")
  calls = {mode: {name: len(re.findall(rf"jit\[\s*name={name}\b", jaxprs[mode])) for name in names}
           for mode in ("pallas", "fold")}
  return dict(max_abs_over_max_logit=apart("pallas", "xla"), fold_max_abs_over_max_logit=apart("fold", "pallas"),
              kernels_traced=calls["pallas"], fold_kernels_traced=calls["fold"],
              same_argmax=bool(all((g.argmax(-1) == w.argmax(-1)).all()
                                   for g, w in zip(logits["pallas"], logits["xla"]))))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", required=True)
  args = p.parse_args(argv)
  from qerl_kernels import config as config_lib
  interpret = jax.default_backend() != "gpu"
  rec = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, commit=commit(),
             kernel_tuning=kernel_tuning(),
             # what the kernels below ran with (each takes its tuned launch fields itself)
             launch={name: config_lib.decode_launch(name, interpret)
                     for name in ("residual_norm", "swiglu", "qkv_rows", "attention")},
             kernels=kernel_checks(np.random.default_rng(args.seed), interpret, small=interpret),
             attention=attention_checks(np.random.default_rng(args.seed + 1), interpret, small=interpret),
             norm_fold=norm_fold_checks(np.random.default_rng(args.seed + 2), interpret, small=interpret),
             model=model_check(args.seed, interpret))
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(rec, f, indent=1)
  print(f"launch fields: {rec['launch']} (tuning: {rec['kernel_tuning']})")
  for name, r in rec["kernels"].items():
    print(f"{name:24s} max {r['max_ulps']:6.2f} ulps, {100 * r['frac_differ']:6.3f}% differ")
  for name, r in rec["attention"].items():
    print(f"{name:24s} max error {r['max_err_over_max']:.2e} of the largest output")
  for name, r in rec["norm_fold"].items():
    print(f"{name:24s} max {r['max_abs_over_max']:.2e} of the largest apart, {100 * r['frac_differ']:6.3f}% differ")
  print(f"model: logits {rec['model']['max_abs_over_max_logit']:.2e} of the largest apart, same argmax "
        f"{rec['model']['same_argmax']}, traced {rec['model']['kernels_traced']}; with the norm fold "
        f"{rec['model']['fold_max_abs_over_max_logit']:.2e} from pallas's, "
        f"traced {rec['model']['fold_kernels_traced']}")


if __name__ == "__main__":
  main()
