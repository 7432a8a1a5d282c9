"""One bundle layout, many device layouts: the same frames on 1 device, 8 devices, and 2 processes x 4.

Fake devices come from XLA_FLAGS=--xla_force_host_platform_device_count=N in subprocesses;
the two processes join over loopback with jax.distributed (gloo collectives).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from .conftest import ROOT, devices_env, in_parallel, run_cli, run_module, run_processes

FP32_TOL = 1e-5  # max abs difference in frames (values in [0, 1]) between device layouts
GEN = ("--prompt", "a robot dancing in the rain", "--steps", "4", "--seed", "7", "-q")


def _devices(n: int) -> dict[str, str]:
    return devices_env(n)


def _frames(path: Path) -> np.ndarray:
    from safetensors.numpy import load_file

    return load_file(str(path))["frames"]


def test_same_frames_on_1_device_8_devices_and_2_processes(fp32_bundles, cpu8_bundle: Path, tmp_path: Path) -> None:
    one, eight = tmp_path / "one.safetensors", tmp_path / "eight.safetensors"
    in_parallel(lambda: run_module("runtime", "generate", str(fp32_bundles["tiny-64x32-f9"]), *GEN, "--out",
                                   str(tmp_path / "one.mp4"), "--frames-out", str(one)),
                lambda: run_module("runtime", "generate", str(cpu8_bundle), *GEN, "--out", str(tmp_path / "eight.mp4"),
                                   "--frames-out", str(eight), env=_devices(8)))

    two = tmp_path / "two.safetensors"
    run_processes(["generate", str(cpu8_bundle), *GEN, "--out", str(tmp_path / "two.mp4"), "--frames-out", str(two)])

    a, b, c = _frames(one), _frames(eight), _frames(two)
    assert a.shape == b.shape == c.shape == (1, 9, 32, 64, 3)
    assert np.abs(a - b).max() <= FP32_TOL
    assert np.abs(b - c).max() <= FP32_TOL
    assert (tmp_path / "two.mp4").is_file()


def test_cond_and_magcache_programs_on_8_devices(fp32_bundles, cpu8_bundle: Path, tmp_path: Path) -> None:
    """The cond-only program (batch 1 cannot split over dp=2: dp joins sp on the tokens) and MagCache's
    full and cached steps (the residual stays sharded between steps) give 1 device's frames on 8."""
    import json

    from safetensors.numpy import load_file

    layout = json.loads((cpu8_bundle / "manifest.json").read_text())["programs"]
    # one kv for both: the cond-only program takes the CFG program's keys and values and uses the first half
    assert layout["denoise_step_cond"]["inputs"]["kv"] == layout["denoise_step"]["inputs"]["kv"]
    ratios = tmp_path / "ratios.json"
    ratios.write_text(json.dumps([1.0] * 4))
    runs = {"g1": ("--guidance", "1"), "mc": ("--magcache", str(ratios), "--magcache-retention", "0.25")}
    out = {}
    for name, flags in runs.items():
        for n, bundle in ((1, fp32_bundles["tiny-64x32-f9"]), (8, cpu8_bundle)):
            path = tmp_path / f"{name}-{n}.safetensors"
            run_module("runtime", "generate", str(bundle), *GEN, *flags, "--out", str(tmp_path / f"{name}-{n}.mp4"),
                       "--frames-out", str(path), env=_devices(n))
            out[name, n] = load_file(str(path))["frames"]
    for name in runs:
        assert np.abs(out[name, 1] - out[name, 8]).max() <= FP32_TOL, name
    assert np.abs(out["g1", 1] - out["mc", 1]).max() > 1e-3  # different settings, different frames


def test_device_count_mismatch_is_refused(cpu8_bundle: Path, tmp_path: Path) -> None:
    proc = run_module("runtime", "generate", str(cpu8_bundle), *GEN, "--out", str(tmp_path / "v.mp4"), check=False,
                      env=_devices(4))
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: bundle was exported for 8 device(s) (target cpu-8) but 4 are available: "
                                   "run it where 8 are, or re-export; on CPU, "
                                   "XLA_FLAGS=--xla_force_host_platform_device_count=8 makes 8")
    assert not (tmp_path / "v.mp4").exists()


def test_incomplete_multihost_flags_are_refused(cpu8_bundle: Path, tmp_path: Path) -> None:
    proc = run_module("runtime", "generate", str(cpu8_bundle), *GEN, "--out", str(tmp_path / "v.mp4"),
                      "--coordinator", "127.0.0.1:1", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: --coordinator, --num-processes and")


DEVICE0_BYTES = """
import json, sys
import runtime
b = runtime.load(sys.argv[1]).bundle
dev = b.mesh.devices.flat[0]
out = {}
for program, spec in b.manifest.programs.items():
    if spec.weights not in out:
        arrays = b.weights(spec.weights, program).values()
        out[spec.weights] = sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == dev)
print(json.dumps(out))
"""


def test_inspect_weight_bytes_per_device_match_the_placed_shards(cpu8_bundle: Path) -> None:
    import json

    summary = json.loads(run_cli("runtime", "inspect", str(cpu8_bundle), "--json").stdout)
    proc = subprocess.run([sys.executable, "-c", DEVICE0_BYTES, str(cpu8_bundle)], cwd=ROOT, capture_output=True,
                          text=True, env={**__import__("os").environ, **_devices(8), "PYTHONPATH": str(ROOT),
                                          "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    placed = json.loads(proc.stdout.strip().splitlines()[-1])
    per_device = {g: w["bytes_per_device"] for g, w in summary["weights"].items()}
    assert per_device == placed
    assert per_device["transformer"] < summary["weights"]["transformer"]["bytes"]  # tp-sharded on cpu-8


SHARDED_ATTENTION = """
import jax, numpy as np
from export.attention import AttentionConfig, attention
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("dp", "sp", "tp"))
rng = np.random.default_rng(0)
def ref(q, k, v):
    s = np.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v)
worst = 0.0
for sq, sk, cfg in [(36, 36, AttentionConfig()), (36, 36, AttentionConfig(block_q=8, block_kv=5, direct_limit=0)),
                    (37, 11, AttentionConfig()), (30, 7, AttentionConfig(block_q=4, block_kv=3, direct_limit=0))]:
    q = rng.standard_normal((2, 4, sq, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 4, sk, 8)).astype(np.float32) for _ in range(2))
    out = jax.jit(lambda a, b, c: attention(a, b, c, config=cfg, mesh=mesh))(q, k, v)
    worst = max(worst, float(np.abs(np.asarray(out) - ref(q, k, v)).max()))
print(worst)
"""


def test_sharded_attention_matches_reference() -> None:
    """Self-attention (heads over tp, queries over sp) and cross-attention (queries over tp x sp, padded
    when they don't divide) inside shard_map on 8 devices, direct and blocked."""
    proc = subprocess.run([sys.executable, "-c", SHARDED_ATTENTION], cwd=ROOT, capture_output=True, text=True,
                          env={**__import__("os").environ, **_devices(8), "PYTHONPATH": str(ROOT),
                               "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.strip().splitlines()[-1]) < 2e-6
