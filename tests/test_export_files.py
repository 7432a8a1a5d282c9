"""Bundle files: the streaming weight writer and byte-reproducible exports."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from .conftest import CASES, run_module


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


def _digests(bundle: Path) -> dict[str, str]:
    return {str(p.relative_to(bundle)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(bundle.rglob("*")) if p.is_file()}


def test_export_is_byte_reproducible(fp32_bundles, checkpoints, tmp_path: Path) -> None:
    variant, res, frames, max_len = CASES["tiny-64x32-f9"]
    again = tmp_path / "again"
    run_module("export", "--model", str(checkpoints[variant]), "--resolution", res, "--frames", str(frames),
               "--dtype", "fp32", "--max-sequence-length", str(max_len), "--out", str(again), "-q")
    first = _digests(fp32_bundles["tiny-64x32-f9"])
    assert set(first) == {"manifest.json", "tokenizer/tokenizer.json", "weights/text_encoder.safetensors",
                          "weights/transformer.safetensors", "weights/vae.safetensors",
                          "stages/text_encoder.jaxexport", "stages/cross_kv.jaxexport", "stages/denoise_step.jaxexport",
                          "stages/denoise_step_cond.jaxexport", "stages/denoise_step_residual.jaxexport",
                          "stages/denoise_step_cached.jaxexport", "stages/vae_decode_first.jaxexport",
                          "stages/vae_decode_next.jaxexport"}
    assert _digests(again) == first
