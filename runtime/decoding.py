"""Latents to frames: the VAE decoder's (or the tiny decoder's) chunk programs, one latent frame per call, their
memory (the causal convolutions' caches) carried on the devices from call to call."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from . import host_memory, kinds, shapes
from . import manifest as mf
from .distributed import fetch
from .errors import UserError

if TYPE_CHECKING:
    from .bundle import Bundle


def decoder_programs(m: mf.Manifest, decoder: str | None) -> str:
    """The chunk programs' prefix of `decoder` ("full", "tiny"; None: "full"); UserError for a name that is neither,
    or "tiny" on a bundle exported without --tiny-decoder."""
    decoder = "full" if decoder is None else decoder
    if decoder not in kinds.DECODERS:
        raise UserError(f"decoder {decoder!r} is not one of {', '.join(kinds.DECODERS)}")
    if decoder == "tiny" and m.tiny_decoder is None:
        raise UserError("this bundle has no tiny decoder: export it with --tiny-decoder FILE (e.g. "
                        "taew2_1.safetensors), or decode with the full VAE (decoder full)")
    return kinds.DECODERS[decoder]


class FrameDecoder:
    """Latent frames in, video frames out (float32 (B, F, H, W, 3) in [0, 1]), across calls: the decoder's chunk
    programs take one latent frame each and carry their memory (the causal convolutions' caches) on the devices, so a
    video's latents given in parts, in order, decode to the frames one call on all of them makes. The first latent
    frame makes one frame, each later one `temporal_scale`."""

    def __init__(self, bundle: Bundle, prefix: str) -> None:
        self.bundle, self.prefix = bundle, prefix
        self.shape: mf.Geometry | None = None
        self.caches: Any = None

    def __call__(self, latents: np.ndarray) -> np.ndarray:
        latents = np.asarray(latents, np.float32)
        m = self.bundle.manifest
        if self.shape is None:
            self.shape = shapes.of_decoding(m, latents.shape)
            host_memory.release_freed()  # what the denoising steps freed, before the decoder allocates its own
        g, start = self.shape, 0
        pending = None
        if self.caches is None:
            pending, self.caches = self.bundle.call(m.program_for(f"{self.prefix}_first", g))(latents[:, :, 0:1])
            start = 1
        chunks = []
        if latents.shape[2] > start:
            nxt = self.bundle.call(m.program_for(f"{self.prefix}_next", g))
            for t in range(start, latents.shape[2]):
                frames, self.caches = nxt(latents[:, :, t:t + 1], *self.caches)  # dispatched: runs as the last copies
                # Each chunk comes to the host as the next one runs, so the devices never hold more than two chunks'
                # frames (they come back whole on every device: the 720p x 81 video is 0.9 GB each).
                if pending is not None:
                    chunks.append(fetch(pending).astype(np.float32))
                pending = frames
        if pending is not None:
            chunks.append(fetch(pending).astype(np.float32))
        if not chunks:
            b, _, _, h, w = latents.shape
            return np.zeros((b, 0, h * g.spatial_scale, w * g.spatial_scale, 3), np.float32)
        return np.concatenate(chunks, axis=1)


def unload_before(bundle: Bundle, stage: str) -> None:
    """Drop the weights (and compiled calls) that no program of `stage` or a later stage (kinds.PIPELINE_STAGES)
    uses: before "denoise", the text and image encoders'; before "decode", those and the DiT experts'. A one-shot run
    then peaks at its largest stage rather than their sum; a later call of a dropped stage loads it again."""
    if stage not in kinds.PIPELINE_STAGES:
        raise ValueError(f"stage must be one of {kinds.PIPELINE_STAGES}, not {stage!r}")
    later = kinds.PIPELINE_STAGES[kinds.PIPELINE_STAGES.index(stage):]
    programs = bundle.manifest.programs
    keep = {p.weights for n, p in programs.items() if kinds.pipeline_stage(n) in later}
    bundle.unload({p.weights for p in programs.values()} - keep)
