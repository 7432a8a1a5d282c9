"""Deploying a bundle: verify, inspect, warm the compilation cache, and deterministic generation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .conftest import run_cli, run_module

GEN = ("--prompt", "a lighthouse in a storm", "--steps", "3", "-q")


def test_verify_passes_a_fresh_bundle(fp32_bundles) -> None:
    proc = run_cli("runtime", "verify", str(fp32_bundles["tiny-64x32-f9"]))
    lines = proc.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines[:-1]] == ["ok"] * 7, proc.stdout
    for what in ("manifest:", "shapes: 1 (64x32 x 9 frames (default)), each with its programs",
                 "files: 28 match their sha256", "weights:", "programs: 14 deserialize", "versions:",
                 "devices: 1 x cpu"):
        assert any(what in line for line in lines), (what, proc.stdout)
    assert lines[-1].endswith("is ready to run on this machine")


def test_inspect_summarizes_stages_and_weights(fp32_bundles) -> None:
    bundle = fp32_bundles["tiny-64x32-f9"]
    s = json.loads(run_cli("runtime", "inspect", str(bundle), "--json").stdout)
    assert set(s["stages"]) == {"text_encoder", "text_encoder_3", "text_encoder_6", "text_encoder_12", "cross_kv",
                                "cross_kv_t3", "cross_kv_t6", "cross_kv_t12", "denoise_step", "denoise_step_cond",
                                "denoise_step_residual", "denoise_step_cached", "vae_decode_first", "vae_decode_next"}
    step = s["stages"]["denoise_step"]
    assert step["weights"] == "transformer" and step["args"][0] == {"aval": "float32[4,1,16,3,4,8]",
                                                                     "sharding": "{replicated}"}
    layers = json.loads((bundle / "manifest.json").read_text())["source"]["config"]["transformer"]["num_layers"]
    assert step["blocks"]["layers"] == layers  # the block loop; its results are the tail's, the step's
    assert sorted(step["blocks"]["short_prompts"], key=int) == ["3", "6", "12"]  # a block per short prompt length
    assert [r["aval"] for r in step["results"]] == ["float32[4,1,16,3,4,8]", "bool[]"]
    from safetensors import safe_open

    with safe_open(str(bundle / "weights" / "transformer.safetensors"), framework="numpy") as f:
        total = sum(f.get_tensor(k).nbytes for k in f.keys())
    assert s["weights"]["transformer"]["bytes"] == total == s["weights"]["transformer"]["bytes_per_device"]
    assert s["geometry"]["latents"] == [1, 16, 3, 4, 8] and s["defaults"]["steps"] == 50
    text = run_cli("runtime", "inspect", str(bundle)).stdout
    assert "denoise_step" in text and "per device" in text and "jax 0.10.2" in text


def test_warm_fills_the_cache_that_generate_then_uses(fp32_bundles, tmp_path: Path) -> None:
    bundle, cache = str(fp32_bundles["tiny-64x32-f9"]), tmp_path / "cache"
    proc = run_module("runtime", "warm", bundle, "--cache-dir", str(cache))
    assert "compiled 14 programs into" in proc.stdout
    warmed = sorted(p.name for p in cache.iterdir())
    assert len(warmed) >= 4
    run_module("runtime", "generate", bundle, *GEN, "--out", str(tmp_path / "v.mp4"), "--cache-dir", str(cache))
    assert sorted(p.name for p in cache.iterdir()) == warmed  # every program came from the cache
    run_module("runtime", "generate", bundle, *GEN, "--out", str(tmp_path / "w.mp4"), "--no-cache")
    assert sorted(p.name for p in cache.iterdir()) == warmed


def test_unusable_cache_dir_only_warns(fp32_bundles, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    proc = run_module("runtime", "generate", str(fp32_bundles["tiny-64x32-f9"]), *GEN, "--out",
                      str(tmp_path / "v.mp4"), "--cache-dir", str(tmp_path / "file" / "cache"))
    assert "compilation cache disabled" in proc.stderr and (tmp_path / "v.mp4").is_file()


def test_generation_is_deterministic(fp32_bundles, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    bundle = str(fp32_bundles["tiny-64x32-f9"])
    runs = {}
    for name, seed in (("a", "5"), ("b", "5"), ("c", "6")):
        run_module("runtime", "generate", bundle, *GEN, "--seed", seed, "--out", str(tmp_path / f"{name}.mp4"),
                   "--frames-out", str(tmp_path / f"{name}.safetensors"))
        runs[name] = load_file(str(tmp_path / f"{name}.safetensors"))["frames"]
    np.testing.assert_array_equal(runs["a"], runs["b"])  # bit for bit
    assert (tmp_path / "a.mp4").read_bytes() == (tmp_path / "b.mp4").read_bytes()
    assert np.abs(runs["a"] - runs["c"]).max() > 1e-3
