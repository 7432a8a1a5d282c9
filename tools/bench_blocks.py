"""The DiT's step as one program per transformer block, called once per block, against the bundle's
one-program step: loading the compiled program, step 1 and a steady step, each mode in fresh processes.

    python tools/bench_blocks.py artifacts/bench/1.3b/bundle-fp32-cpu --repeats 3

Why: on CPU, step 1 of a bundle's `denoise_step` runs 1.5-2.3 s longer than later steps at the 1.3B
widths (XLA's YNNPACK fusions build their executables on first execution, one after another: 576 of them
in the 30 unrolled blocks), and loading its executable from the compilation cache takes about 1 s (the
thunks of every block deserialized). Both grow with the number of blocks in the program. A program of one
block has 1/L of them and runs L times per step with each block's weights, so both should shrink about
L-fold while the arithmetic stays the same. This measures that before the export is changed to it.

"blocks" is block 0 of the bundle's own DiT (built on `meta` from the manifest's config: no checkpoint
needed), exported as the runtime would run it (the bundle's dtype, CPU dots, attention, compiler options),
taking every block's cross-attention keys and values from the bundle's `cross_kv` output by a layer index,
called with each block's placed weights. "step" is the bundle's `denoise_step`. The head (patch and time
embedding) and the tail (output norm and projection, guidance, the UniPC update) a blocks step would add
are not run: at these sizes they are under 1% of a step. Times only; the blocks' values are not compared
(the export's parity tests would be). Text-to-video kinds only (one timestep per sample, text-only
cross-attention).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def export_block(bundle: Path, out: Path) -> None:
    """Block 0 of the bundle's DiT as out/block.jaxexport, and its RoPE tables as out/rope.safetensors."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from diffusers import WanTransformer3DModel
    from safetensors.numpy import save_file

    from export import build, cross_kv, source
    from export.attention import AttentionConfig
    from export.trace import export_program, extract
    from runtime import kinds
    from runtime import manifest
    from runtime.manifest import TensorSpec

    m = manifest.read(bundle)
    kind = kinds.get(m.kind)
    if kind.conditioning != "none" or kind.image_encoder:
        sys.exit(f"bench_blocks: {kind.title} bundles are not covered (text-to-video kinds only)")
    cfg = m.source["config"]["transformer"]
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[m.programs["denoise_step"].inputs["kv"].dtype]
    module = source._empty(lambda: WanTransformer3DModel(**source._init_args(cfg)), dtype)
    block = module.blocks[0]
    a = m.attention
    attention = build.attention_for(m.target, AttentionConfig(block_q=a["block_q"], block_kv=a["block_kv"],
                                                              direct_limit=a["direct_limit"]))
    ex = extract(block, attention, cpu_dots=m.target.platform == "cpu" and dtype == torch.bfloat16)
    g = m.geometry
    with torch.no_grad():
        cos, sin = module.rope(torch.zeros(1, g.latent_channels, g.latent_frames, g.latent_height, g.latent_width))
    kv = m.programs["denoise_step"].inputs["kv"]
    layers, _, n, heads, text, head_dim = kv.shape
    _, ph, pw = cfg["patch_size"]
    tokens = g.latent_frames * (g.latent_height // ph) * (g.latent_width // pw)
    width = heads * head_dim
    model = kv.dtype
    inputs = {"hidden": TensorSpec((n, tokens, width), model), "temb": TensorSpec((n, 6, width), model),
              "cos": TensorSpec(tuple(cos.shape), "float32"), "sin": TensorSpec(tuple(sin.shape), "float32"),
              "kv": kv, "layer": TensorSpec((), "int32")}

    def fn(weights, hidden, temb, c, s, kv, layer):  # noqa: ANN001, ANN202
        mine = jax.lax.dynamic_slice_in_dim(kv, layer, 1, 0)  # (1, 2, n, heads, S, head_dim)
        shell = torch.nn.Module()  # precomputed() patches `blocks` and the condition embedder of a module
        shell.blocks = [block]
        shell.condition_embedder = torch.nn.Module()
        shell.condition_embedder.text_embedder = torch.nn.Identity()
        shell.condition_embedder.image_embedder = None
        with cross_kv.precomputed(shell, ex.env, mine, text):
            return ex.fn(weights, (hidden, jnp.zeros((n, text, 0), model), temb, (c, s)), {})

    specs = {k: TensorSpec(tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in ex.weights.items()}
    blob, _ = export_program(fn, specs, {}, inputs, {}, ["hidden"], jax.sharding.PartitionSpec(), m.target)
    (out / "block.jaxexport").write_bytes(blob)
    save_file({"cos": cos.float().numpy(), "sin": sin.float().numpy()}, str(out / "rope.safetensors"))


def child(mode: str, bundle: str, work: str, steps: int) -> dict[str, object]:
    """One process: load the step ("step") or the block program ("blocks") with the bundle's weights placed
    and the prompt's keys and values computed, then `steps` steps."""
    import jax
    import numpy as np
    from safetensors.numpy import load_file

    import runtime
    from runtime import scheduler

    runtime.enable_compilation_cache(str(Path(work) / "cache"))
    pipe = runtime.load(bundle)
    b = pipe.bundle
    embeds = pipe.encode("a cat playing piano in a jazz club", "blurry, low quality")
    kv = b.call("cross_kv")(np.concatenate([embeds["prompt_embeds"], embeds["negative_prompt_embeds"]]))
    jax.block_until_ready(kv)
    times = []
    if mode == "step":
        t = time.perf_counter()
        step = b.call("denoise_step")
        load = time.perf_counter() - t
        g = pipe.geometry
        state = np.zeros((scheduler.state_rows(pipe.scheduler_config.solver_order), *g.latent_shape), np.float32)
        state[0] = pipe.initial_latents(0)
        plan = scheduler.plan(steps, pipe.manifest.defaults.flow_shift, pipe.scheduler_config)
        for i in range(steps):
            t = time.perf_counter()
            state, finite = step(state, kv, plan.timesteps[i], np.float32(5.0), plan.coeffs[i])
            finite = bool(finite)
            times.append(time.perf_counter() - t)
    else:
        weights = b.weights("transformer", "denoise_step")
        t = time.perf_counter()
        exp = jax.export.deserialize(bytearray((Path(work) / "block.jaxexport").read_bytes()))
        (w_avals, *in_avals), _ = jax.tree.unflatten(exp.in_tree, exp.in_avals)
        sds = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals]
        w_sds = {k: jax.ShapeDtypeStruct(a.shape, a.dtype) for k, a in w_avals.items()}
        block = jax.jit(exp.call).lower(w_sds, *sds).compile(b.compiler_options("denoise_step"))
        load = time.perf_counter() - t
        layers = kv.shape[0]
        per_block = [{k: weights[f"blocks.{i}.{k}"] for k in w_sds} for i in range(layers)]
        rope = load_file(str(Path(work) / "rope.safetensors"))
        rng = np.random.default_rng(0)
        hidden0 = jax.device_put((rng.standard_normal(sds[0].shape) * 0.5).astype(sds[0].dtype))
        temb = jax.device_put((rng.standard_normal(sds[1].shape) * 0.1).astype(sds[1].dtype))
        index = [jax.device_put(np.int32(i)) for i in range(layers)]
        for _ in range(steps):
            t = time.perf_counter()
            hidden = hidden0
            for i in range(layers):
                hidden = block(per_block[i], hidden, temb, rope["cos"], rope["sin"], kv, index[i])
            finite = bool(jax.numpy.isfinite(hidden.astype(np.float32)).all())
            times.append(time.perf_counter() - t)
    return {"load": load, "steps": times, "finite": finite}


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
    with tempfile.TemporaryDirectory(prefix="wan-aot-blocks-") as work:
        export_block(args.bundle, Path(work))
        runs: dict[str, list[dict]] = {"step": [], "blocks": []}
        for r in range(args.repeats + 1):  # round 0 fills the compilation cache
            for mode in runs:
                env = {**os.environ, "WAN_AOT_STAMP_DIR": str(Path(work) / "stamps")}
                out = subprocess.run([sys.executable, __file__, str(args.bundle), "--child", mode, work,
                                      str(args.steps)], env=env, capture_output=True, text=True, check=True)
                result = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[7:])
                if not result["finite"]:
                    sys.exit(f"bench_blocks: {mode} produced non-finite values")
                if r:
                    runs[mode].append(result)
                print(f"[bench_blocks] {'warm-up' if not r else f'repeat {r}'} {mode}: load {result['load']:.2f} s, "
                      f"steps {', '.join(f'{s:.2f}' for s in result['steps'])}", flush=True)
    print(f"\n{args.bundle} ({args.repeats} starts per mode, {args.steps} steps; medians)\n")
    print("| mode | load s (from the cache) | step 1 s | steady step s | step 1 - steady s |")
    print("| --- | --- | --- | --- | --- |")
    for mode, rs in runs.items():
        load = statistics.median(r["load"] for r in rs)
        first = statistics.median(r["steps"][0] for r in rs)
        steady = statistics.median(s for r in rs for s in r["steps"][1:])
        print(f"| {mode} | {load:.2f} | {first:.2f} | {steady:.2f} | {first - steady:+.2f} |")


if __name__ == "__main__":
    main()
