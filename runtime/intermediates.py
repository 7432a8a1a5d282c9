"""Embeddings and latents between stages, as safetensors files that name the bundle they came from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .errors import UserError
from .files import atomic_path

EMBEDS = "embeds"
LATENTS = "latents"
FRAMES = "frames"  # decoded float32 (B, F, H, W, 3) in [0, 1], lossless beside the mp4
KEYS = {EMBEDS: ("prompt_embeds", "negative_prompt_embeds"), LATENTS: ("latents",), FRAMES: ("frames",)}


def save(path: str | Path, kind: str, tensors: dict[str, np.ndarray], bundle_id: str,
         settings: dict[str, Any]) -> Path:
    from safetensors.numpy import save_file

    path = Path(path)
    meta = {"format": "wan-aot", "kind": kind, "bundle_id": bundle_id, "settings": json.dumps(settings, sort_keys=True)}
    arrays = {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(arrays, str(tmp), metadata=meta)
    return path


def load(path: str | Path, kind: str, bundle_id: str, shapes: dict[str, tuple[int, ...] | list[tuple[int, ...]]]
         ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read an intermediate, refusing one made by another bundle or with unexpected keys/shapes (a list: any of
    those shapes, e.g. the latents of each of a bundle's shapes)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} does not exist")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            tensors = {k: f.get_tensor(k) for k in keys}
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise UserError(f"{path} is not a readable safetensors file ({e})") from None
    if meta.get("format") != "wan-aot" or meta.get("kind") != kind:
        raise UserError(f"{path} is not a wan-aot {kind} file: produce it with `python -m runtime "
                        f"{'encode' if kind == EMBEDS else 'denoise'}`")
    if meta.get("bundle_id") != bundle_id:
        raise UserError(f"{path} was made with bundle {meta.get('bundle_id')}, not this bundle ({bundle_id}): "
                        "re-run the earlier stage with this bundle")
    for key, shape in shapes.items():
        if key not in tensors:
            raise UserError(f"{path} has no tensor {key!r}")
        allowed = [tuple(s) for s in shape] if isinstance(shape, list) else [tuple(shape)]
        if tuple(tensors[key].shape) not in allowed or tensors[key].dtype != np.float32:
            want = " or ".join(f"float32{list(s)}" for s in allowed)
            raise UserError(f"{path}: {key} is {tensors[key].dtype}{list(tensors[key].shape)}, this bundle "
                            f"needs {want}")
    return tensors, json.loads(meta.get("settings", "{}"))
