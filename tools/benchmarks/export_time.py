"""Export time: `python -m export` from process spawn to exit, per target, and per number of shapes; and what each
target puts on a device.

Targets: the tiny checkpoint (weights written) and the 14B / A14B from their architecture names (--no-weights:
programs only, as a TPU or GPU build machine makes them before the weights are attached), for each target; ratios
against the same model's cpu export. Bytes per device: of each from-names export, the weights each device holds
(by group, as `python -m runtime inspect` counts them) and the programs' bytes. Shapes: 1, 2 and 4 shapes (the size,
its portrait, each at two frame counts); "per extra shape" is (T(n) - T(1)) / (n - 1), against T(1), which also pays
for loading the model, tracing the shape-free stages and writing the weights. Exports run on this machine's CPU
whatever the target.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .common import Report, Table, add_common, export, log, median, num, ratio

# name: (--model, width, height, frames, a shorter frame count, flags, the targets its heads divide over)
ACCELERATORS = ("tpu-v6e-8", "tpu-v6e-16", "cuda-2", "cuda-4", "cuda-8")
MODELS = {
    "tiny": ("tiny", 256, 144, 17, 9, ["--dtype", "fp32"], ("cpu", "cpu-8")),
    "14B from names": ("wan2.1-t2v-14b", 1280, 720, 81, 49, ["--no-weights"], ("cpu", "cpu-8", *ACCELERATORS)),
    "A14B from names": ("wan2.2-t2v-a14b", 1280, 720, 81, 49, ["--no-weights"], ("cpu", "cpu-8", *ACCELERATORS)),
    # DiT programs for 0 and 1 reference images (--reference-images' default), so twice the 14B's
    "VACE-14B from names": ("wan2.1-vace-14b", 1280, 720, 81, 49, ["--no-weights"], ("cpu", "cpu-8", *ACCELERATORS)),
    # one 77-frame segment (diffusers' default), its steps one program each (no block loop), the face_motion program
    "Animate-14B from names": ("wan2.2-animate-14b", 1280, 720, 77, 45, ["--no-weights"],
                               ("cpu", "cpu-8", *ACCELERATORS)),
    # SkyReels-V2-DF-14B-720P: a 121-frame segment (diffusers' base_num_frames at 720p), any length in segments
    "DF-14B-720P from names": ("skyreels-v2-df-14b-720p", 1280, 720, 121, 97, ["--no-weights"],
                               ("cpu", "cpu-8", *ACCELERATORS)),
}
TARGETS = ("cpu", "cpu-8", *ACCELERATORS)
SHAPES = (("tiny", "cpu"), ("14B from names", "tpu-v6e-8"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, devices=("cpu",))
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--no-shapes", action="store_true", help="skip the 1 / 2 / 4 shapes table")


def shape_flags(width: int, height: int, frames: int, shorter: int, n: int) -> list[str]:
    sizes = [f"{width}x{height}", f"{height}x{width}"][: 1 if n == 1 else 2]
    counts = [frames, shorter][: 2 if n == 4 else 1]
    return ["--resolution", ",".join(sizes), "--frames", ",".join(map(str, counts))]


def out_dir(model: str, target: str, n: int, work: Path) -> Path:
    return work / "export" / f"{MODELS[model][0]}-{target}-{n}"


def timed(model: str, target: str, n: int, work: Path) -> float:
    m, w, h, f, short, flags, _ = MODELS[model]
    return export(["--model", m, *shape_flags(w, h, f, short, n), "--target", target, *flags],
                  out_dir(model, target, n, work))


def per_device(model: str, targets: list[str], work: Path) -> Table:
    """Weights and programs per device of the model's one-shape exports, from the bundles' manifests."""
    from runtime import manifest as mf
    from runtime.summary import summarize

    table = Table(f"{model}: bytes per device (one shape; weights as `runtime inspect` counts them)",
                  ["target", "mesh", "DiT GB", "text encoder GB", "VAE GB", "weights GB", "stages/ MB"])
    for t in targets:
        path = out_dir(model, t, 1, work)
        s = summarize(path, mf.read(path))
        w = s["weights"]
        dit = sum(v["bytes_per_device"] for k, v in w.items() if k.startswith("transformer"))
        programs = sum(f.stat().st_size for f in (path / "stages").iterdir())  # every host loads them all
        table.add(f"{t} ({s['target']['devices']} x {s['target']['platform']})", s["target"]["mesh"],
                  f"{dit / 1e9:.2f}", f"{w['text_encoder']['bytes_per_device'] / 1e9:.2f}",
                  f"{w['vae']['bytes_per_device'] / 1e9:.2f}",
                  f"{sum(v['bytes_per_device'] for v in w.values()) / 1e9:.2f}", f"{programs / 1e6:.1f}")
    table.notes.append("Weights per device: each tensor's bytes over the devices its partition splits it across "
                       "(replicated ones whole). A second expert shares the first's programs; its weights count.")
    return table


def run(a: argparse.Namespace) -> Report:
    cases = [(m, t, 1) for m in a.models for t in a.targets if t in MODELS[m][6]]
    if not a.no_shapes:
        cases += [(m, t, n) for m, t in SHAPES if m in a.models for n in (2, 4)]
        cases += [(m, t, 1) for m, t in SHAPES if m in a.models and (m, t, 1) not in cases]
    times: dict[tuple[str, str, int], list[float]] = {c: [] for c in cases}
    for i in range(a.repeats):  # interleaved, so drift hits every case alike
        for c in cases:
            times[c].append(timed(*c, a.work))
        log(f"repeat {i + 1}/{a.repeats} done")
    med = {c: median(ts) for c, ts in times.items()}
    targets = Table(f"export time per target, one shape (medians of {a.repeats})",
                    ["model", "shape", *a.targets])
    for m in a.models:
        _, w, h, f, _, _, _ = MODELS[m]
        base = med.get((m, "cpu", 1))
        cells = []
        for t in a.targets:
            if (m, t, 1) not in med:
                cells.append("-")  # its heads do not divide over the target's tp
            else:
                vs = f" ({ratio(med[m, t, 1], base)})" if base and t != "cpu" else ""
                cells.append(f"{med[m, t, 1]:.1f} s{vs}")
        targets.add(m, f"{w}x{h} x {f}", *cells)
    targets.notes.append("Ratios against the same model's cpu export. The tiny model writes its weights; from names "
                         "writes programs only. -: the model's attention heads do not divide over the target's tp.")
    tables = [targets]
    for m in a.models:
        if "--no-weights" in MODELS[m][5]:
            tables.append(per_device(m, [t for t in a.targets if (m, t, 1) in med], a.work))
    if not a.no_shapes:
        shapes = Table(f"export time by number of shapes (medians of {a.repeats})",
                       ["model", "target", "shapes", "export s", "per extra shape s", "extra shape / first"])
        for m, t in SHAPES:
            if m not in a.models:
                continue
            one = med[m, t, 1]
            for n in (1, 2, 4):
                per = (med[m, t, n] - one) / (n - 1) if n > 1 else None
                shapes.add(m, t, n, num(med[m, t, n]), num(per), ratio(per, one) if per is not None else "-")
        tables.append(shapes)
    raw: dict[str, Any] = {f"{m}/{t}/{n}": ts for (m, t, n), ts in times.items()}
    return Report(tables, raw)
