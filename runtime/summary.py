"""`python -m runtime inspect`: what a bundle holds, readable (or as JSON), without running anything."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers the "bfloat16" dtype name with numpy)
import numpy as np

from . import executables, fit, kinds
from . import manifest as mf
from .targets import format_mesh


def summarize(path: Path, m: mf.Manifest) -> dict[str, Any]:
    """Stages, shapes, shardings, weight bytes per device, defaults and versions of a bundle."""
    g = m.geometry
    mesh = m.target.mesh
    weights = {}
    for group, wf in m.weights.items():
        total = per_device = 0
        sharded = 0
        by_dtype: dict[str, int] = {}
        for name, t in wf.tensors.items():
            nbytes = math.prod(t.shape) * np.dtype(t.dtype).itemsize  # ml_dtypes registers "bfloat16"
            split = math.prod(mesh[a] for a in _axes(wf.partition.get(name, [])))
            total += nbytes
            per_device += nbytes // split
            by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + nbytes // split
            sharded += split > 1
        weights[group] = {"file": wf.file, "tensors": len(wf.tensors), "sharded_tensors": sharded,
                          "quantized_tensors": len(wf.quantized), "bytes": total, "bytes_per_device": per_device,
                          "bytes_per_device_by_dtype": dict(sorted(by_dtype.items(), key=lambda i: -i[1]))}
    stages = {}
    for name, p in m.programs.items():
        stage: dict[str, Any] = {"file": p.file, "bytes": _size(path, p.file), "weights": p.weights,
                                 "inputs": {k: _spec(v) for k, v in p.inputs.items()},
                                 "outputs": {k: _spec(v) for k, v in p.outputs.items()}}
        if p.blocks is not None:
            stage["blocks"] = {"layers": p.blocks.layers, "block": p.blocks.block.file, "tail": p.blocks.tail.file,
                               "short_prompts": {t: f.file for t, f in sorted(p.blocks.short_blocks.items(),
                                                                             key=lambda i: int(i[0]))},
                               "bytes": sum(_size(path, f.file) for f in p.files()[1:])}
        stage.update(_program_shardings(path, m, name))
        stages[name] = stage
    return {
        "bundle": str(path), "bundle_id": m.bundle_id, "schema_version": m.schema_version,
        "model": {"kind": m.kind, "title": kinds.get(m.kind).title, "boundary_ratio": m.boundary_ratio,
                  "takes": _takes(kinds.get(m.kind))},
        "source": {k: v for k, v in m.source.items() if k != "config"},
        "target": {"name": m.target.name, "platform": m.target.platform, "mesh": format_mesh(mesh),
                   "devices": m.target.num_devices, "device_kind": m.target.device_kind},
        "geometry": {"width": g.width, "height": g.height, "frames": g.frames, "batch": g.batch,
                     "max_sequence_length": g.max_sequence_length, "latents": list(g.latent_shape),
                     "prompt_embeds": list(g.embeds_shape)},
        "shapes": [{"size": s.size, "width": s.width, "height": s.height, "frames": s.frames,
                    "reference_images": s.reference_images,
                    "seconds": round(s.frames / m.defaults.fps, 4), "latents": list(s.latent_shape),
                    "default": i == 0} for i, s in enumerate(m.shapes)],
        "dtype": m.dtype, "quantize": m.quantize, "attention": m.attention,
        "defaults": {"steps": m.defaults.steps, "guidance": m.defaults.guidance, "guidance_2": m.defaults.guidance_2,
                     "flow_shift": m.defaults.flow_shift, "fps": m.defaults.fps, "sampler": m.defaults.sampler,
                     "sigmas": None if m.defaults.sigmas is None else list(m.defaults.sigmas),
                     "timestep_scale": m.defaults.timestep_scale},
        "scheduler": m.scheduler, "stages": stages, "weights": weights,
        "weights_attached": m.has_weights, "versions": m.versions,
        "decoders": {"full": "the VAE", **({"tiny": {"file": m.tiny_decoder.file, "variant": m.tiny_decoder.variant,
                                                    "latent_channels": m.tiny_decoder.latent_channels,
                                                    "latents": m.tiny_decoder.latents}} if m.tiny_decoder else {})},
        "tpu_fit": fit.read_record(path, m) if m.target.platform == "tpu" else None,
        "executables": executables.summary(m),
        "chunks": None if m.chunks is None else dataclasses.asdict(m.chunks),
    }


def _chunks(c: dict[str, Any], g: dict[str, Any]) -> str:
    """A Helios bundle's chunks, in a line."""
    latent = g["latents"][2]
    text = (f"chunks     {g['frames']} frames ({latent} latent) each, any count; history "
            f"{'/'.join(map(str, c['history_sizes']))} latent frames (long/mid/short) + the first")
    if c["stages"] > 1:
        text += f"; pyramid of {c['stages']} stages (gamma {c['gamma']:.3g})"
        text += ", DMD steps" if c["distilled"] else ""
        text += ", CFG-Zero*" if c["cfg_zero_star"] else ""
    shift = f"dynamic ({c['time_shift_type']})" if c["use_dynamic_shifting"] else f"{c['shift']:g}"
    return text + f"; shift {shift}"


def _takes(kind: kinds.Kind) -> str:
    image = {"none": "", "optional": " [+ image]", "required": " + image"}[kind.image]
    video = {"none": "", "optional": " [+ video]", "required": " + video", "extend": " [+ video to extend]",
             "prefix": " [+ first frames to continue]", "context": " [+ video frames as context]"}[kind.video]
    if kind.animate2:  # Wan-Animate 2's video is its own keyword (driving_video), not `video`
        video = " + driving video"
    return "prompt" + image + (" + last image" if kind.last_image else "") + video


def format_text(s: dict[str, Any]) -> str:
    t, g, d = s["target"], s["geometry"], s["defaults"]
    src = s["source"]
    revision = f", revision {src['revision']}" if src.get("revision") else ""
    lines = [
        f"bundle     {s['bundle']}  (id {s['bundle_id']}, schema {s['schema_version']})",
        f"source     {src.get('id')} ({src.get('kind')}{revision})",
        f"model      {s['model']['title']} (kind {s['model']['kind']}): {s['model']['takes']}"
        + (f"; expert 2 below t = {s['model']['boundary_ratio'] * 1000:g}" if s["model"]["boundary_ratio"] else ""),
        f"target     {t['name']}: {t['platform']} x {t['devices']}, mesh {t['mesh']}"
        + (f", {t['device_kind']}" if t["device_kind"] else ""),
        f"video      {g['width']}x{g['height']}, {g['frames']} frames, batch {g['batch']}; latents {g['latents']}, "
        f"prompt embeds {g['prompt_embeds']} (max {g['max_sequence_length']} tokens)",
        f"shapes     {len(s['shapes'])}: " + ", ".join(
            f"{x['size']} x {x['frames']} frames ({x['seconds']:g} s)"
            + (f" + {x['reference_images']} reference image{'s' * (x['reference_images'] > 1)}"
               if x.get("reference_images") else "") + (" default" if x["default"] else "") for x in s["shapes"]),
        f"dtype      {s['dtype']} (VAE fp32); attention {_kv(s['attention'])}",
        f"defaults   {d['steps']} {'DMD' if (s.get('chunks') or {}).get('distilled') else d['sampler']} steps"
        + (" per stage" if (s.get("chunks") or {}).get("stages", 1) > 1 else "")
        + (f" (sigmas {', '.join(f'{v:g}' for v in d['sigmas'])})" if d.get("sigmas") else "")
        + f", guidance {d['guidance']}" + (f" / {d['guidance_2']}" if d.get("guidance_2") is not None else "")
        + f", flow shift {d['flow_shift']}, {d['fps']} fps"
        + (f", DiT fed t = sigma x {d['timestep_scale']:g} (not x 1000)" if d.get("timestep_scale", 1000) != 1000
           else ""),
        "decoders   full (the VAE, default)" + (
            f"; tiny: {(x := s['decoders']['tiny'])['file']} ({x['variant']} TAEHV decoder, {x['latent_channels']} "
            f"channels, takes {x['latents']} latents)" if "tiny" in s.get("decoders", {}) else ""),
        *([_chunks(s["chunks"], g)] if s.get("chunks") else []),
        "samplers   flowmap (FlowMapEulerDiscreteScheduler, the mean velocity), euler (r = t) (per run)"
        if s["model"]["kind"] in kinds.KINDS and kinds.get(s["model"]["kind"]).flow_map else
        f"samplers   unipc (order {s['scheduler'].get('solver_order')}, {s['scheduler'].get('solver_type')}), euler, "
        "dpm++ (any, per run)" if not s.get("chunks") else
        "samplers   DMD (the distilled scheduler's)" if s["chunks"]["distilled"] else
        f"samplers   unipc (order {s['scheduler'].get('solver_order')}, {s['scheduler'].get('solver_type')}), "
        "euler (HeliosScheduler's, per run)",
        f"versions   {_kv(s['versions'])}",
    ]
    if t["platform"] == "tpu":
        record = s.get("tpu_fit")
        lines.append("tpu fit    " + (fit.describe_record(record) if record else
                                      "never compiled for TPU here: `python -m runtime fit BUNDLE --record` compiles "
                                      "every program for the slice with libtpu (no TPU needed)"))
    if (ahead := s.get("executables")) and ahead["count"]:
        lines.append(f"executables {ahead['count']} programs compiled ahead ({ahead['files']} files, "
                     f"{_bytes(ahead['bytes'])}) for "
                     + "; ".join(dict.fromkeys(k["describe"] for k in ahead["built_for"]))
                     + "; loaded where the host matches, else compiled (--json: each one and its whole key)")
    lines += ["", "stages"]
    for name, st in s["stages"].items():
        lines.append(f"  {name:<18} {st['file']} ({_bytes(st['bytes'])}), weights: {st['weights']}")
        if "blocks" in st:
            loop = st["blocks"]
            lines.append(f"  {'':<18} then {loop['block']} x {loop['layers']} blocks, then {loop['tail']} "
                         f"({_bytes(loop['bytes'])})")
            for t, file in loop.get("short_prompts", {}).items():
                lines.append(f"  {'':<18} prompts of <= {t} tokens: {file} as the block")
        if "error" in st:
            lines.append(f"    (cannot read the program: {st['error']})")
        for kind, key in (("in ", "args"), ("out", "results")):
            for (aval, sharding), n in _runs([(a["aval"], a["sharding"]) for a in st.get(key, [])]):
                lines.append(f"    {kind}  {aval:<32} {sharding}" + (f"  (x{n})" if n > 1 else ""))
    quantized = f", quantized: {s['quantize']} (DiT and encoder linear layers, per-row scales)" if s["quantize"] else ""
    lines += ["", f"weights{'' if s['weights_attached'] else ' (not attached: exported with --no-weights)'}{quantized}",
              f"  {'group':<14} {'tensors':>8} {'sharded':>8} {'quantized':>9} {'total':>10} {'per device':>11}  "
              "per device by dtype"]
    all_dtypes: dict[str, int] = {}
    for group, w in s["weights"].items():
        for dtype, n in w["bytes_per_device_by_dtype"].items():
            all_dtypes[dtype] = all_dtypes.get(dtype, 0) + n
        lines.append(f"  {group:<14} {w['tensors']:>8} {w['sharded_tensors']:>8} {w['quantized_tensors']:>9} "
                     f"{_bytes(w['bytes']):>10} {_bytes(w['bytes_per_device']):>11}  "
                     f"{_by_dtype(w['bytes_per_device_by_dtype'])}")
    total = sum(w["bytes"] for w in s["weights"].values())
    per_device = sum(w["bytes_per_device"] for w in s["weights"].values())
    lines.append(f"  {'all':<14} {'':>8} {'':>8} {'':>9} {_bytes(total):>10} {_bytes(per_device):>11}  "
                 f"{_by_dtype(dict(sorted(all_dtypes.items(), key=lambda i: -i[1])))}")
    return "\n".join(lines)


def _by_dtype(sizes: dict[str, int]) -> str:
    return ", ".join(f"{dtype} {_bytes(n)}" for dtype, n in sizes.items())


def _program_shardings(path: Path, m: mf.Manifest, name: str) -> dict[str, Any]:
    """Positional (non-weight) arguments and results with their HLO shardings, from the program itself."""
    from .bundle import load_program
    from .errors import BundleError

    ref = m.programs[name]
    try:
        for file in ref.files():
            mf.check_file(path, file)
        exp = load_program(path, m, name)
        last = load_program(path, m, name, "tail" if ref.blocks else "")  # a block loop's results are its tail's
    except (BundleError, OSError) as e:
        return {"error": str(e)}
    n_weights = len(m.weights[ref.weights].tensors)

    def entry(aval: Any, sharding: Any) -> dict[str, str]:
        return {"aval": aval.str_short(), "sharding": "unspecified" if sharding is None else str(sharding)}

    return {"args": [entry(a, sh) for a, sh in zip(exp.in_avals[n_weights:], exp.in_shardings_hlo[n_weights:])],
            "results": [entry(a, sh) for a, sh in zip(last.out_avals, last.out_shardings_hlo)]}


def _runs(items: list[Any]) -> list[tuple[Any, int]]:
    """Consecutive equal items as (item, count): the VAE's dozens of cache arguments read as a few lines."""
    out: list[tuple[Any, int]] = []
    for item in items:
        if out and out[-1][0] == item:
            out[-1] = (item, out[-1][1] + 1)
        else:
            out.append((item, 1))
    return out


def _axes(entry: list[Any]) -> list[str]:
    out = []
    for e in entry:
        if isinstance(e, str):
            out.append(e)
        elif isinstance(e, list):
            out += e
    return out


def _spec(t: mf.TensorSpec) -> str:
    return f"{t.dtype}{list(t.shape)}"


def _size(path: Path, rel: str) -> int:
    p = mf.resolve(path, rel)
    return p.stat().st_size if p.is_file() else 0


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _kv(d: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())
