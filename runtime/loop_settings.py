"""Each loop's settings, declared once: the keywords of `generate` that not every loop takes, by diffusers' names.

A row says which loops take the setting (kinds.Kind.loop: "segment" is the one-segment loop), its command-line flag
(spelling, type, metavar, help, group; None where another flag feeds it or there is none) and its API field (the
create request's row: type, bounds, default, description; None where the API has no field of that name). From this
one table are made:

- `python -m runtime generate`'s flags of each loop's group (`add_flags`) and the keywords they give (`given`);
- the API's fields of the create request and their OpenAPI entries (runtime/serve/request_fields.py `loop_fields`),
  with the refusal a bundle of another kind answers;
- `generate`'s checks (runtime/front.py): a loop's own keywords given to another kind's bundle (`LOOP_KEYWORDS`) and
  the engine's keywords a loop does not take (`NOT_TAKEN`), each refused in one line.

A new setting of a loop is one more row. The module imports neither numpy nor jax: the server's schema reads it, and
the API's values that come from a loop's module (its defaults and choices) are read from it only when asked.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def parse_bool(text: str) -> bool:
    """A flag's true or false (true/1/yes, false/0/no)."""
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return value


def parse_int_list(text: str) -> list[int]:
    """A flag's comma-separated integers (10,10,10)."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 10,10,10)") \
            from None


def const(module: str, name: str, index: int | None = None) -> Callable[[Any], Any]:
    """An API default or choice list read from a loop's module (runtime/<module>.py) when the document is made, so
    that this table imports no loop (and no jax) itself."""
    def read(offer: Any) -> Any:
        value = getattr(importlib.import_module(f"runtime.{module}"), name)
        return list(value) if index is None and isinstance(value, tuple) else value if index is None else value[index]

    return read


@dataclass(frozen=True)
class Flag:
    """A setting's command-line flag in `group` (GROUPS); `rank` orders it within its group's help (else the table's
    order)."""

    group: str
    help: str
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    default: Any = None
    rank: int = 0


@dataclass(frozen=True)
class Api:
    """A setting's field in the create request (runtime/serve/fields.py `Field`'s keywords besides the name, what
    offers it and the refusal, which come from the loops): `refusal_what` names what takes it in the 400 a bundle of
    another kind answers; `pyramid`: offered by Helios pyramid bundles only."""

    type: str
    description: str
    refusal_what: str
    pyramid: bool = False
    keywords: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Setting:
    name: str  # generate's keyword (diffusers' name where diffusers has the setting) and the API field's
    loops: tuple[str, ...]  # the loops that take it (kinds.Kind.loop)
    flag: Flag | None = None  # None: no flag of its own (--frames feeds num_frames, --video video, ...)
    api: Api | None = None  # None: no create-request field of this name

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


# What each loop is, as a refusal names it (runtime/front.py), in the order generate checks them.
LOOP_TITLES = {"animate": "Wan-Animate models", "forcing": "diffusion forcing models (SkyReels-V2 DF)",
               "helios": "Helios models", "chronoedit": "ChronoEdit models", "far": "AnyFlow-FAR models",
               "animate-2": "Wan-Animate 2 models"}

# The command line's groups of loop flags: their titles (`python -m runtime generate --help`).
GROUPS = {
    "video": "video in (VACE bundles; video-to-video bundles take --video and --strength; Lucy Edit bundles need "
             "--video, the video the prompt's instruction edits)",
    "animate": "Wan-Animate (animate bundles: --image is the character; the video has the pose video's length, made "
               "in segments of the shape's frames)",
    "forcing": "diffusion forcing (SkyReels-V2 DF bundles: --frames beyond the bundle's shape runs segments of it; "
               "--image, --last-image, or --video to extend)",
    "helios": "Helios (helios* bundles: --frames is the video's length, in chunks of the bundle's shape; --image, or "
              "--video to continue)",
    "animate-2": "Wan-Animate 2 (animate-2 bundles: --image is the character, moved by --driving-video; the video has "
                 "the driving video's length at --fps, made in segments of the shape's frames)",
    "chronoedit": "ChronoEdit (image-editing bundles: --image is edited as the prompt says; --out x.png writes the "
                  "edited image, the short video's last frame)",
}

_ANIMATE = ("animate",)
_ANIMATE2 = ("animate-2",)
_ANIMATE2_MODELS = "Wan-Animate 2 models"
_FORCING = ("forcing",)
_HELIOS = ("helios",)
_ANY_LENGTH = ("forcing", "helios")
_WAN_ANIMATE = "Wan-Animate"
_DF = "diffusion forcing models"
_HELIOS_MODELS = "Helios models"
_PYRAMID = "a Helios pyramid (HeliosPyramidPipeline)"


def _animate_video(name: str, help_: str, description: str) -> Setting:
    return Setting(name, _ANIMATE, Flag("animate", help_, type=Path),
                   Api("file", description, _WAN_ANIMATE, keywords={"accepts": lambda o: "video"}))


def _helios(name: str, flag: Flag, type_: str, description: str, pyramid: bool = False, **kw: Any) -> Setting:
    """A Helios setting by diffusers' name (runtime/helios.py takes it as is); `pyramid`: HeliosPyramidPipeline's."""
    return Setting(name, _HELIOS, flag, Api(type_, "Helios: " + description, _PYRAMID if pyramid else _HELIOS_MODELS,
                                            pyramid=pyramid, keywords=kw))


def _bool_flag(help_: str, rank: int = 0) -> Flag:
    return Flag("helios", help_, type=parse_bool, metavar="true|false", rank=rank)


SETTINGS: tuple[Setting, ...] = (
    # Wan-Animate (runtime/animate.py)
    _animate_video("pose_video", "the rendered pose video (skeletons) the character follows",
                   "Wan-Animate: the rendered pose video the character follows (mp4, webm, gif); the video is as long, "
                   "made in segments of the size's frames."),
    _animate_video("face_video", "the face crops, one per pose frame (resized to the model's face size, 512x512 for "
                                 "the 14B)", "Wan-Animate: the face crops, one per pose frame."),
    Setting("mode", _ANIMATE, Flag("animate", "animate: the character moves as the pose video says (default); replace: "
                                              "the character takes the place of the person in --background-video where "
                                              "--mask-video is white", choices=("animate", "replace")),
            Api("string", "Wan-Animate: animate (the character moves as the pose video says) or replace (the "
                "character takes the place of the person in background_video, where mask_video is white).",
                _WAN_ANIMATE, keywords={"enum": lambda o: list(BY_NAME["mode"].flag.choices),
                                        "default": lambda o: "animate",
                                        "mismatch": "mode {value!r} is not one of {choices}"})),
    _animate_video("background_video", "replace: the video without the person",
                   "Wan-Animate, replace: the video without the person, one frame per pose frame."),
    _animate_video("mask_video", "replace: white where the character goes",
                   "Wan-Animate, replace: white where the character goes, one frame per pose frame."),
    Setting("prev_segment_frames", _ANIMATE,
            Flag("animate", "frames each segment takes from the one before (default 1)", type=int, metavar="1|5",
                 default=1),
            Api("integer", "Wan-Animate: the frames each segment takes from the one before.", _WAN_ANIMATE, keywords={
                "default": lambda o: 1,  # those a segment of the bundle's frames can take
                "enum": lambda o: [p for p in const("animate", "PREV_FRAMES")(o) if any(n >= 2 * p + 1
                                                                                         for _, n in o.shapes)],
                "mismatch": "prev_segment_frames must be one of {choices}, got {value!r}"})),
    # any length: --frames is the video's length
    Setting("num_frames", _ANY_LENGTH),
    # diffusion forcing (runtime/forcing.py)
    Setting("overlap_history", _FORCING,
            Flag("forcing", "frames each segment takes from the one before, and of --video (default 17)", type=int,
                 metavar="FRAMES"),
            Api("integer", "Diffusion forcing: the frames each segment takes from the one before.", _DF, keywords={
                "minimum": 1, "maximum": lambda o: max(n for _, n in o.shapes) - 1,
                "default": const("forcing", "DEFAULT_OVERLAP")})),
    Setting("ar_step", _FORCING,
            Flag("forcing", "the asynchronous mode: each causal block starts N steps after the one before (default 0: "
                            "synchronous); needs --causal-block-size", type=int, metavar="N"),
            Api("integer", "Diffusion forcing, the asynchronous mode: each causal block of frames starts this many "
                "steps after the one before (0: all at once). Needs causal_block_size.", _DF, keywords={
                    "minimum": 0, "maximum": lambda o: o.max_steps, "default": lambda o: 0})),
    Setting("causal_block_size", _FORCING,
            Flag("forcing", "latent frames per causal block of block-causal attention (must divide every segment's "
                            "latent frames; default: none)", type=int, metavar="FRAMES"),
            Api("integer", "Diffusion forcing: latent frames per causal block of block-causal attention; must divide "
                "every segment's latent frames.", _DF, keywords={
                    "minimum": 1, "maximum": lambda o: max(n for _, n in o.shapes)})),
    Setting("addnoise_condition", _FORCING,
            Flag("forcing", "re-noise the frames carried over to timestep T (diffusers recommends 20; default 0)",
                 type=float, metavar="T"),
            Api("number", "Diffusion forcing: re-noise the frames carried over between segments to this timestep (20 "
                "is diffusers' recommendation).", _DF, keywords={"minimum": 0, "maximum": 999,
                                                                 "default": lambda o: 0})),
    # Helios (runtime/helios.py), in HeliosPipeline's order: the noise on given latents, then the pyramid's
    _helios("add_noise_to_image_latents", _bool_flag("lightly noise the image's latents first (default true)"),
            "boolean", "lightly noise the first frame's latents first (default true).", default=lambda o: True),
    _helios("image_noise_sigma_min", Flag("helios", "that noise's least sigma (default 0.111)", float, "S"),
            "number", "that noise's least sigma.", minimum=0, maximum=1, default=const("helios", "NOISE_RANGE", 0)),
    _helios("image_noise_sigma_max", Flag("helios", "its greatest (default 0.135)", float, "S"),
            "number", "that noise's greatest sigma.", minimum=0, maximum=1, default=const("helios", "NOISE_RANGE", 1)),
    _helios("add_noise_to_video_latents", _bool_flag("lightly noise the source video's latents (default true)"),
            "boolean", "lightly noise the continued video's latents (default true).", default=lambda o: True),
    _helios("video_noise_sigma_min", Flag("helios", "that noise's least sigma (default 0.111)", float, "S"),
            "number", "that noise's least sigma.", minimum=0, maximum=1, default=const("helios", "NOISE_RANGE", 0)),
    _helios("video_noise_sigma_max", Flag("helios", "its greatest (default 0.135)", float, "S"),
            "number", "that noise's greatest sigma.", minimum=0, maximum=1, default=const("helios", "NOISE_RANGE", 1)),
    _helios("is_skip_first_chunk", _bool_flag("the second chunk's first frame is the video's first frame", rank=1),
            "boolean", "the second chunk's first frame becomes the video's first frame.", default=lambda o: False),
    _helios("pyramid_num_inference_steps_list",
            Flag("helios", "a pyramid bundle's steps per stage (default: --steps for each)", parse_int_list, "N,N,N",
                 rank=-1),
            "integers", "the steps of each pyramid stage (default num_inference_steps for each); they count against "
            "the server's step limit per chunk.", pyramid=True, minimum=1, maximum=lambda o: o.max_steps,
            max_items=lambda o: o.pyramid),
    _helios("is_cfg_zero_star", _bool_flag("CFG-Zero* guidance (pyramid bundles; default the bundle's)"),
            "boolean", "CFG-Zero* guidance (default: the bundle's).", pyramid=True),
    _helios("use_zero_init", _bool_flag("CFG-Zero*: the first steps predict zero (default true)"),
            "boolean", "CFG-Zero*: the first steps predict zero (default true).", pyramid=True,
            default=lambda o: True),
    _helios("zero_steps", Flag("helios", "CFG-Zero*: how many (default 1: steps 0 and 1)", int, "N"),
            "integer", "CFG-Zero*: the steps 0 .. zero_steps predict zero (default 1).", pyramid=True, minimum=0,
            maximum=lambda o: o.max_steps, default=lambda o: 1),
    _helios("is_amplify_first_chunk", _bool_flag("distilled bundles: the first chunk at twice the steps"),
            "boolean", "a distilled model's first chunk at twice the steps.", pyramid=True, default=lambda o: False),
    # Wan-Animate 2 (runtime/animate2.py), by the modular blocks' names
    Setting("driving_video", _ANIMATE2, Flag("animate-2", "the driving video whose motion the character follows (mp4, "
                                                          "webm, gif or a folder of frames; any length)", type=Path),
            Api("file", "Wan-Animate 2: the driving video whose motion the character follows (mp4, webm, gif), of any "
                "length: the video is as long (resampled to fps from driving_video_fps), made in segments of the "
                "size's frames.", _ANIMATE2_MODELS, keywords={"accepts": lambda o: "video"})),
    Setting("prompt_ref", _ANIMATE2, Flag("animate-2", "the reference prompt of the driving video's pass (default "
                                                       "人物动作的参考视频)", metavar="TEXT"),
            Api("string", "Wan-Animate 2: the prompt of the driving video's reference pass (default 人物动作的参考视频, "
                "\"a reference video of the person's motion\").", _ANIMATE2_MODELS,
                keywords={"max_length": 20_000, "default": const("animate2_media", "DEFAULT_PROMPT_REF")})),
    Setting("prev_segment_conditioning_frames", _ANIMATE2,
            Flag("animate-2", "frames each segment takes from the video made before it (default 1)", type=int,
                 metavar="N"),
            Api("integer", "Wan-Animate 2: the frames each segment takes from the video made before it (fewer than "
                "the size's frames).", _ANIMATE2_MODELS,
                keywords={"minimum": 0, "maximum": lambda o: max(n for _, n in o.shapes) - 1,
                          "default": lambda o: 1})),
    Setting("driving_video_fps", _ANIMATE2,
            Flag("animate-2", "the driving video's frame rate, resampled to --fps by nearest frame (default: the "
                              "file's; frames without one are used as they are)", type=float, metavar="FPS"),
            Api("number", "Wan-Animate 2: the driving video's frame rate, from which it is resampled to fps (nearest "
                "frame); left out, the file's own (a file that says none is taken frame for frame).",
                _ANIMATE2_MODELS, keywords={"minimum": 0, "exclusive_minimum": True, "maximum": 1000})),
    # any length: the mp4's frame rate (diffusion forcing tells its DiT too; Wan-Animate 2 resamples the driving
    # video to it)
    Setting("fps", ("forcing", "helios", "animate-2")),
    # ChronoEdit (runtime/chronoedit.py)
    Setting("temporal_reasoning_steps", ("chronoedit",),
            Flag("chronoedit", "the first K steps reason over --frames frames (a frame count the bundle was exported "
                               "with; default its most), the rest edit on 2 latent frames; K < --steps, sampler unipc "
                               "(default 0: none)", type=int, metavar="K")),
    # AnyFlow-FAR (runtime/far.py): from chunk k on, another prompt ({k: prompt}), its KV cache re-encoded
    Setting("prompt_changes", ("far",)),
    # the one-segment loop's inputs and settings, and which other loops take them
    Setting("last_image", ("segment", "forcing")),
    Setting("video", ("segment", "forcing", "helios", "far")),
    Setting("mask", ("segment",)),
    Setting("reference_images", ("segment",)),
    Setting("conditioning_scale", ("segment",), Flag("video", "VACE: scale of the VACE branch's hints (default 1)",
                                                     type=float),
            Api("number", "VACE: the scale of the VACE branch's hints.", "VACE models", keywords={
                "minimum": 0, "maximum": 100, "default": lambda o: 1.0, "offered": lambda o: o.kind.vace})),
    Setting("strength", ("segment",),
            Flag("video", "video-to-video: how much of the source video is replaced, in (0, 1] (default 0.8): the "
                          "steps after the first int(steps x (1 - strength)) run", type=float),
            Api("number", "Video-to-video: how much of the source video is replaced (the steps after the first "
                "int(steps x (1 - strength)) run).", "video-to-video bundles", keywords={
                    "minimum": 0, "maximum": 1, "exclusive_minimum": True, "default": lambda o: 0.8,
                    "offered": lambda o: o.video_to_video})),
    Setting("noise", ("segment", "helios")),
)
BY_NAME = {s.name: s for s in SETTINGS}


def own(loop: str) -> tuple[str, ...]:
    """The settings only `loop` and other loops of its own take (not the one-segment loop), in the table's order."""
    return tuple(s.name for s in SETTINGS if loop in s.loops and "segment" not in s.loops)


def settings_of(loop: str) -> tuple[str, ...]:
    """`loop`'s own settings, those with a flag or an API field (not the video's length and frame rate, which every
    any-length loop takes), in the table's order: e.g. Helios' keywords of HeliosPipeline's __call__."""
    return tuple(n for n in own(loop) if BY_NAME[n].flag is not None or BY_NAME[n].api is not None)


def _loop_keywords() -> dict[str, tuple[str, tuple[str, ...]]]:
    return {loop: (title, own(loop)) for loop, title in LOOP_TITLES.items()}


def _not_taken() -> dict[str, tuple[str, ...]]:
    return {loop: tuple(s.name for s in SETTINGS if "segment" in s.loops and loop not in s.loops)
            for loop in LOOP_TITLES}


# The keywords only some loops take, and what those loops are for (a bundle of another kind refuses them), and the
# engine's keywords each other loop does not take (refused in one line when given): runtime/front.py's checks.
LOOP_KEYWORDS: dict[str, tuple[str, tuple[str, ...]]] = _loop_keywords()
NOT_TAKEN: dict[str, tuple[str, ...]] = _not_taken()


def add_flags(parser: argparse.ArgumentParser, group: str, into: Any = None) -> Any:
    """Add the flags of `group` (GROUPS) to `parser`, in an argument group titled as GROUPS says (or into the group
    `into` already made); returns the argument group."""
    g = into if into is not None else parser.add_argument_group(GROUPS[group])
    rows = sorted((s for s in SETTINGS if s.flag is not None and s.flag.group == group), key=lambda s: s.flag.rank)
    for s in rows:
        f = s.flag
        kw: dict[str, Any] = {"default": f.default, "help": f.help}
        kw.update({k: v for k, v in (("type", f.type), ("metavar", f.metavar), ("choices", f.choices))
                   if v is not None})
        g.add_argument(s.option, **kw)
    return g


def given(args: argparse.Namespace, loop: str) -> dict[str, Any]:
    """The flags of `loop`'s own settings that `args` gives (not None), as generate's keywords."""
    return {n: getattr(args, n) for n in own(loop)
            if BY_NAME[n].flag is not None and getattr(args, n, None) is not None}
