"""`python -m runtime`: generate videos from a bundle, all at once or stage by stage.

    python -m runtime generate BUNDLE --prompt "a cat playing piano" --out cat.mp4
    python -m runtime generate BUNDLE --prompt "..." --size 720x1280 --frames 81 --out tall.mp4  # one of its shapes
    python -m runtime generate BUNDLE --prompt "..." --image first.png [--last-image last.png] --out clip.mp4
    python -m runtime encode  BUNDLE --prompt "..." [--image first.png] --out embeds.safetensors
    python -m runtime denoise BUNDLE --embeds embeds.safetensors --out latents.safetensors
    python -m runtime decode  BUNDLE --latents latents.safetensors --out video.mp4
    python -m runtime calibrate BUNDLE --prompt "..." --steps 50 --out ratios.json   # MagCache's ratios
    python -m runtime generate BUNDLE --prompt "..." --magcache ratios.json --out fast.mp4
    python -m runtime generate BUNDLE --prompt "..." --image me.png --pose-video p.mp4 --face-video f.mp4 --out a.mp4
    python -m runtime generate DF_BUNDLE --prompt "..." --frames 257 --overlap-history 17 --out long.mp4  # any length
    python -m runtime generate DF_BUNDLE --prompt "..." --video clip.mp4 --frames 97 --out longer.mp4  # extend a video
    python -m runtime generate BUNDLE --video source.mp4 --prompt "make it snow" --out edited.mp4   # Lucy Edit
    python -m runtime generate BUNDLE --image in.png --prompt "add a hat" --out edited.png   # ChronoEdit: the edit
    python -m runtime verify  BUNDLE     # check a bundle against its manifest and this machine
    python -m runtime inspect BUNDLE     # what it holds: stages, shapes, shardings, weight bytes
    python -m runtime warm    BUNDLE     # compile every program into the compilation cache
    python -m runtime fit     BUNDLE [--hbm GIB]   # a TPU bundle: compile it for its slice here, does it fit HBM?
    python -m runtime serve   BUNDLE [--port 8000] [--api-key KEY]   # the OpenAI videos API
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path


def _bundle_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("bundle", type=Path, help="bundle directory written by `python -m export`")


def _denoise_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=0, help="noise seed (jax.random; does not reproduce torch's)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the bundle's)")
    p.add_argument("--guidance", type=float, default=None,
                   help="classifier-free guidance scale; 1 or less runs the prompt alone (default: the bundle's)")
    p.add_argument("--guidance-2", type=float, default=None,
                   help="guidance of the second (low-noise) expert of a two-expert model (default: --guidance)")
    p.add_argument("--flow-shift", type=float, default=None, help="flow shift (default: the bundle's)")
    p.add_argument("--sampler", default=None, metavar="unipc|euler|dpm++|flowmap",
                   help="unipc (UniPCMultistepScheduler), euler (FlowMatchEulerDiscreteScheduler) or dpm++ "
                        "(DPMSolverMultistepScheduler, 2M): any of them on the same programs; a flow-map model "
                        "(AnyFlow) runs flowmap (FlowMapEulerDiscreteScheduler) or euler (the same update, r = t) "
                        "(default: the bundle's)")
    p.add_argument("--use-mean-velocity", type=_bool, default=None, metavar="true|false",
                   help="flow-map models (AnyFlow): tell the DiT the step's target timestep (true: sampler flowmap, "
                        "the default) or not (false: sampler euler, r = t), as AnyFlowPipeline's use_mean_velocity")
    p.add_argument("--sigmas", default=None, metavar="S1,S2,...",
                   help="custom noise levels, one per step, before the flow shift (e.g. lightx2v's 4 steps: "
                        "1,0.75,0.5,0.25); they set --steps (default: the bundle's, with its default steps)")


def _shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default=None, metavar="WxH",
                   help="video width x height, one of the bundle's shapes (default: its default shape's; "
                        "`inspect` lists them)")
    p.add_argument("--frames", type=int, default=None, help="video frames, one of the bundle's frame counts for "
                                                            "--size (default: the default shape's)")


def _magcache_args(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("MagCache (skip the transformer blocks on steps whose residual is predictable)")
    m.add_argument("--magcache", type=Path, default=None, metavar="RATIOS.json",
                   help="the model's magnitude ratios (from `python -m runtime calibrate`, or a JSON list)")
    m.add_argument("--magcache-threshold", type=float, default=0.06, metavar="T",
                   help="accumulated error allowed before a step runs in full (default 0.06)")
    m.add_argument("--magcache-max-skip", type=int, default=3, metavar="K",
                   help="most steps skipped in a row (default 3)")
    m.add_argument("--magcache-retention", type=float, default=0.2, metavar="R",
                   help="fraction of the first steps never skipped (default 0.2)")


def magcache_from_args(args: argparse.Namespace) -> object | None:
    """The runtime.MagCache the flags ask for, or None; a bad file or value is a UserError."""
    if args.magcache is None:
        return None
    from .magcache import MagCache, load_ratios

    return MagCache(load_ratios(args.magcache), threshold=args.magcache_threshold,
                    max_skip_steps=args.magcache_max_skip, retention_ratio=args.magcache_retention)


def _lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", action="append", default=[], metavar="ADAPTER[:SCALE]",
                   help="LoRA adapter from `python -m export lora`, merged at load (scale default 1; repeatable)")


def loras_from_args(args: argparse.Namespace) -> list[tuple[Path, float]]:
    from .lora import parse_spec

    return [parse_spec(text) for text in getattr(args, "lora", [])]


def _prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="what the video shows (not empty; longer than the bundle's token "
                                                   "limit, 512 by default, it is truncated with a warning)")
    p.add_argument("--negative-prompt", default="",
                   help="what to steer away from, through classifier-free guidance (default: none)")


def _image_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image", type=Path, default=None, help="first frame (image-to-video and TI2V bundles)")
    p.add_argument("--last-image", type=Path, default=None, help="last frame (first-last-frame bundles)")


def _video_args(p: argparse.ArgumentParser, inputs: bool = True, settings: bool = True) -> None:
    v = p.add_argument_group("video in (VACE bundles; video-to-video bundles take --video and --strength; Lucy Edit "
                             "bundles need --video, the video the prompt's instruction edits)")
    if inputs:
        v.add_argument("--video", type=Path, default=None,
                       help="control, source or (Lucy Edit) edited video: mp4, webm, gif or a folder of numbered "
                            "images; its frame count picks the shape's frames, its frames are resized to the shape's "
                            "size")
        v.add_argument("--mask", type=Path, default=None, help="VACE: mask video, white = generate, black = keep "
                                                               "(default: generate everything)")
        v.add_argument("--reference-image", type=Path, action="append", default=None, metavar="FILE",
                       help="VACE: a reference image (repeatable; the bundle serves the counts it was exported with)")
    if settings:
        v.add_argument("--conditioning-scale", type=float, default=None,
                       help="VACE: scale of the VACE branch's hints (default 1)")
        v.add_argument("--strength", type=float, default=None,
                       help="video-to-video: how much of the source video is replaced, in (0, 1] (default 0.8): "
                            "the steps after the first int(steps x (1 - strength)) run")


def _animate_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("Wan-Animate (animate bundles: --image is the character; the video has the pose video's "
                             "length, made in segments of the shape's frames)")
    a.add_argument("--pose-video", type=Path, default=None, help="the rendered pose video (skeletons) the character "
                                                                 "follows")
    a.add_argument("--face-video", type=Path, default=None,
                   help="the face crops, one per pose frame (resized to the model's face size, 512x512 for the 14B)")
    a.add_argument("--mode", choices=("animate", "replace"), default=None,
                   help="animate: the character moves as the pose video says (default); replace: the character takes "
                        "the place of the person in --background-video where --mask-video is white")
    a.add_argument("--background-video", type=Path, default=None, help="replace: the video without the person")
    a.add_argument("--mask-video", type=Path, default=None, help="replace: white where the character goes")
    a.add_argument("--prev-segment-frames", type=int, default=1, metavar="1|5",
                   help="frames each segment takes from the one before (default 1)")


def _forcing_args(p: argparse.ArgumentParser) -> None:
    f = p.add_argument_group("diffusion forcing (SkyReels-V2 DF bundles: --frames beyond the bundle's shape runs "
                             "segments of it; --image, --last-image, or --video to extend)")
    f.add_argument("--overlap-history", type=int, default=None, metavar="FRAMES",
                   help="frames each segment takes from the one before, and of --video (default 17)")
    f.add_argument("--ar-step", type=int, default=None, metavar="N",
                   help="the asynchronous mode: each causal block starts N steps after the one before (default 0: "
                        "synchronous); needs --causal-block-size")
    f.add_argument("--causal-block-size", type=int, default=None, metavar="FRAMES",
                   help="latent frames per causal block of block-causal attention (must divide every segment's "
                        "latent frames; default: none)")
    f.add_argument("--addnoise-condition", type=float, default=None, metavar="T",
                   help="re-noise the frames carried over to timestep T (diffusers recommends 20; default 0)")


def _bool(text: str) -> bool:
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return value


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 10,10,10)") from None


# Helios' own settings (runtime/helios.py SETTINGS), by diffusers' names: (flag type, metavar, help)
HELIOS_FLAGS = {
    "pyramid_num_inference_steps_list": (_int_list, "N,N,N", "a pyramid bundle's steps per stage (default: --steps "
                                                              "for each)"),
    "add_noise_to_image_latents": (_bool, "true|false", "lightly noise the image's latents first (default true)"),
    "image_noise_sigma_min": (float, "S", "that noise's least sigma (default 0.111)"),
    "image_noise_sigma_max": (float, "S", "its greatest (default 0.135)"),
    "add_noise_to_video_latents": (_bool, "true|false", "lightly noise the source video's latents (default true)"),
    "video_noise_sigma_min": (float, "S", "that noise's least sigma (default 0.111)"),
    "video_noise_sigma_max": (float, "S", "its greatest (default 0.135)"),
    "is_cfg_zero_star": (_bool, "true|false", "CFG-Zero* guidance (pyramid bundles; default the bundle's)"),
    "use_zero_init": (_bool, "true|false", "CFG-Zero*: the first steps predict zero (default true)"),
    "zero_steps": (int, "N", "CFG-Zero*: how many (default 1: steps 0 and 1)"),
    "is_amplify_first_chunk": (_bool, "true|false", "distilled bundles: the first chunk at twice the steps"),
    "is_skip_first_chunk": (_bool, "true|false", "the second chunk's first frame is the video's first frame"),
}


def _helios_args(p: argparse.ArgumentParser) -> None:
    h = p.add_argument_group("Helios (helios* bundles: --frames is the video's length, in chunks of the bundle's "
                             "shape; --image, or --video to continue)")
    for name, (kind, metavar, text) in HELIOS_FLAGS.items():
        h.add_argument("--" + name.replace("_", "-"), type=kind, default=None, metavar=metavar, help=text)


def helios_args(args: argparse.Namespace, kind: object) -> dict:
    """Helios' keywords of `generate`: the flags given (refused by other bundles' generate in one line); for a Helios
    bundle `--frames` is the video's length."""
    out = {n: getattr(args, n, None) for n in HELIOS_FLAGS if getattr(args, n, None) is not None}
    if getattr(kind, "helios", False):
        out.update(num_frames=getattr(args, "frames", None))
    return out


def forcing_args(args: argparse.Namespace, kind: object) -> dict:
    """The diffusion forcing keywords of `generate`: for a DF bundle, the flags and `--frames` as the video's length
    (`--fps` the frame rate the DiT is told too); for others, the flags given (refused by generate in one line)."""
    names = ("overlap_history", "ar_step", "causal_block_size", "addnoise_condition")
    out = {n: getattr(args, n, None) for n in names if getattr(args, n, None) is not None}
    if getattr(kind, "forcing", False):
        out.update(num_frames=getattr(args, "frames", None), fps=getattr(args, "fps", None))
    return out


def animate_args(args: argparse.Namespace) -> dict:
    """The Wan-Animate inputs the flags name, read and checked against each other (runtime/animate.py); {} if the
    flags name none."""
    names = ("pose_video", "face_video", "background_video", "mask_video")
    if all(getattr(args, n, None) is None for n in names) and getattr(args, "mode", None) is None:
        return {}
    from .animate import load_inputs

    mode = args.mode or "animate"
    videos = load_inputs(args.pose_video, args.face_video, mode, args.background_video, args.mask_video)
    return {"pose_video": videos.pose, "face_video": videos.face, "background_video": videos.background,
            "mask_video": videos.mask, "mode": mode, "prev_segment_frames": args.prev_segment_frames}


def video_args(args: argparse.Namespace) -> dict:
    """The video inputs the flags name, read (PIL frames), as generate/encode take them; {} if none."""
    from .images import load_image
    from .video_input import load_frames, load_mask

    out: dict = {}
    if getattr(args, "video", None) is not None:
        out["video"] = load_frames(args.video, "--video")
    if getattr(args, "mask", None) is not None:
        out["mask"] = load_mask(args.mask, "--mask")
    if getattr(args, "reference_image", None):
        out["reference_images"] = [load_image(p, f"--reference-image {p}") for p in args.reference_image]
    return out


def _chronoedit_args(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("ChronoEdit (image-editing bundles: --image is edited as the prompt says; --out x.png "
                             "writes the edited image, the short video's last frame)")
    c.add_argument("--temporal-reasoning-steps", type=int, default=None, metavar="K",
                   help="the first K steps reason over --frames frames (a frame count the bundle was exported with; "
                        "default its most), the rest edit on 2 latent frames; K < --steps, sampler unipc (default 0: "
                        "none)")


def chronoedit_args(args: argparse.Namespace) -> dict:
    """ChronoEdit's keyword of `generate`, if given (other bundles' generate refuses it in one line)."""
    k = getattr(args, "temporal_reasoning_steps", None)
    return {} if k is None else {"temporal_reasoning_steps": k}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="no progress bar or info logs")
    cache = common.add_argument_group("compilation cache (the second start of a bundle skips compiling)")
    cache.add_argument("--cache-dir", type=Path, default=None,
                       help="JAX compilation cache directory (default: $WAN_AOT_CACHE_DIR or ~/.cache/wan-aot/jax)")
    cache.add_argument("--no-cache", action="store_true", help="do not use the persistent compilation cache")
    multi = common.add_argument_group("multi-host (one process per host; process 0 writes the outputs)")
    multi.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordinator")
    multi.add_argument("--num-processes", type=int, help="processes in the job")
    multi.add_argument("--process-id", type=int, help="this process's index, 0 .. N-1")
    multi.add_argument("--distributed", action="store_true",
                       help="join a job described by the environment (TPU pods, SLURM, JAX_COORDINATOR_ADDRESS)")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", parents=[common], help="prompt -> mp4")
    _bundle_arg(g)
    _prompt_args(g)
    _image_args(g)
    _video_args(g)
    _animate_args(g)
    _forcing_args(g)
    _helios_args(g)
    _chronoedit_args(g)
    _shape_args(g)
    _denoise_args(g)
    _magcache_args(g)
    _lora_args(g)
    g.add_argument("--fps", type=int, default=None, help="frames per second of the video (default: the bundle's)")
    g.add_argument("--out", type=Path, required=True,
                   help="video path: .mp4, .mkv, .mov or .gif (batch > 1 writes NAME-<i>.mp4); .png: an "
                        "image-editing bundle's edited image (the last frame)")
    g.add_argument("--frames-out", type=Path, default=None, help="also save the float frames (safetensors)")
    g.add_argument("--decoder", choices=("full", "tiny"), default="full",
                   help="full: the VAE (default); tiny: the bundle's tiny decoder (export --tiny-decoder), faster")
    g.add_argument("--stream", type=Path, default=None, metavar="DIR",
                   help="also write the video as an HLS live stream in DIR while it is made: DIR/stream.m3u8 and "
                        "DIR/stream/<n>.ts, a segment as each part is decoded (`ffplay DIR/stream.m3u8` plays it)")

    e = sub.add_parser("encode", parents=[common], help="prompt -> embeddings (safetensors)")
    _bundle_arg(e)
    _prompt_args(e)
    _image_args(e)
    _video_args(e, settings=False)
    _shape_args(e)
    _lora_args(e)
    e.add_argument("--out", type=Path, required=True, help="embeddings (and image conditioning), safetensors")

    d = sub.add_parser("denoise", parents=[common], help="embeddings -> latents (safetensors)")
    _bundle_arg(d)
    d.add_argument("--embeds", type=Path, required=True, help="what `encode` wrote (incl. the image conditioning)")
    d.add_argument("--latents", type=Path, default=None, help="initial latents (key `latents`) instead of noise "
                                                              "(their shape picks the bundle's shape)")
    _shape_args(d)
    _denoise_args(d)
    _video_args(d, inputs=False)
    _magcache_args(d)
    _lora_args(d)
    d.add_argument("--out", type=Path, required=True, help="the denoised latents (safetensors, for `decode`)")

    cal = sub.add_parser("calibrate", parents=[common], help="MagCache's ratios for this bundle (every step run "
                                                              "in full) -> ratios.json")
    _bundle_arg(cal)
    _prompt_args(cal)
    _image_args(cal)
    _video_args(cal)
    _shape_args(cal)
    _denoise_args(cal)
    _lora_args(cal)
    cal.add_argument("--out", type=Path, required=True, help="ratios JSON (for --magcache)")

    v = sub.add_parser("decode", parents=[common], help="latents -> mp4")
    _bundle_arg(v)
    v.add_argument("--latents", type=Path, required=True, help="what `denoise` wrote")
    v.add_argument("--fps", type=int, default=None, help="frames per second of the video (default: the bundle's)")
    v.add_argument("--out", type=Path, required=True, help="video path: .mp4, .mkv, .mov or .gif")
    v.add_argument("--frames-out", type=Path, default=None, help="also save the float frames (safetensors)")
    v.add_argument("--decoder", choices=("full", "tiny"), default="full",
                   help="full: the VAE (default); tiny: the bundle's tiny decoder (export --tiny-decoder), faster")

    c = sub.add_parser("verify", parents=[common], help="check a bundle: schema, sha256, tensors, programs, "
                                                         "jax versions, devices")
    _bundle_arg(c)
    i = sub.add_parser("inspect", help="summarize a bundle: stages, shapes, shardings, weight bytes per device")
    _bundle_arg(i)
    i.add_argument("--json", action="store_true", help="print JSON instead of text")
    w = sub.add_parser("warm", parents=[common], help="compile every program into the compilation cache "
                                                       "(no weights loaded, nothing run)")
    _bundle_arg(w)
    f = sub.add_parser("fit", help="compile every program of a TPU bundle with XLA's TPU compiler here (libtpu; no TPU "
                                   "needed) and check its per-device peak against the chips' HBM")
    _bundle_arg(f)
    f.add_argument("--hbm", type=float, default=None, metavar="GIB",
                   help="HBM per chip to fit in, e.g. less than the chip's to leave headroom (default: the chip's: "
                        "v4 32, v5e 16, v5p 95, v6e 32)")
    f.add_argument("--mode", choices=("serve", "generate"), default="serve",
                   help="how the runtime will hold the bundle: serve (a server or the Python API: every stage "
                        "resident) or generate (one `runtime generate`: each stage's weights dropped after it) "
                        "(default: serve)")
    f.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    f.add_argument("--record", action="store_true",
                   help="also write the report into the bundle (fit.json), which `inspect` and `verify` show")
    f.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    s = sub.add_parser("serve", parents=[common], help="serve the OpenAI videos API (POST /v1/videos ...) "
                                                       "with a durable job queue")
    _bundle_arg(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    s.add_argument("--api-key", default=os.environ.get("WAN_AOT_API_KEY"),
                   help="clients must send Authorization: Bearer KEY (default: $WAN_AOT_API_KEY); the tenant `default`")
    s.add_argument("--api-keys", type=Path, metavar="FILE",
                   help="tenants: one `KEY NAME` a line; each tenant sees only its own videos, the queue takes turns "
                        "between them; read again on SIGHUP")
    s.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a Host name requests may use besides the address listened on (repeatable; `*`: any), e.g. "
                        "a reverse proxy's public name; pages of that name may POST too")
    s.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key")
    s.add_argument("--no-ui", action="store_true", help="no playground page at GET / (the API only)")
    s.add_argument("--jobs-dir", type=Path, default=Path("jobs"),
                   help="where jobs (SQLite) and videos live; survives restarts (default ./jobs)")
    s.add_argument("--queue-size", type=int, default=16, help="jobs that may wait (in the shared queue); more get 429 "
                                                              "(default 16)")
    s.add_argument("--max-steps", type=int, default=1000, metavar="N",
                   help="the most denoising steps a job may ask for, up to 1000; more get 400 (default 1000)")
    s.add_argument("--max-seconds", type=float, default=60.0, metavar="SECONDS",
                   help="diffusion forcing bundles: the longest video a job may ask for (`seconds`); longer get 400 "
                        "(default 60)")
    s.add_argument("--max-sync-seconds", type=float, default=600.0, metavar="SECONDS",
                   help="image-editing bundles (ChronoEdit): how long POST /v1/images/edits waits for its job (the "
                        "queue, then the edit) before it answers 504 and cancels the job (default 600, the openai "
                        "SDK's own timeout)")
    s.add_argument("--tenant-queue-size", type=int, default=None, metavar="N",
                   help="jobs one tenant may have waiting; more get 429 (default: --queue-size)")
    from .serve.limits import Limits

    lim = s.add_argument_group("limits (what one client may hold: see runtime/serve/README.md, \"Limits\")")
    d = Limits()
    lim.add_argument("--header-timeout", type=float, default=d.header_timeout, metavar="SECONDS",
                     help=f"a request's head must arrive within this; else 408 (default {d.header_timeout:g})")
    lim.add_argument("--body-timeout", type=float, default=d.body_timeout, metavar="SECONDS",
                     help=f"a request's body must arrive within this of its head; else 408 (default "
                          f"{d.body_timeout:g})")
    lim.add_argument("--keep-alive", type=float, default=d.keep_alive, metavar="SECONDS",
                     help=f"an idle connection is closed after this (default {d.keep_alive:g})")
    lim.add_argument("--max-connections", type=int, default=d.max_connections, metavar="N",
                     help=f"connections open at once; a request on one more gets 503 (default {d.max_connections})")
    lim.add_argument("--max-uploads", type=int, default=d.max_uploads, metavar="N",
                     help=f"create requests reading and checking their body at once; more get 503 (default "
                          f"{d.max_uploads})")
    lim.add_argument("--max-decodes", type=int, default=d.max_decodes, metavar="N",
                     help=f"requests decoding their images or video at once; more wait (default {d.max_decodes})")
    lim.add_argument("--max-body-mb", type=float, default=None, metavar="MB",
                     help="the largest request body; more get 413 (default 32, or 256 for a bundle that takes videos)")
    r = s.add_argument_group("replicas (several servers, one queue: see runtime/serve/README.md, \"Many replicas\")")
    r.add_argument("--queue", metavar="URL", default=None,
                   help="the job database every replica shares: postgresql://USER:PASSWORD@HOST:PORT/DB (needs the "
                        "postgres extra); default: SQLite under --jobs-dir, one server")
    r.add_argument("--videos-url", metavar="URL", default=None,
                   help="keep videos and uploaded images in an object store (s3://bucket/prefix, gs://...; the "
                        "objectstore extra) instead of --jobs-dir, which replicas must otherwise share")
    r.add_argument("--queue-wait", type=float, default=120.0, metavar="SECONDS",
                   help="how long to wait for a --queue database that cannot be reached at start-up (restarting, not "
                        "up yet), saying so every 10 s, before giving up with status 2 (default 120)")
    r.add_argument("--store-retry-seconds", type=float, default=300.0, metavar="SECONDS",
                   help="how long a job's writes to a --videos-url store that fails (5xx, unreachable) are retried, "
                        "with backoff, before the job fails with storage_unavailable (default 300)")
    r.add_argument("--lease", type=float, default=60.0, metavar="SECONDS",
                   help="a running job whose heartbeat is older than this is taken over by another replica "
                        "(default 60)")
    r.add_argument("--stall", type=float, default=600.0, metavar="SECONDS",
                   help="a job with no denoising step or stage finished for this long stops being heartbeated and "
                        "the server exits with status 3 for its supervisor to restart it (default 600)")
    wh = s.add_argument_group("webhooks (see runtime/serve/README.md, \"Webhooks\")")
    wh.add_argument("--webhook-url", metavar="URL", default=None,
                    help="the server's own webhook endpoint: every tenant's video.completed and video.failed events "
                         "are POSTed to it, signed with --webhook-secret (Standard Webhooks)")
    wh.add_argument("--webhook-secret", metavar="whsec_...", default=os.environ.get("WAN_AOT_WEBHOOK_SECRET"),
                    help="the secret --webhook-url's deliveries are signed with (default: $WAN_AOT_WEBHOOK_SECRET)")
    wh.add_argument("--webhook-allow", metavar="HOST[,HOST]", action="append", default=[],
                    help="hosts, addresses or networks (CIDR) webhooks may reach although private, loopback or "
                         "link-local (refused otherwise; repeatable)")
    wh.add_argument("--webhook-retry-for", type=float, default=86400.0, metavar="SECONDS",
                    help="how long after an event its delivery is retried (on backoff: 1, 2, 4 s ... at most an hour "
                         "apart) before it is given up (default 86400)")
    _magcache_args(s)  # the server's default for every job
    _lora_args(s)
    lo = s.add_argument_group("LoRA adapters per request (see runtime/serve/README.md, \"LoRA adapters\")")
    lo.add_argument("--lora-dir", type=Path, metavar="DIR",
                    help="offer the adapters in DIR (made by `python -m export lora ... --bundle BUNDLE`), by file "
                         "name without .safetensors: a request's `lora` names them, and the replica switches its "
                         "weights between jobs; each is checked against the bundle at start (--lora adapters apply "
                         "to every job, before these)")
    lo.add_argument("--max-loras", type=int, default=4, metavar="N",
                    help="the most adapters one request may name (default 4)")
    lo.add_argument("--lora-affinity-max", type=int, default=4, metavar="N",
                    help="a replica takes a queued job of the LoRA set it holds before others, but no job waits for "
                         "more than N others because of it (default 4; 0: strictly in turn)")
    return p


def run(args: argparse.Namespace) -> int:
    if args.command == "inspect":
        return inspect(args)
    if args.command == "fit":
        return fit(args)
    from . import cache, distributed
    from . import intermediates as im
    from .files import check_writable
    from .pipeline import load

    distributed.initialize(args.coordinator, args.num_processes, args.process_id, auto=args.distributed)
    if not args.no_cache:
        cache.enable(args.cache_dir)
    if args.command == "verify":
        return verify(args)
    if args.command == "warm":
        return warm(args)
    if args.command == "serve":
        return serve(args)
    from .video import check_fps, check_video_path, write_videos

    if getattr(args, "prompt", None) is not None:  # an empty prompt fails before the bundle is read
        from .text import check_prompt

        check_prompt(args.prompt)
    primary = distributed.is_primary()
    magcache = magcache_from_args(args) if hasattr(args, "magcache") else None  # a bad file fails first
    if hasattr(args, "sigmas"):  # bad sigmas or a bad sampler name fail before the bundle is loaded
        from .samplers import check_sampler, check_sigmas, parse_sigmas

        args.sigmas = parse_sigmas(args.sigmas)
        if args.sigmas is not None:
            check_sigmas(args.sigmas, args.steps)
        if args.sampler is not None:
            check_sampler(args.sampler)
    for out in (args.out, getattr(args, "frames_out", None)):
        if out is not None and primary:
            check_writable(out)
    stream = None
    if getattr(args, "stream", None) is not None and primary:  # a bad directory fails before any work
        from .hls import directory_sink

        stream = directory_sink(args.stream)
    from .chronoedit import is_image_path

    if args.command in ("generate", "decode"):
        if not (args.command == "generate" and is_image_path(args.out)):  # an edit's image: by kind, once loaded
            check_video_path(args.out)
        if args.fps is not None:
            check_fps(args.fps)
    for name in ("image", "last_image"):  # unreadable images fail before the bundle is loaded
        if getattr(args, name, None) is not None:
            from .images import load_image

            setattr(args, name, load_image(getattr(args, name), "--" + name.replace("_", "-")))
    videos = video_args(args)  # unreadable videos fail before the bundle is loaded
    animated = animate_args(args)
    pipe = load(args.bundle, loras=loras_from_args(args))
    if args.command == "generate":  # a .png out is an image-editing bundle's edit: others refuse it now
        from .chronoedit import check_out

        check_out(pipe.kind, args.out)
    if getattr(args, "use_mean_velocity", None) is not None:  # AnyFlow's switch is a sampler: checked before any work
        from .samplers import mean_velocity_sampler

        args.sampler = mean_velocity_sampler(args.use_mean_velocity, args.sampler, pipe.kind.flow_map)
    if pipe.kind.animate and args.command in ("denoise", "calibrate"):
        from .errors import UserError

        raise UserError(f"Wan-Animate bundles run in segments, each of its own steps: use `generate` (with "
                        f"--pose-video and --face-video), not `{args.command}`")
    if pipe.kind.any_length and args.command in ("encode", "denoise", "calibrate"):
        from .errors import UserError

        what = "diffusion forcing bundles run in segments of per-frame steps" if pipe.kind.forcing else \
            "Helios bundles run in chunks, each on the ones before"
        raise UserError(f"{what}: use `generate` (--frames for the length), not `{args.command}`")
    g = pipe.geometry
    shape = {"size": getattr(args, "size", None), "frames": getattr(args, "frames", None)}
    forced = {**forcing_args(args, pipe.kind), **helios_args(args, pipe.kind), **chronoedit_args(args)} \
        if args.command == "generate" else {}
    if pipe.kind.any_length and args.command == "generate":  # --frames is the video's length: forcing/helios plan it
        shape["frames"] = None
    elif args.command != "decode":  # a shape the bundle lacks fails before any work
        from . import kinds

        if hasattr(args, "video"):  # the commands that read the inputs (denoise takes them encoded)
            kinds.check_videos(pipe.kind, pipe.manifest.video_to_video, videos.get("video"), videos.get("mask"),
                               videos.get("reference_images"))
        pipe.shape_for_videos(shape["size"], shape["frames"], videos.get("video"), videos.get("reference_images"))
    latent_shapes = [s.latent_shape for s in pipe.manifest.shapes]
    log = logging.getLogger("runtime")
    progress = not args.quiet
    if args.command in ("generate", "decode"):
        if args.command == "generate":
            live, writer = {}, None
            if stream is not None:  # process 0 writes it, as the video
                from .hls import HlsWriter

                writer = HlsWriter(stream, pipe.manifest.defaults.fps if args.fps is None else args.fps)
                live["on_frames"] = writer.add
            try:
                frames = pipe.generate(args.prompt, args.negative_prompt, image=args.image,
                                       last_image=args.last_image, seed=args.seed, steps=args.steps,
                                       guidance=args.guidance, guidance_2=args.guidance_2, flow_shift=args.flow_shift,
                                       progress=progress, magcache=magcache, low_memory=True, sampler=args.sampler,
                                       sigmas=args.sigmas, **videos, conditioning_scale=args.conditioning_scale,
                                       strength=args.strength, **animated, **forced, **shape, decoder=args.decoder,
                                       **live)  # one video per process
            finally:
                if writer is not None:
                    writer.end()  # a failed run's stream ends where it stopped
                    log.info("streamed %s", args.stream / "stream.m3u8")
        else:
            video_shapes = [s.video_latent_shape for s in pipe.manifest.shapes]  # what denoise writes
            latents = im.load(args.latents, im.LATENTS, pipe.bundle_id, {"latents": video_shapes})[0]["latents"]
            frames = pipe.decode(latents, args.decoder)
        if not primary:
            return
        if args.frames_out is not None:
            im.save(args.frames_out, im.FRAMES, {"frames": frames}, pipe.bundle_id, {})
            log.info("wrote %s", args.frames_out)
        fps = pipe.manifest.defaults.fps if args.fps is None else args.fps
        from .chronoedit import write_images

        for path in write_images(frames, args.out) if is_image_path(args.out) else write_videos(frames, args.out, fps):
            log.info("wrote %s", path)
    elif args.command == "encode":
        embeds = pipe.encode(args.prompt, args.negative_prompt, image=args.image, last_image=args.last_image,
                             **videos, **shape)
        if primary:
            im.save(args.out, im.EMBEDS, embeds, pipe.bundle_id, {"prompt": args.prompt,
                                                                  "negative_prompt": args.negative_prompt,
                                                                  "image": args.image is not None,
                                                                  "last_image": args.last_image is not None})
            log.info("wrote %s", args.out)
    elif args.command == "denoise":
        s = pipe.settings(args.seed, args.steps, args.guidance, args.flow_shift, args.guidance_2, args.sampler,
                          args.sigmas)
        embeds, _ = im.load(args.embeds, im.EMBEDS, pipe.bundle_id,
                            {"prompt_embeds": g.embeds_shape, "negative_prompt_embeds": g.embeds_shape})
        init = None
        if args.latents is not None:
            init = im.load(args.latents, im.LATENTS, pipe.bundle_id, {"latents": latent_shapes})[0]["latents"]
        latents = pipe.denoise(embeds, s.seed, s.steps, s.guidance, s.flow_shift, latents=init, progress=progress,
                               guidance_2=s.guidance_2, magcache=magcache, sampler=s.sampler, sigmas=s.sigmas,
                               conditioning_scale=args.conditioning_scale, strength=args.strength, **shape)
        if primary:
            meta = {**s.to_json(), **({"magcache": magcache.to_json()} if magcache else {})}
            im.save(args.out, im.LATENTS, {"latents": latents}, pipe.bundle_id, meta)
            log.info("wrote %s", args.out)
    elif args.command == "calibrate":
        s = pipe.settings(args.seed, args.steps, args.guidance, args.flow_shift, args.guidance_2, args.sampler,
                          args.sigmas)
        embeds = pipe.encode(args.prompt, args.negative_prompt, image=args.image, last_image=args.last_image,
                             **videos, **shape)
        ratios = pipe.calibrate(embeds, s.seed, s.steps, s.guidance, s.flow_shift, progress=progress,
                                guidance_2=s.guidance_2, sampler=s.sampler, sigmas=s.sigmas,
                                conditioning_scale=args.conditioning_scale, **shape)
        if primary:
            from .files import atomic_path

            record = {"mag_ratios": ratios, "bundle_id": pipe.bundle_id, "prompt": args.prompt, **s.to_json()}
            with atomic_path(args.out) as tmp:
                tmp.write_text(json.dumps(record, indent=1) + "\n")
            log.info("wrote %s (%d ratios)", args.out, len(ratios))
    return 0


def verify(args: argparse.Namespace) -> int:
    from .verify import FAIL, verify

    checks = verify(args.bundle)
    for c in checks:
        print(f"{c.status:<5} {c.message}")
    failed = [c for c in checks if c.status == FAIL]
    if failed:
        print(f"error: {args.bundle}: {len(failed)} check(s) failed", file=sys.stderr)
        return 2
    print(f"{args.bundle} is ready to run on this machine")
    return 0


def inspect(args: argparse.Namespace) -> int:
    import json

    from . import manifest as mf
    from .summary import format_text, summarize

    s = summarize(args.bundle, mf.read(args.bundle))
    print(json.dumps(s, indent=1) if args.json else format_text(s))
    return 0


def fit(args: argparse.Namespace) -> int:
    """Exit 0: the bundle fits; 1: it does not (one line says where and what would help); 2: bad input."""
    from . import fit as fitting

    fitting.check_libtpu()  # before anything is read or compiled (no compilation cache: see fit.fit)
    log = logging.getLogger("runtime")

    def progress(c: fitting.Compiled) -> None:
        log.info("compiled %s in %.1f s", c.key, c.compile_s)

    try:
        report = fitting.fit(args.bundle, args.hbm, args.mode, on_compiled=progress)
        print(json.dumps(report.to_json(), indent=1) if args.json else fitting.format_text(report))
        if args.record:
            from . import manifest as mf

            log.info("wrote %s", fitting.record(report, mf.read(args.bundle).bundle_id))
        fitting.check(report)
    except fitting.DoesNotFit as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def warm(args: argparse.Namespace) -> int:
    import time

    from .bundle import open_bundle

    bundle = open_bundle(args.bundle)
    log = logging.getLogger("runtime")
    for name, spec in bundle.manifest.programs.items():
        t = time.perf_counter()
        for part in spec.parts:  # a block loop's head, blocks (one per prompt length) and tail
            bundle.compile(name, part)
        log.info("compiled %s in %.1f s", name, time.perf_counter() - t)
    from .pipeline import Pipeline

    pipe = Pipeline(bundle)
    for g in bundle.manifest.shapes:  # the noise sampler is a small jax program of its own, one per shape
        pipe.initial_latents(0, g)
    import jax

    where = jax.config.jax_compilation_cache_dir
    print(f"compiled {len(bundle.manifest.programs)} programs" + (f" into {where}" if where else " (no cache)"))
    return 0


def serve(args: argparse.Namespace) -> int:
    import ipaddress

    from . import distributed
    from .errors import UserError
    from .pipeline import load
    from .serve import follower as mh
    from .serve.access import server_names
    from .serve.limits import Limits
    from .serve.server import serve as run_server
    from .serve.state import Settings
    from .serve.tenants import Keys

    if not 1 <= args.port <= 65535:
        raise UserError(f"--port {args.port} must be in 1..65535")
    if args.queue_size < 1:
        raise UserError(f"--queue-size {args.queue_size} must be >= 1")
    if args.tenant_queue_size is not None and args.tenant_queue_size < 1:
        raise UserError(f"--tenant-queue-size {args.tenant_queue_size} must be >= 1")
    for name in ("max_connections", "max_uploads", "max_decodes"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if not 1 <= args.max_steps <= 1000:
        raise UserError(f"--max-steps {args.max_steps} must be in 1..1000")
    if not 0 < args.max_seconds <= 3600:
        raise UserError(f"--max-seconds {args.max_seconds} must be a number of seconds in (0, 3600]")
    if not 0 < args.max_sync_seconds <= 86400:
        raise UserError(f"--max-sync-seconds {args.max_sync_seconds:g} must be a number of seconds in (0, 86400]: "
                        "how long an image edit's request waits for its job")
    for name in ("lease", "stall", "header_timeout", "body_timeout", "keep_alive", "max_body_mb"):
        value = getattr(args, name)
        if value is None:  # --max-body-mb left out: the bundle's
            continue
        if not (value > 0 and value < float("inf")):
            unit = "megabytes" if name == "max_body_mb" else "seconds"
            raise UserError(f"--{name.replace('_', '-')} {value} must be a number of {unit} > 0")
    if args.max_loras < 1:
        raise UserError(f"--max-loras {args.max_loras} must be >= 1")
    if args.lora_affinity_max < 0:
        raise UserError(f"--lora-affinity-max {args.lora_affinity_max} must be >= 0")
    offered = {}
    if args.lora_dir is not None:  # every adapter checked against the bundle: a misfit names its file, exit 2
        from . import manifest as mf
        from .adapters import scan

        offered = scan(args.lora_dir, mf.read(args.bundle))
    # a bad key or file: one line, before anything starts
    keys = Keys.load(args.api_keys, args.api_key or None, frozenset(offered) if args.lora_dir is not None else None)
    from .serve.webhooks import Config as WebhookConfig

    webhooks = WebhookConfig.of(args.webhook_url, args.webhook_secret if args.webhook_url else None,
                                args.webhook_allow, args.webhook_retry_for)
    try:
        loopback = args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = False
    for flag, value in (("--queue-wait", args.queue_wait), ("--store-retry-seconds", args.store_retry_seconds)):
        if not value >= 0:
            raise UserError(f"{flag} {value:g}: give a number of seconds, 0 or more")
    if not loopback and keys is None and not args.insecure:
        raise UserError(f"--host {args.host} is reachable from other machines: set --api-key (or WAN_AOT_API_KEY) or "
                        "--api-keys FILE, or pass --insecure to serve without one")
    if not distributed.is_primary():  # processes 1..N-1 run process 0's jobs
        pipe = load(args.bundle, loras=loras_from_args(args), lora_dir=args.lora_dir)
        pipe.prepare(magcache=args.magcache is not None)
        return mh.follow(pipe)
    import jax

    multi = jax.process_count() > 1
    limits = Limits(header_timeout=args.header_timeout, body_timeout=args.body_timeout, keep_alive=args.keep_alive,
                    max_connections=args.max_connections, max_uploads=args.max_uploads, max_decodes=args.max_decodes,
                    max_body_bytes=None if args.max_body_mb is None else int(args.max_body_mb * (1 << 20)))
    settings = Settings(bundle=args.bundle, keys=keys, jobs_dir=args.jobs_dir, queue_size=args.queue_size,
                        tenant_queue_size=args.tenant_queue_size, magcache=magcache_from_args(args), queue=args.queue,
                        videos_url=args.videos_url, lease=args.lease, stall=args.stall, ui=not args.no_ui,
                        queue_wait=args.queue_wait, store_retry=args.store_retry_seconds,
                        max_steps=args.max_steps, max_seconds=args.max_seconds,
                        max_sync_seconds=args.max_sync_seconds,
                        names=server_names(args.host, args.allowed_host), limits=limits, webhooks=webhooks,
                        loras=tuple(offered.values()), max_loras=args.max_loras,
                        lora_affinity_max=args.lora_affinity_max)
    loras = loras_from_args(args)
    if loras:  # a bad adapter fails the command, before the server starts
        from . import lora
        from . import manifest as mf

        lora.read_all(loras, mf.read(args.bundle))
    return run_server(settings, args.host, args.port,
                      loader=lambda: load(args.bundle, loras=loras, lora_dir=args.lora_dir),
                      broadcast=mh.send if multi else None,
                      on_exit=(lambda: mh.send({"stop": True})) if multi else None)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("runtime").setLevel(logging.WARNING if getattr(args, "quiet", False) else logging.INFO)
    from .errors import UserError
    from .extras import missing

    try:
        return run(args)
    except ModuleNotFoundError as e:  # an optional extra not installed (fastapi for serve, ...): say which
        error = missing(e, f"python -m runtime {args.command}")
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
