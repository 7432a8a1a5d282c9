"""schemathesis' custom strategies for the API's files (loaded with SCHEMATHESIS_HOOKS=tests.schemathesis_hooks): real
images and videos, so that a request the document says is valid is one the server takes, and a fuzzer's 400 means a
bug. The documents name what a file holds by the form part's content type (`image/*`, `video/*`) and, in JSON, by the
string format `image-data-url` or `video-data-url` (runtime/serve/schema.py, file_schema).

Videos are WAN_AOT_FUZZ_FRAMES frames of WAN_AOT_FUZZ_SIZE (a shape of the bundle under test), one of them, so that a
control video and its mask (VACE) or a pose and a face video (Wan-Animate) always agree in length and size; animated
GIFs, which the server reads as it reads an mp4 (by their bytes) but in this process, where an mp4 is ffmpeg's (a
process each: the fuzzer sends hundreds).
"""

from __future__ import annotations

import base64
import io
import os

import numpy as np
import schemathesis
from hypothesis import strategies as st

FRAMES = int(os.environ.get("WAN_AOT_FUZZ_FRAMES", "9"))
WIDTH, HEIGHT = (int(v) for v in os.environ.get("WAN_AOT_FUZZ_SIZE", "64x32").split("x"))


def _png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _gif(frames: int, width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pictures = [Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8)) for _ in range(frames)]
    out = io.BytesIO()
    pictures[0].save(out, format="GIF", save_all=True, append_images=pictures[1:], duration=62, loop=0)
    return out.getvalue()


IMAGES = [_png(40, 30, 1), _png(WIDTH, HEIGHT, 2)]
VIDEOS = [_gif(FRAMES, WIDTH, HEIGHT, 3)]


def _urls(kind: str, files: list[bytes]) -> list[str]:
    return [f"data:{kind};base64," + base64.b64encode(f).decode() for f in files]


schemathesis.openapi.media_type("image/png", st.sampled_from(IMAGES))
schemathesis.openapi.media_type("video/gif", st.sampled_from(VIDEOS))
schemathesis.openapi.format("image-data-url", st.sampled_from(_urls("image/png", IMAGES)))
schemathesis.openapi.format("video-data-url", st.sampled_from(_urls("video/gif", VIDEOS)))


@schemathesis.hook
def filter_case(context: schemathesis.HookContext, case: schemathesis.Case) -> bool:
    """Skip what schemathesis 4.32's coverage phase calls a valid multipart request but is not one: its "Multipart
    body with custom encoding" case takes every file part from the custom strategies and fills the other required
    fields with "" (`_generate_multipart_body_from_custom_strategies`), whatever the schema says (an empty prompt, a
    Wan-Animate background video without mode `replace`). Such a case is checked against the document here, its
    files standing as strings, and left out unless it holds."""
    import jsonschema

    meta = case.meta
    if meta is None or meta.phase.name != "coverage" or not isinstance(case.body, dict) or \
            getattr(meta.phase.data, "description", "") != "Multipart body with custom encoding":
        return True
    raw = context.operation.definition.raw if context.operation is not None else {}
    schema = raw.get("requestBody", {}).get("content", {}).get(case.media_type or "", {}).get("schema", {})
    body = {k: "" if isinstance(v, (bytes, bytearray)) else v for k, v in case.body.items()}
    return jsonschema.Draft202012Validator(schema).is_valid(body)
