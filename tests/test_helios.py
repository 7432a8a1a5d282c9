"""Helios (issue 60): a video in chunks, each conditioned on the clean latents before it at three scales
(runtime/helios.py), against diffusers' HeliosPipeline on the same tiny random model, fp32, the same initial noise per
chunk. A chunk here is 3 latent frames (--frames 9), so three chunks carry history across chunk boundaries."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from .conftest import run_cli, run_module, shared

torch = pytest.importorskip("torch")

W, H, WINDOW, CHUNK = 64, 32, 9, 3  # pixels, frames per chunk, latent frames per chunk
TOL = 1e-4  # the issue's: frames within 1e-4 of diffusers in fp32


@pytest.fixture(scope="module")
def helios() -> tuple[Path, Path]:
    """(the tiny Helios checkpoint, its fp32 bundle of one 64x32 x 9-frame chunk)."""
    from export import tiny

    ckpt = shared("helios-checkpoint", lambda root: tiny.save("tiny-helios", root / "tiny-helios")) / "tiny-helios"
    bundle = shared("helios-bundle", lambda root: run_module(
        "export", "--model", str(ckpt), "--resolution", f"{W}x{H}", "--frames", str(WINDOW), "--dtype", "fp32",
        "--max-sequence-length", "16", "--out", str(root / "helios"), "-q"))
    return ckpt, bundle / "helios"


@pytest.fixture(scope="module")
def reference(helios: tuple[Path, Path]):  # noqa: ANN201 (diffusers' HeliosPipeline)
    """diffusers' HeliosPipeline on the checkpoint, taking the VAE posterior's mean where it samples (the runtime's
    encoder programs give the mean)."""
    from diffusers import HeliosPipeline
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    mp = pytest.MonkeyPatch()
    mp.setattr(DiagonalGaussianDistribution, "sample", lambda self, generator=None: self.mean)
    pipe = HeliosPipeline.from_pretrained(str(helios[0]), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    yield pipe
    mp.undo()


@pytest.fixture(scope="module")
def pipe(helios: tuple[Path, Path]):  # noqa: ANN201
    import runtime

    return runtime.load(helios[1])


def _noise(chunks: int, seed: int = 0) -> list[np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 16, CHUNK, H // 8, W // 8, generator=g).numpy() for _ in range(chunks)]


def _diffusers(ref, noise: list[np.ndarray], num_frames: int, sampler: str = "unipc", guidance: float = 5.0,
               **kw: object) -> np.ndarray:
    """HeliosPipeline's frames with `noise` as each chunk's prepare_latents draw."""
    it = iter(noise)
    ref.prepare_latents = lambda *a, **k: torch.from_numpy(next(it).copy())
    ref.scheduler.register_to_config(scheduler_type=sampler)
    try:
        return ref("a red cat", negative_prompt="blurry", height=H, width=W, num_frames=num_frames,
                   num_inference_steps=3, guidance_scale=guidance, num_latent_frames_per_chunk=CHUNK,
                   max_sequence_length=16, output_type="np", **kw).frames
    finally:
        del ref.prepare_latents
        ref.scheduler.register_to_config(scheduler_type="unipc")


def _ours(pipe, noise: list[np.ndarray], num_frames: int, sampler: str = "unipc", guidance: float = 5.0,
          **kw: object) -> np.ndarray:
    return pipe.generate("a red cat", "blurry", num_frames=num_frames, steps=3, guidance=guidance, sampler=sampler,
                         latents=noise, progress=False, **kw)


@pytest.mark.parametrize("num_frames, sampler, guidance", [(9, "unipc", 5.0), (20, "unipc", 5.0), (20, "euler", 1.0)])
def test_text_to_video_in_chunks_matches_diffusers(pipe, reference, num_frames: int, sampler: str,
                                                   guidance: float) -> None:
    """One chunk, and three (20 frames: rounded up to 27, trimmed to 25) with UniPC and CFG, or Euler without: the
    frames within 1e-4 of HeliosPipeline's; another chunk noise moves them far more."""
    chunks = -(-num_frames // WINDOW)
    noise = _noise(chunks)
    ours = _ours(pipe, noise, num_frames, sampler, guidance)
    ref = _diffusers(reference, noise, num_frames, sampler, guidance)
    assert ours.shape == ref.shape == (1, (chunks * WINDOW - 1) // 4 * 4 + 1, H, W, 3)
    assert np.abs(ours - ref).max() < TOL
    if chunks > 1:  # the last chunk depends on the chunks before it (its history), not only on its own noise
        other = _ours(pipe, [noise[0] * 0.5, *noise[1:]], num_frames, sampler, guidance)
        assert np.abs(other[:, -WINDOW:] - ours[:, -WINDOW:]).max() > 100 * TOL


def test_image_and_video_to_video_match_diffusers(pipe, reference) -> None:
    """Image-to-video (the image's latent as the prefix, a still chunk's last latent as the history) and continuing a
    20-frame video (its first frame the prefix, its last two whole chunks the history; only new frames returned),
    without the light noise on the given latents (drawn from torch's generator in diffusers): within 1e-4. Another
    video gives other frames."""
    from PIL import Image

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (H, W, 3), dtype=np.uint8))
    noise = _noise(2, seed=1)
    ours = _ours(pipe, noise, 18, image=image, add_noise_to_image_latents=False)
    ref = _diffusers(reference, noise, 18, image=image, add_noise_to_image_latents=False)
    assert ours.shape == ref.shape == (1, 17, H, W, 3) and np.abs(ours - ref).max() < TOL

    video = [Image.fromarray(rng.integers(0, 255, (H, W, 3), dtype=np.uint8)) for _ in range(20)]
    ours = _ours(pipe, noise, 10, video=video, add_noise_to_video_latents=False)
    ref = _diffusers(reference, noise, 10, video=video, add_noise_to_video_latents=False)
    assert ours.shape == ref.shape == (1, 17, H, W, 3) and np.abs(ours - ref).max() < TOL
    other = _ours(pipe, noise, 10, video=video[::-1], add_noise_to_video_latents=False)
    assert np.abs(other - ours).max() > 100 * TOL
    noised = _ours(pipe, noise, 10, video=video)  # the light noise, from the seed: close to, not at, the clean run
    assert 0 < np.abs(noised - ours).max()


def test_timestep_scale_1_feeds_the_helios_dit_sigma(helios: tuple[Path, Path], reference, tmp_path: Path) -> None:
    """A Helios bundle whose defaults say timestep_scale=1 (a checkpoint trained on t = sigma) is fed sigma x 1 in
    every chunk's steps, as every loop is (runtime/steps.py): two chunks' frames within 1e-4 of HeliosPipeline whose
    transformer is called with t / 1000, and not those of the released convention; export takes the key for a
    Helios model."""
    import dataclasses
    import shutil

    import runtime
    from export.build import defaults_for
    from runtime import kinds

    from .test_bundle_checks import _rewrite_manifest

    bundle = tmp_path / "bundle"
    shutil.copytree(helios[1], bundle)
    _rewrite_manifest(bundle, lambda m: m["defaults"].update(timestep_scale=1.0))
    pipe = runtime.load(bundle)
    noise = _noise(2, seed=4)
    ours = _ours(pipe, noise, 18)
    forward = reference.transformer.forward
    reference.transformer.forward = lambda *a, timestep, **k: forward(*a, timestep=timestep / 1000, **k)
    try:
        ref = _diffusers(reference, noise, 18)
    finally:
        del reference.transformer.forward
    assert ours.shape == ref.shape and np.abs(ours - ref).max() < TOL
    assert np.abs(ours - _ours(runtime.load(helios[1]), noise, 18)).max() > 100 * TOL
    base = pipe.manifest.defaults
    assert defaults_for(kinds.get("helios"), pipe.scheduler_config, dataclasses.replace(base, timestep_scale=1000.0),
                        {"timestep_scale": 1.0}).timestep_scale == 1.0


def test_helios_bad_input_is_one_line(pipe, helios: tuple[Path, Path], tmp_path: Path) -> None:
    """Settings Helios has no use for, a sampler its scheduler lacks, a video shorter than a chunk: one line each."""
    from runtime.errors import UserError

    cases = [(dict(flow_shift=3.0), "flow_shift is not a Helios setting"),
             (dict(sampler="dpm++"), "sampler dpm++ is not one of Helios' (unipc, euler)"),
             (dict(video=np.zeros((5, H, W, 3), np.uint8)), "the video has 5 frames, fewer than one chunk of 9"),
             (dict(last_image=np.zeros((H, W, 3), np.uint8)), "it takes no last image"),
             (dict(overlap_history=17), "overlap_history is for diffusion forcing"),
             (dict(image_noise_sigma_min=2.0), "image_noise_sigma_min must be a number in [0, 1]")]
    for kwargs, message in cases:
        with pytest.raises(UserError, match=re.escape(message)):
            pipe.generate("a cat", num_frames=9, steps=1, progress=False, **kwargs)
    out = tmp_path / "x.mp4"
    proc = run_cli("runtime", "generate", str(helios[1]), "--prompt", "a cat", "--steps", "1", "--sampler", "dpm++",
                   "--out", str(out), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not out.exists()
    assert proc.stderr.strip().splitlines()[-1].startswith("error: sampler dpm++ is not one of Helios'")


@pytest.fixture(scope="module")
def pyramids():  # noqa: ANN201 (variant -> (checkpoint, bundle), each made when first asked for)
    """HeliosPyramidPipeline checkpoints (CFG-Zero*, and the distilled one's DMD) and their 64x64 bundles (the pyramid
    halves the 8x8 latents twice), each exported when a test first asks for it (the slow tier's on its own)."""
    from export import tiny

    def get(variant: str) -> tuple[Path, Path]:
        ckpt = shared(f"{variant}-checkpoint", lambda root: tiny.save(variant, root / variant)) / variant
        bundle = shared(f"{variant}-bundle", lambda root: run_module(
            "export", "--model", str(ckpt), "--resolution", "64x64", "--frames", str(WINDOW), "--dtype", "fp32",
            "--max-sequence-length", "16", "--out", str(root / variant), "-q")) / variant
        return ckpt, bundle

    return get


@pytest.mark.parametrize("variant, steps, guidance, extra", [
    pytest.param("tiny-helios-pyramid", (1, 2, 3), 5.0, {}, marks=pytest.mark.slow),  # CFG-Zero*, its first step 0
    ("tiny-helios-distilled", (1, 1, 1), 1.0, {"is_amplify_first_chunk": True}),  # DMD; the first chunk's doubled
])
def test_pyramid_matches_diffusers(pyramids, variant: str, steps: tuple[int, ...], guidance: float,
                                   extra: dict) -> None:
    """HeliosPyramidPipeline in three chunks: each chunk's noise shrunk to a quarter, three stages each doubling the
    latents and renoising them with block noise (diffusers' draws given as `noise`), the Mid model's CFG-Zero* and the
    distilled model's DMD steps (two per stage in its amplified first chunk): frames within 1e-4 of diffusers'. Other
    block noise moves them far more, and a run without given draws takes its own from the seed (another seed, other
    frames)."""
    from diffusers import HeliosPyramidPipeline

    import runtime

    ckpt, bundle = pyramids(variant)
    ref = HeliosPyramidPipeline.from_pretrained(str(ckpt), dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    forward = ref.transformer.forward  # (its output is not contiguous, and CFG-Zero* .view()s it: fails on CPU)
    ref.transformer.forward = lambda *a, **k: tuple(o.contiguous() for o in forward(*a, **k))
    g = torch.Generator().manual_seed(0)
    latents = [torch.randn(1, 16, CHUNK, 8, 8, generator=g) for _ in range(3)]
    blocks = [[torch.randn(1, 16, CHUNK, 4, 4, generator=g), torch.randn(1, 16, CHUNK, 8, 8, generator=g)]
              for _ in range(3)]
    given, draws = iter(latents), iter([b for per in blocks for b in per])
    ref.prepare_latents = lambda *a, **k: next(given).clone()
    ref.sample_block_noise = lambda *a, **k: next(draws).clone()
    expected = ref("a red cat", negative_prompt="blurry", height=64, width=64, num_frames=20, guidance_scale=guidance,
                   num_latent_frames_per_chunk=CHUNK, max_sequence_length=16, output_type="np",
                   pyramid_num_inference_steps_list=list(steps), **extra).frames
    pipe = runtime.load(bundle)

    def ours(noise: object = None, seed: int = 0) -> np.ndarray:
        return pipe.generate("a red cat", "blurry", num_frames=20, guidance=guidance, seed=seed,
                             pyramid_num_inference_steps_list=list(steps), latents=[x.numpy() for x in latents],
                             noise=noise, progress=False, **extra)

    got = ours([[b.numpy() for b in per] for per in blocks])
    assert got.shape == expected.shape == (1, 25, 64, 64, 3)
    assert np.abs(got - expected).max() < TOL
    other = ours([[b.numpy() * 0.5 for b in per] for per in blocks])
    assert np.abs(other - got).max() > 100 * TOL
    assert np.abs(ours(seed=1) - ours()).max() > 100 * TOL  # the seed's own block noise


def test_a_helios_job_streams_each_chunk_as_it_is_made(pipe, tmp_path: Path) -> None:
    """The API on a Helios bundle: `seconds` of any length (0.9 s at 24 fps asks for 25 frames: three chunks of 9,
    trimmed to 25); its first chunk is served on the job's live stream while the job is in_progress; the ended
    playlist's three segments are the mp4's frames. Helios' settings by diffusers' names, checked before queueing:
    a pyramid's on a one-stage bundle, a sampler its scheduler lacks, a boolean that is not one: 400 naming the
    field. An extension continues the video (the source, then a new chunk); a remix is refused."""
    from runtime import hls
    from runtime.serve import worker

    from .test_stream import Gate, _app, _run_in_thread, assert_same_video, decode_ts, stream_frames

    client, state = _app(tmp_path, pipe)
    for body, field in (({"pyramid_num_inference_steps_list": [1, 1, 1]}, "pyramid_num_inference_steps_list"),
                        ({"sampler": "dpm++"}, "sampler"), ({"add_noise_to_image_latents": "yes"},
                                                            "add_noise_to_image_latents"),
                        ({"seconds": "3"}, "seconds")):  # past the server's max_seconds (2)
        bad = client.post("/v1/videos", json={"prompt": "a cat", **body})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, bad.text
    model = client.get("/v1/models").json()["data"][0]
    assert model["helios"] and model["pyramid"] == 1 and model["max_seconds"] == 2.0
    created = client.post("/v1/videos", json={"prompt": "a red cat", "seconds": "0.9", "num_inference_steps": 2,
                                              "add_noise_to_image_latents": False, "seed": 3})
    assert created.status_code == 200, created.text
    vid = created.json()["id"]
    assert created.json()["seconds"] == f"{25 / 24:g}"
    gate = Gate(state.store.storage)
    thread = _run_in_thread(state, state.store.claim())
    assert gate.written.wait(120)
    try:
        assert client.get(f"/v1/videos/{vid}").json()["status"] == "in_progress"
        playlist = hls.Playlist.parse(client.get(f"/v1/videos/{vid}/stream.m3u8").text)
        assert playlist.durations == pytest.approx([9 / 24]) and not playlist.ended
        assert decode_ts(client.get(f"/v1/videos/{vid}/stream/0.ts").content).shape == (9, H, W, 3)
    finally:
        gate.go.set()
        thread.join(120)
    assert client.get(f"/v1/videos/{vid}").json()["status"] == "completed"
    playlist, frames = stream_frames(client.get(f"/v1/videos/{vid}/stream.m3u8").text,
                                     lambda name: client.get(f"/v1/videos/{vid}/{name}").content)
    assert playlist.ended and playlist.durations == pytest.approx([9 / 24, 9 / 24, 7 / 24], abs=1e-5)
    video = decode_ts(client.get(f"/v1/videos/{vid}/content").content)
    assert_same_video(frames, video)

    # An extension continues the completed video from its last whole chunks: the source, then the new chunk.
    extended = client.post("/v1/videos/extensions", json={"video": {"id": vid}, "prompt": "a red cat runs",
                                                           "seconds": "0.3", "num_inference_steps": 1})
    assert extended.status_code == 200, extended.text
    ext = extended.json()["id"]
    worker._run(state, state.store.claim())
    assert client.get(f"/v1/videos/{ext}").json()["status"] == "completed"
    joined = decode_ts(client.get(f"/v1/videos/{ext}/content").content)
    assert joined.shape == (25 + 9, H, W, 3)
    assert np.abs(joined[:25].astype(np.float32) - video.astype(np.float32)).mean() < 3  # the source, re-encoded
    remix = client.post(f"/v1/videos/{vid}/remix", json={"prompt": "a blue cat"})
    assert remix.status_code == 400 and "its videos cannot be remixed or edited" in remix.json()["error"]["message"]


def test_a_pyramid_refuses_latents_it_cannot_halve(tmp_path: Path) -> None:
    """helios-mid from its architecture name at 720p: its 160x90 latents do not divide into the pyramid's 8s. One
    line, exit 2, nothing written (before any tracing)."""
    out = tmp_path / "b"
    proc = run_cli("export", "--model", "helios-mid", "--no-weights", "--resolution", "720p", "--out", str(out),
                   check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not out.exists()
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: 1280x720: a Helios pyramid of 3 stages halves the latents (160x90) 2 times, so they must divide by 8: "
        "give a resolution whose width and height are multiples of 64")


@pytest.mark.slow
@pytest.mark.parametrize("name, kind, stages", [("helios-base", "helios", 1), ("helios-distilled", "helios-distilled",
                                                                                3)])
def test_programs_from_architecture_names(tmp_path: Path, name: str, kind: str, stages: int) -> None:
    """The released 14B's programs from its name alone (--no-weights) at its default shape, one chunk of 33 frames at
    640x384 for a v6e-8 slice: the kind, the chunk settings, and each pyramid stage's DiT program on its latents
    (80x48, 40x24, 20x12) with the history at full size."""
    out = tmp_path / name
    run_module("export", "--model", name, "--no-weights", "--resolution", "640x384", "--target", "tpu-v6e-8",
               "--out", str(out), "-q")
    m = __import__("runtime.manifest", fromlist=["read"]).read(out)
    assert m.kind == kind and m.geometry.frames == 33 and m.chunks.stages == stages
    assert m.chunks.distilled == (name == "helios-distilled")
    for k in range(stages):
        f = 2 ** (stages - 1 - k)
        spec = m.programs["denoise_step" + ("" if k == stages - 1 else f"_stage{k}")]
        assert spec.inputs["state"].shape == (4, 1, 16, 9, 48 // f, 80 // f)
        assert spec.inputs["history"].shape == (1, 16, 20, 48, 80)
