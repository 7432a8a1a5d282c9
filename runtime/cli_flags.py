"""`python -m runtime`'s flags: the parser of every command. The loops' own flags (Wan-Animate's, diffusion forcing's,
Helios', ChronoEdit's, video-to-video's and VACE's settings) are made from runtime/loop_settings.py's table, and
`serve`'s defaults are read from the server's Settings and the modules' constants, not typed here again.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from . import loop_settings
from .magcache import MagCache


def defaults(cls: type) -> dict[str, Any]:
    """A dataclass's field defaults, by name (those without one left out): the flags' defaults are the settings'."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

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
    p.add_argument("--use-mean-velocity", type=loop_settings.parse_bool, default=None, metavar="true|false",
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
    d = defaults(MagCache)
    m.add_argument("--magcache", type=Path, default=None, metavar="RATIOS.json",
                   help="the model's magnitude ratios (from `python -m runtime calibrate`, or a JSON list)")
    m.add_argument("--magcache-threshold", type=float, default=d['threshold'], metavar="T",
                   help=f"accumulated error allowed before a step runs in full (default {d['threshold']:g})")
    m.add_argument("--magcache-max-skip", type=int, default=d['max_skip_steps'], metavar="K",
                   help=f"most steps skipped in a row (default {d['max_skip_steps']})")
    m.add_argument("--magcache-retention", type=float, default=d['retention_ratio'], metavar="R",
                   help=f"fraction of the first steps never skipped (default {d['retention_ratio']:g})")


def _lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", action="append", default=[], metavar="ADAPTER[:SCALE]",
                   help="LoRA adapter from `python -m export lora`, merged at load (scale default 1; repeatable)")



def _prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="what the video shows (not empty; longer than the bundle's token "
                                                   "limit, 512 by default, it is truncated with a warning)")
    p.add_argument("--negative-prompt", default="",
                   help="what to steer away from, through classifier-free guidance (default: none)")


def _image_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image", type=Path, default=None, help="first frame (image-to-video and TI2V bundles)")
    p.add_argument("--last-image", type=Path, default=None, help="last frame (first-last-frame bundles)")




def _video_args(p: argparse.ArgumentParser, inputs: bool = True, settings: bool = True) -> None:
    v = p.add_argument_group(loop_settings.GROUPS["video"])
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
        loop_settings.add_flags(p, "video", into=v)


def _loop_args(p: argparse.ArgumentParser) -> None:
    """Each loop's own flags, a group each (runtime/loop_settings.py)."""
    for group in ("animate", "animate-2", "forcing", "helios", "chronoedit"):
        loop_settings.add_flags(p, group)


class _OneLineParser(argparse.ArgumentParser):
    """A command's parser whose missing required arguments are named in one line (exit 2), as every other bad input
    is, rather than after the command's whole usage."""

    def error(self, message: str) -> Any:
        missing = "the following arguments are required: "
        if message.startswith(missing):
            names = message[len(missing):].split(", ")
            listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
            self.exit(2, f"error: {listed} {'is' if len(names) == 1 else 'are'} required\n")
        return super().error(message)


def parser(description: str, serve_flags: bool = True) -> argparse.ArgumentParser:
    """Every command's flags; `description`: the usage examples `--help` shows first. `serve_flags` False leaves
    `serve`'s out (their defaults are the server's Settings, whose module imports the web framework: a command other
    than `serve` need not)."""
    p = argparse.ArgumentParser(prog="python -m runtime", description=description,
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
    sub = p.add_subparsers(dest="command", required=True, parser_class=_OneLineParser)

    g = sub.add_parser("generate", parents=[common], help="prompt -> mp4")
    _bundle_arg(g)
    _prompt_args(g)
    _image_args(g)
    _video_args(g)
    _loop_args(g)
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
    if serve_flags:
        _serve_args(s)
    return p


def _serve_defaults() -> Any:
    """The server's settings when no flag changes them (runtime/serve/state.py's Settings), or None where the serve
    extra is not installed."""
    from pathlib import Path as _Path

    try:
        from .serve.state import Settings
    except ModuleNotFoundError:  # `serve` will say which extra is missing, in one line, when it is run
        return None
    return Settings(bundle=_Path("."))


def _serve_args(s: argparse.ArgumentParser) -> None:
    """`serve`'s flags, each defaulting to the server's own setting."""
    d = _serve_defaults()
    if d is None:  # without the serve extra: whatever follows is left for `serve` to refuse in one line
        s.add_argument("serve_args", nargs=argparse.REMAINDER,
                       help="the server's flags (this install lacks the serve extra: pip install 'wan-aot[serve]')")
        return
    from .serve.fields import MAX_BODY_BYTES, MAX_STEPS, MAX_VIDEO_BODY_BYTES

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
    s.add_argument("--jobs-dir", type=Path, default=d.jobs_dir,
                   help=f"where jobs (SQLite) and videos live; survives restarts (default ./{d.jobs_dir})")
    s.add_argument("--queue-size", type=int, default=d.queue_size,
                   help=f"jobs that may wait (in the shared queue); more get 429 (default {d.queue_size})")
    s.add_argument("--max-steps", type=int, default=d.max_steps, metavar="N",
                   help=f"the most denoising steps a job may ask for, up to {MAX_STEPS}; more get 400 (default "
                        f"{d.max_steps})")
    s.add_argument("--max-seconds", type=float, default=d.max_seconds, metavar="SECONDS",
                   help="diffusion forcing bundles: the longest video a job may ask for (`seconds`); longer get 400 "
                        f"(default {d.max_seconds:g})")
    s.add_argument("--max-sync-seconds", type=float, default=d.max_sync_seconds, metavar="SECONDS",
                   help="image-editing bundles (ChronoEdit): how long POST /v1/images/edits waits for its job (the "
                        "queue, then the edit) before it answers 504 and cancels the job (default "
                        f"{d.max_sync_seconds:g}, the openai "
                        "SDK's own timeout)")
    s.add_argument("--tenant-queue-size", type=int, default=None, metavar="N",
                   help="jobs one tenant may have waiting; more get 429 (default: --queue-size)")
    lim = s.add_argument_group("limits (what one client may hold: see runtime/serve/README.md, \"Limits\")")
    limits = d.limits
    lim.add_argument("--header-timeout", type=float, default=limits.header_timeout, metavar="SECONDS",
                     help=f"a request's head must arrive within this; else 408 (default {limits.header_timeout:g})")
    lim.add_argument("--body-timeout", type=float, default=limits.body_timeout, metavar="SECONDS",
                     help=f"a request's body must arrive within this of its head; else 408 (default "
                          f"{limits.body_timeout:g})")
    lim.add_argument("--keep-alive", type=float, default=limits.keep_alive, metavar="SECONDS",
                     help=f"an idle connection is closed after this (default {limits.keep_alive:g})")
    lim.add_argument("--max-connections", type=int, default=limits.max_connections, metavar="N",
                     help=f"connections open at once; a request on one more gets 503 (default "
                          f"{limits.max_connections})")
    lim.add_argument("--max-uploads", type=int, default=limits.max_uploads, metavar="N",
                     help=f"create requests reading and checking their body at once; more get 503 (default "
                          f"{limits.max_uploads})")
    lim.add_argument("--max-decodes", type=int, default=limits.max_decodes, metavar="N",
                     help=f"requests decoding their images or video at once; more wait (default {limits.max_decodes})")
    lim.add_argument("--max-body-mb", type=float, default=None, metavar="MB",
                     help=f"the largest request body; more get 413 (default {MAX_BODY_BYTES >> 20}, or "
                          f"{MAX_VIDEO_BODY_BYTES >> 20} for a bundle that takes videos)")
    lim.add_argument("--realtime-idle-timeout", type=float, default=limits.realtime_idle, metavar="SECONDS",
                     help="AnyFlow-FAR: a realtime connection (/v1/realtime/video) that starts no session within this "
                          f"is closed (default {limits.realtime_idle:g})")
    lim.add_argument("--realtime-max-seconds", type=float, default=limits.realtime_max_seconds, metavar="SECONDS",
                     help="AnyFlow-FAR: a realtime session (which holds the replica's devices) stops after this "
                          f"(default {limits.realtime_max_seconds:g})")
    lim.add_argument("--realtime-max-message-kb", type=float, default=limits.realtime_max_message_bytes / 1024,
                     metavar="KB", help="AnyFlow-FAR: a realtime client's message over this closes its connection "
                                        f"with 1009 (default {limits.realtime_max_message_bytes >> 10:g})")
    r = s.add_argument_group("replicas (several servers, one queue: see runtime/serve/README.md, \"Many replicas\")")
    r.add_argument("--queue", metavar="URL", default=None,
                   help="the job database every replica shares: postgresql://USER:PASSWORD@HOST:PORT/DB (needs the "
                        "postgres extra); default: SQLite under --jobs-dir, one server")
    r.add_argument("--videos-url", metavar="URL", default=None,
                   help="keep videos and uploaded images in an object store (s3://bucket/prefix, gs://...; the "
                        "objectstore extra) instead of --jobs-dir, which replicas must otherwise share")
    r.add_argument("--queue-wait", type=float, default=d.queue_wait, metavar="SECONDS",
                   help="how long to wait for a --queue database that cannot be reached at start-up (restarting, not "
                        f"up yet), saying so every 10 s, before giving up with status 2 (default {d.queue_wait:g})")
    r.add_argument("--store-retry-seconds", type=float, default=d.store_retry, metavar="SECONDS",
                   help="how long a job's writes to a --videos-url store that fails (5xx, unreachable) are retried, "
                        f"with backoff, before the job fails with storage_unavailable (default {d.store_retry:g})")
    r.add_argument("--lease", type=float, default=d.lease, metavar="SECONDS",
                   help="a running job whose heartbeat is older than this is taken over by another replica "
                        f"(default {d.lease:g})")
    r.add_argument("--stall", type=float, default=d.stall, metavar="SECONDS",
                   help="a job with no denoising step or stage finished for this long stops being heartbeated and "
                        f"the server exits with status 3 for its supervisor to restart it (default {d.stall:g})")
    wh = s.add_argument_group("webhooks (see runtime/serve/README.md, \"Webhooks\")")
    wh.add_argument("--webhook-url", metavar="URL", default=None,
                    help="the server's own webhook endpoint: every tenant's video.completed and video.failed events "
                         "are POSTed to it, signed with --webhook-secret (Standard Webhooks)")
    wh.add_argument("--webhook-secret", metavar="whsec_...", default=os.environ.get("WAN_AOT_WEBHOOK_SECRET"),
                    help="the secret --webhook-url's deliveries are signed with (default: $WAN_AOT_WEBHOOK_SECRET)")
    wh.add_argument("--webhook-allow", metavar="HOST[,HOST]", action="append", default=[],
                    help="hosts, addresses or networks (CIDR) webhooks may reach although private, loopback or "
                         "link-local (refused otherwise; repeatable)")
    wh.add_argument("--webhook-retry-for", type=float, default=d.webhooks.retry_for, metavar="SECONDS",
                    help="how long after an event its delivery is retried (on backoff: 1, 2, 4 s ... at most an hour "
                         f"apart) before it is given up (default {d.webhooks.retry_for:g})")
    _magcache_args(s)  # the server's default for every job
    _lora_args(s)
    lo = s.add_argument_group("LoRA adapters per request (see runtime/serve/README.md, \"LoRA adapters\")")
    lo.add_argument("--lora-dir", type=Path, metavar="DIR",
                    help="offer the adapters in DIR (made by `python -m export lora ... --bundle BUNDLE`), by file "
                         "name without .safetensors: a request's `lora` names them, and the replica switches its "
                         "weights between jobs; each is checked against the bundle at start (--lora adapters apply "
                         "to every job, before these)")
    lo.add_argument("--max-loras", type=int, default=d.max_loras, metavar="N",
                    help=f"the most adapters one request may name (default {d.max_loras})")
    lo.add_argument("--lora-affinity-max", type=int, default=d.lora_affinity_max, metavar="N",
                    help="a replica takes a queued job of the LoRA set it holds before others, but no job waits for "
                         f"more than N others because of it (default {d.lora_affinity_max}; 0: strictly in turn)")
