"""Assemble a bundle: trace each of its programs, write them, the weights, the tokenizer and the manifest.

The programs are the bundle's declared list (runtime/manifest.py bundle_programs, from runtime/kinds.py
Kind.programs): the build loads one component (weight group) at a time, in FAMILIES' order, writes its weights and
traces the listed programs that take them. Everything is written into a temporary sibling directory and renamed into
place at the end (export/bundle_files.py), so an interrupted export never leaves a bundle that looks complete.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np

from runtime import chronoedit, images, programs, samplers
from runtime.errors import UserError
from runtime.kinds import DIT_GROUPS, Kind
from runtime.manifest import (
    MANIFEST_FILE,
    SCHEMA_VERSION,
    Chunks,
    Defaults,
    Geometry,
    Manifest,
    Target,
    TensorSpec,
    bundle_programs,
    canonical_json,
)
from runtime.manifest import TinyDecoder as TinyDecoderInfo
from runtime.programs import Program

from . import animate2, cross_kv, far, image_encoder, lora, sharding, text_encoder
from . import vae as vae_stage
from .attention import AttentionConfig
from .bundle_files import FAMILIES, BundleFiles, fresh_tmp, replace_dir, write_tokenizer
from .decoder_programs import export_tiny_decoder, export_vae, read_tiny_decoder
from .dit_programs import export_denoise, export_face_motion
from .options import Settings, defaults_for
from .shapes import check_pyramid, chunks_for, conditioning_inputs, dit_shape, geometry, kv_inputs, pyramid_shape
from .source import Source
from .trace import Extracted, abstract_mesh, extract

log = logging.getLogger("export")


def versions() -> dict[str, str]:
    out = {}
    for pkg in ("wan-aot", "jax", "jaxlib", "torch", "torchax", "diffusers", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def attention_for(target: Target, base: AttentionConfig) -> AttentionConfig:
    """TPU targets run the DiT's attention in the Pallas flash kernel; other platforms in plain JAX."""
    return dataclasses.replace(base, kernel="pallas" if target.platform == "tpu" else "xla")


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
    if adapters and group in DIT_GROUPS and src.weights:
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


@dataclass
class _Build:
    """What tracing a component's programs needs: the source and settings, the bundle's default shape, and what the
    components before wrote (the files; the CLIP stage's output shape)."""

    src: Source
    s: Settings
    files: BundleFiles
    geo: Geometry
    attention: AttentionConfig
    mesh: Any
    order: int
    chunks: Chunks | None
    model_dtype: Any
    adapters: list
    tiny_decoder: Any
    image_tokens: tuple[int, ...] | None = None
    tiny_info: TinyDecoderInfo | None = None

    @property
    def kind(self) -> Kind:
        return self.src.model

    @property
    def platform(self) -> str:
        return self.s.target.platform


def build_bundle(src: Source, s: Settings, out: Path, force: bool = False,
                 check: Callable[[Path, Manifest], None] | None = None) -> Manifest:
    """Export every program of `src` for `s` into the bundle directory `out` (weights only if src has them).
    `check` (the bundle's directory, its manifest) runs on the finished bundle before it takes `out`'s place: if it
    raises, nothing is written (export --fit)."""
    import torch

    if out.exists() and not force:
        raise UserError(f"{out} already exists: choose another --out or pass --force to replace it")
    kind = src.model
    # VACE: the DiT's programs per count of reference images; Animate: its character image, always one latent frame
    refs = s.reference_images if kind.reference_images else (1,) if kind.animate or kind.animate2 else (0,)
    shapes = [geometry(src, s, shape, r) for shape in s.shapes for r in refs]
    geo = shapes[0]  # the default shape; what does not depend on the shape is traced with it
    for g in shapes:
        sharding.check_dit(s.target, dit_shape(src, g), src.id,
                           f"{g.size} x {g.frames} frames" if len(shapes) > 1 else "")
    sampler, sched_cfg, shift = samplers.from_checkpoint(src.scheduler_config)
    run_defaults = defaults_for(kind, sched_cfg, Defaults(steps=kind.steps, guidance=kind.guidance, flow_shift=shift,
                                                          fps=kind.fps, sampler=sampler), s.defaults)
    chunks = chunks_for(src.scheduler_config, src.transformer_config, src.pipeline_options) if kind.helios else None
    if chunks is not None:
        for g in shapes:
            check_pyramid(g, chunks)
    if kind.chronoedit:  # every run ends on the edit's 2 latent frames (runtime/chronoedit.py)
        chronoedit.check_shapes(shapes)
    adapters = lora.read_merges(list(s.loras), expert_shapes(src)) if s.loras else []
    tiny_dec = read_tiny_decoder(s.tiny_decoder, src) if s.tiny_decoder is not None else None  # before any tracing
    plan = bundle_programs(kind, shapes, kind.short_prompts(s.target.platform), src.video_to_video,
                           tiny_dec is not None, chunks.stages if chunks is not None else 1)
    tmp = fresh_tmp(out)
    try:
        files = BundleFiles(tmp, s.target, src.weights)
        b = _Build(src, s, files, geo, attention_for(s.target, s.attention), abstract_mesh(s.target),
                   sched_cfg.solver_order, chunks, np.dtype({"bf16": "bfloat16", "fp32": "float32"}[s.dtype]),
                   adapters, tiny_dec)
        # One component in memory at a time: load, write its weights, trace its programs, drop it.
        with torch.no_grad():
            for group in FAMILIES:
                todo = [(p, g) for p, g in plan.items() if p.group == group]
                if todo:
                    COMPONENTS.get(group, _dit_expert)(b, group, todo)
                    gc.collect()

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
            attention=b.attention.to_json(),
            programs=files.programs,
            weights=files.weight_files,
            tokenizer=tokenizer,
            versions=versions(),
            kind=kind.name,
            boundary_ratio=src.boundary_ratio,
            image_processor=image_processor,
            quantize=s.quantize,
            video_to_video=src.video_to_video,
            tiny_decoder=b.tiny_info,
            chunks=chunks,
        ).with_id()
        (tmp / MANIFEST_FILE).write_text(canonical_json(manifest.to_json()))
        if check is not None:
            check(tmp, manifest)
        replace_dir(tmp, out)
        return manifest
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise


Todo = list[tuple[Program, Geometry]]  # a component's programs, each with the shape it is made for


def _text_encoder(b: _Build, group: str, todo: Todo) -> None:
    """The text encoder's programs: the same encoder over the first n positions (kinds.text_lengths)."""
    module, ex = load_component(b.src, group, b.attention, platform=b.platform, quantize=b.s.quantize)
    b.files.add_weights(group, ex.weights, ex.quantized)
    encode = text_encoder.build(ex)
    n2 = 2 * b.geo.batch
    for p, _ in todo:
        n = p.text_rows or b.geo.max_sequence_length
        b.files.add_program(p.name, group, encode,
                            {"ids": TensorSpec((n2, n), "int32"), "mask": TensorSpec((n2, n), "int32")}, ["embeds"])


def _image_encoder(b: _Build, group: str, todo: Todo) -> None:
    """CLIP's image embeddings of the image (two: FLF2V's first and last)."""
    cfg = b.src.image_encoder_config or {}
    size, n_images = int(cfg["image_size"]), 2 if b.kind.last_image else 1
    module, ex = load_component(b.src, group, b.attention, platform=b.platform, quantize=b.s.quantize)
    b.files.add_weights(group, ex.weights, ex.quantized)
    for p, _ in todo:
        b.files.add_program(p.name, group, image_encoder.build(ex, b.model_dtype),
                            {"pixels": TensorSpec((n_images, 3, size, size), "float32")}, ["image_embeds"])
        b.image_tokens = b.files.programs[p.name].outputs["image_embeds"].shape  # (n_images, tokens, dim)


# The DiT's programs in the order they are traced: the denoise steps take the cross_kv program's outputs.
DIT_ORDER = (programs.CROSS_KV, programs.FACE_MOTION, programs.DENOISE)


def _dit_expert(b: _Build, group: str, todo: Todo) -> None:
    """An expert's programs: the first's traced (the model loaded once; each shape costs its own tracing only), the
    second's the same programs with its weights (identical names, shapes and shardings)."""
    module, ex = load_component(b.src, group, b.attention, b.mesh, platform=b.platform, quantize=b.s.quantize,
                                adapters=b.adapters)
    b.files.add_weights(group, ex.weights, ex.quantized)
    programs_, weight_files = b.files.programs, b.files.weight_files
    expert = DIT_GROUPS.index(group)
    if expert:
        first = programs_[Program.denoise().name]
        if weight_files[group].tensors != weight_files[first.weights].tensors:
            raise UserError(f"{b.src.id}: {group} does not have the same tensors as {first.weights}")
        for p, _ in todo:
            programs_[p.name] = dataclasses.replace(programs_[p.replace(expert=0).name], weights=group)
        return
    if b.kind.far:  # AnyFlow-FAR: cross_kv, then the chunk step and the KV cache write (export/far.py)
        for p, _ in todo:
            if p.base == programs.CROSS_KV:
                b.files.add_program(p.name, group, cross_kv.build(ex, b.model_dtype), kv_inputs(b.kind, b.geo, None),
                                    ["kv"])
        for g in {g for p, g in todo if p.base != programs.CROSS_KV}:
            far.export_programs(ex, g, b.src.transformer_config, b.order, b.model_dtype, b.files,
                                [p for p, pg in todo if pg == g and p.base != programs.CROSS_KV], b.s.target.mesh)
        return
    if b.kind.animate2:  # Wan-Animate 2: cross_kv, then the reference pass and the steps (export/animate2.py)
        animate2.check_text(ex.module, b.geo.max_sequence_length)
        for p, _ in todo:
            if p.base == programs.CROSS_KV:
                b.files.add_program(p.name, group, animate2.build_cross_kv(ex, b.model_dtype),
                                    kv_inputs(b.kind, b.geo, b.image_tokens), ["kv"])
        text = int(ex.module.config.text_len)
        for g in {g for p, g in todo if p.base != programs.CROSS_KV}:
            animate2.export_programs(ex, g, b.order, b.model_dtype, b.files,
                                     [p for p, pg in todo if pg == g and p.base != programs.CROSS_KV],
                                     b.s.target.mesh, text)
        return
    todo = sorted(todo, key=lambda pg: DIT_ORDER.index(pg[0].base))
    L = b.geo.max_sequence_length
    steps: dict[tuple[str, int | None], tuple[Geometry, list[Program]]] = {}  # by (shape, pyramid stage)
    block = None
    for p, g in todo:
        if p.base == programs.CROSS_KV:
            t = p.text_rows
            b.files.add_program(p.name, group,
                                cross_kv.build(ex, b.model_dtype) if t is None else cross_kv.build(ex, b.model_dtype,
                                                                                                   L - t),
                                kv_inputs(b.kind, b.geo, b.image_tokens, t), ["kv"])
        elif p.base == programs.FACE_MOTION:  # the face video's motion vectors, per frame count
            export_face_motion(ex, p.name, g, b.model_dtype, b.files.add_program)
        else:
            steps.setdefault((p.shape, p.stage), (g, []))[1].append(p)
    for (_, stage), (g, step_programs) in steps.items():
        if block is None:
            block = extract(module.blocks[0], b.attention, b.mesh, cpu_dots=b.platform == "cpu")
        extras = conditioning_inputs(b.kind, g, ex.module, b.chunks)
        export_denoise(b.src, ex, block, b.kind, pyramid_shape(g, b.chunks, stage), b.s.target, b.order,
                       b.model_dtype, extras, b.files, step_programs, b.chunks)


def _vae(b: _Build, group: str, todo: Todo) -> None:
    """The VAE's chunk programs, per width x height (traced for the size's longest shape)."""
    vae, ex = load_component(b.src, group, b.attention, platform=b.platform)
    b.files.add_weights(group, ex.weights, ex.quantized)
    for p, g in todo:
        export_vae(vae, ex, p, g, b.s.target, b.files.add_program,
                   dataclasses.replace(b.attention, kernel="xla"))


def _tiny_decoder(b: _Build, group: str, todo: Todo) -> None:
    b.tiny_info = export_tiny_decoder(b.src, b.s.tiny_decoder, b.tiny_decoder, todo, b.s.target, b.files)


COMPONENTS = {"text_encoder": _text_encoder, "image_encoder": _image_encoder, "vae": _vae,
              "tiny_decoder": _tiny_decoder}  # the others, DIT_GROUPS: _dit_expert


