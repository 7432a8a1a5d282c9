"""The runtime runs with torch, torchax, diffusers, transformers and `export` made unimportable."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from .conftest import ROOT, run_module

BLOCKED = ("torch", "torchax", "diffusers", "transformers", "export")

BLOCKER = textwrap.dedent(f"""
    import importlib.abc, sys
    BLOCKED = {BLOCKED!r}

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is blocked: the runtime must not import it")
            return None

    sys.meta_path.insert(0, Blocker())
    for mod in list(sys.modules):
        if mod.split(".")[0] in BLOCKED:
            del sys.modules[mod]
    from runtime.__main__ import main
    code = main(sys.argv[1:])
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    if leaked:
        print("leaked imports:", leaked, file=sys.stderr)
        code = 3
    sys.exit(code)
""")


def test_generate_without_torch(fp32_bundles, tmp_path: Path) -> None:
    import imageio.v3 as iio

    bundle = fp32_bundles["tiny-64x32-f9"]
    out = tmp_path / "video.mp4"
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKER, "generate", str(bundle), "--prompt", "a robot dancing in the city",
         "--steps", "3", "--seed", "1", "--out", str(out), "-q"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((bundle / "manifest.json").read_text())
    g = manifest["shapes"][0]
    frames = iio.imread(out, plugin="pyav") if _has_pyav() else _read_ffmpeg(out)
    assert frames.shape == (g["frames"], g["height"], g["width"], 3)
    assert frames.dtype == np.uint8 and frames.std() > 0
    assert not list(tmp_path.glob(".*partial*"))


def _has_pyav() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def _read_ffmpeg(path: Path) -> np.ndarray:
    import imageio.v2 as imageio

    reader = imageio.get_reader(str(path), format="FFMPEG")
    try:
        return np.stack([frame for frame in reader])
    finally:
        reader.close()


def test_runtime_sources_import_nothing_from_export_side() -> None:
    import ast

    for path in (ROOT / "runtime").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in BLOCKED, f"{path.name} imports {name}"


def test_stage_by_stage_equals_generate(fp32_bundles, tmp_path: Path) -> None:
    """encode -> denoise -> decode through files gives the same video bytes as generate."""
    bundle = str(fp32_bundles["tiny-64x32-f9"])
    args = ["--steps", "2", "--seed", "3"]
    run_module("runtime", "generate", bundle, "--prompt", "a cat", *args, "--out", str(tmp_path / "a.mp4"), "-q")
    run_module("runtime", "encode", bundle, "--prompt", "a cat", "--out", str(tmp_path / "e.safetensors"), "-q")
    run_module("runtime", "denoise", bundle, "--embeds", str(tmp_path / "e.safetensors"), *args,
               "--out", str(tmp_path / "l.safetensors"), "-q")
    run_module("runtime", "decode", bundle, "--latents", str(tmp_path / "l.safetensors"),
               "--out", str(tmp_path / "b.mp4"), "-q")
    assert (tmp_path / "a.mp4").read_bytes() == (tmp_path / "b.mp4").read_bytes()
    # An intermediate from another bundle is refused with one line and no output.
    other = str(fp32_bundles["wide-48x48-f5"])
    proc = run_module("runtime", "decode", other, "--latents", str(tmp_path / "l.safetensors"),
                      "--out", str(tmp_path / "c.mp4"), check=False)
    assert proc.returncode == 2 and "not this bundle" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "c.mp4").exists()
