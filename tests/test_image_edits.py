"""Image edits, `POST /v1/images/edits` (runtime/serve/images.py), on the tiny ChronoEdit bundle
(tests/test_chronoedit.py's fixtures): the openai SDK's `client.images.edit` gets the PNG the pipeline's
`edit_image` makes with the request's settings, through a job of the queue; the bundle still makes its short
videos; bad input is one line and queues nothing; the playground's image-edit form, in chromium. Cancelling the
edit's job, a client that stops waiting, and a job past --max-sync-seconds, on test_api_kinds' in-process ChronoEdit
offer, whose FakeChronoEdit holds an edit as long as the test needs.

The ChronoEdit server runs in this process (the app, its worker thread and uvicorn on a loopback port, as
runtime/serve/server.py puts them together) on the fixtures' loaded pipeline: one load and compile for every test
here, shared with test_chronoedit.py's through the run's compilation cache.
"""

from __future__ import annotations

import base64
import io
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from .conftest import test_image
from .test_api_kinds import serving_offer
from .test_chronoedit import chronoedit, pipe  # noqa: F401  (the tiny bundle and its loaded pipeline: fixtures)

openai = pytest.importorskip("openai")
KEY = "sk-edit"
PROMPT = "give the cat a red hat"
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


@pytest.fixture(scope="module")
def server(pipe, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:  # noqa: F811
    """The ChronoEdit bundle served with a key and --max-steps 2: the app, the worker and uvicorn in this process."""
    import uvicorn

    from runtime.serve.jobs import open_store
    from runtime.serve.metrics import make_metrics
    from runtime.serve.routes import create_app
    from runtime.serve.schema import Offer
    from runtime.serve.state import Settings, State
    from runtime.serve.tenants import Keys
    from runtime.serve.worker import worker

    root = tmp_path_factory.mktemp("image-edits")
    settings = Settings(bundle=pipe.bundle.path, keys=Keys.load(None, KEY), jobs_dir=root / "jobs", max_steps=2)
    state = State(settings=settings, store=open_store(root / "jobs"),
                  offer=Offer.of(pipe.manifest, pipe.bundle.path.name, max_steps=2))
    state.pipe, state.metrics = pipe, make_metrics(state.store)
    state.ready.set()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    http = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    threads = [threading.Thread(target=http.run, daemon=True), threading.Thread(target=worker, args=(state,),
                                                                                 daemon=True)]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while not http.started and time.time() < deadline:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    try:
        yield SimpleNamespace(url=url, state=state, jobs=root / "jobs", headers={"Authorization": f"Bearer {KEY}"},
                              client=openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120))
    finally:
        http.should_exit = True
        state.draining.set()
        state.wake.set()
        for t in threads:
            t.join(timeout=60)
        state.store.close()


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The image to edit: a PNG of another size than the bundle's 64x32 (resized as the pipeline does)."""
    path = tmp_path_factory.mktemp("edit-source") / "in.png"
    test_image(70, 50, seed=1).save(path)
    return path


def _png(b64: str):
    from PIL import Image

    data = base64.b64decode(b64)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return Image.open(io.BytesIO(data)), data


def test_the_openai_sdk_edits_an_image(server: SimpleNamespace, pipe, source: Path,  # noqa: F811
                                       tmp_path: Path) -> None:
    """`client.images.edit(image=open(png), prompt, n, size, response_format, extra_body=...)` answers an
    ImagesResponse whose one PNG is, pixel for pixel, `pipe.edit_image` with the request's seed, steps and guidance;
    its job is listed as completed, and its content is that PNG. The bundle's /v1/videos still makes its 5 frames."""
    import httpx

    from .test_serve import _mp4_frames

    before = time.time()
    with open(source, "rb") as f:
        answer = server.client.images.edit(image=f, prompt=PROMPT, n=1, size="64x32", response_format="b64_json",
                                           extra_body={"seed": 3, "num_inference_steps": 2, "guidance_scale": 4.0})
    assert isinstance(answer, openai.types.ImagesResponse) and len(answer.data) == 1
    assert (answer.size, answer.output_format) == ("64x32", "png") and answer.created >= int(before) - 1
    image, data = _png(answer.data[0].b64_json)
    assert (image.size, image.mode) == ((64, 32), "RGB")
    expected = pipe.edit_image(source, PROMPT, seed=3, steps=2, guidance=4.0, progress=False)
    assert np.array_equal(np.asarray(image), np.asarray(expected)) and np.asarray(image).std() > 0

    job = server.client.videos.list(limit=1).data[0]  # the edit was a job of the queue, like a video's
    assert (job.status, job.prompt, job.size, job.progress) == ("completed", PROMPT, "64x32", 100)
    content = httpx.get(f"{server.url}/v1/videos/{job.id}/content", headers=server.headers)
    assert content.headers["content-type"] == "image/png" and content.content == data
    remix = httpx.post(f"{server.url}/v1/videos/{job.id}/remix", json={"prompt": "again"}, headers=server.headers)
    assert remix.status_code == 400 and "its videos cannot be remixed or edited" in remix.json()["error"]["message"]

    video = server.client.videos.create_and_poll(prompt=PROMPT, input_reference=open(source, "rb"),  # noqa: SIM115
                                                 extra_body={"num_inference_steps": 1}, poll_interval_ms=50)
    assert video.status == "completed", video.error
    frames = _mp4_frames(server.client.videos.download_content(video.id).read(), tmp_path)
    assert frames.shape == (5, 32, 64, 3)


@pytest.mark.slow
def test_runtime_serve_answers_the_sdks_edit(chronoedit, pipe, source: Path, tmp_path: Path) -> None:  # noqa: F811
    """The same edit from `python -m runtime serve` (its own process: the flags, server.py's wiring, the h11 limits)
    with --max-sync-seconds: the PNG is `pipe.edit_image`'s; /v1/models says it edits images, and at which sizes."""
    import httpx

    from .test_serve import serving

    with serving(chronoedit[1], tmp_path / "jobs", "--api-key", KEY, "--max-steps", "2",
                 "--max-sync-seconds", "120") as served:
        card = httpx.get(served.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]
        assert (card["kind"], card["image_edit"], card["edit_sizes"]) == ("chronoedit", True, ["64x32"])
        with open(source, "rb") as f:
            answer = served.client(KEY).images.edit(image=f, prompt=PROMPT, extra_body={"seed": 5,
                                                                                        "num_inference_steps": 1})
    image, _ = _png(answer.data[0].b64_json)
    expected = pipe.edit_image(source, PROMPT, seed=5, steps=1, progress=False)
    assert image.size == (64, 32) and np.array_equal(np.asarray(image), np.asarray(expected))


def _mp4(tmp_path: Path) -> bytes:
    from runtime.video import write_video

    return write_video(np.full((5, 32, 64, 3), 0.5, np.float32), tmp_path / "clip.mp4").read_bytes()


def test_bad_input_is_one_line_and_queues_nothing(server: SimpleNamespace, source: Path, tmp_path: Path) -> None:
    """No image, a video for the image, a size or `n` the bundle does not make, a url response format, a mask, JSON:
    a 4xx in one line naming the field, and nothing queued or stored."""
    import httpx

    png = ("in.png", source.read_bytes(), "image/png")
    image = {"image": png}
    cases = [
        ({"prompt": (None, PROMPT)}, 400, "image",
         "image is required: the image to edit, a file part (PNG, JPEG, WebP, ...)"),
        ({"image": ("clip.mp4", _mp4(tmp_path), "video/mp4"), "prompt": (None, PROMPT)}, 400, "image",
         "image is a video (mp4): an image edit takes one image (PNG, JPEG, WebP, ...)"),
        ({**image, "prompt": (None, PROMPT), "size": (None, "32x64")}, 400, "size",
         "size '32x64' is not one this bundle edits at: it edits at 64x32 (or auto)"),
        ({**image, "prompt": (None, PROMPT), "n": (None, "2")}, 400, "n",
         "n must be 1, got '2': one edit per request (send it again, with another seed, for another)"),
        ({**image, "prompt": (None, PROMPT), "response_format": (None, "url")}, 400, "response_format",
         "response_format 'url' is not served: this server answers b64_json only (it keeps no image to link to)"),
        ({**image, "prompt": (None, " ")}, 400, "prompt", "prompt is required (a non-empty string)"),
        ({**image, "prompt": (None, PROMPT), "num_inference_steps": (None, "3")}, 400, "num_inference_steps",
         "num_inference_steps must be an integer in 1..2, got '3'"),
        ({**image, "prompt": (None, PROMPT), "mask": png}, 400, "mask",
         "unexpected file field 'mask' (images and videos go in image or image[])"),
    ]
    before = [j.id for j in server.state.store.list(100)[0]]
    for files, status, param, message in cases:
        r = httpx.post(server.url + "/v1/images/edits", files=files, headers=server.headers)
        error = r.json()["error"]
        assert (r.status_code, error["param"], error["message"]) == (status, param, message), r.text
        assert "\n" not in error["message"]
    two = [("image[]", png), ("image[]", png), ("prompt", (None, PROMPT))]  # as the SDK sends a list of images
    r = httpx.post(server.url + "/v1/images/edits", files=two, headers=server.headers)
    assert (r.status_code, r.json()["error"]["message"]) == (
        400, "2 images: a ChronoEdit bundle edits one image per request"), r.text
    r = httpx.post(server.url + "/v1/images/edits", json={"prompt": PROMPT}, headers=server.headers)
    assert r.status_code == 415 and r.json()["error"]["message"] == (
        "unsupported content type 'application/json': send the image edit as multipart/form-data (as the openai "
        "SDK's images.edit does)")
    with pytest.raises(openai.BadRequestError, match="n must be 1"):  # the SDK's own n, refused before any job
        server.client.images.edit(image=open(source, "rb"), prompt=PROMPT, n=2)  # noqa: SIM115
    assert [j.id for j in server.state.store.list(100)[0]] == before  # nothing queued
    assert not list((server.jobs / "images").iterdir())  # nothing stored


def test_serve_takes_max_sync_seconds(chronoedit) -> None:  # noqa: F811
    """`serve --max-sync-seconds` (in `serve --help`) refuses a bound that is not a positive number in one line."""
    from .conftest import run_cli

    assert "--max-sync-seconds SECONDS" in run_cli("runtime", "serve", "--help").stdout
    proc = run_cli("runtime", "serve", str(chronoedit[1]), "--max-sync-seconds", "0", check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: --max-sync-seconds 0 must be a number of seconds in (0, 86400]: how long an image edit's request waits "
        "for its job")


def test_a_cancelled_edit_answers_an_error_and_a_slow_one_504(tmp_path: Path) -> None:
    """On the in-process ChronoEdit offer: an edit whose running job is cancelled (POST /v1/videos/{id}/cancel)
    answers 409 `cancelled` at once, which the SDK does not retry (one job, not three); a client that stops waiting
    has its edit's job cancelled; with no worker and --max-sync-seconds 1, the answer is a 504 saying how to raise
    the bound, and the job is cancelled."""
    import httpx

    from runtime.serve.images import NO_RETRY

    png = io.BytesIO()
    test_image(64, 32, seed=2).save(png, format="PNG")
    hold = threading.Event()
    with serving_offer("chronoedit", tmp_path / "cancel", hold=hold) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=2)
        outcome: list[Exception] = []

        def edit() -> None:
            try:
                client.images.edit(image=("in.png", png.getvalue(), "image/png"), prompt=PROMPT)
            except Exception as e:  # noqa: BLE001  (what the test looks at)
                outcome.append(e)

        waiting = threading.Thread(target=edit)
        waiting.start()
        store = server.state.store
        deadline = time.time() + 30
        while not (jobs := store.list(10)[0]) or jobs[0].status != "in_progress":
            assert time.time() < deadline, jobs
            time.sleep(0.02)
        assert httpx.post(f"{server.url}/v1/videos/{jobs[0].id}/cancel").status_code == 200
        hold.set()  # the edit goes on to its first step, where the worker finds it cancelled
        waiting.join(30)
        assert not waiting.is_alive() and len(outcome) == 1 and isinstance(outcome[0], openai.ConflictError)
        error = outcome[0].body
        assert error["code"] == "cancelled" and error["message"] == (
            f"the image edit was cancelled (job {jobs[0].id}: POST /v1/videos/{jobs[0].id}/cancel) before it ended")
        assert outcome[0].response.headers["x-should-retry"] == NO_RETRY["x-should-retry"]
        ended = store.list(10)[0]
        assert [(j.id, j.status, j.error_code, j.video) for j in ended] == [(jobs[0].id, "failed", "cancelled", None)]
        assert not list((tmp_path / "cancel" / "jobs" / "videos").iterdir())  # no PNG stored

        hold.clear()  # a client that stops waiting: its edit's job is cancelled rather than run for nobody
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/images/edits", timeout=1.0,
                       files={"image": ("in.png", png.getvalue(), "image/png"), "prompt": (None, "left")})
        gone = store.list(1)[0][0]
        deadline = time.time() + 30
        while (gone := store.get(gone.id)).status != "failed":
            assert time.time() < deadline, gone
            time.sleep(0.05)
        hold.set()
        assert (gone.prompt, gone.error_code, gone.error_message) == (
            "left", "cancelled", "the image edit was cancelled: its client went away before it ended")
    with serving_offer("chronoedit", tmp_path / "slow", worker=False, max_sync_seconds=1.0) as server:
        t0 = time.time()
        r = httpx.post(server.url + "/v1/images/edits", files={"image": ("in.png", png.getvalue(), "image/png"),
                                                               "prompt": (None, PROMPT)}, timeout=30)
        job = server.state.store.list(1)[0][0]
        assert r.status_code == 504 and time.time() - t0 >= 1 and r.headers["x-should-retry"] == "false"
        assert r.json()["error"] == {
            "message": f"the image edit did not finish within 1 s (serve --max-sync-seconds) and was cancelled (job "
                       f"{job.id}): start the server with a larger --max-sync-seconds, or ask for fewer "
                       "num_inference_steps", "type": "server_error", "param": None, "code": "edit_timeout"}
        assert (job.status, job.error_code, job.error_message) == (
            "failed", "cancelled", "the image edit was cancelled: it did not end within 1 s")


def test_the_playground_edits_an_image(browser, server: SimpleNamespace, source: Path) -> None:  # noqa: F811
    """The page of an image-editing bundle has an image-edit form: the image, the instruction, steps, guidance and
    seed go as the SDK sends them; the edited PNG shows at the bundle's size, and the edit's job in the list shows
    its PNG too."""
    from .test_playground import sync_api

    page = browser.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(server.url + "/")
    page.get_by_label("API key").fill(KEY)
    page.get_by_role("button", name="Use key").click()
    picture = page.get_by_label("Image to edit")
    sync_api.expect(picture).to_be_visible()
    assert page.get_by_label("Output (width × height)").locator("option").all_inner_texts() == ["64 × 32"]
    picture.set_input_files(str(source))
    page.get_by_label("Instruction (what to change)").fill("a hat for the cat")
    page.get_by_label("Denoising passes").fill("1")
    page.get_by_label("Edit guidance").fill("3")
    page.get_by_label("Starting noise (an integer)").fill("5")
    page.get_by_role("button", name="Edit", exact=True).click()
    edited = page.get_by_alt_text("Edited: a hat for the cat")
    sync_api.expect(edited).to_have_count(1, timeout=60_000)
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=edited.element_handle())
    assert edited.evaluate("img => [img.naturalWidth, img.naturalHeight]") == [64, 32]
    assert page.get_by_role("link", name="Download the PNG").get_attribute("download") == "edited.png"
    listed = page.get_by_alt_text("Image: a hat for the cat")  # the job's content, in the jobs list
    sync_api.expect(listed).to_have_count(1, timeout=30_000)
    assert not problems, problems
    page.close()


@pytest.fixture(scope="module")
def browser():  # noqa: ANN201
    from .test_playground import CHROMIUM, sync_api

    if CHROMIUM is None:
        raise AssertionError("chromium is not installed: apt-get install chromium (.ci/run does)")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()
