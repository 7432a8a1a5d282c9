"""Jobs made from another video: remix (`POST /v1/videos/{id}/remix`), edits (`POST /v1/videos/edits`) and
extensions (`POST /v1/videos/extensions`), as the openai SDK's `client.videos.remix`, `.edit` and `.extend` call them.

The source is a completed video of the caller's (`{"video": {"id": ...}}` in JSON, the form field `video[id]`,
which is how the SDK sends `extra_body={"video": {"id": ...}}`, or the remix's path) or, for edits and extensions, an
uploaded video file (the form's `video` part, or a data URL in JSON). A derived job is an ordinary job of this bundle
(the same create-request checks, schema.parse_request) plus the source video among its files, with
`remixed_from_video_id` set where the source is a completed video.

How a bundle remakes or extends a video depends on what its kind takes, so it is data: the first row of `REMAKES` or
`EXTENDS` whose `applies(kind, video_to_video)` holds says how. A new way (diffusion forcing's extension, which
continues the source's last latent frames) is one more row and a branch in `sources`.

    remakes (remix, edits), the new prompt over the source:
      video_to_video  t2v bundles with the VAE encoder: the source's latents, noised at `strength`, start the run
      image           image-to-video kinds with a video VAE encoder: the source's first frame (and last, FLF2V) is the
                      image, and the source's latents, noised at `strength`, start the run (SDEdit)
      vace            VACE: the source's latents, noised at `strength`, start a run with no control video
      first_frame     TI2V (its VAE encodes one frame): the source's settings and seed, with its first frame as the
                      image where the source had one (an upload: always)
      regenerate      text-to-video without an encoder: the source's settings and seed (a completed video only)
    extensions (the new part begins where the source ends; the result is the source, then the new frames, the
    frames they share once):
      forcing         diffusion forcing (SkyReels-V2 DF): runtime/forcing.py's video extension, the source's last
                      `overlap_history` frames pinned (their latents) at the start of a run of any length (`seconds`
                      up to --max-seconds); the run re-makes those frames, which the result takes from the source
      helios          Helios: runtime/helios.py's video-to-video, the source's first frame and last whole chunks the
                      new chunks' history; the new part (`seconds` up to --max-seconds) follows it, nothing shared
      image           image-to-video kinds with one image: the source's last frame is the image (1 frame shared)
      vace            VACE: the source's last `vace_overlap(F)` frames are kept (mask black) at the start of the new
                      part's F frames, the rest generated (mask white, grey control frames)

`strength` (in (0, 1], default DEFAULT_STRENGTH, as video-to-video's) is how much of a noised source is replaced. A
remake makes as many frames as the source has where the bundle makes that many at its size, else the most it makes that
the source has (its first frames), or its fewest (the source's last frame repeated) where the source is shorter.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kinds import KINDS, Kind
from .errors import ApiError
from .request_fields import loop_fields
from .schema import BY_NAME, Body, Offer, check_video, seconds_of

SOURCE_ROLES = ("source", "remake")  # a derived job's files: the video extended (joined in front) or remade (noised)
DEFAULT_STRENGTH = 0.8
# What a derived request may set besides its prompt (and seconds, for extensions); the rest comes from the source
# (its LoRA set too, where this server still offers it: the tenant's adapters are checked as a create request's).
# Diffusion forcing's settings (offered by DF bundles only) go on from the source's to its extension.
SETTINGS = ("negative_prompt", "seed", "num_inference_steps", "guidance_scale", "guidance_scale_2", "flow_shift",
            "sampler", "sigmas", "fps", "conditioning_scale", "lora", *(f.name for f in loop_fields("forcing")),
            "decoder", *(f.name for f in loop_fields("helios")))
# Each route's fields (besides the source: the remix's path, `video` / `video[id]` for the others).
FIELDS_OF = {"remix": ("prompt", "strength", *SETTINGS), "edit": ("prompt", "size", "strength", *SETTINGS),
             "extend": ("prompt", "seconds", "size", *SETTINGS)}


@dataclass(frozen=True)
class Way:
    name: str
    applies: Callable[[Kind, bool], bool]  # (the bundle's kind, whether it takes a source video: video-to-video)
    noised: bool = False  # the source's latents, noised at `strength`, start the run
    settings_only: bool = False  # needs the source's settings: a completed video, not an upload
    image: str = ""  # "first" or "last": that frame of the source is the image (and the last too for FLF2V)
    overlap: Callable[[int], int] | None = None  # extensions: the source frames the new part of F frames begins with


def vace_overlap(frames: int) -> int:
    """The source frames a VACE extension keeps at the start of its new part of `frames` frames: a quarter of its
    latent frames, at least one beyond the first (1 + 4j frames), leaving at least one latent frame to generate."""
    return max(1, min(1 + 4 * max(1, (frames - 1) // 16), frames - 4))


REMAKES: tuple[Way, ...] = (
    Way("video_to_video", lambda k, vtv: vtv, noised=True),  # (no other conditioning: the run's `video_latents`)
    # (diffusion forcing and Helios have no SDEdit start: their remakes are refused, their extensions are their own;
    # ChronoEdit's videos are an image edit's frames, its loop takes no source video: neither remade nor extended;
    # AnyFlow-FAR's chunks start from their own noise, its image is the first chunk's context: no SDEdit start;
    # Wan-Animate 2's video is its driving video's motion, which went with the source job, as Wan-Animate's)
    Way("image", lambda k, vtv: k.image != "none" and k.vae_encode == "video" and not k.animate and not k.any_length
        and not k.chronoedit and not k.far and not k.animate2, noised=True, image="first"),
    Way("vace", lambda k, vtv: k.vace, noised=True),
    Way("first_frame", lambda k, vtv: k.conditioning == "first_frame", image="first"),
    Way("regenerate", lambda k, vtv: k.conditioning == "none", settings_only=True),
)
EXTENDS: tuple[Way, ...] = (
    Way("forcing", lambda k, vtv: k.forcing),  # the overlap is the run's overlap_history (`extend`)
    Way("helios", lambda k, vtv: k.helios),  # the source continued in chunks: nothing shared
    Way("image", lambda k, vtv: k.image != "none" and not k.last_image and not k.animate and not k.chronoedit
        and not k.far and not k.animate2, image="last", overlap=lambda frames: 1),  # (AnyFlow-FAR continues a video
    # as its context; Wan-Animate 2 as long as a driving video)
    Way("vace", lambda k, vtv: k.vace, overlap=vace_overlap),
)


def way(ways: tuple[Way, ...], offer: Offer) -> Way | None:
    return next((w for w in ways if w.applies(offer.kind, offer.video_to_video)), None)


def kinds_that(ways: tuple[Way, ...]) -> list[str]:
    """The kinds some row of `ways` serves (video-to-video counts as a kind's capability, not a kind)."""
    return [k.name for k in KINDS.values() if any(w.applies(k, False) for w in ways)]


# -- the request ------------------------------------------------------------------------------------------------
@dataclass
class Source:
    frames: list[Any]  # PIL images
    data: bytes  # the video file (mp4 of a completed video, or the upload)
    job: Any = None  # the completed job, if it is one


def reference(fields: dict[str, Any], path_id: str | None = None) -> str | None:
    """The id of a completed video the request names: the path's (remix), `video` as {"id": ...} (JSON) or the form
    field `video[id]`; None where the request uploads one (or names none)."""
    if path_id is not None:
        return path_id
    if "video[id]" in fields:
        value = fields.pop("video[id]")
        if "video" in fields:
            raise ApiError(400, "give video (a file) or video[id] (a completed video's id), not both", "video")
        if not isinstance(value, str) or not value:
            raise ApiError(400, "video[id] must be a video id", "video")
        return value
    value = fields.pop("video", None)
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"id"} or not isinstance(value["id"], str) or not value["id"]:
        raise ApiError(400, 'video must be {"id": VIDEO_ID} (a completed video of yours) or a video file', "video")
    return value["id"]


def check_way(op: str, offer: Offer) -> Way:
    """How this bundle makes route `op`'s job ("remix", "edit", "extend"); a 400 naming the kinds that can where it
    cannot (before any other check: nothing else about the request matters then)."""
    if op == "extend":
        w = way(EXTENDS, offer)
        if w is None:
            raise ApiError(400, f"this bundle is {offer.kind.title}: it cannot extend a video (the kinds that extend: "
                                f"{', '.join(kinds_that(EXTENDS))})", "video")
        return w
    w = way(REMAKES, offer)
    if w is None:
        raise ApiError(400, f"this bundle is {offer.kind.title}: its videos cannot be remixed or edited (the kinds "
                            f"that can: {', '.join(kinds_that(REMAKES))}, and text-to-video with the VAE encoder)",
                       "video")
    return w


def check_fields(body: Body, op: str, offer: Offer) -> None:
    """400 for a field route `op` ("remix", "edit", "extend") does not take, or one this bundle does not; the prompt
    is required (its checks are the create request's)."""
    for name in body.fields:
        if name not in FIELDS_OF[op]:
            raise ApiError(400, f"unknown field {name!r}", name)
        f = BY_NAME[name]
        if name != "strength" and not f.offered(offer):
            raise ApiError(400, f.refusal(offer) if f.refusal else f"{name} is not taken by this bundle", name)
    if "prompt" not in body.fields:
        raise ApiError(400, "prompt is required (a non-empty string)", "prompt")


def offered(op: str, offer: Offer) -> list[str]:
    """The fields route `op` takes on this bundle, for its document: `strength` where its remakes noise the source."""
    remakes = way(REMAKES, offer)
    return [name for name in FIELDS_OF[op] if (BY_NAME[name].offered(offer) and name != "strength")
            or (name == "strength" and remakes is not None and remakes.noised)]


def load_source(store: Any, tenant: str, video_id: str | None, upload: bytes | None, param: str = "video") -> Source:
    """The source video: a completed video of `tenant` (404 for an unknown one or another tenant's, 409 for one not
    completed), or the uploaded file (400 if it is not a video)."""
    from .schema import read_video_bytes

    if video_id is not None:
        job = store.get(video_id, tenant)
        if job is None:
            raise ApiError(404, f"no video {video_id!r}", param)
        if job.status != "completed" or not job.video:
            raise ApiError(409, f"video {video_id} is {job.status}, not completed: a remix, edit or extension starts "
                                "from a completed video", param, code="video_not_ready")
        if job.params.get("task") == "image_edit":  # its content is a PNG (runtime/serve/images.py)
            raise ApiError(400, f"video {video_id} is an image edit, whose content is a PNG: edit the image again with "
                                "POST /v1/images/edits", param)
        if not store.storage.exists(job.video):
            raise ApiError(404, f"the file of video {video_id} is gone from the video storage", param)
        data = store.storage.read(job.video)
        return Source(read_video_bytes(data, "video"), data, job)
    if upload is None:
        raise ApiError(400, 'video is required: a video file, or {"id": VIDEO_ID} (in a form: video[id]) for a '
                            "completed video", param)
    return Source(check_video(param, upload), upload)


def _png(image: Any) -> bytes:
    out = io.BytesIO()
    image.convert("RGB").save(out, format="PNG")
    return out.getvalue()


def _inherited(source: Source, offer: Offer, given: dict[str, Any]) -> dict[str, Any]:
    """The source job's settings as request fields (where it has them), under those the request gives."""
    fields: dict[str, Any] = {}
    if source.job is not None:
        params = source.job.params
        for name in SETTINGS:
            f = BY_NAME[name]
            if f.param and params.get(f.param) is not None and f.offered(offer):
                fields[name] = params[f.param]
    if "num_inference_steps" in given:  # the request's step count replaces the source's sigmas, and the reverse
        fields.pop("sigmas", None)
    if "sigmas" in given:
        fields.pop("num_inference_steps", None)
    return {**fields, **given}


def fit(frames: int, offer: Offer, size: str) -> int:
    """The frames a remake of a `frames`-frame video makes at `size`: the most the bundle makes there that the video
    has (its first ones), or its shortest (the video's last frame repeated) where the video is shorter than all."""
    counts = sorted(set(offer.durations(size).values()))
    return max((n for n in counts if n <= frames), default=counts[0])


def fitted(source: list[Any], frames: int) -> list[Any]:
    """`source` cut, or its last frame repeated, to `frames` frames (`fit`)."""
    return source[:frames] + [source[-1]] * (frames - len(source))


def _seconds(offer: Offer, size: str, frames: int) -> str:
    """The duration the create request names a shape's `frames` by, at the bundle's frame rate; a 400 naming what the
    bundle makes if `size` has no shape of that many frames."""
    durations = offer.durations(size)
    for seconds, n in durations.items():
        if n == frames:
            return seconds
    made = " or ".join(f"{n} frames ({s} s)" for s, n in durations.items())
    raise ApiError(400, f"the video has {frames} frames; this bundle makes {made} at {size}: remake a video of one "
                        "of those lengths", "video")


def _size(source: Source, offer: Offer, fields: dict[str, Any], form: bool) -> str:
    """The derived video's size: the request's `size` (checked: a 400 names the sizes the bundle makes), else the
    source job's, else the source's frames' if the bundle makes it, else the bundle's default."""
    if "size" in fields:
        return BY_NAME["size"].check(fields["size"], offer, form)
    if source.job is not None and source.job.size in offer.sizes:
        return source.job.size
    w, h = source.frames[0].size
    return f"{w}x{h}" if f"{w}x{h}" in offer.sizes else offer.sizes[0]


def remake(body: Body, offer: Offer, source: Source) -> tuple[Body, list[tuple[str, bytes]], dict[str, Any]]:
    """A remix's or an edit's job: (its create request, the files it takes besides, params to add)."""
    w = check_way("edit", offer)
    if w.settings_only and source.job is None:
        raise ApiError(400, f"this bundle is {offer.kind.title} without a VAE encoder: it remakes only its own "
                            'completed videos (their seed and settings with the new prompt): pass {"id": VIDEO_ID}, or '
                            "export the bundle with the encoder (video-to-video) to edit uploads", "video")
    given = dict(body.fields)
    given_strength = "strength" in given
    strength = given.pop("strength", None)
    if given_strength and not w.noised:
        raise ApiError(400, f"strength is for remakes that noise the source video (bundles with a video VAE encoder); "
                            f"this bundle is {offer.kind.title}: it remakes from the source's seed and settings",
                       "strength")
    fields = _inherited(source, offer, given)
    size = _size(source, offer, fields, body.form)
    fields["size"] = size
    files: dict[str, list[bytes]] = {}
    extra: list[tuple[str, bytes]] = []
    params: dict[str, Any] = {}
    if w.noised:
        strength = BY_NAME["strength"].check(strength, offer, body.form) if given_strength else DEFAULT_STRENGTH
        params["strength"] = strength
        fields["seconds"] = _seconds(offer, size, fit(len(source.frames), offer, size))
        extra.append(("remake", source.data))
    elif source.job is not None:
        fields["seconds"] = _seconds(offer, size, int(source.job.params.get("frames") or len(source.frames)))
    if w.image and (source.job is None or w.noised or "image" in (source.job.params.get("media") or [])):
        files["input_reference"] = [_png(source.frames[0])]
        if offer.kind.last_image:
            files["last_image"] = [_png(source.frames[-1])]
    params["derive"] = {"op": "remake", "way": w.name}
    return Body(fields, files, body.form), extra, params


def extend(body: Body, offer: Offer, source: Source) -> tuple[Body, list[tuple[str, bytes]], dict[str, Any]]:
    """An extension's job: (its create request, the files it takes besides, params to add)."""
    w = check_way("extend", offer)
    given = dict(body.fields)
    if "seconds" not in given:
        raise ApiError(400, "seconds is required: the length of the new part, one of the durations GET /v1/models "
                            "lists", "seconds")
    fields = _inherited(source, offer, given)
    if w.name == "forcing":
        return _forcing_extension(body, offer, source, fields)
    if w.name == "helios":  # `seconds` of new chunks after the source's last whole ones (schema.parse_request's plan)
        fields["size"] = _size(source, offer, fields, body.form)
        window = max(n for size, n in offer.shapes if size == fields["size"])
        if len(source.frames) < window:
            raise ApiError(400, f"the video has {len(source.frames)} frames, fewer than one chunk of {window}: Helios "
                                "continues a video from its last whole chunks", "video")
        params = {"derive": {"op": "extend", "way": "helios", "overlap": 0}}
        return Body(fields, {}, body.form), [("source", source.data)], params
    fields.pop("conditioning_scale", None) if not offer.kind.vace else None
    size = _size(source, offer, fields, body.form)
    fields["size"] = size
    frames = offer.durations(size).get(fields["seconds"]) if isinstance(fields["seconds"], str) else None
    files: dict[str, list[bytes]] = {}
    if w.image == "last":
        files["input_reference"] = [_png(source.frames[-1])]
    overlap = min(w.overlap(frames), len(source.frames)) if frames is not None and w.overlap else 1
    if frames is not None and frames <= overlap:
        raise ApiError(400, f"seconds {fields['seconds']!r} is {frames} frames, no more than the {overlap} the new "
                            "part shares with the source: ask for a longer one", "seconds")
    params = {"derive": {"op": "extend", "way": w.name, "overlap": overlap}}
    return Body(fields, files, body.form), [("source", source.data)], params


def _forcing_extension(body: Body, offer: Offer, source: Source, fields: dict[str, Any]
                       ) -> tuple[Body, list[tuple[str, bytes]], dict[str, Any]]:
    """A diffusion forcing extension's job (as runtime.forcing.extend): `seconds` of new video after the source at
    the bundle's frame rate, so the run makes overlap_history + seconds x fps frames (4k + 1 up), its first
    overlap_history the source's end made again. The create request names that length by its duration; the segment
    plan (the source's length included) is checked by schema.parse_request (`source_frames`)."""
    from .. import forcing
    from .schema import SECONDS

    seconds = fields["seconds"]
    value = float(seconds) if isinstance(seconds, str) and re.fullmatch(SECONDS, seconds) else 0.0
    if not value > 0:
        raise ApiError(400, f"seconds {seconds!r} is not a duration: give the new part's length in seconds, such as "
                            '"5"', "seconds")
    overlap = BY_NAME["overlap_history"].check(fields["overlap_history"], offer, body.form) \
        if fields.get("overlap_history") is not None else forcing.DEFAULT_OVERLAP
    fps = offer.defaults.fps
    frames = forcing.frames_for(overlap / fps + value, fps)
    fields["seconds"] = f"{(frames - 1) / fps:.6f}"  # a duration schema._forcing_frames reads as `frames` again
    fields["size"] = _size(source, offer, fields, body.form)
    params = {"derive": {"op": "extend", "way": "forcing", "overlap": int(overlap)}}
    return Body(fields, {}, body.form), [("source", source.data)], params


def forcing_joined(params: dict[str, Any], source_frames: int, frames: np.ndarray) -> np.ndarray:
    """A diffusion forcing extension's video from what runtime.forcing returns (the source, then the run's frames,
    the first overlap_history of which re-make the source's last ones): the source, then the new frames."""
    shared = params["derive"]["overlap"]
    return np.concatenate([frames[:source_frames], frames[source_frames + shared:]], axis=0)


def forcing_live(params: dict[str, Any], source_frames: int, on_frames: Callable[[Any], None]
                 ) -> Callable[[Any], None]:
    """What runtime.forcing's `on_frames` gets for a diffusion forcing extension, passed on as `forcing_joined`
    keeps it: the frames it drops (those the run makes again after the source) never reach `on_frames`."""
    shared = params["derive"]["overlap"]
    seen = [0]

    def live(frames: Any) -> None:  # (B, f, H, W, 3)
        start = seen[0]
        seen[0] += frames.shape[1]
        keep = [i for i in range(frames.shape[1]) if not source_frames <= start + i < source_frames + shared]
        if keep:
            on_frames(frames[:, keep])

    return live


def finish(params: dict[str, Any], added: dict[str, Any], source: Source, extra: list[tuple[str, bytes]]) -> None:
    """The derived job's params: what `remake`/`extend` added, the source job's id, the files' roles after the
    create request's, and an extension's length (the source, then the new frames but those they share)."""
    params.update(added)
    params["media"] = [*params["media"], *(role for role, _ in extra)]
    if source.job is not None:
        params["remixed_from_video_id"] = source.job.id
    d = params["derive"]
    if d["op"] == "extend":
        params["seconds"] = seconds_of(len(source.frames) + params["frames"] - d["overlap"], params["fps"])


# -- the run (run.run_job) -------------------------------------------------------------------------------------
def sources(params: dict[str, Any], media: dict[str, Any]) -> dict[str, Any]:
    """A derived job's media as the run takes them: a VACE extension's control video and mask (the source's last
    frames kept, the rest generated), a remake's source under `remake`; an extension's source kept for `joined`."""
    d = params.get("derive")
    if not d or "source" not in media and "remake" not in media:
        return media
    if d["op"] == "extend":
        source = media.pop("source")
        media["_source"] = source
        if d["way"] == "vace":
            media["video"], media["mask"] = vace_extension(source, d["overlap"], params["frames"], params["size"])
    elif "remake" in media:
        media["remake"] = fitted(media["remake"], params["frames"])
    return media


def vace_extension(source: list[Any], overlap: int, frames: int, size: str) -> tuple[list[Any], list[Any]]:
    """VACE's control video and mask for an extension: the source's last `overlap` frames (at `size`), kept (mask
    black), then grey frames to generate (mask white), `frames` in all."""
    from PIL import Image

    width, height = (int(v) for v in size.split("x"))
    kept = [f.convert("RGB").resize((width, height), Image.BICUBIC) if f.size != (width, height) else f.convert("RGB")
            for f in source[-overlap:]]
    grey = Image.new("RGB", (width, height), (128, 128, 128))
    video = kept + [grey] * (frames - overlap)
    mask = [Image.new("L", (width, height), 0)] * overlap + [Image.new("L", (width, height), 255)] * (frames - overlap)
    return video, mask


def video_latents(pipe: Any, frames: list[Any], size: str, count: int) -> np.ndarray:
    """A remake's source as the run's `video_latents` (B, z, T, h, w): its VAE latents at the job's shape (no
    reference images), which the loop noises at the step `strength` picks."""
    from ..video_input import video_pixels

    g = pipe.shape(size, count, 0 if pipe.kind.reference_images else None)
    latents = pipe.encode_video(video_pixels(frames, g.width, g.height), g)
    return np.repeat(latents, g.batch, axis=0)


def joined(params: dict[str, Any], media: dict[str, Any], frames: np.ndarray) -> np.ndarray:
    """The video a job writes: an extension's source (at the new part's size), then the new frames after those they
    share; any other job's frames as they are. (F, H, W, 3) floats in [0, 1]."""
    source = media.pop("_source", None)
    d = params.get("derive") or {}
    if source is None or d.get("op") != "extend":
        return frames
    from PIL import Image

    h, w = frames.shape[1:3]
    first = np.stack([np.asarray((f if f.size == (w, h) else f.resize((w, h), Image.BICUBIC)).convert("RGB"))
                      for f in source]).astype(np.float32) / 255.0
    return np.concatenate([first, frames[d["overlap"]:]], axis=0)


def overlap_frames(way_name: str, frames: int) -> int:
    """The frames an extension of `frames` new frames shares with its source, by way (for documents and tests)."""
    w = next(w for w in EXTENDS if w.name == way_name)
    return w.overlap(frames) if w.overlap else 1

