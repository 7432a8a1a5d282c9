"""The embedded models: small random-weight Wan pipelines of every kind, built in code.

They need no network and are bit-for-bit reproducible (fixed torch seeds, fixed
vocabulary), so `python -m export --model tiny` gives the same bundle on every
machine with the same tool versions. The shapes follow diffusers' own Wan tests;
the text encoder is a small UMT5, the tokenizer a SentencePiece-style Unigram
model written with the `tokenizers` library, and the image encoder a small CLIP
vision model. "tiny" (Wan 2.1 T2V) is the default; one variant per model kind of
runtime/kinds.py lets tests cover each diffusers configuration.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

_DIT = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
            text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
_VAE = dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
_UMT5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
# CLIP ViT in miniature: 32x32 pixels in 8x8 patches -> 16 + 1 tokens of width 8.
_CLIP = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, image_size=32,
             patch_size=8, projection_dim=8, hidden_act="gelu")
_CLIP_TOKENS = (32 // 8) ** 2 + 1
_I2V_DIT = {**_DIT, "in_channels": 16 + 4 + 16, "image_dim": 8, "added_kv_proj_dim": 24}
# Wan2.2-Animate-14B in miniature: a 36-channel DiT with CLIP cross-attention (added K/V, as the real model), a
# pose patch embedding, a 32x32 face motion encoder (channels per feature map size; 32 -> 16 -> 8 -> 4, then 4x4 to
# 1x1) and face adapters after blocks 0 and 2.
_ANIMATE_DIT = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=36, latent_channels=16,
    out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=4, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", image_dim=_CLIP["hidden_size"], added_kv_proj_dim=32, rope_max_seq_len=32,
    motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 12, "32": 8, "64": 8}, motion_encoder_size=32,
    motion_style_dim=16, motion_dim=4, motion_encoder_dim=16, face_encoder_hidden_dim=16, face_encoder_num_heads=2,
    inject_face_latents_blocks=2, motion_encoder_batch_size=8,
)
# The Wan 2.2 VAE: residual blocks, 2x2 patchify (12 channels), 16x spatial downscale.
_VAE22 = dict(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
              is_residual=True, patch_size=2, in_channels=12, out_channels=12, scale_factor_spatial=16)

_VAE22_48 = {**_VAE22, "z_dim": 48, "latents_mean": [round(0.05 * ((7 * i) % 11 - 5), 2) for i in range(48)],
             "latents_std": [round(0.6 + 0.1 * (i % 9), 2) for i in range(48)]}

# Named variants; "tiny" is the default. "tiny-wide" exists so tests cover a second
# architecture (more heads and layers, a wider VAE with a channel multiplier).
# Optional keys: pipeline ("t2v" | "i2v" | "vace" | "v2v" | "animate" | "lucy" | "skyreels-t2v" | "skyreels-i2v" |
# "skyreels-df" | "helios" | "helios-pyramid"; these two with their scheduler's `scheduler` settings, the pyramid's
# pipeline `options` and `dmd` for HeliosDMDScheduler), experts (2: transformer_2 with boundary_ratio), expand_timesteps, image_encoder (a
# CLIPVisionConfig).
VARIANTS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        transformer=dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
            out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        ),
        vae=dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                 temperal_downsample=[False, True, True]),
        text_encoder=dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
        flow_shift=3.0,
    ),
    "tiny-wide": dict(
        transformer=dict(
            patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=16,
            out_channels=16, text_dim=48, freq_dim=64, ffn_dim=64, num_layers=3,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
        ),
        vae=dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                 temperal_downsample=[False, True, True]),
        text_encoder=dict(d_model=48, d_kv=12, d_ff=96, num_layers=3, num_heads=4),
        flow_shift=5.0,
    ),
    # Wan2.2-T2V-A14B in miniature: two experts of one architecture.
    "tiny-t2v-moe": dict(transformer=_DIT, vae=_VAE, text_encoder=_UMT5, flow_shift=3.0, experts=2,
                         boundary_ratio=0.875),
    # Wan2.2-TI2V-5B (a WanPipeline, as the official checkpoint): the Wan 2.2 VAE, per-token timesteps;
    # text or text + image.
    "tiny-ti2v": dict(transformer=_DIT, vae=_VAE22, text_encoder=_UMT5, flow_shift=5.0,
                      expand_timesteps=True),
    # TI2V with the real Wan 2.2 VAE's 48 latent channels (tiny-ti2v's has 16): what 48-channel tiny decoders
    # (taew2_2, lighttaew2_2) decode; its own latent statistics, so the raw convention's z * std + mean is its own.
    "tiny-ti2v-48": dict(transformer={**_DIT, "in_channels": 48, "out_channels": 48}, vae=_VAE22_48,
                         text_encoder=_UMT5, flow_shift=5.0, expand_timesteps=True),
    # Wan2.1-I2V-14B: CLIP image encoder, 36-channel DiT input, image cross-attention.
    "tiny-i2v": dict(transformer=_I2V_DIT, vae=_VAE, text_encoder=_UMT5, flow_shift=3.0, pipeline="i2v",
                     image_encoder=_CLIP),
    # Wan2.1-FLF2V-14B: first and last frame, a learned position embedding over both images' tokens.
    "tiny-flf2v": dict(transformer={**_I2V_DIT, "pos_embed_seq_len": 2 * _CLIP_TOKENS}, vae=_VAE,
                       text_encoder=_UMT5, flow_shift=3.0, pipeline="i2v", image_encoder=_CLIP),
    # Wan2.1-VACE: the VACE branch after both blocks (96 = 2 x 16 latent channels + 8 x 8 mask channels).
    "tiny-vace": dict(transformer={**_DIT, "vace_layers": [0, 1], "vace_in_channels": 96}, vae=_VAE,
                      text_encoder=_UMT5, flow_shift=3.0, pipeline="vace"),
    # Wan2.2-VACE-Fun-A14B: two VACE experts; its VACE branch after the first block only.
    "tiny-vace-moe": dict(transformer={**_DIT, "vace_layers": [0], "vace_in_channels": 96}, vae=_VAE,
                          text_encoder=_UMT5, flow_shift=3.0, pipeline="vace", experts=2, boundary_ratio=0.875),
    # WanVideoToVideoPipeline: Wan 2.1 T2V that takes a source video.
    "tiny-v2v": dict(transformer=_DIT, vae=_VAE, text_encoder=_UMT5, flow_shift=3.0, pipeline="v2v"),
    # Wan2.2-Animate-14B: a reference image (CLIP and VAE), pose and face videos.
    "tiny-animate": dict(transformer=_ANIMATE_DIT, vae=_VAE, text_encoder=_UMT5, flow_shift=3.0, pipeline="animate",
                         image_encoder=_CLIP),
    # Lucy Edit (decart-ai/Lucy-Edit-Dev): TI2V-5B's layout (the Wan 2.2 VAE, expand_timesteps) with a DiT taking
    # the noise and the source video's latents side by side (16 + 16 channels).
    "tiny-lucy-edit": dict(transformer={**_DIT, "in_channels": 32}, vae=_VAE22, text_encoder=_UMT5, flow_shift=5.0,
                           pipeline="lucy", expand_timesteps=True),
    # Wan2.2-I2V-A14B: no CLIP, two experts.
    "tiny-i2v-moe": dict(transformer={**_DIT, "in_channels": 36}, vae=_VAE, text_encoder=_UMT5, flow_shift=3.0,
                         pipeline="i2v", experts=2, boundary_ratio=0.9),
    # ChronoEdit (nvidia/ChronoEdit-14B-Diffusers): tiny-i2v's parts, the DiT a ChronoEditTransformer3DModel (2 latent
    # frames at temporal RoPE positions 0 and 7), in a ChronoEditPipeline.
    "tiny-chronoedit": dict(transformer={**_I2V_DIT, "rope_temporal_skip_len": 8}, vae=_VAE, text_encoder=_UMT5,
                            flow_shift=5.0, pipeline="chronoedit", image_encoder=_CLIP),
}

# SkyReels-V2 in miniature (SkyReelsV2Transformer3DModel, the Wan 2.1 shapes above): text-to-video, image-to-video
# with CLIP, first-last-frame, and diffusion forcing with the fps embedding (as DF-1.3B-540P has it).
VARIANTS.update({
    "tiny-skyreels-t2v": dict(transformer=_DIT, vae=_VAE, text_encoder=_UMT5, flow_shift=8.0, pipeline="skyreels-t2v"),
    "tiny-skyreels-i2v": dict(transformer=_I2V_DIT, vae=_VAE, text_encoder=_UMT5, flow_shift=5.0,
                              pipeline="skyreels-i2v", image_encoder=_CLIP),
    "tiny-skyreels-flf2v": dict(transformer={**_I2V_DIT, "pos_embed_seq_len": 2 * _CLIP_TOKENS}, vae=_VAE,
                                text_encoder=_UMT5, flow_shift=5.0, pipeline="skyreels-i2v", image_encoder=_CLIP),
    "tiny-skyreels-df": dict(transformer={**_DIT, "inject_sample_info": True}, vae=_VAE, text_encoder=_UMT5,
                             flow_shift=8.0, pipeline="skyreels-df"),
})
SKYREELS_PIPELINES = ("skyreels-t2v", "skyreels-i2v", "skyreels-df")

# Helios (BestWishYsh/Helios-Base) in miniature: HeliosTransformer3DModel with its history patch embeddings and history
# key scale, RoPE over 4 + 4 + 4 of the 12 head channels; the HeliosScheduler as HeliosPipeline runs it.
VARIANTS["tiny-helios"] = dict(
    transformer=dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                     out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, rope_dim=(4, 4, 4),
                     is_amplify_history=True),
    vae=_VAE, text_encoder=_UMT5, pipeline="helios",
    scheduler=dict(stages=1, use_dynamic_shifting=True, shift=1.0, scheduler_type="unipc"))
# Helios-Mid and -Distilled in miniature: HeliosPyramidPipeline's three stages (gamma 0.3: at the class default 1/3
# the block noise's covariance is singular and diffusers' float32 Cholesky fails), CFG-Zero*, and the distilled one's
# HeliosDMDScheduler.
VARIANTS["tiny-helios-pyramid"] = dict(
    VARIANTS["tiny-helios"], pipeline="helios-pyramid", options=dict(is_cfg_zero_star=True),
    scheduler=dict(stages=3, gamma=0.3, use_dynamic_shifting=True, shift=1.0, scheduler_type="unipc"))
VARIANTS["tiny-helios-distilled"] = dict(
    VARIANTS["tiny-helios"], pipeline="helios-pyramid", options=dict(is_distilled=True), dmd=True,
    scheduler=dict(stages=3, gamma=0.3, use_dynamic_shifting=True, shift=1.0, time_shift_type="linear"))

# AnyFlow (nvidia/AnyFlow-Wan2.1-T2V-14B-Diffusers) in miniature: AnyFlowTransformer3DModel (Wan 2.1's blocks, the
# delta embedder on r gated at 0.25) and FlowMapEulerDiscreteScheduler at the Wan 2.1 shift.
VARIANTS["tiny-anyflow"] = dict(
    transformer=dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                     out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                     rope_max_seq_len=32, gate_value=0.25, deltatime_type="r"),
    vae=_VAE, text_encoder=_UMT5, pipeline="anyflow", scheduler=dict(shift=5.0))
# AnyFlow-FAR (nvidia/AnyFlow-FAR-Wan2.1-1.3B-Diffusers) in miniature: AnyFlowFARTransformer3DModel with a full-chunk
# limit of 2 and chunks (1, 2, 2, 2) (25 frames = 7 latent frames), so that a tiny video already has chunks of two
# sizes and compressed context (chunk 0 is compressed from chunk 2 on).
VARIANTS["tiny-anyflow-far"] = dict(
    transformer=dict(patch_size=(1, 2, 2), compressed_patch_size=(1, 4, 4), full_chunk_limit=2,
                     num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16, text_dim=32,
                     freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32,
                     gate_value=0.25, deltatime_type="r", chunk_partition=(1, 2, 2, 2)),
    vae=_VAE, text_encoder=_UMT5, pipeline="anyflow-far", scheduler=dict(shift=5.0))

# Wan-Animate 2 in miniature (WanAnimate2Transformer3DModel; diffusers ships it as modular pipelines only, saved with a
# modular_model_index.json): ten blocks, so that the unconditional branch's skipped block 9 is in the model; its CLIP
# is 1280 wide (the DiT's img_emb takes 1280 features) at 224x224 pixels (the blocks resize to 224), in 32x32 patches;
# FlowMatchEulerDiscreteScheduler (the modular denoise loop passes its generator to `scheduler.step`).
_ANIMATE2_DIT = dict(patch_size=(1, 2, 2), text_len=512, in_dim=36, dim=32, ffn_dim=32, freq_dim=256, text_dim=32,
                     out_dim=16, num_heads=2, num_layers=10)
_ANIMATE2_CLIP = dict(hidden_size=1280, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                      image_size=224, patch_size=32, projection_dim=8, hidden_act="gelu")
VARIANTS["tiny-animate-2"] = dict(transformer=_ANIMATE2_DIT, vae=_VAE, text_encoder=_UMT5, pipeline="animate-2",
                                  image_encoder=_ANIMATE2_CLIP, scheduler=dict(shift=3.0))
# The distilled in two blocks (it runs no unconditional branch): what the tests run many segments of.
VARIANTS["tiny-animate-2-distilled"] = dict(VARIANTS["tiny-animate-2"], pipeline="animate-2-distilled",
                                            transformer={**_ANIMATE2_DIT, "num_layers": 2}, scheduler=dict(shift=5.0))
MODULAR = ("animate-2", "animate-2-distilled")  # pipelines built as diffusers' modular pipelines (build_modular)

VACE_GAIN = 8.0  # the tiny VACE models' VACE branch, made this much stronger than its random init (build_pipeline)

_WORDS = (
    "a an the of in on at with and or to from by for is are cat dog robot city street night "
    "day sky sea water fire light dark red blue green white black small big walking running "
    "flying dancing playing piano jazz club kitchen cake baking together garden video scene "
    "camera slow motion cinematic detailed high quality blurry low static"
).split()


def tokenizer_json() -> str:
    """A deterministic T5-style tokenizer: pad 0, eos 1, unk 2, post-processor `$A </s>`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pieces = ["<pad>", "</s>", "<unk>", "\u2581"]
    pieces += [c for c in string.ascii_letters + string.digits + string.punctuation]
    pieces += ["\u2581" + w for w in _WORDS]
    vocab = [(p, 0.0 if i < 3 else -float(len(p) <= 1) * 5.0 - 1.0 / (1 + len(p)))
             for i, p in enumerate(pieces)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    for special in ("<pad>", "</s>", "<unk>"):
        tok.add_special_tokens([special])
    return tok.to_str()


def build_pipeline(variant: str | dict[str, Any] = "tiny") -> Any:
    """A Wan pipeline (fp32, CPU) with seeded random weights: a named variant, or a spec shaped like
    VARIANTS' values."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        SkyReelsV2DiffusionForcingPipeline,
        SkyReelsV2ImageToVideoPipeline,
        SkyReelsV2Pipeline,
        SkyReelsV2Transformer3DModel,
        UniPCMultistepScheduler,
        WanAnimatePipeline,
        WanAnimateTransformer3DModel,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
        WanVACEPipeline,
        WanVACETransformer3DModel,
        WanVideoToVideoPipeline,
    )

    spec = variant if isinstance(variant, dict) else VARIANTS[variant]
    tokenizer = _tokenizer()
    torch.manual_seed(0)
    te = spec["text_encoder"]
    text_encoder = _umt5(te, len(tokenizer))
    pipeline = spec.get("pipeline", "t2v")
    from diffusers import (
        ChronoEditPipeline,
        ChronoEditTransformer3DModel,
        HeliosDMDScheduler,
        HeliosPipeline,
        HeliosPyramidPipeline,
        HeliosScheduler,
        HeliosTransformer3DModel,
    )

    helios = pipeline in ("helios", "helios-pyramid")
    from diffusers import (
        AnyFlowFARPipeline,
        AnyFlowFARTransformer3DModel,
        AnyFlowPipeline,
        AnyFlowTransformer3DModel,
        FlowMapEulerDiscreteScheduler,
    )

    dit = {"anyflow-far": AnyFlowFARTransformer3DModel,
           "anyflow": AnyFlowTransformer3DModel, "vace": WanVACETransformer3DModel, "animate": WanAnimateTransformer3DModel, "helios": HeliosTransformer3DModel,
           "helios-pyramid": HeliosTransformer3DModel, "chronoedit": ChronoEditTransformer3DModel,
           **dict.fromkeys(SKYREELS_PIPELINES, SkyReelsV2Transformer3DModel)}.get(pipeline, WanTransformer3DModel)
    torch.manual_seed(1)
    transformer = dit(**spec["transformer"]).eval()
    torch.manual_seed(2)
    vae = AutoencoderKLWan(**spec["vae"]).eval()
    helios_scheduler = HeliosDMDScheduler if spec.get("dmd") else HeliosScheduler
    scheduler = helios_scheduler(**spec["scheduler"]) if helios else \
        FlowMapEulerDiscreteScheduler(**spec["scheduler"]) if pipeline in ("anyflow", "anyflow-far") else \
        UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
        flow_shift=spec["flow_shift"], solver_order=2, solver_type="bh2", lower_order_final=True,
        final_sigmas_type="zero",
    )
    parts: dict[str, Any] = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                                 transformer=transformer)
    if spec.get("experts", 1) == 2:
        torch.manual_seed(3)
        parts.update(transformer_2=dit(**spec["transformer"]).eval(),
                     boundary_ratio=spec["boundary_ratio"])
    if pipeline == "vace":  # a random VAE barely tells one video from another: amplify the VACE branch so that the
        for model in (parts["transformer"], parts.get("transformer_2")):  # control visibly changes the video
            if model is not None:
                with torch.no_grad():
                    model.vace_patch_embedding.weight.mul_(VACE_GAIN)
                    for block in model.vace_blocks:
                        block.proj_out.weight.mul_(VACE_GAIN)
    if spec.get("expand_timesteps"):
        parts["expand_timesteps"] = True
    if pipeline == "helios":
        return HeliosPipeline(**parts)
    if pipeline == "anyflow":
        return AnyFlowPipeline(**parts)
    if pipeline == "anyflow-far":
        return AnyFlowFARPipeline(**parts)
    if pipeline == "helios-pyramid":
        return HeliosPyramidPipeline(**parts, **spec.get("options", {}))
    if pipeline == "lucy":
        from diffusers import LucyEditPipeline

        return LucyEditPipeline(**parts)
    if pipeline in ("t2v", "vace", "v2v", "skyreels-t2v", "skyreels-df"):
        cls = {"t2v": WanPipeline, "vace": WanVACEPipeline, "v2v": WanVideoToVideoPipeline,
               "skyreels-t2v": SkyReelsV2Pipeline, "skyreels-df": SkyReelsV2DiffusionForcingPipeline}[pipeline]
        return cls(**parts)
    if "image_encoder" in spec:  # (Animate's pipeline takes it too)
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

        torch.manual_seed(4)
        cfg = spec["image_encoder"]
        parts["image_encoder"] = CLIPVisionModel(CLIPVisionConfig(**cfg)).eval()
        parts["image_processor"] = CLIPImageProcessor(
            size={"shortest_edge": cfg["image_size"]},
            crop_size={"height": cfg["image_size"], "width": cfg["image_size"]},
            resample=3, do_center_crop=True, do_normalize=True, do_rescale=True, do_resize=True, do_convert_rgb=True,
            image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
    cls = {"animate": WanAnimatePipeline, "skyreels-i2v": SkyReelsV2ImageToVideoPipeline,
           "chronoedit": ChronoEditPipeline}.get(pipeline,
                                                                                          WanImageToVideoPipeline)
    return cls(**parts)


def _tokenizer() -> Any:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json()), pad_token="<pad>",
                                   eos_token="</s>", unk_token="<unk>", model_max_length=512)


def _umt5(te: dict[str, int], vocab: int) -> Any:
    """The tiny UMT5 text encoder of a variant's `text_encoder` widths (random: seed it first)."""
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(
        vocab_size=vocab, d_model=te["d_model"], d_kv=te["d_kv"], d_ff=te["d_ff"],
        num_layers=te["num_layers"], num_heads=te["num_heads"], relative_attention_num_buckets=32,
        relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )).eval()


def build_modular(variant: str | dict[str, Any]) -> Any:
    """A Wan-Animate 2 modular pipeline (fp32, CPU) with seeded random weights, as diffusers' docs build one:
    `WanAnimate2Blocks().init_pipeline()` (the distilled: `WanAnimate2DistilledBlocks`), then
    `update_components(...)`; the image and video processors and the guider are the blocks' own defaults."""
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanAnimate2Transformer3DModel
    from diffusers.modular_pipelines import WanAnimate2Blocks, WanAnimate2DistilledBlocks
    from transformers import CLIPVisionConfig, CLIPVisionModel

    spec = variant if isinstance(variant, dict) else VARIANTS[variant]
    tokenizer = _tokenizer()
    torch.manual_seed(0)
    te = spec["text_encoder"]
    text_encoder = _umt5(te, len(tokenizer))
    torch.manual_seed(1)
    transformer = WanAnimate2Transformer3DModel(**spec["transformer"]).eval()
    torch.manual_seed(2)
    vae = AutoencoderKLWan(**spec["vae"]).eval()
    torch.manual_seed(4)
    image_encoder = CLIPVisionModel(CLIPVisionConfig(**spec["image_encoder"])).eval()
    blocks = WanAnimate2DistilledBlocks() if spec["pipeline"] == "animate-2-distilled" else WanAnimate2Blocks()
    pipe = blocks.init_pipeline()
    pipe.update_components(text_encoder=text_encoder, tokenizer=tokenizer, image_encoder=image_encoder, vae=vae,
                           transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**spec["scheduler"]))
    return pipe


def save(variant: str, directory: Path) -> Path:
    """Write the tiny pipeline to `directory` in diffusers format (safetensors), as `save_pretrained` does (a modular
    pipeline's directory holds a modular_model_index.json instead of model_index.json)."""
    modular = VARIANTS[variant].get("pipeline") in MODULAR
    pipe = build_modular(variant) if modular else build_pipeline(variant)
    directory.mkdir(parents=True, exist_ok=True)
    # (a modular index pointing its components at the directory: what diffusers' save_pretrained now does by default)
    pipe.save_pretrained(str(directory), safe_serialization=True, **({"overwrite_modular_index": True} if modular
                                                                     else {}))
    return directory
