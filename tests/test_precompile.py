"""Executables compiled ahead (issue 72): `python -m export precompile` and the build's `--precompile`.

A precompiled tiny cpu bundle makes, in a fresh process with an empty compilation cache, bit for bit the frames of the
plain bundle and compiles none of the bundle's programs (JAX_LOG_COMPILES' "Finished XLA compilation of jit(call)"
lines: the plain bundle's every program, the precompiled one's none). A bundle whose executables were built for
another key (forged here) compiles, with one log line saying why, and makes the same frames. A changed executable is
named by `runtime verify`, and `generate` stops in one line, exit 2, before running anything. Weights attached after
the precompile, quantized, with a LoRA switched per run, run on the executables. A TPU bundle precompiles on this CPU
with libtpu's compile-only devices; a cuda bundle is refused where its GPUs are not, in one line.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

import runtime
from runtime import manifest as mf

from .conftest import devices_env, in_parallel, run_cli, run_module, run_processes
from .test_lora_switch import make_adapter

PROMPT, SEED, STEPS = "a lighthouse in a storm", 3, 2
COMPILED_PROGRAM = "Finished XLA compilation of jit(call)"  # one line per bundle program compiled (jit of exp.call)
WARNING = "not loading the bundle's executables compiled ahead"


@pytest.fixture(scope="module")
def pair(fp32_bundles: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the plain tiny bundle, a copy of it precompiled by `python -m export precompile`)."""
    plain = fp32_bundles["tiny-64x32-f9"]
    pre = tmp_path_factory.mktemp("precompiled") / "bundle"
    shutil.copytree(plain, pre)
    run_module("export", "precompile", str(pre), "-q")
    return plain, pre


def _forged(bundle: Path, out: Path, **key: str) -> Path:
    """A copy of `bundle` whose executables' keys have these fields changed (its id made anew, as an export would)."""
    shutil.copytree(bundle, out)
    data = json.loads((out / mf.MANIFEST_FILE).read_text())
    for e in data["executables"]:
        e["key"].update(key)
    data["bundle_id"] = mf.content_id(data)
    (out / mf.MANIFEST_FILE).write_text(mf.canonical_json(data))
    return out


def _generate(bundle: Path, out: Path) -> tuple[np.ndarray, str]:
    """`runtime generate` in a fresh process with an empty compilation cache: its float frames and its stderr."""
    from safetensors.numpy import load_file

    proc = run_module("runtime", "generate", str(bundle), "--prompt", PROMPT, "--seed", str(SEED), "--steps",
                      str(STEPS), "--out", str(out / "video.mp4"), "--frames-out", str(out / "frames.safetensors"),
                      env={"JAX_LOG_COMPILES": "1", "WAN_AOT_CACHE_DIR": str(out / "cache")})
    return load_file(str(out / "frames.safetensors"))["frames"], proc.stderr


def test_the_manifest_lists_every_program_and_part(pair: tuple[Path, Path]) -> None:
    _, pre = pair
    m = mf.read(pre)
    assert {(e.program, e.part) for e in m.executables} == {(n, p) for n, s in m.programs.items() for p in s.parts}
    for e in m.executables:
        data = mf.resolve(pre, e.file).read_bytes()
        assert len(data) == e.bytes and mf.sha256_file(mf.resolve(pre, e.file)) == e.sha256
        assert e.key.platform == "cpu" and e.key.cpu and "+" in e.key.features and e.key.devices == 1
    text = run_cli("runtime", "inspect", str(pre)).stdout
    assert f"executables {len(m.executables)} programs compiled ahead" in text
    listed = json.loads(run_cli("runtime", "inspect", str(pre), "--json").stdout)["executables"]
    assert listed["count"] == len(m.executables) and listed["built_for"][0]["features"] == m.executables[0].key.features
    assert "ok    executables:" in run_cli("runtime", "verify", str(pre)).stdout


def test_a_cold_start_loads_them_compiles_no_program_and_makes_the_same_frames(pair: tuple[Path, Path],
                                                                               tmp_path: Path) -> None:
    plain, pre = pair
    (a, plain_log), (b, pre_log) = in_parallel(functools.partial(_generate, plain, tmp_path / "plain"),
                                               functools.partial(_generate, pre, tmp_path / "pre"))
    assert plain_log.count(COMPILED_PROGRAM) >= 7  # text encoder, cross_kv, the step's head/block/tail, the VAE's
    assert pre_log.count(COMPILED_PROGRAM) == 0 and WARNING not in pre_log
    np.testing.assert_array_equal(a, b)


def test_another_key_compiles_with_one_line_saying_why(pair: tuple[Path, Path], tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    _, pre = pair
    forged = _forged(pre, tmp_path / "forged", jax="0.0.1")
    with caplog.at_level(logging.WARNING, logger="runtime"):
        pipe = runtime.load(forged)
        frames = pipe.generate(PROMPT, seed=SEED, steps=STEPS, progress=False)
    said = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(said) == 1 and "it was built for jax '0.0.1', this host has" in said[0], said
    assert not any(k.startswith("load executable") for k in pipe.bundle.timings)
    assert any(k.startswith("compile ") for k in pipe.bundle.timings)
    loaded = runtime.load(pre)
    np.testing.assert_array_equal(loaded.generate(PROMPT, seed=SEED, steps=STEPS, progress=False), frames)
    assert not any(k.startswith("compile ") for k in loaded.bundle.timings)


def test_an_executable_is_xla_bytes_loaded_without_unpickling(pair: tuple[Path, Path],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The file is XLA's serialized executable, not a pickle, and loading it never unpickles anything."""
    import pickle

    _, pre = pair

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("an executable was unpickled")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    first = {mf.resolve(pre, e.file).read_bytes()[:1] for e in mf.read(pre).executables}
    assert b"\x80" not in first  # a pickle's protocol opcode
    pipe = runtime.load(pre)
    pipe.generate(PROMPT, seed=SEED, steps=1, progress=False)
    assert any(k.startswith("load executable") for k in pipe.bundle.timings)
    assert not any(k.startswith("compile ") for k in pipe.bundle.timings)


def test_schema_11_pickled_executables_are_dropped_with_one_line(caplog: pytest.LogCaptureFixture) -> None:
    golden = Path(__file__).resolve().parents[1] / "artifacts" / "golden" / "schema-11" / "bundle"
    assert json.loads((golden / mf.MANIFEST_FILE).read_text())["executables"]  # schema 11 wrote 29 pickles
    mf._said_v11.clear()
    with caplog.at_level(logging.WARNING, logger="runtime"):
        assert mf.read(golden).executables == () and mf.read(golden).executables == ()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "Python pickles, which this runtime never reads" in said[0], said


def test_a_changed_executable_is_refused(pair: tuple[Path, Path], tmp_path: Path) -> None:
    _, pre = pair
    bad = tmp_path / "bad"
    shutil.copytree(pre, bad)
    target = bad / "executables" / "denoise_step__block.xla"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 1
    target.write_bytes(bytes(data))
    verify = run_cli("runtime", "verify", str(bad), check=False)
    assert verify.returncode != 0
    assert "FAIL  bundle file executables/denoise_step__block.xla does not match its sha256" in verify.stdout
    out = tmp_path / "video.mp4"
    gen = run_cli("runtime", "generate", str(bad), "--prompt", PROMPT, "--steps", "1", "--out", str(out), check=False)
    assert gen.returncode == 2 and len(gen.stderr.strip().splitlines()) == 1, gen.stderr
    assert "executables/denoise_step__block.xla does not match its sha256" in gen.stderr and not out.exists()
    served = run_module("runtime", "serve", str(bad), "--port", "18791", check=False, timeout=60)  # before it binds
    assert served.returncode == 2 and served.stderr.strip().splitlines() == gen.stderr.strip().splitlines()
    # opened without the check at open, the bytes are still hashed as they are read: changed code never runs
    with pytest.raises(runtime.BundleError, match="executables/denoise_step__block.xla does not match its sha256"):
        runtime.load(bad, verify=False).generate(PROMPT, seed=SEED, steps=1, progress=False)


def test_attached_quantized_weights_and_a_lora_run_on_the_executables(checkpoints: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    """Precompiled with no weights, int8; the weights attached after; a LoRA switched in per run."""
    bundle = tmp_path / "int8"
    run_module("export", "--model", str(checkpoints["tiny"]), "--resolution", "64x32", "--frames", "5", "--dtype",
               "fp32", "--max-sequence-length", "24", "--quantize", "int8", "--no-weights", "--precompile", "--out",
               str(bundle), "-q")
    before = mf.read(bundle).executables
    run_module("export", "attach", str(bundle), "--weights", str(checkpoints["tiny"]), "-q")
    assert before and mf.read(bundle).executables == before
    forged = _forged(bundle, tmp_path / "forged", compiler="jaxlib 0.0.1")
    runs = []
    for path in (bundle, forged):
        adapter = make_adapter(path, tmp_path / f"{path.name}-lora.safetensors", seed=1)
        pipe = runtime.load(path)
        plain = pipe.generate(PROMPT, seed=SEED, steps=STEPS, progress=False)
        lora = pipe.generate(PROMPT, seed=SEED, steps=STEPS, progress=False, loras=[(adapter, 1.0)])
        runs.append((plain, lora, dict(pipe.bundle.timings)))
    (plain, lora, timings), (plain_compiled, lora_compiled, compiled_timings) = runs
    assert not any(k.startswith("compile ") for k in timings) and any(k.startswith("load executable") for k in timings)
    assert any(k.startswith("compile ") for k in compiled_timings)
    assert np.abs(lora - plain).max() > 1e-3  # the LoRA changes the frames
    np.testing.assert_array_equal(plain, plain_compiled)
    np.testing.assert_array_equal(lora, lora_compiled)


def test_a_tpu_bundle_precompiles_here_with_compile_only_devices(tmp_path: Path) -> None:
    pytest.importorskip("libtpu")
    out = tmp_path / "tpu"
    run_module("export", "--model", "tiny-wide", "--resolution", "32x32", "--frames", "5", "--target", "tpu-v6e-8",
               "--no-weights", "--precompile", "--out", str(out), "-q")
    m = mf.read(out)
    assert {(e.program, e.part) for e in m.executables} == {(n, p) for n, s in m.programs.items() for p in s.parts}
    keys = [e.key for e in m.executables]
    assert {(k.platform, k.chip, k.topology, k.devices, k.compiler.split()[0]) for k in keys} == {
        ("tpu", "TPU v6 lite", "v6e:2x4", 8, "libtpu")}
    assert all(not k.features for k in keys)
    assert "ok    files:" in run_cli("runtime", "verify", str(out), check=False).stdout


def test_a_cuda_bundle_is_precompiled_only_where_its_gpus_are(tmp_path: Path) -> None:
    proc = run_cli("export", "--model", "tiny", "--resolution", "64x32", "--frames", "5", "--target", "cuda",
                   "--precompile", "--out", str(tmp_path / "cuda"), check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error: --precompile compiles a cuda bundle only where its GPUs are")
    assert not (tmp_path / "cuda").exists()


def _precompiled_cpu8(cpu8_bundle: Path, out: Path) -> Path:
    shutil.copytree(cpu8_bundle, out)
    run_module("export", "precompile", str(out), "-q", env=devices_env(8))
    return out


@pytest.mark.slow
def test_sharded_executables_load_on_8_devices(cpu8_bundle: Path, tmp_path: Path) -> None:
    """A cpu-8 bundle (dp, sp and tp of 2) precompiled with 8 devices: its sharded executables load (the shardings
    read back from XLA's bytes) and make the plain bundle's frames."""
    pre = _precompiled_cpu8(cpu8_bundle, tmp_path / "pre")
    assert {(e.key.devices, e.key.processes) for e in mf.read(pre).executables} == {(8, 1)}
    frames, logs = [], []
    for bundle in (cpu8_bundle, pre):
        proc = run_module("runtime", "generate", str(bundle), "--prompt", PROMPT, "--seed", str(SEED), "--steps",
                          str(STEPS), "--out", str(tmp_path / f"{bundle.name}.mp4"), "--frames-out",
                          str(tmp_path / f"{bundle.name}.safetensors"),
                          env={**devices_env(8), "JAX_LOG_COMPILES": "1", "WAN_AOT_CACHE_DIR": str(tmp_path / "c")})
        from safetensors.numpy import load_file

        frames.append(load_file(str(tmp_path / f"{bundle.name}.safetensors"))["frames"])
        logs.append(proc.stderr)
    assert logs[0].count(COMPILED_PROGRAM) >= 7 and logs[1].count(COMPILED_PROGRAM) == 0 and WARNING not in logs[1]
    np.testing.assert_array_equal(frames[0], frames[1])


@pytest.mark.slow
def test_two_processes_say_why_they_compile(cpu8_bundle: Path, tmp_path: Path) -> None:
    """Executables compiled in one process are not a 2-process run's (each process holds 4 of the 8 devices): each
    process says why in one line and compiles, and the video is made."""
    pre = _precompiled_cpu8(cpu8_bundle, tmp_path / "pre")
    logs = run_processes(["generate", str(pre), "--prompt", PROMPT, "--steps", "1", "--out", str(tmp_path / "v.mp4")])
    assert (tmp_path / "v.mp4").is_file()
    for text in logs:
        said = [line for line in text.splitlines() if WARNING in line]
        assert len(said) == 1 and "it was built for processes 1, this host has 2" in said[0], text[-2000:]
