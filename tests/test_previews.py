"""Live previews and a finished video's images: the latent-to-RGB map of each latent family, the latent frame that
decodes to the video's middle frame, the device projection of the scheduler's denoised estimate against the host's
(on the tiny bundle, in this process), the spritesheet's geometry, and the preview writer that keeps only the latest.
The served side (a running job's thumbnail, a completed one's) is in tests/test_serve.py."""

from __future__ import annotations

import io
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from runtime import previews
from runtime.serve import thumbnails


def test_latent_families_and_the_middle_frame() -> None:
    assert previews.family(16) is previews.WAN21 and previews.family(48) is previews.WAN22
    assert previews.family(12) is None  # no map, no preview
    for fam in (previews.WAN21, previews.WAN22):
        assert np.asarray(fam.factors).shape == (fam.channels, 3) and len(fam.bias) == 3
    # ComfyUI's published constants (comfy/latent_formats.py): spot-check a row and the bias of each
    assert previews.WAN21.factors[6] == (-0.3477, -0.4059, -0.2925) and previews.WAN21.bias[2] == -0.3360
    assert previews.WAN22.factors[39] == (-0.3441, -0.3543, -0.2008) and previews.WAN22.bias[2] == -0.1388
    # latent frame 0 decodes to frame 0, latent frame t > 0 to frames 4t-3 .. 4t
    for frames, refs, want in ((81, 0, 10), (9, 0, 1), (5, 0, 1), (1, 0, 0), (13, 0, 2), (9, 1, 2), (121, 0, 15)):
        g = SimpleNamespace(frames=frames, temporal_scale=4, reference_images=refs)
        assert previews.middle_frame(g) == want, (frames, refs)
        f = (frames - 1) // 2
        assert want - refs == (0 if f == 0 else -(-f // 4))  # the latent frame holding video frame f
    rgb = previews.latent_rgb(np.zeros((16, 2, 3), np.float32), previews.WAN21)  # x0 = 0: the bias, [-1, 1] -> [0, 1]
    assert rgb.shape == (2, 3, 3) and rgb.dtype == np.uint8
    assert rgb[0, 0].tolist() == [int((b + 1) / 2 * 255) for b in previews.WAN21.bias]


def test_the_step_previews_are_the_denoised_estimate_of_the_middle_frame(fp32_bundles) -> None:
    """Every step gives a preview at the latents' resolution; they change from step to step; and the last one is the
    final latents' middle frame through the map (after the last step the estimate is the result: sigma is 0)."""
    import runtime

    pipe = runtime.load(fp32_bundles["tiny-64x32-f9"])
    g = pipe.geometry
    got: list[np.ndarray] = []
    embeds = pipe.encode("a red fox in the snow")
    latents = pipe.denoise(embeds, seed=3, steps=3, progress=False, on_preview=got.append)
    assert len(got) == 3 and all(p.shape == (g.latent_height, g.latent_width, 3) and p.dtype == np.uint8 for p in got)
    assert all(np.any(a != b) for a, b in zip(got, got[1:]))
    want = previews.latent_rgb(latents[0, :, previews.middle_frame(g)], previews.family(g.latent_channels))
    assert np.abs(got[-1].astype(int) - want).max() <= 1  # float rounding at the uint8 boundary
    assert np.array_equal(pipe.denoise(embeds, seed=3, steps=3, progress=False), latents)  # no preview: the same run
    big = previews.upscale(got[-1], g.width, g.height)
    assert big.size == (g.width, g.height)


@pytest.mark.parametrize("frames,width,height", [(9, 64, 32), (40, 1280, 720), (1, 48, 48), (17, 32, 64)])
def test_the_spritesheet_geometry(frames: int, width: int, height: int) -> None:
    """n = min(16, F) evenly spaced frames (the first and the last among them), tiles at most 256 wide keeping the
    aspect, rows of ceil(sqrt(n)), left to right and top to bottom, black after the last: as thumbnails.py documents."""
    from PIL import Image

    colours = np.random.default_rng(frames).integers(30, 225, (frames, 3))
    video = np.broadcast_to(colours[:, None, None, :], (frames, height, width, 3)).astype(np.uint8)
    n, columns, rows, tw, th = thumbnails.spritesheet_geometry(frames, width, height)
    indices = thumbnails.sprite_indices(frames)
    assert n == min(16, frames) == len(indices) and indices[0] == 0 and indices[-1] == frames - 1
    assert columns == int(np.ceil(np.sqrt(n))) and rows == int(np.ceil(n / columns))
    assert tw == min(width, 256) and th == round(height * tw / width)
    sheet = np.asarray(Image.open(io.BytesIO(thumbnails.spritesheet(video))).convert("RGB")).astype(int)
    assert sheet.shape == (rows * th, columns * tw, 3)
    for k in range(columns * rows):
        top, left = (k // columns) * th, (k % columns) * tw
        cell = sheet[top + 2:top + th - 2, left + 2:left + tw - 2]
        want = colours[indices[k]] if k < n else np.zeros(3)
        assert np.abs(cell.mean(axis=(0, 1)) - want).max() < 6, (k, cell.mean(axis=(0, 1)), want)
    thumb = np.asarray(Image.open(io.BytesIO(thumbnails.thumbnail(video))).convert("RGB")).astype(int)
    assert thumb.shape == (height, width, 3) and np.abs(thumb - video[0]).max() < 8


def test_the_preview_writer_keeps_only_the_latest() -> None:
    """The first preview is stored at once (a client that sees the step's progress finds it); after it, a slow store
    never holds the offering thread up nor builds a backlog: offers while one is being stored replace the one waiting,
    and the last one offered is the one stored at the end."""
    from PIL import Image

    stored: list[bytes] = []
    gate = threading.Event()

    class SlowStorage:
        def put(self, key: str, data: bytes, retry: bool = True) -> None:
            assert not retry  # a preview does not hold the job up while a store fails
            if stored:  # the stores after the first are slow
                gate.wait(5)
            stored.append(data)

    writer = thumbnails.PreviewWriter(SlowStorage(), "previews/x-1.png")
    t0 = time.perf_counter()
    for i in range(50):
        writer.offer(np.full((2, 3, 3), i, np.uint8))
    assert time.perf_counter() - t0 < 4.0  # a hand-over, not a store: one blocked store would wait 5 s
    gate.set()
    writer.close()
    assert 2 <= len(stored) <= 4 and writer.written == len(stored)
    assert np.asarray(Image.open(io.BytesIO(stored[0])))[0, 0].tolist() == [0, 0, 0]
    assert np.asarray(Image.open(io.BytesIO(stored[-1])))[0, 0].tolist() == [49, 49, 49]
