"""Quantized weights (export --quantize) against bf16, side by side in one run.

bytes: the 1.3B-width model on cpu and the 14B / A14B on tpu-v6e-8 (dp=2, tp=4), exported from their architecture
names with --no-weights in bf16 and each mode; the DiT's (both experts for A14B) and the text encoder's bytes per
device, as `runtime inspect` counts them, and their ratio to bf16. int8-dynamic stores what int8 stores.

run: a workload exported in bf16 and in each mode from one checkpoint; each bundle runs in a fresh process per
repeat (the prompt, --steps steps): the median of steps 2..N and the peak RSS, medians over repeats, interleaved;
then tools/quality.py against the bf16 bundle (its prompts, seed 0, --quality-steps steps, the same latents): the
frames' PSNR, max error and the first step's velocity error.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from .common import (
    GUIDANCE,
    NEGATIVE,
    PROMPT,
    WORKLOADS,
    Report,
    Table,
    add_common,
    bundle,
    export,
    log,
    median,
    num,
    peak_rss_gb,
    ratio,
    spawn,
)

MODES = ("int8", "fp8", "int8-dynamic")
BYTES_MODELS = {  # name: (architecture, resolution, frames, target)
    "1.3B (cpu)": ("wan2.1-t2v-1.3b", "480p", 81, "cpu"),
    "14B (tpu-v6e-8)": ("wan2.1-t2v-14b", "720p", 81, "tpu-v6e-8"),
    "A14B (tpu-v6e-8)": ("wan2.2-t2v-a14b", "720p", 81, "tpu-v6e-8"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, workloads=("1.3b",), dtypes=("bf16",))
    p.add_argument("--what", nargs="+", default=["bytes", "run"], choices=["bytes", "run"],
                   help="bytes: weight bytes per device from names; run: step time, RSS and fidelity of a workload")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--steps", type=int, default=6, help="denoising steps per timed run")
    p.add_argument("--quality-steps", type=int, default=10, help="denoising steps of the fidelity runs")


def _per_device(bund: Path) -> dict[str, int]:
    from runtime import manifest as mf
    from runtime.summary import summarize

    s = summarize(bund, mf.read(bund))["weights"]
    return {"dit": sum(w["bytes_per_device"] for g, w in s.items() if g.startswith("transformer")),
            "text_encoder": s["text_encoder"]["bytes_per_device"]}


def bytes_table(a: argparse.Namespace) -> tuple[Table, dict[str, Any]]:
    rows = {}
    for name, (arch, res, frames, target) in BYTES_MODELS.items():
        for mode in ("bf16", *a.modes):
            out = a.work / "quantize-bytes" / f"{arch}-{target}-{mode}"
            if not (out / "manifest.json").is_file():
                log(f"exporting {out}")
                export(["--model", arch, "--no-weights", "--resolution", res, "--frames", str(frames), "--target",
                        target, *([] if mode == "bf16" else ["--quantize", mode])], out)
            rows[name, mode] = _per_device(out)
    t = Table("weight bytes per device (from architecture names, bf16 and each mode)",
              ["model", "mode", "DiT per device GB", "vs bf16", "text encoder per device GB", "vs bf16"])
    for (name, mode), r in rows.items():
        base = rows[name, "bf16"]
        t.add(name, mode, num(r["dit"] / 1e9), ratio(r["dit"], base["dit"]), num(r["text_encoder"] / 1e9),
              ratio(r["text_encoder"], base["text_encoder"]))
    t.notes.append("The DiT of A14B is both experts. What stays in bf16: the DiT's embedders, time projection, "
                   "modulation tables, norms and head.")
    return t, {f"{n}/{m}": r for (n, m), r in rows.items()}


def child(a: dict[str, Any], spawned: float) -> dict[str, Any]:
    import runtime

    pipe = runtime.load(a["bundle"])
    embeds = pipe.encode(PROMPT, NEGATIVE)
    marks: list[float] = []
    pipe.denoise(embeds, seed=0, steps=a["steps"], guidance=GUIDANCE, progress=False,
                 on_step=lambda i: marks.append(time.perf_counter()))
    return {"steps": [b - a for a, b in zip(marks[:-1], marks[1:])], "rss_gb": peak_rss_gb()}


def run_table(a: argparse.Namespace, workload: str, dtype: str) -> tuple[Table, dict[str, Any]]:
    import quality  # tools/quality.py

    import runtime

    wl, target = WORKLOADS[workload], a.device
    bundles = {dtype: bundle(a.work, wl, dtype, target),
               **{m: bundle(a.work, wl, dtype, target, quantize=m) for m in a.modes}}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in bundles}
    for i in range(a.repeats):
        for mode, b in bundles.items():  # interleaved, so drift on the machine hits every mode alike
            runs[mode].append(spawn("quantize:child", {"bundle": str(b), "steps": a.steps}, device=a.device))
        log(f"{workload} repeat {i + 1}/{a.repeats} done")
    result: dict[str, dict[str, Any]] = {}
    for mode, rs in runs.items():
        result[mode] = {"step": median([median(r["steps"]) for r in rs]), "rss_gb": median([r["rss_gb"] for r in rs]),
                        "weights_gb": sum(_per_device(bundles[mode]).values()) / 1e9}
    ref = runtime.load(bundles[dtype])
    for mode in a.modes:
        rows = quality.compare(ref, runtime.load(bundles[mode]), list(quality.PROMPTS), [0], a.quality_steps)
        result[mode].update(quality.summary(rows))
    base = result[dtype]
    t = Table(f"{workload} ({wl.shape}; {a.device}): {a.steps} steps per fresh process, medians of {a.repeats}; "
              f"fidelity against {dtype} over {len(quality.PROMPTS)} prompts, {a.quality_steps} steps",
              ["mode", "DiT + text encoder GB", "step s", "vs " + dtype, "peak RSS GB", "vs " + dtype, "PSNR dB (min)",
               "max error (of 255)", "first-step velocity rel. error"])
    for mode, r in result.items():
        q = ["-", "-", "-"] if mode == dtype else [num(r["psnr_db_min"], 1), num(r["max_error_levels"], 1),
                                                   f"{r['velocity_rel_error_max']:.2e}"]
        t.add(mode, num(r["weights_gb"]), num(r["step"], 3), ratio(r["step"], base["step"]), num(r["rss_gb"]),
              ratio(r["rss_gb"], base["rss_gb"]), *q)
    return t, {"workload": workload, "runs": runs, "result": result}


def run(a: argparse.Namespace) -> Report:
    tables, raw = [], {}
    if "bytes" in a.what:
        t, raw["bytes"] = bytes_table(a)
        tables.append(t)
    if "run" in a.what:
        for workload in a.workload:
            for dtype in a.dtype:
                t, raw[f"run/{workload}/{dtype}"] = run_table(a, workload, dtype)
                tables.append(t)
    return Report(tables, raw)
