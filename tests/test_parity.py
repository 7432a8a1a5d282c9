"""The runtime against diffusers' WanPipeline on the same tiny weights and initial latents (fp32)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import runtime

from .conftest import CASES

PROMPT = "A cat &amp; a dog   baking a cake together in a kitchen, cinematic"
NEGATIVE = "blurry, low quality"


@pytest.mark.parametrize("case", list(CASES))
def test_matches_diffusers(case: str, fp32_bundles, checkpoints) -> None:
    import torch
    from diffusers import WanPipeline

    variant, _, frames, max_len = CASES[case]
    pipe = runtime.load(fp32_bundles[case])
    g = pipe.geometry
    steps, guidance, seed = 4, 5.0, 7

    ref = WanPipeline.from_pretrained(str(checkpoints[variant]), dtype=torch.float32)
    with torch.no_grad():
        ref_pe, ref_ne = ref.encode_prompt(PROMPT, NEGATIVE, do_classifier_free_guidance=True,
                                           max_sequence_length=max_len)
    embeds = pipe.encode(PROMPT, NEGATIVE)
    assert np.abs(embeds["prompt_embeds"] - ref_pe.numpy()).max() <= 1e-5
    assert np.abs(embeds["negative_prompt_embeds"] - ref_ne.numpy()).max() <= 1e-5

    init = pipe.initial_latents(seed)
    latents = pipe.denoise(embeds, seed=seed, steps=steps, guidance=guidance, progress=False)
    call = dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=g.height, width=g.width, num_frames=frames,
                num_inference_steps=steps, guidance_scale=guidance, max_sequence_length=max_len,
                latents=torch.from_numpy(init.copy()))
    with torch.no_grad():
        ref_latents = ref(**call, output_type="latent").frames.numpy()
        ref_frames = ref(**call, output_type="np").frames
    np.testing.assert_allclose(latents, ref_latents, rtol=0, atol=1e-4)

    frames_out = pipe.decode(latents)
    assert frames_out.shape == ref_frames.shape == (1, frames, g.height, g.width, 3)
    assert np.abs(frames_out - ref_frames).max() <= 1e-4
    # The frames are not trivially equal (e.g. all clamped): the model did something.
    assert frames_out.std() > 1e-3


def test_bf16_bundle_tracks_diffusers_bf16(checkpoints, bf16_bundle) -> None:
    """bf16 rounds differently in XLA and torch, so only mean errors are bounded here: embeddings
    within ~1/4 bf16 ulp on average, latents and frames within a few tenths of a percent. A wrong
    program (e.g. a dropped kept-in-fp32 module or a bad cast) is off by 10x more."""
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline

    pipe = runtime.load(bf16_bundle)  # tiny at 64x32, 9 frames, 24 tokens
    assert pipe.manifest.weights["transformer"].tensors["blocks.0.attn1.to_q.weight"].dtype == "bfloat16"
    assert pipe.manifest.weights["transformer"].tensors["scale_shift_table"].dtype == "float32"
    # On CPU targets the DiT's bf16 matmuls accumulate in fp32 (export/cpu_dots.py): no bf16-result dot.
    dots = re.findall(r"stablehlo\.dot_general .*?: \((tensor<[^)]*)\) -> tensor<[\dx]*(\w+)>",
                      pipe.bundle.program("denoise_step").mlir_module())
    assert any("bf16" in operands and result == "f32" for operands, result in dots), dots[:3]
    assert not [d for d in dots if d[1] == "bf16"]
    vae = AutoencoderKLWan.from_pretrained(str(checkpoints["tiny"]), subfolder="vae", dtype=torch.float32)
    ref = WanPipeline.from_pretrained(str(checkpoints["tiny"]), vae=vae, dtype=torch.bfloat16)
    embeds = pipe.encode(PROMPT, NEGATIVE)
    init = pipe.initial_latents(0)
    latents = pipe.denoise(embeds, seed=0, steps=4, guidance=5.0, progress=False)
    frames = pipe.decode(latents)
    call = dict(prompt=PROMPT, negative_prompt=NEGATIVE, height=32, width=64, num_frames=9, num_inference_steps=4,
                guidance_scale=5.0, max_sequence_length=24, latents=torch.from_numpy(init.copy()))
    with torch.no_grad():
        pe, _ = ref.encode_prompt(PROMPT, NEGATIVE, max_sequence_length=24)
        ref_latents = ref(**call, output_type="latent").frames.float().numpy()
        ref_frames = ref(**call, output_type="np").frames
    assert np.abs(embeds["prompt_embeds"] - pe.float().numpy()).mean() <= 5e-3
    assert np.abs(latents - ref_latents).mean() <= 3e-2
    assert np.abs(frames - ref_frames).mean() <= 1e-2


def test_a_prompt_runs_the_shortest_text_encoder_that_holds_it_with_the_full_lengths_embeddings(fp32_bundles) -> None:
    """The bundle has text encoder programs over 3, 6, 12 and all 24 positions (kinds.text_lengths); a batch of
    prompts runs the shortest that holds its longest prompt, and its embeddings are the full program's (padding
    masked out of attention, padded rows zero) to float rounding."""
    from runtime import kinds

    pipe = runtime.load(fp32_bundles["tiny-64x32-f9"])
    L = pipe.geometry.max_sequence_length
    assert [n for n in kinds.text_lengths(L) if kinds.text_encoder_program(n, L) in pipe.manifest.programs] == \
        [3, 6, 12, 24]
    used: list[str] = []
    call = pipe.bundle.call
    pipe.bundle.call = lambda name: (used.append(name), call(name))[1]
    ran = set()
    for prompt, negative in [("cat", ""), ("a cat playing", "dog"), ("a cat playing piano in a jazz club", "blurry"),
                             ("a cat playing piano in a jazz club at night, with a band of dogs and a crowd "
                              "watching from the bar, cinematic lighting, 4k", "blurry, low quality")]:
        ids, mask = pipe.tokenizer()([prompt, negative])
        tokens = int(mask.sum(axis=1).max())
        want = min(n for n in (3, 6, 12, 24) if n >= tokens or n == L)
        used.clear()
        embeds = pipe.encode(prompt, negative)
        assert used == [kinds.text_encoder_program(want, L)], (prompt, tokens, used)
        ran.add(used[0])
        full = np.asarray(call("text_encoder")(ids, mask), np.float32)
        got = np.concatenate([embeds["prompt_embeds"], embeds["negative_prompt_embeds"]])
        assert got.shape == full.shape and not got[:, tokens:].any()
        np.testing.assert_allclose(got, full, rtol=0, atol=1e-5 * max(1.0, float(np.abs(full).max())))
    assert len(ran) >= 3 and "text_encoder" in ran, ran


def test_timestep_scale_1_feeds_the_dit_sigma_as_diffusers_fed_t_over_1000(fp32_bundles, checkpoints,
                                                                           tmp_path) -> None:
    """A bundle whose defaults say timestep_scale=1 (a checkpoint trained on t = sigma, as TorchTitan's Wan trainer
    feeds it) gives the frames of diffusers' WanPipeline whose transformer is called with t / 1000, within 1e-4, and
    not the frames of the same weights fed released Wan's t; `runtime inspect` says so; export's --defaults takes
    the key and refuses a scale <= 0."""
    import shutil

    import torch
    from diffusers import WanPipeline

    from export.options import defaults_for, parse_defaults
    from runtime import kinds
    from runtime.errors import UserError
    from runtime.scheduler import UniPCConfig

    from .conftest import run_cli
    from .test_bundle_checks import _rewrite_manifest

    variant, _, frames, max_len = CASES["tiny-64x32-f9"]
    bundle = tmp_path / "bundle"
    shutil.copytree(fp32_bundles["tiny-64x32-f9"], bundle)
    _rewrite_manifest(bundle, lambda m: m["defaults"].update(timestep_scale=1.0))
    assert "DiT fed t = sigma x 1 (not x 1000)" in run_cli("runtime", "inspect", str(bundle)).stdout
    pipe = runtime.load(bundle)
    steps, guidance, seed = 3, 5.0, 7
    embeds = pipe.encode(PROMPT, NEGATIVE)
    out = pipe.decode(pipe.denoise(embeds, seed=seed, steps=steps, guidance=guidance, progress=False))
    released = runtime.load(fp32_bundles["tiny-64x32-f9"])
    assert np.abs(out - released.decode(released.denoise(embeds, seed=seed, steps=steps, guidance=guidance,
                                                         progress=False))).max() > 1e-2

    ref = WanPipeline.from_pretrained(str(checkpoints[variant]), dtype=torch.float32)
    forward = ref.transformer.forward
    ref.transformer.forward = lambda *a, timestep, **k: forward(*a, timestep=timestep / 1000, **k)
    g = pipe.geometry
    with torch.no_grad():
        want = ref(prompt=PROMPT, negative_prompt=NEGATIVE, height=g.height, width=g.width, num_frames=frames,
                   num_inference_steps=steps, guidance_scale=guidance, max_sequence_length=max_len,
                   latents=torch.from_numpy(pipe.initial_latents(seed).copy()), output_type="np").frames
    assert np.abs(out - want).max() <= 1e-4 and out.std() > 1e-3

    assert parse_defaults("steps=4,timestep_scale=1") == {"steps": 4, "timestep_scale": 1.0}
    t2v = kinds.get("t2v")
    base = pipe.manifest.defaults
    assert defaults_for(t2v, UniPCConfig(), base, {"timestep_scale": 1.0}).timestep_scale == 1.0
    with pytest.raises(UserError, match=r"timestep_scale=0 must be a number > 0"):
        defaults_for(t2v, UniPCConfig(), base, {"timestep_scale": 0.0})
