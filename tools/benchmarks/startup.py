"""Start-up: process start to the first denoising step done, on a machine's first start (empty compilation cache,
no verified stamp) and on every later one (both warm), side by side, with where the seconds go.

Each start is a fresh process doing what `runtime generate` does up to its first step: import the runtime, open the
bundle (manifest, programs and tokenizer checked), start loading every stage in the background, tokenize and encode
the prompt, run denoising step 1. "first" gives every start a new cache and stamp directory; "warm" reuses ones that
an earlier start filled. The second table is the work behind the phases: per weight group the mapping (+ sha256
when not stamped) and placement, per program deserialization and compilation (background work overlaps the
foreground phases).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import PROMPT, WORKLOADS, Report, Table, add_common, bundle, median, num, ratio, spawn

PHASES = {"imported": "runtime imported", "loaded": "bundle opened", "encoded": "prompt encoded",
          "first_step": "step 1 done"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=5, workloads=("tiny", "1.3b"), dtypes=("fp32",))
    p.add_argument("--bundle", type=Path, default=None, help="measure this bundle instead of the workloads'")


class _Stop(Exception):
    pass


def child(a: dict[str, Any], spawned: float) -> dict[str, float]:
    """One start, in this (fresh) process; times are seconds since the parent spawned it."""
    os.environ["WAN_AOT_STAMP_DIR"] = str(Path(a["cache_dir"]) / "stamps")
    import runtime

    marks = {"imported": time.time() - spawned}
    runtime.enable_compilation_cache(a["cache_dir"])
    pipe = runtime.load(a["bundle"])
    marks["loaded"] = time.time() - spawned
    pipe.start_loading(prompt=PROMPT)  # as generate: the stages before step 1 load in the background
    embeds = pipe.encode(PROMPT)
    marks["encoded"] = time.time() - spawned

    def first(i: int) -> None:
        marks["first_step"] = time.time() - spawned
        raise _Stop

    try:
        pipe.denoise(embeds, seed=0, progress=False, on_step=first)
    except _Stop:
        pass
    pipe.bundle.cancel_prefetch()
    return {**marks, **{f"work: {k}": v for k, v in pipe.bundle.timings.items()}}


def _work(r: dict[str, float]) -> dict[str, float]:
    """The bundle's timings, weight groups one row each (mapped, hashed unless stamped, placed), programs summed."""
    out: dict[str, float] = {}
    for key, seconds in r.items():
        if not key.startswith("work: "):
            continue
        what = key[6:]
        for prefix in ("deserialize ", "compile "):
            if what.startswith(prefix):
                n = sum(k.startswith("work: " + prefix) for k in r)
                what = f"{prefix}{n} programs"
        out[what] = out.get(what, 0.0) + seconds
    return out


def _order(key: str) -> tuple[int, str]:
    return ("check", "weights", "lora", "deserialize", "compile").index(key.split()[0]) \
        if key.split()[0] in ("check", "weights", "lora", "deserialize", "compile") else 9, key


def measure(a: argparse.Namespace, bund: Path) -> dict[str, list[dict[str, float]]]:
    """Every start's marks and work, first and warm interleaved."""
    runs: dict[str, list[dict[str, float]]] = {"first": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="wan-aot-startup-") as tmp:
        warm = str(Path(tmp) / "warm")
        spawn("startup:child", {"bundle": str(bund), "cache_dir": warm}, device=a.device)  # and the OS page cache
        for i in range(a.repeats):  # interleaved, so drift affects both alike
            runs["first"].append(spawn("startup:child", {"bundle": str(bund), "cache_dir": str(Path(tmp) / str(i))},
                                       device=a.device))
            runs["warm"].append(spawn("startup:child", {"bundle": str(bund), "cache_dir": warm}, device=a.device))
    return runs


def run(a: argparse.Namespace) -> Report:
    targets = [(str(a.bundle), a.bundle)] if a.bundle else [
        (f"{w}, {d}", bundle(a.work, WORKLOADS[w], d, a.device)) for w in a.workload for d in a.dtype]
    phases = Table(f"seconds since process spawn ({a.device}; medians of {a.repeats} starts)",
                   ["bundle", "start", *PHASES.values(), "vs first start"])
    work = Table("the work behind the phases (s, medians; background work overlaps the phases)",
                 ["work", *(f"{name}: {k}" for name, _ in targets for k in ("first", "warm"))])
    raw, totals = [], {}
    for name, bund in targets:
        runs = measure(a, bund)
        raw.append({"bundle": str(bund), "runs": runs})
        med = {k: {ph: median([r[ph] for r in v]) for ph in PHASES} for k, v in runs.items()}
        for k in runs:
            phases.add(name, k, *(num(med[k][ph]) for ph in PHASES),
                       ratio(med[k]["first_step"], med["first"]["first_step"]))
        totals[name] = {k: [_work(r) for r in v] for k, v in runs.items()}
    keys = sorted({k for t in totals.values() for v in t.values() for r in v for k in r}, key=_order)
    for key in keys:
        work.add(key, *(num(median([r.get(key, 0.0) for r in totals[name][k]])) for name, _ in targets
                        for k in ("first", "warm")))
    return Report([phases, work], raw)
