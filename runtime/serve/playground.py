"""The playground page at `GET /`: static files from runtime/serve/ui/, served under a strict
Content-Security-Policy. ui/hls.light.min.js is hls.js 1.7.4 as npm ships it (`npm pack hls.js@1.7.4`,
dist/hls.light.min.js; Apache-2.0, ui/hls.js.LICENSE.txt): it plays a running job's live stream where the browser
has Media Source Extensions, adding the page's API key to its requests, which a native HLS player cannot."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

from .errors import ApiError

UI_DIR = Path(__file__).with_name("ui")
UI_FILES = {"app.js": "text/javascript", "style.css": "text/css", "hls.light.min.js": "text/javascript",
            "hls.js.LICENSE.txt": "text/plain; charset=utf-8"}
# The page runs only its own script file (no inline script, no eval), talks only to this server, and shows media
# only from it or from the blobs it downloaded.
UI_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; "
                               "media-src 'self' blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_playground(app: FastAPI) -> None:
    """GET / (the page) and GET /ui/{app.js, style.css}: static files; the page uses the public API as any client
    does, with the same authentication (it asks for the key), so it adds no way around the API's checks."""

    @app.get("/", include_in_schema=False)
    def page() -> Response:
        return Response((UI_DIR / "index.html").read_bytes(), media_type="text/html; charset=utf-8",
                        headers=UI_HEADERS)

    @app.get("/ui/{name}", include_in_schema=False)
    def asset(name: str) -> Response:
        if name not in UI_FILES:
            raise ApiError(404, f"no route GET /ui/{name}")
        return Response((UI_DIR / name).read_bytes(), media_type=UI_FILES[name], headers=UI_HEADERS)

