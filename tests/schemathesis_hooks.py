"""schemathesis' custom strategies for the API's files (loaded with SCHEMATHESIS_HOOKS=tests.schemathesis_hooks): real
images and videos, so that a request the document says is valid is one the server takes, and a fuzzer's 400 means a
bug. The documents name what a file holds by the form part's content type (`image/*`, `video/*`) and, in JSON, by the
string format `image-data-url` or `video-data-url` (runtime/serve/schema.py, file_schema).

Videos are WAN_AOT_FUZZ_FRAMES frames of WAN_AOT_FUZZ_SIZE (a shape of the bundle under test), one of them, so that a
control video and its mask (VACE) or a pose and a face video (Wan-Animate) always agree in length and size.
"""

from __future__ import annotations

import base64
import io
import os
import tempfile
from pathlib import Path

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


def _mp4(frames: int, width: int, height: int, seed: int) -> bytes:
    import imageio.v2 as imageio

    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "v.mp4"
        imageio.mimwrite(str(path), [(rng.random((height, width, 3)) * 255).astype(np.uint8) for _ in range(frames)],
                         fps=16, macro_block_size=1)
        return path.read_bytes()


IMAGES = [_png(40, 30, 1), _png(WIDTH, HEIGHT, 2)]
VIDEOS = [_mp4(FRAMES, WIDTH, HEIGHT, 3)]


def _urls(kind: str, files: list[bytes]) -> list[str]:
    return [f"data:{kind};base64," + base64.b64encode(f).decode() for f in files]


schemathesis.openapi.media_type("image/png", st.sampled_from(IMAGES))
schemathesis.openapi.media_type("video/mp4", st.sampled_from(VIDEOS))
schemathesis.openapi.format("image-data-url", st.sampled_from(_urls("image/png", IMAGES)))
schemathesis.openapi.format("video-data-url", st.sampled_from(_urls("video/mp4", VIDEOS)))


@schemathesis.hook
def map_case(context: schemathesis.HookContext, case: schemathesis.Case) -> schemathesis.Case:
    """Work around schemathesis 4.32's coverage phase: its "Multipart body with custom encoding" case draws only the
    file parts and fills every other required field with "" (`_generate_multipart_body_from_custom_strategies`), a
    request its own document check calls valid although `prompt` (minLength 1, a pattern) and `seconds` (an enum)
    refuse it. Such a field gets a value the schema takes, so that the case is what it says it is: a valid request."""
    meta = case.meta
    if meta is None or meta.phase.name != "coverage" or not isinstance(case.body, dict) or \
            getattr(meta.phase.data, "description", "") != "Multipart body with custom encoding":
        return case
    raw = context.operation.definition.raw if context.operation is not None else {}
    schema = raw.get("requestBody", {}).get("content", {}).get(case.media_type or "", {}).get("schema", {})
    for name, value in list(case.body.items()):
        field = schema.get("properties", {}).get(name, {})
        if value == "" and name in schema.get("required", []):
            case.body[name] = field["enum"][0] if "enum" in field else "a fox in the snow"
    return case
