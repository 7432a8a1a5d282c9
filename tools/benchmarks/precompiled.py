"""Executables compiled ahead (issue 72): a cold start of a precompiled bundle against the plain one.

Each start is a fresh process with an empty compilation cache and stamp directory (a new replica's first start):
import the runtime, open the bundle, place every weight and ready every program of every shape as a server does
before it reports ready (`Pipeline.prepare`): "ready"; then one video (`generate`, the workload's shape, 4 steps):
"video". The precompiled bundle is a copy of the plain one after `python -m export precompile` (its build time is
reported). The XLA compilations of each start are counted from jax's own log (jax_log_compiles: "Finished XLA
compilation of ..."): the bundle's programs (jit(call)) apart from the runtime's few helpers (noise, stage). The
frames of both are compared bit for bit.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import PROMPT, ROOT, WORKLOADS, Table, add_common, bundle, each_workload, log, median, num, ratio, spawn

STEPS = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=2, devices=("cpu",), workloads=("tiny", "1.3b"), dtypes=("fp32",))


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.programs = self.others = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("Finished XLA compilation of "):
            if text.startswith("Finished XLA compilation of jit(call)"):
                self.programs += 1
            else:
                self.others += 1


def child(a: dict[str, Any], spawned: float) -> dict[str, Any]:
    """One cold start, in this (fresh) process; times are seconds since the parent spawned it."""
    import os

    os.environ["WAN_AOT_STAMP_DIR"] = str(Path(a["cache_dir"]) / "stamps")
    import jax

    count = _Count()
    for name in ("jax._src.dispatch", "jax._src.interpreters.pxla", "jax._src.compiler"):
        logger = logging.getLogger(name)
        logger.addHandler(count)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
    jax.config.update("jax_log_compiles", True)
    import numpy as np

    import runtime

    runtime.enable_compilation_cache(a["cache_dir"])
    pipe = runtime.load(a["bundle"])
    pipe.prepare()
    ready = time.time() - spawned
    ready_programs = count.programs
    frames = pipe.generate(PROMPT, seed=0, steps=STEPS, progress=False)
    video = time.time() - spawned
    np.save(a["frames"], np.asarray(frames))
    loaded = sum(k.startswith("load executable ") for k in pipe.bundle.timings)
    return {"ready": ready, "video": video, "programs_compiled": count.programs, "ready_programs": ready_programs,
            "other_compiled": count.others, "executables_loaded": loaded}


def _precompile(plain: Path, out: Path) -> tuple[float, int]:
    """A copy of `plain` precompiled (once): the seconds `python -m export precompile` took, the executables' bytes."""
    import json

    from runtime import manifest as mf

    done = out / "manifest.json"
    stamp = out.parent / f"{out.name}.seconds"
    fresh = done.is_file() and stamp.is_file() and stamp.stat().st_mtime > (plain / "manifest.json").stat().st_mtime
    if not (fresh and mf.read(out).executables):  # (an older schema's executables read as none: made anew)
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(plain, out)
        log(f"precompiling {out}")
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "export", "precompile", str(out), "-q"], cwd=ROOT, check=True)
        stamp.write_text(f"{time.perf_counter() - t:.3f}\n")
    files = {e["file"]: e["bytes"] for e in json.loads(done.read_text())["executables"]}
    return float(stamp.read_text()), sum(files.values())


def measure(a: argparse.Namespace, workload: str, dtype: str) -> tuple[list[Table], dict[str, Any]]:
    import numpy as np

    wl = WORKLOADS[workload]
    plain = bundle(a.work, wl, dtype, "cpu")
    pre = plain.parent / f"{plain.name}-precompiled"
    build_s, nbytes = _precompile(plain, pre)
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "precompiled": []}
    same = True
    with tempfile.TemporaryDirectory(prefix="wan-aot-precompiled-") as tmp:
        for i in range(a.repeats):  # interleaved, each start with an empty cache
            for name, path in (("plain", plain), ("precompiled", pre)):
                cache = Path(tmp) / f"{name}-{i}"
                runs[name].append(spawn("precompiled:child", {"bundle": str(path), "cache_dir": str(cache),
                                                              "frames": str(cache) + ".npy"}, device="cpu"))
            same &= bool(np.array_equal(np.load(Path(tmp) / f"plain-{i}.npy"),
                                        np.load(Path(tmp) / f"precompiled-{i}.npy")))
    med = {k: {m: median([r[m] for r in v]) for m in v[0]} for k, v in runs.items()}
    t = Table(f"{workload}, {dtype} ({wl.shape}; cpu; a cold start each: empty compilation cache; {STEPS} steps; "
              f"medians of {a.repeats})",
              ["bundle", "to ready (s)", "to a video (s)", "vs plain", "bundle programs compiled",
               "other compiles", "executables loaded", "frames"])
    for k in runs:
        t.add(k, num(med[k]["ready"]), num(med[k]["video"]), ratio(med[k]["video"], med["plain"]["video"]),
              f"{med[k]['programs_compiled']:.0f}", f"{med[k]['other_compiled']:.0f}",
              f"{med[k]['executables_loaded']:.0f}", "identical" if same else "DIFFER")
    build = Table(f"{workload}, {dtype}: the precompile at build",
                  ["executables (MB)", "python -m export precompile (s)"])
    build.add(num(nbytes / 1e6, 1), num(build_s, 1))
    return [t, build], {"workload": workload, "runs": runs, "identical": same, "precompile_s": build_s,
                        "executable_bytes": nbytes}


def run(a: argparse.Namespace) -> Any:
    return each_workload(a, measure)
