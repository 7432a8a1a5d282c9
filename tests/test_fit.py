"""`runtime fit` and `export --fit`: every program of a TPU bundle compiled by XLA's TPU compiler on this CPU-only
machine (libtpu's compile-only devices), and its per-device peak against the chips' HBM.

Tiny random models (tiny-wide: 4 heads for tp=4) stand in for the real ones, whose figures are BENCHMARKS.md's.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from runtime import fit, targets
from runtime import manifest as mf

from .conftest import PLAIN_XLA, ROOT, blocked_run, in_parallel, run_cli, run_module

# target, topology, HBM GiB, frames (v5e: one frame, so no vae_decode_next, the slowest program to compile; v6e has
# every program)
CASES = {"v6e-8": ("tpu-v6e-8", "v6e:2x4", 32, 5), "v5e-8": ("tpu-v5e-8", "v5e:2x4", 16, 1)}
TINY = ["--model", "tiny-wide", "--no-weights", "--resolution", "32x32", "-q"]
GOLDEN = ROOT / "artifacts" / "golden" / "schema-9" / "bundle"  # a CPU bundle
GIB = 1 << 30
# What compiles for TPU here runs with the environment's own XLA flags, not the suite's cheap CPU ones (conftest):
# fit measures the compiled programs.
TPU_ENV = {"XLA_FLAGS": PLAIN_XLA}


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fit")
    in_parallel(*[functools.partial(run_module, "export", *TINY, "--frames", str(frames), "--target", target,
                                    "--out", str(root / case)) for case, (target, _, _, frames) in CASES.items()])
    return {case: root / case for case in CASES}


@pytest.fixture(scope="module")
def reports(bundles: dict[str, Path]) -> dict[str, dict]:
    """`runtime fit --json` of each bundle (the v6e one with --record), two at a time."""
    procs = in_parallel(*[functools.partial(run_module, "runtime", "fit", str(bundles[case]), "--json",
                                            *(["--record"] if case == "v6e-8" else []), check=False, env=TPU_ENV)
                          for case in CASES])
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return {case: json.loads(proc.stdout) for case, proc in zip(CASES, procs)}


def _files(bundle: Path) -> dict[str, str]:
    """Each program file of the bundle by the key `fit` reports it under: its program's manifest name, or for a
    block loop's block and tail the file's stem."""
    m = mf.read(bundle)
    out: dict[str, str] = {}
    for name, spec in m.programs.items():
        for part in spec.parts:
            file = spec.blocks.file(part).file if part else spec.file
            if file not in out.values():
                out[Path(file).stem if part else name] = file
    return out


@pytest.mark.parametrize("case", CASES)
def test_every_program_file_compiles_for_the_slice(bundles: dict[str, Path], reports: dict[str, dict],
                                                   case: str) -> None:
    target, topology, hbm, _ = CASES[case]
    r, m = reports[case], mf.read(bundles[case])
    assert (r["target"], r["topology"], r["hbm_bytes"], r["mode"]) == (target, topology, hbm * GIB, "serve")
    assert set(r["programs"]) == set(_files(bundles[case]))
    for key, p in r["programs"].items():
        assert p["compile_s"] > 0 and p["argument_bytes"] > 0 and p["code_bytes"] > 0, (key, p)
        assert p["temp_bytes"] >= 0 and p["output_bytes"] > 0 and p["flops"] >= 0, (key, p)
    weights = sum(fit.group_bytes(m).values())  # every group resident while serving
    peak = r["peak"]
    assert r["peak_bytes"] == peak["bytes"] > weights and sum(peak["weights"].values()) == weights
    assert r["fits"] is True and r["peak_bytes"] <= r["hbm_bytes"]
    assert r["peaks"]["generate"]["bytes"] <= r["peaks"]["serve"]["bytes"]  # one-shot runs drop finished stages


@pytest.mark.parametrize("case", CASES)
def test_the_flash_kernel_survives_the_tpu_compiler(bundles: dict[str, Path], reports: dict[str, dict],
                                                    case: str) -> None:
    """Wherever an exported program calls the Pallas kernel, its compiled program runs Mosaic's custom call; the DiT's
    block programs are where it is."""
    files = _files(bundles[case])
    for key, p in reports[case]["programs"].items():
        exp = jax.export.deserialize(bytearray((bundles[case] / files[key]).read_bytes()))
        assert p["kernel"] == (fit.MOSAIC in exp.mlir_module()), key
    assert {k for k, p in reports[case]["programs"].items() if p["kernel"]} == {k for k in files
                                                                                if k.startswith("denoise_block")}


def test_the_record_is_shown_by_inspect_and_verify(bundles: dict[str, Path], reports: dict[str, dict]) -> None:
    text = run_cli("runtime", "inspect", str(bundles["v6e-8"])).stdout
    line = next(ln for ln in text.splitlines() if ln.startswith("tpu fit"))
    assert re.search(r"\d+ programs compiled for tpu-v6e-8 \(v6e:2x4\) by XLA's TPU compiler \(libtpu 0\.0\.42\.\d+\) "
                     r"on .+ \(\w+, \d+ cores\) .+: peak .+ of 32\.00 GiB per chip \(serve\), fits", line), line
    checks = run_cli("runtime", "verify", str(bundles["v6e-8"]), check=False).stdout
    assert "ok    tpu: " in checks
    assert "tpu: never compiled for TPU here" in run_cli("runtime", "verify", str(bundles["v5e-8"]), check=False).stdout


def _one_line(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_a_budget_too_small_fails_naming_the_program(bundles: dict[str, Path]) -> None:
    """2 MiB holds the tiny model's weights but not the first program's working set: exit 1 after that program."""
    line = _one_line(run_module("runtime", "fit", str(bundles["v5e-8"]), "--hbm", "0.002", "-q", check=False,
                                env=TPU_ENV), 1)
    assert re.fullmatch(r"error: tpu-v5e-8 \(v5e, 2\.0 MiB HBM per chip\) does not fit: (cross_kv|denoise_\w+|"
                        r"text_encoder\w*|vae_decode_\w+) \((encode|denoise|decode)\) needs [\d.]+ MiB per device "
                        r"\(weights [\d.]+ MiB, the rest [\d.]+ MiB\); try --quantize int8, a larger slice "
                        r"\(tpu-v5e-16\), fewer frames, a smaller shape", line), line


def test_export_fit_writes_nothing_that_does_not_fit(tmp_path: Path) -> None:
    out = tmp_path / "bundle"
    proc = run_module("export", *TINY, "--frames", "5", "--target", "tpu-v6e-8", "--out", str(out), "--fit", "--hbm",
                      "0.002", check=False, env=TPU_ENV)
    line = _one_line(proc, 1)
    assert line.startswith("error: tpu-v6e-8 (v6e, 2.0 MiB HBM per chip) does not fit: ") and \
        line.endswith("; no bundle was written"), line
    assert list(tmp_path.iterdir()) == []  # not the bundle, nor its temporary directory


@pytest.mark.parametrize("args, message", [
    ([str(GOLDEN)], f"error: {GOLDEN} is a cpu bundle (target cpu): fit compiles TPU bundles; export one with "
                    "--target tpu-... (e.g. tpu-v6e-8)"),
    ([str(GOLDEN) + "-missing"], None),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str | None) -> None:
    line = _one_line(run_cli("runtime", "fit", *args, check=False), 2)
    assert line == message if message else line.startswith("error: ")


def test_export_fit_needs_a_tpu_target(tmp_path: Path) -> None:
    line = _one_line(run_cli("export", *TINY, "--out", str(tmp_path / "b"), "--fit", check=False), 2)  # cpu target
    assert line == "error: --fit compiles for a TPU slice; target cpu is cpu: use --target tpu-... (e.g. tpu-v6e-8)"
    assert not (tmp_path / "b").exists()


def test_without_libtpu_the_pip_command(bundles: dict[str, Path]) -> None:
    code = "from runtime.__main__ import main\ncode = main(sys.argv[1:])"
    line = _one_line(blocked_run(("libtpu",), code, "fit", str(bundles["v6e-8"]), timeout=120), 2)
    assert line == ("error: fitting a bundle to a TPU slice needs the tpu extra (libtpu, XLA's TPU compiler, is not "
                    "installed; no TPU is needed): pip install 'wan-aot[tpu]' (or: pip install -r "
                    "requirements/tpu.lock)")


def test_libtpu_stays_quiet_on_a_machine_without_a_tpu(tmp_path: Path) -> None:
    """With libtpu installed (as the test set has it) and no JAX_PLATFORMS set, a CLI error is still its one line and
    jax starts on the CPU without a word from libtpu."""
    import importlib.util

    assert importlib.util.find_spec("libtpu") is not None, "the test set installs libtpu (the tpu extra)"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"} | TPU_ENV | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "runtime", "generate", str(tmp_path / "none"), "--prompt", "a cat",
                           "--out", str(tmp_path / "cat.mp4")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert _one_line(proc, 2).startswith("error: "), proc.stderr
    proc = subprocess.run([sys.executable, "-c", "import runtime, jax; print(jax.devices()[0].platform)"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, "cpu", "")


def test_each_tpu_preset_names_its_slice() -> None:
    want = {"tpu-v6e-4": "v6e:2x2", "tpu-v6e-8": "v6e:2x4", "tpu-v6e-16": "v6e:4x4", "tpu-v5e-8": "v5e:2x4",
            "tpu-v4-8": "v4:2x2x1"}
    assert {n: targets.topology(t) for n, t in targets.PRESETS.items() if t.platform == "tpu"} == want
    v4 = targets.resolve("tpu-v4-8", "dp=2,sp=2,tp=4")  # a 16-chip v4 slice
    assert targets.topology(v4) == "v4:2x2x4" and targets.chip(v4).chip_config == "megacore"


KERNEL_CHECK = """
import jax, jax.numpy as jnp, sys
from runtime import fit, targets
from export.flash_tpu import FlashBlocks, flash_attention
t = targets.get(sys.argv[1])
mesh, _ = fit.compile_only_mesh(t)
b = FlashBlocks()
q = jax.ShapeDtypeStruct((1, 40 // t.mesh["tp"], 2 * b.block_q, 128), jnp.bfloat16,
                         sharding=jax.sharding.SingleDeviceSharding(mesh.devices.flat[0]))
kv = jax.ShapeDtypeStruct((1, q.shape[1], 2 * b.block_kv, 128), jnp.bfloat16, sharding=q.sharding)
compiled = jax.jit(flash_attention).lower(q, kv, kv).compile()
print(fit.MOSAIC in compiled.as_text())
"""


def test_the_default_flash_blocks_compile_for_the_tightest_chip() -> None:
    """The presets' default blocks (3328 / 2816 / 256), unclamped (two q and two kv blocks of the 14B's 128-wide
    heads, as many per device as tp leaves), through Mosaic for v4, whose VMEM is the smallest of the presets' chips
    (16 MiB per core against v5e's and v6e's 128 MiB, as jax's
    pallas/mosaic/tpu_info.py lists them). v5e and v6e compile the same defaults in the real 1.3B and 14B block
    programs (tools/bench.py fit, BENCHMARKS.md section 6); the tiny bundles above clamp them to their sequence."""
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHECK, "tpu-v4-8"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **TPU_ENV, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert (proc.returncode, proc.stdout.strip()) == (0, "True"), proc.stderr[-3000:]


OUT_OF_HBM = """
import jax, jax.numpy as jnp
from runtime import fit, targets
t = targets.get("tpu-v5e-8")
mesh, _ = fit.compile_only_mesh(t)
x = jax.ShapeDtypeStruct((1 << 16,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(mesh.devices.flat[0]))
try:  # 16 GiB of float32 to sort: more temporaries than a v5e chip's HBM
    jax.jit(lambda x: jnp.sort(jnp.outer(x, x), axis=0)[0]).lower(x).compile()
except jax.errors.JaxRuntimeError as e:
    print(fit.refusal("denoise_step", t, e))
"""


def test_a_program_the_compiler_refuses_for_hbm_is_one_line_with_what_helps() -> None:
    """Where the TPU compiler itself runs out of HBM (a program's temporaries, as the 14B VACE head on v5e-8 in
    BENCHMARKS.md section 6), fit's line keeps the compiler's figures and says what would help."""
    proc = subprocess.run([sys.executable, "-c", OUT_OF_HBM], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **TPU_ENV, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.fullmatch(r"the TPU compiler refuses denoise_step for tpu-v5e-8: RESOURCE_EXHAUSTED: Ran out of memory "
                        r"on HBM, the total memory required for HLO temporaries \(32\.00G\) exceeds available HBM "
                        r"\(15\.75G\); try a larger slice \(tpu-v5e-16\), fewer frames, a smaller shape",
                        proc.stdout.strip()), proc.stdout
