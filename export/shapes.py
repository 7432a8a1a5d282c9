"""The tensor shapes of a bundle's programs: each shape's geometry, a Helios pyramid's stages, and the inputs of the
DiT's programs (the denoise steps' conditioning, the cross-attention keys' and values' prompt and image rows)."""

from __future__ import annotations

import dataclasses
from typing import Any

from runtime.errors import UserError
from runtime.kinds import Kind
from runtime.manifest import Chunks, Geometry, TensorSpec

from . import sharding
from .options import Settings
from .source import Source


def geometry(src: Source, s: Settings, shape: tuple[int, int, int], reference_images: int = 0) -> Geometry:
    vae_cfg, tr_cfg = src.vae_config, src.transformer_config
    t_scale = int(vae_cfg.get("scale_factor_temporal") or 4)
    s_scale = int(vae_cfg.get("scale_factor_spatial") or 8)
    text_dim = int(src.text_encoder_config["d_model"])
    if int(tr_cfg["text_dim"]) != text_dim:
        raise UserError(f"transformer text_dim {tr_cfg['text_dim']} != text encoder d_model {text_dim}")
    ph, pw = tr_cfg["patch_size"][1], tr_cfg["patch_size"][2]
    width, height, frames = shape
    if height % s_scale or width % s_scale or (height // s_scale) % ph or (width // s_scale) % pw:
        raise UserError(f"{width}x{height} does not divide into the DiT's {pw}x{ph} patches of the "
                        f"{s_scale}x-downscaled latent")
    return Geometry(width=width, height=height, frames=frames, batch=s.batch,
                    max_sequence_length=s.max_sequence_length, latent_channels=int(vae_cfg.get("z_dim") or 16),
                    latent_frames=(frames - 1) // t_scale + 1, latent_height=height // s_scale,
                    latent_width=width // s_scale, text_dim=text_dim, temporal_scale=t_scale,
                    spatial_scale=s_scale, reference_images=reference_images)


def dit_shape(src: Source, geo: Geometry) -> sharding.DitShape:
    cfg = src.transformer_config
    _, ph, pw = cfg["patch_size"]
    tokens = geo.latent_shape[2] * (geo.latent_height // ph) * (geo.latent_width // pw)  # reference frames too
    return sharding.DitShape(heads=int(cfg["num_attention_heads"]), tokens=tokens, batch=2 * geo.batch)


def pyramid_shape(g: Geometry, chunks: Chunks | None, stage: int | None) -> Geometry:
    """The DiT's latent geometry of shape `g` at a Helios pyramid's stage `stage` (runtime/programs.py Program.stage;
    None: the full-resolution stage, the only one of other bundles): stage k of S runs on latents 2^(S-1-k) times
    smaller (its history stays full size)."""
    if stage is None:
        return g
    f = 2 ** (chunks.stages - 1 - stage)
    return dataclasses.replace(g, latent_height=g.latent_height // f, latent_width=g.latent_width // f)


def check_pyramid(g: Geometry, chunks: Chunks) -> None:
    """A pyramid of S stages halves the latents S - 1 times, down to whole patches: refuse other sizes in one line."""
    div = 2 ** (chunks.stages - 1) * max(chunks.patch_size[1:])
    if g.latent_height % div or g.latent_width % div:
        step = div * g.spatial_scale
        raise UserError(f"{g.size}: a Helios pyramid of {chunks.stages} stages halves the latents "
                        f"({g.latent_width}x{g.latent_height}) {chunks.stages - 1} times, so they must divide by "
                        f"{div}: "
                        f"give a resolution whose width and height are multiples of {step}")


def chunks_for(scheduler_config: dict[str, Any], transformer_config: dict[str, Any],
               pipeline_options: dict[str, Any] | None = None) -> Chunks:
    """A Helios bundle's chunk settings: HeliosPipeline's history sizes; its scheduler's shift settings
    (calculate_shift's line as the pipeline reads it from the scheduler config, diffusers' defaults where absent); a
    pyramid pipeline's stages, gamma, DMD (HeliosDMDScheduler) and CFG-Zero* (model_index.json's is_cfg_zero_star)."""
    cfg, d, opts = scheduler_config, Chunks(), pipeline_options or {}
    pyramid = bool(opts.get("pyramid"))
    dmd = cfg.get("_class_name") == "HeliosDMDScheduler"
    if dmd and not pyramid:
        raise UserError("a HeliosDMDScheduler runs only in HeliosPyramidPipeline (the distilled model's stages): "
                        "export the checkpoint as HeliosPyramidPipeline")
    stages = int(cfg.get("stages", 3)) if pyramid else 1
    return Chunks(history_sizes=d.history_sizes, patch_size=tuple(int(p) for p in transformer_config["patch_size"]),
                  stages=stages, stage_range=tuple(float(r) for r in cfg.get("stage_range", d.stage_range)),
                  gamma=float(cfg.get("gamma", d.gamma)), distilled=dmd,
                  cfg_zero_star=bool(opts.get("is_cfg_zero_star")),
                  use_dynamic_shifting=bool(cfg.get("use_dynamic_shifting", False)),
                  time_shift_type=str(cfg.get("time_shift_type", "linear" if dmd else d.time_shift_type)),
                  shift=float(cfg.get("shift") if cfg.get("shift") is not None else 1.0),
                  **{k: type(getattr(d, k))(cfg.get(k, getattr(d, k)))
                     for k in ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")})


def conditioning_inputs(kind: Kind, geo: Geometry, module: Any = None, chunks: Chunks | None = None
                        ) -> dict[str, TensorSpec]:
    """The denoise programs' conditioning inputs (kind.conditioning_inputs) and their shapes (`module`: the DiT, for
    a VACE model's control channels and layers; `chunks`: a Helios bundle's, for its history's frames)."""
    b, z, t, h, w = geo.latent_shape
    mask = geo.temporal_scale if kind.channel_condition == "mask+latents" else 0
    shapes = {
        # "concat": the frame mask (one channel per frame a latent frame stands for) and the image latents; Lucy Edit:
        # the source video's latents; "first_frame": the image's latent frame
        "condition": (b, mask + z, t, h, w) if kind.channel_condition else (b, z, 1, h, w),
        "mask": (1, 1, t, h, w),
    }
    if kind.vace:  # the inactive and reactive latents and the folded mask, for the reference images' frames too
        shapes["control"] = (b, int(module.config.vace_in_channels), t, h, w)
        shapes["control_scale"] = (len(module.config.vace_layers),)
    if kind.forcing:  # re-noise for pinned frames and its share per frame, the frames that step, causal blocks, fps
        shapes.update(noise=(b, z, t, h, w), blend=(t,), update=(t,), causal_block=(), fps=())
    if kind.flow_map:  # a given video's first latent frames over every frame (mask 0 there), each frame's target time
        shapes.update(condition=(b, z, t, h, w), r_timestep=(t,))
    if kind.helios:  # the clean history (the first frame, then the long, mid and short history's), the guidance
        shapes.update(history=(b, z, 1 + sum((chunks or Chunks()).history_sizes), h, w), cfg_mode=())
    if kind.animate:  # the pose latents of the video's frames; the face_motion program's vectors, for cond and uncond
        cfg = module.config
        shapes["pose"] = (b, z, geo.latent_frames, h, w)
        shapes["motion"] = (2, b, geo.latent_frames, int(cfg.face_encoder_num_heads) + 1,
                            int(cfg.num_attention_heads) * int(cfg.attention_head_dim))
    ints = ("causal_block", "fps")
    return {name: TensorSpec(shapes[name], "int32" if name in ints else "float32") for name in kind.conditioning_inputs}


def kv_inputs(kind: Kind, geo: Geometry, image_tokens: tuple[int, ...] | None,
              text_rows: int | None = None) -> dict[str, TensorSpec]:
    """The cross_kv programs' inputs (kind.kv_inputs): the prompt's then the negative prompt's embeddings (their
    first `text_rows` rows for a short prompt's program), and for CLIP kinds the image embeddings. `image_tokens`
    is the CLIP stage's output shape (n_images, tokens, dim); the DiT takes diffusers' layout, the images of each
    video in turn (B x n_images, tokens, dim), and FLF2V's embedder pairs them up itself."""
    shapes = {"context": (2 * geo.batch, text_rows or geo.max_sequence_length, geo.text_dim),
              "image_embeds": (geo.batch * image_tokens[0], *image_tokens[1:]) if image_tokens else ()}
    return {name: TensorSpec(shapes[name], "float32") for name in kind.kv_inputs}
