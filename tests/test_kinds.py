"""Wan 2.2 and image-to-video against diffusers: every configuration WanPipeline and WanImageToVideoPipeline
ship, on tiny random models saved with save_pretrained, exported with the CLI, run through `pipe.generate`
with the same initial latents (fp32: max abs error <= 1e-4 on frames; bf16: mean-error bounds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import runtime
from runtime import scheduler

from .conftest import KIND_CASES, run_module, test_image

PROMPT = "a robot walking in the city at night, cinematic"
NEGATIVE = "blurry, low quality"
FP32_TOL = 1e-4
STEPS = 4  # flow shift 3: timesteps 999, 900, 750, 500 -> both experts run (boundaries 875 and 900)

# (kind, image mode): TI2V is one bundle for text-to-video and text+image-to-video.
CONFIGURATIONS = [("t2v-moe", "text"), ("ti2v", "text"), ("ti2v", "image"), ("i2v", "image"), ("flf2v", "image"),
                  ("i2v-moe", "image")]


def _images(kind: str, mode: str) -> dict:
    """Images of other sizes than the bundle's (so both sides resize), in each accepted form."""
    if mode == "text":
        return {}
    images = {"image": test_image(70, 50, seed=1)}
    if kind == "flf2v":
        images["last_image"] = np.asarray(test_image(40, 64, seed=2))  # a uint8 array
    return images


def _reference(kind: str, checkpoint: Path, mode: str, dtype: str = "fp32"):
    import torch
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanPipeline

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    cls = WanPipeline if mode == "text" else WanImageToVideoPipeline
    vae = AutoencoderKLWan.from_pretrained(str(checkpoint), subfolder="vae", dtype=torch.float32)
    ref = cls.from_pretrained(str(checkpoint), vae=vae, dtype=torch_dtype)
    ref.set_progress_bar_config(disable=True)
    return ref


def _diffusers_frames(ref, pipe: runtime.Pipeline, images: dict, init: np.ndarray, guidance_2: float | None,
                      output_type: str = "np") -> np.ndarray:
    import torch
    from PIL import Image

    g = pipe.geometry
    call = dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=g.height, width=g.width, num_frames=g.frames,
                num_inference_steps=STEPS, guidance_scale=5.0, max_sequence_length=g.max_sequence_length,
                latents=torch.from_numpy(init.copy()), output_type=output_type)
    if guidance_2 is not None:
        call["guidance_scale_2"] = guidance_2
    for key, value in images.items():
        call[key] = Image.fromarray(value) if isinstance(value, np.ndarray) else value
    with torch.no_grad():
        out = ref(**call).frames
    return out.float().numpy() if output_type == "latent" else out


@pytest.mark.parametrize("kind,mode", CONFIGURATIONS)
def test_matches_diffusers(kind: str, mode: str, kind_bundles, kind_checkpoints) -> None:
    pipe = runtime.load(kind_bundles[kind])
    assert pipe.kind.name == kind
    guidance_2 = 3.0 if pipe.kind.experts == 2 else None
    if guidance_2 is not None:  # the boundary falls inside the schedule: both experts run
        plan = scheduler.plan(STEPS, pipe.manifest.defaults.flow_shift, pipe.scheduler_config)
        assert {pipe.expert_of(float(t)) for t in plan.timesteps} == {0, 1}
    images = _images(kind, mode)
    init = pipe.initial_latents(11)
    frames = pipe.generate(PROMPT, NEGATIVE, seed=11, steps=STEPS, guidance=5.0, guidance_2=guidance_2,
                           progress=False, **images)
    ref = _diffusers_frames(_reference(kind, kind_checkpoints[kind], mode), pipe, images, init, guidance_2)
    g = pipe.geometry
    assert frames.shape == ref.shape == (1, g.frames, g.height, g.width, 3)
    assert np.abs(frames - ref).max() <= FP32_TOL
    assert frames.std() > 1e-3  # not trivially equal (e.g. all clamped)


def test_two_experts_switch_at_the_boundary_with_euler_as_diffusers(kind_bundles, kind_checkpoints) -> None:
    """Euler's fractional timesteps decide the expert as diffusers' `t >= boundary_ratio x 1000` does."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = runtime.load(kind_bundles["t2v-moe"])
    plan = pipe.settings(steps=STEPS, flow_shift=5.0, sampler="euler").plan(pipe.scheduler_config)
    assert {pipe.expert_of(float(t)) for t in plan.timesteps} == {0, 1}
    init = pipe.initial_latents(8)
    frames = pipe.generate(PROMPT, NEGATIVE, seed=8, steps=STEPS, guidance=5.0, guidance_2=3.0, flow_shift=5.0,
                           sampler="euler", progress=False)
    ref = _reference("t2v-moe", kind_checkpoints["t2v-moe"], "text")
    ref.scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    assert np.abs(frames - _diffusers_frames(ref, pipe, {}, init, 3.0)).max() <= FP32_TOL


def test_a_lora_per_expert_merged_at_export_as_wan22_lightning(kind_checkpoints, tmp_path: Path) -> None:
    """Wan2.2-Lightning's pair, ComfyUI-named: the high-noise LoRA merged into `transformer` (--merge-lora), the
    low-noise one into `transformer_2` (--merge-lora-2), with a 4-step CFG-free Euler default; the bundle run with no
    settings matches diffusers with load_lora_weights(high) and load_lora_weights(low, load_into_transformer_2=True)
    across the expert boundary."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from .test_lora import wan_format_lora

    variant, res, frames, max_len = KIND_CASES["t2v-moe"]
    ckpt = kind_checkpoints["t2v-moe"]
    high, low = (wan_format_lora(ckpt, tmp_path / name, seed) for name, seed in (("high", 1), ("low", 2)))
    out = tmp_path / "lightning"
    run_module("export", "--model", str(ckpt), "--resolution", res, "--frames", str(frames), "--dtype", "fp32",
               "--max-sequence-length", str(max_len), "--merge-lora", str(high), "--merge-lora-2", str(low),
               "--defaults", "steps=4,guidance=1,guidance_2=1,sampler=euler,flow_shift=5", "--out", str(out), "-q")
    pipe = runtime.load(out)
    assert [m["into"] for m in pipe.manifest.source["merged_loras"]] == ["transformer", "transformer_2"]
    init = pipe.initial_latents(0)
    ours = pipe.generate(PROMPT, NEGATIVE, progress=False)
    ref = _reference("t2v-moe", ckpt, "text")
    ref.scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    ref.load_lora_weights(str(high), adapter_name="high")
    ref.load_lora_weights(str(low), adapter_name="low", load_into_transformer_2=True)
    g = pipe.geometry
    import torch

    with torch.no_grad():
        want = ref(prompt=PROMPT, negative_prompt=NEGATIVE, height=g.height, width=g.width, num_frames=g.frames,
                   num_inference_steps=4, guidance_scale=1.0, guidance_scale_2=1.0,
                   max_sequence_length=g.max_sequence_length, latents=torch.from_numpy(init.copy()),
                   output_type="np").frames
    assert np.abs(ours - want).max() <= FP32_TOL


def test_image_changes_the_video_and_ti2v_keeps_the_first_frame(kind_bundles) -> None:
    """The conditioning is used: another image gives another video; TI2V's first latent frame is the image's."""
    pipe = runtime.load(kind_bundles["ti2v"])
    embeds = pipe.encode(PROMPT, NEGATIVE, image=test_image(70, 50, seed=1))
    latents = pipe.denoise(embeds, seed=1, steps=2, progress=False)
    np.testing.assert_array_equal(latents[:, :, 0], embeds["condition"][:, :, 0])
    other = pipe.denoise(pipe.encode(PROMPT, NEGATIVE, image=test_image(70, 50, seed=5)), seed=1, steps=2,
                         progress=False)
    assert np.abs(other - latents).max() > 1e-2
    text = pipe.denoise(pipe.encode(PROMPT, NEGATIVE), seed=1, steps=2, progress=False)
    assert np.abs(text - latents).max() > 1e-2


def test_second_expert_and_its_guidance_are_used(kind_bundles) -> None:
    pipe = runtime.load(kind_bundles["t2v-moe"])
    embeds = pipe.encode(PROMPT, NEGATIVE)
    a = pipe.denoise(embeds, seed=2, steps=STEPS, guidance=5.0, progress=False)
    b = pipe.denoise(embeds, seed=2, steps=STEPS, guidance=5.0, guidance_2=5.0, progress=False)
    c = pipe.denoise(embeds, seed=2, steps=STEPS, guidance=5.0, guidance_2=2.0, progress=False)
    np.testing.assert_array_equal(a, b)  # guidance_2 defaults to guidance, as in diffusers
    assert np.abs(a - c).max() > 1e-3


def test_low_memory_generate_drops_each_stage_once_past_it_and_makes_the_same_video(kind_bundles) -> None:
    """generate(low_memory=True), as `runtime generate` runs: before the VAE decode only the decoder's weights are
    held (the DiT experts' arrays are freed, not just forgotten); the frames are the same, and a next call loads
    the dropped stages again."""
    import gc
    import weakref

    pipe = runtime.load(kind_bundles["i2v-moe"])
    image = test_image(40, 60, seed=3)
    kept = pipe.generate(PROMPT, NEGATIVE, image=image, seed=4, steps=STEPS, progress=False)
    dit = weakref.ref(pipe.bundle.weights("transformer_2", "denoise_step_2")["blocks.0.attn1.to_q.weight"])
    decoded: list[set[str]] = []
    decode = pipe.decode
    pipe.decode = lambda latents, *rest: (decoded.append(set(pipe.bundle._weights)), decode(latents, *rest))[1]
    low = pipe.generate(PROMPT, NEGATIVE, image=image, seed=4, steps=STEPS, progress=False, low_memory=True)
    gc.collect()
    decoder = {pipe.manifest.programs[n].weights for n in pipe.manifest.programs if n.startswith("vae_decode")}
    assert len(decoded) == 1 and decoded[0] <= decoder and not decoder & {"transformer", "transformer_2"}
    assert dit() is None
    np.testing.assert_array_equal(low, kept)
    np.testing.assert_array_equal(pipe.generate(PROMPT, NEGATIVE, image=image, seed=4, steps=STEPS, progress=False,
                                                low_memory=True), kept)
    with pytest.raises(ValueError, match="stage must be one of"):
        pipe.unload_before("vae")


def test_a_background_load_still_queued_when_its_stage_is_dropped_does_not_load_it_again(kind_bundles) -> None:
    """generate queues every stage before the first step for background loading; the text encoder, dropped once
    the prompt is encoded, must not be loaded again (and held through denoising) by a queued task that starts
    after the drop. The other queued program still loads."""
    import threading

    bundle = runtime.load(kind_bundles["t2v-moe"]).bundle
    bundle.prefetch([])  # makes the pool
    pool, gate = bundle._pool, threading.Event()
    for _ in range(pool._max_workers):  # every worker busy: what prefetch queues now waits
        pool.submit(gate.wait)
    bundle.prefetch(["text_encoder", "vae_decode_first"])
    bundle.unload({"text_encoder"})
    gate.set()
    pool.shutdown(wait=True)
    assert "text_encoder" not in bundle._weights and "text_encoder" not in bundle._calls
    assert "vae_decode_first" in bundle._calls


def test_rgba_and_greyscale_images_are_converted_as_the_clip_processor_does(kind_bundles) -> None:
    from PIL import Image

    pipe = runtime.load(kind_bundles["i2v"])
    rgba = test_image(70, 50, seed=3).convert("RGBA")
    rgba.putalpha(Image.fromarray(np.tile(np.arange(70, dtype=np.uint8) * 3, (50, 1))))
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    flattened = Image.alpha_composite(white, rgba).convert("RGB")
    a, b = pipe.encode_images(rgba), pipe.encode_images(flattened)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    grey = pipe.encode_images(test_image(70, 50, seed=3, mode="L"))
    assert grey["condition"].shape == a["condition"].shape


@pytest.mark.slow  # bf16 variants: test_parity.py's test_bf16_bundle_tracks_diffusers_bf16 is the default run's
@pytest.mark.parametrize("kind", ["t2v-moe", "i2v"])
def test_bf16_tracks_diffusers_bf16(kind: str, kind_checkpoints, tmp_path: Path) -> None:
    """bf16 rounds differently in XLA and torch, and a tiny random model amplifies rounding, so the bound is
    relative to diffusers' own bf16 error ("noise": diffusers bf16 vs diffusers fp32, mean abs on frames):
    the runtime's bf16 frames are within tests/test_parity.py's Wan 2.1 bound (1e-2) or 3x that noise, whichever
    is larger, of both diffusers' fp32 and bf16 frames. Measured (ours vs fp32, ours vs bf16, noise): t2v-moe
    0.0031, 0.0037, 0.0012; i2v 0.0125, 0.0154, 0.0124 (the CLIP stage adds its own bf16 rounding).
    A wrong program (a dropped kept-in-fp32 module, a bad cast) is off by 10x more."""
    variant, res, frames, max_len = KIND_CASES[kind]
    out = tmp_path / "bf16"
    run_module("export", "--model", str(kind_checkpoints[kind]), "--resolution", res, "--frames", str(frames),
               "--dtype", "bf16", "--max-sequence-length", str(max_len), "--out", str(out), "-q")
    pipe = runtime.load(out)
    mode = "text" if pipe.kind.image == "none" else "image"
    images = _images(kind, mode)
    guidance_2 = 3.0 if pipe.kind.experts == 2 else None
    init = pipe.initial_latents(4)
    latents = pipe.denoise(pipe.encode(PROMPT, NEGATIVE, **images), seed=4, steps=STEPS, guidance=5.0,
                           guidance_2=guidance_2, progress=False)
    ours = pipe.decode(latents)
    ref_bf16 = _diffusers_frames(_reference(kind, kind_checkpoints[kind], mode, "bf16"), pipe, images, init,
                                 guidance_2)
    ref_fp32 = _diffusers_frames(_reference(kind, kind_checkpoints[kind], mode), pipe, images, init, guidance_2)
    noise = np.abs(ref_bf16 - ref_fp32).mean()
    assert 1e-4 < noise < 0.05  # bf16 really ran on both sides, and this model is not degenerate
    print(f"bf16 {kind}: ours vs fp32 {np.abs(ours - ref_fp32).mean():.4f}, ours vs bf16 "
          f"{np.abs(ours - ref_bf16).mean():.4f}, diffusers bf16 vs fp32 {noise:.4f}")
    bound = max(1e-2, 3 * noise)
    assert np.abs(ours - ref_fp32).mean() <= bound
    assert np.abs(ours - ref_bf16).mean() <= bound


def _used_weights(bundle: Path, name: str) -> set[str]:
    """The weights program `name` reads (jax.export drops unused arguments: module_kept_var_idx)."""
    import jax

    from runtime import manifest as mf
    from runtime.bundle import load_program

    m = mf.read(bundle)
    loop = m.programs[name].blocks
    used = set()
    for part in ("", "block", "tail") if loop is not None else ("",):
        exp = load_program(bundle, m, name, part)
        (weights, *_), _ = jax.tree.unflatten(exp.in_tree, list(range(len(exp.in_avals))))
        kept = {k for k, i in weights.items() if i in set(exp.module_kept_var_idx)}
        # block i reads "<prefix><i>.<name>" for each name the block program reads
        used |= {f"{loop.prefix}{i}.{k}" for k in kept for i in range(loop.layers)} if part == "block" else kept
    return used


def test_steps_take_the_prompts_keys_and_values_instead_of_projecting_them(kind_bundles) -> None:
    """The text (and CLIP image) projections of cross-attention run once per prompt, in cross_kv; no denoise
    variant reads their weights, and the prompt's K/V reach the steps as `kv` (frames: test_matches_diffusers)."""
    import re

    projections = re.compile(r"(blocks\.\d+\.attn2\.(to_k|to_v|norm_k|add_k_proj|add_v_proj|norm_added_k)"
                             r"|condition_embedder\.(text|image)_embedder)\.")
    bundle = kind_bundles["i2v"]
    kv_reads = _used_weights(bundle, "cross_kv")
    # (the tiny models' 16-token context makes diffusers' processor treat every CLIP token as text, so the
    # added projections go unused here; tests/test_cross_kv.py covers them)
    assert {"blocks.0.attn2.to_k.weight", "condition_embedder.text_embedder.linear_1.weight"} <= kv_reads
    assert any(k.startswith("condition_embedder.image_embedder.") for k in kv_reads)
    assert all(projections.match(k) for k in kv_reads), sorted(k for k in kv_reads if not projections.match(k))
    pipe = runtime.load(bundle)
    for name in ("denoise_step", "denoise_step_cond", "denoise_step_residual"):
        step_reads = _used_weights(bundle, name)
        assert "blocks.0.attn2.to_q.weight" in step_reads
        assert not {k for k in step_reads if projections.match(k)}, name
        assert "kv" in pipe.manifest.programs[name].inputs and "context" not in pipe.manifest.programs[name].inputs


def test_every_kind_says_what_it_takes() -> None:
    """`inspect`'s model line names a kind's inputs from its row: every value a row may hold has its words (a
    diffusion forcing bundle's video to extend once had none, and inspect failed on it)."""
    from runtime import kinds, summary

    takes = {name: summary._takes(kind) for name, kind in kinds.KINDS.items()}
    assert takes["t2v"] == "prompt" and takes["skyreels-df"] == "prompt [+ image] [+ video to extend]"
    assert takes["lucy-edit"].endswith(" + video") and takes["vace"].endswith(" [+ video]")


def test_program_names_are_made_from_typed_fields_and_read_back() -> None:
    """A program's identity is runtime/programs.py's typed fields; its name on disk is made from them and read back
    into the same fields, for every program of every kind (a pyramid's stages, other shapes, short prompts, both
    decoders) and of every golden bundle (whose names must not change); what is no program's name reads as None."""
    from runtime import kinds
    from runtime import manifest as mf
    from runtime.programs import CROSS_KV, DENOISE, VAE_DECODE, Program

    from .conftest import ROOT

    assert Program.parse("denoise_step_2_cond_stage0@64x32x9r1") == Program(
        DENOISE, expert=1, variant="cond", stage=0, shape="64x32x9r1")
    assert Program.parse("cross_kv_2_t64") == Program(CROSS_KV, expert=1, text_rows=64)
    assert Program.parse("vae_decode_next@32x64") == Program(VAE_DECODE, chunk="next", shape="32x64")
    assert Program.parse("text_encoder_64").text_rows == 64 and Program.parse("text_encoder").text_rows is None
    for name in ("denoise_block_2_t64", "denoise_step_tail", "denoise_step_fast", "cross_kv_x", "vae_decode", "x"):
        assert Program.parse(name) is None, name
    g = mf.Geometry(width=64, height=32, frames=9, batch=1, max_sequence_length=64, latent_channels=16,
                    latent_frames=3, latent_height=4, latent_width=8, text_dim=32, temporal_scale=4, spatial_scale=8)
    shapes = [g, mf.dataclasses.replace(g, width=32, height=64, latent_height=8, latent_width=4),
              mf.dataclasses.replace(g, frames=1, latent_frames=1)]
    names = set()
    for kind in kinds.KINDS.values():
        for flags in ((False, False, False, 1), (True, True, True, 3)):
            for p, at in mf.bundle_programs(kind, shapes, *flags).items():
                assert Program.parse(p.name) == p and at in shapes, p
                names.add(p.name)
    for manifest in sorted((ROOT / "artifacts" / "golden").glob("*/bundle/manifest.json")):
        for name in mf.read(manifest.parent).programs:
            assert Program.parse(name).name == name, (manifest, name)
    assert {"denoise_step_residual_stage1@32x64x9", "cross_kv_2_t8", "tiny_decode_next@32x64",
            "face_motion@64x32x1"} <= names
