"""Lucy Edit (decart-ai/Lucy-Edit-Dev, diffusers' LucyEditPipeline): a source video's VAE latents beside the noise at
every step, the instruction as the prompt. Against diffusers on the tiny random model of tests/conftest.py's KIND_CASES
(fp32, the same video and initial latents: frames within 1e-4) at the shape the video's frame count picks, also with a
LoRA merged at load and the Euler sampler; what bad input says in Python; and the server's create request, whose
input_reference is the video.
(tests/test_kinds_cli.py: the same frames on 1 and 8 devices from an mp4, and the CLI's bad input;
test_denoise_blocks.py and test_short_prompts.py cover the kind as every other.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import runtime
from runtime.errors import UserError

from .test_video_in import _mp4, _video

PROMPT = "turn the sky into a sunset, warm light"
NEGATIVE = "blurry, low quality"
FP32_TOL = 1e-4
STEPS = 4


def _reference(checkpoint: Path):
    import torch
    from diffusers import LucyEditPipeline

    ref = LucyEditPipeline.from_pretrained(str(checkpoint), dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    return ref


@pytest.fixture(scope="module")
def pipe(kind_bundles) -> runtime.Pipeline:
    return runtime.load(kind_bundles["lucy-edit"])


def test_matches_diffusers_at_the_shape_the_videos_frames_pick(pipe, kind_checkpoints) -> None:
    """A 5-frame video, of another size than the bundle's (both sides resize it), picks the bundle's 5-frame shape (not
    its default, 9): frames within 1e-4 of LucyEditPipeline's given the same video (PIL frames there, a uint8 array
    here) and initial latents. (The video weighs: a black one instead moves these frames by 1.5e-2, measured.) The
    9-frame shape: tests/test_kinds_cli.py, on 1 and 8 devices."""
    import torch

    assert pipe.kind.name == "lucy-edit" and [f for _, _, f in pipe.shapes] == [9, 5]
    video = _video(5, 70, 50, seed=5)
    g = pipe.shape_for_videos(video=video)
    assert (g.frames, g.size) == (5, "64x32")
    init = pipe.initial_latents(11, g)
    ours = pipe.generate(PROMPT, NEGATIVE, video=np.stack([np.asarray(f) for f in video]), seed=11, steps=STEPS,
                         guidance=5.0, progress=False)
    with torch.no_grad():
        want = _reference(kind_checkpoints["lucy-edit"])(
            video=video, prompt=PROMPT, negative_prompt=NEGATIVE, height=g.height, width=g.width, num_frames=5,
            num_inference_steps=STEPS, guidance_scale=5.0, max_sequence_length=g.max_sequence_length,
            latents=torch.from_numpy(init.copy()), output_type="np").frames
    assert ours.shape == want.shape == (1, 5, g.height, g.width, 3)
    assert np.abs(ours - want).max() <= FP32_TOL
    assert ours.std() > 1e-3


@pytest.mark.slow  # Lucy Edit's LoRA and Euler: test_lora merges at load, test_samplers runs Euler against diffusers
def test_a_lora_merged_at_load_and_the_euler_sampler_as_diffusers(pipe, kind_bundles, kind_checkpoints,
                                                                   tmp_path: Path) -> None:
    """A Wan-format LoRA made into an adapter (`export --lora`) and merged at load, run with the Euler sampler:
    LucyEditPipeline with the LoRA loaded by its Wan loader and FlowMatchEulerDiscreteScheduler (frames, 1e-4)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    from .conftest import run_cli
    from .test_lora import wan_format_lora

    bundle, ckpt = kind_bundles["lucy-edit"], kind_checkpoints["lucy-edit"]
    lora = wan_format_lora(ckpt, tmp_path / "lora", seed=5)
    run_cli("export", "lora", str(lora), "--bundle", str(bundle), "--out", str(tmp_path / "a.safetensors"), "-q")
    adapted = runtime.load(bundle, loras=[(tmp_path / "a.safetensors", 0.8)])
    video = _video(5, 64, 32, seed=8)
    g = adapted.shape_for_videos(video=video)
    kwargs = dict(video=video, seed=6, steps=3, guidance=4.0, flow_shift=5.0, sampler="euler", progress=False)
    ours = adapted.generate(PROMPT, NEGATIVE, **kwargs)
    assert np.abs(ours - pipe.generate(PROMPT, NEGATIVE, **kwargs)).max() > 1e-2  # the adapter changes the edit
    ref = _reference(ckpt)
    ref.scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    ref.load_lora_weights(str(lora), adapter_name="a")
    ref.set_adapters(["a"], [0.8])
    with torch.no_grad():
        want = ref(video=video, prompt=PROMPT, negative_prompt=NEGATIVE, height=g.height, width=g.width,
                   num_frames=g.frames, num_inference_steps=3, guidance_scale=4.0,
                   max_sequence_length=g.max_sequence_length,
                   latents=torch.from_numpy(adapted.initial_latents(6, g).copy()), output_type="np").frames
    assert np.abs(ours - want).max() <= FP32_TOL


def test_the_architecture_name_is_lucy_edit_devs_config() -> None:
    """`--model lucy-edit-dev --no-weights`: decart-ai/Lucy-Edit-Dev's configs (TI2V-5B's DiT taking 96 channels, the
    Wan 2.2 VAE, UniPC at shift 5), detected as the lucy-edit kind. (Its TPU programs: README, Lucy Edit.)"""
    from export import source

    src = source.load("lucy-edit-dev", "bf16", weights=False)
    t = src.transformer_config
    assert src.model_kind == "lucy-edit" and src.boundary_ratio is None and src.image_encoder_config is None
    assert (t["in_channels"], t["out_channels"], t["num_layers"], t["num_attention_heads"], t["ffn_dim"]) == \
        (96, 48, 30, 24, 14336)
    assert (src.vae_config["z_dim"], src.vae_config["scale_factor_spatial"], src.scheduler_config["flow_shift"]) == \
        (48, 16, 5.0)


def test_bad_input_in_python_is_one_line(pipe) -> None:
    cases = [
        ({}, "this bundle is Lucy Edit (video editing from an instruction): it needs a source video (--video FILE / "
             "video=...)"),
        ({"video": _video(7, 64, 32)}, "the video has 7 frames; this bundle makes 5 or 9 (its shapes: 64x32 x 9 "
                                       "frames"),
        ({"video": _video(5, 64, 32), "frames": 9}, "the video has 5 frames but frames=9 was asked"),
        ({"video": _video(5, 64, 32), "mask": _video(5, 64, 32)}, "this bundle is Lucy Edit (video editing from an "
                                                                  "instruction): it takes no mask"),
        ({"video": _video(5, 64, 32), "image": np.zeros((32, 64, 3), np.uint8)}, "this bundle is Lucy Edit (video "
                                                                                 "editing from an instruction): it "
                                                                                 "takes no image"),
    ]
    for kwargs, message in cases:
        with pytest.raises(UserError) as e:
            pipe.generate(PROMPT, steps=2, progress=False, **kwargs)
        assert str(e.value).startswith(message) and "\n" not in str(e.value), (kwargs, str(e.value))
    with pytest.raises(UserError, match="^this bundle is Lucy Edit .*: it needs a source video"):
        pipe.encode(PROMPT)
    # the embeddings carry the video: denoise needs nothing more, and refuses embeddings without it
    with pytest.raises(UserError, match="the embeddings have no 'condition'; encode with the video"):
        pipe.denoise({"prompt_embeds": np.zeros(pipe.geometry.embeds_shape, np.float32),
                      "negative_prompt_embeds": np.zeros(pipe.geometry.embeds_shape, np.float32)}, progress=False)


def test_the_server_takes_the_video_to_edit_as_input_reference(pipe, kind_bundles, tmp_path: Path) -> None:
    """The create request's input_reference is the video to edit: required, a video in the document; a request is
    checked (parse_request) and run (the worker's run_job) as the server does, making the mp4 Python makes from the
    same file; no video, or one of a frame count the bundle lacks, is a 400 naming input_reference. (The HTTP upload
    of a video is the one VACE and video-to-video use: tests/test_video_in.py serves it through the openai SDK.)"""
    from runtime import manifest as mf
    from runtime.serve import openapi
    from runtime.serve.errors import ApiError
    from runtime.serve.run import run_job
    from runtime.serve.schema import FILE_FIELDS, Body, Offer, parse_request
    from runtime.video import write_video

    from .test_serve import _mp4_frames

    offer = Offer.of(mf.read(kind_bundles["lucy-edit"]), "lucy")
    form = openapi.create_request(offer)["content"]["multipart/form-data"]
    assert "input_reference" in form["schema"]["required"]
    assert form["encoding"]["input_reference"]["contentType"] == "video/*"
    assert not {"strength", "mask", "last_image", "reference_image"} & set(form["schema"]["properties"])
    source = _mp4(_video(5, 64, 32, seed=21), tmp_path / "source.mp4").read_bytes()
    short = _mp4(_video(7, 64, 32, seed=22), tmp_path / "short.mp4").read_bytes()
    fields = {"prompt": PROMPT, "num_inference_steps": "2", "seed": "3"}
    for files, message in (({}, "this bundle is Lucy Edit (video editing from an instruction): it needs a source "
                                "video (input_reference)"),
                           ({"input_reference": [short]}, "input_reference has 7 frames; this bundle makes 9 frames "
                                                          "(0.375 s) or 5 frames (0.208333 s) at 64x32")):
        with pytest.raises(ApiError) as e:
            parse_request(Body(fields, files, form=True), offer, pipe, None)
        assert e.value.status == 400 and e.value.param == "input_reference", e.value
        assert str(e.value.message).startswith(message), e.value.message
    body = Body(fields, {"input_reference": [source]}, form=True)
    params = parse_request(body, offer, pipe, None)
    assert (params["frames"], params["seconds"], params["media"]) == (5, "0.208333", ["video"])
    run_job(pipe, params, [data for name in FILE_FIELDS for data in body.files.get(name, [])], tmp_path / "job.mp4")
    served = _mp4_frames((tmp_path / "job.mp4").read_bytes(), tmp_path).astype(np.int16)
    frames = pipe.generate(PROMPT, video=str(tmp_path / "source.mp4"), steps=2, seed=3, progress=False)
    write_video(frames[0], tmp_path / "python.mp4", fps=24)
    local = _mp4_frames((tmp_path / "python.mp4").read_bytes(), tmp_path).astype(np.int16)
    assert served.shape == local.shape == (5, 32, 64, 3)
    assert np.abs(served - local).max() <= 1
