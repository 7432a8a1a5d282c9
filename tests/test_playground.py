"""The playground page at `runtime serve`'s GET /, driven in a real browser: Debian's chromium, headless, through
Playwright for Python with that executable (`.ci/run` installs chromium where it is missing).

On the tiny bundle of two sizes: the page asks for the API key first (a wrong one shows the 401's message), fills its
pickers from the bundle's shapes, creates a job from the form (with the keyboard), shows the progress moving,
plays the finished video and offers it for download; a prompt made of HTML is shown as text; the page runs no
inline script; `--no-ui` serves no page.
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .test_serve import KEY, Server, serving

sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HOSTILE = "<img src=x onerror=\"document.title='pwned'\"> a fox & <b>snow</b>"


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if CHROMIUM is None:
        raise AssertionError("chromium is not installed: apt-get install chromium (.ci/run does)")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def ui_server(shapes_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny bundle of two sizes, with a key and two LoRA adapters offered."""
    from .test_lora_switch import make_adapter

    root = tmp_path_factory.mktemp("ui")
    for seed, name in enumerate(("style", "subject")):
        make_adapter(shapes_bundle, root / "loras" / f"{name}.safetensors", seed=seed, rank=2 + seed)
    with serving(shapes_bundle, root / "jobs", "--api-key", KEY, "--lora-dir", str(root / "loras"),
                 "--max-loras", "2") as server:
        yield server


def test_the_page_asks_for_the_key_first(browser, ui_server: Server) -> None:
    """On a server with a key, before the key is given, the page says it needs one and shows only the key's field:
    not "Loading the model…", which the ready server is not doing."""
    page = browser.new_page()
    page.goto(ui_server.url + "/")
    key = page.get_by_label("API key")
    sync_api.expect(key).to_be_visible()
    sync_api.expect(page.locator("#model")).to_have_text("This server needs an API key.")
    assert not page.get_by_label("Prompt", exact=True).is_visible()
    assert page.locator("#key-error").inner_text() == ""  # no error before a key was tried
    page.close()


def test_the_page_makes_a_video_in_the_browser(browser, ui_server: Server, tmp_path: Path) -> None:
    import httpx

    page = browser.new_page(viewport={"width": 1000, "height": 900}, accept_downloads=True)
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" and "401" not in m.text else None)
    page.goto(ui_server.url + "/")

    # the key: asked for once; a wrong one shows the server's 401 message and can be entered again
    key = page.get_by_label("API key")
    key.fill("wrong-key")
    page.get_by_role("button", name="Use key").click()
    sync_api.expect(page.locator("#key-error")).to_contain_text("missing or wrong API key")
    sync_api.expect(key).to_be_visible()
    key.fill(KEY)
    key.press("Enter")
    prompt = page.get_by_label("Prompt", exact=True)
    sync_api.expect(prompt).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('wan-aot-api-key')") == KEY

    # pickers from the bundle's shapes; the second expert's guidance and the image inputs only where they apply
    size = page.get_by_label("Size")
    assert size.locator("option").all_inner_texts() == ["64 × 32", "32 × 64"]
    size.select_option("32x64")
    assert page.get_by_label("Duration").locator("option").all_inner_texts() == ["9 frames (0.5625 s)",
                                                                                 "5 frames (0.3125 s)"]
    page.get_by_label("Duration").select_option("0.5625")
    for hidden in ("Guidance 2", "Image (first frame)", "Last frame", "Image to edit"):  # (image edits: ChronoEdit)
        assert not page.get_by_label(hidden).is_visible()

    # a prompt made of HTML, submitted from the keyboard
    prompt.fill(HOSTILE)
    page.get_by_label("Steps").fill("400")
    page.get_by_label("Seed").fill("3")
    page.get_by_role("button", name="Generate").focus()
    page.keyboard.press("Enter")
    job = page.locator("#jobs li").first
    sync_api.expect(job).to_be_visible(timeout=10_000)
    assert job.locator(".job-prompt").inner_text() == HOSTILE  # the text itself: no element made of it
    assert page.locator("#jobs img:not(.preview), #jobs b").count() == 0 and page.title() != "pwned"

    seen, previews = set(), set()
    deadline = time.time() + 180
    while time.time() < deadline and not job.locator("video").count():
        # the bar and the live preview (a WebP at the video's size, as it changes), read in one step in the page: the
        # job's element replaces them with the video at any moment, and a locator on a removed element waits for it
        state = job.evaluate("""li => {
            const shown = e => e !== null && e.getClientRects().length > 0 &&
                getComputedStyle(e).visibility !== 'hidden';
            const bar = li.querySelector('progress'), img = li.querySelector('img.preview');
            return {bar: shown(bar) ? Number(bar.getAttribute('value') || 0) : null,
                    preview: shown(img) && img.naturalWidth ?
                        [img.naturalWidth + 'x' + img.naturalHeight, img.getAttribute('src')] : null};
        }""")
        if state["bar"] is not None:
            seen.add(int(state["bar"]))
        if state["preview"]:
            previews.add(tuple(state["preview"]))
        time.sleep(0.1)
    assert any(0 < v < 100 for v in seen), seen  # the bar moved with the steps
    assert {size for size, _ in previews} == {"32x64"} and len({src for _, src in previews}) >= 2, previews
    assert job.locator("img.preview").count() == 0  # the video took its place
    video = job.locator("video")
    page.wait_for_function("v => v.readyState >= 1 && v.duration > 0", arg=video.element_handle(), timeout=60_000)
    duration = video.evaluate("v => v.duration")
    assert abs(duration - 0.5625) < 0.1, duration  # 9 frames at 16 fps
    assert video.evaluate("v => [v.videoWidth, v.videoHeight]") == [32, 64]

    # the download link gives the mp4
    with page.expect_download() as info:
        job.get_by_role("link", name="Download").click()
    data = Path(info.value.path()).read_bytes()
    assert data[4:8] == b"ftyp" and info.value.suggested_filename.endswith(".mp4")

    # the job is the API's, made as any client makes one
    listed = httpx.get(ui_server.url + "/v1/videos", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    assert listed[0]["prompt"] == HOSTILE and listed[0]["size"] == "32x64" and listed[0]["status"] == "completed"
    assert not problems, problems

    page.close()


def test_the_page_offers_the_lora_adapters(browser, ui_server: Server) -> None:
    """The server's adapters (GET /v1/models) as rows of a name, a scale (and on two-expert bundles an expert), at
    most --max-loras of them; the job runs with the chosen set, as the server's log says."""
    page = browser.new_page()
    page.goto(ui_server.url + "/")
    page.evaluate(f"sessionStorage.setItem('wan-aot-api-key', '{KEY}')")
    page.reload()
    sync_api.expect(page.get_by_label("Prompt", exact=True)).to_be_visible()
    add = page.get_by_role("button", name="Add a LoRA")
    assert page.locator("#loras li").count() == 0 and add.is_visible()
    add.click()
    add.click()
    assert page.locator("#loras li").count() == 2 and not add.is_visible()  # --max-loras 2
    names = page.get_by_label("LoRA", exact=True)
    assert names.first.locator("option").all_inner_texts() == ["style (rank 2, transformer)",
                                                               "subject (rank 3, transformer)"]
    assert page.get_by_label("LoRA expert").count() == 0  # one expert
    names.nth(1).select_option("subject")
    page.get_by_label("LoRA scale").nth(1).fill("-0.5")
    page.get_by_role("button", name="Remove").first.click()  # style goes: subject at -0.5 stays
    assert page.locator("#loras li").count() == 1 and add.is_visible()
    page.get_by_label("Prompt", exact=True).fill("a styled fox")
    page.get_by_label("Steps").fill("1")
    page.get_by_role("button", name="Generate").click()
    job = page.locator("#jobs li", has_text="a styled fox")
    sync_api.expect(job.locator("video")).to_have_count(1, timeout=120_000)
    assert "LoRA set subject@-0.5, switched to in" in ui_server.output()
    page.close()


def test_the_page_runs_no_inline_script(ui_server: Server) -> None:
    import re

    import httpx

    r = httpx.get(ui_server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    scripts = re.findall(r"<script([^>]*)>(.*?)</script>", r.text, re.S)
    assert scripts and all('src="/ui/' in attrs and not body.strip() for attrs, body in scripts)
    assert not re.search(r"\son[a-z]+\s*=", r.text, re.I)  # no onclick= handlers in the markup either
    assert httpx.get(ui_server.url + "/ui/app.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(ui_server.url + "/ui/../jobs.sqlite3").status_code == 404
    assert httpx.get(ui_server.url + "/v1/videos").status_code == 401  # the page opens no way around the key


def test_no_ui_serves_no_page(shapes_bundle: Path, tmp_path: Path) -> None:
    import httpx

    server = Server(shapes_bundle, tmp_path / "jobs", "--no-ui")
    try:
        server.wait_ready()
        for path in ("/", "/ui/app.js"):
            r = httpx.get(server.url + path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    finally:
        server.stop(signal.SIGKILL)


def test_an_image_kind_shows_its_image_input_and_sends_the_image(browser, kind_bundles, tmp_path: Path) -> None:
    """A first-last-frame bundle (no key on this server): both image inputs are shown and required; the job goes
    as a multipart form with the images, as the SDK sends it, and its video plays."""
    from .conftest import test_image

    first, last = tmp_path / "first.png", tmp_path / "last.png"
    test_image(70, 50, seed=1).save(first)
    test_image(40, 64, seed=2).save(last)
    with serving(kind_bundles["flf2v"], tmp_path / "jobs") as server:
        page = browser.new_page()
        page.goto(server.url + "/")
        sync_api.expect(page.get_by_label("Prompt", exact=True)).to_be_visible()
        assert not page.get_by_label("API key").is_visible()  # this server needs none
        image, last_image = page.get_by_label("Image (first frame)"), page.get_by_label("Last frame")
        assert image.is_visible() and last_image.is_visible() and not page.get_by_label("Guidance 2").is_visible()
        page.get_by_label("Prompt", exact=True).fill("a bird flies from one frame to the other")
        page.get_by_label("Steps").fill("2")
        page.get_by_role("button", name="Generate").click()  # without the images: the browser asks for them
        assert page.locator("#jobs li").count() == 0
        image.set_input_files(str(first))
        last_image.set_input_files(str(last))
        page.get_by_role("button", name="Generate").click()
        video = page.locator("#jobs li").first.locator("video")
        sync_api.expect(video).to_have_count(1, timeout=120_000)
        page.wait_for_function("v => v.readyState >= 1 && v.duration > 0", arg=video.element_handle(),
                               timeout=60_000)
        assert video.evaluate("v => [v.videoWidth, v.videoHeight]") == [64, 32]
        page.close()


def test_a_segment_job_plays_live_while_it_runs(browser, skyreels_bundles, tmp_path: Path) -> None:
    """A diffusion forcing job (1.5 s: three segments) on a server with a key: while the job is in_progress, held
    after its first segment is stored, the page plays that segment through hls.js (which sends the key with each
    request); once the job completes, the mp4 takes the live player's place."""
    import socket
    import threading
    import time

    import uvicorn

    import runtime
    from runtime.serve.routes import create_app

    from .test_stream import Gate, _app, _run_in_thread

    _, state = _app(tmp_path, runtime.load(skyreels_bundles["skyreels-df"]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_level="warning"))
    serving_thread = threading.Thread(target=server.run, daemon=True)
    serving_thread.start()
    gate, job_thread = Gate(state.store.storage), None
    try:
        deadline = time.time() + 30
        while not server.started and time.time() < deadline:
            time.sleep(0.02)
        page = browser.new_page()
        page.goto(f"http://127.0.0.1:{port}/")
        page.get_by_label("API key").fill("k")
        page.get_by_role("button", name="Use key").click()
        page.get_by_label("Prompt", exact=True).fill("waves on a long beach")
        page.get_by_label("Steps").fill("2")
        page.get_by_label("Seconds (any length: overlapping segments)").fill("1.5")
        page.get_by_label("Overlap (frames)").fill("5")
        page.get_by_role("button", name="Generate").click()
        deadline = time.time() + 30
        while (job := state.store.claim()) is None and time.time() < deadline:
            time.sleep(0.05)
        assert job is not None
        job_thread = _run_in_thread(state, job)
        assert gate.written.wait(120)
        live = page.get_by_label("Live: waves on a long beach")
        sync_api.expect(live).to_have_count(1, timeout=30_000)
        page.wait_for_function("v => v.currentTime > 0 && !v.paused && v.readyState >= 2",
                               arg=live.element_handle(), timeout=60_000)
        assert state.store.get(job.id).status == "in_progress"  # playing while the job runs
        assert live.evaluate("v => [v.videoWidth, v.videoHeight]") == [64, 32]
        gate.go.set()
        job_thread.join(120)
        assert state.store.get(job.id).status == "completed"
        sync_api.expect(page.get_by_label("Video: waves on a long beach")).to_have_count(1, timeout=60_000)
        sync_api.expect(live).to_have_count(0)
        page.close()
    finally:
        gate.go.set()
        if job_thread is not None:
            job_thread.join(120)
        server.should_exit = True
        serving_thread.join(30)
        state.store.close()
