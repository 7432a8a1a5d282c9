"""Every kind of bad input fails with one clear line, a non-zero exit, no traceback, and writes nothing.

(Export argument errors, tampered weights, edited manifests, `..` paths, unknown schemas,
device-count mismatches and missing weights are covered beside the features they guard:
test_bundle_checks, test_targets, test_multidevice, test_attach.)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import runtime
from runtime.errors import BundleError, UserError

from .conftest import CASES, ROOT, run_cli, run_module
from .test_bundle_checks import _rewrite_manifest


def _fails_cleanly(proc: subprocess.CompletedProcess, message: str) -> None:
    err = proc.stderr.strip()
    assert proc.returncode == 2, err
    assert "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("error:") and message in err.splitlines()[-1], err


@pytest.fixture()
def bundle_copy(fp32_bundles, tmp_path: Path) -> Path:
    dst = tmp_path / "bundle"
    shutil.copytree(fp32_bundles["tiny-64x32-f9"], dst)
    return dst


def _set_file(bundle: Path, rel: str, data: bytes) -> None:
    """Replace a bundle file and make the manifest agree (as a careless or hostile repackager would)."""
    import hashlib

    (bundle / rel).write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()

    def edit(m: dict) -> None:
        for section in (m["programs"].values(), m["weights"].values(), [m["tokenizer"]]):
            for ref in section:
                if ref.get("file") == rel:
                    ref["sha256"] = digest

    _rewrite_manifest(bundle, edit)


def _edit_weights(bundle: Path, change) -> None:
    from safetensors.numpy import load_file, save_file

    path = bundle / "weights" / "transformer.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))
    _set_file(bundle, "weights/transformer.safetensors", path.read_bytes())


# -- runtime arguments ---------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--steps", "0"], "steps must be an integer >= 1"),
    (["--guidance", "-1"], "guidance must be a finite number >= 0"),
    (["--guidance", "nan"], "guidance must be a finite number >= 0"),
    (["--guidance", "inf"], "guidance must be a finite number >= 0"),
    (["--flow-shift", "0"], "flow shift must be a finite number > 0"),
    (["--seed", "-1"], "seed must be an integer in [0, 4294967295]"),
    (["--seed", str(2**40)], "seed must be an integer in [0, 4294967295]"),
])
def test_bad_generation_settings(fp32_bundles, tmp_path: Path, args: list[str], message: str) -> None:
    out = tmp_path / "v.mp4"
    proc = run_cli("runtime", "generate", str(fp32_bundles["tiny-64x32-f9"]), "--prompt", "x", *args,
                      "--out", str(out), check=False)
    _fails_cleanly(proc, message)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out,message", [
    ("missing-dir/v.mp4", "does not exist: create it first"),
    (".", "is a directory: give a file name"),
    ("file.txt/v.mp4", "does not exist: create it first"),
])
def test_unwritable_output(fp32_bundles, tmp_path: Path, out: str, message: str) -> None:
    (tmp_path / "file.txt").write_text("x")
    proc = run_cli("runtime", "generate", str(fp32_bundles["tiny-64x32-f9"]), "--prompt", "x", "--steps", "1",
                      "--out", str(tmp_path / out), check=False)
    _fails_cleanly(proc, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_intermediate_with_wrong_shapes(fp32_bundles, tmp_path: Path) -> None:
    from runtime import intermediates as im

    bundle = fp32_bundles["tiny-64x32-f9"]
    bundle_id = runtime.load(bundle).bundle_id
    bad = tmp_path / "latents.safetensors"
    im.save(bad, im.LATENTS, {"latents": np.zeros((1, 16, 2, 4, 8), np.float32)}, bundle_id, {})
    proc = run_cli("runtime", "decode", str(bundle), "--latents", str(bad), "--out", str(tmp_path / "v.mp4"),
                      check=False)
    _fails_cleanly(proc, "latents is float32[1, 16, 2, 4, 8], this bundle needs float32[1, 16, 3, 4, 8]")
    assert not (tmp_path / "v.mp4").exists()
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    proc = run_cli("runtime", "denoise", str(bundle), "--embeds", str(junk), "--out", str(tmp_path / "l"),
                      check=False)
    _fails_cleanly(proc, "is not a readable safetensors file")


def test_non_finite_latents_name_the_step(bundle_copy: Path, tmp_path: Path) -> None:
    def poison(t: dict) -> None:
        name = next(k for k in sorted(t) if k.startswith("proj_out") and k.endswith("weight"))
        t[name] = np.full_like(t[name], np.nan)

    _edit_weights(bundle_copy, poison)
    out = tmp_path / "v.mp4"
    proc = run_cli("runtime", "generate", str(bundle_copy), "--prompt", "x", "--steps", "3", "--out", str(out),
                      check=False)
    _fails_cleanly(proc, "non-finite values (NaN/inf) appeared in the latents at denoising step 1 of 3")
    assert list(tmp_path.iterdir()) == [bundle_copy]  # no video, no partial file


def test_long_prompt_is_truncated_with_one_warning_naming_it(fp32_bundles, tmp_path: Path) -> None:
    """One warning per run (generate tokenizes twice: to pick the programs, then to encode), naming which prompt is
    long and how many tokens were kept."""
    out = tmp_path / "v.mp4"
    proc = run_module("runtime", "generate", str(fp32_bundles["tiny-64x32-f9"]), "--prompt", "a fox",
                      "--negative-prompt", "word " * 200, "--steps", "1", "--out", str(out))
    warnings = [line for line in proc.stderr.splitlines() if "tokens" in line]
    assert len(warnings) == 1 and out.is_file(), proc.stderr
    tokens = _tokens(fp32_bundles["tiny-64x32-f9"], "word " * 200)
    assert tokens > 24 and warnings[0].startswith(
        f"runtime: negative prompt has {tokens} tokens, more than the bundle's 24 (its --max-sequence-length): "
        "truncated to its first 24: 'word word"), warnings[0]


def test_long_prompt_warning_from_the_python_api(fp32_bundles, caplog: pytest.LogCaptureFixture) -> None:
    pipe = runtime.load(fp32_bundles["tiny-64x32-f9"])
    with caplog.at_level(logging.WARNING, logger="runtime"):
        pipe.generate("word " * 30, steps=1, progress=False)
    warnings = [r.getMessage() for r in caplog.records if "tokens" in r.getMessage()]
    tokens = _tokens(fp32_bundles["tiny-64x32-f9"], "word " * 30)
    assert len(warnings) == 1 and warnings[0].startswith(f"prompt has {tokens} tokens, more than the bundle's 24"), \
        warnings


def _tokens(bundle: Path, prompt: str) -> int:
    """The prompt's tokens, untruncated, by the bundle's tokenizer (export writes it without truncation)."""
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(bundle / "tokenizer" / "tokenizer.json")).encode(prompt.strip()).ids)


@pytest.mark.parametrize("prompt", ["", "  \n\t "])
def test_empty_prompt_is_refused(fp32_bundles, tmp_path: Path, prompt: str) -> None:
    """As the server answers 400: an empty prompt would make an unconditional video (runtime/README.md)."""
    out = tmp_path / "v.mp4"
    proc = run_cli("runtime", "generate", str(fp32_bundles["tiny-64x32-f9"]), "--prompt", prompt, "--out", str(out),
                   check=False)
    _fails_cleanly(proc, "prompt is empty: describe the video")
    assert list(tmp_path.iterdir()) == []
    pipe = runtime.load(fp32_bundles["tiny-64x32-f9"])
    for call in (lambda: pipe.generate(prompt, steps=1), lambda: pipe.encode(prompt),
                 lambda: pipe.generate([prompt], steps=1)):
        with pytest.raises(UserError, match="^prompt is empty: describe the video"):
            call()
    assert pipe.encode("a fox", negative_prompt=prompt)["negative_prompt_embeds"].shape[0] == 1  # may be empty


# -- bundles ----------------------------------------------------------------------------------------

def test_malformed_manifest(bundle_copy: Path, tmp_path: Path) -> None:
    (bundle_copy / "manifest.json").write_text('{"schema_version": 2, "programs": ')
    proc = run_cli("runtime", "generate", str(bundle_copy), "--prompt", "x", "--out", str(tmp_path / "v.mp4"),
                      check=False)
    _fails_cleanly(proc, "manifest.json is not valid JSON")
    (bundle_copy / "manifest.json").write_text(json.dumps({"schema_version": 2, "bundle_id": "x"}))
    with pytest.raises(BundleError, match="modified after export"):
        runtime.load(bundle_copy)


def test_malformed_manifest_fields(bundle_copy: Path) -> None:
    _rewrite_manifest(bundle_copy, lambda d: d.pop("shapes"))
    with pytest.raises(BundleError, match=r"manifest.json is malformed \(KeyError: 'Manifest.shapes'\)"):
        runtime.load(bundle_copy)
    _rewrite_manifest(bundle_copy, lambda d: d.update(shapes=[]))
    with pytest.raises(BundleError, match=r"manifest.json is malformed \(ValueError: it lists no shapes\)"):
        runtime.load(bundle_copy)


def test_tampered_stage_is_refused(bundle_copy: Path, tmp_path: Path) -> None:
    stage = bundle_copy / "stages" / "denoise_step.jaxexport"
    stage.write_bytes(stage.read_bytes()[:100])
    proc = run_cli("runtime", "verify", str(bundle_copy), check=False)
    assert proc.returncode == 2 and "FAIL  bundle file stages/denoise_step.jaxexport does not match its sha256" \
        in proc.stdout
    with pytest.raises(BundleError, match="stages/denoise_step.jaxexport does not match its sha256"):
        runtime.load(bundle_copy)


@pytest.mark.parametrize("change,message", [
    ("drop", "has no tensor 'proj_out.weight'"),
    ("shape", "tensor 'proj_out.weight' in weights/transformer.safetensors is float32[16, 64]"),
    ("dtype", "tensor 'proj_out.weight' in weights/transformer.safetensors is float16"),
])
def test_missing_or_misshapen_tensor(bundle_copy: Path, tmp_path: Path, change: str, message: str) -> None:
    def edit(t: dict) -> None:
        w = t["proj_out.weight"]
        if change == "drop":
            del t["proj_out.weight"]
        elif change == "shape":
            t["proj_out.weight"] = np.zeros((16, 64), w.dtype)
        else:
            t["proj_out.weight"] = w.astype(np.float16)

    _edit_weights(bundle_copy, edit)
    verify = run_cli("runtime", "verify", str(bundle_copy), check=False)
    assert verify.returncode == 2 and message in verify.stdout, verify.stdout
    out = tmp_path / "v.mp4"
    proc = run_cli("runtime", "generate", str(bundle_copy), "--prompt", "x", "--steps", "1", "--out", str(out),
                      check=False)
    _fails_cleanly(proc, message)
    assert not out.exists()


def test_bundle_for_another_platform(bundle_copy: Path) -> None:
    _rewrite_manifest(bundle_copy, lambda d: d["target"].update(name="tpu-v6e-8", platform="tpu",
                                                                mesh={"dp": 2, "sp": 1, "tp": 4}))
    with pytest.raises(BundleError, match="exported for platform 'tpu' .* but this machine runs 'cpu'"):
        runtime.load(bundle_copy)


def test_bundle_from_a_newer_jax_is_refused_an_older_one_warned(bundle_copy: Path) -> None:
    _rewrite_manifest(bundle_copy, lambda d: d["versions"].update(jax="0.99.0", jaxlib="0.99.0"))
    proc = run_cli("runtime", "verify", str(bundle_copy), check=False)
    assert proc.returncode == 2 and "FAIL  bundle was exported with jax 0.99.0, newer than the installed" in proc.stdout
    with pytest.raises(BundleError, match="install jax==0.99.0"):
        runtime.load(bundle_copy)
    _rewrite_manifest(bundle_copy, lambda d: d["versions"].update(jax="0.10.0", jaxlib="0.10.0"))
    proc = run_cli("runtime", "verify", str(bundle_copy))
    assert "warn  bundle was exported with jax 0.10.0" in proc.stdout and "ready to run" in proc.stdout


def test_schema_policy(bundle_copy: Path) -> None:
    from runtime import manifest as mf

    _rewrite_manifest(bundle_copy, lambda d: d.update(schema_version=mf.SCHEMA_VERSION + 1))
    with pytest.raises(BundleError, match="newer than this runtime reads .*: upgrade the runtime"):
        runtime.load(bundle_copy)
    _rewrite_manifest(bundle_copy, lambda d: d.update(schema_version=0))
    with pytest.raises(BundleError, match="schema version 0 is no longer supported .*: re-export"):
        runtime.load(bundle_copy)


# -- export ----------------------------------------------------------------------------------------

def test_interrupted_export_leaves_no_bundle(checkpoints, tmp_path: Path) -> None:
    """An export killed (SIGKILL) once it has written a program leaves its temporary directory and no bundle; the next
    export sweeps it. The killed export is forked from the export fork server (tests/export_fork.py), as run_module's
    are: a process of its own, without a new interpreter's imports."""
    import tempfile

    from . import export_fork

    variant, res, frames, max_len = CASES["tiny-64x32-f9"]
    out = tmp_path / "b"
    args = ["export", "--model", str(checkpoints[variant]), "--resolution", res, "--frames", str(frames),
            "--dtype", "fp32", "--max-sequence-length", str(max_len), "--out", str(out), "-q"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryDirectory(prefix="wan-aot-export-") as logs:
        proc = export_fork.start(args[1:], env, str(ROOT), logs)
        try:
            partial = tmp_path / f".b.partial-{proc.pid}"
            deadline = time.time() + 300
            while not list(partial.glob("stages/*.jaxexport")) and proc.is_alive() and time.time() < deadline:
                time.sleep(0.02)
        finally:
            proc.kill()  # SIGKILL
            proc.join()
    assert partial.is_dir(), "the export finished before it could be interrupted"
    assert not out.exists()
    with pytest.raises(BundleError, match="is not a bundle directory"):
        runtime.load(out)
    run_module(*args)  # the next export succeeds and sweeps the killed one's leftovers
    assert not partial.exists() and runtime.load(out).manifest.has_weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_mesh_that_does_not_divide_the_model(tmp_path: Path) -> None:
    proc = run_cli("export", "--model", "wan2.1-t2v-1.3b", "--no-weights", "--resolution", "480p",
                      "--target", "tpu-v6e-16", "--out", str(tmp_path / "b"), check=False)
    _fails_cleanly(proc, "12 attention heads do not divide over tp=8 (try --mesh")
    assert list(tmp_path.iterdir()) == []


def test_atomic_path_leaves_nothing_on_failure(tmp_path: Path) -> None:
    from runtime.files import atomic_path

    target = tmp_path / "out.bin"
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        assert not target.exists()
        raise RuntimeError("killed midway")
    assert list(tmp_path.iterdir()) == []
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"whole")
    assert target.read_bytes() == b"whole" and list(tmp_path.iterdir()) == [target]
