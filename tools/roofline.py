"""A roofline model of one denoising step on a TPU slice, from the programs we export.

    python tools/roofline.py                  # 14B 720p on tpu-v6e-8 and tpu-v6e-16, 1.3B 480p on tpu-v6e-4
    python tools/roofline.py --model wan2.1-t2v-14b --resolution 720p --frames 81 --target tpu-v6e-8

No TPU is needed. For each case:
  FLOPs per step (both CFG halves) counted analytically from the DiT config (matmuls and attention;
    XLA's own count of the compiled per-device program is printed beside it: it counts a while
    loop's body once, so it undercounts the blocked attention);
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
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Per chip: peak bf16 FLOP/s, HBM bytes/s, bidirectional ICI bytes/s (Google Cloud TPU pages).
CHIPS = {
    "TPU v6 lite": {"name": "v6e", "flops": 918e12, "hbm": 1638e9, "ici": 800e9, "hbm_gb": 32},
    "TPU v5 lite": {"name": "v5e", "flops": 197e12, "hbm": 819e9, "ici": 400e9, "hbm_gb": 16},
    "TPU v4": {"name": "v4", "flops": 275e12, "hbm": 1200e9, "ici": None, "hbm_gb": 32},  # ICI not published
}
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

def compile_child(bundle: str) -> dict[str, Any]:
    from runtime import manifest as mf
    from runtime.bundle import Bundle, make_mesh

    m = mf.read(Path(bundle))
    b = Bundle(path=Path(bundle), manifest=m, mesh=make_mesh(m.target))
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
        subprocess.run([sys.executable, "-m", "export", "--model", model, "--no-weights", "--resolution", resolution,
                        "--frames", str(frames), "--target", "cpu", "--mesh", format_mesh(target.mesh),
                        "--out", str(bundle), "--force", "-q"], cwd=ROOT, check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    proc = subprocess.run([sys.executable, __file__, "--child", str(bundle)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
                                          "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"})
    if proc.returncode != 0:
        raise SystemExit(f"error: compiling {bundle} failed:\n{proc.stderr[-3000:]}")
    compiled = json.loads(proc.stdout.strip().splitlines()[-1])

    m = mf.read(bundle)
    g = m.geometry
    cfg = m.source["config"]["transformer"]
    _, ph, pw = cfg["patch_size"]
    tokens = g.latent_frames * (g.latent_height // ph) * (g.latent_width // pw)
    flops = dit_flops(cfg, tokens, g.max_sequence_length, 2 * g.batch)
    total = sum(flops.values())
    summary = summarize(bundle, m)
    weights = summary["weights"]["transformer"]["bytes_per_device"]
    chip = CHIPS[target.device_kind]
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
    return {"model": model, "resolution": f"{g.width}x{g.height}", "frames": g.frames, "target": target_name,
            "mesh": format_mesh(target.mesh), "devices": n, "chip": chip["name"], "tokens": tokens,
            "flops": flops, "flops_total": total, "xla_flops_x_devices": compiled["xla_flops"] * n,
            "weight_bytes_per_device": weights, "activation_bytes_per_device": compiled["temp_bytes"],
            "xla_bytes_per_device": compiled["xla_bytes"], "collectives": compiled["collectives"],
            "bounds_s": bounds, "hbm_gb": chip["hbm_gb"], "ici_bytes_bf16": traffic,
            "mfu_for": {k: total / (n * chip["flops"] * v) for k, v in SEEDS.items()}}


def report(r: dict[str, Any]) -> str:
    gb = 1e9
    c = r["collectives"]
    kinds = ", ".join(f"{k} {c['bytes'][k] / gb:.2f} GB ({c['counts'][k]}x)" for k in COLLECTIVES if c["counts"][k])
    bound = max((v, k) for k, v in r["bounds_s"].items() if v == v and k != "hbm (XLA bytes)")
    b = r["bounds_s"]
    lines = [
        f"## {r['model']}, {r['resolution']}, {r['frames']} frames, {r['target']} ({r['devices']} x {r['chip']}, "
        f"mesh {r['mesh']})",
        f"tokens per sample {r['tokens']}; FLOPs per step (CFG batch of 2): {r['flops_total'] / 1e15:.2f} PFLOP "
        f"(linear {r['flops']['linear'] / 1e15:.2f}, attention {r['flops']['attention'] / 1e15:.2f}, "
        f"embed+head {r['flops']['embed+head'] / 1e15:.3f}); XLA's count x devices "
        f"{r['xla_flops_x_devices'] / 1e15:.2f} PFLOP (loop bodies once)",
        f"per device: weights {r['weight_bytes_per_device'] / gb:.2f} GB, activations (XLA CPU temporaries) "
        f"{r['activation_bytes_per_device'] / gb:.2f} GB of {r['hbm_gb']} GB HBM; XLA bytes accessed "
        f"{r['xla_bytes_per_device'] / gb:.1f} GB",
        f"collectives per device per step: {c['total'] / gb:.2f} GB as compiled for CPU ({kinds or 'none'}); "
        f"{r['ici_bytes_bf16'] / gb:.2f} GB with the f32 tensors at bf16 width as on TPU; largest:",
        *[f"    {e['count']:>4} x {e['what']}: {e['bytes'] / gb:.2f} GB" for e in c.get("largest", [])],
        f"time bounds per step: compute {b['compute']:.2f} s, HBM weights {b['hbm (weights)']:.3f} s "
        f"(XLA bytes {b['hbm (XLA bytes)']:.2f} s), ICI {b['ici']:.2f} s -> bound {bound[0]:.2f} s ({bound[1]})",
    ]
    if r["model"] == "wan2.1-t2v-14b" and r["resolution"] == "1280x720":  # what the seeds' figures are for
        lines.append(f"MFU needed for the seeds' {SEEDS['measured']} s/step (measured on v6e-8): "
                     f"{r['mfu_for']['measured']:.0%}; for {SEEDS['claimed']} s/step (claimed): "
                     f"{r['mfu_for']['claimed']:.0%}")
    else:
        lines.append(f"at 50% MFU: {r['bounds_s']['compute'] * 2:.2f} s/step")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(compile_child(sys.argv[2])))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="architecture name (default: the three standard cases)")
    p.add_argument("--resolution", default="720p")
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--target", default="tpu-v6e-8")
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / "roofline")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    cases = [(args.model, args.resolution, args.frames, args.target)] if args.model else CASES
    results = []
    for case in cases:
        results.append(analyse(*case, args.work))
        print(report(results[-1]) + "\n", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
