"""The GPU benchmark scripts run end to end on tiny shapes on the CPU and write the fields the issues ask for.

The numbers themselves only mean something on a GPU; these runs keep the scripts from rotting between GPU
sessions (a broken benchmark costs device time to discover) and check that every kernel they time passed
its float32 check first.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow  # ~24 s each: CI is near its 10-minute limit; run with `pytest -m slow`
def test_bench_kernels_times_tile_gemv_and_xla_paths_after_checking_them(tmp_path, monkeypatch):
  from experiments import bench_kernels
  monkeypatch.setattr(bench_kernels, "GEMV_CANDIDATES", bench_kernels.GEMV_CANDIDATES[:1])  # interpret mode is slow
  out = tmp_path / "kernels.jsonl"
  # 8 rows: the tile kernel's default forward, every gemv candidate (<= 16 rows) and the XLA path.
  bench_kernels.main(["--interpret", "--models", "tiny", "--layers", "down", "--rows", "8",
                      "--gemv", "--xla", "--trace", "--out", str(out)])
  records = _lines(out)
  engines = {(r["direction"], r["config"].get("engine", "tensorcore")) for r in records}
  assert {("fwd", "tensorcore"), ("fwd", "gemv"), ("fwd", "xla"), ("bwd", "tensorcore"), ("bwd", "xla")} <= engines
  for r in records:
    for field in ("shape", "rows", "k", "n", "direction", "us", "bf16_us", "roofline_frac", "implementation",
                  "commit", "device"):
      assert field in r, field
    assert r["shape"] == "qwen2.5-tiny.down" and (r["k"], r["n"]) == (96, 64)
    assert r["kernel_tuning"] == (os.environ.get("QERL_KERNEL_TUNING") or "shipped")
    assert r["xla_dequant"] == "xla"  # the XLA path's dequantization on the CPU
    if r["implementation"] in ("pallas", "xla"):
      assert r["check_rel_err"] < 1e-2
  # The XLA path's records time the shipped path and count its launches (on the CPU no Triton GEMM is emitted).
  xla = [r for r in records if r["implementation"] == "xla"]
  assert sorted(r["direction"] for r in xla) == ["bwd", "fwd"]
  assert all(r["launches"] >= 1 and r["fused_gemm"] is False for r in xla)


@pytest.mark.slow  # ~40 s in interpret mode, as the other bench_kernels runs
def test_bench_kernels_times_the_group_launch_of_a_fused_layer(tmp_path, capsys):
  # --group: q|k|v as one launch over its three projections' arrays, checked against the float32 reference of
  # the fused weight before it is timed; layers that are not fused get no group record.
  from experiments import bench_kernels
  out = tmp_path / "kernels.jsonl"
  bench_kernels.main(["--interpret", "--models", "tiny", "--layers", "qkv,o", "--rows", "1", "--directions", "fwd",
                      "--group", "--out", str(out)])
  records = _lines(out)
  groups = [r for r in records if r["implementation"] == "group"]
  assert [(r["shape"], r["group"]) for r in groups] == [("qwen2.5-tiny.qkv", [32, 16, 16])]
  assert groups[0]["check_rel_err"] < 1e-2 and groups[0]["n"] == 64
  assert {r["shape"] for r in records if r["implementation"] == "pallas"} == {"qwen2.5-tiny.qkv", "qwen2.5-tiny.o"}
  assert "group gemv" in capsys.readouterr().out


def test_bench_kernels_xla_only_times_the_xla_path_against_the_bf16_dot_and_no_kernel(tmp_path, capsys):
  # --xla-only: the training rows' path and its bf16 peer in both directions, checked first; no tile kernel
  # is compiled or timed, and options that time kernels are refused before any work.
  from experiments import bench_kernels
  out = tmp_path / "kernels.jsonl"
  bench_kernels.main(["--interpret", "--models", "tiny", "--layers", "down,o", "--rows", "40", "--xla-only",
                      "--out", str(out)])
  records = _lines(out)
  assert sorted((r["shape"], r["direction"]) for r in records) == [
      ("qwen2.5-tiny.down", "bwd"), ("qwen2.5-tiny.down", "fwd"), ("qwen2.5-tiny.o", "bwd"), ("qwen2.5-tiny.o", "fwd")]
  for r in records:
    assert r["implementation"] == "xla" and r["config"]["engine"] == "xla" and r["rows"] == 40
    assert r["check_rel_err"] < 1e-2 and r["us"] > 0 and r["bf16_us"] > 0
    # us and bf16_us are stored rounded to 0.01 and speedup to 0.001: the bound those roundings allow
    rounding = r["speedup"] * (0.005 / r["us"] + 0.005 / r["bf16_us"]) + 5e-4
    assert r["speedup"] == pytest.approx(r["bf16_us"] / r["us"], abs=rounding)
  with pytest.raises(SystemExit):
    bench_kernels.main(["--interpret", "--models", "tiny", "--xla-only", "--sweep", "--out", "/dev/null"])
  assert "--xla-only times no kernel" in capsys.readouterr().err


def test_bench_kernels_times_shapes_given_as_k_by_n_and_refuses_malformed_ones(tmp_path, capsys):
  # --shapes: weights outside the Qwen table (e.g. a column count that fills one round of programs), named "KxN".
  from experiments import bench_kernels
  out = tmp_path / "kernels.jsonl"
  bench_kernels.main(["--interpret", "--shapes", "96x48,160x32", "--rows", "24", "--directions", "fwd",
                      "--xla-only", "--out", str(out)])
  records = _lines(out)
  assert [(r["shape"], r["k"], r["n"], r["rows"]) for r in records] == [("96x48", 96, 48, 24), ("160x32", 160, 32, 24)]
  assert all(r["check_rel_err"] < 1e-2 and r["bf16_us"] > 0 for r in records)
  for bad, message in (("96x", "expected KxN"), ("100x64", "K=100 must be a multiple of 16"), ("0x64", "expected KxN")):
    with pytest.raises(SystemExit):
      bench_kernels.main(["--interpret", "--shapes", bad, "--xla-only", "--out", "/dev/null"])
    assert message in capsys.readouterr().err
  with pytest.raises(SystemExit):
    bench_kernels.main(["--interpret", "--shapes", "96x48", "--group", "--out", "/dev/null"])
  assert "does not combine with --shapes" in capsys.readouterr().err


def test_bench_kernels_layers_name_the_models_launches_and_refuse_unknown_names(capsys):
  import argparse  # pylint: disable=import-outside-toplevel
  from experiments import bench_kernels
  parser = argparse.ArgumentParser()
  assert bench_kernels.layer_names("launches", parser) == ("q", "kv", "o", "gate", "down")
  assert bench_kernels.layer_names("down,qkv", parser) == ("down", "qkv")
  # The model's launches are its seven projections: q, k, v, o, gate, up, down (k, v and gate, up share a shape).
  shapes = bench_kernels.MODELS["7b"]
  assert [shapes[n] for n in bench_kernels.LAUNCHES] == [(3584, 3584), (3584, 512), (3584, 3584), (3584, 18944),
                                                          (18944, 3584)]
  with pytest.raises(SystemExit):
    bench_kernels.main(["--interpret", "--models", "tiny", "--layers", "gate_up,mlp", "--out", "/dev/null"])
  assert "unknown --layers ['mlp']" in capsys.readouterr().err


@pytest.mark.slow  # ~40 s: Mosaic GPU's interpreter simulates threads; the kernel's own tests run in CI
def test_bench_kernels_times_the_mosaic_kernel_after_checking_it(tmp_path, monkeypatch):
  from experiments import bench_kernels
  # K = 256 and N = 64: the Mosaic GPU kernel's smallest shape (the "tiny" model's K = 96 does not take it).
  monkeypatch.setitem(bench_kernels.MODELS, "tiny256", {"down": (256, 64)})
  monkeypatch.setattr(bench_kernels, "MOSAIC_CANDIDATES", bench_kernels.MOSAIC_CANDIDATES[:1])
  out = tmp_path / "kernels.jsonl"
  bench_kernels.main(["--interpret", "--models", "tiny256", "--layers", "down", "--rows", "3", "--directions", "fwd",
                      "--mosaic", "--out", str(out)])
  mosaic = [r for r in _lines(out) if r["implementation"] == "mosaic"]
  assert len(mosaic) == 1 and mosaic[0]["config"]["engine"] == "mosaic" and mosaic[0]["config"]["tile_m"] == 8
  assert mosaic[0]["check_rel_err"] < 1e-2 and (mosaic[0]["k"], mosaic[0]["n"], mosaic[0]["rows"]) == (256, 64, 3)


def test_device_time_per_call_comes_from_each_timed_programs_kernels():
  from experiments import bench_kernels
  timing = bench_kernels.Timing
  bw = 4e12
  kernel, bf16, lost = timing(30.0, "jit_bench_7", 40), timing(50.0, "jit_bench_8", 20), timing(9.0, "jit_bench_9", 5)
  recs = [bench_kernels._record("fwd", 256, 128, 1, kernel, bf16, bw),
          bench_kernels._record("fwd", 256, 128, 1, lost, bf16, bw)]
  bench_kernels.add_device_us(recs, {"jit_bench_7": 800.0, "jit_bench_8": 700.0, "jit_other": 5.0}, bw,
                              {"jit_bench_7": "regs:115 occ_pct:25", "jit_bench_8": "regs:90"})
  first, second = recs
  assert first["launch"] == "regs:115 occ_pct:25" and "launch" not in second  # the timed kernel's, not bf16's
  assert (first["us"], first["device_us"], first["bf16_device_us"], first["device_speedup"]) == (30.0, 20.0, 35.0, 1.75)
  assert first["device_roofline_frac"] == round(first["roofline_us"] / 20.0, 3) and "_programs" not in first
  assert "device_us" not in second and second["bf16_device_us"] == 35.0  # its program is not in the trace
  assert bench_kernels._rank_us(first) == 20.0 and bench_kernels._rank_us(second) == 9.0
  assert "rounds" not in first  # that launch string names no grid


def test_rounds_of_programs_from_a_launch_record():
  from experiments import bench_kernels
  rounds = bench_kernels.launch_rounds
  # The 2-warp 64-row tile on 7B gate|up (H100, d4f251b): 12.5% of 64 warps is 8 warps, 4 programs of 2 per SM.
  assert rounds("regs:236 dynamic_shared:41984 grid:592,1,1 block:64,1,1 occ_pct:12.5", 132) == round(592 / 528, 3)
  # XLA's GEMM: a 2-D grid of 132 programs of 12 warps, one per SM at 18.75%.
  assert rounds("regs:168 grid:2,66,1 block:384,1,1 occ_pct:18.75", 132) == 1.0
  assert rounds("grid:3,5,7 block:96,1,1 occ_pct:50", 10) == round(105 / (32 // 3 * 10), 3)
  assert rounds("regs:90", 132) is None and rounds("grid:4,1,1 block:64,1,1 occ_pct:0", 132) is None
  recs = [bench_kernels._record("fwd", 256, 128, 64, bench_kernels.Timing(30.0, "jit_bench_1", 10), None, 4e12)]
  bench_kernels.add_device_us(recs, {"jit_bench_1": 300.0}, 4e12, {"jit_bench_1": "grid:1056,1,1 block:64,1,1 "
                                                                                  "occ_pct:12.5"}, num_sms=132)
  assert recs[0]["rounds"] == 2.0 and recs[0]["device_us"] == 30.0


def test_launch_resources_name_registers_and_shared_memory():
  # profile_decode prints them beside the rounds: a pipelined gemv's stages show as shared memory.
  from experiments.profile_decode import launch_resources
  launch = "regs:85 static_shared:0 dynamic_shared:17408 grid:2400,1,1 block:128,1,1"
  assert launch_resources(launch) == "85 regs 17.0 KB"
  assert launch_resources("regs:40 static_shared:8320 dynamic_shared:0 grid:8,1,1") == "40 regs 8.1 KB"
  assert launch_resources("grid:1,1,1 dynamic_shared:2048") == "2.0 KB"
  assert launch_resources("grid:1,1,1 block:1,1,1") == "" and launch_resources("regs:x") == ""


def test_tuning_entries_let_only_candidates_timed_on_every_shape_win():
  from experiments import bench_kernels

  def rec(shape, rows, block_n, us):
    return dict(shape=shape, direction="fwd", rows=rows, us=us,
                candidate=dict(block_m=64, block_n=block_n, block_k=128, split=1, num_warps=4))

  swept = [rec("a", 64, 64, 10.0), rec("b", 64, 64, 30.0), rec("a", 64, 128, 12.0), rec("b", 64, 128, 20.0),
           rec("a", 64, 256, 9.0)]  # 256 failed on b: its one term (1.0) must not beat 128 (12/9 + 20/20)
  (entry,) = bench_kernels.tuning_entries(swept)
  assert (entry["max_rows"], entry["config"]["block_n"], entry["score"]) == (64, 128, 2.333)


@pytest.mark.slow  # ~24 s each: CI is near its 10-minute limit; run with `pytest -m slow`
def test_bench_layer_slicing_counts_the_slices_of_each_form(tmp_path):
  from experiments import bench_layer_slicing
  out = tmp_path / "slicing.jsonl"
  records = bench_layer_slicing.main(["--layers", "2", "--k", "64", "--n", "128", "--rows", "1", "--passes", "1",
                                      "--out", str(out)])
  forms = {(r["format"], r["form"]): r for r in records}
  assert set(forms) == {("bf16", "scan"), ("bf16", "list"), ("nvfp4", "scan"), ("nvfp4", "list"),
                        ("nvfp4", "in_place")}
  assert forms[("bf16", "scan")]["hlo"]["dynamic_slice"] > 0  # the scan slices its stacked weights
  assert forms[("bf16", "list")]["hlo"]["dynamic_slice"] == 0
  assert len(_lines(out)) == 5


def _run(script, tmp_path, name, *flags):
  out = tmp_path / f"{name}.jsonl"
  subprocess.run([sys.executable, os.path.join(ROOT, "experiments", script), "--smoke", "--out", str(out), *flags],
                 check=True, cwd=ROOT, env=dict(os.environ, QERL_COMMIT="test"), capture_output=True, text=True)
  return _lines(out)


# The two subprocess smoke runs take ~55 s together: run by hand (`pytest -m slow tests/test_benchmarks.py`).
@pytest.mark.slow
def test_bench_rollout_smoke_writes_one_line_per_quant(tmp_path):
  records = _run("bench_rollout.py", tmp_path, "rollout")
  assert sorted(r["quant"] for r in records) == ["bf16", "nvfp4"]
  for r in records:
    for field in ("model", "quant", "batch", "new_tokens", "tokens_per_s", "peak_gb", "commit", "device"):
      assert field in r, field
    assert r["commit"] == "test" and r["tokens_per_s"] > 0 and r["batch"] == 2
    assert r["kernel_tuning"] == os.environ.get("QERL_KERNEL_TUNING", "shipped")
    assert r["xla_dequant"] == "xla"  # the CPU's, whatever a tuning file says


def test_bench_rollout_transformers_peer_runs(tmp_path):
  # The hf-bf16 peer (transformers' generate on the same shape) on the CPU, so a GPU run does not find it broken.
  out = tmp_path / "hf.jsonl"
  subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "bench_rollout.py"), "--smoke", "--quants",
                  "hf-bf16", "--out", str(out)],
                 check=True, cwd=ROOT, env=dict(os.environ, QERL_COMMIT="test"), capture_output=True, text=True)
  (r,) = _lines(out)
  assert (r["quant"], r["batch"], r["new_tokens"], r["commit"], r["device"]) == ("hf-bf16", 2, 8, "test", "cpu")
  assert r["tokens_per_s"] > 0 and r["transformers"]


@pytest.mark.parametrize("script", ["bench_rollout.py", "bench_grpo_step.py"])
@pytest.mark.parametrize("flag", ["--model", "--quant"])
def test_benches_refuse_the_subprocess_flags(script, flag, tmp_path):
  # A mistyped --model once ran the default 7B instead of the 32B asked for (a GPU call spent on the wrong model).
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", script), flag, "qwen2.5-32b",
                         "--out", str(tmp_path / "r.jsonl")], cwd=ROOT, capture_output=True, text=True)
  assert proc.returncode == 2 and "use --models and --quants" in proc.stderr
  assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.slow
def test_bench_grpo_step_smoke_writes_the_phase_split(tmp_path):
  # With the rollout's adapters cast to bf16 (ModelConfig.rollout_lora_dtype) and no remat, which the record names.
  records = _run("bench_grpo_step.py", tmp_path, "grpo", "--rollout-lora-dtype", "bfloat16", "--no-remat")
  assert sorted(r["quant"] for r in records) == ["bf16", "nvfp4"]
  for r in records:
    for field in ("model", "quant", "devices", "step_s", "rollout_s", "logprob_s", "update_s", "peak_gb",
                  "commit", "device", "loss", "plan_gb"):
      assert field in r, field
    assert r["step_s"] >= r["rollout_s"] > 0 and r["commit"] == "test"
    assert r["rollout_lora_dtype"] == "bfloat16" and r["fused_lora"] is True and r["remat"] is False
    assert r["train_attention"] == "auto" and r["train_attention_impl"] == "xla"  # the CPU's
    assert r["rollout_merged_launches"] == ("qkv,gate_up" if r["quant"] == "nvfp4" else "")  # the default
    assert r["kernel_tuning"] == (os.environ.get("QERL_KERNEL_TUNING") or "shipped")
    assert r["xla_min_rows"] is None  # no kernels on the CPU: the planner's crossover, as the record replays it
    assert r["xla_dequant"] == "xla"
    peaks = r["phase_peak_gb"]  # the peak after each phase of the first step, in order: it only grows
    assert list(peaks) == ["rollout", "logprob", "update"]
    assert peaks["rollout"] <= peaks["logprob"] <= peaks["update"] <= r["peak_gb"]


def test_records_name_the_kernel_tuning_they_ran_with(monkeypatch):
  # An A/B of a tuning variant (QERL_KERNEL_TUNING) is told apart from the shipped arm by this field.
  from experiments import provenance
  monkeypatch.delenv("QERL_KERNEL_TUNING", raising=False)
  assert provenance.kernel_tuning() == "shipped"
  monkeypatch.setenv("QERL_KERNEL_TUNING", "")
  assert provenance.kernel_tuning() == "shipped"
  monkeypatch.setenv("QERL_KERNEL_TUNING", "/tmp/pallas_dequant.json")
  assert provenance.kernel_tuning() == "/tmp/pallas_dequant.json"


def test_profile_decode_sums_stream_kernels_only(tmp_path):
  # The parser counts kernels on the GPU's stream lines, not the "XLA Ops" line that repeats them, nor host
  # events (the end-to-end run below is slow-marked: on the CPU its traces hold no GPU kernels).
  import gzip
  from experiments import profile_decode
  run = tmp_path / "plugins" / "profile" / "run"
  run.mkdir(parents=True)
  events = [
    {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
    {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
    {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
    {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}},
    {"ph": "X", "pid": 1, "tid": 7, "ts": 10.0, "dur": 5.0, "name": "nvfp4_gemv",
     "args": {"hlo_op": "custom-call.3", "kernel_details": "regs:56 grid:1184,1,1 occ_pct:56.25"}},
    {"ph": "X", "pid": 1, "tid": 7, "ts": 20.0, "dur": 3.0, "name": "nvfp4_gemv", "args": {"hlo_op": "custom-call.9"}},
    {"ph": "X", "pid": 1, "tid": 7, "ts": 30.0, "dur": 2.0, "name": "loop_add_fusion",
     "args": {"hlo_op": "add.1", "kernel_details": "regs:16 grid:4,1,1"}},
    {"ph": "X", "pid": 1, "tid": 8, "ts": 10.0, "dur": 5.0, "name": "custom-call.3",
     "args": {"long_name": "custom-call.3 = bf16[1,512] custom-call(...), "
                           "custom_call_target=\"__gpu$xla.gpu.triton\""}},
    {"ph": "X", "pid": 2, "tid": 9, "ts": 0.0, "dur": 99.0, "name": "PjitFunction", "args": {"hlo_module": "x"}},
  ]
  for e, module in zip(events[4:7], ("jit_decode", "jit_decode", "jit_step")):
    e["args"]["hlo_module"] = module
  with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  totals, busy, span, details = profile_decode.kernel_totals(str(tmp_path))
  assert totals == {"nvfp4_gemv": 8.0, "loop_add_fusion": 2.0}
  assert busy == {"Stream #13(Compute)": 10.0, "XLA Ops": 5.0} and span == 22.0
  # Each kernel's first event says which HLO op it ran; the op's HLO text comes from the "XLA Ops" line.
  gemv = details["nvfp4_gemv"]
  assert gemv["hlo_op"] == "custom-call.3" and "gpu.triton" in gemv["long_name"] and gemv["calls"] == 2
  assert details["loop_add_fusion"] == {"hlo_op": "add.1", "hlo_module": "jit_step",
                                        "kernel_details": "regs:16 grid:4,1,1",
                                        "calls": 1}
  # Per program (bench_kernels --trace): stream kernels only, by the module each ran in.
  assert profile_decode.module_kernel_us(str(tmp_path)) == {"jit_decode": 8.0, "jit_step": 2.0}
  # And the launch of each module's longest kernel (registers, grid, occupancy as the GPU compiled it).
  assert profile_decode.module_launches(str(tmp_path)) == {"jit_decode": "regs:56 grid:1184,1,1 occ_pct:56.25",
                                                           "jit_step": "regs:16 grid:4,1,1"}


def test_profile_decode_finds_a_kernels_fused_computation():
  # A trace names a kernel "input_reduce_fusion_113" where the HLO says "input_reduce_fusion.113".
  import re
  import jax
  import jax.numpy as jnp
  from experiments import profile_decode
  hlo = jax.jit(lambda x: jnp.exp(x * 3.0) + 1.0).lower(jnp.ones((8, 128))).compile().as_text()
  name = re.search(r"%([\w.]+) = \S+ fusion\(", hlo).group(1)  # e.g. "add_exponential_fusion" on the CPU
  numbered = hlo.replace(f"%{name} =", f"%{name}.113 =")
  shown = profile_decode.fused_computation(numbered, f"{name}_113")
  assert shown.startswith(f"{name}.113 = ") and "calls=" in shown.splitlines()[0]
  assert "exponential(" in shown and "ROOT" in shown  # the called computation's body
  assert profile_decode.fused_computation(hlo, "no_such_fusion_9") == "no_such_fusion_9: not in the compiled HLO"


@pytest.mark.parametrize("layers", ["unrolled", "scan"])
def test_profile_decode_program_copies_no_cache_into_its_loop(layers):
  # The profiled decode steps take their KV cache donated, as a rollout's loop holds its own: passed in and not
  # donated it was copied into the loop on every call, one copy per buffer, which the profiles then counted as
  # decode-step time (memcpy128, 144 us per 7B step at batch 64) that no rollout spends. Made inside the program,
  # its zeros are written on every call instead. The donated cache comes back with the steps written.
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from experiments.profile_decode import decode_program, model_config, synthetic_base
  from qerl_jax.model import Transformer, init_cache
  from qerl_jax.rollout.sampling import SamplingParams
  config = model_config("smoke").replace(decode_layers=layers)
  model = Transformer(config, synthetic_base(config, "bf16"), rngs=nnx.Rngs(0))
  batch, slots, start = 3, 40, 8
  cache = init_cache(config, batch, slots, per_layer=layers == "unrolled")
  args = (jnp.int32(start), jnp.ones((batch, slots), bool), jax.random.key(0), jnp.zeros((2,)))
  decode = decode_program(SamplingParams(temperature=1.0))
  hlo = decode.lower(nnx.split(model), jnp.zeros((batch,), jnp.int32), cache, *args).compile().as_text()
  shapes = {"[" + ",".join(map(str, a.shape)) + "]{" for a in jax.tree.leaves(cache)}  # as the HLO text writes them
  copies = [line.strip() for line in hlo.splitlines() if " copy(" in line and any(s in line for s in shapes)]
  assert shapes and not copies, copies[:4]
  tokens, out = decode(nnx.split(model), jnp.zeros((batch,), jnp.int32), cache, *args)
  assert all(a.is_deleted() for a in jax.tree.leaves(cache))  # donated
  written = np.abs(np.asarray(out["k"][0], np.float32)).sum(axis=(0, 2, 3)) > 0  # layer 0's slots: [B, S, Hkv, Dh]
  assert tokens.shape == (batch,) and written.tolist() == [start <= s < start + 2 for s in range(slots)]


@pytest.mark.slow
def test_profile_decode_runs_every_variant(tmp_path):
  out = tmp_path / "profile.json"
  subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "profile_decode.py"), "--model", "smoke",
                  "--quants", "bf16", "nvfp4", "--batches", "2", "--decode-layers", "unrolled", "scan",
                  "--lora-epilogue", "xla", "fused", "gemv-xa", "fused+gemv-xa", "--cache-len", "48", "--start", "32",
                  "--steps", "2", "--reps", "1", "--out", str(out)],
                 check=True, cwd=ROOT, env=dict(os.environ, QERL_COMMIT="test"), capture_output=True, text=True)
  records = json.loads(out.read_text())
  lora = lambda r: (r["fused_lora"], r["gemv_lora_xa"])  # noqa: E731
  hows = [(False, False), (True, False), (False, True), (True, True)]
  assert sorted((r["quant"], r["decode_layers"], lora(r)) for r in records) == sorted([
    ("bf16", "unrolled", (False, False)), ("bf16", "scan", (False, False)),
    *[("nvfp4", layers, how) for layers in ("unrolled", "scan") for how in hows]])
  from experiments.profile_decode import lora_label
  assert {lora_label(r) for r in records} == {"xla", "fused", "gemv-xa", "fused+gemv-xa"}
  # (bf16 has no kernel to fuse into)
  assert all(r["ms_per_step"] > 0 and r["commit"] == "test" for r in records)


def test_profile_decode_tunings_reach_the_kernel_configs(tmp_path, monkeypatch):
  # --tunings: each file is what the next trace's kernel configs read (QERL_KERNEL_TUNING), "" the shipped one.
  from experiments import profile_decode
  from qerl_kernels import config as config_lib
  monkeypatch.delenv("QERL_KERNEL_TUNING", raising=False)
  shipped = config_lib.get_config("fwd", 1, 3584, 18944, "NVIDIA H200")
  data = json.loads(open(config_lib._device_file("NVIDIA H200")).read())  # pylint: disable=protected-access
  entry = next(e for e in data["entries"] if e["direction"] == "fwd" and e["max_rows"] == 1 and "shapes" not in e)
  entry["config"]["programs_per_sm"] = 2 * entry["config"]["programs_per_sm"]
  variant = tmp_path / "variant.json"
  variant.write_text(json.dumps(data))
  profile_decode.use_tuning(str(variant))
  doubled = config_lib.get_config("fwd", 1, 3584, 18944, "NVIDIA H200")
  assert doubled.programs_per_sm == 2 * shipped.programs_per_sm and doubled.split > shipped.split
  profile_decode.use_tuning("")
  assert "QERL_KERNEL_TUNING" not in os.environ
  assert config_lib.get_config("fwd", 1, 3584, 18944, "NVIDIA H200") == shipped


def test_profile_decode_tunings_default_to_the_variable_and_bad_files_fail_first(tmp_path, monkeypatch, capsys):
  # Without --tunings a QERL_KERNEL_TUNING already set is the one timed (it used to be dropped for the shipped
  # file); a missing or malformed file stops the command at its arguments, naming the file, and leaves the
  # variable as it was.
  from experiments import profile_decode
  from qerl_kernels import config as config_lib
  data = json.loads(open(config_lib._device_file("NVIDIA H200")).read())  # pylint: disable=protected-access
  good, bad = tmp_path / "good.json", tmp_path / "bad.json"
  good.write_text(json.dumps(data))
  data["entries"][0]["config"]["block_q"] = 64
  bad.write_text(json.dumps(data))
  monkeypatch.setenv("QERL_KERNEL_TUNING", str(good))
  assert profile_decode.checked_tunings(None) == [str(good)]
  assert profile_decode.checked_tunings(["", str(good)]) == ["", str(good)]
  monkeypatch.delenv("QERL_KERNEL_TUNING")
  assert profile_decode.checked_tunings(None) == [""]
  for path, says in ((tmp_path / "missing.json", "does not exist"), (bad, "unknown config fields ['block_q']")):
    monkeypatch.setenv("QERL_KERNEL_TUNING", str(good))
    monkeypatch.setattr(sys, "argv", ["profile_decode.py", "--model", "smoke", "--tunings", "", str(path),
                                      "--out", str(tmp_path / "never.json")])
    with pytest.raises(SystemExit) as exit_info:
      profile_decode.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and str(path) in err and says in err, err
    assert os.environ["QERL_KERNEL_TUNING"] == str(good) and not (tmp_path / "never.json").exists()


@pytest.mark.slow
def test_profile_decode_runs_merged_launch_variants_on_the_same_weights(tmp_path):
  # --merged-launches none auto: both in one process (the group launch A/B); bf16 has nothing to merge.
  out = tmp_path / "profile.json"
  subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "profile_decode.py"), "--model", "smoke",
                  "--quants", "bf16", "nvfp4", "--batches", "1", "--merged-launches", "none", "auto",
                  "--cache-len", "48", "--start", "32", "--steps", "2", "--reps", "1", "--out", str(out)],
                 check=True, cwd=ROOT, env=dict(os.environ, QERL_COMMIT="test"), capture_output=True, text=True)
  records = json.loads(out.read_text())
  assert sorted((r["quant"], r["rollout_merged_launches"]) for r in records) == [
    ("bf16", ""), ("nvfp4", ""), ("nvfp4", "qkv,gate_up")]


def test_kernel_sass_lowers_the_tuned_kernel_and_reads_its_loop():
  # The GPU-free half of experiments/kernel_sass.py: jax's Triton IR for the kernel the H200 dispatch would
  # launch, cleaned for Triton's parser; and the K-loop instruction mix read from SASS text.
  from experiments import kernel_sass
  from qerl_kernels import config as config_lib

  cfg = config_lib.get_config("fwd", 8, 3584, 37888, "NVIDIA H200")
  ir = kernel_sass.triton_ir("fwd", 8, 3584, 37888, cfg)
  assert ir.startswith("module @nvfp4_matmul_fwd") and ir.rstrip().endswith("}")
  assert "#loc" not in ir and "[unknown]" not in ir
  assert ir.count("tt.dot ") == 2 and ir.count("tt.elementwise_inline_asm") == 2  # asm decoder, two planes
  sass = """
        /*0010*/                   MOV R1, c[0x0][0x28] ;
        /*0020*/                   LDG.E.U8 R2, desc[UR4][R4.64] ;
        /*0030*/                   LOP3.LUT R3, R2, 0x7, RZ, 0xc0, !PT ;
        /*0040*/                   HGMMA.64x16x16.F32.BF16 R32, R24, gdesc[UR20], RZ, !UPT ;
        /*0050*/               @P0 BRA 0x20 ;
        /*0060*/                   EXIT ;
        /*0070*/                   BRA 0x70;
  """
  opcodes, classes, length = kernel_sass.loop_mix(sass)
  assert length == 4 and opcodes == {"LDG.E.U8": 1, "LOP3.LUT": 1, "HGMMA.64x16x16.F32.BF16": 1, "BRA": 1}
  assert classes["global load (sync)"] == 1 and classes["tensor core"] == 1 and classes["integer"] == 1
  assert kernel_sass.opcode_counts(sass) == {"MOV": 1, "LDG": 1, "LOP3": 1, "HGMMA": 1, "BRA": 2, "EXIT": 1}


def test_kernel_sass_lowers_the_xla_paths_dequantization():
  # kernel_sass --xla-dequant: the Pallas dequantization's Triton IR, what the GPU-free SASS count compiles. Each
  # program loads its [32, 16, 8] packed bytes and [32, 16] block steps and stores [32, 16, 8] uint32 words once.
  # (Pallas writes a ref through a swap, so the IR also loads the old words; Triton drops that dead load: the
  # 7B SASS has 8 LDG.E.64 + 2 LDG.E.128 per thread, the bytes and steps alone.)
  import re
  from experiments import kernel_sass
  ir = kernel_sass.xla_dequant_ir(256, 64, 32, 16, 4)
  assert ir.startswith("module @nvfp4_dequant") and "tt.func public @nvfp4_dequant(" in ir
  loads = re.findall(r"tt\.load %\w+ : tensor<([^>]*)>", ir)
  assert {"32x16x8x!tt.ptr<i8", "32x16x!tt.ptr<f32"} <= set(loads), loads
  assert re.findall(r"tt\.store %\w+, %\w+ : tensor<([^>]*)>", ir) == ["32x16x8x!tt.ptr<i32"]


def test_kernel_sass_lowers_a_group_with_a_branch_per_member():
  # kernel_sass --group: the q|k|v group's launch, one weight operand triple per member and a branch each.
  from experiments import kernel_sass
  from qerl_kernels import config as config_lib

  cfg = config_lib.get_config("fwd", 1, 3584, 4608, "NVIDIA H200")
  one = kernel_sass.triton_ir("fwd", 1, 3584, 4608, cfg)
  group = kernel_sass.triton_ir("fwd", 1, 3584, 4608, cfg, group=(3584, 512, 512))
  assert group.count("scf.if") >= one.count("scf.if") + 3
  assert group.count("!tt.ptr<i8>") > one.count("!tt.ptr<i8>")  # each member's packed bytes and scales
  with pytest.raises(ValueError, match="widths summing to N=4608"):
    kernel_sass.triton_ir("fwd", 1, 3584, 4608, cfg, group=(3584, 512))


def test_kernel_sass_lowers_only_the_ptx_version_line():
  # Mosaic GPU writes PTX ISA 9.0; the pip Triton's ptxas reads 8.8 (kernel_sass.assemble_ptx lowers the line).
  from experiments import kernel_sass
  ptx = "//\n// Generated\n.version 9.0\n.target sm_90a\n.address_size 64\n\t// .version 9.0 in a comment\n"
  got = kernel_sass.ptx_at_version(ptx, "8.8")
  assert got.splitlines()[2] == ".version 8.8" and got.replace(".version 8.8", ".version 9.0", 1) == ptx
  with pytest.raises(ValueError, match="no .version line"):
    kernel_sass.ptx_at_version(".target sm_90a\n", "8.8")


def test_tuning_variant_changes_one_entry_and_refuses_bad_ones(tmp_path, monkeypatch):
  # experiments.tuning_variant: the H200 file with one entry's fields changed, loadable as QERL_KERNEL_TUNING.
  from experiments import tuning_variant
  from qerl_kernels import config as config_lib
  out = tmp_path / "v.json"
  assert tuning_variant.main(["--entry", "fwd:2", "--set", "dequant=asm_e4m3", "prefetch=0", "num_warps=8",
                              "--out", str(out)]) == 0
  base = json.load(open(config_lib._device_file("NVIDIA H200")))
  got = json.load(open(out))
  changed = [(b, g) for b, g in zip(base["entries"], got["entries"]) if b != g]
  assert len(changed) == 1 and (changed[0][0]["direction"], changed[0][0]["max_rows"]) == ("fwd", 2)
  assert changed[0][1]["config"] == {**changed[0][0]["config"], "dequant": "asm_e4m3", "prefetch": 0, "num_warps": 8}
  with pytest.raises(ValueError, match="no single entry fwd:3"):
    tuning_variant.variant(base, "fwd", 3, {"num_warps": 8})
  # --shapes: a changed copy for those shapes goes before the row count's entries, which stay as they were. The
  # copy starts from the entry that tuned those shapes: the shipped file's one-row entry for 7B down (one_round).
  first = next(i for i, e in enumerate(base["entries"]) if (e["direction"], e["max_rows"]) == ("fwd", 1))
  down_before = config_lib.get_config("fwd", 1, 18944, 3584, "NVIDIA H200")
  assert tuning_variant.main(["--entry", "fwd:1", "--shapes", "18944x3584", "--set", "block_n=64", "num_warps=8",
                              "--out", str(out)]) == 0
  got = json.load(open(out))
  assert got["entries"][:first] == base["entries"][:first] and got["entries"][first + 1:] == base["entries"][first:]
  assert got["entries"][first]["shapes"] == [[18944, 3584]]
  monkeypatch.setenv("QERL_KERNEL_TUNING", str(out))
  down = config_lib.get_config("fwd", 1, 18944, 3584, "NVIDIA H200")
  assert (down.block_n, down.num_warps) == (64, 8)
  def kept(cfg):  # all but the changed fields and those `fit` derives from them
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("block_n", "num_warps", "split", "block_k")}
  assert kept(down) == kept(down_before)  # every other field as it was for down (one_round included)
  assert config_lib.get_config("fwd", 1, 3584, 3584, "NVIDIA H200").block_n == 16
  monkeypatch.delenv("QERL_KERNEL_TUNING")
  # Without --shapes the change reaches every entry of that row count, the shape-restricted ones too.
  assert tuning_variant.main(["--entry", "fwd:1", "--set", "block_n=32", "--out", str(out)]) == 0
  monkeypatch.setenv("QERL_KERNEL_TUNING", str(out))
  assert {config_lib.get_config("fwd", 1, k, n, "NVIDIA H200").block_n
          for k, n in ((18944, 3584), (3584, 4608), (3584, 3584), (3584, 37888))} == {32}
  assert config_lib.get_config("fwd", 1, 18944, 3584, "NVIDIA H200").one_round == down_before.one_round
  monkeypatch.delenv("QERL_KERNEL_TUNING")
  # Shapes tuned by different entries: one copy cannot start from both.
  split_file = tuning_variant.variant(base, "fwd", 1, {"block_n": 64}, [[18944, 3584]])
  with pytest.raises(ValueError, match=r"shapes \[\[18944, 3584\], \[3584, 3584\]\] are tuned by different fwd:1"):
    tuning_variant.variant(split_file, "fwd", 1, {"block_n": 32}, [[18944, 3584], [3584, 3584]])
  # ... so such a change is two variants, the second built on the first (--base): both shapes change, the rest not.
  chained = tmp_path / "chained.json"
  assert tuning_variant.main(["--entry", "fwd:1", "--shapes", "18944x3584", "--set", "pipeline=true", "--out",
                              str(out)]) == 0
  assert tuning_variant.main(["--base", str(out), "--entry", "fwd:1", "--shapes", "3584x37888", "--set",
                              "pipeline=true", "--out", str(chained)]) == 0
  monkeypatch.setenv("QERL_KERNEL_TUNING", str(chained))
  pipelined = {(k, n): config_lib.get_config("fwd", 1, k, n, "NVIDIA H200")
               for k, n in ((18944, 3584), (3584, 37888), (3584, 4608), (3584, 3584))}
  assert {kn for kn, cfg in pipelined.items() if cfg.pipeline} == {(18944, 3584), (3584, 37888)}
  assert pipelined[18944, 3584].one_round and not pipelined[3584, 37888].one_round
  monkeypatch.delenv("QERL_KERNEL_TUNING")
  with pytest.raises(SystemExit):
    tuning_variant.main(["--entry", "fwd:1", "--shapes", "18944by3584", "--set", "block_n=64", "--out", str(out)])
  with pytest.raises(ValueError, match="dequant"):
    tuning_variant.variant(base, "fwd", 2, {"dequant": "nibbles"})


@pytest.mark.parametrize("argv, flag_sets", [
  (["--xla-flag-sets", "--xla_gpu_dot_merger_threshold_mb=0", "--reps", "2"], "--xla_gpu_dot_merger_threshold_mb=0"),
  (["--xla-flag-sets", "--xla_a=1 --xla_b=2"], "--xla_a=1 --xla_b=2"),
  (["--xla-flag-sets=--xla_a=1"], "--xla_a=1"),
  (["--xla-flag-sets", "|--xla_a=1"], "|--xla_a=1"),
  ([], ""),
])
def test_bench_rollout_takes_a_lone_flag_set(argv, flag_sets):
  # A lone set given as "--xla-flag-sets --xla_..." once stopped a GPU call at argparse (3203742).
  from experiments.bench_rollout import parse_args
  args = parse_args(argv)
  assert args.xla_flag_sets == flag_sets
  assert args.reps == (2 if "--reps" in argv else 3)


def test_bench_rollout_merged_launches_reach_the_nvfp4_config_only():
  from experiments.bench_rollout import merged_groups, parse_args
  args = parse_args(["--merged-launches", "qkv,gate_up"])
  assert args.merged_launches == "qkv,gate_up"
  assert merged_groups(args.merged_launches, "nvfp4") == ("qkv", "gate_up")
  assert merged_groups("qkv", "bf16") == ()
  assert merged_groups("", "nvfp4") == ()


def test_probe_gemv_loads_checks_every_probe_reads_every_byte(tmp_path, monkeypatch):
  from experiments import probe_gemv_loads
  out = tmp_path / "probe.json"
  records = probe_gemv_loads.main(["--shapes", "tiny", "--copies", "2", "--passes", "1", "--reps", "1",
                                   "--interpret", "--out", str(out)])
  assert {r["op"] for r in records} == {*probe_gemv_loads.PROBES, "xla_sum", "bf16_dot", "gemv"}
  assert [r["op"] for r in json.loads(out.read_text())] == [r["op"] for r in records]
  for r in records:
    assert r["shape"] == "tiny" and {"device_us", "mb", "tbps", "commit", "device"} <= set(r)
  # A probe whose sums miss one program fails the byte-sum check before anything is timed.
  real = probe_gemv_loads.probe
  monkeypatch.setattr(probe_gemv_loads, "probe", lambda name, packed, *a, **kw: real(name, packed, *a, **kw)[:-1])
  with pytest.raises(AssertionError, match="skipped or re-read"):
    probe_gemv_loads.check_probes(probe_gemv_loads._weights(512, 64, 1)[0], interpret=True)


def test_ncu_gemv_harness_runs_both_kernels(capsys):
  from experiments import ncu_gemv
  ncu_gemv.main(["--shape", "tiny", "--interpret"])
  assert "tiny: y (1, 64) bfloat16" in capsys.readouterr().out


@pytest.mark.slow  # a GPU profiling harness (~18 s of CI's budget); test_decode_attention tests the kernel
def test_ncu_attention_harness_checks_the_kernel_against_the_models_attention(capsys):
  # 7B's heads over the 1280-slot cache, the token's own k and v written at the first and the last slot. At the
  # first slot the token sees only itself, so the output is its v exactly; at the last, the launch is within bf16
  # rounding of the model's float32 attention (the probabilities are rounded to bf16 before the product with v,
  # and the splits sum in another order).
  from experiments import ncu_attention
  errs = ncu_attention.main(["--interpret", "--batches", "2", "--visible", "0", "1279"])
  assert errs[0] == 0.0 and 1e-5 < errs[1] < 1e-2, errs
  assert "batch 2, slot 1279: out (2, 3584) bfloat16" in capsys.readouterr().out


@pytest.mark.slow  # ~35 s on 2 cores (the small model's interpret-mode kernels); run with `pytest -m slow`
def test_check_decode_kernels_finds_the_kernels_equal_to_their_references(tmp_path):
  # The GPU check's CPU run (interpret mode, small shapes): each kernel equals its reference bit for bit here,
  # and the small model's decode step traced every kernel (2 residual adds and norms, 1 SwiGLU, 1 q|k|v per layer
  # and step: 2 layers, 4 steps).
  out = tmp_path / "check.json"
  subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "check_decode_kernels.py"), "--seed", "3",
                  "--out", str(out)], check=True, cwd=ROOT, env=dict(os.environ, QERL_COMMIT="test"),
                 capture_output=True, text=True)
  rec = json.loads(out.read_text())
  from qerl_kernels import config as config_lib
  launch = rec["launch"]  # interpret mode: the kernels' defaults, whatever the tuning file says
  assert launch == {name: config_lib.DECODE_KERNELS[name]
                    for name in ("residual_norm", "swiglu", "qkv_rows", "attention")}
  assert {name: r["max_ulps"] for name, r in rec["kernels"].items()} == {
    f"{kernel}_m{m}{part}": 0.0 for m in (1, 2)
    for kernel, parts in (("residual_norm", ("_x", "_h")), ("swiglu", ("",)), ("qkv_rows", ("",))) for part in parts}
  assert rec["model"]["kernels_traced"] == {"residual_add": 16, "pending_norm": 16, "swiglu": 8, "qkv_rows": 8}
  # With the norm fold only the final norm launches (q|k|v and gate|up read the others), with the same logits;
  # the gate|up launch's partials from a pending norm equal the norm launch's then the launch's.
  assert rec["model"]["fold_kernels_traced"] == {"residual_add": 16, "pending_norm": 4, "swiglu": 8, "qkv_rows": 8}
  assert rec["model"]["fold_max_abs_over_max_logit"] == 0.0
  assert sorted(rec["norm_fold"]) == [f"norm_fold_m{m}_{p}" for m in (1, 2) for p in ("xa", "y")]
  assert all(r["frac_differ"] == 0.0 for r in rec["norm_fold"].values()), rec["norm_fold"]
  # decode attention against the model's float32 attention: bf16 probabilities times v, ~1e-3 of the output
  assert sorted(rec["attention"]) == [f"attention_b{b}_{label}" for b in (1, 3)
                                      for label in ("block_per_split", "tuned")]
  assert all(1e-5 < r["max_err_over_max"] < 1e-2 for r in rec["attention"].values()), rec["attention"]
  assert rec["model"]["max_abs_over_max_logit"] < 0.02 and rec["commit"] == "test"


def test_check_tile_decoders_runs_and_compares_each_case(tmp_path, capsys):
  # The GPU check's CPU run: interpret mode decodes both ways with jnp, so the two must be bit-equal here, and
  # each case's error against the float32 product is a real NVFP4 error (~0.0017 relative for Gaussian weights).
  from experiments import check_tile_decoders
  out = tmp_path / "check.json"
  assert check_tile_decoders.main(["--interpret", "--out", str(out)]) == 0
  rec = json.loads(out.read_text())
  assert sorted(rec["cases"]) == ["small bwd 256", "small fwd 64", "small fwd 8"] and rec["all_bit_equal"]
  assert rec["kernel_tuning"] == (os.environ.get("QERL_KERNEL_TUNING") or "shipped")
  assert all(0.001 < c["rel_err_vs_f32"] < 0.003 for c in rec["cases"].values())
  assert "all bit-equal" in capsys.readouterr().out


def test_profile_decode_defaults_to_the_lora_path_rollouts_run():
  # Until 8f7f91c its default was "gemv-xa" (XLA's LoRA dots at 3+ rows) while the model and bench_rollout fuse
  # the epilogue there, so batch-8 profiles timed a step rollouts do not run.
  import dataclasses as dc
  from experiments import profile_decode
  from qerl_jax.model.config import ModelConfig
  args = profile_decode.build_parser().parse_args(["--out", "x.json"])
  defaults = {f.name: f.default for f in dc.fields(ModelConfig)}
  assert args.lora_epilogue == [profile_decode.lora_label(
      {"fused_lora": defaults["fused_lora"], "gemv_lora_xa": defaults["gemv_lora_xa"]})] == ["fused+gemv-xa"]


def test_tuning_variant_sets_a_decode_kernels_launch_fields(tmp_path, monkeypatch):
  # decode:KERNEL changes that kernel's fields in the file's "decode_kernels" and nothing else; the model reads them
  # through qerl_kernels.config.decode_kernel_params (defaults for a kernel or a device the file does not tune).
  from experiments import tuning_variant
  from qerl_kernels import config as config_lib
  out = tmp_path / "v.json"
  assert tuning_variant.main(["--entry", "decode:qkv_rows", "--set", "num_warps=4", "--out", str(out)]) == 0
  base, got = json.load(open(config_lib._device_file("NVIDIA H200"))), json.load(open(out))
  assert got["entries"] == base["entries"]
  assert got["decode_kernels"] == {**base.get("decode_kernels", {}), "qkv_rows": {"num_warps": 4}}
  monkeypatch.setenv("QERL_KERNEL_TUNING", str(out))
  assert config_lib.decode_kernel_params("qkv_rows", "NVIDIA H200") == {"num_warps": 4}
  assert config_lib.decode_kernel_params("attention", "NVIDIA H200") == {  # untouched: the file's own fields
      **config_lib.DECODE_KERNELS["attention"], **base["decode_kernels"].get("attention", {})}
  assert config_lib.decode_kernel_params("qkv_rows", None) == config_lib.DECODE_KERNELS["qkv_rows"]
  with pytest.raises(ValueError, match="unknown decode kernel 'mlp'"):
    config_lib.decode_kernel_params("mlp", "NVIDIA H200")
  # What a kernel runs with (config.decode_launch, which the decode kernels call): a field its caller gives, else
  # the device's tuned one; interpret mode (no GPU to ask) the defaults.
  monkeypatch.setattr(config_lib, "device_kind", lambda: "NVIDIA H200")
  assert config_lib.decode_launch("qkv_rows", False) == {"num_warps": 4}
  assert config_lib.decode_launch("qkv_rows", False, num_warps=None) == {"num_warps": 4}
  assert config_lib.decode_launch("qkv_rows", False, num_warps=2) == {"num_warps": 2}
  assert config_lib.decode_launch("qkv_rows", True) == config_lib.DECODE_KERNELS["qkv_rows"]
  with pytest.raises(ValueError, match=r"decode kernel 'swiglu' takes launch fields \['block_n', 'num_warps'\]"):
    config_lib.decode_launch("swiglu", True, block_d=64)
  with pytest.raises(ValueError, match="field 'block_n' must be a power of two, got 100"):
    tuning_variant.decode_variant(base, "swiglu", {"block_n": 100})
  with pytest.raises(ValueError, match=r"decode kernel 'swiglu' takes fields \['block_n', 'num_warps'\]"):
    tuning_variant.decode_variant(base, "swiglu", {"block_d": 128})
  with pytest.raises(SystemExit):  # --shapes is for matmul entries
    tuning_variant.main(["--entry", "decode:swiglu", "--shapes", "3584x3584", "--set", "block_n=64",
                         "--out", str(out)])
  bad = tmp_path / "bad.json"  # a hand-written file is checked when it is read, naming itself
  bad.write_text(json.dumps({"entries": [], "decode_kernels": {"swiglu": {"block_n": True}}}))
  monkeypatch.setenv("QERL_KERNEL_TUNING", str(bad))
  with pytest.raises(ValueError, match="bad.json.*'block_n' must be a power of two, got True"):
    config_lib.decode_kernel_params("swiglu", "NVIDIA H200")


def test_bench_kernels_l2_warm_reuses_one_weight_and_rotated_runs_do_not(monkeypatch):
  # --l2-warm: the timed loop calls the op on one weight copy 16 times over (its bytes stay in L2 between calls);
  # without it the copies are distinct arrays, more bytes than L2 holds.
  import jax
  import jax.numpy as jnp
  from experiments import bench_kernels
  monkeypatch.setattr(bench_kernels, "_INTERPRET", False)
  monkeypatch.setattr(bench_kernels, "_L2_WARM", True)
  ws, a = bench_kernels._case("fwd", 64, 128, 1, jax.random.key(0), jnp.bfloat16)
  assert len(ws) == 16 and all(w is ws[0] for w in ws) and a.shape == (1, 64)
  monkeypatch.setattr(bench_kernels, "_L2_WARM", False)
  ws, _ = bench_kernels._case("fwd", 64, 128, 1, jax.random.key(0), jnp.bfloat16)
  assert len(ws) == 16 and len({id(w[0]) for w in ws}) == 16
  assert not bool(jnp.array_equal(ws[0][0], ws[1][0]))


def test_profile_decode_output_digest_tells_values_apart():
  # The digest that says an XLA flag left a decode's values alone: equal trees hash equal, one changed bit does not.
  import jax.numpy as jnp
  import numpy as np
  from experiments import profile_decode
  tree = (jnp.arange(5, dtype=jnp.int32), [jnp.ones((2, 3), jnp.bfloat16), jnp.zeros((4,), jnp.float32)])
  same = (np.arange(5, dtype=np.int32), [jnp.ones((2, 3), jnp.bfloat16), jnp.zeros((4,), jnp.float32)])
  assert profile_decode.output_digest(tree) == profile_decode.output_digest(same)
  flipped = (tree[0], [tree[1][0], tree[1][1].at[3].set(jnp.float32(1e-45))])
  assert profile_decode.output_digest(flipped) != profile_decode.output_digest(tree)


@pytest.mark.slow  # needs Triton (pip install -e ".[sass]"); ~40 s: the interpreter, then sm_90 compiles
def test_triton_gemv_probe_matches_numpy_and_pipelines_only_when_asked():
  # The probe's gemv in Triton's CPU interpreter against its float64 NumPy reference (ragged splits and column
  # blocks), then what its PTX loads with: plain loads without the loop's num_stages, cp.async with it (the
  # claim experiments/RESULTS.md's probe section rests on).
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "triton_gemv_probe.py"), "--check-only",
                         "--shapes", "tiny"], cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"),
                        capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-2000:]
  err = float(proc.stdout.split("largest error ")[1].split()[0])
  assert 0 < err < 1e-6 and "over 18 variants" in proc.stdout
  sys.path.insert(0, os.path.join(ROOT, "experiments"))
  import triton_gemv_probe as probe
  rows = probe.ptx_report("7b.o", ["int"])
  assert {r["stages"] for r in rows} == {0, 3, 4}
  for r in rows:
    if r["stages"] == 0:
      assert r["cp_async"] == 0 and r["ld_global"] > 0, r
    else:
      assert r["cp_async"] > 0 and r["ld_global"] == 0 and r["shared"] > 2048, r


@pytest.mark.slow  # needs Triton (pip install -e ".[sass]"); ~30 s: the interpreter, then ten sm_90 compiles
def test_triton_ws_probe_matches_numpy_and_splits_only_when_asked():
  # The probe's tile in Triton's CPU interpreter against the project's dequantization in float64 (1, 8 and 64 rows,
  # outputs poisoned), then what sm_90 gets: TMA loads and the decoded weight as wgmma's register operand in every
  # variant, producer / consumer partitions only where the loop asks (the claim qerl_kernels/NOTES.md rests on).
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "triton_ws_probe.py"), "--check-only",
                         "--shapes", "tiny", "--rows", "1", "8", "64"], cwd=ROOT,
                        env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-2000:]
  errs = [float(line.split("largest error ")[1].split()[0]) for line in proc.stdout.splitlines() if "largest" in line]
  sys.path.insert(0, os.path.join(ROOT, "experiments"))
  import triton_ws_probe as probe
  assert len(errs) == 3 * len(probe.VARIANTS) and all(0 < e <= 1.0 for e in errs), proc.stdout
  rows = probe.sass_report("7b.gate", 64)
  assert len(rows) == len(probe.VARIANTS) and not any("failed" in r for r in rows), rows
  for r in rows:
    assert r["partitions"] == r["ws"] and r["wgmma_register_a"] and r["tma_loads"] > 0, r


def test_bench_dot_forms_checks_both_forms_against_numpy():
  # Both dot forms give bf16 outputs and input gradients within one bf16 rounding of a float32 sum of float64 inputs
  # on fresh inputs (`check_error`; a form that summed in bf16 would not), and every record carries its timings and
  # kernel counts.
  import numpy as np
  from experiments import bench_dot_forms
  records = bench_dot_forms.main(["--smoke"])
  assert [r["form"] for r in records] == ["f32_then_cast", "bf16_dot"]
  for r in records:
    assert r["out_dtype"] == r["dx_dtype"] == "bfloat16", r
    assert 0.05 < r["err_roundings"] <= 1.01 and 0.05 < r["dx_err_roundings"] <= 1.01, r
    assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_kernels"] >= 1 and r["fwd_bwd_kernels"] >= 2, r
  x = np.arange(6, dtype=np.float64).reshape(2, 3) / 7
  w = np.ones((3, 2))
  exact = x @ w
  assert bench_dot_forms.check_error(exact, x, w) == 0.0
  assert bench_dot_forms.check_error(exact * (1 + 2.0 ** -7), x, w) > 1.9  # two roundings' worth


def test_dot_forms_error_bound_passes_float32_sums_and_catches_bf16_sums():
  # Long sums whose outputs nearly cancel: a float32 sum rounded once to bf16 must read <= 1 however small the output,
  # and a running sum kept in bf16 (the fault the check is there for) must read far above it.
  import ml_dtypes
  import numpy as np
  from experiments import bench_dot_forms
  rng = np.random.default_rng()
  bf16 = ml_dtypes.bfloat16
  x = rng.standard_normal((8, 4096)).astype(bf16)
  w = (0.02 * rng.standard_normal((4096, 6))).astype(bf16)
  w[:, 0] = -w[:, 1] * (1 + 2.0 ** -7)  # outputs 0 and 1 cancel to ~1% of their terms' size
  x32, w32 = x.astype(np.float32), w.astype(np.float32)
  y32 = (x32 @ w32).astype(bf16)
  assert bench_dot_forms.check_error(y32, x, w) <= 1.0
  acc = np.zeros((8, 6), bf16)
  for i in range(x.shape[1]):
    acc = (acc.astype(np.float32) + np.outer(x32[:, i], w32[i]).astype(np.float32)).astype(bf16)
  assert bench_dot_forms.check_error(acc, x, w) > 10


def test_dot_forms_kernel_count_sees_tuple_typed_gemms():
  # A cuBLAS GEMM's custom call returns (output, workspace); the count missed those before, so the GPU's bf16 dots
  # read as zero kernels. Lines of a GPU-shaped entry computation; parameters and tuple plumbing are not launches.
  from experiments import bench_dot_forms
  text = """HloModule m

%fused_convert (p: f32[4,8]) -> bf16[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  ROOT %c = bf16[4,8]{1,0} convert(%p)
}

ENTRY %main (a: bf16[4,16], b: bf16[16,8]) -> bf16[4,8] {
  %a = bf16[4,16]{1,0} parameter(0)
  %b = bf16[16,8]{1,0} parameter(1)
  %custom-call.1 = (f32[4,8]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm"
  %get-tuple-element = f32[4,8]{1,0} get-tuple-element(%custom-call.1), index=0
  ROOT %loop_convert_fusion = bf16[4,8]{1,0} fusion(%get-tuple-element), kind=kLoop, calls=%fused_convert
}
"""
  assert bench_dot_forms._kernels(text) == 2
  assert bench_dot_forms._kernels(text.replace("(f32[4,8]{1,0}, s8[4194304]{0})", "f32[4,8]{1,0}")) == 2
  # hlo_launches also says whether a dot is XLA's Triton GEMM fusion (which can take a dequantization in as the
  # operand's producer): the cuBLAS call above is not; the same entry with the GEMM as such a fusion is.
  assert bench_dot_forms.hlo_launches(text) == (2, False)
  triton = text.replace(
      '%custom-call.1 = (f32[4,8]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm"',
      '%gemm_fusion = f32[4,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_convert, '
      'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}').replace(
      "get-tuple-element(%custom-call.1), index=0", "copy(%gemm_fusion)")
  assert bench_dot_forms.hlo_launches(triton) == (2, True)


def test_probe_launch_harness_keeps_every_launch():
  # host_us times `calls` launches over fewer weight copies; XLA merges identical dots (CSE), which once made the bf16
  # peer look 8x cheaper. Each launch now reads its own row of a stacked x: the compiled program keeps all of them,
  # and each launch's output is its own x row's product.
  sys.path.insert(0, os.path.join(ROOT, "experiments"))
  import jax.numpy as jnp
  import numpy as np
  import triton_gemv_probe as probe
  rng = np.random.default_rng()
  x = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
  copies = [(jnp.asarray(rng.standard_normal((8, 32)), jnp.float32),) for _ in range(2)]
  run = probe.host_program(lambda x, w: x @ w.T, 6)
  xs = jnp.stack([x] * 6)
  assert run.lower(xs, copies).compile().as_text().count(" dot(") == 6
  for j, y in enumerate(run(xs, copies)):
    np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ np.asarray(copies[j % 2][0]).T, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~7 s: CI is near its 10-minute limit (567 s at the last landing); `pytest -m slow`
def test_bench_train_attention_checks_each_implementation_before_timing_it():
  # bf16 inputs against attend in float32 on the rows that see something: ~1e-3 of the largest value. cuDNN has no
  # CPU kernel, so its record says why it was not timed.
  from experiments import bench_train_attention
  records = bench_train_attention.main(["--rows", "2", "--seq", "40", "--max-pad", "9", "--query-chunk", "16",
                                        "--reps", "1"])
  by_impl = {r["impl"]: r for r in records}
  assert sorted(by_impl) == ["cudnn", "cudnn-causal", "jax-xla", "model"]
  for name in ("model", "jax-xla"):
    errs = by_impl[name]["error"]
    assert sorted(errs) == ["dk", "dq", "dv", "out"]
    assert all(1e-5 < e < 2e-2 for e in errs.values()), (name, errs)
    assert by_impl[name]["fwd_us"] > 0 and by_impl[name]["fwd_bwd_us"] > 0
  for name in ("cudnn", "cudnn-causal"):
    assert "cuDNN" in by_impl[name]["failed"] and "fwd_us" not in by_impl[name]


def test_bench_xla_dequant_forms_agree_with_the_shipped_dequantization():
  # Every decode the bench times must give the shipped weight bit for bit (it exits otherwise) and a product within
  # one bf16 rounding of float64; the integer decode must agree with the table on all 16 codes, -0.0 included.
  import numpy as np
  from experiments import bench_xla_dequant
  records = bench_xla_dequant.main(["--smoke"])
  assert [r["form"] for r in records] == ["bf16_weight", "table_dequant_only", "table_kn", "table_nk",
                                          "arith_dequant_only", "arith_kn", "arith_nk", "words_dequant_only",
                                          "words_kn", "words_nk", "pallas_dequant_only", "pallas_nk"]
  for r in records:
    assert r["us"] > 0, r
    if r["form"].endswith(("_kn", "_nk")):  # the products (the other records time a weight or a dequantization)
      assert 0.05 < r["err_roundings"] <= 1.01, r
    if r["form"] != "bf16_weight":  # each dequantizing program's launches (no Triton GEMM on the CPU)
      assert r["launches"] >= 1 and r["fused_gemm"] is False, r
  import jax.numpy as jnp
  from qerl_jax.quant import e2m1
  codes = jnp.arange(16, dtype=jnp.uint8)
  got = np.asarray(e2m1.e2m1_decode(codes))
  np.testing.assert_array_equal(got.view(np.uint32), np.asarray(bench_xla_dequant.table_decode(codes)).view(np.uint32))
  np.testing.assert_array_equal(got[:8], [0, 0.5, 1, 1.5, 2, 3, 4, 6])
