"""Quantized weights (export --quantize) against bf16, side by side in one run.

    python tools/bench_quantize.py bytes                  # weight bytes per device, from --no-weights exports
    python tools/bench_quantize.py cpu --repeats 3        # this CPU: peak RSS, step time, fidelity (tools/quality.py)

bytes: the 1.3B-width model on cpu and the 14B / A14B on tpu-v6e-8 (dp=2, tp=4), exported from their
architecture names with --no-weights in bf16 and each mode; the DiT's (both experts for A14B) and the
text encoder's bytes per device, as `runtime inspect` counts them, and their ratio to bf16.
int8-dynamic stores what int8 stores.

cpu: the 1.3b workload of tools/bench.py (the real Wan2.1-1.3B DiT and VAE with random weights,
128x128, 9 frames, a 1-layer UMT5 of the XXL width), exported in bf16 and each mode from one
checkpoint; each bundle runs in a fresh process per repeat (prompt, --steps steps): the median of
steps 2..N and the peak RSS, medians over repeats; then tools/quality.py against the bf16 bundle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

MODES = ("int8", "fp8", "int8-dynamic")
BYTES_MODELS = {  # name: (architecture, resolution, frames, target)
    "1.3B (cpu)": ("wan2.1-t2v-1.3b", "480p", 81, "cpu"),
    "14B (tpu-v6e-8)": ("wan2.1-t2v-14b", "720p", 81, "tpu-v6e-8"),
    "A14B (tpu-v6e-8)": ("wan2.2-t2v-a14b", "720p", 81, "tpu-v6e-8"),
}


def _export(out: Path, *args: str) -> None:
    if not (out / "manifest.json").is_file():
        print(f"[bench] exporting {out}", flush=True)
        subprocess.run([sys.executable, "-m", "export", *args, "--out", str(out), "--force", "-q"], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}, check=True)


def _per_device(bundle: Path) -> dict[str, int]:
    from runtime import manifest as mf
    from runtime.summary import summarize

    s = summarize(bundle, mf.read(bundle))["weights"]
    return {"dit": sum(w["bytes_per_device"] for g, w in s.items() if g.startswith("transformer")),
            "text_encoder": s["text_encoder"]["bytes_per_device"]}


def bytes_table(work: Path) -> dict[str, Any]:
    rows = {}
    for name, (arch, res, frames, target) in BYTES_MODELS.items():
        for mode in ("bf16", "int8", "fp8"):
            out = work / "bytes" / f"{arch}-{target}-{mode}"
            _export(out, "--model", arch, "--no-weights", "--resolution", res, "--frames", str(frames), "--target",
                    target, *([] if mode == "bf16" else ["--quantize", mode]))
            rows[name, mode] = _per_device(out)
    print("| model | mode | DiT per device | ratio | text encoder per device | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (name, mode), r in rows.items():
        base = rows[name, "bf16"]
        print(f"| {name} | {mode} | {r['dit'] / 1e9:.2f} GB | {r['dit'] / base['dit']:.3f}x | "
              f"{r['text_encoder'] / 1e9:.2f} GB | {r['text_encoder'] / base['text_encoder']:.3f}x |")
    return {f"{n}/{m}": r for (n, m), r in rows.items()}


_CHILD = """
import json, resource, sys, time
import runtime
pipe = runtime.load(sys.argv[1])
embeds = pipe.encode("a cat playing piano in a jazz club", "blurry, low quality")
times = []
pipe.denoise(embeds, seed=0, steps=int(sys.argv[2]), guidance=5.0, progress=False,
             on_step=lambda i: times.append(time.perf_counter()))
print(json.dumps({"steps": [b - a for a, b in zip(times[:-1], times[1:])],
                  "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6}))
"""


def cpu_table(work: Path, repeats: int, steps: int, quality_steps: int) -> dict[str, Any]:
    import bench
    import quality

    import runtime

    ckpt, bf16 = bench.prepare(work, "1.3b", "bf16", "cpu")
    _, w, h, frames, max_len = bench.WORKLOADS["1.3b"]
    bundles = {"bf16": bf16}
    for mode in MODES:
        bundles[mode] = work / "1.3b" / f"bundle-bf16-cpu-{mode}"
        _export(bundles[mode], "--model", str(ckpt), "--resolution", f"{w}x{h}", "--frames", str(frames),
                "--max-sequence-length", str(max_len), "--dtype", "bf16", "--quantize", mode)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in bundles}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "WAN_AOT_CACHE_DIR": cache}
        for i in range(repeats):
            for mode, bundle in bundles.items():  # interleaved, so drift on the machine hits every mode alike
                proc = subprocess.run([sys.executable, "-c", _CHILD, str(bundle), str(steps)], cwd=ROOT, env=env,
                                      capture_output=True, text=True, check=True)
                runs[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(f"[bench] repeat {i + 1}/{repeats}: {mode} done", flush=True)
    result: dict[str, Any] = {}
    for mode, rs in runs.items():
        result[mode] = {"step": statistics.median(statistics.median(r["steps"]) for r in rs),
                        "rss_gb": statistics.median(r["rss_gb"] for r in rs),
                        "weights_gb": sum(_per_device(bundles[mode]).values()) / 1e9}
    ref = runtime.load(bf16)
    for mode in MODES:
        rows = quality.compare(ref, runtime.load(bundles[mode]), list(quality.PROMPTS), [0], quality_steps)
        result[mode].update(quality.summary(rows))
    base = result["bf16"]
    print(f"\n1.3b workload ({w}x{h}, {frames} frames), {steps} steps x {repeats} fresh processes per mode; quality: "
          f"{len(quality.PROMPTS)} prompts, seed 0, {quality_steps} steps against bf16\n")
    print("| mode | DiT + text encoder weights | step | vs bf16 | peak RSS | vs bf16 | PSNR (min) | max error (of 255) "
          "| first-step velocity rel. error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode, r in result.items():
        q = "| - | - | - |" if mode == "bf16" else (f"| {r['psnr_db_min']:.1f} dB | {r['max_error_levels']:.1f} | "
                                                     f"{r['velocity_rel_error_max']:.2e} |")
        print(f"| {mode} | {r['weights_gb']:.2f} GB | {r['step']:.3f} s | {r['step'] / base['step']:.2f}x | "
              f"{r['rss_gb']:.2f} GB | {r['rss_gb'] / base['rss_gb']:.2f}x {q}")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("bytes", "cpu"))
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / "bench")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="denoising steps per timed run (cpu)")
    p.add_argument("--quality-steps", type=int, default=10, help="denoising steps of the fidelity runs (cpu)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    result = bytes_table(args.work) if args.what == "bytes" else cpu_table(args.work, args.repeats, args.steps,
                                                                           args.quality_steps)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
