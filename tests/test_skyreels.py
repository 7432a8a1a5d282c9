"""SkyReels-V2 against diffusers' SkyReelsV2 pipelines on tiny random models saved with save_pretrained, exported
with the CLI (tests/conftest.py SKYREELS_CASES), fp32: frames within 1e-4 with the same initial noise per segment
(`latents`, one per segment; diffusers' draws replaced by them) and the same re-noise of carried-over frames
(addnoise_condition: the runtime's draws replayed for torch.randn_like).

Diffusion forcing covers one segment, three overlapping segments (the last shorter), the asynchronous mode
(ar_step 2, causal blocks of 2) over two segments, image-to-video with a last image, and video extension; then the
asynchronous run on 8 fake devices, and the bad settings (one line, exit 2)."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest

import runtime
from runtime import forcing

from .conftest import devices_env, run_cli, test_image

PROMPT = "a robot walking in the city at night, cinematic"
NEGATIVE = "blurry, low quality"
FP32_TOL = 1e-4
STEPS = 4  # UniPC at 4 steps: order 2 and the corrector both run (the per-frame history matters)
DF_MODULES = ("pipeline_skyreels_v2_diffusion_forcing", "pipeline_skyreels_v2_diffusion_forcing_i2v",
              "pipeline_skyreels_v2_diffusion_forcing_v2v")


@pytest.fixture(autouse=True)
def plain_ftfy(monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers' SkyReels pipelines call ftfy.fix_text unconditionally; it is not installed here, and the runtime's
    prompt cleaning skips it when absent (as diffusers' Wan pipelines do)."""
    import importlib

    for name in ("pipeline_skyreels_v2", "pipeline_skyreels_v2_i2v", *DF_MODULES):
        module = importlib.import_module(f"diffusers.pipelines.skyreels_v2.{name}")
        monkeypatch.setattr(module, "ftfy", types.SimpleNamespace(fix_text=lambda text: text), raising=False)


@pytest.fixture(scope="module")
def df(skyreels_bundles) -> runtime.Pipeline:
    return runtime.load(skyreels_bundles["skyreels-df"])


def _noise(frames: list[int], seed: int = 0) -> list[np.ndarray]:
    """One initial noise per segment (latent frames each), at the tiny DF bundle's 64x32."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 16, n, 4, 8)).astype(np.float32) for n in frames]


class Replay:
    """diffusers' random draws replaced: each segment's initial noise (randn_tensor) by `noise` in order, and the
    re-noise of carried-over frames (torch.randn_like) by what the runtime drew (`record` around its run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, noise: list[np.ndarray]) -> None:
        self.monkeypatch, self.noise, self.renoise = monkeypatch, list(noise), []

    def record(self) -> None:
        draw = forcing.prefix_noise

        def recorded(seed: int, segment: int, row: int, shape: tuple[int, ...]):
            out = draw(seed, segment, row, shape)
            self.renoise.append(np.asarray(out))
            return out

        self.monkeypatch.setattr(forcing, "prefix_noise", recorded)

    def install(self) -> None:
        import importlib

        import torch

        def randn_tensor(shape, generator=None, device=None, dtype=None, layout=None):
            a = self.noise.pop(0)
            assert tuple(a.shape) == tuple(shape), (a.shape, shape)
            return torch.from_numpy(a.copy())

        def randn_like(x, *args, **kwargs):
            a = self.renoise.pop(0)[:, :, : x.shape[2]]  # the pinned frames' share
            assert tuple(a.shape) == tuple(x.shape), (a.shape, x.shape)
            return torch.from_numpy(np.ascontiguousarray(a))

        for name in DF_MODULES:
            module = importlib.import_module(f"diffusers.pipelines.skyreels_v2.{name}")
            self.monkeypatch.setattr(module, "randn_tensor", randn_tensor)
        self.monkeypatch.setattr(torch, "randn_like", randn_like)

    def done(self) -> None:
        assert not self.noise and not self.renoise, "diffusers drew less than the runtime"


def _reference(checkpoint: Path, cls: str):
    import diffusers
    import torch

    ref = getattr(diffusers, cls).from_pretrained(str(checkpoint), dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    return ref


def _diffusers_df(checkpoint: Path, cls: str, replay: Replay, **call) -> np.ndarray:
    import torch

    replay.install()
    with torch.no_grad():
        out = _reference(checkpoint, cls)(prompt=PROMPT, negative_prompt=NEGATIVE, height=32, width=64,
                                          num_inference_steps=STEPS, guidance_scale=6.0, max_sequence_length=16,
                                          output_type="np", **call).frames
    replay.done()
    return out


def _close(ours: np.ndarray, ref: np.ndarray, frames: int) -> None:
    assert ours.shape == ref.shape == (1, frames, 32, 64, 3)
    assert np.abs(ours - ref).max() <= FP32_TOL
    assert ours.std() > 1e-3  # not trivially equal


@pytest.mark.parametrize("kind", ["skyreels-t2v", "skyreels-i2v"])
def test_text_and_image_to_video_match_diffusers(kind: str, skyreels_bundles, skyreels_checkpoints) -> None:
    """SkyReelsV2Pipeline and SkyReelsV2ImageToVideoPipeline: Wan 2.1's loop on SkyReels' DiT (its float64 timestep
    sinusoid runs in float32 in the programs: 3e-6 of a step's velocity on this model)."""
    import torch

    pipe = runtime.load(skyreels_bundles[kind])
    assert pipe.kind.name == kind and pipe.kind.fps == 24
    images = {"image": test_image(70, 50, seed=1)} if kind == "skyreels-i2v" else {}
    init = pipe.initial_latents(11)
    ours = pipe.generate(PROMPT, NEGATIVE, seed=11, steps=STEPS, progress=False, **images)
    g = pipe.geometry
    ref = _reference(skyreels_checkpoints[f"tiny-{kind}"],
                     {"skyreels-t2v": "SkyReelsV2Pipeline", "skyreels-i2v": "SkyReelsV2ImageToVideoPipeline"}[kind])
    with torch.no_grad():
        want = ref(prompt=PROMPT, negative_prompt=NEGATIVE, height=g.height, width=g.width, num_frames=g.frames,
                   num_inference_steps=STEPS, guidance_scale=pipe.manifest.defaults.guidance,
                   max_sequence_length=g.max_sequence_length, latents=torch.from_numpy(init.copy()), output_type="np",
                   **images).frames
    assert ours.shape == want.shape == (1, g.frames, g.height, g.width, 3)
    assert np.abs(ours - want).max() <= FP32_TOL and ours.std() > 1e-3


def test_df_text_to_video_in_one_segment(df, skyreels_checkpoints, monkeypatch) -> None:
    replay = Replay(monkeypatch, _noise([5]))
    ours = df.generate(PROMPT, NEGATIVE, num_frames=17, latents=replay.noise, steps=STEPS, progress=False)
    _close(ours, _diffusers_df(skyreels_checkpoints["tiny-skyreels-df"], "SkyReelsV2DiffusionForcingPipeline", replay,
                               num_frames=17, base_num_frames=17), 17)


def test_df_text_to_video_over_three_overlapping_segments(df, skyreels_checkpoints, monkeypatch) -> None:
    """37 frames (10 latent) in segments of 5 overlapping by 2 (overlap_history 5): 5, 5 and a shorter last 4, run on
    the bundle's 13-frame shape; the carried-over frames re-noised (addnoise_condition 20)."""
    replay = Replay(monkeypatch, _noise([5, 5, 4], seed=1))
    plan = forcing.plan(10, 5, 5)
    assert [(s.frames, s.prefix) for s in plan.segments] == [(5, 0), (5, 2), (4, 2)]
    replay.record()
    ours = df.generate(PROMPT, NEGATIVE, num_frames=37, overlap_history=5, addnoise_condition=20,
                       latents=replay.noise, seed=2, steps=STEPS, progress=False)
    assert len(replay.renoise) == 2 * STEPS  # every row of the two segments with carried-over frames
    _close(ours, _diffusers_df(skyreels_checkpoints["tiny-skyreels-df"], "SkyReelsV2DiffusionForcingPipeline", replay,
                               num_frames=37, base_num_frames=17, overlap_history=5, addnoise_condition=20), 37)


ASYNC = dict(num_frames=21, frames=13, overlap_history=5, ar_step=2, causal_block_size=2, addnoise_condition=20)


@pytest.fixture(scope="module")
def async_noise() -> list[np.ndarray]:
    return _noise([4, 4], seed=3)


def test_df_asynchronous_mode(df, skyreels_checkpoints, async_noise, monkeypatch, tmp_path: Path) -> None:
    """ar_step 2, causal blocks of 2 latent frames: segments of 13 frames (4 latent, 2 blocks: 4 + 2 rows), 21 frames
    in two; block-causal self-attention. Then the same run through the CLI on 8 fake devices (cpu-8 bundle: the causal
    mask across the sequence shards) gives the same frames."""
    replay = Replay(monkeypatch, async_noise)
    assert len(forcing.timestep_matrix(4, STEPS, 2, 0, 2)[0]) == STEPS + 2
    replay.record()
    ours = df.generate(PROMPT, NEGATIVE, latents=replay.noise, seed=4, steps=STEPS, progress=False, **ASYNC)
    want = _diffusers_df(skyreels_checkpoints["tiny-skyreels-df"], "SkyReelsV2DiffusionForcingPipeline", replay,
                         num_frames=21, base_num_frames=13, overlap_history=5, ar_step=2, causal_block_size=2,
                         addnoise_condition=20)
    _close(ours, want, 21)
    sync = df.generate(PROMPT, NEGATIVE, latents=async_noise, seed=4, steps=STEPS, progress=False,
                       **{**ASYNC, "ar_step": 0, "causal_block_size": None})
    assert np.abs(sync - ours).max() > 1e-2  # the mode is used


@pytest.mark.slow  # a variant on 8 devices: test_multidevice covers the mechanism, test_df_asynchronous_mode the mode
def test_df_asynchronous_mode_on_8_devices(df, skyreels_checkpoints, tmp_path: Path) -> None:
    """The CLI (--frames beyond the shape, --overlap-history, --ar-step, --causal-block-size, --addnoise-condition) on
    the cpu-8 bundle (dp=2, sp=2, tp=2) with 8 fake devices gives 1 device's frames (the noise from the seed): with
    guidance (the CFG batch over dp, the causal mask across sp's shards) and without (dp joins sp: 4 shards)."""
    import os
    import subprocess
    import sys

    from safetensors.numpy import load_file

    from .conftest import ROOT, run_module

    cpu8 = tmp_path / "cpu8"  # the asynchronous mode's segment (13 frames) for dp=2, sp=2, tp=2
    run_module("export", "--model", str(skyreels_checkpoints["tiny-skyreels-df"]), "--resolution", "64x32", "--frames",
               "13", "--dtype", "fp32", "--max-sequence-length", "16", "--target", "cpu-8", "--out", str(cpu8), "-q")
    flags = ["generate", str(cpu8), "--prompt", PROMPT, "--negative-prompt", NEGATIVE,
             "--frames", "21", "--overlap-history", "5", "--ar-step", "2", "--causal-block-size", "2",
             "--addnoise-condition", "20", "--steps", str(STEPS), "--seed", "4", "-q"]
    runs = {g: tmp_path / f"g{g}.safetensors" for g in (6, 1)}
    calls = [flags + ["--guidance", str(g), "--out", str(tmp_path / f"g{g}.mp4"), "--frames-out", str(out)]
             for g, out in runs.items()]
    script = "from runtime.__main__ import main\n" + "".join(f"assert main({c!r}) == 0\n" for c in calls)

    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           **devices_env(8)}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for g, out in runs.items():
        one = df.generate(PROMPT, NEGATIVE, seed=4, steps=STEPS, guidance=float(g), progress=False, **ASYNC)
        eight = load_file(str(out))["frames"]
        assert eight.shape == one.shape == (1, 21, 32, 64, 3)
        assert np.abs(eight - one).max() <= 1e-5, g


def test_df_image_to_video_with_a_last_image(df, skyreels_checkpoints, monkeypatch) -> None:
    """The image's latent pinned as frame 0, the last image's after the segment's 4 latent frames (run on the 17-frame
    shape), dropped before the decode."""
    images = {"image": test_image(70, 50, seed=1), "last_image": test_image(40, 64, seed=2)}
    replay = Replay(monkeypatch, _noise([4], seed=5))
    ours = df.generate(PROMPT, NEGATIVE, num_frames=13, frames=13, latents=replay.noise, steps=STEPS, progress=False,
                       **images)
    want = _diffusers_df(skyreels_checkpoints["tiny-skyreels-df"], "SkyReelsV2DiffusionForcingImageToVideoPipeline",
                         replay, num_frames=13, base_num_frames=13, **images)
    _close(ours, want, 13)


def test_df_video_extension(df, skyreels_checkpoints, monkeypatch) -> None:
    """A 12-frame source: its last 5 frames' latents pinned (overlap_history 5), 29 frames (8 latent) in two segments;
    the output is the source followed by the 29 decoded frames, as diffusers returns it."""
    source = [test_image(64, 32, seed=10 + i) for i in range(12)]
    replay = Replay(monkeypatch, _noise([5, 5], seed=6))
    ours = df.generate(PROMPT, NEGATIVE, video=source, num_frames=29, overlap_history=5, latents=replay.noise,
                       steps=STEPS, progress=False)
    want = _diffusers_df(skyreels_checkpoints["tiny-skyreels-df"], "SkyReelsV2DiffusionForcingVideoToVideoPipeline",
                         replay, video=source, num_frames=29, base_num_frames=17, overlap_history=5)
    _close(ours, want, 12 + 29)
    np.testing.assert_allclose(ours[0, :12], np.stack([np.asarray(f, np.float32) / 255 for f in source]), atol=1e-6)


BAD = [
    (["--frames", "37", "--overlap-history", "17"], "overlap_history 17 is 5 latent frames, which leaves no new"),
    (["--frames", "37", "--overlap-history", "5", "--causal-block-size", "2"], "causal_block_size 2 does not divide"),
    (["--frames", "17", "--ar-step", "2"], "ar_step 2 (the asynchronous mode) needs causal_block_size"),
    (["--frames", "9"], "9 frames need the video to be 9 frames, and this bundle's shapes at 64x32 have 13, 17"),
    (["--frames", "33", "--overlap-history", "5"], "33 frames need segment 3 of 3 to be 9 frames"),
    (["--frames", "18"], "num_frames 18 is not of the form 4k+1"),
]


@pytest.mark.parametrize("flags,message", BAD)
def test_bad_settings_are_one_line(flags: list[str], message: str, skyreels_bundles, tmp_path: Path) -> None:
    """Each refused setting is one line, exit 2, and nothing is written: neither the video nor the live stream asked
    for with it (the stream is written from the first frames on, once the loop has checked its settings)."""
    out, stream = tmp_path / "never.mp4", tmp_path / "live" / "hls"
    proc = run_cli("runtime", "generate", str(skyreels_bundles["skyreels-df"]), "--prompt", "a cat", *flags,
                   "--out", str(out), "--stream", str(stream), "-q", check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr
    assert not out.exists() and not (tmp_path / "live").exists()


def test_a_source_video_too_short_to_extend(df, tmp_path: Path) -> None:
    with pytest.raises(forcing.InputError, match="the video has 3 frames, fewer than overlap_history 5") as e:
        df.generate(PROMPT, video=[test_image(64, 32, seed=i) for i in range(3)], num_frames=17, overlap_history=5,
                    progress=False)
    assert e.value.field == "video"


def _df_app(tmp_path: Path, pipe: runtime.Pipeline, **settings):
    """(TestClient, State): the HTTP app serving the DF bundle (its real manifest and pipeline), no worker."""
    from fastapi.testclient import TestClient

    from runtime.serve.jobs import open_store
    from runtime.serve.metrics import make_metrics
    from runtime.serve.routes import create_app
    from runtime.serve.schema import Offer
    from runtime.serve.state import Settings, State

    state = State(settings=Settings(bundle=pipe.bundle.path, jobs_dir=tmp_path / "jobs", **settings),
                  store=open_store(tmp_path / "jobs"), offer=Offer.of(pipe.manifest, "df", max_seconds=2.0))
    state.pipe = pipe
    state.metrics = make_metrics(state.store)
    state.ready.set()
    return TestClient(create_app(state), base_url="http://127.0.0.1"), state


SERVER_BAD = [
    ({"seconds": "3"}, "seconds", "seconds 3 is longer than this server makes (2 s, its --max-seconds)"),
    ({"seconds": "0.3"}, "seconds", "9 frames need the video to be 9 frames"),
    ({"seconds": "1.5", "overlap_history": 17}, "overlap_history", "overlap_history must be an integer in 1..16"),
    ({"seconds": "1.5", "overlap_history": 5, "causal_block_size": 2}, "causal_block_size", "does not divide"),
    ({"ar_step": 2}, "ar_step", "needs causal_block_size"),
]


@pytest.mark.parametrize("fields,param,message", SERVER_BAD)
def test_server_refuses_what_no_segment_plan_makes(fields: dict, param: str, message: str, df, tmp_path: Path) -> None:
    client, _ = _df_app(tmp_path, df)
    r = client.post("/v1/videos", json={"prompt": PROMPT, **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param and message in r.json()["error"]["message"], \
        r.text


def test_server_seconds_beyond_the_shape(df, tmp_path: Path) -> None:
    """`seconds` past the bundle's shape on a DF bundle (up to --max-seconds): 1.5 s at 24 fps is 37 frames, three
    overlapping segments; the worker's run makes them. GET /v1/models says the bundle makes any length."""
    from runtime.serve import worker
    from runtime.video_input import load_frames

    client, state = _df_app(tmp_path, df)
    card = client.get("/v1/models").json()["data"][0]
    assert card["forcing"] is True and card["max_seconds"] == 2.0 and card["last_image"] is True
    r = client.post("/v1/videos", json={"prompt": PROMPT, "seconds": "1.5", "overlap_history": 5,
                                        "addnoise_condition": 20, "num_inference_steps": 2})
    assert r.status_code == 200, r.text
    assert r.json()["seconds"] == "1.54167"  # 37 frames at 24 fps
    job = state.store.claim()
    assert job.params["frames"] == 37 and job.params["overlap_history"] == 5
    progress: list[int] = []
    worker.run_job(df, job.params, [], tmp_path / "video.mp4", on_progress=progress.append)
    assert len(load_frames(tmp_path / "video.mp4")) == 37
    assert progress[-1] == 99 and progress == sorted(progress)


def test_the_step_runner_and_the_loops_import_no_front() -> None:
    """runtime/steps.py is the one step runner and runtime/segment.py the one-segment loop: nothing they import (within
    runtime) imports another loop or the Pipeline front; no loop imports the front, which imports every loop."""
    import ast

    from .conftest import ROOT

    def imports(module: str) -> set[str]:
        tree = ast.parse((ROOT / "runtime" / f"{module}.py").read_text())
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                out |= {node.module} if node.module else {a.name for a in node.names}
        return {m.split(".")[0] for m in out if (ROOT / "runtime" / f"{m.split('.')[0]}.py").is_file()}

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += imports(m)
        return seen

    loops = {"segment", "animate", "forcing", "helios", "chronoedit"}
    assert not reach("steps") & (loops | {"pipeline", "front"}), sorted(reach("steps"))
    assert not reach("segment") & (loops - {"segment"} | {"pipeline", "front"}), sorted(reach("segment"))
    for loop in loops:
        assert "pipeline" not in reach(loop), loop
    assert loops <= imports("pipeline")


def test_extend_is_the_extensions_hook(df) -> None:
    """`forcing.extend(pipe, prompt, video, seconds=)` (what POST /v1/videos/extensions calls): seconds of new video at
    the bundle's 24 fps after the overlap: 5 + 0.5 x 24 = 17 frames, one segment here; the source comes first."""
    source = [test_image(64, 32, seed=20 + i) for i in range(12)]
    assert forcing.frames_for(5 / 24 + 0.5, 24) == 17 and forcing.frames_for(1.5, 24) == 37
    out = forcing.extend(df, PROMPT, source, seconds=0.5, overlap_history=5, steps=2, progress=False)
    assert out.shape == (1, 12 + 17, 32, 64, 3)
    np.testing.assert_allclose(out[0, :12], np.stack([np.asarray(f, np.float32) / 255 for f in source]), atol=1e-6)
    with pytest.raises(forcing.InputError, match="seconds or num_frames"):
        forcing.extend(df, PROMPT, source)


def _mp4(frames: list, path: Path) -> bytes:
    from runtime.video import write_video

    write_video(np.stack([np.asarray(f, np.float32) / 255 for f in frames]), path, fps=24)
    return path.read_bytes()


def test_df_extension_through_the_extensions_route(df, tmp_path: Path) -> None:
    """POST /v1/videos/extensions on a DF bundle (derive.py's "forcing" way): `seconds` of new video after an uploaded
    source, as forcing.extend makes it; the job's video is the source, then the new frames after the overlap_history
    frames the run makes again (12 + 17 - 5 = 24 frames, 1 s at 24 fps). The worker's run gives each row a live
    preview and the frames forcing.extend returns; a source shorter than overlap_history is a 400 naming video, and a
    DF bundle's videos cannot be remade (no SDEdit start). Its document is valid OpenAPI, with the extension taking
    any duration and the DF settings, and remix and edits left out."""
    import jsonschema
    import openapi_spec_validator

    from runtime.serve import worker
    from runtime.video_input import load_frames

    client, state = _df_app(tmp_path, df)
    data = _mp4([test_image(64, 32, seed=40 + i) for i in range(12)], tmp_path / "source.mp4")
    fields = {"prompt": PROMPT, "seconds": "0.5", "overlap_history": "5", "num_inference_steps": "2"}
    short = client.post("/v1/videos/extensions", data=fields, files={"video": ("s.mp4", _mp4(
        [test_image(64, 32, seed=i) for i in range(3)], tmp_path / "short.mp4"), "video/mp4")})
    assert short.status_code == 400 and short.json()["error"]["param"] == "video", short.text
    assert "fewer than overlap_history 5" in short.json()["error"]["message"]
    edit = client.post("/v1/videos/edits", data={"prompt": PROMPT}, files={"video": ("v.mp4", data, "video/mp4")})
    assert edit.status_code == 400 and "cannot be remixed or edited" in edit.json()["error"]["message"], edit.text

    doc = client.get("/openapi.json").json()
    openapi_spec_validator.validate(doc)
    assert "/v1/videos/edits" not in doc["paths"] and "/v1/videos/{video_id}/remix" not in doc["paths"]
    extension = doc["paths"]["/v1/videos/extensions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"overlap_history", "ar_step", "causal_block_size", "addnoise_condition"} <= extension["properties"].keys()
    jsonschema.validate({"prompt": PROMPT, "seconds": "0.5", "video": {"id": "video_1"}}, extension)

    r = client.post("/v1/videos/extensions", data=fields, files={"video": ("v.mp4", data, "video/mp4")})
    assert r.status_code == 200, r.text
    assert r.json()["seconds"] == "1"
    job = state.store.claim()
    assert job.params["frames"] == 17 and job.params["derive"] == {"op": "extend", "way": "forcing", "overlap": 5}
    files = [state.store.storage.read(key) for key in job.images]
    shown: list[np.ndarray] = []
    parts: list[np.ndarray] = []  # the live stream's: the source, then each segment's new frames, the overlap left out
    out = worker.run_job(df, job.params, files, tmp_path / "video.mp4", on_preview=shown.append,
                         on_frames=parts.append)
    assert out.shape == (24, 32, 64, 3) and len(load_frames(tmp_path / "video.mp4")) == 24
    np.testing.assert_array_equal(np.concatenate(parts, axis=1)[0], out)
    source = load_frames(tmp_path / "source.mp4")
    ref = forcing.extend(df, PROMPT, source, seconds=0.5, overlap_history=5, steps=2, progress=False)[0]
    np.testing.assert_allclose(out[:12], ref[:12], atol=1e-6)
    np.testing.assert_allclose(out[12:], ref[12 + 5:], atol=1e-6)
    rows = sum(forcing.layout(df, None, None, 17, 5, video_frames=12).rows(2))
    assert len(shown) == rows and shown[0].shape == (4, 8, 3) and shown[0].dtype == np.uint8


def test_df_job_stops_between_steps_when_cancelled(df, tmp_path: Path) -> None:
    """The worker's diffusion forcing run asks `check` after every row (the server's cancel raises there): a job of
    three segments stops after the row where it was cancelled, and nothing is written."""
    from runtime.serve import worker

    params = {"prompt": PROMPT, "negative_prompt": "", "seed": 0, "steps": 2, "guidance": None, "flow_shift": None,
              "guidance_2": None, "sampler": None, "sigmas": None, "size": "64x32", "frames": 37, "fps": 24,
              "overlap_history": 5, "media": []}
    progress: list[int] = []

    def check() -> None:
        if len(progress) >= 2:
            raise worker.Cancelled

    with pytest.raises(worker.Cancelled):
        worker.run_job(df, params, [], tmp_path / "video.mp4", on_progress=progress.append, check=check)
    assert len(progress) == 2 and not (tmp_path / "video.mp4").exists()
