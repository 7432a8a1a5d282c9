"""A roofline model of one denoising step on a TPU slice, from the programs we export: what a step must cost there.

    python tools/bench.py roofline            # 14B 720p on tpu-v6e-8 and tpu-v6e-16, 1.3B 480p on tpu-v6e-4
    python tools/bench.py roofline --model wan2.1-t2v-14b --resolution 720p --frames 81 --target tpu-v6e-8

No TPU is needed, and nothing is timed (--repeats does not apply). For each case:
  FLOPs per step (both CFG halves) counted analytically from the DiT config (matmuls and attention), and
    beside them the TPU compiler's own count: the step's TPU programs (head, block, tail; the bundle
    `tools/bench.py fit` builds, compiled by libtpu here, its memo shared) as cost analysis counts
    them per device, which sees nothing inside the flash kernel, plus the attention FLOPs the kernel
    does (counted from the config) and its HBM reads (q, k and v per query block, from the blocks);
  the denoise_step program exported for the CPU with the target's (dp, sp, tp) mesh, compiled by
    XLA's SPMD partitioner for as many fake CPU devices, and its optimized HLO read for every
    all-gather / all-reduce / reduce-scatter / all-to-all / collective-permute (bytes moved per
    device, ring algorithms); the TPU program has the same shardings, only the local attention
    kernel differs;
  weight bytes per device from the manifest's partition specs, activation bytes per device from
    XLA's buffer assignment (temporaries), and HBM traffic from XLA's cost analysis;
and from the chip's peak bf16 FLOP/s, HBM and ICI bandwidth: the time bound of each resource, and
the MFU a step time needs (the seeds measured 4.59 s/step for 14B 720p on v6e-8 and claim 2.5 s).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from . import fit as fit_bench
from .common import Report, Table, add_common, child_env, export, log, spawn

SEEDS = {"measured": 4.59, "claimed": 2.5}  # s/step, 14B 720p 81 frames on v6e-8
CASES = [("wan2.1-t2v-14b", "720p", 81, "tpu-v6e-8"), ("wan2.1-t2v-14b", "720p", 81, "tpu-v6e-16"),
         ("wan2.1-t2v-1.3b", "480p", 81, "tpu-v6e-4")]
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s64": 8,
               "u64": 8, "f64": 8, "s16": 2, "u16": 2}


# -- FLOPs -------------------------------------------------------------------------------------------

def dit_flops(cfg: dict[str, Any], tokens: int, text_len: int, batch: int) -> dict[str, float]:
    """Multiply-adds x 2 of one DiT forward on `batch` samples, by part."""
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    f, n, s, L = cfg["ffn_dim"], cfg["num_layers"], tokens, text_len
    patch = cfg["in_channels"] * cfg["patch_size"][0] * cfg["patch_size"][1] * cfg["patch_size"][2]
    per_layer_linear = 2 * s * d * d * 4 + 2 * s * d * d * 2 + 2 * L * d * d * 2 + 2 * s * d * f * 2
    per_layer_attention = 4 * s * s * d + 4 * s * L * d
    parts = {
        "linear": n * per_layer_linear,
        "attention": n * per_layer_attention,
        "embed+head": 2 * s * patch * d + 2 * L * (cfg["text_dim"] * d + d * d) + 2 * s * d * cfg["out_channels"] * 4,
    }
    return {k: v * batch for k, v in parts.items()}


# -- HLO --------------------------------------------------------------------------------------------

_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>" + "|".join(COLLECTIVES)
                    + r")(?P<start>-start)?\(")


def _bytes(shape: str) -> list[int]:
    out = []
    for dtype, dims in _SHAPE.findall(shape):
        if dtype in DTYPE_BYTES:
            n = 1
            for x in filter(None, dims.split(",")):
                n *= int(x)
            out.append(n * DTYPE_BYTES[dtype])
    return out


def _group_size(line: str, devices: int) -> int:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line)  # mesh['a'=2,'b'=4] {'b'}
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'([\w]+)'=(\d+)", m.group(1))}
        n = 1
        for axis in re.findall(r"'([\w]+)'", m.group(2)):
            n *= sizes.get(axis, 1)
        return n
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    return devices


def collective_traffic(hlo: str, devices: int) -> dict[str, Any]:
    """Bytes each device sends per program run, by collective kind (ring algorithms), from optimized HLO."""
    trip = _loop_trip_counts(hlo)
    out: dict[str, float] = {k: 0.0 for k in COLLECTIVES}
    counts: dict[str, int] = {k: 0 for k in COLLECTIVES}
    by_shape: dict[str, list[float]] = {}  # "op shape over n" -> [count, bytes moved]
    f32_bytes = 0.0
    computation = None
    for line in hlo.splitlines():
        head = re.match(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and "=" not in line.split("{")[0]:
            computation = head.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        op, sizes = m.group("op"), _bytes(m.group("shape"))
        f32 = m.group("shape").lstrip("(").startswith("f32")
        r = max(sizes) if m.group("start") else sum(sizes)
        n = _group_size(line, devices)
        if n <= 1:
            continue
        moved = {"all-reduce": 2 * (n - 1) / n * r, "all-gather": (n - 1) / n * r, "reduce-scatter": (n - 1) * r,
                 "all-to-all": (n - 1) / n * r, "collective-permute": r}[op]
        times = trip.get(computation, 1)
        out[op] += moved * times
        counts[op] += times
        f32_bytes += moved * times if f32 else 0.0
        entry = by_shape.setdefault(f"{op} {m.group('shape')} over {n}", [0, 0.0])
        entry[0] += times
        entry[1] += moved * times
    top = sorted(by_shape.items(), key=lambda kv: -kv[1][1])[:5]
    return {"bytes": out, "counts": counts, "total": sum(out.values()), "f32": f32_bytes,
            "largest": [{"what": k, "count": int(c), "bytes": b} for k, (c, b) in top]}


def _loop_trip_counts(hlo: str) -> dict[str, int]:
    """while-body computation -> known trip count (collectives in loop bodies run that many times)."""
    trips = {}
    for m in re.finditer(r"while\(.*?body=%?([\w.\-]+).*?known_trip_count\":\{\"n\":\"(\d+)\"", hlo):
        trips[m.group(1)] = int(m.group(2))
    return trips


# -- the compile (a child process with as many fake devices as the target has) ----------------------

def compile_child(a: dict[str, Any], spawned: float) -> dict[str, Any]:
    from runtime import manifest as mf
    from runtime.bundle import Bundle, make_mesh

    m = mf.read(Path(a["bundle"]))
    b = Bundle(path=Path(a["bundle"]), manifest=m, mesh=make_mesh(m.target))
    compiled = b.compile_whole("denoise_step")
    hlo = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mem = compiled.memory_analysis()
    return {"collectives": collective_traffic(hlo, m.target.num_devices),
            "xla_flops": float(cost.get("flops", 0.0)), "xla_bytes": float(cost.get("bytes accessed", 0.0)),
            "temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0)),
            "argument_bytes": int(getattr(mem, "argument_size_in_bytes", 0))}


def analyse(model: str, resolution: str, frames: int, target_name: str, work: Path) -> dict[str, Any]:
    from runtime import manifest as mf
    from runtime.summary import summarize
    from runtime.targets import format_mesh, resolve

    target = resolve(target_name)
    n = target.num_devices
    bundle = work / f"{model}-{resolution}-f{frames}-{target_name}"
    if not (bundle / "manifest.json").is_file():  # the same program for the CPU, with the target's mesh
        log(f"exporting {bundle}")
        export(["--model", model, "--no-weights", "--resolution", resolution, "--frames", str(frames), "--target",
                "cpu", "--mesh", format_mesh(target.mesh)], bundle)
    log(f"compiling {bundle} for {n} CPU devices")
    compiled = spawn("roofline:compile_child", {"bundle": str(bundle)},
                     env=child_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={n}"))

    m = mf.read(bundle)
    g = m.geometry
    cfg = m.source["config"]["transformer"]
    _, ph, pw = cfg["patch_size"]
    tokens = g.latent_frames * (g.latent_height // ph) * (g.latent_width // pw)
    flops = dit_flops(cfg, tokens, g.max_sequence_length, 2 * g.batch)
    total = sum(flops.values())
    summary = summarize(bundle, m)
    weights = summary["weights"]["transformer"]["bytes_per_device"]
    from runtime.targets import chip as chip_of

    c = chip_of(target)  # peak bf16 FLOP/s, HBM and ICI bytes/s per chip (runtime/targets.py CHIPS)
    chip = {"name": c.name, "flops": c.bf16_flops, "hbm": c.hbm_bytes_per_s, "ici": c.ici_bytes_per_s,
            "hbm_gb": c.hbm_gib}
    # XLA CPU computes bf16 dots in f32 and moves their operands as f32; a bf16 program on TPU moves
    # those tensors (bf16 weights, bf16 hidden states) at half the bytes.
    traffic = compiled["collectives"]["total"] - compiled["collectives"]["f32"] / 2 if m.dtype == "bf16" \
        else compiled["collectives"]["total"]
    bounds = {
        "compute": total / n / chip["flops"],
        "hbm (weights)": weights / chip["hbm"],
        "hbm (XLA bytes)": compiled["xla_bytes"] / chip["hbm"],
        # a 1D ring per collective drives 2 of a chip's 4 ICI ports: half its bidirectional bandwidth
        "ici": traffic / (chip["ici"] / 2) if chip["ici"] else float("nan"),
    }
    tpu = tpu_counts(work.parent, model, resolution, frames, target, cfg, g, flops)
    tpu["compute_s"] = tpu["flops_total"] / n / chip["flops"]
    tpu["hbm_s"] = tpu["bytes_per_device"] / chip["hbm"]
    tpu["bound_s"] = max(tpu["compute_s"], tpu["hbm_s"], bounds["ici"] if bounds["ici"] == bounds["ici"] else 0.0)
    return {"model": model, "resolution": f"{g.width}x{g.height}", "frames": g.frames, "target": target_name,
            "tpu": tpu,
            "mesh": format_mesh(target.mesh), "devices": n, "chip": chip["name"], "tokens": tokens,
            "flops": flops, "flops_total": total, "xla_flops_x_devices": compiled["xla_flops"] * n,
            "weight_bytes_per_device": weights, "activation_bytes_per_device": compiled["temp_bytes"],
            "xla_bytes_per_device": compiled["xla_bytes"], "collectives": compiled["collectives"],
            "bounds_s": bounds, "hbm_gb": chip["hbm_gb"], "ici_bytes_bf16": traffic,
            "mfu_for": {k: total / (n * chip["flops"] * v) for k, v in SEEDS.items()}}


def tpu_child(a: dict[str, Any], spawned: float) -> dict[str, Any]:
    """The CFG step's TPU programs (head, block, tail) compiled for the slice by libtpu: per-device FLOPs and bytes
    accessed as cost analysis counts them; the fit memo in and out."""
    from runtime import fit
    from runtime import manifest as mf
    from runtime.bundle import Bundle

    memo_path = Path(a["memo"])
    memo = json.loads(memo_path.read_text()) if memo_path.is_file() else {}
    before = set(memo)
    m = mf.read(Path(a["bundle"]))
    mesh, topology = fit.compile_only_mesh(m.target)
    parts = fit.compile_bundle(Bundle(path=Path(a["bundle"]), manifest=m, mesh=mesh), memo=memo, topology=topology,
                               only={"denoise_step"})
    return {"parts": {c.part or "head": {"flops": c.flops, "bytes": c.bytes_accessed} for c in parts},
            "blocks": m.programs["denoise_step"].blocks.layers, "memo": {k: memo[k] for k in set(memo) - before},
            "attention": m.attention.get("dit", {})}


def tpu_counts(work: Path, model: str, resolution: str, frames: int, target: Any, cfg: dict[str, Any], g: Any,
               flops: dict[str, float]) -> dict[str, Any]:
    """One CFG step as the TPU compiler counts it, over all devices, plus what the flash kernel does."""
    bundle = fit_bench.bundle_for(work, (model, resolution, frames, None), target.name)
    memo_path = work / "fit" / "memo.json"
    log(f"compiling the TPU step of {bundle.name}")
    out = spawn("roofline:tpu_child", {"bundle": str(bundle), "memo": str(memo_path)})
    memo = json.loads(memo_path.read_text()) if memo_path.is_file() else {}
    memo.update(out.pop("memo"))
    memo_path.write_text(json.dumps(memo))
    n, parts, layers = target.num_devices, out["parts"], out["blocks"]
    xla = (parts["head"]["flops"] + layers * parts["block"]["flops"] + parts["tail"]["flops"]) * n
    xla_bytes = parts["head"]["bytes"] + layers * parts["block"]["bytes"] + parts["tail"]["bytes"]
    # The kernel's HBM traffic per device and layer: q read and the output written once, k and v read once per
    # query block (the kv axis is the inner loop), for this device's samples and heads (bf16).
    _, ph, pw = cfg["patch_size"]
    s = g.latent_frames * (g.latent_height // ph) * (g.latent_width // pw)
    mesh = target.mesh
    heads = cfg["num_attention_heads"] // mesh["tp"]
    samples = 2 * g.batch // mesh["dp"]
    block_q = out["attention"].get("block_q", 3328)
    sq = -(-s // mesh["sp"])
    d = cfg["attention_head_dim"]
    per_head = 2 * sq * d * 2 + -(-sq // block_q) * 2 * (s + g.max_sequence_length) * d * 2 + 2 * sq * d * 2
    kernel_bytes = cfg["num_layers"] * samples * heads * per_head
    return {"xla_flops": xla, "kernel_flops": flops["attention"], "flops_total": xla + flops["attention"],
            "xla_bytes_per_device": xla_bytes, "kernel_bytes_per_device": kernel_bytes,
            "bytes_per_device": xla_bytes + kernel_bytes}


def tables(results: list[dict[str, Any]]) -> list[Table]:
    gb = 1e9
    bounds = Table("time bounds of one denoising step (CFG batch of 2), from the programs as exported",
                   ["model, shape, target", "mesh", "PFLOP / step", "weights / device GB", "activations / device GB",
                    "ICI GB / device", "compute s", "HBM (weights) s", "ICI s", "bound s", "MFU for 4.59 s",
                    "MFU for 2.5 s"])
    colls = Table("collectives per device per step (as compiled for CPU; f32 tensors at bf16 width as on TPU)",
                  ["model, shape, target", "largest collectives"])
    for r in results:
        b = r["bounds_s"]
        bound = max((v, k) for k, v in b.items() if v == v and k != "hbm (XLA bytes)")
        case = f"{r['model']}, {r['resolution']} x {r['frames']}, {r['target']} ({r['devices']} x {r['chip']})"
        seeds = r["model"] == "wan2.1-t2v-14b" and r["resolution"] == "1280x720"  # what the seeds' figures are for
        bounds.add(case, r["mesh"], f"{r['flops_total'] / 1e15:.2f}", f"{r['weight_bytes_per_device'] / gb:.2f}",
                   f"{r['activation_bytes_per_device'] / gb:.2f}", f"{r['ici_bytes_bf16'] / gb:.2f}",
                   f"{b['compute']:.2f}", f"{b['hbm (weights)']:.3f}", f"{b['ici']:.2f}",
                   f"{bound[0]:.2f} ({bound[1].split(' ')[0]})",
                   *((f"{r['mfu_for']['measured']:.0%}", f"{r['mfu_for']['claimed']:.0%}") if seeds else ("-", "-")))
        colls.add(case, "; ".join(f"{e['count']} x {e['what']}: {e['bytes'] / gb:.2f} GB"
                                  for e in r["collectives"].get("largest", [])[:3]) or "none")
    bounds.notes.append("Compute at the chip's peak bf16 FLOP/s, HBM for reading the weights once, ICI at half the "
                        "chip's bidirectional bandwidth (a 1D ring drives 2 of 4 ports). MFU columns: the share of "
                        "peak the seeds' measured (4.59 s) and claimed (2.5 s) steps for 14B 720p on v6e-8 imply.")
    video = Table("denoising one video at the bound: 50 steps with CFG against 4 CFG-free steps (a distilled model)",
                  ["model, shape, target", "CFG step s", "CFG-free step s", "50 CFG steps s", "4 CFG-free steps s",
                   "ratio"])
    for r in results:
        b = r["bounds_s"]
        step = max(v for k, v in b.items() if v == v and k != "hbm (XLA bytes)")
        # a CFG-free step is the same DiT on batch 1: half the FLOPs; the weights' reads and all-gathers stay, so
        # its bound is the largest of half the compute and the (unhalved) HBM and ICI bounds
        free = max(b["compute"] / 2, b["hbm (weights)"], b["ici"] if b["ici"] == b["ici"] else 0.0)
        case = f"{r['model']}, {r['resolution']} x {r['frames']}, {r['target']}"
        video.add(case, f"{step:.2f}", f"{free:.2f}", f"{50 * step:.1f}", f"{4 * free:.2f}",
                  f"{50 * step / (4 * free):.0f}x")
    video.notes.append("A CFG-free step's bound keeps the CFG step's whole ICI traffic (an upper bound: the hidden "
                       "states' all-reduces halve with the batch). The VAE decode and the text encoder are the same "
                       "for both and not counted.")
    compiler = Table("the step as the TPU compiler counts it, beside the hand count (one CFG step, PFLOP over all "
                     "devices; bytes per device)",
                     ["model, shape, target", "hand PFLOP", "XLA PFLOP (outside the kernel)", "+ kernel attention",
                      "= compiler PFLOP", "compute s (hand)", "compute s (compiler)", "HBM GB: XLA + kernel",
                      "HBM s", "bound s (compiler)"])
    for r in results:
        t = r["tpu"]
        case = f"{r['model']}, {r['resolution']} x {r['frames']}, {r['target']}"
        compiler.add(case, f"{r['flops_total'] / 1e15:.2f}", f"{t['xla_flops'] / 1e15:.2f}",
                     f"{t['kernel_flops'] / 1e15:.2f}", f"{t['flops_total'] / 1e15:.2f}",
                     f"{r['bounds_s']['compute']:.2f}", f"{t['compute_s']:.2f}",
                     f"{t['xla_bytes_per_device'] / 1e9:.1f} + {t['kernel_bytes_per_device'] / 1e9:.1f}",
                     f"{t['hbm_s']:.2f}", f"{t['bound_s']:.2f}")
    compiler.notes.append("XLA PFLOP: cost analysis of the step's TPU programs (head + blocks x block + tail), per "
                          "device, times the devices; it counts nothing inside a custom call, so the flash kernel's "
                          "attention (self and cross, 4 s d (s + L) per layer and sample) is added from the config. "
                          "HBM: XLA's bytes accessed plus the kernel's reads and writes (q and the output once, k and "
                          "v once per query block); the bound is the largest of compute, HBM and the ICI bound above.")
    return [bounds, compiler, colls, video]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common(p, repeats=1, devices=("cpu",))
    p.add_argument("--model", help="architecture name (default: the three standard cases)")
    p.add_argument("--resolution", default="720p")
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--target", default="tpu-v6e-8")


def run(a: argparse.Namespace) -> Report:
    cases = [(a.model, a.resolution, a.frames, a.target)] if a.model else CASES
    results = [analyse(*case, a.work / "roofline") for case in cases]
    return Report(tables(results), results)
