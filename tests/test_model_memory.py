"""Loading streams: peak host memory stays near the quantized model plus one layer, never the bf16 model.

A fresh subprocess writes a bf16 checkpoint many layers deep, loads it once to compile everything, frees
it, then loads it again while a thread samples the resident set size. On CPU the "device" is host memory,
so a loader that built the bf16 model (or a bf16 stacked array) anywhere would show up here.
"""

import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(r"""
  import ctypes, gc, json, os, sys, threading, time
  import numpy as np, ml_dtypes, jax
  from safetensors.numpy import save_file
  from qerl_jax.model.loading import from_pretrained
  from qerl_jax.quant import nbytes

  out_dir, layers, hidden, inter = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
  rng = np.random.default_rng(0)
  kv = hidden // 2
  shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden),
            "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, hidden),
            "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
  embed = rng.standard_normal((64, hidden), np.float32).astype(ml_dtypes.bfloat16)
  tensors = {"model.embed_tokens.weight": embed,
             "model.norm.weight": np.ones(hidden, ml_dtypes.bfloat16)}
  for i in range(layers):
    for name, shape in shapes.items():
      w = 0.02 * rng.standard_normal(shape, np.float32)
      tensors[f"model.layers.{i}.{name}.weight"] = w.astype(ml_dtypes.bfloat16)
    for norm in ("input_layernorm", "post_attention_layernorm"):
      tensors[f"model.layers.{i}.{norm}.weight"] = np.ones(hidden, ml_dtypes.bfloat16)
  layer_bytes = sum(2 * a * b for a, b in shapes.values())
  os.makedirs(out_dir, exist_ok=True)
  save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
  del tensors
  json.dump(dict(model_type="llama", vocab_size=64, hidden_size=hidden, intermediate_size=inter,
                 num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=kv // 64,
                 tie_word_embeddings=True, max_position_embeddings=128, rms_norm_eps=1e-6),
            open(os.path.join(out_dir, "config.json"), "w"))

  def rss():
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

  def load():
    model, _ = from_pretrained(out_dir, quant="nvfp4", dtype="bfloat16", lora_rank=None, load_tokenizer=False)
    return model

  model = load()  # compiles every program the measured loads will use

  def measured_load():
    # (model, RSS increase over the load), sampled every 0.5 ms
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    time.sleep(0.2)
    base = rss()
    peak = [base]
    done = threading.Event()

    def sample():
      while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.0005)

    thread = threading.Thread(target=sample)
    thread.start()
    model = load()
    done.set()
    thread.join()
    return model, max(peak[0], rss()) - base

  # Three measured loads, the smallest increase kept: allocations of the process unrelated to loading (a busy
  # machine's allocator arenas) can only add to a measurement. Under a full two-core suite run two loads
  # still measured 86.6 MB against the 80.8 MB bound once (the test alone: 67-75 MB), hence a third.
  increases = []
  for _ in range(3):
    del model
    model, increase = measured_load()
    increases.append(increase)
  quantized = sum(nbytes(v) for v in jax.tree.leaves(model.params(), is_leaf=lambda x: hasattr(x, "scheme")))
  print("RESULT", json.dumps(dict(increase=min(increases), quantized=quantized, layer_bf16=layer_bytes,
                                  model_bf16=layers * layer_bytes)))
""")


def test_loading_peak_memory_is_quantized_model_plus_a_layer(tmp_path):
  proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "ckpt"), "24", "512", "2048"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [out for out in proc.stdout.splitlines() if out.startswith("RESULT ")][-1]
  r = json.loads(line[len("RESULT "):])
  mb = {k: round(v / 2**20, 1) for k, v in r.items()}
  # The measurement works: the quantized model itself is allocated during the measured load...
  assert r["increase"] >= 0.7 * r["quantized"], mb
  # ...and nothing near the bf16 model is: at most the quantized model plus the working set of one
  # fused group (gate+up: bf16 source, its device copy, float32 temporaries: ~2-3 layers of bf16 bytes).
  assert r["increase"] <= r["quantized"] + 4 * r["layer_bf16"], mb
  assert r["quantized"] + 4 * r["layer_bf16"] < 0.5 * r["model_bf16"], mb  # the bound can tell them apart
