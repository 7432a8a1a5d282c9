"""Attach weights to a bundle exported with --no-weights.

Programs depend only on shapes, dtypes and shardings, so they can be built from an
architecture name on any machine, and the (large) weights added later from the real
checkpoint. Every tensor must match the manifest's name, shape and dtype exactly,
so weights from another architecture or dtype are refused before anything is written.
The result is written beside the bundle and swapped in only when complete.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import shutil
from pathlib import Path
from typing import Any

from runtime import manifest as mf
from runtime.errors import UserError

from . import gguf_file
from . import weights as weight_writer
from .attention import AttentionConfig
from .build import load_component
from .bundle_files import FAMILIES, replace_dir, write_tokenizer
from .lora import merge_into, provenance, read_merges
from .options import defaults_for
from .prequantized import check_lightx2v, read_lightx2v
from .source import Source

log = logging.getLogger("export")


def attach_weights(bundle: Path, src: Source, force: bool = False, quantize: str | None = None,
                   dit_weights: list[Path] | None = None, defaults: dict[str, Any] | None = None,
                   merges: list[Any] | None = None, tiny_decoder: Any = None) -> mf.Manifest:
    """Write `src`'s weights and tokenizer into `bundle` (a --no-weights bundle, or any bundle with force).

    A quantized bundle takes `src`'s weights quantized as at export (`quantize`, when given, must be the
    bundle's mode). `dit_weights` (one per expert, in order) replace `src`'s DiT experts with files in the
    original Wan layout (export/prequantized.py): float ones cast to the bundle's dtype, pre-quantized ones (a
    quantized bundle) used as they are; GGUF files (export/gguf_file.py) dequantized, then cast or quantized as
    the bundle stores each tensor. `merges` (--merge-lora, export/lora.py) are merged into the DiT's
    weights; `defaults` (--defaults) replace the bundle's run defaults. `tiny_decoder` (--tiny-decoder, a
    options.TinyDecoderFile) holds the weights of a bundle exported with one, in the convention it was exported for."""
    import torch

    manifest = mf.read(bundle)
    if manifest.has_weights and not force:
        raise UserError(f"{bundle} already has weights: pass --force to replace them")
    if quantize is not None and quantize != manifest.quantize:
        was = f"with --quantize {manifest.quantize}" if manifest.quantize else "without --quantize"
        raise UserError(f"{bundle} was exported {was} and its programs take weights stored that way: attach "
                        f"{was}, or export the bundle again with --quantize {quantize}")
    experts = [g for g in manifest.weights if g in ("transformer", "transformer_2")]
    dit_weights = list(dit_weights or [])
    if len(dit_weights) not in (0, len(experts)):
        raise UserError(f"{bundle} has {len(experts)} DiT expert(s) ({', '.join(experts)}): give --dit-weights "
                        f"once per expert, the high-noise one first (got {len(dit_weights)})")
    prequantized = dict(zip(experts, dit_weights))
    computed = {group: _computed(src, group) for group in prequantized}
    for group, path in prequantized.items():  # from their headers, before anything is loaded or written
        checker = gguf_file.check if gguf_file.is_gguf(path) else check_lightx2v
        checker(path, manifest.weights[group], group, set(computed[group]))
    merges = list(merges or [])
    if merges and prequantized and manifest.quantize:
        raise UserError(f"--merge-lora cannot merge into this {manifest.quantize} bundle's DiT taken from --dit-weights "
                        "(its weights are stored quantized as they are read): merge the LoRA at load instead "
                        "(python -m export lora, then --lora ADAPTER on the runtime)")
    adapters = read_merges(merges, {g: {k: t.shape for k, t in manifest.weights[g].tensors.items()}
                                    for g in experts}) if merges else []
    run_defaults = manifest.defaults
    if defaults:
        from runtime import kinds
        from runtime.scheduler import UniPCConfig

        run_defaults = defaults_for(kinds.get(manifest.kind), UniPCConfig.from_json(manifest.scheduler),
                                    manifest.defaults, defaults)
    if src.tokenizer_json is None:
        raise UserError(f"{src.id} has no tokenizer: attach weights from a diffusers-format checkpoint")
    tiny = _tiny_decoder_tensors(manifest, tiny_decoder, src)
    _check_baked(manifest, src)
    _check_vae_shapes(manifest, src)
    tmp = bundle.parent / f".{bundle.name}.attach-partial"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(bundle, tmp, ignore=shutil.ignore_patterns("weights"))
        (tmp / "weights").mkdir(exist_ok=True)
        files: dict[str, mf.WeightFile] = {}
        with torch.no_grad():
            for group, wf in manifest.weights.items():
                if group not in FAMILIES:
                    raise UserError(f"{bundle} lists an unknown weight group {group!r}: re-export it")
                if group == "tiny_decoder":
                    module, tensors, label = None, tiny, str(tiny_decoder.path)
                elif group in prequantized:
                    module = None
                    reader = gguf_file.read if gguf_file.is_gguf(prequantized[group]) else read_lightx2v
                    tensors = reader(prequantized[group], wf, group, computed[group])
                    label = str(prequantized[group])
                    if adapters:
                        merge_into(tensors, group, adapters)
                else:
                    module, ex = load_component(src, group, AttentionConfig(), quantize=manifest.quantize,
                                                adapters=adapters)
                    tensors, label = ex.weights, src.id
                    if ex.quantized != wf.quantized:
                        raise UserError(f"{src.id}'s {group} quantizes other tensors than the bundle records: "
                                        "export the bundle again with this wan-aot")
                got = {k: weight_writer.spec(t) for k, t in tensors.items()}
                _check_same(group, wf.tensors, got, label)
                rel = f"weights/{group}.safetensors"
                log.info("writing %s weights", group)
                weight_writer.write(tmp / rel, tensors)
                files[group] = dataclasses.replace(wf, file=rel, sha256=mf.sha256_file(tmp / rel))
                del module, tensors
                ex = None
                gc.collect()
        tokenizer = write_tokenizer(tmp, src.tokenizer_json)
        described = src.describe()
        source = {**manifest.source, "weights": {"kind": described["kind"], "id": described["id"],
                                                 "revision": described["revision"]}, **provenance(merges)}
        source.pop("vae_file", None)  # the VAE's weights come from this attach: --vae's file, or the checkpoint's
        if src.vae_file is not None:
            source["vae_file"] = src.vae_file.describe()
        if prequantized:
            source["dit_weights"] = [{"file": Path(p).name, "expert": g} for g, p in prequantized.items()]
        new = dataclasses.replace(manifest, weights=files, tokenizer=tokenizer, source=source,
                                  defaults=run_defaults).with_id()
        (tmp / mf.MANIFEST_FILE).write_text(mf.canonical_json(new.to_json()))
        replace_dir(tmp, bundle)
        return new
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _tiny_decoder_tensors(manifest: mf.Manifest, spec: Any, src: Source) -> dict[str, Any] | None:
    """The tiny decoder's tensors (torch, float32) for a bundle exported with --tiny-decoder, from the same kind of file
    in the same latent convention; one-line errors for a file the bundle has no place for, or none where it has."""
    import torch

    from .decoder_programs import read_tiny_decoder

    info = manifest.tiny_decoder
    if info is None:
        if spec is not None:
            raise UserError(f"--tiny-decoder: bundle {manifest.bundle_id} was exported without a tiny decoder, so its "
                            "programs have none to take: export it again with --tiny-decoder FILE")
        return None
    if spec is None:
        raise UserError(f"this bundle was exported with a tiny decoder ({info.file}): give its weights with "
                        "--tiny-decoder FILE")
    if spec.latents != info.latents:
        raise UserError(f"--tiny-decoder {spec.path.name} takes {spec.latents} latents, the bundle's tiny decoder "
                        f"{info.latents} ones: give the file it was exported with (or --tiny-decoder-latents "
                        f"{info.latents})")
    dec = read_tiny_decoder(spec, src)
    return {k: torch.from_numpy(v) for k, v in sorted(dec.tensors.items())}


def _computed(src: Source, group: str) -> dict[str, Any]:
    """The DiT tensors no checkpoint holds (its RoPE tables): the buffers the model's constructor computes, from
    the model built on `meta` from its config."""
    module = dataclasses.replace(src, weights=False).load_transformer(group)
    return {k: v for k, v in module.named_buffers() if v.device.type != "meta"}


def _check_baked(manifest: mf.Manifest, src: Source) -> None:
    """What the programs have baked in besides shapes: the model kind, the expert boundary, the VAE's
    latent statistics and the CLIP preprocessing must be the checkpoint's too."""
    vae = manifest.source.get("config", {}).get("vae", {})
    theirs = {"kind": src.model_kind, "boundary_ratio": src.boundary_ratio,
              "latents_mean": list(src.vae_config.get("latents_mean") or []),
              "latents_std": list(src.vae_config.get("latents_std") or [])}
    ours = {"kind": manifest.kind, "boundary_ratio": manifest.boundary_ratio,
            "latents_mean": list(vae.get("latents_mean") or []), "latents_std": list(vae.get("latents_std") or [])}
    if manifest.image_processor is not None:
        from runtime.images import clip_config

        theirs["image_processor"] = clip_config(src.image_processor_config or {})
        ours["image_processor"] = manifest.image_processor
    for key in ours:
        if ours[key] != theirs[key]:
            raise UserError(f"{src.id} does not match the bundle's model: its {key} is {_short(theirs[key])}, the "
                            f"bundle was built for {_short(ours[key])}: attach weights of the model it was built for")


def _check_vae_shapes(manifest: mf.Manifest, src: Source) -> None:
    """The VAE `src` gives (the checkpoint's, or --vae's file) must have the bundle's VAE tensor shapes, checked on
    the model built on `meta` before any weight is read: a bundle exported with another VAE's widths (--vae) is
    refused in one line, before the DiT is loaded."""
    if "vae" not in manifest.weights:
        return
    ours = manifest.source.get("vae_file")
    theirs = src.vae_file.describe() if src.vae_file is not None else None
    have = {k: tuple(t.shape) for k, t in dataclasses.replace(src, weights=False).load_vae().state_dict().items()}
    for name, spec in sorted(manifest.weights["vae"].tensors.items()):
        if have.get(name) != tuple(spec.shape):
            given = f"--vae {theirs['file']}" if theirs else f"{src.id}'s VAE"
            exported = f"with --vae {ours['file']}" if ours else "with its checkpoint's VAE"
            raise UserError(f"{given} does not match the bundle's architecture ({name} is "
                            f"{list(have[name]) if name in have else 'missing'}, the bundle has {list(spec.shape)}): "
                            f"the bundle was exported {exported}; attach that VAE")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_same(group: str, want: dict[str, mf.TensorSpec], got: dict[str, mf.TensorSpec], source: str) -> None:
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing or extra:
        what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
        raise UserError(f"{source}'s {group} does not match the bundle's architecture ({what}"
                        f"{' ...' if len(missing or extra) > 3 else ''}): attach weights of the model it was built for")
    for name in sorted(want):
        if want[name] != got[name]:
            w, g = want[name], got[name]
            raise UserError(f"{source}'s {group} tensor {name} is {g.dtype}{list(g.shape)} but the bundle expects "
                            f"{w.dtype}{list(w.shape)}: attach weights of the model and dtype it was built for")
