"""Wan-Animate: a character image moved by a pose and a face video, or put into a video in place of someone, in
segments of the bundle's frames, against diffusers' WanAnimatePipeline on a tiny Animate model saved with
save_pretrained (fp32, the same initial noise for every segment): one segment, three, replace mode with prev 5; the
same frames on 1 device, 8 and 2 processes x 4; a merged LoRA with the few-step Euler sampler; int8 weights; the CLI,
the server and what bad input says."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

import runtime
from runtime.errors import UserError

from .conftest import (
    ROOT,
    OnDemand,
    devices_env,
    in_parallel,
    run_cli,
    run_module,
    run_processes,
    test_image,
)
from .test_lora import wan_format_lora
from .test_video_in import _mask, _mp4, _video, _write_frames

PROMPT = "a dancer on a stage"
NEGATIVE = "blurry"
FP32_TOL = 1e-4
WIDTH, HEIGHT, MAX_LEN = 64, 32, 16  # 8 tokens per latent frame (not the face adapters' 3 motion tokens)
FACE = 32  # the tiny model's motion_encoder_size


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from export import tiny

    return tiny.save("tiny-animate", tmp_path_factory.mktemp("animate-checkpoint") / "tiny-animate")


def _common(checkpoint: Path) -> list[str]:
    return ["--model", str(checkpoint), "--resolution", f"{WIDTH}x{HEIGHT}", "--dtype", "fp32", "--max-sequence-length",
            str(MAX_LEN), "-q"]


@pytest.fixture(scope="module")
def bundles(checkpoint, tmp_path_factory) -> dict[str, Path]:
    """fp32 with segments of 9 and 13 frames; with a LoRA merged; int8."""
    root = tmp_path_factory.mktemp("animate-bundles")
    lora = wan_format_lora(checkpoint, root / "lora-file", seed=3)
    common = _common(checkpoint)
    out = {name: root / name for name in ("fp32", "lora", "int8")}
    commands = {"fp32": ["export", *common, "--frames", "9,13", "--out", str(out["fp32"])],
                "lora": ["export", *common, "--frames", "9", "--merge-lora", f"{lora}:0.7", "--out", str(out["lora"])],
                "int8": ["export", *common, "--frames", "9", "--quantize", "int8", "--out", str(out["int8"])]}

    def build(name: str) -> Path:
        run_module(*commands[name])
        return out[name]

    # the merged LoRA's bundle is the slow tier's (built when its test asks)
    return OnDemand.start({**{n: functools.partial(build, n) for n in commands}, "lora-file": lambda: lora},
                          now=["fp32", "int8", "lora-file"])


def _inputs(n: int, mode: str, seed: int = 0) -> dict:
    out = {"pose_video": _video(n, WIDTH, HEIGHT, seed=seed + 1), "face_video": _video(n, FACE, FACE, seed=seed + 2)}
    if mode == "replace":
        out.update(background_video=_video(n, WIDTH, HEIGHT, seed=seed + 3), mask_video=_mask(n, WIDTH, HEIGHT))
    return out


def _diffusers(checkpoint: Path, noises: list[np.ndarray], scheduler=None, lora: tuple[Path, float] | None = None):
    """WanAnimatePipeline drawing `noises` in turn, one per segment (its `prepare_latents`, called once a segment)."""
    import diffusers
    import torch

    ref = diffusers.WanAnimatePipeline.from_pretrained(str(checkpoint), dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    if scheduler is not None:
        ref.scheduler = scheduler
    if lora is not None:
        ref.load_lora_weights(str(lora[0]), adapter_name="a")
        ref.set_adapters(["a"], [lora[1]])
    draws = iter(noises)
    ref.prepare_latents = lambda *a, **k: torch.from_numpy(next(draws).copy())
    return ref


@pytest.mark.parametrize("mode,frames,segment,prev,guidance,segments", [
    ("animate", 9, 9, 1, 1.0, 1),    # one segment, the cond-only step
    ("animate", 22, 9, 1, 3.0, 3),   # three segments (25 frames padded by reflection), CFG with a black face
    ("replace", 18, 13, 5, 2.0, 2),  # a background and a mask, 5 frames carried, the 13-frame shape
])
def test_matches_diffusers(mode, frames, segment, prev, guidance, segments, bundles, checkpoint) -> None:
    import torch

    from runtime import animate

    pipe = runtime.load(bundles["fp32"])
    g = pipe.shape(None, segment)
    assert animate.segments(frames, segment, prev).count == segments
    noises = [pipe.initial_latents(10 + i, g) for i in range(segments)]
    image = test_image(40, 56, seed=3)
    kw = _inputs(frames, mode)
    parts: list[np.ndarray] = []  # each segment's kept frames as soon as it is decoded (the live stream's parts)
    ours = pipe.generate(PROMPT, NEGATIVE, image=image, mode=mode, prev_segment_frames=prev, steps=3,
                         guidance=guidance, latents=noises, frames=segment, progress=False, on_frames=parts.append,
                         **kw)
    assert len(parts) == segments
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), ours)
    with torch.no_grad():
        want = _diffusers(checkpoint, noises)(
            image=image, prompt=PROMPT, negative_prompt=NEGATIVE, height=HEIGHT, width=WIDTH,
            segment_frame_length=segment, num_inference_steps=3, guidance_scale=guidance, mode=mode,
            prev_segment_conditioning_frames=prev, max_sequence_length=MAX_LEN, output_type="np", **kw).frames
    assert ours.shape == want.shape == (1, frames, HEIGHT, WIDTH, 3)
    assert np.abs(ours - want).max() <= FP32_TOL
    if segments > 1:  # each segment's own noise: from the seed, the later segments differ from these
        seeded = pipe.generate(PROMPT, NEGATIVE, image=image, mode=mode, prev_segment_frames=prev, steps=3,
                               guidance=guidance, latents=noises[0], frames=segment, progress=False, **kw)
        first = g.frames
        np.testing.assert_allclose(seeded[:, :first], ours[:, :first], rtol=0, atol=1e-6)
        assert np.abs(seeded[:, first:] - ours[:, first:]).max() > 1e-3


def _devices(n: int) -> dict[str, str]:
    return devices_env(n)


def _cli_inputs(tmp_path: Path) -> list[str]:
    """Two segments' inputs for the CLI: a folder of pose frames and an mp4 face video."""
    test_image(48, 40, seed=4).save(tmp_path / "me.png")
    pose = _write_frames(_video(14, WIDTH, HEIGHT, seed=5), tmp_path / "pose")
    face = _mp4(_video(14, FACE, FACE, seed=6), tmp_path / "face.mp4")
    return ["--prompt", PROMPT, "--image", str(tmp_path / "me.png"), "--pose-video", str(pose), "--face-video",
            str(face), "--steps", "2", "--guidance", "2", "--seed", "3", "-q"]


def test_the_cli_reads_a_folder_of_frames_and_an_mp4(bundles, tmp_path) -> None:
    """Two segments through the CLI (a folder of pose frames, an mp4 face video): the pipeline's frames, and the mp4
    at the bundle's 30 fps."""
    from safetensors.numpy import load_file

    args = _cli_inputs(tmp_path)
    run_cli("runtime", "generate", str(bundles["fp32"]), *args, "--out", str(tmp_path / "one.mp4"), "--frames-out",
            str(tmp_path / "one.safetensors"))
    one = load_file(str(tmp_path / "one.safetensors"))["frames"]
    assert one.shape == (1, 14, HEIGHT, WIDTH, 3)
    import imageio.v2 as imageio

    with imageio.get_reader(str(tmp_path / "one.mp4")) as reader:
        assert reader.get_meta_data()["fps"] == 30


@pytest.mark.slow  # a variant on 8 devices and 2 processes: test_multidevice covers the mechanism
def test_same_frames_on_1_device_8_devices_and_2_processes(bundles, checkpoint, tmp_path) -> None:
    """The CLI's two segments on the one-device bundle, a cpu-8 bundle on 8 devices, and on 2 processes x 4
    (jax.distributed over loopback): the same frames (1e-5)."""
    from safetensors.numpy import load_file

    args = _cli_inputs(tmp_path)
    cpu8 = tmp_path / "cpu8"
    in_parallel(lambda: run_module("export", *_common(checkpoint), "--frames", "9", "--target", "cpu-8", "--out",
                                   str(cpu8)),
                lambda: run_module("runtime", "generate", str(bundles["fp32"]), *args, "--out",
                                   str(tmp_path / "one.mp4"), "--frames-out", str(tmp_path / "one.safetensors")))
    run_module("runtime", "generate", str(cpu8), *args, "--out", str(tmp_path / "eight.mp4"), "--frames-out",
               str(tmp_path / "eight.safetensors"), env=_devices(8))
    run_processes(["generate", str(cpu8), *args, "--out", str(tmp_path / "two.mp4"), "--frames-out",
                   str(tmp_path / "two.safetensors")])
    one, eight, two = (load_file(str(tmp_path / f"{n}.safetensors"))["frames"] for n in ("one", "eight", "two"))
    assert one.shape == (1, 14, HEIGHT, WIDTH, 3)
    assert np.abs(one - eight).max() <= 1e-5 and np.abs(eight - two).max() <= 1e-5


@pytest.mark.slow  # Animate's LoRA and Euler: test_lora merges at export, test_samplers runs Euler against diffusers
def test_a_merged_lora_with_the_few_step_euler_sampler(bundles, checkpoint) -> None:
    """lightx2v-style distilled Animate: a Wan-format LoRA merged at export, Euler at shift 5, 4 steps, guidance 1,
    two segments: diffusers' pipeline with the LoRA loaded and FlowMatchEulerDiscreteScheduler."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = runtime.load(bundles["lora"])
    g = pipe.shape()
    noises = [pipe.initial_latents(20 + i, g) for i in range(2)]
    image = test_image(64, 32, seed=8)
    kw = _inputs(15, "animate", seed=10)
    ours = pipe.generate(PROMPT, image=image, steps=4, guidance=1.0, sampler="euler", flow_shift=5.0, latents=noises,
                         progress=False, **kw)
    with torch.no_grad():
        want = _diffusers(checkpoint, noises, FlowMatchEulerDiscreteScheduler(shift=5.0),
                          (bundles["lora-file"], 0.7))(
            image=image, prompt=PROMPT, height=HEIGHT, width=WIDTH, segment_frame_length=9, num_inference_steps=4,
            guidance_scale=1.0, max_sequence_length=MAX_LEN, output_type="np", **kw).frames
    assert np.abs(ours - want).max() <= FP32_TOL
    plain = runtime.load(bundles["fp32"]).generate(PROMPT, image=image, steps=4, guidance=1.0, sampler="euler",
                                                   flow_shift=5.0, latents=noises, progress=False, **kw)
    assert np.abs(plain - ours).max() > 1e-3  # the LoRA changed the video


def test_int8_weights_are_close_to_fp32_and_verify(bundles) -> None:
    from tools.quality import psnr

    q = runtime.load(bundles["int8"])
    assert q.manifest.weights["transformer"].quantized.get("face_adapter.0.to_q.weight") == "int8"
    kw = dict(image=test_image(40, 40, seed=2), steps=3, guidance=2.0, seed=4, progress=False, **_inputs(12, "animate"))
    assert psnr(q.generate(PROMPT, **kw), runtime.load(bundles["fp32"]).generate(PROMPT, **kw, frames=9)) > 30
    assert "ready to run" in run_cli("runtime", "verify", str(bundles["int8"])).stdout


def test_bad_input_is_one_line_and_writes_nothing(bundles, tmp_path) -> None:
    test_image(32, 32).save(tmp_path / "me.png")
    pose = _write_frames(_video(9, WIDTH, HEIGHT), tmp_path / "pose")
    face = _write_frames(_video(9, FACE, FACE), tmp_path / "face")
    face8 = _write_frames(_video(8, FACE, FACE), tmp_path / "face8")
    one_pose = _write_frames(_video(1, WIDTH, HEIGHT), tmp_path / "one-pose")
    one_face = _write_frames(_video(1, FACE, FACE), tmp_path / "one-face")
    background8 = _write_frames(_video(8, WIDTH, HEIGHT), tmp_path / "background8")
    mask = _write_frames(_mask(9, WIDTH, HEIGHT), tmp_path / "mask")
    both = ["--pose-video", str(pose), "--face-video", str(face)]
    image = ["--image", str(tmp_path / "me.png")]
    out = tmp_path / "o.mp4"
    cases = [
        ([*image, "--pose-video", str(pose), "--face-video", str(face8)],
         "error: face_video has 8 frames and pose_video 9: give one face frame per pose frame"),
        ([*image, "--pose-video", str(one_pose), "--face-video", str(one_face)],
         "error: the pose video has 1 frame: it needs at least prev_segment_frames + 1 = 2"),
        ([*image, *both, "--background-video", str(pose)],
         "error: background_video is for mode 'replace': leave it out, or use mode 'replace'"),
        ([*image, *both, "--mask-video", str(mask)], "error: mask_video is for mode 'replace'"),
        ([*image, *both, "--mode", "replace", "--background-video", str(pose)],
         "error: mode 'replace' needs a background video and a mask video: give mask_video (--mask-video)"),
        ([*image, *both, "--mode", "replace", "--background-video", str(background8), "--mask-video", str(mask)],
         "error: background_video has 8 frames and pose_video 9"),
        ([*image, "--pose-video", str(pose)], "error: Wan-Animate needs a pose video and a face video: give "
                                              "face_video (--face-video)"),
        ([*image, *both, "--prev-segment-frames", "5"],
         "error: prev_segment_frames 5 needs segments of at least 11 frames, and this shape's are 9"),
        ([*image, *both, "--prev-segment-frames", "3"], "error: prev_segment_frames must be 1 or 5"),
        ([*image, *both, "--frames", "17"], "error: this bundle makes no 64x32 x 17 frames video"),
        (both, "error: Wan-Animate needs the character's image"),
        ([*image, *both, "--video", str(pose)], "error: this bundle is Wan 2.2 Animate"),
    ]
    for args, message in cases:
        proc = run_cli("runtime", "generate", str(bundles["fp32"]), "--prompt", "a", "--steps", "2", *args, "--out",
                       str(out), check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.startswith(message) and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
        assert not out.exists()
    # the Animate inputs on another kind's bundle; and stage by stage, which cannot run segments
    golden = ROOT / "artifacts" / "golden" / "schema-9" / "bundle"
    proc = run_cli("runtime", "generate", str(golden), "--prompt", "a", *both, "--out", str(out), check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == ("error: this bundle is Wan 2.1 text-to-video: pose_video "
                                                            "is for Wan-Animate models")
    proc = run_cli("runtime", "denoise", str(bundles["fp32"]), "--embeds", str(tmp_path / "e.safetensors"),
                   "--out", str(tmp_path / "l.safetensors"), check=False)
    assert proc.returncode == 2 and "use `generate`" in proc.stderr
    pipe = runtime.load(bundles["fp32"])
    with pytest.raises(UserError, match=r"latents: give one initial noise per segment \(2 here\)"):
        pipe.generate("a", image=str(tmp_path / "me.png"), latents=[pipe.initial_latents(0)], progress=False,
                      **_inputs(14, "animate"))


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_the_server_takes_the_videos_as_multipart_files(bundles, tmp_path) -> None:
    """A replace job with the character as input_reference and the pose, face, background and mask videos as more
    file parts: the CLI's video, as long as the pose video; the document requires the videos and offers no seconds;
    what does not fit is a 400 naming the field."""
    import httpx

    from .test_serve import KEY, _mp4_frames, _wait, serving

    n = 14
    test_image(40, 48, seed=12).save(tmp_path / "me.png")
    files = {"pose_video": _mp4(_video(n, WIDTH, HEIGHT, seed=13), tmp_path / "pose.mp4"),
             "face_video": _mp4(_video(n, FACE, FACE, seed=14), tmp_path / "face.mp4"),
             "background_video": _mp4(_video(n, WIDTH, HEIGHT, seed=15), tmp_path / "background.mp4"),
             "mask_video": _mp4(_mask(n, WIDTH, HEIGHT), tmp_path / "mask.mp4")}
    run_module("runtime", "generate", str(bundles["fp32"]), "--prompt", PROMPT, "--image", str(tmp_path / "me.png"),
               "--mode", "replace", *[a for k, p in files.items() for a in (f"--{k.replace('_', '-')}", str(p))],
               "--steps", "2", "--out", str(tmp_path / "cli.mp4"), "-q")
    want = _mp4_frames((tmp_path / "cli.mp4").read_bytes(), tmp_path).astype(np.int16)
    parts = {"input_reference": ("me.png", (tmp_path / "me.png").read_bytes(), "image/png"),
             **{k: (p.name, p.read_bytes(), "video/mp4") for k, p in files.items()}}
    headers = {"Authorization": f"Bearer {KEY}"}
    with serving(bundles["fp32"], tmp_path / "jobs", "--api-key", KEY) as server:
        client = server.client()
        card = client.models.list().data[0].model_dump()
        assert (card["kind"], card["animate"], card["video"], card["fps"]) == ("animate", True, False, 30)
        doc = httpx.get(server.url + "/openapi.json").json()
        schema = doc["paths"]["/v1/videos"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
        assert set(schema["required"]) == {"prompt", "input_reference", "pose_video", "face_video"}
        assert "seconds" not in schema["properties"] and schema["properties"]["mode"]["enum"] == ["animate", "replace"]
        assert schema["properties"]["prev_segment_frames"]["enum"] == [1, 5]
        replace = {"properties": {"mode": {"const": "replace"}}, "required": ["mode", "background_video", "mask_video"]}
        assert any(replace in rule.get("anyOf", []) for rule in schema["allOf"])  # replace takes both, animate neither
        r = httpx.post(server.url + "/v1/videos", headers=headers, files=parts,
                       data={"prompt": PROMPT, "mode": "replace", "num_inference_steps": "2"})
        assert r.status_code == 200, r.text
        assert r.json()["seconds"] == f"{n / 30:g}"
        video = _wait(client, r.json()["id"], ("completed", "failed"))
        assert video.status == "completed", video.error
        got = _mp4_frames(client.videos.download_content(video.id).read(), tmp_path).astype(np.int16)
        assert got.shape == want.shape and np.abs(got - want).max() <= 1
        short = _mp4(_video(n - 1, FACE, FACE), tmp_path / "short.mp4")
        animate_parts = {k: v for k, v in parts.items() if k not in ("background_video", "mask_video")}
        for extra, data, param, message in [
            ({**animate_parts, "face_video": ("s.mp4", short.read_bytes(), "video/mp4")}, {}, "face_video",
             f"face_video has {n - 1} frames and pose_video {n}"),
            (parts, {}, "background_video", "background_video is for mode 'replace'"),
            (animate_parts, {"mode": "replace"}, "background_video", "mode 'replace' needs a background video"),
            ({k: v for k, v in animate_parts.items() if k != "face_video"}, {}, "face_video",
             "Wan-Animate needs a pose video and a face video"),
            (animate_parts, {"seconds": "0.3"}, "seconds", "a Wan-Animate video is as long as its pose video"),
            (animate_parts, {"prev_segment_frames": "3"}, "prev_segment_frames", "prev_segment_frames must be one "
                                                                               "of 1, 5"),
            (animate_parts, {"prev_segment_frames": "5"}, "prev_segment_frames", "prev_segment_frames 5 needs "
                                                                               "segments of at least 11 frames"),
            (animate_parts, {"num_inference_steps": "700"}, "pose_video", "2 segments of 700 steps are 1400 steps"),
        ]:
            r = httpx.post(server.url + "/v1/videos", headers=headers, files=extra, data={"prompt": PROMPT, **data})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text)
            assert r.json()["error"]["message"].startswith(message), r.text


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_the_playground_takes_the_character_and_the_videos(bundles, tmp_path) -> None:
    """On an Animate bundle the page asks for the character image, the pose and face videos and the mode (no
    duration: the pose video's), shows the background and mask inputs for replace, and a job made there is the CLI's
    video from those files."""
    from .test_playground import CHROMIUM, sync_api
    from .test_serve import _mp4_frames, _wait, serving

    n = 10
    test_image(36, 44, seed=20).save(tmp_path / "me.png")
    pose = _mp4(_video(n, WIDTH, HEIGHT, seed=21), tmp_path / "pose.mp4")
    face = _mp4(_video(n, FACE, FACE, seed=22), tmp_path / "face.mp4")
    run_module("runtime", "generate", str(bundles["fp32"]), "--prompt", PROMPT, "--image", str(tmp_path / "me.png"),
               "--pose-video", str(pose), "--face-video", str(face), "--steps", "2", "--out", str(tmp_path / "cli.mp4"),
               "-q")
    want = _mp4_frames((tmp_path / "cli.mp4").read_bytes(), tmp_path).astype(np.int16)
    with serving(bundles["fp32"], tmp_path / "jobs") as server, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(server.url + "/")
        sync_api.expect(page.get_by_label("Prompt", exact=True)).to_be_visible()
        for shown in ("Character image", "Pose video (the video is as long)", "Face video (one face crop per pose "
                      "frame)", "Mode", "Frames carried between segments"):
            assert page.get_by_label(shown).is_visible(), shown
        for hidden in ("Duration", "Background video (without the person)", "Video (control or source)"):
            assert not page.get_by_label(hidden).is_visible(), hidden
        page.get_by_label("Mode").select_option("replace")
        assert page.get_by_label("Background video (without the person)").is_visible()
        page.get_by_label("Mode").select_option("animate")
        page.get_by_label("Prompt", exact=True).fill(PROMPT)
        page.get_by_label("Steps").fill("2")
        page.get_by_label("Character image").set_input_files(str(tmp_path / "me.png"))
        page.get_by_label("Pose video (the video is as long)").set_input_files(str(pose))
        page.get_by_label("Face video (one face crop per pose frame)").set_input_files(str(face))
        page.get_by_role("button", name="Generate").click()
        video = page.locator("#jobs li").first.locator("video")
        sync_api.expect(video).to_have_count(1, timeout=120_000)
        browser.close()
        client = server.client(key="unused")
        job = _wait(client, client.videos.list(limit=1).data[0].id, "completed")
        got = _mp4_frames(client.videos.download_content(job.id).read(), tmp_path).astype(np.int16)
        assert got.shape == want.shape == (n, HEIGHT, WIDTH, 3) and np.abs(got - want).max() <= 1
