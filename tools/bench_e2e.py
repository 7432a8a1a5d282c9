"""End to end, process start to mp4 written: `runtime generate` against a diffusers `WanPipeline` script.

    python tools/bench_e2e.py                       # fp32 and bf16, 3 pairs each
    python tools/bench_e2e.py --dtypes fp32 --pairs 5

Both sides are timed as whole processes (spawn to exit, the mp4 written), in turn, pair by pair,
with the same model, size, steps, guidance and prompts. The model has the Wan2.1-1.3B widths with
6 DiT layers, the real Wan VAE and a 1-layer UMT5 of the XXL width as its text encoder (random
weights, saved in diffusers format), at 160x96, 9 frames, 6 steps, guidance 5. Eager runs the VAE
in fp32, as the runtime does, and writes its mp4 with the runtime's writer, so the encoders match.
Before the pairs, one untimed runtime start fills the compilation cache and the verified stamp, as
any earlier run on the machine would have. Per start: wall time, user and system CPU time, peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "a cat playing piano in a jazz club"
NEGATIVE = "blurry, low quality"
WIDTH, HEIGHT, FRAMES, STEPS, GUIDANCE, MAX_LEN, LAYERS = 160, 96, 9, 6, 5.0, 512, 6


def spec() -> dict[str, Any]:
    from export.architectures import ARCHITECTURES

    arch = ARCHITECTURES["wan2.1-t2v-1.3b"]
    return dict(transformer={**arch["transformer"], "num_layers": LAYERS}, vae=dict(arch["vae"]),
                text_encoder=dict(d_model=4096, d_kv=64, d_ff=256, num_layers=1, num_heads=2), flow_shift=3.0)


def eager_child(checkpoint: str, dtype: str, out: str) -> None:
    """What a diffusers user runs: WanPipeline in eager PyTorch, then the frames to mp4."""
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline

    from runtime.video import write_video

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    vae = AutoencoderKLWan.from_pretrained(checkpoint, subfolder="vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(checkpoint, vae=vae, torch_dtype=torch_dtype)
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                  num_inference_steps=STEPS, guidance_scale=GUIDANCE, max_sequence_length=MAX_LEN,
                  output_type="np").frames
    write_video(frames[0], out, fps=16)


def timed(cmd: list[str], env: dict[str, str]) -> dict[str, float]:
    """Run `cmd` to completion: wall seconds, CPU seconds and peak RSS of that process alone."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[:4])} ... failed:\n{err[-3000:]}")
    return {"wall": wall, "user": usage.ru_utime, "sys": usage.ru_stime, "rss_gb": usage.ru_maxrss / 1e6}


def prepare(work: Path, dtype: str) -> tuple[Path, Path]:
    ckpt = work / "checkpoint"
    if not (ckpt / "model_index.json").is_file():
        print(f"[e2e] building the checkpoint in {ckpt}", flush=True)
        from export import tiny

        tiny.build_pipeline(spec()).save_pretrained(str(ckpt), safe_serialization=True)
    bundle = work / f"bundle-{dtype}-cpu"
    if not (bundle / "manifest.json").is_file():
        print(f"[e2e] exporting {bundle}", flush=True)
        subprocess.run([sys.executable, "-m", "export", "--model", str(ckpt), "--resolution", f"{WIDTH}x{HEIGHT}",
                        "--frames", str(FRAMES), "--max-sequence-length", str(MAX_LEN), "--dtype", dtype,
                        "--target", "cpu", "--out", str(bundle), "--force", "-q"], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    return ckpt, bundle


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--eager-child":
        eager_child(*sys.argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / "bench" / "e2e")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    results = {}
    with tempfile.TemporaryDirectory(prefix="wan-aot-e2e-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
               "WAN_AOT_CACHE_DIR": str(Path(tmp) / "jax-cache"), "WAN_AOT_STAMP_DIR": str(Path(tmp) / "stamps")}
        for dtype in args.dtypes:
            ckpt, bundle = prepare(args.work, dtype)
            out = str(Path(tmp) / f"{dtype}.mp4")
            runtime_cmd = [sys.executable, "-m", "runtime", "generate", str(bundle), "--prompt", PROMPT,
                           "--negative-prompt", NEGATIVE, "--steps", str(STEPS), "--guidance", str(GUIDANCE),
                           "--out", out, "-q"]
            eager_cmd = [sys.executable, __file__, "--eager-child", str(ckpt), dtype, out]
            timed(runtime_cmd, env)  # fills the compilation cache and the stamp
            pairs = []
            for i in range(args.pairs):
                pair = {"runtime": timed(runtime_cmd, env), "eager": timed(eager_cmd, env)}
                pairs.append(pair)
                r, e = pair["runtime"], pair["eager"]
                print(f"[e2e] {dtype} pair {i + 1}: runtime {r['wall']:.1f} s (sys {r['sys']:.1f}, "
                      f"{r['rss_gb']:.2f} GB), eager {e['wall']:.1f} s (sys {e['sys']:.1f}, "
                      f"{e['rss_gb']:.2f} GB), ratio {r['wall'] / e['wall']:.2f}", flush=True)
            results[dtype] = pairs

    print(f"\nprocess start to mp4 written, {WIDTH}x{HEIGHT}, {FRAMES} frames, {STEPS} steps, guidance {GUIDANCE}, "
          f"1.3B widths with {LAYERS} DiT layers; medians of {args.pairs} pairs")
    print("| dtype | runtime s | eager s | runtime / eager (median of pair ratios) | runtime sys s | eager sys s "
          "| runtime peak RSS GB | eager peak RSS GB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for dtype, pairs in results.items():
        def med(side: str, key: str, pairs: list[dict[str, Any]] = pairs) -> float:
            return statistics.median(p[side][key] for p in pairs)

        ratio = statistics.median(p["runtime"]["wall"] / p["eager"]["wall"] for p in pairs)
        print(f"| {dtype} | {med('runtime', 'wall'):.1f} | {med('eager', 'wall'):.1f} | {ratio:.2f} | "
              f"{med('runtime', 'sys'):.1f} | {med('eager', 'sys'):.1f} | {med('runtime', 'rss_gb'):.2f} | "
              f"{med('eager', 'rss_gb'):.2f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
