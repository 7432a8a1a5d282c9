"""The README's picture of the playground page (docs/playground.png), taken in Debian's chromium through Playwright.

    python tools/playground_screenshot.py [BUNDLE] [--out docs/playground.png]

Starts `python -m runtime serve BUNDLE --api-key ...` on a free loopback port with a scratch jobs directory, gives
the page the key, makes one video from an ordinary prompt with the bundle's default settings (steps, guidance,
size and duration as the page offers them), waits until the finished video plays in the page, and captures it.
Without BUNDLE it exports the tiny random model first (the export extra; its video is noise, at 64x32): the picture
shows the page, not a model. Needs the serve and test extras and chromium (`apt-get install chromium`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "a red fox running through fresh snow at sunrise"
KEY = "playground-key"


def tiny_bundle(work: Path) -> Path:
    """The tiny random model of two sizes, exported as the tests export it."""
    from export import tiny

    checkpoint = tiny.save("tiny", work / "checkpoint")
    out = work / "tiny"
    subprocess.run([sys.executable, "-m", "export", "--model", str(checkpoint), "--resolution", "64x32,32x64",
                    "--frames", "9,5", "--dtype", "fp32", "--max-sequence-length", "24", "--out", str(out), "-q"],
                   cwd=ROOT, check=True)
    return out


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"error: the server was not ready in {timeout:.0f} s")


def capture(url: str, out: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("error: chromium is not installed: apt-get install chromium")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1000, "height": 900})
        page.goto(url + "/")
        page.get_by_label("API key").fill(KEY)
        page.get_by_role("button", name="Use key").click()
        page.get_by_label("Prompt", exact=True).fill(PROMPT)
        page.get_by_role("button", name="Generate").click()
        video = page.locator("#jobs li").first.locator("video")
        expect(video).to_have_count(1, timeout=600_000)
        page.wait_for_function("v => v.readyState >= 4 && v.duration > 0", arg=video.element_handle(),
                               timeout=60_000)
        page.mouse.move(0, 0)  # no hover on the video: while it plays, its controls fade out
        video.evaluate("v => v.play()")  # muted and looping, as the page makes it
        page.wait_for_function("v => !v.paused && v.currentTime > 0", arg=video.element_handle(), timeout=10_000)
        page.wait_for_timeout(4000)
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out), full_page=True)
        browser.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", type=Path, nargs="?", help="the bundle to serve (default: export the tiny model)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "playground.png")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="playground-") as tmp:
        work = Path(tmp)
        bundle = args.bundle or tiny_bundle(work)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([sys.executable, "-m", "runtime", "serve", str(bundle), "--port", str(port),
                                   "--jobs-dir", str(work / "jobs"), "--api-key", KEY], cwd=ROOT,
                                  env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            wait_ready(url, server)
            capture(url, args.out)
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
