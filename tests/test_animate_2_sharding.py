"""Wan-Animate 2 on a mesh (issue 73; export/sharding.py, export/animate2.py): the 14B DiT's tensors, under their
original Wan names, split as the Wan DiT's (diffusers' names) are; a tiny animate-2 bundle exported for cpu-8 (dp, sp,
tp of 2) makes the frames of the one-device bundle on 8 devices (1e-5), with CFG (the batch over dp, block 9 skipped
for the unconditional half) and without (the tokens over dp and sp)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from .conftest import devices_env, in_parallel, run_module, shared

# WanAnimate2Transformer3DModel's names -> diffusers' WanTransformer3DModel's (the rules written for the latter)
_WAN_NAMES = [
    (r"\.self_attn\.", ".attn1."), (r"\.cross_attn\.", ".attn2."), (r"\.ffn\.0\.", ".ffn.net.0.proj."),
    (r"\.ffn\.2\.", ".ffn.net.2."), (r"^time_projection\.1\.", "condition_embedder.time_proj."),
    (r"^(time|text)_embedding\.0\.", r"condition_embedder.\1_embedder.linear_1."),
    (r"^(time|text)_embedding\.2\.", r"condition_embedder.\1_embedder.linear_2."),
]


def test_the_14b_dit_is_split_as_the_wan_dit() -> None:
    """Every tensor of the 14B architecture's DiT (built on meta) gets the partition its diffusers-named counterpart
    gets on tpu-v6e-8's mesh; the blocks' attention and FFN and the time/text embedders are split over tp (7.65 GiB
    per device of 30.5, not all of it)."""
    from export import sharding
    from export.source import load

    module = load("wan-animate-2-14b", "bf16", weights=False).load_transformer("transformer")
    mesh = {"dp": 2, "sp": 1, "tp": 4}
    total = per_device = 0.0
    split = 0
    for name, t in module.named_parameters():
        shape = tuple(t.shape)
        ours = sharding.partition("wan_transformer", name, shape, mesh)
        wan = name
        for pattern, repl in _WAN_NAMES:
            wan = re.sub(pattern, repl, wan)
        assert ours == sharding.partition("wan_transformer", wan, shape, mesh), (name, wan)
        pieces = int(np.prod([sharding._axis_size(mesh, e) for e in ours if e is not None]))
        split += pieces > 1
        total += t.numel() * 2
        per_device += t.numel() * 2 / pieces
    assert split == 1050  # 40 blocks x 26, and the time projection's and embedders' 10
    for name in ("blocks.7.self_attn.to_q.weight", "blocks.7.cross_attn.add_v_proj.weight", "blocks.7.ffn.0.weight",
                 "time_projection.1.weight", "text_embedding.2.weight"):
        assert sharding.partition("wan_transformer", name, (5120, 5120), mesh) == sharding.PartitionSpec("tp")
    for name in ("blocks.7.self_attn.to_out.0.weight", "blocks.7.ffn.2.weight"):
        assert sharding.partition("wan_transformer", name, (5120, 13824), mesh) == sharding.PartitionSpec(None, "tp")
    assert total / 2**30 > 30 and per_device / 2**30 < 8


@pytest.mark.slow  # an export for cpu-8 and four generations: about a minute
def test_same_frames_on_1_device_and_8(tmp_path: Path) -> None:
    """Two segments of the tiny base model (ten blocks), with CFG and a negative prompt and without, on the
    one-device bundle and on a cpu-8 bundle (dp, sp, tp of 2) on 8 devices: the same frames (1e-5)."""
    from safetensors.numpy import load_file

    from .test_animate_2 import SEGMENT, TEXT, H, W, _build, _image, _video, _write_mp4

    ckpt = shared("tiny-animate-2-checkpoint", lambda root: _build("tiny-animate-2").save_pretrained(
        str(root / "ckpt"), overwrite_modular_index=True)) / "ckpt"
    common = ["--model", str(ckpt), "--resolution", f"{W}x{H}", "--frames", str(SEGMENT), "--dtype", "fp32",
              "--max-sequence-length", str(TEXT), "-q"]
    one = shared("tiny-animate-2-bundle", lambda root: run_module("export", *common, "--out", str(root / "b"))) / "b"
    eight = tmp_path / "cpu8"
    run_module("export", *common, "--target", "cpu-8", "--out", str(eight))
    _image().save(tmp_path / "me.png")
    mp4 = _write_mp4(tmp_path / "dance.mp4", _video(14, width=W, height=H), 24.0)
    args = ["--image", str(tmp_path / "me.png"), "--driving-video", str(mp4), "--prompt", "a cat dancing",
            "--steps", "2", "--seed", "3", "-q"]
    cases = {"cfg": ["--guidance", "3", "--negative-prompt", "blurry"], "cond": ["--guidance", "1"]}

    def run(bundle: Path, case: str, env: dict[str, str] | None) -> np.ndarray:
        out = tmp_path / f"{bundle.name}-{case}.safetensors"
        run_module("runtime", "generate", str(bundle), *args, *cases[case], "--out", str(out.with_suffix(".mp4")),
                   "--frames-out", str(out), env=env)
        return load_file(str(out))["frames"]

    for case in cases:
        ours_one, ours_eight = in_parallel(lambda c=case: run(one, c, None),
                                           lambda c=case: run(eight, c, devices_env(8)))
        assert ours_one.shape == (1, 14, H, W, 3), ours_one.shape
        diff = float(np.abs(ours_one - ours_eight).max())
        print(f"{case}: max abs diff {diff:.3g}")
        assert diff <= 1e-5, (case, diff)
