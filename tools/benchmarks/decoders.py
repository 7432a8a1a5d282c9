"""Fast decode: the Wan VAE, LightVAE (export --vae) and a tiny decoder (export --tiny-decoder) on the same latents.

Two bundles of the workload's checkpoint, each with a second shape at --large's size: one with the checkpoint's VAE and
a TAEHV tiny decoder of the real widths (taew2_1's layout, fp16), one with its VAE replaced by a LightVAE (the Wan 2.1
VAE at base_dim 24, lightvaew2_1's layout). Random weights, so the seconds are real and the picture is not: PSNR
against the full VAE only says how far two random networks' frames are apart, not how good a decoder is.

In one process, every program compiled first, interleaved over --repeats:
- a --steps-step CFG-free run (guidance 1) at the workload's shape, encode and denoise once, then each decoder on the
  same latents: decode seconds, and the run end to end with that decoder (encode + denoise + its decode);
- PSNR of the tiny decoder's and LightVAE's frames against the full VAE's, on those latents;
- at --large's size (e.g. 832x480 x 81 frames: 21 latent frames), each decoder on the same random latents: the first
  --large-chunks latent frames, scaled to the whole video (the chunks after the first all run one program: a chunk's
  time does not depend on where it is).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from .common import PROMPT, WORKLOADS, Report, Table, add_common, checkpoint, each_workload, export, log, median, num


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=3, devices=("cpu",), workloads=("1.3b",), dtypes=("bf16",))
    p.add_argument("--steps", type=int, default=4, help="CFG-free denoising steps of the run (default 4)")
    p.add_argument("--large", default="832x480x81", help="the second shape, WxHxF (default 832x480x81: 480p)")
    p.add_argument("--large-chunks", type=int, default=3,
                   help="latent frames each decoder decodes at --large's size, scaled to the whole video (default 3)")


def _files(work: Path) -> tuple[Path, Path]:
    """A random TAEHV decoder of the real widths (fp16, taew2_1's layout) and a random LightVAE (lightvaew2_1's
    layout), built once."""
    import torch

    from tests.taehv_reference import make_file
    from tests.test_light_vae import random_vae, write_original

    root = work / "decoders"
    root.mkdir(parents=True, exist_ok=True)
    tiny, light = root / "taew2_1-random.safetensors", root / "lightvaew2_1-random.safetensors"
    if not tiny.is_file():
        make_file(tiny, 16, 1, (256, 128, 64, 64), dtype=torch.float16)
    if not light.is_file():
        write_original(random_vae(seed=0, base_dim=24, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                  temperal_downsample=[False, True, True]), light)
    return tiny, light


def _bundles(a: argparse.Namespace, workload: str, dtype: str) -> tuple[Path, Path]:
    wl = WORKLOADS[workload]
    tiny, light = _files(a.work)
    width, height, _ = a.large.split("x")
    common = ["--model", str(checkpoint(a.work, wl).resolve()), "--resolution", f"{wl.width}x{wl.height},"
              f"{width}x{height}", "--frames", str(wl.frames), "--max-sequence-length", str(wl.max_len),
              "--dtype", dtype]
    out = {}
    for name, extra in (("vae+tiny", ["--tiny-decoder", str(tiny)]), ("lightvae", ["--vae", str(light)])):
        out[name] = a.work / wl.name / f"decoders-{dtype}-{name}-{a.large}"
        if not (out[name] / "manifest.json").is_file():
            log(f"exporting {out[name]}")
            export([*common, *extra], out[name])
    return out["vae+tiny"], out["lightvae"]


def _psnr(x: np.ndarray, ref: np.ndarray) -> float:
    mse = float(np.mean((np.asarray(x, np.float64) - np.asarray(ref, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def measure(a: argparse.Namespace, workload: str, dtype: str) -> tuple[list[Table], dict[str, Any]]:
    import runtime

    full_path, light_path = _bundles(a, workload, dtype)
    pipe, light = runtime.load(full_path), runtime.load(light_path)
    for p in (pipe, light):
        p.prepare(magcache=False)
    decoders = {"full VAE": lambda x: pipe.decode(x), "LightVAE": lambda x: light.decode(x),
                "tiny (taew2_1)": lambda x: pipe.decode(x, "tiny")}
    lw, lh, lf = (int(v) for v in a.large.split("x"))
    big = pipe.manifest.find_shape(lw, lh)
    lt = (lf - 1) // big.temporal_scale + 1
    rng = np.random.default_rng(0)
    large = rng.standard_normal((1, big.latent_channels, lt, big.latent_height, big.latent_width)).astype(np.float32)
    times: dict[str, list[float]] = {"run": [], **{k: [] for k in decoders}, **{f"large {k}": [] for k in decoders}}
    psnr: dict[str, list[float]] = {"LightVAE": [], "tiny (taew2_1)": []}
    for i in range(a.repeats):
        t = time.perf_counter()
        latents = pipe.denoise(pipe.encode(PROMPT), seed=i, steps=a.steps, guidance=1.0, progress=False)
        times["run"].append(time.perf_counter() - t)
        frames = {}
        for name, decode in decoders.items():
            t = time.perf_counter()
            frames[name] = decode(latents)
            times[name].append(time.perf_counter() - t)
        for name in psnr:
            psnr[name].append(_psnr(frames[name], frames["full VAE"]))
        for name, decode in decoders.items():
            t = time.perf_counter()
            decode(large[:, :, : a.large_chunks])
            # the first chunk and (large_chunks - 1) next ones, scaled to the video's lt chunks
            times[f"large {name}"].append((time.perf_counter() - t) / a.large_chunks * lt)
        log(f"{workload} {dtype} repeat {i + 1}/{a.repeats} done")
    wl = WORKLOADS[workload]
    run = median(times["run"])
    small = Table(f"{workload}, {dtype} ({wl.shape}; {a.steps} CFG-free steps, guidance 1; {a.device}; medians of "
                  f"{a.repeats})", ["decoder", "decode s", "against the VAE", "run end to end s", "against the VAE",
                                    "PSNR against the VAE's frames dB"])
    base = median(times["full VAE"])
    for name in decoders:
        d = median(times[name])
        small.add(name, num(d, 3), f"{d / base:.3f}x", num(run + d, 2), f"{(run + d) / (run + base):.3f}x",
                  "-" if name not in psnr else num(median(psnr[name]), 1))
    small.notes.append(f"The run end to end: encode and {a.steps} steps ({num(run, 2)} s, the same for each) then that "
                       "decoder on the same latents. Random weights: PSNR measures two random networks' disagreement, "
                       "not a decoder's quality.")
    big_t = Table(f"{workload}, {dtype} at {lw}x{lh} x {lf} frames (latents {list(large.shape)}; {a.device}; medians "
                  f"of {a.repeats})", ["decoder", "decode s", "against the VAE"])
    big_base = median(times["large full VAE"])
    for name in decoders:
        d = median(times[f"large {name}"])
        big_t.add(name, num(d, 2), f"{d / big_base:.3f}x")
    big_t.notes.append(f"Each decoder decoded {a.large_chunks} of the video's {lt} latent frames (chunks), scaled to "
                       f"{lt}: a chunk after the first runs the same program wherever it is (the first, one frame, is "
                       "cheaper, so this overstates a whole video's time slightly). Whole 480p videos on 2 cores "
                       "take minutes each.")
    return [small, big_t], {"workload": workload, "dtype": dtype, "times_s": times, "psnr_db": psnr}


def run(a: argparse.Namespace) -> Report:
    return each_workload(a, measure)
