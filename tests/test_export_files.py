"""Bundle files: the streaming weight writer and byte-reproducible exports."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .conftest import CASES, ROOT


def test_streaming_writer_round_trips(tmp_path: Path) -> None:
    import ml_dtypes
    import torch
    from safetensors import safe_open

    from export.weights import write

    tensors = {
        "b.bf16": torch.randn(3, 5).to(torch.bfloat16),
        "a.f32": torch.randn(7),
        "c.i64": torch.arange(4),
        "d.scalar": torch.tensor(2.5),
        "e.transposed": torch.randn(4, 6).t(),  # non-contiguous
    }
    specs = write(tmp_path / "w.safetensors", tensors)
    assert specs["b.bf16"].dtype == "bfloat16" and specs["e.transposed"].shape == (6, 4)
    with safe_open(str(tmp_path / "w.safetensors"), framework="numpy") as f:
        assert sorted(f.keys()) == sorted(tensors)
        for name, t in tensors.items():
            got = f.get_slice(name)[tuple(slice(0, n) for n in t.shape)]
            want = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
            if t.dtype == torch.bfloat16:
                assert got.dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(np.asarray(got, want.dtype).reshape(want.shape), want)


def _placed(path: Path, names: list[str]) -> dict:
    """runtime.weights.load_file on one device, no integrity checker."""
    import jax

    from runtime import manifest as mf
    from runtime import weights as wio

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return wio.load_file(path, mf.FileRef(path.name, ""), None, dict.fromkeys(names, sharding),
                         dict.fromkeys(names, None), lambda name, entry: None if entry else f"{name} missing")


def test_weights_are_aligned_mapped_and_placed_without_a_copy(tmp_path: Path) -> None:
    """The writer starts every tensor whose size is a multiple of 64 bytes on a 64-byte boundary of the file;
    the runtime maps the file and jax on CPU adopts those tensors where they lie in the mapping (the others are
    copied). Values round-trip either way, also from a file the safetensors library wrote (8-byte aligned)."""
    import json
    import struct

    import torch
    from safetensors.torch import save_file

    from export.weights import write

    torch.manual_seed(0)
    tensors = {"odd": torch.randn(3, 5), "big": torch.randn(64, 48), "bias": torch.randn(48),
               "half": torch.randn(31, 5).to(torch.bfloat16), "tiny": torch.randn(1)}
    path = tmp_path / "w.safetensors"
    write(path, tensors)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    offsets = {k: 8 + n + v["data_offsets"][0] for k, v in json.loads(raw[8:8 + n]).items()}
    aligned = {k for k, t in tensors.items() if t.numel() * t.element_size() % 64 == 0}
    assert aligned == {"big", "bias"} and all(offsets[k] % 64 == 0 for k in aligned)

    arrays = _placed(path, list(tensors))
    maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(str(path))]
    spans = [tuple(int(x, 16) for x in m[0].split("-")) for m in maps]

    def mapped(name: str) -> bool:
        p = arrays[name].unsafe_buffer_pointer()
        return any(lo <= p < hi for lo, hi in spans)

    on_boundary = {k for k in tensors if offsets[k] % 64 == 0}  # the aligned ones, and the first other one
    assert aligned < on_boundary != set(tensors)
    assert {k for k in tensors if mapped(k)} == on_boundary
    for k, t in tensors.items():
        np.testing.assert_array_equal(np.asarray(arrays[k], np.float32), t.float().numpy())

    other = tmp_path / "library.safetensors"
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(other))
    for k, a in _placed(other, list(tensors)).items():
        np.testing.assert_array_equal(np.asarray(a, np.float32), tensors[k].float().numpy())


def _mapped_rss(path: Path) -> int:
    """Bytes of `path`'s mappings in this process that are in its page tables (/proc/self/smaps Rss)."""
    rss, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            ours = line.endswith(str(path))
        elif ours and head[0] == "Rss:":
            rss += int(head[1]) << 10
    return rss


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_only_wanted_tensors_are_paged_in(tmp_path: Path) -> None:
    """load_file fills the page tables of the tensors it places (MADV_POPULATE_READ, run by run of back-to-back
    wanted tensors), and of no others: a tensor no program uses stays out of the process's memory."""
    import torch

    from export.weights import write

    mb = 1 << 20
    tensors = {"a": torch.ones(2 * mb // 4), "unused": torch.ones(4 * mb // 4), "b": torch.ones(mb // 4),
               "c": torch.ones(mb // 4)}
    path = tmp_path / "w.safetensors"
    write(path, tensors)
    arrays = _placed(path, ["a", "b", "c"])
    rss = _mapped_rss(path)
    assert 4 * mb <= rss < 5 * mb, rss  # a, b and c (4 MB), not the unused 4 MB
    assert float(np.asarray(arrays["c"]).sum()) == mb // 4


def _digests(bundle: Path) -> dict[str, str]:
    return {str(p.relative_to(bundle)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(bundle.rglob("*")) if p.is_file()}


def test_export_is_byte_reproducible(fp32_bundles, checkpoints, tmp_path: Path) -> None:
    """Exported again by the same code installed elsewhere (a copy of the packages at another path, as another venv or
    checkout has them) and started another way (`python -m export` here; the session's bundles are forked from the
    tests' export server, tests/export_fork.py): the same bytes. Programs record source locations, relative to where
    the code is, and only the op's own frame."""
    variant, res, frames, max_len = CASES["tiny-64x32-f9"]
    again, elsewhere = tmp_path / "again", tmp_path / "elsewhere"
    for package in ("export", "runtime"):
        shutil.copytree(ROOT / package, elsewhere / package, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "export", "--model", str(checkpoints[variant]), "--resolution", res,
                           "--frames", str(frames), "--dtype", "fp32", "--max-sequence-length", str(max_len),
                           "--out", str(again), "-q"], cwd=elsewhere, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(elsewhere), "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = _digests(fp32_bundles["tiny-64x32-f9"])
    assert set(first) == {"manifest.json", "tokenizer/tokenizer.json", "weights/text_encoder.safetensors",
                          "weights/transformer.safetensors", "weights/vae.safetensors",
                          "stages/text_encoder.jaxexport", "stages/text_encoder_3.jaxexport",
                          "stages/text_encoder_6.jaxexport", "stages/text_encoder_12.jaxexport",
                          "stages/cross_kv.jaxexport", "stages/denoise_step.jaxexport",
                          "stages/denoise_step_cond.jaxexport",
                          "stages/denoise_step_cached.jaxexport", "stages/vae_decode_first.jaxexport",
                          "stages/vae_decode_next.jaxexport",
                          # the block loop: a head and a block program per batch (2B, B; MagCache's full step shares the
                          # CFG step's head), a tail per looping step
                          "stages/denoise_block_2.jaxexport", "stages/denoise_block_1.jaxexport",
                          "stages/denoise_step_tail.jaxexport", "stages/denoise_step_cond_tail.jaxexport",
                          "stages/denoise_step_residual_tail.jaxexport",
                          # short prompts (CPU targets): keys and values over 3, 6 or 12 of the 24 text rows
                          *[f"stages/{p}_t{t}.jaxexport" for t in (3, 6, 12)
                            for p in ("cross_kv", "denoise_block_2", "denoise_block_1")]}
    assert _digests(again) == first
