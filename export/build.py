"""Assemble a bundle: trace each stage, write programs, weights, tokenizer and the manifest.

Everything is written into a temporary sibling directory and renamed into place
at the end, so an interrupted export never leaves a bundle that looks complete.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from runtime import chronoedit, images, kinds, samplers
from runtime import scheduler as sched
from runtime import settings as run_settings
from runtime.errors import UserError
from runtime.files import process_alive
from runtime.kinds import Kind
from runtime.manifest import (
    MANIFEST_FILE,
    SCHEMA_VERSION,
    BlockLoop,
    Chunks,
    Defaults,
    FileRef,
    Geometry,
    Manifest,
    ProgramSpec,
    Target,
    TensorSpec,
    WeightFile,
    canonical_json,
    sha256_file,
    shape_suffix,
)
from runtime.manifest import TinyDecoder as TinyDecoderInfo

from . import (
    cross_kv,
    denoise,
    denoise_blocks,
    face_motion,
    image_encoder,
    lora,
    sharding,
    text_encoder,
    tiny_decoder,
    vae_decoder,
)
from . import vae as vae_stage
from . import weights as weight_writer
from .attention import AttentionConfig
from .source import Source
from .trace import Extracted, abstract_mesh, export_program, extract

log = logging.getLogger("export")

RESOLUTIONS = {"480p": (832, 480), "720p": (1280, 720)}


@dataclass(frozen=True)
class Settings:
    shapes: tuple[tuple[int, int, int], ...]  # (width, height, frames) of each shape, the default first
    batch: int
    max_sequence_length: int
    dtype: str  # "bf16" | "fp32"
    target: Target
    attention: AttentionConfig = AttentionConfig()
    quantize: str | None = None  # export/quantize.py MODES
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)  # --defaults: run defaults over the checkpoint's
    loras: tuple[lora.MergeSpec, ...] = ()  # --merge-lora / --merge-lora-2: merged into the DiT's weights
    reference_images: tuple[int, ...] = (0,)  # VACE: the counts of reference images the DiT programs serve
    tiny_decoder: TinyDecoderFile | None = None  # --tiny-decoder: a second decoder beside the VAE's


@dataclass(frozen=True)
class TinyDecoderFile:
    path: Path
    latents: str  # export/tiny_decoder.py LATENTS
    decoder: Any = None  # the file read (tiny_decoder.read), or None: read when needed


def size_multiple(src: Source) -> int:
    """Pixel sizes must divide by the VAE's spatial scale times the DiT's patch (16 for Wan 2.1, 32 for TI2V)."""
    s_scale = int(src.vae_config.get("scale_factor_spatial") or 8)
    return s_scale * int(max(src.transformer_config["patch_size"][1:]))


def parse_resolution(text: str, multiple: int = 16) -> tuple[int, int]:
    """'480p', '720p' (the family's native size: 1280x720 rounded down to `multiple`, as diffusers rounds,
    e.g. 1280x704 for TI2V-5B) or 'WxH' -> (width, height), both multiples of `multiple`."""
    if text in RESOLUTIONS:
        w, h = RESOLUTIONS[text]
        return w // multiple * multiple, h // multiple * multiple
    m = re.fullmatch(r"(\d+)x(\d+)", text.strip())
    if not m:
        raise UserError(f"resolution {text!r} is not 480p, 720p or WIDTHxHEIGHT (e.g. 832x480)")
    w, h = int(m.group(1)), int(m.group(2))
    if w <= 0 or h <= 0 or w % multiple or h % multiple:
        near = f"{max(multiple, round(w / multiple) * multiple)}x{max(multiple, round(h / multiple) * multiple)}"
        raise UserError(f"resolution {w}x{h} is not a multiple of {multiple} in both width and height (the VAE's "
                        f"spatial scale times the DiT's patch size for this model): try {near}")
    return w, h


def check_frames(frames: int) -> int:
    if frames < 1 or (frames - 1) % 4:
        lo = max(1, (frames - 1) // 4 * 4 + 1)
        raise UserError(f"--frames {frames} is not of the form 4k+1 (try {lo} or {lo + 4})")
    return frames


def parse_frames(text: str) -> list[int]:
    """'81' or '49,81' -> [81] or [49, 81], each of the form 4k+1."""
    out = []
    for part in str(text).split(","):
        if not part.strip().isdigit():
            raise UserError(f"--frames {text!r} is not a frame count or a comma-separated list of them (e.g. 81 or "
                            "49,81)")
        out.append(check_frames(int(part)))
    return out


def parse_reference_images(text: str | None, kind: Kind) -> tuple[int, ...]:
    """--reference-images "0,1" -> (0, 1): the counts a VACE bundle serves (default 0 and 1), the first the default;
    refused for other kinds."""
    if not kind.reference_images:
        if text is not None:
            raise UserError(f"--reference-images is for VACE models; this model is {kind.title}")
        return (0,)
    counts = []
    for part in (text or "0,1").split(","):
        if not part.strip().isdigit():
            raise UserError(f"--reference-images {text!r} is not a comma-separated list of counts (e.g. 0,1,2)")
        counts.append(int(part))
    if len(set(counts)) != len(counts):
        raise UserError(f"--reference-images {text!r} lists a count twice: list each once")
    return tuple(counts)


def parse_shapes(resolutions: str, frames: str, multiple: int = 16) -> tuple[tuple[int, int, int], ...]:
    """--resolution R1,R2,... x --frames F1,F2,... -> every (width, height, frames), in the order given (the first
    resolution with the first frame count is the default shape); a resolution or count given twice is refused."""
    sizes = [parse_resolution(r, multiple) for r in resolutions.split(",")]
    counts = parse_frames(frames)
    for what, values, show in (("--resolution", sizes, lambda v: f"{v[0]}x{v[1]}"), ("--frames", counts, str)):
        twice = [v for i, v in enumerate(values) if v in values[:i]]
        if twice:
            raise UserError(f"{what} lists {show(twice[0])} twice (after resolving 480p/720p): list each once")
    return tuple((w, h, f) for w, h in sizes for f in counts)


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


def versions() -> dict[str, str]:
    out = {}
    for pkg in ("wan-aot", "jax", "jaxlib", "torch", "torchax", "diffusers", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "unknown"
    return out


# Weight group -> partition-rule family (export/sharding.py).
FAMILIES = {"text_encoder": "umt5", "image_encoder": "clip_vision", "transformer": "wan_transformer",
            "transformer_2": "wan_transformer", "vae": "wan_vae", "tiny_decoder": "taehv"}


def attention_for(target: Target, base: AttentionConfig) -> AttentionConfig:
    """TPU targets run the DiT's attention in the Pallas flash kernel; other platforms in plain JAX."""
    return dataclasses.replace(base, kernel="pallas" if target.platform == "tpu" else "xla")


def dit_shape(src: Source, geo: Geometry) -> sharding.DitShape:
    cfg = src.transformer_config
    _, ph, pw = cfg["patch_size"]
    tokens = geo.latent_shape[2] * (geo.latent_height // ph) * (geo.latent_width // pw)  # reference frames too
    return sharding.DitShape(heads=int(cfg["num_attention_heads"]), tokens=tokens, batch=2 * geo.batch)


def load_component(src: Source, group: str, attention: AttentionConfig, mesh: Any = None,
                   platform: str = "cpu", quantize: str | None = None,
                   adapters: list[tuple[dict[str, Any], float]] = ()) -> tuple[Any, Extracted]:
    """(torch module, its torchax extraction) of one weight group; the module keeps the weights alive.

    Only the DiT runs the TPU kernel (sharded over `mesh`); the encoders and VAE use XLA attention.
    On CPU the VAE's 3D convolutions run as 2D ones (export/conv.py; the decoder is replaced by
    export/vae_decoder.py in `export_vae`) and bf16 matmuls accumulate in fp32 (export/cpu_dots.py).
    With `quantize`, the layers export/quantize.py's table names are swapped for quantized ones before
    the module is extracted, so every program traced from it takes the quantized tensors. `adapters`
    (export/lora.py read_merges) are merged into a DiT expert's weights first, so they are quantized merged.
    """
    cpu = platform == "cpu"
    loaders = {"text_encoder": src.load_text_encoder, "image_encoder": src.load_image_encoder,
               "transformer": lambda: src.load_transformer("transformer"),
               "transformer_2": lambda: src.load_transformer("transformer_2"), "vae": src.load_vae}
    if group not in loaders:
        raise KeyError(group)
    module = loaders[group]()
    if adapters and group in kinds.DIT_GROUPS and src.weights:
        changed = lora.merge_into(dict(module.named_parameters()), group, list(adapters))
        log.info("merged %d LoRA adapter(s) into %d %s tensors", len(adapters), changed, group)
    quantized = {}
    if quantize:
        from . import quantize as quant

        quantized = quant.apply(module, group, quantize)
    if group == "vae":
        parts = vae_stage.module(module, encode=bool(src.model.vae_encode) or src.video_to_video)
        ex = extract(parts, dataclasses.replace(attention, kernel="xla"), conv_as_2d=cpu)
    elif group in ("transformer", "transformer_2"):
        ex = extract(module, attention, mesh, {r"(vace_)?blocks\.\d+": lambda: sharding.current_layout().hidden},
                     conv_as_2d=cpu, cpu_dots=cpu)
    else:
        ex = extract(module, dataclasses.replace(attention, kernel="xla"), cpu_dots=cpu)
    ex.quantized = quantized
    return module, ex


def expert_shapes(src: Source) -> dict[str, dict[str, tuple[int, ...]]]:
    """Each DiT expert's tensor shapes, from the model built on `meta` (no weights read): what --merge-lora
    adapters are checked against before an export starts."""
    module = dataclasses.replace(src, weights=False).load_transformer("transformer")
    shapes = {k: tuple(v.shape) for k, v in module.named_parameters()}
    return {group: shapes for group in src.model.expert_groups}


def build_bundle(src: Source, s: Settings, out: Path, force: bool = False,
                 check: Callable[[Path, Manifest], None] | None = None) -> Manifest:
    """Export every stage of `src` for `s` into the bundle directory `out` (weights only if src has them). `check`
    (the bundle's directory, its manifest) runs on the finished bundle before it takes `out`'s place: if it raises,
    nothing is written (export --fit)."""
    import torch

    if out.exists() and not force:
        raise UserError(f"{out} already exists: choose another --out or pass --force to replace it")
    kind = src.model
    # VACE: the DiT's programs per count of reference images; Animate: its character image, always one latent frame
    refs = s.reference_images if kind.reference_images else (1,) if kind.animate else (0,)
    shapes = [geometry(src, s, shape, r) for shape in s.shapes for r in refs]
    geo = shapes[0]  # the default shape; what does not depend on the shape is traced with it
    for g in shapes:
        sharding.check_dit(s.target, dit_shape(src, g), src.id,
                           f"{g.size} x {g.frames} frames" if len(shapes) > 1 else "")
    sampler, sched_cfg, shift = samplers.from_checkpoint(src.scheduler_config)
    run_defaults = defaults_for(kind, sched_cfg, Defaults(steps=kind.steps, guidance=kind.guidance, flow_shift=shift,
                                                          fps=kind.fps, sampler=sampler), s.defaults)
    order = sched_cfg.solver_order
    chunks = chunks_for(src.scheduler_config, src.transformer_config, src.pipeline_options) if kind.helios else None
    if chunks is not None:
        for g in shapes:
            check_pyramid(g, chunks)
    if kind.chronoedit:  # every run ends on the edit's 2 latent frames (runtime/chronoedit.py)
        chronoedit.check_shapes(shapes)
    adapters = lora.read_merges(list(s.loras), expert_shapes(src)) if s.loras else []
    attention = attention_for(s.target, s.attention)
    mesh = abstract_mesh(s.target)
    tiny_dec = read_tiny_decoder(s.tiny_decoder, src) if s.tiny_decoder is not None else None  # before any tracing
    tmp = _fresh_tmp(out)
    try:
        programs: dict[str, ProgramSpec] = {}
        weight_files: dict[str, WeightFile] = {}
        partitions: dict[str, dict[str, PartitionSpec]] = {}

        def add_weights(group: str, weights: dict[str, Any], quantized: dict[str, str]) -> None:
            tensors = {k: weight_writer.spec(t) for k, t in weights.items()}
            partitions[group] = sharding.partitions(FAMILIES[group], tensors, quantized, s.target.mesh)
            file = sha = None
            if src.weights:
                log.info("writing %s weights", group)
                file = f"weights/{group}.safetensors"
                weight_writer.write(tmp / file, weights)
                sha = sha256_file(tmp / file)
            weight_files[group] = WeightFile(file=file, sha256=sha, tensors=dict(sorted(tensors.items())),
                                             partition={k: sharding.spec_to_json(p)
                                                        for k, p in sorted(partitions[group].items())},
                                             quantized=dict(sorted(quantized.items())))

        def write_program(name: str, group: str, fn: Any, inputs: dict[str, TensorSpec], outputs: list[str],
                          input_partition: dict[str, PartitionSpec] | None = None,
                          output_partition: Any = PartitionSpec(), tensors: dict[str, str] | None = None
                          ) -> tuple[FileRef, dict[str, TensorSpec]]:
            """Export fn to stages/<name>.jaxexport; its weights are the group's, or with `tensors` (the name fn
            uses -> the group's name) those tensors only. Returns the file and the output specs."""
            t0 = time.perf_counter()
            names = tensors or {k: k for k in weight_files[group].tensors}
            blob, outs = export_program(fn, {k: weight_files[group].tensors[g] for k, g in names.items()},
                                        {k: partitions[group][g] for k, g in names.items()}, inputs,
                                        input_partition or {}, outputs, output_partition, s.target)
            log.info("exported %s in %.2f s", name, time.perf_counter() - t0)
            rel = f"stages/{name}.jaxexport"
            (tmp / rel).write_bytes(blob)
            return FileRef(rel, sha256_file(tmp / rel)), outs

        def add_program(name: str, group: str, fn: Any, inputs: dict[str, TensorSpec], outputs: list[str],
                        input_partition: dict[str, PartitionSpec] | None = None,
                        output_partition: Any = PartitionSpec()) -> None:
            ref, outs = write_program(name, group, fn, inputs, outputs, input_partition, output_partition)
            programs[name] = ProgramSpec(file=ref.file, sha256=ref.sha256, weights=group, inputs=inputs,
                                         outputs=outs)

        model_dtype = np.dtype({"bf16": "bfloat16", "fp32": "float32"}[s.dtype])  # ml_dtypes registers bf16
        # One component in memory at a time: load, write its weights, trace its programs, drop it.
        with torch.no_grad():
            n2, L = 2 * geo.batch, geo.max_sequence_length
            module, ex = load_component(src, "text_encoder", attention, platform=s.target.platform,
                                        quantize=s.quantize)
            add_weights("text_encoder", ex.weights, ex.quantized)
            encode = text_encoder.build(ex)
            for n in kinds.text_lengths(L):  # the same encoder over the first n positions (kinds.text_lengths)
                add_program(kinds.text_encoder_program(n, L), "text_encoder", encode,
                            {"ids": TensorSpec((n2, n), "int32"), "mask": TensorSpec((n2, n), "int32")},
                            ["embeds"])
            del module, ex
            gc.collect()

            # Keys and values over a short prompt's rows (export/cross_kv.py): CPU targets, where cross-attention
            # over 512 rows is a tenth of a small video's step; elsewhere as before (the TPU kernel takes no bias).
            # (Not for VACE: its head runs the VACE blocks' cross-attention, on the whole text's keys and values; nor
            # where the steps are one program each, Animate's.)
            short_rows = kinds.short_text_lengths(L) if s.target.platform == "cpu" and not kind.vace \
                and kind.block_loop else ()
            image_tokens = None
            if kind.image_encoder:
                cfg = src.image_encoder_config or {}
                size, n_images = int(cfg["image_size"]), 2 if kind.last_image else 1
                module, ex = load_component(src, "image_encoder", attention, platform=s.target.platform,
                                            quantize=s.quantize)
                add_weights("image_encoder", ex.weights, ex.quantized)
                add_program("image_encoder", "image_encoder", image_encoder.build(ex, model_dtype),
                            {"pixels": TensorSpec((n_images, 3, size, size), "float32")}, ["image_embeds"])
                image_tokens = programs["image_encoder"].outputs["image_embeds"].shape  # (n_images, tokens, dim)
                del module, ex
            gc.collect()

            for e, group in enumerate(kind.expert_groups):
                module, ex = load_component(src, group, attention, mesh, platform=s.target.platform,
                                            quantize=s.quantize, adapters=adapters)
                add_weights(group, ex.weights, ex.quantized)
                if e == 0:
                    add_program(kinds.cross_kv_program(0), group,
                                cross_kv.build(ex, model_dtype),
                                kv_inputs(kind, geo, image_tokens), ["kv"])
                    for t in short_rows:
                        add_program(kinds.cross_kv_program(0, t), group, cross_kv.build(ex, model_dtype, L - t),
                                    kv_inputs(kind, geo, image_tokens, t), ["kv"])
                    if kind.animate:  # the face video's motion vectors, per frame count (shape_scope "video")
                        export_face_motion(ex, shapes, geo, model_dtype, add_program)
                    block = extract(module.blocks[0], attention, mesh, cpu_dots=s.target.platform == "cpu")
                    for g in shapes:  # the model loaded once; each shape costs its own tracing only
                        extras = conditioning_inputs(kind, g, ex.module, chunks)
                        for stage, at in pyramid_shapes(g, chunks):  # (a Helios pyramid's lower stages first)
                            export_denoise(src, ex, block, kind, at, s.target, order, model_dtype, extras,
                                           add_program, write_program, programs,
                                           stage + shape_suffix("video", g, geo), chunks)
                else:  # the same programs with this expert's weights (identical names, shapes and shardings)
                    first = programs[kinds.denoise_program(0)]
                    if weight_files[group].tensors != weight_files[first.weights].tensors:
                        raise UserError(f"{src.id}: {group} does not have the same tensors as {first.weights}")
                    names = [(kinds.cross_kv_program(e, t), kinds.cross_kv_program(0, t)) for t in (None, *short_rows)]
                    names += [(kinds.denoise_program(e, v) + at, kinds.denoise_program(0, v) + at)
                              for at in (shape_suffix("video", g, geo) for g in shapes) for v in kind.variants]
                    for name, like in names:
                        programs[name] = dataclasses.replace(programs[like], weights=group)
                del module, ex
            gc.collect()

            vae, ex = load_component(src, "vae", attention, platform=s.target.platform)
            add_weights("vae", ex.weights, ex.quantized)
            for size in dict.fromkeys(g.size for g in shapes):  # the VAE's chunks depend on width x height only
                same = [g for g in shapes if g.size == size]
                longest = max(same, key=lambda g: g.latent_frames)  # its chunk programs serve every frame count
                export_vae(vae, ex, "video" if src.video_to_video else kind.vae_encode, longest, s.target, add_program,
                           dataclasses.replace(attention, kernel="xla"), shape_suffix("size", longest, geo))
            del vae, ex
            gc.collect()

            tiny = None
            if tiny_dec is not None:
                tiny = export_tiny_decoder(src, s.tiny_decoder, tiny_dec, shapes, geo, s.target, add_weights,
                                           add_program)

        tokenizer = None
        if src.tokenizer_json is not None and src.weights:
            tokenizer = write_tokenizer(tmp, src.tokenizer_json)
        image_processor = None
        if kind.image_encoder:
            image_processor = images.clip_config(src.image_processor_config or {})
        manifest = Manifest(
            schema_version=SCHEMA_VERSION,
            source={**src.describe(), **lora.provenance(list(s.loras))},
            shapes=tuple(shapes),
            target=s.target,
            defaults=run_defaults,
            scheduler=sched_cfg.to_json(),
            dtype=s.dtype,
            attention=attention.to_json(),
            programs=programs,
            weights=weight_files,
            tokenizer=tokenizer,
            versions=versions(),
            kind=kind.name,
            boundary_ratio=src.boundary_ratio,
            image_processor=image_processor,
            quantize=s.quantize,
            video_to_video=src.video_to_video,
            tiny_decoder=tiny,
            chunks=chunks,
        ).with_id()
        (tmp / MANIFEST_FILE).write_text(canonical_json(manifest.to_json()))
        if check is not None:
            check(tmp, manifest)
        replace_dir(tmp, out)
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


DEFAULT_KEYS = ("steps", "guidance", "guidance_2", "flow_shift", "sampler", "sigmas", "fps", "timestep_scale")


def parse_defaults(text: str | None) -> dict[str, Any]:
    """--defaults "steps=4,guidance=1,sampler=euler,flow_shift=5,sigmas=1,0.75,0.5,0.25" -> {key: value}. A bare
    number after sigmas= is one more sigma. Values are checked against the model in `defaults_for`."""
    out: dict[str, Any] = {}
    last = None
    for item in (text.split(",") if text else []):
        item = item.strip()
        key, sep, value = item.partition("=")
        if not sep and last == "sigmas":
            out["sigmas"].append(item)
            continue
        key = key.strip().replace("-", "_")
        if not sep or key not in DEFAULT_KEYS:
            raise UserError(f"--defaults {text!r}: {item!r} is not KEY=VALUE with KEY one of {', '.join(DEFAULT_KEYS)}")
        if key in out:
            raise UserError(f"--defaults {text!r} sets {key} twice")
        out[key] = [value.strip()] if key == "sigmas" else value.strip()
        last = key
    try:
        for key in ("steps", "fps"):
            if key in out:
                out[key] = int(out[key])
        for key in ("guidance", "guidance_2", "flow_shift", "timestep_scale"):
            if key in out:
                out[key] = float(out[key])
        if "sigmas" in out:
            out["sigmas"] = [float(v) for v in out["sigmas"]]
    except ValueError as e:
        raise UserError(f"--defaults {text!r}: {e}") from None
    return out


def defaults_for(kind: Kind, config: sched.UniPCConfig, base: Defaults, given: dict[str, Any]) -> Defaults:
    """The bundle's run defaults: the checkpoint's (`base`) with what --defaults sets, checked as a run's settings
    are (runtime/settings.py), so a bundle never defaults to settings it would refuse."""
    d = dataclasses.replace(base, **{k: (tuple(v) if k == "sigmas" else v) for k, v in given.items()})
    if "sigmas" in given and "steps" not in given:
        d = dataclasses.replace(d, steps=len(d.sigmas))
    if not 1 <= d.fps <= 240:
        raise UserError(f"--defaults fps={d.fps} must be in 1..240")
    if not 0 < d.timestep_scale < float("inf"):
        raise UserError(f"--defaults timestep_scale={d.timestep_scale:g} must be a number > 0 (1000 for released Wan "
                        "weights, 1 for a checkpoint trained on t = sigma, as TorchTitan's Wan trainer does)")
    if d.timestep_scale != 1000 and kind.helios:  # runtime/helios.py feeds its own chunk loop's timesteps
        raise UserError(f"--defaults timestep_scale: {kind.title} bundles feed their DiT released Wan's timesteps "
                        "(x 1000) only")
    try:
        run_settings.resolve(dataclasses.replace(d, guidance_2=None), kind, config, guidance_2=d.guidance_2,
                             sigmas=d.sigmas, steps=d.steps)
    except UserError as e:
        raise UserError(f"--defaults: {e}") from None
    return d


def pyramid_shapes(g: Geometry, chunks: Chunks | None) -> list[tuple[str, Geometry]]:
    """(program name suffix, the DiT's latent geometry) of each stage of shape `g`: one, `g` itself, unless a Helios
    pyramid, whose stage k of S runs on latents 2^(S-1-k) times smaller (its history stays full size)."""
    stages = chunks.stages if chunks is not None else 1
    out = []
    for k in range(stages):
        f = 2 ** (stages - 1 - k)
        name = kinds.stage_program("", k, stages)
        out.append((name, dataclasses.replace(g, latent_height=g.latent_height // f, latent_width=g.latent_width // f)))
    return out


def check_pyramid(g: Geometry, chunks: Chunks) -> None:
    """A pyramid of S stages halves the latents S - 1 times, down to whole patches: refuse other sizes in one line."""
    div = 2 ** (chunks.stages - 1) * max(chunks.patch_size[1:])
    if g.latent_height % div or g.latent_width % div:
        step = div * g.spatial_scale
        raise UserError(f"{g.size}: a Helios pyramid of {chunks.stages} stages halves the latents "
                        f"({g.latent_width}x{g.latent_height}) {chunks.stages - 1} times, so they must divide by {div}: "
                        f"give a resolution whose width and height are multiples of {step}")


def chunks_for(scheduler_config: dict[str, Any], transformer_config: dict[str, Any],
               pipeline_options: dict[str, Any] | None = None) -> Chunks:
    """A Helios bundle's chunk settings: HeliosPipeline's history sizes; its scheduler's shift settings (calculate_shift's
    line as the pipeline reads it from the scheduler config, diffusers' defaults where absent); a pyramid pipeline's
    stages, gamma, DMD (HeliosDMDScheduler) and CFG-Zero* (model_index.json's is_cfg_zero_star)."""
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


def export_face_motion(ex: Extracted, shapes: list[Geometry], default: Geometry, model_dtype: Any,
                       add_program: Any) -> None:
    """Wan-Animate's face_motion program (export/face_motion.py) for each frame count: a face video of the shape's
    frames at motion_encoder_size x motion_encoder_size, float32 in [-1, 1], to the face encoder's vectors."""
    size = int(ex.module.config.motion_encoder_size)
    fn = face_motion.build(ex, model_dtype)
    for g in shapes:
        add_program("face_motion" + shape_suffix("video", g, default), "transformer", fn,
                    {"face": TensorSpec((1, 3, g.frames, size, size), "float32")}, ["motion"])


def export_denoise(src: Source, ex: Extracted, block: Extracted, kind: Kind, geo: Geometry, target: Target,
                   order: int, model_dtype: Any, extras: dict[str, TensorSpec], add_program: Any, write_program: Any,
                   programs: dict[str, ProgramSpec], suffix: str = "", chunks: Chunks | None = None) -> None:
    """The first expert's denoise programs for shape `geo`, one per variant (kinds.DENOISE_VARIANTS), named with
    `suffix` (manifest.shape_suffix), each traced with the DiT layout of its batch (export/sharding.py): 2B for the
    CFG ones, B for the cond-only one. Those that run the blocks take the cross_kv program's keys and values
    (exported before them), replicated: the cross-attention layout wants them whole on every device
    (export/attention.py).

    A variant that runs the transformer blocks runs them as one block program per batch size, called once per
    block (export/denoise_blocks.py; `block` extracts block 0 of the DiT): the program's own file is the head,
    and its tail is listed beside it; with cross_kv_t<T> programs, a block program per T too, for their keys and
    values. The variants of one batch size share their head and block programs (traced once), so a variant costs
    its tail. MagCache's cached step runs no block and stays one program, taking no kv."""
    patch = tuple(src.transformer_config["patch_size"][1:])
    L = geo.max_sequence_length
    kv = programs[kinds.cross_kv_program(0)].outputs["kv"]
    short_kv = {t: programs[kinds.cross_kv_program(0, t)].outputs["kv"] for t in kinds.short_text_lengths(L)
                if kinds.cross_kv_program(0, t) in programs}
    tokens = dit_shape(src, geo).tokens
    layers = len(ex.module.blocks)
    block_files: dict[tuple[int, int], FileRef] = {}  # by (batch, text rows; L: the whole text)
    heads: dict[int, tuple[FileRef, dict[str, TensorSpec], denoise_blocks.Carry]] = {}  # by batch
    tensors = {k: f"{denoise_blocks.BLOCK_PREFIX}0.{k}" for k in block.weights}
    frames = geo.latent_shape[2] if kind.forcing else None  # diffusion forcing: a timestep and a row per frame
    shared = ("kv", "causal_block") if kind.forcing else ("kv",)  # what the blocks take, not the head and tail
    for v in (kinds.DENOISE_VARIANTS[n] for n in kind.variants):
        batch = (2 if v.cfg else 1) * geo.batch
        layout = sharding.dit_layout(target.mesh, batch, tokens)
        name = kinds.denoise_program(0, v.name) + suffix
        inputs = {
            "state": TensorSpec((sched.state_rows(order), *geo.latent_shape), "float32"),
            "kv": kv,
            "timestep": TensorSpec(() if frames is None else (frames,), "float32"),
            "guidance": TensorSpec((), "float32"),
            "row": TensorSpec((sched.row_size(order),) if frames is None else (frames, sched.row_size(order)),
                              "float32"),
            **extras,
        }
        outputs, out_partition = ["state", "finite"], [PartitionSpec(), PartitionSpec()]
        if v.residual == "in":  # as the "residual" variant (exported before this one) returns it
            inputs["residual"] = programs[kinds.denoise_program(0, "residual") + suffix].outputs["residual"]
        if v.residual == "out":
            outputs.append("residual")
            out_partition.append(layout.hidden)
        with sharding.use_layout(layout):
            # What runs no block takes no kv: the whole step is traced with zeros there, which nothing reads.
            step = denoise.build(ex, order, model_dtype, kind, L, patch, v,
                                 (chunks or Chunks()).history_sizes)
            no_kv = denoise.without(step, list(inputs), {k: inputs[k] for k in shared})
            without_kv = {k: t for k, t in inputs.items() if k not in shared}
            if v.residual == "in":
                add_program(name, "transformer", no_kv, without_kv, outputs, {"residual": layout.hidden},
                            tuple(out_partition))
                continue
            hidden = layout.hidden
            # A VACE model's head runs the VACE blocks (their cross-attention reads kv): its head and tail take every
            # input (BlockLoop.head_takes_shared), and it carries the hints, split like the hidden states.
            own_step, own_inputs = (step, inputs) if kind.vace else (no_kv, without_kv)
            if not kind.block_loop:  # one program per variant
                add_program(name, "transformer", step, inputs, outputs, output_partition=tuple(out_partition))
                continue
            # A VACE head's hints (VACE layers, B, S, dim) split over tp on dim too (it divides: check_dit made the
            # heads divide), each block gathering its one hint where it adds it: the 14B's 8 at 720p x 81 are 6.2 GB
            # per device whole. Its head on tpu-v5e-8 needed 22.0 GiB of temporaries with them whole, 15.9 with the
            # stack split, 3.4 with each hint scaled and split as its VACE block makes it (denoise_blocks.head)
            hint = PartitionSpec(*hidden[:-1], "tp")
            hints = PartitionSpec(None, *hint)
            if batch not in heads:  # the step up to the first block is the same for every variant of this batch
                carry = denoise_blocks.Carry()
                scale_at = list(inputs).index("control_scale") if kind.vace else None
                head_outputs = denoise_blocks.VACE_HEAD_OUTPUTS if kind.vace else denoise_blocks.HEAD_OUTPUTS
                head, carried = write_program(name, "transformer",
                                              denoise_blocks.head(ex, own_step, carry, scale_at, kind.forcing,
                                                                  NamedSharding(abstract_mesh(target), hint)
                                                                  if kind.vace else None),
                                              own_inputs, head_outputs,
                                              output_partition=(hidden, PartitionSpec(), PartitionSpec(),
                                                                *([hints] if kind.vace else [])))
                heads[batch] = head, carried, carry
            head, carried, carry = heads[batch]
            for t, t_kv in [(L, kv), *short_kv.items()]:  # one block program per batch size, shared by the variants
                if (batch, t) not in block_files:
                    rows = "" if t == L else f"_t{t}"
                    block_files[batch, t], _ = write_program(
                        f"denoise_block_{batch}{rows}{suffix}", "transformer",
                        denoise_blocks.block(block, carry, kind.image_encoder, L - t,
                                             denoise_blocks.vace_index(ex.module) if kind.vace else None,
                                             kind.forcing),
                        {**carried, "kv": t_kv, **{k: inputs[k] for k in shared[1:]}, "layer": TensorSpec((), "int32")},
                        ["hidden"],
                        {"hidden": hidden, "hints": hints}, hidden, tensors)
            tail_name = f"{kinds.denoise_program(0, v.name)}_tail{suffix}"
            tail, outs = write_program(tail_name, "transformer", denoise_blocks.tail(ex, own_step),
                                       {**own_inputs, "hidden": carried["hidden"]}, outputs,
                                       {"residual": hidden, "hidden": hidden}, tuple(out_partition))
            loop = BlockLoop(block=block_files[batch, L], tail=tail, layers=layers, prefix=denoise_blocks.BLOCK_PREFIX,
                             shared=shared, short_blocks={str(t): block_files[batch, t] for t in short_kv},
                             head_takes_shared=kind.vace)
            programs[name] = ProgramSpec(file=head.file, sha256=head.sha256, weights="transformer", inputs=inputs,
                                         outputs=outs, blocks=loop)


def export_vae(vae: Any, ex: Extracted, encode: str, geo: Geometry, target: Target, add_program: Any,
               attention: AttentionConfig, suffix: str = "") -> None:
    """The VAE's chunk programs for width x height of `geo` (named with `suffix`, manifest.shape_suffix): decode
    always, encode as the kind needs (one image, or a whole video). The chunks do not depend on the frame count;
    whether there are "next" chunks does (`geo` is the longest shape of its size).

    On CPU targets the decoder is export/vae_decoder.py's channels-last JAX version of the same module
    (same weights, same cache slots); elsewhere, and for the encoder, the torchax trace."""
    directions = [("decode", geo.batch, geo.latent_height, geo.latent_width, geo.latent_frames)]
    if encode:  # images and videos are encoded once per call (batch 1) and repeated over the batch on the host
        chunks = 1 if encode == "image" else geo.latent_frames
        directions.insert(0, ("encode", 1, geo.height, geo.width, chunks))
    for direction, batch, height, width, chunks in directions:
        caches = vae_stage.cache_specs(vae, direction, batch, height, width)
        cache_inputs = {f"cache_{i:02d}": c for i, c in enumerate(caches) if c is not None}
        cache_outputs = list(cache_inputs)
        result = "frames" if direction == "decode" else "latents"
        build = vae_stage.build_decode if direction == "decode" else vae_stage.build_encode
        fn = ex.fn
        if direction == "decode" and target.platform == "cpu":
            fn = vae_decoder.build(vae, attention)
        arg = "latents" if direction == "decode" else "pixels"
        for which in (vae_stage.FIRST, vae_stage.NEXT)[: 1 if chunks == 1 else 2]:
            chunk = TensorSpec(vae_stage.chunk_shape(vae, direction, which, batch, height, width), "float32")
            inputs = {arg: chunk, **(cache_inputs if which == vae_stage.NEXT else {})}
            # Activations split on width (or height) over all devices; results come back whole (host 0 writes the
            # video).
            dim = sharding.spatial_dim(chunk.shape, target.mesh)
            split = {k: sharding.width_split(c.shape, target.mesh, dim)
                     for k, c in {arg: chunk, **cache_inputs}.items()}
            out_split = (PartitionSpec(), [split[k] for k in cache_outputs])
            add_program(f"vae_{direction}_{which}{suffix}", "vae",
                        build(vae, fn, caches, first=which == vae_stage.FIRST),
                        inputs, [result, *cache_outputs], split, out_split)


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


def export_tiny_decoder(src: Source, spec: TinyDecoderFile, dec: Any, shapes: list[Geometry], geo: Geometry,
                        target: Target, add_weights: Any, add_program: Any) -> TinyDecoderInfo:
    """The tiny decoder's weights (float32, replicated: 11 M parameters) and its chunk programs per width x height,
    activations split over the devices as the VAE's are."""
    import torch

    add_weights("tiny_decoder", {k: torch.from_numpy(v) for k, v in sorted(dec.tensors.items())}, {})
    for size in dict.fromkeys(g.size for g in shapes):
        g = max((x for x in shapes if x.size == size), key=lambda x: x.latent_frames)
        suffix = shape_suffix("size", g, geo)
        chunk = TensorSpec((g.batch, dec.latent_channels, 1, g.latent_height, g.latent_width), "float32")
        memory = {f"cache_{i:02d}": TensorSpec(m, "float32")
                  for i, m in enumerate(dec.memory_shapes(g.batch, g.latent_height, g.latent_width))}
        dim = sharding.spatial_dim(chunk.shape, target.mesh)
        split = {k: sharding.width_split(t.shape, target.mesh, dim) for k, t in {"latents": chunk, **memory}.items()}
        for which in ("first", "next")[: 1 if g.latent_frames == 1 else 2]:
            fn = tiny_decoder.build(dec, spec.latents, src.vae_config["latents_mean"], src.vae_config["latents_std"],
                                    first=which == "first")
            inputs = {"latents": chunk, **(memory if which == "next" else {})}
            add_program(f"tiny_decode_{which}{suffix}", "tiny_decoder", fn, inputs, ["frames", *memory], split,
                        (PartitionSpec(), [split[k] for k in memory]))
    return TinyDecoderInfo(latents=spec.latents, variant=dec.variant, latent_channels=dec.latent_channels,
                           file=spec.path.name)


def write_tokenizer(bundle: Path, tokenizer_json: str) -> FileRef:
    rel = "tokenizer/tokenizer.json"
    (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
    (bundle / rel).write_text(tokenizer_json)
    return FileRef(rel, sha256_file(bundle / rel))


def _fresh_tmp(out: Path) -> Path:
    """An empty temporary sibling of `out` (same filesystem, so the final rename is atomic)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.partial-*"):  # left by an export that was killed
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not process_alive(int(pid)):
            log.info("removing %s, left by an interrupted export", stale)
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for sub in ("stages", "weights", "tokenizer"):
        (tmp / sub).mkdir(parents=True)
    return tmp


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished bundle into place (the old one, with --force, goes only after)."""
    if out.exists():
        trash = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(trash)
        tmp.rename(out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        tmp.rename(out)
