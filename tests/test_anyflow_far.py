"""AnyFlow-FAR (issue 71): causal chunks with a KV cache (kind anyflow-far: export/far.py, runtime/far.py) against
diffusers' AnyFlowFARPipeline on the same tiny random model (tiny-anyflow-far: chunks (1, 2, 2, 2), a full-chunk
limit of 2, so chunks of two sizes and compressed context), fp32, the same initial latents, within 1e-4: text-to-video
at 1, 2 and 4 steps, guidance with a negative prompt, use_mean_velocity=False, an image and a video of whole chunks as
context, and a prompt switch (the cache re-encoded under the new prompt: the video of AnyFlowFARPipeline run with the
new prompt and the latents made before as video_latents). The stream's chunks join into the whole video."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from .conftest import run_cli, run_module, shared

torch = pytest.importorskip("torch")

W, H, FRAMES = 64, 32, 25  # 7 latent frames: chunks (1, 2, 2, 2)
LATENT = (1, 16, 7, H // 8, W // 8)
TOL = 1e-4
PROMPT, NEGATIVE, OTHER = "a red cat", "blurry", "a blue dog"


@pytest.fixture(scope="module")
def far() -> tuple[Path, Path]:
    """(the tiny AnyFlow-FAR checkpoint, its fp32 bundle at 64x32 x 25 frames)."""
    from export import tiny

    ckpt = shared("anyflow-far-checkpoint", lambda root: tiny.save("tiny-anyflow-far", root / "ckpt")) / "ckpt"
    bundle = shared("anyflow-far-bundle", lambda root: run_module(
        "export", "--model", str(ckpt), "--resolution", f"{W}x{H}", "--frames", str(FRAMES), "--dtype", "fp32",
        "--max-sequence-length", "16", "--out", str(root / "far"), "-q")) / "far"
    return ckpt, bundle


@pytest.fixture(scope="module")
def reference(far: tuple[Path, Path]):  # noqa: ANN201 (diffusers' AnyFlowFARPipeline)
    from diffusers import AnyFlowFARPipeline

    pipe = AnyFlowFARPipeline.from_pretrained(str(far[0]), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe(far: tuple[Path, Path]):  # noqa: ANN201
    import runtime

    return runtime.load(far[1])


def _noise(seed: int = 0) -> np.ndarray:
    return torch.randn(*LATENT, generator=torch.Generator().manual_seed(seed)).numpy()


def _diffusers(ref, noise: np.ndarray, steps: int, guidance: float = 1.0, prompt: str = PROMPT,
               output_type: str = "np", **kw: object) -> np.ndarray:
    out = ref(prompt, negative_prompt=NEGATIVE, height=H, width=W, num_frames=FRAMES, num_inference_steps=steps,
              guidance_scale=guidance, latents=torch.from_numpy(noise.copy()), max_sequence_length=16,
              output_type=output_type, **kw).frames
    return out.numpy() if output_type == "latent" else out


def _ours(pipe, noise: np.ndarray, steps: int, guidance: float = 1.0, **kw: object) -> np.ndarray:
    return pipe.generate(PROMPT, NEGATIVE, steps=steps, guidance=guidance, latents=noise, progress=False, **kw)


def _latents(pipe, noise: np.ndarray, steps: int, changes: dict[int, str] | None = None, **kw: object) -> np.ndarray:
    from runtime import far

    session = far.stream(pipe, PROMPT, NEGATIVE, steps=steps, latents=noise, decode=False, **kw)
    for chunk in session:
        if changes and chunk.index + 1 in changes:
            session.prompt = changes[chunk.index + 1]
    return session.output


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_text_to_video_matches_diffusers(pipe, reference, steps: int) -> None:
    """1, 2 and 4 flow-map steps per chunk: the frames within 1e-4 of AnyFlowFARPipeline's (every chunk after the
    first read the KV cache; the last ones its compressed part)."""
    noise = _noise()
    ours, ref = _ours(pipe, noise, steps), _diffusers(reference, noise, steps)
    assert ours.shape == ref.shape == (1, FRAMES, H, W, 3)
    assert np.abs(ours - ref).max() < TOL


def test_guidance_and_plain_euler_match_diffusers(pipe, reference) -> None:
    """Guidance 3 with a negative prompt (CFG: the cache holds both halves) and use_mean_velocity=False (sampler
    euler, r = t): within 1e-4; each moves the frames away from the plain run."""
    noise = _noise(1)
    plain = _ours(pipe, noise, 2)
    guided = _ours(pipe, noise, 2, guidance=3.0)
    assert np.abs(guided - _diffusers(reference, noise, 2, guidance=3.0)).max() < TOL
    euler = _ours(pipe, noise, 2, use_mean_velocity=False)
    assert np.abs(euler - _diffusers(reference, noise, 2, use_mean_velocity=False)).max() < TOL
    assert min(np.abs(guided - plain).max(), np.abs(euler - plain).max()) > 100 * TOL


def test_image_and_video_context_match_diffusers(pipe, reference) -> None:
    """An image (the first chunk's context: diffusers' video of one frame) and a video of 9 frames (3 latent frames:
    chunks 0 and 1 whole) as context: those chunks only write the cache, the rest within 1e-4 of
    AnyFlowFARPipeline(video=...)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, (9, H, W, 3), dtype=np.uint8)
    noise = _noise(2)
    for given in (pixels[:1], pixels):
        video = torch.from_numpy(given).permute(0, 3, 1, 2)[None].float() / 255  # (B, T, C, H, W) in [0, 1]
        ref = _diffusers(reference, noise, 2, video=video)
        if len(given) == 1:
            ours = _ours(pipe, noise, 2, image=Image.fromarray(given[0]))
        else:
            ours = _ours(pipe, noise, 2, video=[Image.fromarray(f) for f in given])
        assert ours.shape == ref.shape
        assert np.abs(ours - ref).max() < TOL, len(given)


def test_prompt_switch_is_a_kv_recache(pipe, reference) -> None:
    """A prompt switch at chunk 2: the chunks before it unchanged (exactly), and the video equals
    AnyFlowFARPipeline run with the new prompt, the latents made before chunk 2 as video_latents and the same
    initial latents (within 1e-4); the same through `generate(prompt_changes=...)`, frames within 1e-4 too."""
    noise = _noise(3)
    before = _latents(pipe, noise, 2)
    switched = _latents(pipe, noise, 2, {2: OTHER})
    np.testing.assert_array_equal(switched[:, :, :3], before[:, :, :3])
    assert np.abs(switched - before).max() > 100 * TOL
    given = torch.from_numpy(before[:, :, :3].copy()).permute(0, 2, 1, 3, 4)  # (B, T, C, h, w)
    ref = _diffusers(reference, noise, 2, prompt=OTHER, output_type="latent", video_latents=given)
    assert np.abs(switched - ref).max() < TOL
    frames = _ours(pipe, noise, 2, prompt_changes={2: OTHER})
    ref_frames = _diffusers(reference, noise, 2, prompt=OTHER, video_latents=given)
    assert np.abs(frames - ref_frames).max() < TOL


def test_stream_yields_each_chunk_as_made(pipe) -> None:
    """`far.stream`: one Chunk per chunk, in order, its frames (1 for the first latent frame, 4 per later one)
    decoded as made; joined, they are generate's frames; a prompt sent between chunks applies from the next one."""
    from runtime import far

    noise = _noise(4)
    session = far.stream(pipe, PROMPT, NEGATIVE, steps=2, latents=noise)
    chunks = [next(session), session.send(OTHER), *session]
    assert [c.index for c in chunks] == [0, 1, 2, 3] and [c.prompt for c in chunks] == [PROMPT, OTHER, OTHER, OTHER]
    assert [c.frames.shape[1] for c in chunks] == [1, 8, 8, 8]
    whole = _ours(pipe, noise, 2, prompt_changes={1: OTHER})
    assert np.abs(np.concatenate([c.frames for c in chunks], axis=1) - whole).max() < 1e-5


def test_bundle_and_what_it_refuses(far: tuple[Path, Path], pipe, tmp_path: Path) -> None:
    """The manifest: kind anyflow-far, one step and one cache program per CFG variant (the cache an input and output
    of the cache write, heads on axis 3); `runtime generate --stream` writes one HLS segment per chunk, --image and
    --video (context frames) run; unipc and
    dpm++ are refused in one line, exit 2; a bad prompt_changes chunk and an image with a video are refused."""
    from runtime.errors import UserError

    m = json.loads((far[1] / "manifest.json").read_text())
    assert m["kind"] == "anyflow-far" and m["defaults"]["sampler"] == "flowmap"
    programs = m["programs"]
    assert {"denoise_step", "denoise_step_cond", "cache_step", "cache_step_cond"} <= set(programs)
    write = programs["cache_step"]
    assert write["inputs"]["full_cache"] == write["outputs"]["full_cache"]
    assert write["inputs"]["full_cache"]["shape"] == [2, 2, 2, 2, 2 * 8, 12]  # layers, k/v, 2B, heads, 2 frames, dim
    assert programs["denoise_step_cond"]["inputs"]["compressed_cache"]["shape"] == [2, 2, 1, 2, 3 * 2, 12]
    out, stream = tmp_path / "x.mp4", tmp_path / "live"
    run_cli("runtime", "generate", str(far[1]), "--prompt", PROMPT, "--steps", "1", "--out", str(out), "--stream",
            str(stream))
    assert out.exists() and sorted(p.name for p in (stream / "stream").iterdir()) == ["0.ts", "1.ts", "2.ts", "3.ts"]
    from PIL import Image

    (tmp_path / "v").mkdir()
    for i in range(9):  # 9 frames: chunks 0 and 1 as context
        Image.fromarray(np.full((H, W, 3), 20 * i, np.uint8)).save(tmp_path / "v" / f"{i:02d}.png")
    for flag, value in (("--image", tmp_path / "v" / "00.png"), ("--video", tmp_path / "v")):
        run_cli("runtime", "generate", str(far[1]), "--prompt", PROMPT, "--steps", "1", flag, str(value), "--out",
                str(tmp_path / f"{flag[2:]}.mp4"))
        assert (tmp_path / f"{flag[2:]}.mp4").exists()
    for sampler in ("unipc", "dpm++"):
        r = run_cli("runtime", "generate", str(far[1]), "--prompt", PROMPT, "--sampler", sampler, "--out",
                    str(tmp_path / "y.mp4"), check=False)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and f"sampler {sampler} treats" in r.stderr, r.stderr
    with pytest.raises(UserError, match="prompt_changes' chunks are 1..3"):
        pipe.generate(PROMPT, prompt_changes={4: OTHER}, progress=False)
    with pytest.raises(UserError, match="not both"):
        pipe.generate(PROMPT, image=np.zeros((H, W, 3), np.uint8), video=np.zeros((5, H, W, 3), np.uint8))


def test_blocked_attention_is_the_whole_softmax() -> None:
    """export/far.py's attention over blocks of keys (an online softmax: what real sizes run) gives the softmax over all
    of them at once, with the zero keys of diffusers' padding and masked keys; a query that sees nothing gets 0."""
    from export import far as far_export

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, n, 8)).astype(np.float32) for n in (20, 70, 70))
    allowed = rng.random((20, 70)) > 0.3
    allowed[0] = False
    whole = np.asarray(far_export.attend(q, k, v, allowed, 5, block=128))
    s = np.einsum("nhqd,nhkd->nhqk", q, k) / np.sqrt(8)
    e = np.where(allowed, np.exp(s), 0.0)
    want = np.einsum("nhqk,nhkd->nhqd", e, v) / (e.sum(-1, keepdims=True) + 5)
    assert np.abs(whole - want).max() < 1e-5
    for zero in (5, 0):
        blocked = np.asarray(far_export.attend(q, k, v, allowed, zero, block=16))
        assert np.abs(blocked - np.asarray(far_export.attend(q, k, v, allowed, zero, block=128))).max() < 1e-5
    assert np.abs(blocked[:, :, 0]).max() == 0.0


@pytest.mark.slow
def test_context_ending_inside_a_chunk_matches_diffusers(pipe, reference) -> None:
    """5 frames of context (2 latent frames: chunk 0 and the first frame of chunk 1): chunk 1 only writes the cache,
    its second latent frame stays zero (as diffusers), and the video is within 1e-4 of AnyFlowFARPipeline's."""
    from PIL import Image

    pixels = np.random.default_rng(5).integers(0, 255, (5, H, W, 3), dtype=np.uint8)
    noise = _noise(5)
    video = torch.from_numpy(pixels).permute(0, 3, 1, 2)[None].float() / 255
    ours = _latents(pipe, noise, 2, video=[Image.fromarray(f) for f in pixels])
    assert np.abs(ours[:, :, 2]).max() == 0.0
    ref = _diffusers(reference, noise, 2, output_type="latent", video=video)
    assert np.abs(ours - ref).max() < TOL


@pytest.mark.slow
def test_the_1_3b_from_its_architecture_name(tmp_path: Path) -> None:
    """`--model anyflow-far-wan2.1-1.3b --no-weights` at 480p x 81 frames: the kind from the name, the released
    chunks (1, 3 x 6, 2) and full-chunk limit 3 giving a 3-frame chunk slot and the cache of the most any chunk
    reads."""
    out = tmp_path / "b"
    run_module("export", "--model", "anyflow-far-wan2.1-1.3b", "--no-weights", "--resolution", "480p", "--frames",
               "81", "--out", str(out), "-q")
    m = json.loads((out / "manifest.json").read_text())
    assert m["kind"] == "anyflow-far"
    step = m["programs"]["denoise_step_cond"]["inputs"]
    assert step["state"]["shape"][3] == 3
    assert step["full_cache"]["shape"] == [30, 2, 1, 12, 6 * 30 * 52, 128]
    assert step["compressed_cache"]["shape"] == [30, 2, 1, 12, 13 * 15 * 26, 128]


def test_its_videos_are_neither_remixed_nor_extended() -> None:
    """A FAR bundle's server offers no remix, edit or extension (its chunks start from their own noise, with no SDEdit
    start; a continuation is the first chunks' context, `video=`): the API refuses them in one line, as for
    ChronoEdit, instead of a job that would fail in the worker."""
    from runtime import kinds
    from runtime.serve import derive

    far = kinds.get("anyflow-far")
    assert not any(w.applies(far, False) for w in (*derive.REMAKES, *derive.EXTENDS))
    assert "anyflow-far" not in derive.kinds_that(derive.REMAKES) + derive.kinds_that(derive.EXTENDS)
