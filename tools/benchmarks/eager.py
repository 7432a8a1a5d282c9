"""The runtime against the torchax JIT path and diffusers eager: the same video three ways, each start a fresh
process, interleaved.

  runtime  `runtime.load(bundle)` on an exported bundle, with an empty and with a warm compilation cache, each
           stage's weights dropped once past it, as `runtime generate` does (Pipeline.unload_before);
  jit      the seeds' path: torch + torchax + diffusers in process, each stage traced with torchax and jax.jit-ed
           (no export, no cache); the export's own stage functions and the runtime's loop;
  eager    diffusers' WanPipeline in eager PyTorch (VAE in fp32, as the runtime), what a user would run instead.

Per path: import time; cold start (process spawn to denoising step 1 done); steady step (median of steps 2..N);
VAE decode (the second decode of the run); peak RSS. Ratios are against eager. --baseline CHECKOUT also runs the
runtime of another checkout (its own exporter makes its bundle), to measure a change.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import (
    GUIDANCE,
    NEGATIVE,
    PROMPT,
    ROOT,
    WORKLOADS,
    Report,
    Table,
    add_common,
    bundle,
    checkpoint,
    log,
    median,
    num,
    peak_rss_gb,
    ratio,
    spawn,
)

PATHS = ("runtime", "jit", "eager")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, workloads=("tiny", "1.3b"), dtypes=("fp32", "bf16"))
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--steps", type=int, default=4, help="denoising steps per start (>= 2: step 1 is the cold one)")
    p.add_argument("--baseline", type=Path, default=None,
                   help="also run the runtime of this other checkout (e.g. `git worktree add /tmp/before HEAD~3`)")


# -- children: one start each, in a fresh process ------------------------------------------------------------------

def _save_frames(path: str | None, frames: Any) -> None:
    if path:
        import numpy as np
        from safetensors.numpy import save_file

        save_file({"frames": np.ascontiguousarray(frames, np.float32)}, path)


def _run_pipeline(pipe: Any, a: dict[str, Any], spawned: float, marks: dict[str, Any], low_memory: bool) -> None:
    """encode -> denoise (every step timed) -> decode twice, on a runtime Pipeline (paths runtime and jit)."""
    embeds = pipe.encode(PROMPT, NEGATIVE)
    if low_memory:
        pipe.unload_before("denoise")
    steps: list[float] = []
    latents = pipe.denoise(embeds, seed=0, steps=a["steps"], guidance=GUIDANCE, progress=False,
                           on_step=lambda i: steps.append(time.time() - spawned))
    marks["steps"] = steps
    if low_memory:
        pipe.unload_before("decode")
    marks["decode"] = []
    for _ in range(2):
        t = time.time()
        frames = pipe.decode(latents)
        marks["decode"].append(time.time() - t)
    _save_frames(a.get("frames_out"), frames)


def child_runtime(a: dict[str, Any], spawned: float) -> dict[str, Any]:
    import runtime

    marks: dict[str, Any] = {"imported": time.time() - spawned}
    runtime.enable_compilation_cache(a["cache_dir"])
    pipe = runtime.load(a["bundle"])
    prompts = {"prompt": PROMPT, "negative_prompt": NEGATIVE}  # as generate: the programs for their length load
    if "prompt" not in inspect.signature(pipe.start_loading).parameters:  # a --baseline checkout may predate that
        prompts = {}
    if "s" in inspect.signature(pipe.start_loading).parameters:  # the settings resolved once, as the loops pass them
        pipe.start_loading(pipe.settings(steps=a["steps"], guidance=GUIDANCE), **prompts)
    else:  # a --baseline checkout from before that
        pipe.start_loading(steps=a["steps"], guidance=GUIDANCE, **prompts)
    _run_pipeline(pipe, a, spawned, marks, low_memory=True)
    return {**marks, "rss_gb": peak_rss_gb()}


def child_jit(a: dict[str, Any], spawned: float) -> dict[str, Any]:
    """Each stage traced from the checkpoint with torchax and jitted in this process; only metadata (geometry,
    scheduler, tokenizer) comes from the bundle, and the loop is the runtime's."""
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
    g = m.shapes[0]
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

    # The pipeline sees the programs the stages above stand for: the text encoder, cross_kv, the CFG step as one
    # program (no block loop, no short-prompt variants) and the VAE decoder.
    programs = {n: dataclasses.replace(p, blocks=None) for n, p in m.programs.items()
                if kinds.is_text_encoder(n) or n in stages}
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    class JitBundle:  # what runtime.pipeline.Pipeline needs of a Bundle
        path, manifest = Path(a["bundle"]), dataclasses.replace(m, programs=programs)

        def call(self, name: str) -> Any:
            fn, weights = stages["text_encoder" if kinds.is_text_encoder(name) else name]  # jit traces each length
            jitted = jax.jit(fn)
            return lambda *args: jitted(weights, *args)

        def input_shardings(self, name: str, part: str = "") -> list[Any]:
            return [one_device] * len(programs[name].inputs)

        call_shardings = input_shardings

        def prefetch(self, *args: Any) -> None:
            pass

        prefetch_part = cancel_prefetch = unload = prefetch

    _run_pipeline(Pipeline(JitBundle()), a, spawned, marks, low_memory=False)
    return {**marks, "rss_gb": peak_rss_gb()}


def child_eager(a: dict[str, Any], spawned: float) -> dict[str, Any]:
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline

    def sync() -> None:
        if a["device"] == "cuda":
            torch.cuda.synchronize()

    marks: dict[str, Any] = {"imported": time.time() - spawned}
    device, dtype = a["device"], {"bf16": torch.bfloat16, "fp32": torch.float32}[a["dtype"]]
    vae = AutoencoderKLWan.from_pretrained(a["checkpoint"], subfolder="vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(a["checkpoint"], vae=vae, torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    steps: list[float] = []

    def on_step(p: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        sync()
        steps.append(time.time() - spawned)
        return {}

    latents = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=a["height"], width=a["width"],
                   num_frames=a["frames"], num_inference_steps=a["steps"], guidance_scale=GUIDANCE,
                   max_sequence_length=a["max_len"], output_type="latent", callback_on_step_end=on_step).frames
    marks["steps"], marks["decode"] = steps, []
    with torch.no_grad():
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(device)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(device)
        for _ in range(2):
            t = time.time()
            video = vae.decode(latents.to(torch.float32) * std + mean, return_dict=False)[0]
            sync()
            marks["decode"].append(time.time() - t)
    _save_frames(a.get("frames_out"), ((video.float().clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 4, 1).cpu().numpy())
    return {**marks, "rss_gb": peak_rss_gb()}


# -- the measure ---------------------------------------------------------------------------------------------------

def summarize(runs: list[dict[str, Any]]) -> dict[str, float]:
    steady = [b - a for r in runs for a, b in zip(r["steps"][:-1], r["steps"][1:])]
    return {"import": median([r["imported"] for r in runs]), "cold_start": median([r["steps"][0] for r in runs]),
            "step": median(steady), "decode": median([r["decode"][1] for r in runs]),
            "rss_gb": median([r["rss_gb"] for r in runs])}


def measure(a: argparse.Namespace, workload: str, dtype: str) -> tuple[Table, dict[str, Any]]:
    wl = WORKLOADS[workload]
    target = a.device
    ckpt, bund = checkpoint(a.work, wl), bundle(a.work, wl, dtype, target)
    base_bundle = bundle(a.work, wl, dtype, target, root=a.baseline) if a.baseline else None
    base = {"bundle": str(bund), "checkpoint": str(ckpt), "dtype": dtype, "steps": a.steps, "device": a.device,
            "width": wl.width, "height": wl.height, "frames": wl.frames, "max_len": wl.max_len}
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="wan-aot-bench-") as tmp:
        warm = str(Path(tmp) / "warm-cache")
        frames_out = {p: str(Path(tmp) / f"{p}.safetensors") for p in PATHS}
        plan: list[tuple[str, str, dict[str, Any], Path | None]] = []  # (row, child, its arguments, checkout)
        if "runtime" in a.paths:
            spawn("eager:child_runtime", {**base, "cache_dir": warm}, device=a.device)  # fills the warm cache
            plan += [("runtime, empty cache", "runtime", {**base, "cache_dir": None}, None),
                     ("runtime, warm cache", "runtime", {**base, "cache_dir": warm,
                                                         "frames_out": frames_out["runtime"]}, None)]
        if base_bundle is not None:
            before = {**base, "bundle": str(base_bundle), "cache_dir": str(Path(tmp) / "baseline-cache")}
            spawn("eager:child_runtime", before, device=a.device, root=a.baseline)
            plan.append(("runtime before, warm cache", "runtime", before, a.baseline))
        plan += [(p, p, {**base, "frames_out": frames_out[p]}, None) for p in ("jit", "eager") if p in a.paths]
        for i in range(a.repeats):  # interleaved, so that drift on the machine affects every path alike
            for row, child, args, root in plan:
                if args.get("cache_dir", "") is None:
                    args = {**args, "cache_dir": str(Path(tmp) / f"empty-{i}")}
                runs.setdefault(row, []).append(spawn(f"eager:child_{child}", args, device=a.device,
                                                      root=root or ROOT))
                log(f"{workload} {dtype} repeat {i + 1}/{a.repeats}: {row} done")
        diffs = _frame_diffs(frames_out)
    paths = {k: summarize(v) for k, v in runs.items()}
    eager = paths.get("eager")
    t = Table(f"{workload}, {dtype} ({wl.shape}; {a.device}; {a.steps} steps, guidance {GUIDANCE:g}; median of "
              f"{a.repeats} starts)", ["path", "import s", "cold start s", "steady step s", "VAE decode s",
                                       "peak RSS GB"])
    for name, s in paths.items():
        cells = []
        for key, digits in (("import", 2), ("cold_start", 2), ("step", 3), ("decode", 3), ("rss_gb", 2)):
            cell = num(s[key], digits)
            if eager and name != "eager":
                cell += f" ({ratio(s[key], eager[key])})"
            cells.append(cell)
        t.add(name, *cells)
    t.notes.append("Ratios are against diffusers eager. Cold start: process spawn to step 1 done. Max |frames - "
                   "runtime's|: " + (", ".join(f"{p} {d:.1e}" for p, d in diffs.items()) or "-")
                   + " (eager draws its noise from torch, so its frames differ by design).")
    return t, {"workload": workload, "dtype": dtype, "paths": paths, "raw": runs, "frame_diffs": diffs}


def _frame_diffs(files: dict[str, str]) -> dict[str, float]:
    from safetensors.numpy import load_file

    if not Path(files["runtime"]).is_file():
        return {}
    ref = load_file(files["runtime"])["frames"]
    return {p: float(abs(load_file(f)["frames"] - ref).max()) for p, f in files.items()
            if p != "runtime" and Path(f).is_file()}


def run(a: argparse.Namespace) -> Report:
    if a.steps < 2:
        raise SystemExit("error: --steps must be at least 2 (step 1 is the cold one)")
    tables, raw = [], []
    for workload in a.workload:
        for dtype in a.dtype:
            t, r = measure(a, workload, dtype)
            tables.append(t)
            raw.append(r)
    return Report(tables, raw)
