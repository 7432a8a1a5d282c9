"""End to end, process start to mp4 written: `runtime generate` against a diffusers `WanPipeline` script.

Both sides are whole processes (spawn to exit, the mp4 written), in turn, pair by pair, with the same model, size,
steps, guidance and prompts. Eager runs the VAE in fp32, as the runtime does, and writes its mp4 with the runtime's
writer, so the encoders match. Before the pairs, one untimed runtime start fills the compilation cache and the
verified stamp, as any earlier run on the machine would have. Per start: wall time, user and system CPU time, peak
RSS; ratios are medians of the pairs' ratios.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from .common import (
    BENCH,
    GUIDANCE,
    NEGATIVE,
    PROMPT,
    WORKLOADS,
    Report,
    Table,
    add_common,
    bundle,
    checkpoint,
    child_env,
    log,
    median,
    num,
    timed_process,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, workloads=("1.3b",), dtypes=("fp32", "bf16"))
    p.add_argument("--steps", type=int, default=6)


def child_eager(a: dict[str, Any], spawned: float) -> dict[str, Any]:
    """What a diffusers user runs: WanPipeline in eager PyTorch, then the frames to mp4."""
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline

    from runtime.video import write_video

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a["dtype"]]
    vae = AutoencoderKLWan.from_pretrained(a["checkpoint"], subfolder="vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(a["checkpoint"], vae=vae, torch_dtype=dtype).to(a["device"])
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=a["height"], width=a["width"],
                  num_frames=a["frames"], num_inference_steps=a["steps"], guidance_scale=GUIDANCE,
                  max_sequence_length=a["max_len"], output_type="np").frames
    write_video(frames[0], a["out"], fps=16)
    return {}


def measure(a: argparse.Namespace, workload: str, dtype: str, tmp: Path) -> tuple[list[str], dict[str, Any]]:
    import json

    wl = WORKLOADS[workload]
    ckpt, bund = checkpoint(a.work, wl), bundle(a.work, wl, dtype, a.device)
    env = child_env(a.device, WAN_AOT_CACHE_DIR=str(tmp / "jax-cache"), WAN_AOT_STAMP_DIR=str(tmp / "stamps"))
    out = str(tmp / f"{workload}-{dtype}.mp4")
    runtime_cmd = [sys.executable, "-m", "runtime", "generate", str(bund), "--prompt", PROMPT, "--negative-prompt",
                   NEGATIVE, "--steps", str(a.steps), "--guidance", str(GUIDANCE), "--out", out, "-q"]
    eager_args = {"checkpoint": str(ckpt), "dtype": dtype, "device": a.device, "out": out, "width": wl.width,
                  "height": wl.height, "frames": wl.frames, "steps": a.steps, "max_len": wl.max_len}
    eager_cmd = [sys.executable, str(BENCH), "--child", "e2e:child_eager", json.dumps(eager_args), "0"]
    timed_process(runtime_cmd, env)  # fills the compilation cache and the stamp
    pairs = []
    for i in range(a.repeats):
        pairs.append({"runtime": timed_process(runtime_cmd, env), "eager": timed_process(eager_cmd, env)})
        log(f"{workload} {dtype} pair {i + 1}/{a.repeats}: runtime {pairs[-1]['runtime']['wall']:.1f} s, "
            f"eager {pairs[-1]['eager']['wall']:.1f} s")

    def med(side: str, key: str) -> float:
        return median([p[side][key] for p in pairs])

    row = [workload, dtype, num(med("runtime", "wall"), 1), num(med("eager", "wall"), 1),
           f"{median([p['runtime']['wall'] / p['eager']['wall'] for p in pairs]):.2f}x",
           num(med("runtime", "user") + med("runtime", "sys"), 1), num(med("eager", "user") + med("eager", "sys"), 1),
           num(med("runtime", "rss_gb")), num(med("eager", "rss_gb")),
           f"{median([p['runtime']['rss_gb'] / p['eager']['rss_gb'] for p in pairs]):.2f}x"]
    return row, {"workload": workload, "dtype": dtype, "pairs": pairs}


def run(a: argparse.Namespace) -> Report:
    t = Table(f"process start to mp4 written ({a.steps} steps, guidance {GUIDANCE:g}; {a.device}; medians of "
              f"{a.repeats} pairs)", ["workload", "dtype", "runtime s", "eager s", "runtime / eager", "runtime CPU s",
                                      "eager CPU s", "runtime peak RSS GB", "eager peak RSS GB", "RSS ratio"])
    raw = []
    with tempfile.TemporaryDirectory(prefix="wan-aot-e2e-") as tmp:
        for workload in a.workload:
            for dtype in a.dtype:
                row, r = measure(a, workload, dtype, Path(tmp))
                t.add(*row)
                raw.append(r)
    t.notes.append("CPU s is user + system time. " + " ".join(f"{w}: {WORKLOADS[w].about}, {WORKLOADS[w].shape}."
                                                               for w in a.workload))
    return Report([t], raw)
