"""Wan-Animate 2 through the server (runtime/serve/animate2_request.py, run.py): `POST /v1/videos` with the character
as `input_reference` and the driving video as `driving_video` (multipart), its settings as fields; the job's video
is `pipe.generate`'s with the same seed and inputs, and its HLS stream gets a segment per video segment; what cannot
run is a 400 naming the field, with no job queued and nothing stored; the document and the model card say what it
takes; the playground offers it.

On the tiny distilled model (export/tiny.py tiny-animate-2-distilled: two blocks, no CFG), fp32, 9-frame segments at
32x48, one step. The app runs in this process on uvicorn with the loaded pipeline and a worker thread (the server's
own State, routes and worker), so the programs `pipe.generate` compiled are the job's too.
"""

from __future__ import annotations

import base64
import io
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from .conftest import run_module, shared, test_image

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")

W, H, SEGMENT = 32, 48, 9
PROMPT = "a dancer on a stage"
MAX_STEPS = 4  # the server's --max-steps: two segments of three steps are past it
FILE_FPS = 30  # the driving mp4's own rate, resampled to the request's fps (24, the bundle's)


@pytest.fixture(scope="module")
def bundle() -> Path:
    """The tiny distilled model's fp32 bundle, one shape: 32x48 x 9 frames."""
    from export import tiny

    variant = "tiny-animate-2-distilled"
    ckpt = shared(f"{variant}-checkpoint", lambda root: tiny.save(variant, root / "ckpt")) / "ckpt"
    return shared("api-animate-2-bundle", lambda root: run_module(
        "export", "--model", str(ckpt), "--resolution", f"{W}x{H}", "--frames", str(SEGMENT), "--dtype", "fp32",
        "--max-sequence-length", "16", "--out", str(root / "b"), "-q")) / "b"


@pytest.fixture(scope="module")
def pipe(bundle: Path) -> Any:
    import runtime

    return runtime.load(bundle)


@contextmanager
def serving_pipe(pipe: Any, bundle: Path, root: Path) -> Iterator[SimpleNamespace]:
    """The server's app for the loaded `pipe`, with its worker thread, on a loopback port in this process."""
    import uvicorn

    from runtime.serve.jobs import open_store
    from runtime.serve.metrics import make_metrics
    from runtime.serve.routes import create_app
    from runtime.serve.schema import Offer
    from runtime.serve.state import Settings, State
    from runtime.serve.worker import worker

    settings = Settings(bundle=bundle, jobs_dir=root / "jobs", max_steps=MAX_STEPS)
    state = State(settings=settings, store=open_store(root / "jobs"),
                  offer=Offer.of(pipe.manifest, bundle.resolve().name, MAX_STEPS))
    state.pipe = pipe
    state.metrics = make_metrics(state.store)
    state.ready.set()
    running = threading.Thread(target=worker, args=(state,), daemon=True)
    running.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    try:
        yield SimpleNamespace(url=url, state=state, jobs=root / "jobs",
                              client=openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        state.draining.set()
        state.wake.set()
        running.join(timeout=60)
        state.store.close()


@pytest.fixture(scope="module")
def server(pipe: Any, bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    with serving_pipe(pipe, bundle, tmp_path_factory.mktemp("animate-2-api")) as s:
        yield s


def _png(image: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _driving_mp4(frames: int, seed: int = 1) -> bytes:
    """A landscape driving video at FILE_FPS (letterboxed into the portrait frame), as an mp4's bytes."""
    import tempfile

    import imageio.v2 as imageio

    from .test_video_in import _video

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "driving.mp4"
        imageio.mimwrite(str(path), [np.asarray(f) for f in _video(frames, 40, 28, seed=seed)], fps=FILE_FPS,
                         macro_block_size=1)
        return path.read_bytes()


def _decode(data: bytes) -> np.ndarray:
    from .test_stream import decode_ts

    return decode_ts(data).astype(np.int16)


def _wait(client: Any, video_id: str, timeout: float = 300) -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        video = client.videos.retrieve(video_id)
        if video.status in ("completed", "failed"):
            return video
        time.sleep(0.05)
    raise AssertionError(f"{video_id} did not end in {timeout} s (last {video.status})")


def _stored(jobs: Path) -> set[Path]:
    """The files the server has stored (videos, images, streams), the job database aside."""
    return {p for p in jobs.rglob("*") if p.is_file() and not p.name.startswith("jobs.")}


def test_a_request_makes_the_frames_of_generate_and_streams_each_segment(server: SimpleNamespace, pipe: Any) -> None:
    """The character and an mp4 at 30 fps, sent by the openai SDK (the driving video as a data URL among its form
    fields): the job resamples it to 24 fps (its own rate, read from the file as the CLI reads it), makes the frames
    `pipe.generate` makes from the same inputs and seed (the two mp4s decode within 1 of 255: the same frames,
    encoded alike), reports the resampled length and the frame size, and streams one HLS segment per video segment
    (14 frames at 30 fps are 11 at 24: two segments of 9, none carried)."""
    import httpx

    from runtime.serve.body import read_video_bytes
    from runtime.video import write_video

    from .test_stream import stream_frames

    image = test_image(34, 50, seed=3)
    driving = _driving_mp4(14)
    # the openai SDK sends a multipart form: the image as a file part, extra_body's fields as form fields, the
    # driving video among them as a data URL
    created = server.client.videos.create(
        prompt=PROMPT, input_reference=("me.png", _png(image), "image/png"),
        extra_body={"driving_video": "data:video/mp4;base64," + base64.b64encode(driving).decode(),
                    "num_inference_steps": 1, "seed": 5, "prompt_ref": "a reference video",
                    "prev_segment_conditioning_frames": 0})
    assert (created.size, created.seconds) == (f"{W}x{H}", f"{11 / 24:g}")
    params = server.state.store.get(created.id).params
    assert (params["driving_video_fps"], params["prev_segment_conditioning_frames"], params["area"]) == (30.0, 0, None)
    video = _wait(server.client, created.id)
    assert video.status == "completed", video.error
    got = _decode(server.client.videos.download_content(video.id).read())

    want = pipe.generate(PROMPT, image=image, driving_video=read_video_bytes(driving, "driving_video"),
                         driving_video_fps=30.0, fps=24, steps=1, seed=5, prompt_ref="a reference video",
                         prev_segment_conditioning_frames=0, progress=False)[0]
    assert want.shape == (11, H, W, 3)
    mp4 = server.jobs.parent / "want.mp4"
    write_video(want, mp4, fps=24)
    expected = _decode(mp4.read_bytes())
    assert got.shape == expected.shape and np.abs(got - expected).max() <= 1

    base = f"{server.url}/v1/videos/{video.id}/"
    playlist = httpx.get(base + "stream.m3u8").text
    parsed, streamed = stream_frames(playlist, lambda name: httpx.get(base + name).content)
    assert parsed.ended and len(parsed.durations) == 2 and streamed.shape == got.shape, playlist
    assert [round(d * 24) for d in parsed.durations] == [9, 2]  # the first segment's 9 frames, the second's 2


def test_what_cannot_run_is_a_400_naming_the_field_and_nothing_is_kept(server: SimpleNamespace, tmp_path: Path) -> None:
    """No image, no driving video, a driving video that is not a video, an image whose frame size the bundle does not
    make (a landscape image: 48x32 here, which makes 32x48 only), a seconds field, too many frames carried, a driving
    video no longer than the frames carried, more steps than the server runs over all segments, another kind's
    field, a JSON body's driving video that is not a data URL: each a 400 naming the field; no job is queued and no
    file is stored."""
    import httpx

    image = ("me.png", _png(test_image(34, 50, seed=3)), "image/png")
    landscape = ("wide.png", _png(test_image(60, 40, seed=4)), "image/png")
    driving = ("dance.mp4", _driving_mp4(14), "video/mp4")
    short = ("short.mp4", _driving_mp4(2), "video/mp4")
    text = ("dance.mp4", b"this is not a video", "video/mp4")
    before_jobs = len(server.state.store.list(1000)[0])
    before_files = _stored(server.jobs)
    for files, extra, param, message in [
        ({"driving_video": driving}, {}, "input_reference", "this bundle is Wan-Animate 2 distilled (few steps, no "
                                                            "CFG): it needs an image"),
        ({"input_reference": image}, {}, "driving_video", "this bundle is Wan-Animate 2 distilled (few steps, no CFG): "
                                                          "it needs a driving video"),
        ({"input_reference": image, "driving_video": text}, {}, "driving_video",
         "driving_video: cannot read driving_video.mp4 as a video"),
        ({"input_reference": landscape, "driving_video": driving}, {}, "input_reference",
         f"the image (60x40) makes a 48x32 video (Wan-Animate 2 keeps its aspect), and this bundle makes {W}x{H}"),
        ({"input_reference": landscape, "driving_video": driving}, {"size": f"{W}x{H}"}, "input_reference",
         "the image (60x40) makes a 48x32 video"),
        ({"input_reference": image, "driving_video": driving}, {"seconds": "0.5"}, "seconds",
         "a Wan-Animate 2 video is as long as its driving video (at fps): leave seconds out"),
        ({"input_reference": image, "driving_video": driving}, {"prev_segment_conditioning_frames": "9"},
         "prev_segment_conditioning_frames", "prev_segment_conditioning_frames must be an integer in 0..8"),
        ({"input_reference": image, "driving_video": short}, {"prev_segment_conditioning_frames": "2"},
         "driving_video", "the driving video has 1 frame (after resampling to the fps): it needs more than "
                          "prev_segment_conditioning_frames (2)"),
        ({"input_reference": image, "driving_video": driving}, {"num_inference_steps": "3"}, "driving_video",
         f"2 segments of 3 steps are 6 steps, more than this server runs ({MAX_STEPS})"),
        ({"input_reference": image, "driving_video": driving}, {"driving_video_fps": "0"}, "driving_video_fps",
         "driving_video_fps must be a finite number in (0, 1000]"),
        ({"input_reference": image, "driving_video": driving}, {"driving_video_fps": "1e-320"}, "driving_video_fps",
         "driving_video_fps 1e-320 makes the driving video's 14 frames more than 1e+09 at 24 fps"),
        ({"input_reference": image, "driving_video": driving}, {"driving_video_fps": "0.01"}, "driving_video",
         "4200 segments of 4 steps are 16800 steps, more than this server runs (4)"),
        ({"input_reference": image, "driving_video": driving, "pose_video": driving}, {}, "pose_video",
         "pose_video is for Wan-Animate; this bundle is Wan-Animate 2"),
    ]:
        r = httpx.post(server.url + "/v1/videos", files=files, data={"prompt": PROMPT, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text)
        assert message in r.json()["error"]["message"], r.text
    # in JSON the files are data URLs: one that is not base64 is refused by the field's name too
    png = "data:image/png;base64," + base64.b64encode(image[1]).decode()
    r = httpx.post(server.url + "/v1/videos", json={"prompt": PROMPT, "input_reference": png,
                                                     "driving_video": "data:video/mp4;base64,not base64!"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "driving_video"), r.text
    assert len(server.state.store.list(1000)[0]) == before_jobs
    assert _stored(server.jobs) == before_files


def test_the_document_and_the_card_say_what_it_takes(server: SimpleNamespace) -> None:
    """The create request of an animate-2 bundle, for JSON and multipart: the character and the driving video
    required, its settings offered with their bounds and defaults, no seconds, Wan-Animate's fields not offered;
    the driving video a video part; valid and invalid bodies as the document says (jsonschema). The model card says
    animate_2."""
    import httpx
    import jsonschema

    doc = httpx.get(server.url + "/openapi.json").json()
    body = doc["paths"]["/v1/videos"]["post"]["requestBody"]["content"]
    form, plain = body["multipart/form-data"]["schema"], body["application/json"]["schema"]
    for schema in (form, plain):
        props = schema["properties"]
        assert schema["required"] == ["prompt", "input_reference", "driving_video"]
        assert {"prompt_ref", "prev_segment_conditioning_frames", "driving_video_fps", "fps", "negative_prompt",
                "num_inference_steps", "guidance_scale", "seed"} <= props.keys()
        assert not {"seconds", "pose_video", "face_video", "mode", "prev_segment_frames"} & props.keys()
        prev = props["prev_segment_conditioning_frames"]
        assert (prev["minimum"], prev["maximum"], prev["default"]) == (0, SEGMENT - 1, 1)
        assert props["prompt_ref"]["default"] == "人物动作的参考视频"
        assert props["driving_video_fps"]["exclusiveMinimum"] == 0
    assert form["properties"]["driving_video"]["format"] == "binary"
    assert body["multipart/form-data"]["encoding"]["driving_video"] == {"contentType": "video/*"}
    assert plain["properties"]["driving_video"]["format"] == "video-data-url"
    ok = {"prompt": "a dancer", "input_reference": "data:image/png;base64,AAAA",
          "driving_video": "data:video/mp4;base64,AAAA"}
    jsonschema.validate({**ok, "prev_segment_conditioning_frames": 0, "driving_video_fps": 29.97}, plain)
    for bad in ({k: v for k, v in ok.items() if k != "driving_video"}, {**ok, "seconds": "1"},
                {**ok, "prev_segment_conditioning_frames": SEGMENT}, {**ok, "driving_video_fps": 0}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, plain)
    card = server.client.models.list().data[0].model_dump()
    assert (card["kind"], card["animate_2"], card["animate"], card["image"], card["fps"]) == (
        "animate-2-distilled", True, False, "required", 24)
    # (the shape's one reference latent frame is the character's slot, not a reference image a request sends)
    assert card["reference_images"] == [0] and [s["reference_images"] for s in card["shapes"]] == [0]
    assert not {"/v1/videos/{video_id}/remix", "/v1/videos/edits", "/v1/videos/extensions"} & doc["paths"].keys()


def test_the_playground_takes_the_character_and_the_driving_video(server: SimpleNamespace, pipe: Any,
                                                                 tmp_path: Path) -> None:
    """On an animate-2 bundle the page asks for the character image, the driving video and its settings (no
    duration, none of Wan-Animate's videos), and a job made there with a frame rate and the driving video's own
    rate given is `pipe.generate`'s video from those files and settings."""
    from runtime.serve.body import read_video_bytes
    from runtime.video import write_video

    from .test_playground import CHROMIUM, sync_api

    if CHROMIUM is None:
        raise AssertionError("chromium is not installed: apt-get install chromium (.ci/run does)")
    test_image(34, 50, seed=8).save(tmp_path / "me.png")
    driving = _driving_mp4(10, seed=9)  # 10 frames at 30 fps, given as 15 fps: 13 frames at 20 fps
    (tmp_path / "dance.mp4").write_bytes(driving)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        problems: list[str] = []
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(server.url + "/")
        sync_api.expect(page.get_by_label("Prompt", exact=True)).to_be_visible()
        for shown in ("Character image", "Driving video (the character moves as it does; the video is as long)",
                      "Reference prompt (the driving video's pass)", "Driving video's frame rate",
                      "Frames carried into each segment"):
            assert page.get_by_label(shown).is_visible(), shown
        for hidden in ("Duration", "Pose video (the video is as long)", "Video (control or source)", "Last frame",
                       "Frames carried between segments"):
            assert not page.get_by_label(hidden).is_visible(), hidden
        sizes = page.get_by_label("Size").locator("option").all_inner_texts()
        assert sizes == ["Any: the image's aspect picks", f"{W} × {H}"]  # the first: no size sent
        page.get_by_label("Prompt", exact=True).fill(PROMPT)
        page.get_by_label("Steps").fill("1")
        page.get_by_label("Seed").fill("2")
        page.get_by_label("Character image").set_input_files(str(tmp_path / "me.png"))
        page.get_by_label("Driving video (the character moves as it does; the video is as long)").set_input_files(
            str(tmp_path / "dance.mp4"))
        page.get_by_label("Driving video's frame rate").fill("15")
        page.get_by_label("Frame rate (the driving video is resampled to it)").fill("20")
        page.get_by_role("button", name="Generate").click()
        earlier = "".join(f':not([data-id="{v.id}"])' for v in server.client.videos.list(limit=100).data)
        item = page.locator(f"#jobs li{earlier}")  # the job made here (the others' too are listed)
        sync_api.expect(item.locator("video:not(.live)")).to_have_count(1, timeout=120_000)
        job_id = item.get_attribute("data-id")
        browser.close()
    assert problems == []
    job = server.client.videos.retrieve(job_id)
    assert server.state.store.get(job_id).params["area"] is None  # no size sent: the image's aspect picked it
    assert (job.status, job.seconds) == ("completed", "0.65")
    got = _decode(server.client.videos.download_content(job.id).read())
    want = pipe.generate(PROMPT, image=tmp_path / "me.png", driving_video=read_video_bytes(driving, "driving_video"),
                         driving_video_fps=15.0, fps=20, steps=1, seed=2, progress=False)[0]
    write_video(want, tmp_path / "want.mp4", fps=20)
    expected = _decode((tmp_path / "want.mp4").read_bytes())
    assert got.shape == expected.shape == (13, H, W, 3) and np.abs(got - expected).max() <= 1



@pytest.mark.slow
def test_guidance_and_a_negative_prompt_on_the_base_model(tmp_path: Path) -> None:
    """The slow tier's variant of the first test on the other kind of the same path: the base model (animate-2,
    tiny-animate-2: ten blocks, CFG's unconditional branch skipping block 9) through the API with guidance 2 (its
    default is 3) and a negative prompt, one segment, makes `pipe.generate`'s frames."""
    import httpx

    import runtime
    from export import tiny
    from runtime.serve.body import read_video_bytes
    from runtime.video import write_video

    variant = "tiny-animate-2"
    ckpt = shared(f"{variant}-checkpoint", lambda root: tiny.save(variant, root / "ckpt")) / "ckpt"
    bundle = shared("api-animate-2-base-bundle", lambda root: run_module(
        "export", "--model", str(ckpt), "--resolution", f"{W}x{H}", "--frames", str(SEGMENT), "--dtype", "fp32",
        "--max-sequence-length", "16", "--out", str(root / "b"), "-q")) / "b"
    pipe = runtime.load(bundle)
    image, driving = test_image(34, 50, seed=6), _driving_mp4(8, seed=7)  # 8 frames at 30 fps: 6 at 24, one segment
    with serving_pipe(pipe, bundle, tmp_path) as server:
        files = {"input_reference": ("me.png", _png(image), "image/png"),
                 "driving_video": ("dance.mp4", driving, "video/mp4")}
        r = httpx.post(server.url + "/v1/videos", files=files, timeout=60, data={
            "prompt": PROMPT, "negative_prompt": "blurry", "guidance_scale": "2", "num_inference_steps": "2",
            "seed": "4"})
        assert r.status_code == 200, r.text
        video = _wait(server.client, r.json()["id"])
        assert video.status == "completed", video.error
        got = _decode(server.client.videos.download_content(video.id).read())
    want = pipe.generate(PROMPT, "blurry", image=image, driving_video=read_video_bytes(driving, "driving_video"),
                         driving_video_fps=30.0, fps=24, steps=2, guidance=2.0, seed=4, progress=False)[0]
    write_video(want, tmp_path / "want.mp4", fps=24)
    expected = _decode((tmp_path / "want.mp4").read_bytes())
    assert got.shape == expected.shape == (6, H, W, 3) and np.abs(got - expected).max() <= 1
