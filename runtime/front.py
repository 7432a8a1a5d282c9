"""`pipe.generate`: the one front that picks a kind's loop.

runtime/pipeline.py is the one-segment engine (encode -> denoise -> decode of one bundle shape). The loops over
segments run above it, on its methods: Wan-Animate's (runtime/animate.py) and diffusion forcing's
(runtime/forcing.py). `runtime.load` returns this module's `Pipeline`, the engine whose `generate` hands the call to
the loop of the bundle's kind (kinds.Kind.loop), keywords as they are: each loop takes the keywords it knows, and
those of another kind's loop are refused in one line here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import adapters, animate, chronoedit, forcing, helios, loop_settings
from . import manifest as mf
from . import pipeline as engine
from .bundle import open_bundle
from .errors import UserError

# The keywords only some loops take (and what those loops are for), and the engine's keywords a loop does not take
# (given, refused in one line; None, dropped): both made from the loops' settings table (runtime/loop_settings.py).
LOOP_KEYWORDS: dict[str, tuple[str, tuple[str, ...]]] = loop_settings.LOOP_KEYWORDS
NOT_TAKEN: dict[str, tuple[str, ...]] = loop_settings.NOT_TAKEN


class Pipeline(engine.Pipeline):
    """A loaded bundle (runtime/pipeline.py's engine) whose `generate` runs its kind's loop."""

    def generate(self, prompt: str | Sequence[str], negative_prompt: str | Sequence[str] = "", *args: Any,
                 **kwargs: Any) -> np.ndarray:
        """prompt (+ images, videos) -> frames (B, F, H, W, 3) float32 in [0, 1], by the bundle kind's loop:

        - one bundle shape (engine.Pipeline.generate): every kind without a loop of its own;
        - Wan-Animate (runtime/animate.py `generate`): `image`, `pose_video`, `face_video`, `mode`, ...;
        - diffusion forcing (runtime/forcing.py `generate`): `num_frames` of any length, `overlap_history`,
          `ar_step`, `causal_block_size`, `addnoise_condition`, `image`, `last_image`, `video`, `latents` (one initial
          noise per segment), `fps`;
        - Helios (runtime/helios.py `generate`): `num_frames` of any length (whole chunks), `image`, `video`,
          `latents` (one initial noise per chunk), add_noise_to_image_latents, image_noise_sigma_min/max,
          add_noise_to_video_latents, video_noise_sigma_min/max, is_skip_first_chunk.

        The shared keywords (seed, steps, guidance, flow_shift, sampler, sigmas, size, frames, progress, low_memory,
        on_step, on_frames, ...) mean the same everywhere; `loras` (the LoRA set, engine.Pipeline.use_loras) is
        switched to before any loop runs. `stream` (a directory): the video as an HLS live stream there while it is
        made, `stream.m3u8` and `stream/<n>.ts` (runtime/hls.py), a segment for each part as it is decoded, ended
        when the call returns or fails (the first video of a batch; at `fps`, default the bundle's)."""
        loop = self.kind.loop
        loras = kwargs.pop("loras", None)
        stream = kwargs.pop("stream", None)
        if stream is not None:
            return self._streamed(stream, prompt, negative_prompt, *args, loras=loras, **kwargs)
        own = LOOP_KEYWORDS.get(loop, ("", ()))[1]
        for other, (what, names) in LOOP_KEYWORDS.items():
            given = [n for n in names if kwargs.get(n) is not None and n not in own]
            if other != loop and given:
                raise UserError(f"this bundle is {self.kind.title}: {given[0]} is for {what}")
        for name in NOT_TAKEN.get(loop, ()):
            if name in kwargs and kwargs.pop(name) is not None:
                raise UserError(f"this bundle is {self.kind.title}: it takes no {name.replace('_', ' ')}")
        if loras is not None:  # before any loop: whichever runs, its programs use the weights of this set
            self.use_loras(loras)
        return LOOPS[loop](self, prompt, negative_prompt, *args, **kwargs)

    def edit_image(self, image: Any, prompt: str, negative_prompt: str = "", seed: int = 0,
                   steps: int | None = None, guidance: float | None = None, temporal_reasoning_steps: int = 0,
                   frames: int | None = None, **kwargs: Any) -> Any:
        """The edited image (a PIL RGB image of the bundle shape's size) of an image-editing bundle (ChronoEdit):
        the last frame of the short video the edit is made as (runtime/chronoedit.py `edit_image`, where the
        keywords are). UserError (one line) for a bundle of another kind or bad input, before any work."""
        return chronoedit.edit_image(self, image, prompt, negative_prompt, seed=seed, steps=steps, guidance=guidance,
                                     temporal_reasoning_steps=temporal_reasoning_steps, frames=frames, **kwargs)

    def _streamed(self, stream: str | Path, prompt: Any, negative_prompt: Any, *args: Any, **kwargs: Any
                  ) -> np.ndarray:
        """`generate` with its frames written to an HLS stream in directory `stream` as they come."""
        from . import hls

        fps = kwargs.get("fps") or self.manifest.defaults.fps
        writer = hls.HlsWriter(hls.directory_sink(stream), fps)
        given = kwargs.pop("on_frames", None)

        def on_frames(frames: np.ndarray) -> None:
            writer.add(frames)
            if given is not None:
                given(frames)

        try:
            return self.generate(prompt, negative_prompt, *args, on_frames=on_frames, **kwargs)
        finally:
            writer.end()  # a failed run's stream ends where it stopped


LOOPS: dict[str, Callable[..., np.ndarray]] = {
    "segment": engine.Pipeline.generate,
    "animate": animate.generate,
    "forcing": forcing.generate,
    "helios": helios.generate,
    "chronoedit": chronoedit.generate,
}


def load(path: str | Path, verify: bool = True, loras: Sequence[adapters.LoraSpec] | None = None,
         lora_dir: str | Path | None = None) -> Pipeline:
    """Open the bundle at `path` as runtime/pipeline.py's `load` does (every file checked against the manifest's
    sha256; `loras` merged at load, `lora_dir` the adapters a call may name), as this module's `Pipeline`."""
    named = adapters.scan(Path(lora_dir), mf.read(Path(path))) if lora_dir is not None else None
    return Pipeline(open_bundle(path, verify=verify, loras=loras, named=named), loras, named)
