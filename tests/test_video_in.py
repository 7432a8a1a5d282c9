"""Video in: VACE (control video, mask, reference images; one expert, and in the slow tier two experts with two
reference images) and video-to-video against diffusers' WanVACEPipeline and WanVideoToVideoPipeline on tiny models saved
with save_pretrained (fp32, the same initial latents or noise), the same frames on 1 and 8 devices (the slow tier), the
CLI with an mp4 control video, and what bad input says."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest

import runtime
from runtime.errors import UserError

from .conftest import ROOT, OnDemand, devices_env, in_parallel, run_cli, run_module, test_image

PROMPT = "a boat sailing across a stormy sea"
NEGATIVE = "blurry"
FP32_TOL = 1e-4
# (variant, resolution, frames, max sequence length, extra export arguments)
CASES = {
    "vace": ("tiny-vace", "64x32", 9, 16, ["--reference-images", "0,1"]),
    "vace-moe": ("tiny-vace-moe", "32x32", 5, 16, ["--reference-images", "2"]),
    "v2v": ("tiny-v2v", "64x32", 9, 16, []),
}


# What only the slow tier reads: the two-expert VACE model's checkpoint and bundle (built when first asked for).
SLOW_CASES = {"vace-moe"}


@pytest.fixture(scope="module")
def video_checkpoints(tmp_path_factory) -> OnDemand:
    from export import tiny

    root = tmp_path_factory.mktemp("video-in-checkpoints")
    save = {case: functools.partial(tiny.save, variant, root / case) for case, (variant, *_) in CASES.items()}
    return OnDemand(save, done={case: save[case]() for case in CASES if case not in SLOW_CASES})


@pytest.fixture(scope="module")
def bundles(video_checkpoints, tmp_path_factory) -> OnDemand:
    """Each case exported fp32: the default run's at once, two at a time, the slow tier's when first asked for."""
    root = tmp_path_factory.mktemp("video-in-bundles")

    def export(case: str) -> Path:
        _, res, frames, max_len, extra = CASES[case]
        run_module("export", "--model", str(video_checkpoints[case]), "--resolution", res, "--frames", str(frames),
                   "--dtype", "fp32", "--max-sequence-length", str(max_len), *extra, "--out", str(root / case), "-q")
        return root / case

    return OnDemand.start({case: functools.partial(export, case) for case in CASES},
                          now=[case for case in CASES if case not in SLOW_CASES])


def _video(frames: int, width: int, height: int, seed: int = 0) -> list:
    """Structured frames (moving gradients plus noise), as PIL images."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    out = []
    for t in range(frames):
        base = np.stack([(x * 4 + t * 9) % 256, (y * 6 + t * 5) % 256, (x + y + t * 13) % 256], axis=-1)
        out.append(Image.fromarray(np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)))
    return out


def _mask(frames: int, width: int, height: int) -> list:
    """A moving box to generate (white) in a kept (black) frame, greyscale."""
    from PIL import Image

    out = []
    for t in range(frames):
        m = np.zeros((height, width), np.uint8)
        m[height // 4: 3 * height // 4, t * 2: t * 2 + width // 2] = 255
        out.append(Image.fromarray(m, mode="L"))
    return out


def _diffusers(checkpoint: Path, cls: str):
    import diffusers
    import torch

    ref = getattr(diffusers, cls).from_pretrained(str(checkpoint), dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    return ref


@pytest.mark.parametrize("case,inputs,guidance_2", [
    ("vace", "video+mask+reference", None),
    ("vace", "control", None),
    # the slow tier's: another kind (both experts run: timesteps 999, 900 | 750, 500) with two reference images
    pytest.param("vace-moe", "video+mask+2 references", 3.0, marks=pytest.mark.slow),
])
def test_vace_matches_diffusers(case, inputs, guidance_2, bundles, video_checkpoints) -> None:
    import torch

    _, res, frames, max_len, _ = CASES[case]
    width, height = map(int, res.split("x"))
    kw: dict = {"video": _video(frames, width, height)}
    if "mask" in inputs:
        kw["mask"] = _mask(frames, width, height)
    n_refs = 2 if "2 references" in inputs else 1 if "reference" in inputs else 0
    if n_refs:
        kw["reference_images"] = [test_image(40 + 9 * i, 50 - 7 * i, seed=i) for i in range(n_refs)]
    pipe = runtime.load(bundles[case])
    g = pipe.shape(None, frames, n_refs)
    init = pipe.initial_latents(5, g)
    ours = pipe.generate(PROMPT, NEGATIVE, seed=5, steps=4, guidance=5.0, guidance_2=guidance_2, progress=False, **kw)
    extra = {} if guidance_2 is None else {"guidance_scale_2": guidance_2}
    with torch.no_grad():
        want = _diffusers(video_checkpoints[case], "WanVACEPipeline")(
            prompt=PROMPT, negative_prompt=NEGATIVE, height=height, width=width, num_frames=frames,
            num_inference_steps=4, guidance_scale=5.0, max_sequence_length=max_len, output_type="np",
            latents=torch.from_numpy(init.copy()), **extra, **kw).frames
    assert ours.shape == want.shape == (1, frames, height, width, 3)
    assert np.abs(ours - want).max() <= FP32_TOL
    # the control mattered: without it (a zero video, no mask, no reference) the video differs
    plain = pipe.generate(PROMPT, NEGATIVE, seed=5, steps=4, guidance=5.0, guidance_2=guidance_2, progress=False,
                          latents=pipe.initial_latents(5, pipe.shape(None, frames, 0))) if n_refs == 0 else None
    if plain is not None:
        assert np.abs(plain - ours).max() > 1e-3


def test_vace_conditioning_scale_is_per_layer_as_diffusers(bundles, video_checkpoints) -> None:
    import torch

    _, res, frames, max_len, _ = CASES["vace"]
    width, height = map(int, res.split("x"))
    pipe = runtime.load(bundles["vace"])
    video = _video(frames, width, height, seed=2)
    init = pipe.initial_latents(1, pipe.shape(None, frames, 0))
    ours = pipe.generate(PROMPT, seed=1, steps=3, guidance=1.0, video=video, conditioning_scale=[0.3, 1.7],
                         progress=False)
    with torch.no_grad():
        want = _diffusers(video_checkpoints["vace"], "WanVACEPipeline")(
            prompt=PROMPT, height=height, width=width, num_frames=frames, num_inference_steps=3, guidance_scale=1.0,
            max_sequence_length=max_len, output_type="np", latents=torch.from_numpy(init.copy()), video=video,
            conditioning_scale=[0.3, 1.7]).frames
    assert np.abs(ours - want).max() <= FP32_TOL
    with pytest.raises(UserError, match="conditioning_scale must be a number or a list of 2 numbers"):
        pipe.generate(PROMPT, steps=1, video=video, conditioning_scale=[1.0, 2.0, 3.0], progress=False)


@pytest.mark.parametrize("sampler,steps,strength", [("unipc", 5, 0.6), ("euler", 4, 0.6)])
def test_video_to_video_matches_diffusers(sampler, steps, strength, bundles, video_checkpoints) -> None:
    """The same Gaussian noise (`noise=`, what diffusers' randn_tensor draws from the same generator): the video's
    latents noised at the step strength picks, then the remaining steps."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.utils.torch_utils import randn_tensor

    _, res, frames, max_len, _ = CASES["v2v"]
    width, height = map(int, res.split("x"))
    pipe = runtime.load(bundles["v2v"])
    assert pipe.manifest.video_to_video and "vae_encode_next" in pipe.manifest.programs
    video = _video(frames, width, height, seed=3)
    shape = pipe.geometry.latent_shape
    noise = randn_tensor(shape, generator=torch.Generator().manual_seed(4), dtype=torch.float32)
    ours = pipe.generate(PROMPT, NEGATIVE, steps=steps, guidance=5.0, video=video, strength=strength,
                         noise=noise.numpy(), sampler=sampler, progress=False)
    ref = _diffusers(video_checkpoints["v2v"], "WanVideoToVideoPipeline")
    if sampler == "euler":
        ref.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.manifest.defaults.flow_shift)
    with torch.no_grad():
        want = ref(prompt=PROMPT, negative_prompt=NEGATIVE, video=video, height=height, width=width,
                   num_inference_steps=steps, guidance_scale=5.0, strength=strength, max_sequence_length=max_len,
                   generator=torch.Generator().manual_seed(4), output_type="np").frames
    assert ours.shape == want.shape
    assert np.abs(ours - want).max() <= FP32_TOL
    # the strength and the video both matter
    weaker = pipe.generate(PROMPT, NEGATIVE, steps=steps, guidance=5.0, video=video, strength=0.3,
                           noise=noise.numpy(), sampler=sampler, progress=False)
    other = pipe.generate(PROMPT, NEGATIVE, steps=steps, guidance=5.0, video=_video(frames, width, height, seed=8),
                          strength=strength, noise=noise.numpy(), sampler=sampler, progress=False)
    assert np.abs(weaker - ours).max() > 1e-3 and np.abs(other - ours).max() > 1e-3


def _write_frames(frames: list, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, f in enumerate(frames):
        f.save(folder / f"frame{i}.png")  # frame10 after frame9: natural order
    return folder


@pytest.mark.slow  # a variant on 8 devices: test_multidevice covers the mechanism
def test_same_frames_on_1_and_8_devices(bundles, video_checkpoints, tmp_path) -> None:
    """The VACE bundle exported for cpu-8 makes the frames of the one-device bundle (1e-5), from a folder of frames,
    a mask folder and a reference image."""
    from safetensors.numpy import load_file

    _, res, frames, max_len, extra = CASES["vace"]
    width, height = map(int, res.split("x"))
    eight = tmp_path / "cpu8"
    run_module("export", "--model", str(video_checkpoints["vace"]), "--resolution", res, "--frames", str(frames),
               "--dtype", "fp32", "--max-sequence-length", str(max_len), *extra, "--target", "cpu-8", "--out",
               str(eight), "-q")
    video = _write_frames(_video(frames, width, height, seed=6), tmp_path / "video")
    mask = _write_frames(_mask(frames, width, height), tmp_path / "mask")
    test_image(30, 30, seed=9).save(tmp_path / "ref.png")
    args = ["--prompt", PROMPT, "--steps", "3", "--seed", "2", "--video", str(video), "--mask", str(mask),
            "--reference-image", str(tmp_path / "ref.png"), "-q"]
    in_parallel(lambda: run_module("runtime", "generate", str(bundles["vace"]), *args, "--out",
                                   str(tmp_path / "one.mp4"), "--frames-out", str(tmp_path / "one.safetensors")),
                lambda: run_module("runtime", "generate", str(eight), *args, "--out", str(tmp_path / "eight.mp4"),
                                   "--frames-out", str(tmp_path / "eight.safetensors"),
                                   env=devices_env(8)))
    one, eight_frames = (load_file(str(tmp_path / f"{n}.safetensors"))["frames"] for n in ("one", "eight"))
    assert one.shape == (1, frames, height, width, 3)
    assert np.abs(one - eight_frames).max() <= 1e-5


def test_the_cli_reads_folders_and_an_mp4_as_the_api_does(bundles, tmp_path) -> None:
    """The CLI's --video, --mask and --reference-image from folders of frames and an image file make the Python
    API's frames; its --video reads an mp4 as the Python API does."""
    import imageio.v2 as imageio
    from safetensors.numpy import load_file

    _, res, frames, _, _ = CASES["vace"]
    width, height = map(int, res.split("x"))
    video = _write_frames(_video(frames, width, height, seed=6), tmp_path / "video")
    mask = _write_frames(_mask(frames, width, height), tmp_path / "mask")
    test_image(30, 30, seed=9).save(tmp_path / "ref.png")
    run_cli("runtime", "generate", str(bundles["vace"]), "--prompt", PROMPT, "--steps", "2", "--seed", "2", "--video",
            str(video), "--mask", str(mask), "--reference-image", str(tmp_path / "ref.png"), "-q", "--out",
            str(tmp_path / "folders.mp4"), "--frames-out", str(tmp_path / "folders.safetensors"))
    pipe = runtime.load(bundles["vace"])
    want = pipe.generate(PROMPT, steps=2, seed=2, video=str(video), mask=str(mask),
                         reference_images=[str(tmp_path / "ref.png")], progress=False)
    np.testing.assert_allclose(load_file(str(tmp_path / "folders.safetensors"))["frames"], want, rtol=0, atol=1e-6)
    # an mp4 control video through the CLI: the frames the Python API makes from the same file
    mp4 = tmp_path / "control.mp4"
    imageio.mimwrite(str(mp4), [np.asarray(f) for f in _video(frames, width, height, seed=7)], fps=16,
                     macro_block_size=1)
    cli = run_module("runtime", "generate", str(bundles["vace"]), "--prompt", PROMPT, "--steps", "2", "--video",
                     str(mp4), "--out", str(tmp_path / "cli.mp4"), "--frames-out", str(tmp_path / "cli.safetensors"),
                     "-q")
    assert "os.fork()" not in cli.stderr, cli.stderr  # ffmpeg's fork-and-exec is not JAX's deadlock
    api = pipe.generate(PROMPT, steps=2, video=str(mp4), progress=False)
    np.testing.assert_allclose(load_file(str(tmp_path / "cli.safetensors"))["frames"], api, rtol=0, atol=1e-6)
    assert (tmp_path / "cli.mp4").stat().st_size > 0


def test_bad_video_input_is_one_line_and_writes_nothing(bundles, tmp_path) -> None:
    _, res, frames, _, _ = CASES["vace"]
    width, height = map(int, res.split("x"))
    video = _write_frames(_video(frames, width, height), tmp_path / "video")
    short = _write_frames(_video(frames - 4, width, height), tmp_path / "short")
    wrong_size = _write_frames(_mask(frames, width // 2, height), tmp_path / "small-mask")
    few = _write_frames(_mask(frames - 1, width, height), tmp_path / "few-mask")
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.mp4").write_bytes(b"not a video at all")
    test_image(20, 20).save(tmp_path / "ref.png")
    ref = ["--reference-image", str(tmp_path / "ref.png")]
    out = tmp_path / "o.mp4"
    cases = [
        ("vace", ["--video", str(tmp_path / "broken.mp4")], "error: --video: cannot read broken.mp4 as a video"),
        ("vace", ["--video", str(tmp_path / "empty")], "error: --video: folder"),
        ("vace", ["--video", str(short)], f"error: the video has {frames - 4} frames; this bundle makes {frames}"),
        ("vace", ["--video", str(video), "--mask", str(wrong_size)],
         f"error: the mask is {width // 2}x{height}, the video {width}x{height}"),
        ("vace", ["--video", str(video), "--mask", str(few)], f"error: the mask has {frames - 1} frames, the video"),
        ("vace", [*ref, *ref], "error: 2 reference images: this bundle serves 0 or 1"),
        ("v2v", ["--video", str(video), "--strength", "1.5"], "error: strength must be a number in (0, 1]"),
        ("v2v", ["--video", str(video), "--strength", "0"], "error: strength must be a number in (0, 1]"),
        ("v2v", ["--video", str(video), "--mask", str(few)], "error: this bundle is Wan 2.1 text-to-video: it takes no "
                                                             "mask"),
    ]
    for case, args, message in cases:
        proc = run_cli("runtime", "generate", str(bundles[case]), "--prompt", "a", "--steps", "2", *args, "--out",
                       str(out), check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.startswith(message) and len(proc.stderr.strip().splitlines()) == 1, (args, proc.stderr)
        assert not out.exists()


def test_a_video_to_a_bundle_that_takes_none_is_refused(tmp_path) -> None:
    bundle = ROOT / "artifacts" / "golden" / "schema-9" / "bundle"  # Wan 2.1 text-to-video, no VAE encoder
    video = _write_frames(_video(5, 32, 32), tmp_path / "video")
    proc = run_cli("runtime", "generate", str(bundle), "--prompt", "a", "--video", str(video),
                   "--out", str(tmp_path / "o.mp4"), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: this bundle is Wan 2.1 text-to-video: it takes no video (export a "
                                   "text-to-video model with --video-to-video for video-to-video)")
    pipe = runtime.load(bundle)
    with pytest.raises(UserError, match="it takes no video"):
        pipe.generate("a", video=str(video), progress=False)


# -- the server: video uploads -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vace_server(bundles, tmp_path_factory):
    """The VACE bundle served (with a key), for the tests of this module that need one."""
    from .test_serve import KEY, serving

    with serving(bundles["vace"], tmp_path_factory.mktemp("vace-server") / "jobs", "--api-key", KEY) as server:
        yield server


@pytest.fixture(scope="module")
def v2v_server(bundles, tmp_path_factory):
    from .test_serve import serving

    with serving(bundles["v2v"], tmp_path_factory.mktemp("v2v-server") / "jobs") as server:
        yield server


def _mp4(frames: list, path: Path) -> Path:
    import imageio.v2 as imageio

    imageio.mimwrite(str(path), [np.asarray(f.convert("RGB")) for f in frames], fps=16, macro_block_size=1)
    return path


def _served(client, video_id: str, tmp_path: Path) -> np.ndarray:
    from .test_serve import _mp4_frames, _wait

    video = _wait(client, video_id, ("completed", "failed"))
    assert video.status == "completed", video.error
    return _mp4_frames(client.videos.download_content(video_id).read(), tmp_path).astype(np.int16)


def _cli(bundle: Path, tmp_path: Path, name: str, *args: str) -> np.ndarray:
    from .test_serve import _mp4_frames

    run_module("runtime", "generate", str(bundle), "--prompt", PROMPT, *args, "--out", str(tmp_path / f"{name}.mp4"),
               "-q")
    return _mp4_frames((tmp_path / f"{name}.mp4").read_bytes(), tmp_path).astype(np.int16)


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_the_server_takes_videos_through_the_openai_sdk(bundles, vace_server, v2v_server, tmp_path) -> None:
    """A VACE job with an mp4 control video sent as the openai SDK sends input_reference (a multipart file), a mask
    and a reference image as more file parts, and a video-to-video job with its strength: each the CLI's video;
    what does not fit the bundle is a 400 naming the field."""
    import httpx

    from .test_serve import KEY

    _, res, frames, _, _ = CASES["vace"]
    width, height = map(int, res.split("x"))
    control = _mp4(_video(frames, width, height, seed=11), tmp_path / "control.mp4")
    mask = _mp4(_mask(frames, width, height), tmp_path / "mask.mp4")
    test_image(30, 40, seed=5).save(tmp_path / "ref.png")
    want = _cli(bundles["vace"], tmp_path, "vace", "--video", str(control), "--mask", str(mask), "--reference-image",
                str(tmp_path / "ref.png"), "--steps", "2", "--conditioning-scale", "0.5")
    server = vace_server
    client = server.client()
    card = client.models.list().data[0].model_dump()
    assert (card["video"], card["mask"], card["reference_images"]) == (True, True, [0, 1])
    files = {"input_reference": ("control.mp4", control.read_bytes(), "video/mp4"),
             "mask": ("mask.mp4", mask.read_bytes(), "video/mp4"),
             "reference_image": ("ref.png", (tmp_path / "ref.png").read_bytes(), "image/png")}
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/videos", headers=headers, files=files,
                   data={"prompt": PROMPT, "num_inference_steps": "2", "conditioning_scale": "0.5"})
    assert r.status_code == 200, r.text
    assert np.abs(_served(client, r.json()["id"], tmp_path) - want).max() <= 1
    # the SDK's own path: input_reference=open(...) and extra_body fields
    with open(control, "rb") as f:
        sdk = client.videos.create(prompt=PROMPT, input_reference=f, extra_body={"num_inference_steps": 2})
    sdk_want = _cli(bundles["vace"], tmp_path, "sdk", "--video", str(control), "--steps", "2")
    assert np.abs(_served(client, sdk.id, tmp_path) - sdk_want).max() <= 1
    short = _mp4(_video(frames - 4, width, height), tmp_path / "short.mp4")
    for extra, param, message in [
        ({"input_reference": ("s.mp4", short.read_bytes(), "video/mp4")}, "input_reference",
         f"input_reference has {frames - 4} frames"),
        ({**files, "mask": ("m.mp4", short.read_bytes(), "video/mp4")}, "mask", f"mask has {frames - 4} frames"),
        ({"input_reference": ("x.mp4", b"not a video", "video/mp4")}, "input_reference", "input_reference: "
                                                                                          "cannot read"),
        ([("reference_image", ("a.png", (tmp_path / "ref.png").read_bytes(), "image/png"))] * 2,
         "reference_image", "reference_image is sent 2 times; this bundle takes at most 1"),
    ]:
        r = httpx.post(server.url + "/v1/videos", headers=headers, files=extra, data={"prompt": PROMPT})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert r.json()["error"]["message"].startswith(message), r.text
    r = httpx.post(server.url + "/v1/videos", headers=headers, json={"prompt": PROMPT, "strength": 0.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "strength"
    source = _mp4(_video(frames, width, height, seed=12), tmp_path / "source.mp4")
    want = _cli(bundles["v2v"], tmp_path, "v2v", "--video", str(source), "--steps", "5", "--strength", "0.6")
    client = v2v_server.client(key="unused")
    with open(source, "rb") as f:
        video = client.videos.create(prompt=PROMPT, input_reference=f,
                                     extra_body={"num_inference_steps": 5, "strength": 0.6})
    assert np.abs(_served(client, video.id, tmp_path) - want).max() <= 1


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
def test_remix_edit_and_extend_on_vace_and_video_to_video(vace_server, v2v_server, tmp_path) -> None:
    """Through the SDK (a completed video by reference as extra_body={"video": {"id": ...}}, an upload as a file):
    VACE extends a video (its last frames kept as the given frames of the new part's: the result begins with the
    source's frames, the frames they share once) and remakes one (its latents noised at `strength`); a
    video-to-video bundle remakes and edits, and refuses to extend, naming the kinds that do."""
    import openai

    from .test_serve import _mp4_frames, _wait

    def frames_of(client, video_id: str) -> np.ndarray:
        return _mp4_frames(client.videos.download_content(video_id).read(), tmp_path).astype(np.int16)

    client = vace_server.client()
    source = client.videos.create_and_poll(prompt=PROMPT, extra_body={"num_inference_steps": 2}, poll_interval_ms=50)
    first = frames_of(client, source.id)
    longer = _wait(client, client.videos.extend(prompt="the boat sails on", seconds="0.5625", video=openai.omit,
                                                extra_body={"video": {"id": source.id}}).id, ("completed", "failed"))
    from runtime.serve.derive import vace_overlap

    kept = vace_overlap(9)
    assert (longer.status, longer.remixed_from_video_id) == ("completed", source.id), longer.error
    extended = frames_of(client, longer.id)
    assert extended.shape[0] == 9 + 9 - kept and longer.seconds == f"{(18 - kept) / 16:g}"
    assert np.abs(extended[:9] - first).mean() < 3  # the source's frames (encoded once more)
    remix = _wait(client, client.videos.remix(source.id, prompt="a calm sea", extra_body={"strength": 0.7}).id,
                  ("completed", "failed"))
    from PIL import Image

    with open(_mp4([Image.fromarray(f.astype(np.uint8)) for f in first], tmp_path / "upload.mp4"), "rb") as f:
        edit = _wait(client, client.videos.edit(prompt="a calm sea", video=f).id, ("completed", "failed"))
    for made, from_id in ((remix, source.id), (edit, None)):
        assert (made.status, made.remixed_from_video_id, made.seconds) == ("completed", from_id, "0.5625"), made.error
        assert np.abs(frames_of(client, made.id) - first).max() > 8  # remade
    client = v2v_server.client(key="unused")
    with open(tmp_path / "upload.mp4", "rb") as f:
        v2v = client.videos.create_and_poll(prompt=PROMPT, input_reference=f, poll_interval_ms=50,
                                            extra_body={"num_inference_steps": 3})
    remix = _wait(client, client.videos.remix(v2v.id, prompt="a calm sea").id, ("completed", "failed"))
    with open(tmp_path / "upload.mp4", "rb") as f:
        edit = _wait(client, client.videos.edit(prompt="a calm sea", video=f, extra_body={"strength": 1.0}).id,
                     ("completed", "failed"))
    for made, from_id in ((remix, v2v.id), (edit, None)):
        assert (made.status, made.remixed_from_video_id) == ("completed", from_id), made.error
    with pytest.raises(openai.BadRequestError) as e:
        client.videos.extend(prompt="more", seconds="0.5625", video=openai.omit, extra_body={"video": {"id": v2v.id}})
    assert e.value.body["param"] == "video" and "the kinds that extend: ti2v, i2v, i2v-moe, vace, vace-moe, " \
        "skyreels-i2v, skyreels-df" in e.value.body["message"]


def test_the_playground_takes_a_video_mask_and_references(bundles, vace_server, tmp_path) -> None:
    """On a VACE bundle the page shows its video, mask and reference image inputs (no strength, which is
    video-to-video's), and a job made there with the Euler sampler is the CLI's video with those flags."""
    from .test_playground import CHROMIUM, sync_api
    from .test_serve import KEY

    _, res, frames, _, _ = CASES["vace"]
    width, height = map(int, res.split("x"))
    control = _mp4(_video(frames, width, height, seed=13), tmp_path / "control.mp4")
    test_image(24, 40, seed=6).save(tmp_path / "ref.png")
    want = _cli(bundles["vace"], tmp_path, "cli", "--video", str(control), "--reference-image",
                str(tmp_path / "ref.png"), "--steps", "2", "--sampler", "euler")
    server = vace_server
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(server.url + "/")
        page.get_by_label("API key").fill(KEY)
        page.get_by_label("API key").press("Enter")
        sync_api.expect(page.get_by_label("Prompt", exact=True)).to_be_visible()
        for shown in ("Video (control or source)", "Mask video (white areas are made anew)", "Reference images",
                      "Sampler", "Control scale"):
            assert page.get_by_label(shown).is_visible(), shown
        for hidden in ("Image (first frame)", "Strength"):
            assert not page.get_by_label(hidden).is_visible(), hidden
        page.get_by_label("Prompt", exact=True).fill(PROMPT)
        page.get_by_label("Steps").fill("2")
        page.get_by_label("Sampler").select_option("euler")
        page.get_by_label("Video (control or source)").set_input_files(str(control))
        page.get_by_label("Reference images").set_input_files([str(tmp_path / "ref.png")])
        page.get_by_role("button", name="Generate").click()
        video = page.locator("#jobs li").first.locator("video")
        sync_api.expect(video).to_have_count(1, timeout=120_000)
        page.wait_for_function("v => v.readyState >= 1 && v.duration > 0", arg=video.element_handle(),
                               timeout=60_000)
        browser.close()
        client = server.client()
        job = client.videos.list(limit=1).data[0]
        assert np.abs(_served(client, job.id, tmp_path) - want).max() <= 1


def test_vace_with_magcache_cfg_free_steps_int8_and_verify(bundles, video_checkpoints, tmp_path) -> None:
    """What the other kinds have works on VACE: MagCache (calibrated, then skipping steps: its cached step skips the
    VACE branch with the blocks), CFG-free steps (guidance 1 runs the cond-only program: the CFG program's result),
    int8 weights (close to fp32), and verify."""
    from tools.quality import psnr

    _, res, frames, max_len, extra = CASES["vace"]
    width, height = map(int, res.split("x"))
    video = _video(frames, width, height, seed=21)
    pipe = runtime.load(bundles["vace"])
    embeds = pipe.encode(PROMPT, NEGATIVE, video=video)
    full = pipe.denoise(embeds, seed=1, steps=8, guidance=5.0, progress=False)
    ratios = pipe.calibrate(embeds, seed=1, steps=8, guidance=5.0, progress=False)
    cache = runtime.MagCache(ratios, threshold=0.5, retention_ratio=0.2)
    assert cache.schedule([0] * 8).count(False) > 0  # some steps are skipped
    cached = pipe.denoise(embeds, seed=1, steps=8, guidance=5.0, magcache=cache, progress=False)
    assert 0 < np.abs(cached - full).max() and psnr(pipe.decode(cached), pipe.decode(full)) > 20
    cond = pipe.denoise(embeds, seed=1, steps=3, guidance=1.0, progress=False)
    programs = pipe.step_programs
    pipe.step_programs = lambda *a, **k: ["denoise_step"] * 3
    np.testing.assert_allclose(pipe.denoise(embeds, seed=1, steps=3, guidance=1.0, progress=False), cond,
                               rtol=0, atol=1e-5)
    pipe.step_programs = programs
    int8 = tmp_path / "int8"
    run_module("export", "--model", str(video_checkpoints["vace"]), "--resolution", res, "--frames", str(frames),
               "--dtype", "fp32", "--max-sequence-length", str(max_len), *extra, "--quantize", "int8", "--out",
               str(int8), "-q")
    q = runtime.load(int8)
    assert q.manifest.weights["transformer"].quantized.get("vace_blocks.0.attn1.to_q.weight") == "int8"
    ours = q.generate(PROMPT, NEGATIVE, seed=2, steps=3, video=video, progress=False)
    ref = pipe.generate(PROMPT, NEGATIVE, seed=2, steps=3, video=video, progress=False)
    assert psnr(ours, ref) > 30
    assert "ready to run" in run_cli("runtime", "verify", str(int8)).stdout
