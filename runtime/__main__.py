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
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from . import cli_flags
from .cli_inputs import animate_args, loop_args, loras_from_args, magcache_from_args, video_args

log = logging.getLogger("runtime")


def parser(serve_flags: bool = True) -> argparse.ArgumentParser:
    """Every command's flags (runtime/cli_flags.py), with this module's examples first in `--help`."""
    return cli_flags.parser(__doc__, serve_flags)


@dataclass
class Prepared:
    """What the commands that run a bundle share once their inputs are read and checked and the bundle is loaded."""

    pipe: Any  # runtime.Pipeline
    primary: bool  # this process writes the outputs (process 0)
    magcache: Any  # runtime.MagCache or None
    stream: Any  # generate --stream: the HLS directory's sink, or None
    videos: dict[str, Any]  # --video, --mask, --reference-image, read
    animated: dict[str, Any]  # Wan-Animate's inputs, read
    shape: dict[str, Any]  # --size and --frames, as the engine takes them


def prepare(args: argparse.Namespace) -> Prepared:
    """Every input of generate, encode, denoise, calibrate and decode read and checked (one line, exit 2, for the
    first that is bad), before the bundle is loaded where the check needs no bundle; then the bundle loaded and the
    checks that need its kind."""
    from . import distributed
    from .chronoedit import is_image_path
    from .errors import UserError
    from .files import check_writable
    from .pipeline import load
    from .video import check_fps, check_video_path

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
        raise UserError(f"Wan-Animate bundles run in segments, each of its own steps: use `generate` (with "
                        f"--pose-video and --face-video), not `{args.command}`")
    if pipe.kind.any_length and args.command in ("encode", "denoise", "calibrate"):
        what = "diffusion forcing bundles run in segments of per-frame steps" if pipe.kind.forcing else \
            "Helios bundles run in chunks, each on the ones before"
        raise UserError(f"{what}: use `generate` (--frames for the length), not `{args.command}`")
    shape = {"size": getattr(args, "size", None), "frames": getattr(args, "frames", None)}
    if pipe.kind.any_length and args.command == "generate":  # --frames is the video's length: forcing/helios plan it
        shape["frames"] = None
    elif args.command != "decode":  # a shape the bundle lacks fails before any work
        from . import kinds

        if hasattr(args, "video"):  # the commands that read the inputs (denoise takes them encoded)
            kinds.check_videos(pipe.kind, pipe.manifest.video_to_video, videos.get("video"), videos.get("mask"),
                               videos.get("reference_images"))
        pipe.shape_for_videos(shape["size"], shape["frames"], videos.get("video"), videos.get("reference_images"))
    return Prepared(pipe, primary, magcache, stream, videos, animated, shape)


def write_frames(args: argparse.Namespace, p: Prepared, frames: Any) -> None:
    """Process 0 writes the video (or an edit's image) and, if asked, the float frames."""
    from . import intermediates as im
    from .chronoedit import is_image_path, write_images
    from .video import write_videos

    if not p.primary:
        return
    if args.frames_out is not None:
        im.save(args.frames_out, im.FRAMES, {"frames": frames}, p.pipe.bundle_id, {})
        log.info("wrote %s", args.frames_out)
    fps = p.pipe.manifest.defaults.fps if args.fps is None else args.fps
    for path in write_images(frames, args.out) if is_image_path(args.out) else write_videos(frames, args.out, fps):
        log.info("wrote %s", path)


def generate(args: argparse.Namespace) -> int:
    """prompt (+ images, videos) -> video, by the bundle kind's loop; `--stream` writes it as HLS as it is made."""
    p = prepare(args)
    pipe, live, writer = p.pipe, {}, None
    if p.stream is not None:  # process 0 writes it, as the video
        from .hls import HlsWriter

        # written from the first frames on: a run its loop refuses leaves no stream behind
        writer = HlsWriter(p.stream, pipe.manifest.defaults.fps if args.fps is None else args.fps, open_now=False)
        live["on_frames"] = writer.add
    try:
        frames = pipe.generate(args.prompt, args.negative_prompt, image=args.image, last_image=args.last_image,
                               seed=args.seed, steps=args.steps, guidance=args.guidance, guidance_2=args.guidance_2,
                               flow_shift=args.flow_shift, progress=not args.quiet, magcache=p.magcache,
                               low_memory=True, sampler=args.sampler, sigmas=args.sigmas, **p.videos,
                               conditioning_scale=args.conditioning_scale, strength=args.strength, **p.animated,
                               **loop_args(args, pipe.kind), **p.shape, decoder=args.decoder,
                               **live)  # one video per process
    finally:
        if writer is not None and writer.end():  # a failed run's stream ends where it stopped
            log.info("streamed %s", args.stream / "stream.m3u8")
    write_frames(args, p, frames)
    return 0


def decode(args: argparse.Namespace) -> int:
    """latents (what `denoise` wrote) -> video."""
    from . import intermediates as im

    p = prepare(args)
    video_shapes = [s.video_latent_shape for s in p.pipe.manifest.shapes]  # what denoise writes
    latents = im.load(args.latents, im.LATENTS, p.pipe.bundle_id, {"latents": video_shapes})[0]["latents"]
    write_frames(args, p, p.pipe.decode(latents, args.decoder))
    return 0


def encode(args: argparse.Namespace) -> int:
    """prompt (+ images, videos) -> embeddings and conditioning (safetensors)."""
    from . import intermediates as im

    p = prepare(args)
    embeds = p.pipe.encode(args.prompt, args.negative_prompt, image=args.image, last_image=args.last_image,
                           **p.videos, **p.shape)
    if p.primary:
        im.save(args.out, im.EMBEDS, embeds, p.pipe.bundle_id, {"prompt": args.prompt,
                                                                "negative_prompt": args.negative_prompt,
                                                                "image": args.image is not None,
                                                                "last_image": args.last_image is not None})
        log.info("wrote %s", args.out)
    return 0


def denoise(args: argparse.Namespace) -> int:
    """embeddings (what `encode` wrote) -> latents (safetensors, for `decode`)."""
    from . import intermediates as im

    p = prepare(args)
    pipe = p.pipe
    s = pipe.settings(args.seed, args.steps, args.guidance, args.flow_shift, args.guidance_2, args.sampler,
                      args.sigmas)
    g = pipe.geometry
    embeds, _ = im.load(args.embeds, im.EMBEDS, pipe.bundle_id,
                        {"prompt_embeds": g.embeds_shape, "negative_prompt_embeds": g.embeds_shape})
    init = None
    if args.latents is not None:
        latent_shapes = [s.latent_shape for s in pipe.manifest.shapes]
        init = im.load(args.latents, im.LATENTS, pipe.bundle_id, {"latents": latent_shapes})[0]["latents"]
    latents = pipe.denoise(embeds, s.seed, s.steps, s.guidance, s.flow_shift, latents=init, progress=not args.quiet,
                           guidance_2=s.guidance_2, magcache=p.magcache, sampler=s.sampler, sigmas=s.sigmas,
                           conditioning_scale=args.conditioning_scale, strength=args.strength, **p.shape)
    if p.primary:
        meta = {**s.to_json(), **({"magcache": p.magcache.to_json()} if p.magcache else {})}
        im.save(args.out, im.LATENTS, {"latents": latents}, pipe.bundle_id, meta)
        log.info("wrote %s", args.out)
    return 0


def calibrate(args: argparse.Namespace) -> int:
    """MagCache's magnitude ratios of this bundle, every step run in full -> ratios JSON (for --magcache)."""
    p = prepare(args)
    pipe = p.pipe
    s = pipe.settings(args.seed, args.steps, args.guidance, args.flow_shift, args.guidance_2, args.sampler,
                      args.sigmas)
    embeds = pipe.encode(args.prompt, args.negative_prompt, image=args.image, last_image=args.last_image,
                         **p.videos, **p.shape)
    ratios = pipe.calibrate(embeds, s.seed, s.steps, s.guidance, s.flow_shift, progress=not args.quiet,
                            guidance_2=s.guidance_2, sampler=s.sampler, sigmas=s.sigmas,
                            conditioning_scale=args.conditioning_scale, **p.shape)
    if p.primary:
        from .files import atomic_path

        record = {"mag_ratios": ratios, "bundle_id": pipe.bundle_id, "prompt": args.prompt, **s.to_json()}
        with atomic_path(args.out) as tmp:
            tmp.write_text(json.dumps(record, indent=1) + "\n")
        log.info("wrote %s (%d ratios)", args.out, len(ratios))
    return 0


def verify(args: argparse.Namespace) -> int:
    """Each check of the bundle against its manifest and this machine, a line each; exit 2 if any failed."""
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
    """What the bundle holds (stages, shapes, shardings, weight bytes), as text or JSON: nothing compiled or loaded."""
    from . import manifest as mf
    from .summary import format_text, summarize

    s = summarize(args.bundle, mf.read(args.bundle))
    print(json.dumps(s, indent=1) if args.json else format_text(s))
    return 0


def fit(args: argparse.Namespace) -> int:
    """Exit 0: the bundle fits; 1: it does not (one line says where and what would help: cli.exit_code); 2: bad
    input."""
    from . import fit as fitting
    from .cli import compile_for_fit

    report = compile_for_fit(args.bundle, args.hbm, log, args.mode)  # (no compilation cache: see fit.fit)
    print(json.dumps(report.to_json(), indent=1) if args.json else fitting.format_text(report))
    if args.record:
        from . import manifest as mf

        log.info("wrote %s", fitting.record(report, mf.read(args.bundle).bundle_id))
    fitting.check(report)
    return 0


def warm(args: argparse.Namespace) -> int:
    """Every program compiled into the compilation cache (no weights loaded, nothing run): the next start is fast."""
    import time

    from .bundle import open_bundle

    bundle = open_bundle(args.bundle)
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


def _check_executables(bundle: Path) -> None:
    """A bundle's executables compiled ahead are native code: one that was changed stops `serve` before it starts, one
    line and exit 2, as it stops `generate` (the rest of the bundle is checked as the server loads it)."""
    from . import manifest as mf
    from .errors import BundleError
    from .integrity import Checker

    try:
        m = mf.read(bundle)
    except BundleError:
        return  # not a bundle: the server's load reports it, as before
    Checker(bundle, m).check([mf.FileRef(e.file, e.sha256) for e in m.executables])


def serve(args: argparse.Namespace) -> int:
    """The OpenAI videos API on this bundle: every flag checked (one line, exit 2) before anything starts."""
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
    for name in ("lease", "stall", "header_timeout", "body_timeout", "keep_alive", "max_body_mb",
                 "realtime_idle_timeout", "realtime_max_seconds", "realtime_max_message_kb"):
        value = getattr(args, name)
        if value is None:  # --max-body-mb left out: the bundle's
            continue
        if not (value > 0 and value < float("inf")):
            unit = "megabytes" if name == "max_body_mb" else "kilobytes" if name.endswith("_kb") else "seconds"
            raise UserError(f"--{name.replace('_', '-')} {value} must be a number of {unit} > 0")
    if args.max_loras < 1:
        raise UserError(f"--max-loras {args.max_loras} must be >= 1")
    if args.lora_affinity_max < 0:
        raise UserError(f"--lora-affinity-max {args.lora_affinity_max} must be >= 0")
    _check_executables(args.bundle)
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
                    max_body_bytes=None if args.max_body_mb is None else int(args.max_body_mb * (1 << 20)),
                    realtime_idle=args.realtime_idle_timeout, realtime_max_seconds=args.realtime_max_seconds,
                    realtime_max_message_bytes=max(1, int(args.realtime_max_message_kb * 1024)))
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



COMMANDS = {"generate": generate, "encode": encode, "denoise": denoise, "calibrate": calibrate, "decode": decode,
            "verify": verify, "warm": warm, "serve": serve}


def run(args: argparse.Namespace) -> int:
    """The command's function; every command but inspect and fit (which read a bundle on this host alone, with no
    compilation cache) joins the job's processes and turns the compilation cache on first."""
    if args.command == "inspect":
        return inspect(args)
    if args.command == "fit":
        return fit(args)
    from . import cache, distributed

    distributed.initialize(args.coordinator, args.num_processes, args.process_id, auto=args.distributed)
    if not args.no_cache:
        cache.enable(args.cache_dir)
    return COMMANDS[args.command](args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser(serve_flags=argv[:1] == ["serve"]).parse_args(argv)  # serve's flags read the server's settings
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    log.setLevel(logging.WARNING if getattr(args, "quiet", False) else logging.INFO)
    from .cli import exit_code

    return exit_code(f"python -m runtime {args.command}", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
