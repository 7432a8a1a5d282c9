"""Wan-Animate 2 (issue 73; kinds animate-2 and animate-2-distilled: export/animate2.py, runtime/animate2.py) against
diffusers' modular pipelines (WanAnimate2ModularPipeline, WanAnimate2DistilledModularPipeline) on the same tiny random
models (export/tiny.py tiny-animate-2: ten blocks, so CFG's unconditional branch skips block 9; the distilled in two,
which the segment tests run), fp32, 9-frame segments at 32x48, each segment's initial noise the one diffusers drew
(its randn_tensor calls recorded), within 1e-4: one segment with guidance and a negative prompt; three segments
carrying 1 frame, the driving video not ending on a segment boundary; two carrying 5; five carried over three
segments, where diffusers fails and the runtime runs (its first two segments diffusers' own); a driving video at
another frame rate, resampled, and shorter than a segment; the distilled pipeline. A driving video shorter than half
a segment, where diffusers fails, runs. The inputs' preparation against the blocks that prepare them; the CLI, and
its bad input in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .conftest import run_cli, run_module, shared

torch = pytest.importorskip("torch")

W, H, SEGMENT = 32, 48, 9
TOL = 1e-4
PROMPT, NEGATIVE = "a cat dancing", "blurry"
TEXT = 16  # --max-sequence-length: the prompts' rows (the DiT pads them to its text_len, 512, as diffusers' does)


def _image(width: int = 34, height: int = 50, seed: int = 0) -> Any:
    """A character image a little wider than 2:3: letterboxed with bars, resolving to 32x48."""
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _video(frames: int, seed: int = 1, width: int = 40, height: int = 28) -> list[Any]:
    """Landscape driving frames (letterboxed with bars above and below), smooth enough for a VAE to tell apart."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height, width, 3)).astype(np.float32)
    drift = rng.normal(0, 40, (height, width, 3)).astype(np.float32)
    return [Image.fromarray(np.clip(base + drift * (i / max(frames - 1, 1)), 0, 255).astype(np.uint8))
            for i in range(frames)]


_BUILT: dict[str, Any] = {}  # the modular pipelines this process built (and saved): diffusers' references


def _build(variant: str) -> Any:
    from export import tiny

    if variant not in _BUILT:
        _BUILT[variant] = tiny.build_modular(variant)
    return _BUILT[variant]


@pytest.fixture(scope="module")
def bundles() -> dict[str, Path]:
    """The tiny checkpoints' fp32 bundles at 32x48 x 9 frames: "base" and "distilled"."""
    out = {}
    for name, variant in (("base", "tiny-animate-2"), ("distilled", "tiny-animate-2-distilled")):
        ckpt = shared(f"{variant}-checkpoint", lambda root, v=variant: _build(v).save_pretrained(
            str(root / "ckpt"), overwrite_modular_index=True)) / "ckpt"
        out[name] = shared(f"{variant}-bundle", lambda root, c=ckpt: run_module(
            "export", "--model", str(c), "--resolution", f"{W}x{H}", "--frames", str(SEGMENT), "--dtype", "fp32",
            "--max-sequence-length", str(TEXT), "--out", str(root / "b"), "-q")) / "b"
    return out


@pytest.fixture(scope="module")
def references(bundles: dict[str, Path]) -> dict[str, Any]:
    """diffusers' modular pipelines of the same seeded models (export/tiny.py build_modular; those the checkpoints
    were saved from, where this process saved them)."""
    return {"base": _build("tiny-animate-2"), "distilled": _build("tiny-animate-2-distilled")}


@pytest.fixture(scope="module")
def pipes(bundles: dict[str, Path]) -> dict[str, Any]:
    import runtime

    return {name: runtime.load(path) for name, path in bundles.items()}


def _diffusers(pipe: Any, driving: list[Any], guidance: float | None = None, extra_noise: int = 0, steps: int = 1,
               **kw: Any) -> tuple[np.ndarray, list[np.ndarray]]:
    """diffusers' frames (1, n, H', W', 3) and the initial noise it drew for each segment (`extra_noise` more drawn
    after them, for segments it does not reach)."""
    import diffusers.modular_pipelines.wan_animate_2.denoise as blocks
    from diffusers.guiders import ClassifierFreeGuidance

    if guidance is not None:
        pipe.update_components(guider=ClassifierFreeGuidance(guidance_scale=guidance))
    drawn: list[np.ndarray] = []
    original = blocks.randn_tensor

    def record(*args: Any, **kwargs: Any) -> Any:
        x = original(*args, **kwargs)
        drawn.append(x.numpy().copy())
        return x

    blocks.randn_tensor = record
    try:
        generator = torch.Generator().manual_seed(0)
        frames = pipe(prompt=PROMPT, image=_image(), driving_video=driving, height=H, width=W,
                      segment_frame_length=SEGMENT, max_sequence_length=TEXT, num_inference_steps=steps,
                      generator=generator, output="videos", **kw)
    finally:
        blocks.randn_tensor = original
    extra = [torch.randn(*drawn[0].shape, generator=generator).numpy() for _ in range(extra_noise)]
    return np.asarray(frames), drawn + extra


def _ours(pipe: Any, driving: list[Any], noise: list[np.ndarray], steps: int = 1, **kw: Any) -> np.ndarray:
    return pipe.generate(PROMPT, image=_image(), driving_video=driving, steps=steps, latents=noise, progress=False,
                         **kw)


def _close(ours: np.ndarray, theirs: np.ndarray) -> float:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    diff = float(np.abs(ours - theirs).max())
    print(f"max abs diff {diff:.3g}")  # (pytest -s shows each case's figure)
    assert diff < TOL, diff
    return diff


def test_one_segment_with_guidance_and_a_negative_prompt(pipes, references) -> None:
    """CFG at 3.0 (the blocks' default guider) with a negative prompt: the unconditional branch skips block 9."""
    theirs, noise = _diffusers(references["base"], _video(9), guidance=3.0, negative_prompt=NEGATIVE)
    assert len(noise) == 1 and noise[0].shape == (16, 4, H // 8, W // 8) and theirs.shape == (1, 9, H, W, 3)
    _close(_ours(pipes["base"], _video(9), noise, negative_prompt=NEGATIVE, guidance=3.0), theirs)


def test_three_segments_carrying_one_frame_of_a_video_off_the_boundary(pipes, references) -> None:
    """23 frames, segments of 9 advancing 8: padded with its last 2 frames mirrored to 25, cut back to 23 (the
    segment tests run the distilled model: the same loop and programs as the base one's, in two blocks)."""
    theirs, noise = _diffusers(references["distilled"], _video(23), prev_segment_conditioning_frames=1)
    assert len(noise) == 3 and theirs.shape[1] == 23
    _close(_ours(pipes["distilled"], _video(23), noise, prev_segment_conditioning_frames=1), theirs)


@pytest.fixture(scope="module")
def five_carried(references) -> tuple[np.ndarray, list[np.ndarray]]:
    """diffusers' two segments of 9 carrying 5 (13 frames), and the noise of a third segment drawn after them."""
    return _diffusers(references["distilled"], _video(17)[:13], prev_segment_conditioning_frames=5, extra_noise=1)


def test_two_segments_carrying_five_frames(pipes, five_carried) -> None:
    theirs, noise = five_carried
    _close(_ours(pipes["distilled"], _video(17)[:13], noise[:2], prev_segment_conditioning_frames=5), theirs)


def test_five_frames_over_three_segments_runs_where_diffusers_fails(pipes, five_carried) -> None:
    """diffusers' third segment would carry the 4 frames its second kept, not 5 (it fails: see the slow test); the
    runtime carries the video's last 5, and its first two segments are diffusers' own."""
    theirs, noise = five_carried
    ours = _ours(pipes["distilled"], _video(17), noise, prev_segment_conditioning_frames=5)
    assert ours.shape == (1, 17, H, W, 3) and np.isfinite(ours).all()
    _close(ours[:, :13], theirs)


@pytest.mark.slow
def test_diffusers_fails_with_five_frames_over_three_segments(references) -> None:
    """What the default test above says of diffusers 0.42.1."""
    with pytest.raises(ValueError, match="Each sample must hold exactly `seq_len`"):
        _diffusers(references["distilled"], _video(17), prev_segment_conditioning_frames=5)


def test_a_driving_video_at_another_fps_shorter_than_a_segment(pipes, references) -> None:
    """10 frames at 30 fps are 8 at 24 (nearest frame), one frame short of a segment: padded with its last frame."""
    theirs, noise = _diffusers(references["distilled"], _video(10), driving_video_fps=30.0, fps=24)
    assert theirs.shape[1] == 8
    _close(_ours(pipes["distilled"], _video(10), noise, driving_video_fps=30.0, fps=24), theirs)


def test_a_driving_video_shorter_than_half_a_segment(pipes) -> None:
    """3 frames need 6 of padding: diffusers' mirror slice gives 3 and it fails (the slow test below); the runtime
    mirrors back and forth ([0 1 2 | 2 1 0 0 1 2]) and makes 3 frames. A video no longer than the frames carried
    makes no segment (diffusers fails at its end): refused in one line."""
    from runtime.errors import UserError

    ours = _ours(pipes["distilled"], _video(3), [np.zeros((16, 4, H // 8, W // 8), np.float32)])
    assert ours.shape == (1, 3, H, W, 3) and np.isfinite(ours).all()
    with pytest.raises(UserError, match=r"the driving video has 1 frame \(after resampling to the fps\): it needs "
                                        r"more than prev_segment_conditioning_frames \(1\)"):
        _ours(pipes["distilled"], _video(1), None)


@pytest.mark.slow
def test_diffusers_fails_with_a_driving_video_shorter_than_half_a_segment(references) -> None:
    """What the default test above says of diffusers 0.42.1."""
    with pytest.raises(ValueError, match="Each sample must hold exactly `seq_len`"):
        _diffusers(references["distilled"], _video(3))


def test_the_distilled_pipeline(pipes, references) -> None:
    """WanAnimate2DistilledModularPipeline: no CFG (its guider's 1.0 is the bundle's default guidance)."""
    assert pipes["distilled"].manifest.defaults.guidance == 1.0 and pipes["distilled"].manifest.defaults.steps == 10
    theirs, noise = _diffusers(references["distilled"], _video(9), steps=2)
    _close(_ours(pipes["distilled"], _video(9), noise, steps=2), theirs)


def test_inputs_are_prepared_as_the_blocks_prepare_them() -> None:
    """The frame size, crop, letterboxes, frame rate resampling, segments and CLIP pixels of runtime/animate2_media.py
    against the blocks that make them (no model)."""
    import torch.nn.functional as F
    from diffusers.modular_pipelines.wan_animate_2 import encoders
    from PIL import Image

    from runtime import animate2_media as media

    images_ = encoders.WanAnimate2ProcessImagesInputStep().init_pipeline()
    videos = encoders.WanAnimate2ProcessVideosInputStep().init_pipeline()
    for (iw, ih), (w, h) in [((34, 50), (32, 48)), ((300, 200), (832, 480)), ((123, 457), (640, 800)),
                             ((640, 640), (640, 800)), ((97, 61), (480, 480))]:
        img = _image(iw, ih, seed=iw)
        state = images_(image=img, height=h, width=w, output=["height", "width", "crop_region", "image_pixels"])
        size = media.frame_size((iw, ih), w * h, 16)
        assert size == (state["width"], state["height"])
        assert media.crop_region(size, (iw, ih), 16) == tuple(state["crop_region"])
        np.testing.assert_array_equal(media.letterbox(img, *size, media.IMAGE_RESAMPLE),
                                      state["image_pixels"][0].numpy())
        pixels = state["image_pixels"][0]
        want = F.interpolate(pixels[None], size=(224, 224), mode="bicubic", align_corners=False) * 0.5 + 0.5
        want = (want - torch.tensor(media.CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(media.CLIP_STD).view(1, 3, 1, 1)
        assert np.abs(media.clip_pixels(pixels.numpy()) - want.numpy()).max() < 3e-5  # float32 sums, other order
    for n, fps_in, fps in [(10, 30.0, 24), (31, 29.97, 24), (7, 12.0, 24), (50, 25.0, 16)]:
        assert media.frame_indices(n, fps_in, fps) == encoders.get_frame_indices(n, fps_in, fps)
    frames = [Image.fromarray(np.full((40, 56, 3), i * 3, np.uint8)) for i in range(81)]
    for n, length, prev in [(23, 9, 1), (13, 9, 5), (8, 9, 1), (9, 9, 1), (30, 13, 5), (5, 9, 1), (81, 81, 1)]:
        state = videos(driving_video=frames[:n], height=64, width=48, segment_frame_length=length,
                       prev_segment_conditioning_frames=prev, output=["driving_video_pixels", "num_segments"])
        seg = media.segments(n, length, prev)
        assert seg.count == state["num_segments"], (n, length, prev)
        ours = np.stack([media.letterbox(frames[i], 48, 64, media.VIDEO_RESAMPLE) for i in seg.padded()], axis=1)
        np.testing.assert_array_equal(ours, state["driving_video_pixels"][0].numpy())


def _write_mp4(path: Path, frames: list[Any], fps: float) -> Path:
    import imageio.v2 as imageio

    with imageio.get_writer(str(path), fps=fps, codec="libx264", quality=10, macro_block_size=1) as writer:
        for f in frames:
            writer.append_data(np.asarray(f))
    return path


def test_the_cli_animates_an_mp4_at_its_own_frame_rate(bundles, pipes, tmp_path) -> None:
    """--driving-video FILE at 30 fps is resampled to --fps 24 by default, as Python's driving_video_fps=30; the mp4
    and the HLS stream are written."""
    from safetensors.numpy import load_file

    from runtime import video_input

    _image().save(tmp_path / "me.png")
    mp4 = _write_mp4(tmp_path / "dance.mp4", _video(10, width=W, height=H), 30.0)
    out, stream = tmp_path / "out.mp4", tmp_path / "hls"
    run_cli("runtime", "generate", str(bundles["distilled"]), "--image", str(tmp_path / "me.png"), "--driving-video",
            str(mp4), "--prompt", PROMPT, "--steps", "1", "--prompt-ref", "a dance", "--out", str(out),
            "--frames-out", str(tmp_path / "f.safetensors"), "--stream", str(stream), "-q")
    frames = load_file(str(tmp_path / "f.safetensors"))["frames"]
    assert frames.shape == (1, 8, H, W, 3) and out.is_file() and (stream / "stream.m3u8").is_file()
    frames_in = video_input.load_frames(mp4)
    ours = pipes["distilled"].generate(PROMPT, image=str(tmp_path / "me.png"), driving_video=frames_in,
                                       driving_video_fps=30.0, steps=1, prompt_ref="a dance", progress=False)
    assert np.abs(ours - frames).max() == 0


def test_bad_input_is_one_line_and_writes_nothing(bundles, tmp_path) -> None:
    _image().save(tmp_path / "me.png")
    _image(48, 32).save(tmp_path / "wide.png")  # resolves to 48x32: the bundle makes 32x48 only
    mp4 = _write_mp4(tmp_path / "dance.mp4", _video(9), 24.0)
    (tmp_path / "notes.mp4").write_text("not a video")
    out = tmp_path / "out.mp4"
    cases = [
        (["--driving-video", str(mp4)], "error: Wan-Animate 2 needs the character's image"),
        (["--image", str(tmp_path / "me.png")], "error: Wan-Animate 2 needs a driving video"),
        (["--image", str(tmp_path / "me.png"), "--driving-video", str(tmp_path / "notes.mp4")],
         "error: driving video: cannot read notes.mp4 as a video"),
        (["--image", str(tmp_path / "wide.png"), "--driving-video", str(mp4)],
         "error: the image (48x32) makes a 48x32 video (Wan-Animate 2 keeps its aspect), and this bundle makes 32x48"),
        (["--image", str(tmp_path / "me.png"), "--driving-video", str(mp4), "--prev-segment-conditioning-frames",
          "9"], "error: prev_segment_conditioning_frames must be a whole number from 0 to 8"),
    ]
    for args, message in cases:
        proc = run_cli("runtime", "generate", str(bundles["distilled"]), "--prompt", "a", "--steps", "1", *args,
                       "--out", str(out), check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.startswith(message) and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
        assert not out.exists()


@pytest.mark.slow
def test_the_tiny_decoder_decodes_each_segment(tmp_path) -> None:
    """--tiny-decoder on an animate-2 bundle: decoder="tiny" decodes each segment's latents (frame 0, the image's
    slot, dropped) as TAEHV does, and the frames it carries into the next segment are those (a variant of the decode
    the default tests run with the VAE)."""
    import runtime

    from . import taehv_reference as ref

    dec = ref.make_file(tmp_path / "taew2_1.safetensors", 16, 1, (16, 8, 8, 8), dtype=torch.float16)
    variant = "tiny-animate-2-distilled"
    ckpt = shared(f"{variant}-checkpoint", lambda root: _build(variant).save_pretrained(
        str(root / "ckpt"), overwrite_modular_index=True)) / "ckpt"
    run_module("export", "--model", str(ckpt), "--resolution", f"{W}x{H}", "--frames", str(SEGMENT), "--dtype", "fp32",
               "--max-sequence-length", str(TEXT), "--tiny-decoder", str(tmp_path / "taew2_1.safetensors"), "--out",
               str(tmp_path / "b"), "-q")
    pipe = runtime.load(tmp_path / "b")
    seen: list[np.ndarray] = []
    decode = pipe.decode

    def recording(latents: np.ndarray, decoder: str = "full") -> np.ndarray:
        assert decoder == "tiny"
        seen.append(latents)
        return decode(latents, decoder)

    pipe.decode = recording
    frames = pipe.generate(PROMPT, image=_image(), driving_video=_video(17), steps=1, decoder="tiny", progress=False)
    assert frames.shape == (1, 17, H, W, 3) and len(seen) == 2 and seen[0].shape == (1, 16, 3, H // 8, W // 8)
    taehv = [ref.decode(dec, torch.from_numpy(x).permute(0, 2, 1, 3, 4), 1).permute(0, 1, 3, 4, 2).numpy()
             for x in seen]
    assert np.abs(np.concatenate([taehv[0], taehv[1][:, 1:]], axis=1) - frames).max() < TOL
