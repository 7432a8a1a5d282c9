"""The runtime against the JIT path and diffusers, side by side in one run.

    python tools/bench.py                                  # tiny and 1.3b, fp32 and bf16, 3 repeats
    python tools/bench.py --workloads tiny --dtypes fp32 --repeats 5
    python tools/bench.py --device cuda                    # on a GPU machine: cuda bundles, torch on cuda

Three ways to make the same video, each start a fresh process:
  runtime  `runtime.load(bundle)` on an exported bundle (1a: empty compilation cache, 1b: warm cache), each
           stage's weights dropped once past it, as `runtime generate` does (Pipeline.unload_before);
  jit      the seeds' path: torch + torchax + diffusers in process, each stage traced with torchax and
           jax.jit-ed (no export, no cache); the same stage functions and the same loop as the runtime;
  eager    diffusers' WanPipeline in eager PyTorch (VAE in fp32, as the runtime).
Per path: import time; cold start (process spawn to denoising step 1 done); steady step (median
of steps 2..N); VAE decode (second decode of the run); peak RSS. Medians over --repeats starts.
Workloads: the embedded tiny model (256x144, 17 frames), and the real Wan2.1-1.3B DiT and VAE with
random weights (128x128, 9 frames) whose text encoder is a 1-layer UMT5 of the XXL width (4096),
since UMT5-XXL itself (11 GB in bf16, 23 GB in fp32) does not fit this machine beside the rest.
Checkpoints and bundles are built once under --work (default artifacts/bench/).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
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
GUIDANCE = 5.0


def _spec_1_3b() -> dict[str, Any]:
    from export.architectures import ARCHITECTURES

    arch = ARCHITECTURES["wan2.1-t2v-1.3b"]
    return dict(transformer=dict(arch["transformer"]), vae=dict(arch["vae"]),
                text_encoder=dict(d_model=4096, d_kv=64, d_ff=256, num_layers=1, num_heads=2), flow_shift=3.0)


WORKLOADS = {  # name: (tiny variant or spec builder, width, height, frames, max sequence length)
    "tiny": ("tiny", 256, 144, 17, 512),
    "1.3b": (_spec_1_3b, 128, 128, 9, 512),
}


# -- children: one start each, in a fresh process --------------------------------------------------

def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KB on Linux


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _save_frames(path: str | None, frames: Any) -> None:
    if path:
        import numpy as np
        from safetensors.numpy import save_file

        save_file({"frames": np.ascontiguousarray(frames, np.float32)}, path)


def _run_pipeline(pipe: Any, a: dict[str, Any], spawned: float, marks: dict[str, Any],
                  low_memory: bool = False) -> None:
    """encode -> denoise (every step timed) -> decode twice, on a runtime Pipeline (paths runtime and jit);
    `low_memory`: each stage's weights dropped once past it, as `runtime generate` does."""
    embeds = pipe.encode(PROMPT, NEGATIVE)
    if low_memory:
        pipe.unload_before("denoise")
    steps: list[float] = []
    latents = pipe.denoise(embeds, seed=0, steps=a["steps"], guidance=GUIDANCE, progress=False,
                           on_step=lambda i: steps.append(time.time() - spawned))
    marks["steps"] = steps
    if low_memory:
        pipe.unload_before("decode")
    decodes = []
    for _ in range(2):
        t = time.time()
        frames = pipe.decode(latents)
        decodes.append(time.time() - t)
    marks["decode"] = decodes
    _save_frames(a.get("frames_out"), frames)


def child_runtime(a: dict[str, Any], spawned: float) -> dict[str, Any]:
    import runtime

    marks: dict[str, Any] = {"imported": time.time() - spawned}
    if a["cache_dir"]:
        runtime.enable_compilation_cache(a["cache_dir"])
    pipe = runtime.load(a["bundle"])
    # as generate: with the prompts, so that the programs for their length load (a --baseline checkout may predate that)
    prompts = {"prompt": PROMPT, "negative_prompt": NEGATIVE}
    if "prompt" not in inspect.signature(pipe.start_loading).parameters:
        prompts = {}
    pipe.start_loading(steps=a["steps"], guidance=GUIDANCE, **prompts)
    _run_pipeline(pipe, a, spawned, marks, low_memory=True)  # as `runtime generate`
    marks["rss_gb"] = _rss_gb()
    return marks


def child_jit(a: dict[str, Any], spawned: float) -> dict[str, Any]:
    """Trace each stage from the checkpoint with torchax and jit it, in this process.

    Only metadata (geometry, scheduler, tokenizer) comes from the bundle; the programs are the
    export's own stage functions, jitted instead of serialized, and the loop is the runtime's.
    """
    import gc

    import jax
    import ml_dtypes
    import numpy as np
    import torch

    from export import build, cross_kv, source
    from export import denoise as denoise_stage
    from export import text_encoder as text_stage
    from export import vae as vae_stage
    from export.attention import AttentionConfig
    from runtime import kinds, scheduler
    from runtime import manifest as mf
    from runtime.pipeline import Pipeline

    marks: dict[str, Any] = {"imported": time.time() - spawned}
    m = mf.read(Path(a["bundle"]))
    g = m.geometry
    src = source.load(a["checkpoint"], a["dtype"])
    attention = build.attention_for(m.target, AttentionConfig())

    def to_jax(weights: dict[str, Any]) -> dict[str, jax.Array]:
        out = {}
        for k, t in weights.items():
            t = t.detach().to("cpu").contiguous()
            arr = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
            out[k] = jax.device_put(np.array(arr, copy=True))
        return out

    def release(module: Any) -> None:  # the weights now live in jax (as torchax's module.to("jax") leaves them)
        for t in [*module.parameters(), *module.buffers()]:
            t.data = torch.empty(0, dtype=t.dtype)
        gc.collect()

    stages: dict[str, tuple[Any, dict[str, jax.Array]]] = {}
    with torch.no_grad():
        module, ex = build.load_component(src, "text_encoder", attention, platform=m.target.platform)
        stages["text_encoder"] = (text_stage.build(ex), to_jax(ex.weights))
        release(module)
        module, ex = build.load_component(src, "transformer", attention, platform=m.target.platform)
        model_dtype = np.dtype({"bf16": "bfloat16", "fp32": "float32"}[a["dtype"]])
        order = scheduler.UniPCConfig.from_json(m.scheduler).solver_order
        kind = kinds.get(m.kind)
        patch = tuple(src.transformer_config["patch_size"][1:])
        dit_weights = to_jax(ex.weights)
        stages["cross_kv"] = (cross_kv.build(ex, model_dtype), dit_weights)
        stages["denoise_step"] = (denoise_stage.build(ex, order, model_dtype, kind, g.max_sequence_length, patch),
                                  dit_weights)
        release(module)
        vae, ex = build.load_component(src, "vae", attention, platform=m.target.platform)
        caches = vae_stage.cache_specs(vae, "decode", g.batch, g.latent_height, g.latent_width)
        w = to_jax(ex.weights)
        stages["vae_decode_first"] = (vae_stage.build_decode(vae, ex.fn, caches, first=True), w)
        stages["vae_decode_next"] = (vae_stage.build_decode(vae, ex.fn, caches, first=False), w)
        release(vae)

    class JitBundle:  # what runtime.pipeline.Pipeline needs of a Bundle
        path, manifest = Path(a["bundle"]), m

        def call(self, name: str) -> Any:
            fn, weights = stages["text_encoder" if kinds.is_text_encoder(name) else name]  # jit traces each length
            jitted = jax.jit(fn)
            return lambda *args: jitted(weights, *args)

        def input_shardings(self, name: str) -> list[Any]:
            return [jax.sharding.SingleDeviceSharding(jax.devices()[0])] * 8

    _run_pipeline(Pipeline(JitBundle()), a, spawned, marks)
    marks["rss_gb"] = _rss_gb()
    return marks


def child_eager(a: dict[str, Any], spawned: float) -> dict[str, Any]:
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline

    marks: dict[str, Any] = {"imported": time.time() - spawned}
    device, dtype = a["device"], {"bf16": torch.bfloat16, "fp32": torch.float32}[a["dtype"]]
    vae = AutoencoderKLWan.from_pretrained(a["checkpoint"], subfolder="vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(a["checkpoint"], vae=vae, torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    steps: list[float] = []

    def on_step(p: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        _sync(device)
        steps.append(time.time() - spawned)
        return {}

    latents = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=a["height"], width=a["width"],
                   num_frames=a["frames"], num_inference_steps=a["steps"], guidance_scale=GUIDANCE,
                   max_sequence_length=a["max_len"], output_type="latent", callback_on_step_end=on_step).frames
    marks["steps"] = steps
    decodes = []
    with torch.no_grad():
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(device)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(device)
        for _ in range(2):
            t = time.time()
            video = vae.decode(latents.to(torch.float32) * std + mean, return_dict=False)[0]
            _sync(device)
            decodes.append(time.time() - t)
    marks["decode"] = decodes
    frames = ((video.float().clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 4, 1).cpu().numpy()
    _save_frames(a.get("frames_out"), frames)
    marks["rss_gb"] = _rss_gb()
    return marks


CHILDREN = {"runtime": child_runtime, "jit": child_jit, "eager": child_eager}


def spawn(path: str, args: dict[str, Any], root: Path = ROOT) -> dict[str, Any]:
    """One start of `path` in a fresh process, running the code of the checkout at `root`."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    spawned = time.time()
    proc = subprocess.run([sys.executable, __file__, "--child", path, json.dumps(args), repr(spawned)], env=env,
                          capture_output=True, text=True, cwd=root)
    if proc.returncode != 0:
        raise SystemExit(f"error: the {path} child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- preparation ---------------------------------------------------------------------------------

def prepare(work: Path, workload: str, dtype: str, target: str, root: Path = ROOT) -> tuple[Path, Path]:
    """(checkpoint, bundle) for a workload, built once (the bundle by the exporter of the checkout at `root`)."""
    variant, w, h, frames, max_len = WORKLOADS[workload]
    ckpt = work / workload / "checkpoint"
    if not (ckpt / "model_index.json").is_file():
        print(f"[bench] building the {workload} checkpoint in {ckpt}", flush=True)
        from export import tiny

        pipe = tiny.build_pipeline(variant if isinstance(variant, str) else variant())
        pipe.save_pretrained(str(ckpt), safe_serialization=True)
        del pipe
    bundle = work / workload / f"bundle-{dtype}-{target}"
    if not (bundle / "manifest.json").is_file():
        print(f"[bench] exporting {bundle}", flush=True)
        subprocess.run([sys.executable, "-m", "export", "--model", str(ckpt), "--resolution", f"{w}x{h}",
                        "--frames", str(frames), "--max-sequence-length", str(max_len), "--dtype", dtype,
                        "--target", target, "--out", str(bundle), "--force", "-q"], cwd=root,
                       env={**os.environ, "PYTHONPATH": str(root)}, check=True)
    return ckpt, bundle


# -- installed sizes ---------------------------------------------------------------------------------

def installed_mb(roots: list[str]) -> tuple[float, list[str]]:
    """Size on disk of the distributions `roots` need (transitively, no extras)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = [canonicalize_name(r) for r in roots]
    total = 0
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        total += sum(dist.locate_file(f).stat().st_size for f in dist.files or [] if dist.locate_file(f).exists())
        for req in dist.requires or []:
            r = Requirement(req)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(r.name))
    return total / 1e6, sorted(seen)


def dependency_sizes() -> dict[str, float]:
    from importlib import metadata

    from packaging.requirements import Requirement

    reqs = [Requirement(r) for r in metadata.distribution("wan-aot").requires or []]
    runtime_roots = [r.name for r in reqs if r.marker is None]
    export_roots = runtime_roots + [r.name for r in reqs if r.marker is not None
                                    and r.marker.evaluate({"extra": "export"})]
    return {"runtime": installed_mb(runtime_roots)[0], "runtime+export": installed_mb(export_roots)[0]}


# -- the run -------------------------------------------------------------------------------------------

def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    steady = [b - a for r in runs for a, b in zip(r["steps"][:-1], r["steps"][1:])]
    return {"import": median([r["imported"] for r in runs]), "cold_start": median([r["steps"][0] for r in runs]),
            "step": median(steady), "decode": median([r["decode"][1] for r in runs]),
            "rss_gb": median([r["rss_gb"] for r in runs])}


def bench(work: Path, workload: str, dtype: str, repeats: int, steps: int, device: str,
          paths: list[str], caches: tuple[str, ...] = ("empty", "warm"), baseline: Path | None = None
          ) -> dict[str, Any]:
    target = "cuda" if device == "cuda" else "cpu"
    ckpt, bundle = prepare(work, workload, dtype, target)
    if baseline is not None:  # the same checkpoint, exported and run by another checkout (e.g. before a change)
        link = work / "baseline" / workload / "checkpoint"
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(ckpt.resolve())
        base_bundle = prepare(work / "baseline", workload, dtype, target, baseline)[1]
    _, w, h, frames, max_len = WORKLOADS[workload]
    base = {"bundle": str(bundle), "checkpoint": str(ckpt), "dtype": dtype, "steps": steps, "device": device,
            "width": w, "height": h, "frames": frames, "max_len": max_len}
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="wan-aot-bench-") as tmp:
        warm = str(Path(tmp) / "warm-cache")
        frames_out = {p: str(Path(tmp) / f"{p}.safetensors") for p in ("runtime", "jit", "eager")}
        if "runtime" in paths:
            spawn("runtime", {**base, "cache_dir": warm})  # fills the warm cache
        if baseline is not None:
            base_args = {**base, "bundle": str(base_bundle), "cache_dir": str(Path(tmp) / "baseline-cache")}
            spawn("runtime", base_args, baseline)
        for i in range(repeats):  # interleaved, so that drift on the machine affects every path alike
            for p in paths:
                if p == "runtime":
                    if "empty" in caches:
                        runs.setdefault("runtime (empty cache)", []).append(
                            spawn("runtime", {**base, "cache_dir": str(Path(tmp) / f"empty-{i}")}))
                    if "warm" in caches:
                        runs.setdefault("runtime (warm cache)", []).append(
                            spawn("runtime", {**base, "cache_dir": warm, "frames_out": frames_out["runtime"]}))
                else:
                    runs.setdefault(p, []).append(spawn(p, {**base, "frames_out": frames_out[p]}))
                print(f"[bench] {workload} {dtype} repeat {i + 1}/{repeats}: {p} done", flush=True)
            if baseline is not None:
                runs.setdefault("runtime before (warm cache)", []).append(spawn("runtime", base_args, baseline))
                print(f"[bench] {workload} {dtype} repeat {i + 1}/{repeats}: baseline done", flush=True)
        diffs = _frame_diffs(frames_out)
    return {"workload": workload, "dtype": dtype, "device": device, "repeats": repeats, "steps": steps,
            "geometry": f"{w}x{h}, {frames} frames, {max_len} tokens",
            "paths": {k: summarize(v) for k, v in runs.items()}, "raw": runs, "frame_diffs": diffs}


def _frame_diffs(files: dict[str, str]) -> dict[str, float]:
    """Max |frames - runtime's frames| (same seed and noise for jit; eager draws torch noise)."""
    from safetensors.numpy import load_file

    if not Path(files["runtime"]).is_file():
        return {}
    ref = load_file(files["runtime"])["frames"]
    return {p: float(abs(load_file(f)["frames"] - ref).max()) for p, f in files.items()
            if p != "runtime" and Path(f).is_file()}


def table(result: dict[str, Any]) -> str:
    paths = result["paths"]
    base = paths.get("runtime (warm cache)")
    lines = [f"### {result['workload']}, {result['dtype']} ({result['geometry']}; {result['device']}; "
             f"{result['steps']} steps, median of {result['repeats']} starts)", "",
             "| path | import s | cold start s | steady step s | VAE decode s | peak RSS GB |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, s in paths.items():
        cells = []
        for key, fmt in (("import", ".2f"), ("cold_start", ".2f"), ("step", ".3f"), ("decode", ".3f"),
                         ("rss_gb", ".2f")):
            cell = format(s[key], fmt)
            if base and name != "runtime (warm cache)":
                cell += f" ({s[key] / base[key]:.2f}x)"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Ratios are against the runtime with a warm cache. Max |frames - runtime's|: "
                 + ", ".join(f"{p} {d:.1e}" for p, d in result["frame_diffs"].items())
                 + " (eager draws its noise from torch, so its frames differ by design)")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(CHILDREN[sys.argv[2]](json.loads(sys.argv[3]), float(sys.argv[4]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--paths", nargs="+", default=["runtime", "jit", "eager"], choices=list(CHILDREN))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--caches", nargs="+", default=["empty", "warm"], choices=["empty", "warm"],
                   help="runtime starts with an empty and/or a warm compilation cache")
    p.add_argument("--steps", type=int, default=4, help="denoising steps per start (>= 2: step 1 is the cold one)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / "bench")
    p.add_argument("--baseline", type=Path, default=None,
                   help="also run the runtime of this other checkout (e.g. `git worktree add /tmp/before HEAD~3`), "
                        "interleaved, as 'runtime before'; its bundles are exported by its own exporter")
    p.add_argument("--json", type=Path, default=None, help="also write every measurement here")
    args = p.parse_args()

    results = []
    for workload in args.workloads:
        for dtype in args.dtypes:
            results.append(bench(args.work, workload, dtype, args.repeats, args.steps, args.device, args.paths,
                                 tuple(args.caches), args.baseline))
            print("\n" + table(results[-1]) + "\n", flush=True)
    sizes = dependency_sizes()
    print(f"installed size: runtime dependencies {sizes['runtime']:.0f} MB, runtime + export dependencies "
          f"{sizes['runtime+export']:.0f} MB ({sizes['runtime+export'] / sizes['runtime']:.1f}x)")
    if args.json:
        args.json.write_text(json.dumps({"results": results, "installed_mb": sizes}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
