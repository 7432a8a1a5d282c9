"""The decoders' and the VAE encoder's chunk programs, per width x height: the VAE's, and a tiny decoder's
(--tiny-decoder) checked against the VAE before anything is traced."""

from __future__ import annotations

from typing import Any

from jax.sharding import PartitionSpec

from runtime import programs
from runtime.errors import UserError
from runtime.manifest import Geometry, Target, TensorSpec
from runtime.manifest import TinyDecoder as TinyDecoderInfo
from runtime.programs import Program

from . import sharding, tiny_decoder, vae_decoder
from . import vae as vae_stage
from .attention import AttentionConfig
from .bundle_files import BundleFiles
from .options import TinyDecoderFile
from .source import Source
from .trace import Extracted


def export_vae(vae: Any, ex: Extracted, p: Program, geo: Geometry, target: Target, add_program: Any,
               attention: AttentionConfig) -> None:
    """The VAE's chunk program `p` (vae_encode or vae_decode, its first chunk or the next ones) for width x height of
    `geo`. The chunks do not depend on the frame count (whether a bundle has "next" chunks does: kinds.Kind.programs).

    On CPU targets the decoder is export/vae_decoder.py's channels-last JAX version of the same module
    (same weights, same cache slots); elsewhere, and for the encoder, the torchax trace."""
    direction = "decode" if p.base == programs.VAE_DECODE else "encode"
    if direction == "decode":
        batch, height, width = geo.batch, geo.latent_height, geo.latent_width
    else:  # images and videos are encoded once per call (batch 1) and repeated over the batch on the host
        batch, height, width = 1, geo.height, geo.width
    caches = vae_stage.cache_specs(vae, direction, batch, height, width)
    cache_inputs = {f"cache_{i:02d}": c for i, c in enumerate(caches) if c is not None}
    cache_outputs = list(cache_inputs)
    result = "frames" if direction == "decode" else "latents"
    build = vae_stage.build_decode if direction == "decode" else vae_stage.build_encode
    fn = ex.fn
    if direction == "decode" and target.platform == "cpu":
        fn = vae_decoder.build(vae, attention)
    arg = "latents" if direction == "decode" else "pixels"
    which = {"first": vae_stage.FIRST, "next": vae_stage.NEXT}[p.chunk]
    chunk = TensorSpec(vae_stage.chunk_shape(vae, direction, which, batch, height, width), "float32")
    inputs = {arg: chunk, **(cache_inputs if which == vae_stage.NEXT else {})}
    # Activations split on width (or height) over all devices; results come back whole (host 0 writes the video).
    dim = sharding.spatial_dim(chunk.shape, target.mesh)
    split = {k: sharding.width_split(c.shape, target.mesh, dim) for k, c in {arg: chunk, **cache_inputs}.items()}
    out_split = (PartitionSpec(), [split[k] for k in cache_outputs])
    add_program(p.name, "vae", build(vae, fn, caches, first=which == vae_stage.FIRST), inputs,
                [result, *cache_outputs], split, out_split)


def read_tiny_decoder(spec: TinyDecoderFile, src: Source) -> Any:
    """The tiny decoder of --tiny-decoder, checked against the model's VAE (its latent channels and scales) before
    anything is traced."""
    dec = spec.decoder if spec.decoder is not None else tiny_decoder.read(spec.path)
    z = int(src.vae_config.get("z_dim") or 16)
    if dec.latent_channels != z:
        raise UserError(f"--tiny-decoder {spec.path.name}: a {dec.latent_channels}-channel decoder, but this model's "
                        f"VAE has {z} latent channels: use the decoder made for this VAE (taew2_1/lighttaew2_1 for 16 "
                        "channels, taew2_2/lighttaew2_2 for 48)")
    spatial, temporal = int(src.vae_config.get("scale_factor_spatial") or 8), \
        int(src.vae_config.get("scale_factor_temporal") or 4)
    if (dec.spatial_scale, dec.time_scale) != (spatial, temporal):
        raise UserError(f"--tiny-decoder {spec.path.name}: it upscales {dec.spatial_scale}x in space and "
                        f"{dec.time_scale}x in time, this model's VAE {spatial}x and {temporal}x: use the decoder made "
                        "for this VAE")
    return dec


def export_tiny_decoder(src: Source, spec: TinyDecoderFile, dec: Any, todo: list[tuple[Program, Geometry]],
                        target: Target, files: BundleFiles) -> TinyDecoderInfo:
    """The tiny decoder's weights (float32, replicated: 11 M parameters) and its chunk programs `todo` (each with the
    shape it is made for: the longest of its width x height), activations split over the devices as the VAE's are."""
    import torch

    files.add_weights("tiny_decoder", {k: torch.from_numpy(v) for k, v in sorted(dec.tensors.items())}, {})
    for p, g in todo:
        chunk = TensorSpec((g.batch, dec.latent_channels, 1, g.latent_height, g.latent_width), "float32")
        memory = {f"cache_{i:02d}": TensorSpec(m, "float32")
                  for i, m in enumerate(dec.memory_shapes(g.batch, g.latent_height, g.latent_width))}
        dim = sharding.spatial_dim(chunk.shape, target.mesh)
        split = {k: sharding.width_split(t.shape, target.mesh, dim) for k, t in {"latents": chunk, **memory}.items()}
        fn = tiny_decoder.build(dec, spec.latents, src.vae_config["latents_mean"], src.vae_config["latents_std"],
                                first=p.chunk == "first")
        inputs = {"latents": chunk, **(memory if p.chunk == "next" else {})}
        files.add_program(p.name, "tiny_decoder", fn, inputs, ["frames", *memory], split,
                          (PartitionSpec(), [split[k] for k in memory]))
    return TinyDecoderInfo(latents=spec.latents, variant=dec.variant, latent_channels=dec.latent_channels,
                           file=spec.path.name)
