"""Every kind's API document holds: schemathesis (`--checks all`, drawing real images and videos for the files:
tests/schemathesis_hooks.py) finds nothing in the create, remix, edit and extension operations of image-to-video,
video-to-video, VACE, Wan-Animate and Lucy Edit servers, the operations whose documents differ from kind to kind.

The app runs in this process, on uvicorn, with the kind's offer (what a bundle of that kind and shape serves, as the
manifest gives it) and the real request checks (schema.parse_request, the media decoded, the settings' schedule check),
but no weights and no worker: the document describes requests, and no job has to run for them to be checked (queued
jobs stay queued; a remix of one is a 409). The text-to-video document is fuzzed whole, every route, against a live
server (tests/test_openapi.py); each kind's jobs run in its own tests.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from .test_openapi import KIND_OPERATIONS, schemathesis_clean

# name: (the offer: kind, shapes, video-to-video, reference image counts), each with 9-frame shapes
KINDS = {
    "i2v": ("i2v", (("48x32", 9),), False, (0,)),
    "v2v": ("t2v", (("64x32", 9),), True, (0,)),
    "vace": ("vace", (("64x32", 9),), False, (0, 1)),
    "animate": ("animate", (("64x32", 9),), False, (0,)),
    "lucy-edit": ("lucy-edit", (("64x32", 9),), False, (0,)),
    "chronoedit": ("chronoedit", (("64x32", 5),), False, (0,)),  # its edit shape: POST /v1/images/edits too
}


class FakeChronoEdit:
    """A test double of a loaded ChronoEdit pipeline, for the worker (runtime/serve/worker.py) to run image edits on:
    `edit_image` as runtime.Pipeline's (runtime/front.py), reporting each step, returning an image of the size's shape
    made from the input and the seed. `hold` (an Event), if given, holds every edit before its first step until set. It
    makes no videos: a video job fails in one line."""

    base_loras: tuple = ()

    def __init__(self, settings, hold: threading.Event | None = None) -> None:
        self.settings, self.hold, self.edits = settings, hold, []

    def use_loras(self, specs) -> None:
        return None

    def edit_image(self, image, prompt: str, negative_prompt: str = "", seed: int = 0, steps: int | None = None,
                   guidance: float | None = None, temporal_reasoning_steps: int = 0, frames: int | None = None, *,
                   size: str, on_step=None, **kwargs):
        import numpy as np
        from PIL import Image

        if self.hold is not None:
            assert self.hold.wait(60)
        self.edits.append({"prompt": prompt, "seed": seed, "steps": steps, "guidance": guidance, "size": size})
        for i in range(steps):
            on_step(i + 1, steps)
        width, height = (int(v) for v in size.split("x"))
        pixels = np.asarray(image.convert("RGB").resize((width, height)), np.uint8)
        return Image.fromarray(255 - pixels if seed % 2 else pixels)  # something the seed changes

    def encode(self, *args, **kwargs):
        from runtime.errors import UserError

        raise UserError("this test double makes image edits only")


@contextmanager
def serving_offer(name: str, root: Path, hold: threading.Event | None = None, worker: bool = True,
                  **settings_kw) -> Iterator[SimpleNamespace]:
    """The HTTP app for a bundle of kind `name` (KINDS), on a loopback port, in this process. A ChronoEdit offer gets
    a worker thread (unless `worker` is False) running its jobs on FakeChronoEdit (`hold` passed to it), since its
    image edits answer when their job ends; `settings_kw`: the server's Settings besides the defaults."""
    import uvicorn

    from runtime import kinds, scheduler
    from runtime import settings as st
    from runtime.manifest import Defaults
    from runtime.serve.jobs import open_store
    from runtime.serve.metrics import make_metrics
    from runtime.serve.routes import create_app
    from runtime.serve.schema import Offer
    from runtime.serve.state import Settings, State

    kind_name, shapes, video_to_video, references = KINDS[name]
    kind = kinds.get(kind_name)
    offer = Offer(models=(f"tiny-{name}",), shapes=shapes, kind=kind, max_steps=4, video_to_video=video_to_video,
                  reference_counts=references, defaults=Defaults(steps=4, guidance=kind.guidance, flow_shift=3.0))
    settings = Settings(bundle=root / f"tiny-{name}", jobs_dir=root / "jobs", queue_size=100_000, max_steps=4,
                        **settings_kw)
    state = State(settings=settings, store=open_store(root / "jobs"), offer=offer)
    config = scheduler.UniPCConfig()
    resolve = lambda *args: st.resolve(offer.defaults, kind, config, *args)  # noqa: E731
    state.pipe = FakeChronoEdit(resolve, hold) if kind.chronoedit else SimpleNamespace(settings=resolve)
    state.metrics = make_metrics(state.store)
    state.ready.set()
    running = None
    if kind.chronoedit and worker:
        from runtime.serve.worker import worker as run_worker

        running = threading.Thread(target=run_worker, args=(state,), daemon=True)
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
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", output=lambda: "", state=state)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        state.draining.set()
        if hold is not None:
            hold.set()
        if running is not None:
            state.wake.set()
            running.join(timeout=30)
        state.store.close()


# v2v, Lucy Edit and I2V in the slow tier: their documents come from the same kinds table as VACE's (a video in) and
# Animate's (an image and videos), and test_openapi fuzzes the text-to-video one. ChronoEdit's image edits in the
# default run; its video operations (an image-to-video kind's, from the same table as i2v's) in the slow tier.
CASES = [pytest.param(n, KIND_OPERATIONS, id=n, marks=[pytest.mark.slow] if n in ("v2v", "lucy-edit", "i2v") else [])
         for n in KINDS if n != "chronoedit"]
CASES += [pytest.param("chronoedit", "^editImage$", id="chronoedit"),
          pytest.param("chronoedit", KIND_OPERATIONS, id="chronoedit-videos", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name, operations", CASES)
def test_schemathesis_finds_nothing_in_each_kinds_document(name: str, operations: str, tmp_path: Path) -> None:
    """ChronoEdit's: its image edits (POST /v1/images/edits, each answered once the worker has run its job on
    FakeChronoEdit, which fails video jobs in one line)."""
    size, frames = KINDS[name][1][0]
    with serving_offer(name, tmp_path) as server:
        schemathesis_clean(server, tmp_path, key=None, examples=2, size=size, frames=frames, operations=operations,
                           phases=("coverage", "fuzzing"))
        if name == "chronoedit":  # the fuzzer's edits ran as jobs, and each completed with its PNG
            edits = [j for j in server.state.store.list(100)[0] if j.params.get("task") == "image_edit"]
            assert edits and all(j.status == "completed" and j.video.endswith(".png") for j in edits), edits[:3]


def test_what_a_kind_cannot_make_is_refused_and_left_out_of_its_document(tmp_path: Path) -> None:
    """Wan-Animate neither remakes nor extends (its pose and face videos went with the source job): remix, edits and
    extensions answer 400 naming the kinds that do, and its document leaves them out; an image-to-video bundle's has
    them all. Neither edits images: POST /v1/images/edits is a 404 saying which bundles do."""
    import base64
    import io

    import httpx
    import numpy as np
    from PIL import Image

    frames = [Image.fromarray(np.full((32, 64, 3), 40 * i, np.uint8)) for i in range(5)]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    upload = "data:video/gif;base64," + base64.b64encode(out.getvalue()).decode()
    derived = {"/v1/videos/{video_id}/remix", "/v1/videos/edits", "/v1/videos/extensions"}
    with serving_offer("animate", tmp_path / "animate") as server:
        assert not derived & httpx.get(server.url + "/openapi.json").json()["paths"].keys()
        for path, body, message in (
                ("/v1/videos/edits", {}, "its videos cannot be remixed or edited (the kinds that can: t2v, t2v-moe, "
                                         "ti2v, i2v, flf2v, i2v-moe, vace, vace-moe, skyreels-t2v, "
                                         "skyreels-i2v, skyreels-flf2v, and text-to-video with the VAE encoder)"),
                ("/v1/videos/extensions", {"seconds": "0.5625"}, "it cannot extend a video (the kinds that extend: "
                                                                 "ti2v, i2v, i2v-moe, vace, vace-moe, "
                                                                 "skyreels-i2v, "
                                                                 "skyreels-df, helios, helios-pyramid, "
                                                                 "helios-distilled)")):
            r = httpx.post(server.url + path, json={"prompt": "a dancer", "video": upload, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == "video", r.text
            assert r.json()["error"]["message"].endswith(message), r.text
        # image edits are an image-editing bundle's (ChronoEdit): a 404 saying so, and no route in the document
        r = httpx.post(server.url + "/v1/images/edits", data={"prompt": "a hat"})
        assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found"), r.text
        assert r.json()["error"]["message"] == (
            "this bundle is Wan 2.2 Animate (a character from an image, moved by pose and face videos): it makes "
            "videos (POST /v1/videos); image edits (POST /v1/images/edits) are served for image-editing bundles "
            "(ChronoEdit)")
    with serving_offer("i2v", tmp_path / "i2v") as server:
        paths = httpx.get(server.url + "/openapi.json").json()["paths"].keys()
        assert derived <= paths and "/v1/images/edits" not in paths
