"""The create request's fields, `POST /v1/videos`: one table (FIELDS) of Field rows (fields.py), the loops' own
settings among them made from runtime/loop_settings.py (`loop_fields`), which offers each to the bundles of the loops
that take it and refuses it elsewhere in one line. A new field is one more Field here (or one more row of the loops'
table); the job's params carry it under `param`, for the worker to use."""

from __future__ import annotations

from typing import Any

from .. import loop_settings, samplers
from ..settings import MAX_SEED
from .fields import FLOW_SHIFT, MAX_FPS, MAX_PROMPT_CHARS, NOT_BLANK, SIGMA_MIN, Field, Offer

# What offers a loop's settings: a bundle whose kind runs that loop.
_OFFERED_BY = {"animate": lambda o: o.kind.animate, "forcing": lambda o: o.kind.forcing,
               "helios": lambda o: o.kind.helios, "animate-2": lambda o: o.kind.animate2}


def _loop_field(s: loop_settings.Setting) -> Field:
    """A loop's setting (runtime/loop_settings.py) as a field: offered by bundles of the loops that take it (a Helios
    pyramid's by pyramid bundles only), refused elsewhere naming what takes it."""
    api = s.api
    kw: dict[str, Any] = dict(api.keywords)
    loop = next((loop for loop in s.loops if loop in _OFFERED_BY), None)
    if "offered" not in kw:
        by = _OFFERED_BY[loop]
        kw["offered"] = (lambda o: by(o) and o.pyramid > 1) if api.pyramid else by
    what = api.refusal_what
    return Field(s.name, api.type, api.description, param=None if api.type == "file" else s.name,
                 refusal=lambda o: f"{s.name} is for {what}; this bundle is {o.kind.title}", **kw)


def loop_fields(loop: str | None = None) -> tuple[Field, ...]:
    """The fields of the loops' settings that the API takes (those of `loop`, or all), in the table's order."""
    return tuple(_loop_field(s) for s in loop_settings.SETTINGS
                 if s.api is not None and (loop is None or loop in s.loops))


def _two_experts(offer: Offer) -> bool:
    return offer.kind.experts > 1


HELIOS_FIELDS = loop_fields("helios")  # the Helios settings the API takes (runtime/helios.py's keywords)


FIELDS: tuple[Field, ...] = (
    Field("prompt", "string", "What the video shows.", param="prompt", required=True,
          max_length=MAX_PROMPT_CHARS, pattern=NOT_BLANK, mismatch="prompt is required (a non-empty string)"),
    Field("negative_prompt", "string", "What the video should not show.", param="negative_prompt",
          max_length=MAX_PROMPT_CHARS, default=lambda o: ""),
    Field("model", "string", "The bundle served here, by its directory name or its bundle_id (GET /v1/models).",
          enum=lambda o: list(o.models), default=lambda o: o.models[0],
          mismatch="model {value!r} is not served here: this server runs {choices} (or leave model out)"),
    Field("size", "string", "Width x height, one of the bundle's resolutions (GET /v1/models lists its shapes). "
          "Wan-Animate 2 bundles make the video at the character image's aspect ratio: `size` is the area asked for, "
          "and the frame size that aspect makes at it must be one of the bundle's (left out: the first size whose "
          "area does).",
          param="size", enum=lambda o: o.sizes, default=lambda o: o.sizes[0],
          mismatch="size {value!r} is not one this bundle makes: it makes {choices}"),
    Field("seconds", "string", "The duration, one of those GET /v1/models lists for the size (frames at the "
          "bundle's frame rate); left out, the default shape's frame count. `fps` sets the rate the mp4 plays at, "
          "not the frame count. Diffusion forcing bundles make any duration up to the server's max_seconds (GET "
          "/v1/models), in overlapping segments of the size's longest shape; Helios bundles too, in chunks of the "
          "size's shape (rounded up to whole chunks).", offered=lambda o: not o.kind.animate and not o.kind.animate2,
          refusal=lambda o: "a Wan-Animate 2 video is as long as its driving video (at fps): leave seconds out"
          if o.kind.animate2 else "a Wan-Animate video is as long as its pose video: leave seconds out"),
    Field("input_reference", "file", "The first frame (image-to-video bundles; PNG, JPEG, WebP, ...), the "
          "character (Wan-Animate and Wan-Animate 2 bundles: Wan-Animate 2 makes the video at the image's aspect, at "
          "the area of `size`, and crops it to the image), or the control or source video (VACE and video-to-video "
          "bundles, and Lucy Edit bundles, which need it: the video to edit; mp4, webm, gif): its frame count picks "
          "the video's frames.",
          offered=lambda o: o.kind.image != "none" or o.takes_video,
          accepts=lambda o: "video" if o.video_reference else "image",
          refusal=lambda o: f"this bundle is {o.kind.title}: it takes no image or video (export an image-to-video, "
                            "VACE or video-to-video model for that)"),
    Field("last_image", "file", "The last frame (first-last-frame and diffusion forcing bundles).",
          offered=lambda o: o.kind.takes_last_image,
          refusal=lambda o: f"this bundle is {o.kind.title}: it takes no last image (that needs a "
                            "first-last-frame model such as Wan2.1-FLF2V)"),
    Field("mask", "file", "VACE: the mask video, white = generate, black = keep (one frame per video frame).",
          offered=lambda o: o.kind.vace, accepts=lambda o: "video",
          refusal=lambda o: f"this bundle is {o.kind.title}: it takes no mask (masks are for VACE models)"),
    Field("reference_image", "file", "VACE: a reference image (repeat the field for several; the bundle serves the "
          "counts GET /v1/models lists).", offered=lambda o: o.kind.reference_images and max(o.reference_counts) > 0,
          repeat=lambda o: max(o.reference_counts),
          refusal=lambda o: f"this bundle is {o.kind.title}: it takes no reference images"),
    *loop_fields(),  # Wan-Animate's, diffusion forcing's, Helios', VACE's and video-to-video's settings
    Field("seed", "integer", "The noise seed (jax.random).", param="seed", minimum=0, maximum=MAX_SEED,
          default=lambda o: 0),
    Field("num_inference_steps", "integer", "Denoising steps.", param="steps", minimum=1,
          maximum=lambda o: o.max_steps, default=lambda o: o.steps),
    Field("guidance_scale", "number", "Classifier-free guidance scale.", param="guidance", minimum=0,
          default=lambda o: o.defaults.guidance),
    Field("guidance_scale_2", "number", "The second (low-noise) expert's guidance scale (default: "
          "guidance_scale).", param="guidance_2", minimum=0, offered=_two_experts,
          refusal=lambda o: f"guidance_scale_2 is for two-expert models; this bundle is {o.kind.title} with one "
                            "expert: use guidance_scale"),
    Field("flow_shift", "number", "The scheduler's flow shift.", param="flow_shift", minimum=FLOW_SHIFT[0],
          maximum=FLOW_SHIFT[1], default=lambda o: o.defaults.flow_shift),
    Field("sampler", "string", "The sampler: unipc (UniPCMultistepScheduler), euler (FlowMatchEulerDiscreteScheduler) "
          "or dpm++ (DPMSolverMultistepScheduler); flowmap (FlowMapEulerDiscreteScheduler) on flow-map models "
          "(AnyFlow), which take flowmap or euler only.", param="sampler",
          enum=lambda o: list(samplers.samplers_for(o.kind.flow_map)),
          default=lambda o: o.defaults.sampler, mismatch="sampler {value!r} is not one of {choices}"),
    Field("sigmas", "numbers", "Custom noise levels before the flow shift (e.g. 1, 0.75, 0.5, 0.25), one step per "
          "distinct level, run from the highest down (so any order): they set the step count, so "
          "num_inference_steps is left out. In a form: comma-separated decimals.",
          param="sigmas", minimum=SIGMA_MIN, maximum=1, max_items=lambda o: o.max_steps),
    Field("decoder", "string", "What decodes the video: full (the VAE) or tiny (the bundle's tiny decoder: several "
          "times faster, coarser).", param="decoder", enum=lambda o: ["full", "tiny"], default=lambda o: "full",
          mismatch="decoder {value!r} is not one of {choices}", offered=lambda o: o.tiny_decoder,
          refusal=lambda o: "this bundle has no tiny decoder (export it with --tiny-decoder FILE): leave decoder out"),
    Field("fps", "integer", "The frame rate the mp4 plays at (Wan-Animate 2: also the rate its driving video is "
          "resampled to).", param="fps", minimum=1, maximum=MAX_FPS,
          default=lambda o: o.defaults.fps),
    Field("lora", "loras", "LoRA adapters to run with, from those GET /v1/models lists: each {\"name\", \"scale\"} "
          "(scale in -4..4, default 1), on two-expert bundles with \"expert\": \"high\" or \"low\" (default: the "
          "experts the adapter was made for); left out, none.", param="lora", offered=lambda o: bool(o.loras),
          refusal=lambda o: "this server offers no LoRA adapters (start it with --lora-dir DIR)"),
)
BY_NAME = {f.name: f for f in FIELDS}
FILE_FIELDS = tuple(f.name for f in FIELDS if f.type == "file")
