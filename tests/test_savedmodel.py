"""Bundles as TensorFlow SavedModels (export/savedmodel.py) and the jax-free TF client (tools/tf_generate.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

import runtime
from runtime import intermediates as im
from runtime import kinds

from .conftest import OnDemand, blocked_run, in_parallel, run_module, run_modules

PROMPT = "a red fox running through snow"


def export_cli(*args: str, blocked: tuple[str, ...] = ("torch", "torchax", "diffusers", "transformers")
               ) -> subprocess.CompletedProcess:
    return blocked_run(blocked, "from export.__main__ import main\ncode = main(sys.argv[1:])", *args)


def tf_generate(*args: str) -> subprocess.CompletedProcess:
    """tools/tf_generate.py in a process where importing jax (or jaxlib, or torch) raises."""
    return blocked_run(("jax", "jaxlib", "torch"), """
        import runpy
        sys.argv = ["tools/tf_generate.py", *sys.argv[1:]]
        try:
            runpy.run_path("tools/tf_generate.py", run_name="__main__")
        except SystemExit as e:
            code = e.code
    """, *args)


@pytest.fixture(scope="module")
def savedmodels(checkpoints, fp32_bundles, kind_bundles, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny fp32 bundle (validated against JAX while converting), the two-expert one, the first-last-frame one
    (CLIP and VAE-encode stages) and a bf16 bundle for the cuda target, converted in processes where torch cannot be
    imported, two at a time."""
    root = tmp_path_factory.mktemp("savedmodels")

    def cuda_bundle() -> Path:
        run_module("export", "--model", str(checkpoints["tiny"]), "--resolution", "64x32", "--frames", "5",
                   "--max-sequence-length", "16", "--dtype", "bf16", "--target", "cuda", "--out", str(root / "cuda-b"),
                   "-q")
        return root / "cuda-b"

    jobs = {"tiny": (lambda: fp32_bundles["tiny-64x32-f9"], ["--validate"]),
            "cuda": (cuda_bundle, ["-q"]),
            "flf2v": (lambda: kind_bundles["flf2v"], [])}
    out = {name: root / name for name in jobs}
    procs = dict(zip(jobs, in_parallel(*[
        lambda name=name, bundle=bundle, extra=extra: export_cli("savedmodel", str(bundle()), "--out",
                                                                 str(out[name]), *extra)
        for name, (bundle, extra) in jobs.items()])))
    for name, proc in procs.items():
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    assert procs["tiny"].stderr.count("validated ") == 12 and ": Pass" in procs["tiny"].stderr, \
        procs["tiny"].stderr[-2000:]

    def two_experts() -> Path:  # the slow tier's
        proc = export_cli("savedmodel", str(kind_bundles["t2v-moe"]), "--out", str(root / "t2v-moe"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return root / "t2v-moe"

    return OnDemand({"t2v-moe": two_experts}, done=out)


def test_layout_and_description(savedmodels, fp32_bundles) -> None:
    directory, bundle = savedmodels["tiny"], fp32_bundles["tiny-64x32-f9"]
    assert (directory / "1" / "saved_model.pb").is_file() and (directory / "1" / "variables").is_dir()
    info = json.loads((directory / "wan-aot.json").read_text())
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert info["bundle_id"] == manifest["bundle_id"] and info["scheduler"] == manifest["scheduler"]
    # every program but the short-prompt cross_kv_t<T> ones, whose keys and values only the runtime's short block
    # programs take (the signatures run the whole text's)
    short = {f"cross_kv_t{t}" for t in kinds.short_text_lengths(manifest["shapes"][0]["max_sequence_length"])}
    assert short and short <= set(manifest["programs"])
    assert set(info["signatures"]) == {*manifest["programs"], "initial_latents"} - short
    # Call order: the denoise step takes (state, kv, timestep, guidance, row), as the runtime calls it.
    assert [i["name"] for i in info["signatures"]["denoise_step"]["inputs"]] == [
        "state", "kv", "timestep", "guidance", "row"]
    assert [i["name"] for i in info["signatures"]["cross_kv"]["inputs"]] == ["context"]
    for name, program in manifest["programs"].items():
        if name in short:
            continue
        sig = info["signatures"][name]
        assert {i["name"]: {"shape": i["shape"], "dtype": i["dtype"]} for i in sig["inputs"]} == program["inputs"]
        assert {o["name"]: {"shape": o["shape"], "dtype": o["dtype"]} for o in sig["outputs"]} == program["outputs"]
    assert not list(directory.parent.glob(".*partial*"))


# The slow tier's: text-to-video is the path of test_tf_client_first_and_last_frame without its image stages (the same
# client from a seed, with --guidance and --flow-shift), and the fixture's --validate runs each of this SavedModel's
# signatures against JAX.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["seed", "latents"])
def test_tf_client_matches_the_runtime(savedmodels, fp32_bundles, tmp_path: Path, name: str) -> None:
    """The same frames from TensorFlow (no jax in the process) as from the runtime (max abs error <= 1e-4), from the
    same seed (the SavedModel draws the runtime's noise) and on the same initial latents given."""
    bundle = fp32_bundles["tiny-64x32-f9"]
    pipe = runtime.load(bundle)
    init = np.random.default_rng(3).standard_normal(pipe.geometry.latent_shape).astype(np.float32)
    im.save(tmp_path / "init.safetensors", im.LATENTS, {"latents": init}, pipe.bundle_id, {})
    settings = {"steps": 3, "guidance": 4.0, "flow_shift": 2.0}
    args, kwargs = {"latents": (["--latents", str(tmp_path / "init.safetensors")], {"latents": init}),
                    "seed": (["--seed", "11"], {"seed": 11})}[name]
    out, frames_out = tmp_path / f"{name}.mp4", tmp_path / f"{name}.safetensors"
    proc = tf_generate(str(savedmodels["tiny"]), "--prompt", PROMPT, "--steps", "3", "--guidance", "4",
                       "--flow-shift", "2", *args, "--out", str(out), "--frames-out", str(frames_out), "-q")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.stat().st_size > 0
    tf_frames = im.load(frames_out, im.FRAMES, pipe.bundle_id, {"frames": (1, 9, 32, 64, 3)})[0]["frames"]
    expected = pipe.generate(PROMPT, progress=False, **settings, **kwargs)
    assert expected.std() > 0.01
    np.testing.assert_allclose(tf_frames, expected, rtol=0, atol=1e-4)


@pytest.mark.slow  # another kind: test_tf_client_first_and_last_frame runs a converted kind with more stages
def test_tf_client_two_experts(savedmodels, kind_bundles, tmp_path: Path) -> None:
    """Wan 2.2 (two experts): the client switches signatures at the boundary with per-expert guidance."""
    pipe = runtime.load(kind_bundles["t2v-moe"])
    proc = tf_generate(str(savedmodels["t2v-moe"]), "--prompt", PROMPT, "--steps", "4", "--guidance", "3",
                       "--guidance-2", "1.5", "--seed", "2", "--out", str(tmp_path / "v.mp4"),
                       "--frames-out", str(tmp_path / "f.safetensors"), "-q")
    assert proc.returncode == 0, proc.stderr[-3000:]
    g = pipe.geometry
    tf_frames = im.load(tmp_path / "f.safetensors", im.FRAMES, pipe.bundle_id,
                        {"frames": (1, g.frames, g.height, g.width, 3)})[0]["frames"]
    expected = pipe.generate(PROMPT, seed=2, steps=4, guidance=3.0, guidance_2=1.5, progress=False)
    np.testing.assert_allclose(tf_frames, expected, rtol=0, atol=1e-4)


def test_tf_client_first_and_last_frame(savedmodels, kind_bundles, tmp_path: Path) -> None:
    """FLF2V from two images: CLIP on both, the conditioning video VAE-encoded chunk by chunk, in TF; the same frames
    as the runtime's (max abs error <= 1e-4) from the same seed (the SavedModel draws the runtime's noise) and
    settings."""
    from .conftest import test_image

    test_image(80, 48, seed=1).save(tmp_path / "first.png")
    test_image(64, 64, seed=2).save(tmp_path / "last.png")
    pipe = runtime.load(kind_bundles["flf2v"])
    proc = tf_generate(str(savedmodels["flf2v"]), "--prompt", PROMPT, "--image", str(tmp_path / "first.png"),
                       "--last-image", str(tmp_path / "last.png"), "--steps", "3", "--guidance", "4",
                       "--flow-shift", "2", "--seed", "4",
                       "--out", str(tmp_path / "v.mp4"), "--frames-out", str(tmp_path / "f.safetensors"), "-q")
    assert proc.returncode == 0, proc.stderr[-3000:]
    g = pipe.geometry
    tf_frames = im.load(tmp_path / "f.safetensors", im.FRAMES, pipe.bundle_id,
                        {"frames": (1, g.frames, g.height, g.width, 3)})[0]["frames"]
    expected = pipe.generate(PROMPT, image=tmp_path / "first.png", last_image=tmp_path / "last.png", seed=4, steps=3,
                             guidance=4.0, flow_shift=2.0, progress=False)
    assert expected.std() > 0.01
    np.testing.assert_allclose(tf_frames, expected, rtol=0, atol=1e-4)
    proc = tf_generate(str(savedmodels["flf2v"]), "--prompt", PROMPT, "--out", str(tmp_path / "w.mp4"))
    assert proc.returncode == 2 and "it needs an image (--image FILE" in proc.stderr


@pytest.fixture(scope="module")
def unconvertible(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Programs-only bundles: one for a TPU (with the Pallas kernel), one for the CPU."""
    root = tmp_path_factory.mktemp("unconvertible")
    common = ["--model", "tiny", "--no-weights", "--resolution", "64x32", "--frames", "5",
              "--max-sequence-length", "16", "-q"]
    run_modules(["export", *common, "--target", "tpu-v6e-4", "--mesh", "dp=1,sp=1,tp=1", "--out", str(root / "tpu")],
                ["export", *common, "--out", str(root / "no-weights")])
    return {"tpu": root / "tpu", "no-weights": root / "no-weights"}


@pytest.mark.parametrize("case, message", [
    ("tpu", "is a TPU bundle (target tpu-v6e-4[dp=1,sp=1,tp=1]): its DiT calls the Pallas TPU kernel"),
    ("no-weights", "has no weights (exported with --no-weights): attach them first"),
])
def test_unconvertible_bundles_are_refused(unconvertible, tmp_path: Path, case: str, message: str) -> None:
    out = tmp_path / "sm"
    proc = export_cli("savedmodel", str(unconvertible[case]), "--out", str(out))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_existing_output_needs_force(savedmodels, fp32_bundles, tmp_path: Path) -> None:
    out = tmp_path / "sm"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = export_cli("savedmodel", str(fp32_bundles["tiny-64x32-f9"]), "--out", str(out))
    assert proc.returncode == 2 and "already exists: choose another --out or pass --force" in proc.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_missing_extra_names_the_pip_command(fp32_bundles, tmp_path: Path) -> None:
    out = tmp_path / "sm"
    proc = export_cli("savedmodel", str(fp32_bundles["tiny-64x32-f9"]), "--out", str(out),
                      blocked=("torch", "tensorflow", "orbax"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().endswith("pip install 'wan-aot[savedmodel]'") and proc.stderr.count("\n") == 1
    assert not out.exists()


def test_tf_client_bad_input(savedmodels, tmp_path: Path) -> None:
    proc = tf_generate(str(tmp_path), "--prompt", PROMPT, "--out", str(tmp_path / "v.mp4"))
    assert proc.returncode == 2 and "has no wan-aot.json: pass the directory" in proc.stderr
    proc = tf_generate(str(savedmodels["tiny"]), "--prompt", PROMPT, "--steps", "0", "--out", str(tmp_path / "v.mp4"))
    assert proc.returncode == 2 and "steps must be an integer >= 1" in proc.stderr
    assert not (tmp_path / "v.mp4").exists()


def test_cuda_bundle_converts_for_gpu_serving(savedmodels) -> None:
    """A cuda bundle converts on a CPU-only machine: its signatures run the StableHLO for CUDA, and bf16
    weights stay bf16 variables."""
    out = savedmodels["cuda"]
    code = """
        import collections, tensorflow as tf
        model = tf.saved_model.load(sys.argv[1] + "/1")
        graph = model.signatures["denoise_step"].graph.as_graph_def()
        platforms = {bytes(p).decode() for f in graph.library.function for n in f.node_def
                     if n.op == "XlaCallModule" for p in n.attr["platforms"].list.s}
        dtypes = collections.Counter(d.name for d in
                                     tf.train.load_checkpoint(sys.argv[1] + "/1/variables/variables")
                                     .get_variable_to_dtype_map().values())
        print(sorted(platforms), dict(dtypes))
        code = 0
    """
    proc = blocked_run(("jax", "torch"), code, str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    platforms, dtypes = proc.stdout.strip().split(" ", 1)
    assert platforms == "['CUDA']" and "'bfloat16'" in dtypes, proc.stdout
