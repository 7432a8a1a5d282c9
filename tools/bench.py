"""Every benchmark of wan-aot, behind one entry point with one set of conventions.

    python tools/bench.py MEASURE [--workload NAME ...] [--dtype fp32|bf16 ...] [--repeats N] [--device cpu|cuda]
                                  [--work DIR] [--json OUT] [the measure's own options]
    python tools/bench.py MEASURE --help

Every measure compares things side by side in one run (interleaved over --repeats, medians reported), prints the
machine (CPU model, cores, memory), the date and its own command line, then Markdown tables whose ratio columns
say what they are against; --json OUT also writes the tables and every raw measurement. Workloads are built once
under --work (default artifacts/bench/): `tiny` (the README's embedded model, 256x144, 17 frames) and `1.3b` (the
real Wan2.1-1.3B DiT and Wan VAE with random weights, 128x128, 9 frames, a 1-layer UMT5 of the XXL width). Nothing
here is run by the test suite. BENCHMARKS.md holds the current figures, each with the command that made it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# benchmarks/ and quality.py, then PYTHONPATH (a child of --baseline runs another checkout's runtime), then this
# checkout's export and runtime packages
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(2 + len([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
                str(Path(__file__).resolve().parents[1]))

from benchmarks import (  # noqa: E402
    animate,
    animate2,
    cancel,
    decoders,
    e2e,
    eager,
    export_time,
    faults,
    fewsteps,
    fit,
    forcing,
    gguf,
    load,
    lora,
    precompiled,
    preview,
    quantize,
    ready,
    realtime,
    roofline,
    serve,
    speedups,
    startup,
    stream,
    vace,
)
from benchmarks.common import Usage, emit, run_child  # noqa: E402

MEASURES = {  # name: (module, the question it answers)
    "eager": (eager, "the runtime against the torchax JIT path and diffusers eager: start, step, decode, memory"),
    "e2e": (e2e, "process start to mp4 written: `runtime generate` against a diffusers script"),
    "startup": (startup, "process start to step 1, first start against warm, and where the seconds go"),
    "ready": (ready, "a server's time to ready, one shape and four, against generate's first step"),
    "precompiled": (precompiled, "a cold start of a precompiled bundle (executables compiled ahead) against the "
                                 "plain one: time to ready, to a video, XLA compilations"),
    "export": (export_time, "export time per target and per number of shapes"),
    "serve": (serve, "serving throughput and latency: one replica, two on PostgreSQL, one killed"),
    "load": (load, "load against servers already running (loopback)"),
    "speedups": (speedups, "CFG-free steps and MagCache: speed-up and fidelity"),
    "vace": (vace, "what VACE's branch costs a denoising step, against text-to-video at the same shape"),
    "animate": (animate, "Wan-Animate: a video of 1, 2 and 4 segments, and where a segment's time goes"),
    "animate2": (animate2, "Wan-Animate 2 beside Wan-Animate at the same widths: time per segment, where it goes, "
                           "the reference pass's share"),
    "forcing": (forcing, "diffusion forcing: a video of 1, 2 and 4 segments; the asynchronous mode against the "
                         "synchronous one"),
    "fewsteps": (fewsteps, "a 4-step CFG-free video against 50 CFG steps; the samplers at equal steps"),
    "quantize": (quantize, "int8 / fp8 / int8-dynamic weights: bytes per device, step time, RSS, fidelity"),
    "roofline": (roofline, "a roofline model of a TPU denoising step from the exported programs"),
    "preview": (preview, "what a live preview (the x0 estimate through a latent-to-RGB map) costs a denoising step"),
    "decoders": (decoders, "the full VAE, LightVAE and a tiny decoder: decode seconds, a few-step run end to end, "
                           "PSNR against the VAE"),
    "cancel": (cancel, "the time from a cancel of a running job to the replica's next job, SQLite and PostgreSQL"),
    "fit": (fit, "real architectures compiled for TPU slices by XLA's TPU compiler: does each fit its HBM?"),
    "lora": (lora, "LoRA sets switched between jobs: a switch's cost, the two designs, the 14B per device, affinity"),
    "faults": (faults, "jobs completed and lost out of N while the queue's PostgreSQL restarts, a disk fills, the "
                       "S3 store goes away; the time from the fault's end to the next completed job"),
    "gguf": (gguf, "GGUF DiT files (Q8_0 kept as int8, Q4_K dequantized) against bf16: bytes and weight PSNR on "
                   "the 1.3B's shape"),
    "stream": (stream, "time to the first playable segment of a live stream against the whole video (diffusion "
                       "forcing, Wan-Animate, Helios)"),
    "realtime": (realtime, "AnyFlow-FAR's live session: time to the first chunk, per chunk, and the realtime factor "
                           "at 1, 2 and 4 steps"),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="measure", required=True, metavar="MEASURE", title="measures")
    for name, (module, about) in MEASURES.items():
        q = sub.add_parser(name, help=about, description=f"{about}.\n\n{module.__doc__}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(q)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"] and len(argv) == 4:  # one fresh-process start of a measure (common.spawn)
        return run_child(*argv[1:])
    args = parser().parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", args.device)  # for the measures that run the runtime in this process
    try:
        if args.repeats < 1:
            raise Usage(f"--repeats must be at least 1, got {args.repeats}")
        args.work.mkdir(parents=True, exist_ok=True)
        report = MEASURES[args.measure][0].run(args)
    except Usage as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    emit(report, argv, args.device, args.json)
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
