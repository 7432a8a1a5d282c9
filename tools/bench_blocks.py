"""A bundle's denoise step with its blocks as one program called once per block (how the runtime runs it), against
the same step compiled whole: loading the compiled step, step 1 and a steady step, each mode in fresh processes.

    python tools/bench_blocks.py artifacts/bench/1.3b/bundle-fp32-cpu --repeats 3

Why: XLA compiles each block of a whole step into its own code. On CPU, loading that executable from the
compilation cache took about 1 s at the 1.3B widths (30 blocks), and step 1 ran about 2 s longer than later
steps: XLA's YNNPACK fusions build their executables on first execution, one after another, 576 of them. One
block program has 1/30 of that code and runs 30 times per step with each block's weights (export/denoise_blocks.py).

"blocks" is `runtime.load(bundle)` as it is; "whole" compiles the same head, block and tail programs as one XLA
program (`Bundle.compile_whole`, the step as bundles before the block loop ran it) and runs it in their place.
Both run `Pipeline.denoise` on the same prompt (and a gray image for image-to-video kinds), with the weights
placed and the other programs compiled before the step program is loaded, so step 1 includes the prompt's
keys and values (cross_kv) in both. Prints the latents' largest difference between the modes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def child(mode: str, bundle: str, work: str, steps: int) -> dict[str, object]:
    import numpy as np
    from PIL import Image

    import runtime
    from runtime import kinds

    runtime.enable_compilation_cache(str(Path(work) / "cache"))
    pipe = runtime.load(bundle)
    b = pipe.bundle
    kind = pipe.kind
    gray = Image.new("RGB", (pipe.geometry.width, pipe.geometry.height), (128, 128, 128))
    image = gray if kind.image == "required" else None
    embeds = pipe.encode("a cat playing piano in a jazz club", "blurry, low quality", image,
                         gray if kind.last_image else None)
    name = kinds.denoise_program(0)
    b.call(kinds.cross_kv_program(0))  # weights placed, cross_kv compiled: what is left is the step's own load
    t = time.perf_counter()
    if mode == "whole":  # the step compiled as one program, run by the bundle's own call in place of the loop
        compiled = b.compile_whole(name)
        b.manifest.programs[name] = dataclasses.replace(b.manifest.programs[name], blocks=None)
        b.compile = lambda program, part="": compiled
    b.call(name)
    load = time.perf_counter() - t
    marks = [time.perf_counter()]
    latents = pipe.denoise(embeds, seed=0, steps=steps, guidance=5.0, progress=False,
                           on_step=lambda i: marks.append(time.perf_counter()))
    np.save(Path(work) / f"{mode}.npy", latents)
    return {"load": load, "steps": [b - a for a, b in zip(marks, marks[1:])]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path)
    p.add_argument("--repeats", type=int, default=3, help="starts per mode, alternating (after one warm-up each)")
    p.add_argument("--steps", type=int, default=3, help="steps per start (>= 2: step 1 is the cold one)")
    p.add_argument("--child", nargs=3, metavar=("MODE", "WORK", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        mode, work, steps = args.child
        print("RESULT " + json.dumps(child(mode, str(args.bundle), work, int(steps))), flush=True)
        return
    if args.steps < 2:
        p.error("--steps must be at least 2")
    import numpy as np

    runs: dict[str, list[dict]] = {"whole": [], "blocks": []}
    with tempfile.TemporaryDirectory(prefix="wan-aot-blocks-") as work:
        for r in range(args.repeats + 1):  # round 0 fills the compilation cache
            for mode in runs:
                env = {**os.environ, "WAN_AOT_STAMP_DIR": str(Path(work) / "stamps")}
                out = subprocess.run([sys.executable, __file__, str(args.bundle), "--child", mode, work,
                                      str(args.steps)], env=env, capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"bench_blocks: the {mode} start failed:\n{out.stderr[-3000:]}")
                result = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[7:])
                if r:
                    runs[mode].append(result)
                print(f"[bench_blocks] {'warm-up' if not r else f'repeat {r}'} {mode}: load {result['load']:.2f} s, "
                      f"steps {', '.join(f'{s:.2f}' for s in result['steps'])}", flush=True)
        diff = float(np.abs(np.load(Path(work) / "whole.npy") - np.load(Path(work) / "blocks.npy")).max())
    print(f"\n{args.bundle} ({args.repeats} starts per mode, {args.steps} steps; medians; warm compilation cache)\n")
    print("| step program | load s | step 1 s | steady step s | step 1 - steady s |")
    print("| --- | --- | --- | --- | --- |")
    for mode, rs in runs.items():
        load = statistics.median(r["load"] for r in rs)
        first = statistics.median(r["steps"][0] for r in rs)
        steady = statistics.median(s for r in rs for s in r["steps"][1:])
        label = {"whole": "one program (whole)", "blocks": "block loop (the runtime)"}[mode]
        print(f"| {label} | {load:.2f} | {first:.2f} | {steady:.2f} | {first - steady:+.2f} |")
    print(f"\nlatents, largest |whole - blocks|: {diff:.2e}")


if __name__ == "__main__":
    main()
