"""The official Wan architectures, by name, so programs can be built from a config alone.

`python -m export --model wan2.2-t2v-a14b --no-weights ...` traces every stage on
`meta` tensors (no weights, no download) and the weights are attached later from
the real checkpoint (`python -m export attach`). The values are those of the
Wan-AI/*-Diffusers repositories (model_index.json, transformer, vae, scheduler,
image_encoder and image_processor configs): the Wan 2.1 VAE is diffusers' default
AutoencoderKLWan, TI2V-5B has the Wan 2.2 VAE (z_dim 48, 16x spatial, 2x2 patches),
the text encoder is UMT5-XXL and the image encoder (Wan 2.1 I2V, FLF2V) the CLIP
ViT-H/14 vision tower. Values baked into programs (the VAE's latents_mean/std) are
checked against the checkpoint when weights are attached.
"""

from __future__ import annotations

from typing import Any

_UMT5_XXL: dict[str, Any] = dict(
    vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_decoder_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.1,
    layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu", tie_word_embeddings=False, pad_token_id=0,
    eos_token_id=1, decoder_start_token_id=0,
)

_SCHEDULER: dict[str, Any] = dict(
    _class_name="UniPCMultistepScheduler", num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02,
    beta_schedule="linear", solver_order=2, prediction_type="flow_prediction", thresholding=False,
    predict_x0=True, solver_type="bh2", lower_order_final=True, disable_corrector=[], use_flow_sigmas=True,
    flow_shift=3.0, timestep_spacing="linspace", steps_offset=0, final_sigmas_type="zero",
    use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False,
)


def _transformer(heads: int, ffn: int, layers: int, **over: Any) -> dict[str, Any]:
    return {**dict(patch_size=[1, 2, 2], num_attention_heads=heads, attention_head_dim=128, in_channels=16,
                   out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=ffn, num_layers=layers, cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                   rope_max_seq_len=1024), **over}


# Wan 2.1 I2V / FLF2V: 36 input channels (noise 16 + mask 4 + image latents 16), CLIP image cross-attention.
_I2V_14B = dict(in_channels=36, image_dim=1280, added_kv_proj_dim=5120)

# CLIP ViT-H/14 (laion/CLIP-ViT-H-14-laion2B-s32B-b79K) vision tower and its processor.
_CLIP_VIT_H: dict[str, Any] = dict(
    hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16, patch_size=14,
    image_size=224, hidden_act="gelu", layer_norm_eps=1e-5, projection_dim=1024, num_channels=3,
    attention_dropout=0.0, dropout=0.0, initializer_factor=1.0, initializer_range=0.02,
)
_CLIP_PROCESSOR: dict[str, Any] = dict(
    crop_size={"height": 224, "width": 224}, do_center_crop=True, do_convert_rgb=True, do_normalize=True,
    do_rescale=True, do_resize=True, image_mean=[0.48145466, 0.4578275, 0.40821073],
    image_std=[0.26862954, 0.26130258, 0.27577711], resample=3, rescale_factor=0.00392156862745098,
    size={"shortest_edge": 224},
)

# VACE: VACE blocks after the main blocks in vace_layers, taking 96 channels (inactive + reactive latents, 16 each,
# and the mask folded 8x8: 64).
_VACE_1_3B = dict(vace_layers=list(range(0, 30, 2)), vace_in_channels=96)
_VACE_14B = dict(vace_layers=list(range(0, 40, 5)), vace_in_channels=96)

# The Wan 2.2 VAE of TI2V-5B.
_VAE22: dict[str, Any] = dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True], dropout=0.0, is_residual=True, in_channels=12, out_channels=12,
    patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
    latents_mean=[
        -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891, 0.157,
        -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502, -0.2055,
        -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.123, -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083,
        -0.052, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
    ],
    latents_std=[
        0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165,
        0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917,
        0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.06,
        0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
    ],
)


def _arch(pipeline: str, hub_id: str, transformer: dict[str, Any], flow_shift: float = 3.0,
          **extra: Any) -> dict[str, Any]:
    return dict(pipeline=pipeline, hub_id=hub_id, transformer=transformer, vae=extra.pop("vae", {}),
                text_encoder=_UMT5_XXL, scheduler={**_SCHEDULER, "flow_shift": flow_shift}, **extra)


# name -> model_index facts (pipeline class, boundary_ratio, expand_timesteps) and component configs.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "wan2.1-t2v-1.3b": _arch("WanPipeline", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", _transformer(12, 8960, 30)),
    "wan2.1-t2v-14b": _arch("WanPipeline", "Wan-AI/Wan2.1-T2V-14B-Diffusers", _transformer(40, 13824, 40)),
    "wan2.2-t2v-a14b": _arch("WanPipeline", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", _transformer(40, 13824, 40),
                             boundary_ratio=0.875),
    "wan2.2-ti2v-5b": _arch("WanPipeline", "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
                            _transformer(24, 14336, 30, in_channels=48, out_channels=48), flow_shift=5.0,
                            vae=_VAE22, expand_timesteps=True),
    "wan2.2-i2v-a14b": _arch("WanImageToVideoPipeline", "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
                             _transformer(40, 13824, 40, in_channels=36), boundary_ratio=0.9),
    "wan2.1-i2v-14b-480p": _arch("WanImageToVideoPipeline", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
                                 _transformer(40, 13824, 40, **_I2V_14B), image_encoder=_CLIP_VIT_H,
                                 image_processor=_CLIP_PROCESSOR),
    "wan2.1-i2v-14b-720p": _arch("WanImageToVideoPipeline", "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers",
                                 _transformer(40, 13824, 40, **_I2V_14B), image_encoder=_CLIP_VIT_H,
                                 image_processor=_CLIP_PROCESSOR),
    "wan2.1-vace-1.3b": _arch("WanVACEPipeline", "Wan-AI/Wan2.1-VACE-1.3B-diffusers",
                              _transformer(12, 8960, 30, **_VACE_1_3B)),
    "wan2.1-vace-14b": _arch("WanVACEPipeline", "Wan-AI/Wan2.1-VACE-14B-diffusers",
                             _transformer(40, 13824, 40, **_VACE_14B), flow_shift=5.0),
    # Wan2.2-VACE-Fun-A14B (alibaba-pai): the VACE branch on both experts of Wan2.2-T2V-A14B
    "wan2.2-vace-fun-a14b": _arch("WanVACEPipeline", "alibaba-pai/Wan2.2-VACE-Fun-A14B",
                                  _transformer(40, 13824, 40, **_VACE_14B), boundary_ratio=0.875),
    # Wan2.2-Animate-14B: 36 input channels over one more latent frame (the reference image's), CLIP cross-attention
    # with added K/V, a pose patch embedding, a 512x512 face motion encoder and face adapters every 5 blocks
    # (diffusers' WanAnimateTransformer3DModel defaults for the motion and face parts).
    "wan2.2-animate-14b": _arch("WanAnimatePipeline", "Wan-AI/Wan2.2-Animate-14B-Diffusers",
                                _transformer(40, 13824, 40, in_channels=36, latent_channels=16, image_dim=1280,
                                             added_kv_proj_dim=5120, motion_encoder_size=512,
                                             inject_face_latents_blocks=5),
                                flow_shift=5.0, image_encoder=_CLIP_VIT_H, image_processor=_CLIP_PROCESSOR),
    # Lucy Edit (decart-ai/Lucy-Edit-Dev, a LucyEditPipeline; the weights are non-commercial): Wan2.2-TI2V-5B's DiT
    # taking 96 channels (the noise's 48, then the source video's latents' 48), the Wan 2.2 VAE, UniPC at shift 5.
    "lucy-edit-dev": _arch("LucyEditPipeline", "decart-ai/Lucy-Edit-Dev",
                           _transformer(24, 14336, 30, in_channels=96, out_channels=48), flow_shift=5.0, vae=_VAE22,
                           expand_timesteps=True),
    "wan2.1-flf2v-14b-720p": _arch("WanImageToVideoPipeline", "Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers",
                                   _transformer(40, 13824, 40, **_I2V_14B, pos_embed_seq_len=2 * 257),
                                   flow_shift=16.0, image_encoder=_CLIP_VIT_H, image_processor=_CLIP_PROCESSOR),
}

# SkyReels-V2 (Skywork/SkyReels-V2-*-Diffusers): Wan 2.1's DiT as SkyReelsV2Transformer3DModel. The diffusion forcing
# checkpoints are text-to-video DiTs that diffusers' three DF pipelines share; DF-1.3B has the fps embedding
# (inject_sample_info), the 14B ones not (diffusers' convert_skyreelsv2_to_diffusers.py). Flow shift 8 for text and
# 5 for image conditioning, as diffusers' examples set it.
_I2V_1_3B = dict(in_channels=36, image_dim=1280, added_kv_proj_dim=1536)
ARCHITECTURES.update({
    "skyreels-v2-df-1.3b-540p": _arch("SkyReelsV2DiffusionForcingPipeline",
                                      "Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers",
                                      _transformer(12, 8960, 30, inject_sample_info=True), flow_shift=8.0),
    "skyreels-v2-df-14b-540p": _arch("SkyReelsV2DiffusionForcingPipeline", "Skywork/SkyReels-V2-DF-14B-540P-Diffusers",
                                     _transformer(40, 13824, 40), flow_shift=8.0),
    "skyreels-v2-df-14b-720p": _arch("SkyReelsV2DiffusionForcingPipeline", "Skywork/SkyReels-V2-DF-14B-720P-Diffusers",
                                     _transformer(40, 13824, 40), flow_shift=8.0),
    "skyreels-v2-t2v-14b-540p": _arch("SkyReelsV2Pipeline", "Skywork/SkyReels-V2-T2V-14B-540P-Diffusers",
                                      _transformer(40, 13824, 40), flow_shift=8.0),
    "skyreels-v2-t2v-14b-720p": _arch("SkyReelsV2Pipeline", "Skywork/SkyReels-V2-T2V-14B-720P-Diffusers",
                                      _transformer(40, 13824, 40), flow_shift=8.0),
    "skyreels-v2-i2v-1.3b-540p": _arch("SkyReelsV2ImageToVideoPipeline", "Skywork/SkyReels-V2-I2V-1.3B-540P-Diffusers",
                                       _transformer(12, 8960, 30, **_I2V_1_3B), flow_shift=5.0,
                                       image_encoder=_CLIP_VIT_H, image_processor=_CLIP_PROCESSOR),
    "skyreels-v2-i2v-14b-540p": _arch("SkyReelsV2ImageToVideoPipeline", "Skywork/SkyReels-V2-I2V-14B-540P-Diffusers",
                                      _transformer(40, 13824, 40, **_I2V_14B), flow_shift=5.0,
                                      image_encoder=_CLIP_VIT_H, image_processor=_CLIP_PROCESSOR),
    "skyreels-v2-i2v-14b-720p": _arch("SkyReelsV2ImageToVideoPipeline", "Skywork/SkyReels-V2-I2V-14B-720P-Diffusers",
                                      _transformer(40, 13824, 40, **_I2V_14B), flow_shift=5.0,
                                      image_encoder=_CLIP_VIT_H, image_processor=_CLIP_PROCESSOR),
    "skyreels-v2-flf2v-1.3b-540p": _arch("SkyReelsV2ImageToVideoPipeline",
                                         "Skywork/SkyReels-V2-FLF2V-1.3B-540P-Diffusers",
                                         _transformer(12, 8960, 30, **_I2V_1_3B, pos_embed_seq_len=2 * 257),
                                         flow_shift=5.0, image_encoder=_CLIP_VIT_H, image_processor=_CLIP_PROCESSOR),
})

# Helios (BestWishYsh/Helios-Base, -Mid, -Distilled): HeliosTransformer3DModel's defaults are the released 14B's (Wan
# 2.1 14B's widths, RoPE over 44 + 42 + 42 of the head's 128 channels, the history's three patch embeddings). Base is a
# HeliosPipeline, Mid and Distilled HeliosPyramidPipelines (is_distilled with HeliosDMDScheduler), as their
# model_index.json say; the scheduler settings are diffusers' defaults, with the dynamic shift (runtime/helios.py).
# Attaching the real weights checks every tensor's name and shape (export/attach.py).
_HELIOS: dict[str, Any] = dict(
    patch_size=[1, 2, 2], num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, added_kv_proj_dim=None, rope_dim=[44, 42, 42], rope_theta=10000.0, guidance_cross_attn=True,
    zero_history_timestep=True, has_multi_term_memory_patch=True, is_amplify_history=False,
    history_scale_mode="per_head",
)
_HELIOS_UNIPC: dict[str, Any] = dict(
    _class_name="HeliosScheduler", num_train_timesteps=1000, shift=1.0, stage_range=[0, 1 / 3, 2 / 3, 1],
    gamma=1 / 3, thresholding=False, prediction_type="flow_prediction", solver_order=2, predict_x0=True,
    solver_type="bh2", lower_order_final=True, disable_corrector=[], solver_p=None, use_flow_sigmas=True,
    scheduler_type="unipc", use_dynamic_shifting=True, time_shift_type="exponential",
)


def _helios(pipeline: str, hub_id: str, scheduler: dict[str, Any], **options: Any) -> dict[str, Any]:
    return dict(pipeline=pipeline, hub_id=hub_id, transformer=_HELIOS, vae={}, text_encoder=_UMT5_XXL,
                scheduler=scheduler, options=options)


ARCHITECTURES.update({
    "helios-base": _helios("HeliosPipeline", "BestWishYsh/Helios-Base", {**_HELIOS_UNIPC, "stages": 1}),
    "helios-mid": _helios("HeliosPyramidPipeline", "BestWishYsh/Helios-Mid", {**_HELIOS_UNIPC, "stages": 3},
                          is_cfg_zero_star=True),
    "helios-distilled": _helios("HeliosPyramidPipeline", "BestWishYsh/Helios-Distilled", dict(
        _class_name="HeliosDMDScheduler", num_train_timesteps=1000, shift=1.0, stages=3,
        stage_range=[0, 1 / 3, 2 / 3, 1], gamma=1 / 3, prediction_type="flow_prediction", use_flow_sigmas=True,
        use_dynamic_shifting=True, time_shift_type="linear"), is_distilled=True),
})

# ChronoEdit (nvidia/ChronoEdit-14B-Diffusers, a ChronoEditPipeline): Wan2.1-I2V-14B's DiT, CLIP and VAE, the DiT as
# ChronoEditTransformer3DModel (rope_temporal_skip_len 8: 2 latent frames at temporal positions 0 and 7). UniPC at
# flow shift 5, what ChronoEdit's own scripts/run_inference_diffusers.py sets on the checkpoint's UniPC config (the
# hub's scheduler config was not readable here; a bundle's default shift is one --defaults flow_shift=... away).
ARCHITECTURES["chronoedit-14b"] = _arch("ChronoEditPipeline", "nvidia/ChronoEdit-14B-Diffusers",
                                        _transformer(40, 13824, 40, **_I2V_14B, rope_temporal_skip_len=8),
                                        flow_shift=5.0, image_encoder=_CLIP_VIT_H, image_processor=_CLIP_PROCESSOR)

# AnyFlow (nvidia/AnyFlow-Wan2.1-T2V-14B-Diffusers, an AnyFlowPipeline): AnyFlowTransformer3DModel's defaults are the
# released 14B's (Wan 2.1 T2V-14B's widths, the delta embedder gated at 0.25 on r); FlowMapEulerDiscreteScheduler at
# the Wan 2.1 shift of 5 (the hub's scheduler config was not readable here: attaching the checkpoint's weights checks
# every tensor, and a bundle's default shift is one --defaults flow_shift=... away).
ARCHITECTURES.update({
    "anyflow-wan2.1-t2v-14b": dict(
        pipeline="AnyFlowPipeline", hub_id="nvidia/AnyFlow-Wan2.1-T2V-14B-Diffusers",
        transformer=dict(patch_size=[1, 2, 2], num_attention_heads=40, attention_head_dim=128, in_channels=16,
                         out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
                         cross_attn_norm=True, eps=1e-6, image_dim=None, rope_max_seq_len=1024, gate_value=0.25,
                         deltatime_type="r"),
        vae={}, text_encoder=_UMT5_XXL,
        scheduler=dict(_class_name="FlowMapEulerDiscreteScheduler", num_train_timesteps=1000, shift=5.0)),
})

# AnyFlow-FAR (nvidia/AnyFlow-FAR-Wan2.1-1.3B-Diffusers, an AnyFlowFARPipeline): AnyFlowFARTransformer3DModel at Wan 2.1
# T2V-1.3B's widths (12 heads of 128, FFN 8960, 30 layers), the rest the class's defaults, those of the released
# checkpoints: patch (1, 2, 2), the compressed context's (1, 4, 4), full_chunk_limit 3, chunk_partition
# (1, 3, 3, 3, 3, 3, 3, 2) for 81 frames; FlowMapEulerDiscreteScheduler at the Wan 2.1 shift of 5.
ARCHITECTURES["anyflow-far-wan2.1-1.3b"] = dict(
    pipeline="AnyFlowFARPipeline", hub_id="nvidia/AnyFlow-FAR-Wan2.1-1.3B-Diffusers",
    transformer=dict(patch_size=[1, 2, 2], compressed_patch_size=[1, 4, 4], full_chunk_limit=3,
                     num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
                     freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True, eps=1e-6, image_dim=None,
                     rope_max_seq_len=1024, gate_value=0.25, deltatime_type="r",
                     chunk_partition=[1, 3, 3, 3, 3, 3, 3, 2]),
    vae={}, text_encoder=_UMT5_XXL,
    scheduler=dict(_class_name="FlowMapEulerDiscreteScheduler", num_train_timesteps=1000, shift=5.0))

# Wan-Animate 2 (diffusers 0.42.1 ships it as modular pipelines only, WanAnimate2ModularPipeline; it names no released
# repository): WanAnimate2Transformer3DModel's defaults (5120 wide, 40 heads, 40 layers, 36 channels in, CLIP
# img_emb 1280 wide), the Wan 2.1 VAE, UMT5-XXL and the CLIP ViT-H/14 vision tower (the blocks resize its input to
# 224); FlowMatchEulerDiscreteScheduler (the blocks step it with a generator), at Wan2.2-Animate's shift of 5. Weights
# attach from a modular directory (export attach checks every tensor's name and shape).
ARCHITECTURES["wan-animate-2-14b"] = dict(
    pipeline="WanAnimate2ModularPipeline", hub_id="a Wan-Animate 2 modular directory",
    transformer={}, vae={}, text_encoder=_UMT5_XXL, image_encoder=_CLIP_VIT_H, image_processor=_CLIP_PROCESSOR,
    scheduler=dict(_class_name="FlowMatchEulerDiscreteScheduler", num_train_timesteps=1000, shift=5.0))
# The distilled (WanAnimate2DistilledModularPipeline): the same architecture, the kind animate-2-distilled.
ARCHITECTURES["wan-animate-2-14b-distilled"] = dict(ARCHITECTURES["wan-animate-2-14b"],
                                                    pipeline="WanAnimate2DistilledModularPipeline")
