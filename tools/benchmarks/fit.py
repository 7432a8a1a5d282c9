"""`runtime fit` on the real architectures: each bundle built from its name (--no-weights) for TPU slices, every
program compiled by XLA's TPU compiler on this machine, and its per-device peak against the chips' HBM.

    python tools/bench.py fit                      # the cases below, on tpu-v5e-8 and tpu-v6e-8 (+ v6e-16 for the A14B)
    python tools/bench.py fit --case wan2.1-t2v-14b:720p:81 --target tpu-v6e-8
    python tools/bench.py fit --case wan2.1-t2v-14b:720p:81@tpu-v6e-8 wan2.2-t2v-a14b:720p:81:int8@tpu-v6e-16
    python tools/bench.py fit --from a.json b.json  # one table from earlier runs' --json (nothing compiled)

No TPU is needed and nothing runs (--repeats does not apply). Each fit runs in a fresh process, one at a time. The
programs several bundles share byte for byte (UMT5-XXL's, the VAE decoder's at one size) compile once per slice:
their figures are kept in --work/fit/memo.json by the file's sha256, the topology and libtpu's version, so a second
run compiles only what changed; it is saved after each program, so a run stopped half way resumes there. Compile
time is reported in CPU seconds (the process's, summed over its programs): wall seconds depend on what else the
machine runs.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from .common import Report, Table, Usage, add_common, export, log, spawn

# (architecture, resolution, frames, quantize), targets
CASES: list[tuple[tuple[str, str, int, str | None], tuple[str, ...]]] = [
    (("wan2.1-t2v-1.3b", "480p", 81, None), ("tpu-v5e-8", "tpu-v6e-8")),
    (("wan2.1-t2v-14b", "720p", 81, None), ("tpu-v5e-8", "tpu-v6e-8")),
    (("wan2.1-t2v-14b", "720p", 81, "int8"), ("tpu-v5e-8", "tpu-v6e-8")),
    (("wan2.2-t2v-a14b", "720p", 81, None), ("tpu-v5e-8", "tpu-v6e-8", "tpu-v6e-16")),
    (("wan2.2-t2v-a14b", "720p", 81, "int8"), ("tpu-v5e-8", "tpu-v6e-8", "tpu-v6e-16")),
    (("wan2.2-ti2v-5b", "720p", 121, None), ("tpu-v5e-8", "tpu-v6e-8")),
    (("wan2.1-vace-14b", "720p", 81, None), ("tpu-v5e-8", "tpu-v6e-8")),
    (("wan2.2-animate-14b", "720p", 77, None), ("tpu-v5e-8", "tpu-v6e-8")),
]
GIB = 1 << 30


def fit_child(a: dict[str, Any], spawned: float) -> dict[str, Any]:
    """One `runtime fit` in this fresh process; the memo read, and saved with each program it compiles."""
    from runtime import fit

    memo_path = Path(a["memo"])
    memo = json.loads(memo_path.read_text()) if memo_path.is_file() else {}
    before = set(memo)

    def compiled(c: Any) -> None:
        log(f"  {c.key}: {c.compile_cpu_s:.0f} CPU s")
        save_memo(memo_path, {k: v for k, v in memo.items() if k not in before})

    try:  # every program compiled, whatever the chip's HBM: a bundle that does not fit still gets its figures
        report = fit.fit(Path(a["bundle"]), memo=memo, hbm_gib=float(1 << 20), on_compiled=compiled)
        out = report.to_json()
        out["hbm_bytes"] = int(report.chip.hbm_gib * GIB)
        out["fits"] = {mode: p.total <= out["hbm_bytes"] for mode, p in report.peaks.items()}
    except fit.DoesNotFit as e:  # the compiler refused a program
        out = {"refused": str(e)}
    save_memo(memo_path, new := {k: v for k, v in memo.items() if k not in before})  # a refusal's figures too
    out["compiled_here"] = len(new)
    return out


def save_memo(path: Path, new: dict[str, Any]) -> None:
    """Merge `new` into the memo file (other runs may have added theirs since it was read)."""
    memo = json.loads(path.read_text()) if path.is_file() else {}
    memo.update(new)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(memo))
    tmp.replace(path)


def bundle_for(work: Path, case: tuple[str, str, int, str | None], target: str) -> Path:
    arch, res, frames, quantize = case
    out = work / "fit" / f"{arch}-{res}-f{frames}-{quantize or 'bf16'}-{target}"
    if not (out / "manifest.json").is_file():
        log(f"exporting {out.name}")
        export(["--model", arch, "--no-weights", "--resolution", res, "--frames", str(frames), "--target", target,
                *(["--quantize", quantize] if quantize else [])], out)
    return out


def measure(work: Path, case: tuple[str, str, int, str | None], target: str) -> dict[str, Any]:
    memo_path = work / "fit" / "memo.json"
    bundle = bundle_for(work, case, target)
    log(f"fitting {bundle.name}")
    result = spawn("fit:fit_child", {"bundle": str(bundle), "memo": str(memo_path)})
    return {"case": list(case), "target": target, **result}


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _verdict(fits: dict[str, bool] | bool) -> str:
    if isinstance(fits, bool):  # a result from before modes were told apart
        return "yes" if fits else "**no**"
    if all(fits.values()):
        return "yes"
    return "generate only" if fits.get("generate") else "**no**"


def tables(results: list[dict[str, Any]]) -> list[Table]:
    t = Table("does it fit? every program compiled for the slice by XLA's TPU compiler (per device, GiB)",
              ["model, shape", "stored as", "target (slice)", "programs", "compile CPU s", "weights", "peak (serve)",
               "where", "peak (generate)", "HBM", "fits"])
    big = Table("the largest working sets (per device, GiB): a DiT block (denoise_block_1) and the VAE decoder's next "
                "chunk",
                ["model, shape", "target", "DiT block temp", "DiT block args", "VAE decode temp", "VAE decode args",
                 "Mosaic in the block"])
    for r in results:
        arch, res, frames, quantize = r["case"]
        name = f"{arch}, {res} x {frames}"
        if "refused" in r:
            t.add(name, quantize or "bf16", r["target"], "-", "-", "-", "-", r["refused"], "-", "-", "no")
            continue
        progs = r["programs"]
        peak, gen = r["peaks"]["serve"], r["peaks"]["generate"]
        t.add(name, quantize or "bf16", f"{r['target']} ({r['topology']})", len(progs),
              f"{sum(p['compile_cpu_s'] for p in progs.values()):.0f}", _gib(sum(peak["weights"].values())),
              _gib(peak["bytes"]), f"{peak['program']} ({peak['stage']})", _gib(gen["bytes"]), _gib(r["hbm_bytes"]),
              _verdict(r["fits"]))
        # a kind without a block loop (Animate: its face adapters run between blocks) has its whole step instead
        looped = "denoise_block_1" in progs
        block = progs.get("denoise_block_1" if looped else "denoise_step", {})
        vae = progs.get("vae_decode_next", {})
        big.add(name + (f", {quantize}" if quantize else "") + ("" if looped else " (no block loop: the whole step)"),
                r["target"], _gib(block.get("temp_bytes", 0)),
                _gib(block.get("argument_bytes", 0)), _gib(vae.get("temp_bytes", 0)),
                _gib(vae.get("argument_bytes", 0)), "yes" if block.get("kernel") else "no")
    total = sum(p["compile_cpu_s"] for r in results if "programs" in r for p in r["programs"].values())
    t.notes.append(f"All {len(results)} bundles' programs: {total:.0f} CPU s ({total / 3600:.1f} h) of compiling on "
                   "this machine, a program several bundles share counted in each.")
    t.notes.append("Peak (serve): every stage resident, as `runtime serve` and the Python API hold a bundle; "
                   "peak (generate): one `runtime generate`, which drops each stage's weights once it is past it. "
                   "Weights from the manifest's shapes and shardings; everything else (arguments, temporaries, "
                   "outputs, code) from `compiled.memory_analysis()`. Compile CPU s: the programs this bundle "
                   "needed, including those compiled once for an earlier bundle of the run (the memo). Fits: yes where "
                   "the serve peak is within the chip's HBM, 'generate only' where only a one-shot run's is.")
    return [t, big]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=1, devices=("cpu",))
    p.add_argument("--case", nargs="+", help="ARCH:RESOLUTION:FRAMES[:QUANTIZE][@TARGET] ... (default: the standard "
                   "cases)")
    p.add_argument("--target", nargs="+", help="targets for a --case without @TARGET (default tpu-v5e-8 tpu-v6e-8)")
    p.add_argument("--from", dest="from_json", nargs="+", type=Path, metavar="JSON",
                   help="compile nothing: the tables of the cases in these earlier runs' --json files, in order (the "
                        "cases take 15-80 CPU minutes each on 2 cores, so a table is often several runs')")


def run(a: argparse.Namespace) -> Report:
    if a.from_json:
        results = []
        for path in a.from_json:
            try:
                results += json.loads(path.read_text())["raw"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise Usage(f"--from {path}: not a `tools/bench.py fit --json` file ({e})") from None
        return Report(tables(results), results)
    if a.case:
        cases = []
        for text in a.case:
            spec, _, target = text.partition("@")
            arch, res, frames, *q = spec.split(":")
            targets = (target,) if target else tuple(a.target or ("tpu-v5e-8", "tpu-v6e-8"))
            cases.append(((arch, res, int(frames), q[0] if q else None), targets))
    else:
        cases = CASES
    results = [measure(a.work, case, target) for case, targets in cases for target in targets]
    return Report(tables(results), results)
