"""What every benchmark shares: the workloads by name, bundles built once, fresh-process starts, the machine, and
one table layout (Markdown, medians, ratios against a named baseline) with an optional JSON copy."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench.py"
PROMPT = "a cat playing piano in a jazz club"
NEGATIVE = "blurry, low quality"
GUIDANCE = 5.0


# -- workloads -----------------------------------------------------------------------------------------------------

def _spec_1_3b() -> dict[str, Any]:
    from export.architectures import ARCHITECTURES

    arch = ARCHITECTURES["wan2.1-t2v-1.3b"]
    return dict(transformer=dict(arch["transformer"]), vae=dict(arch["vae"]),
                text_encoder=dict(d_model=4096, d_kv=64, d_ff=256, num_layers=1, num_heads=2), flow_shift=3.0)


def _spec_vace_1_3b() -> dict[str, Any]:
    """Wan2.1-VACE-1.3B's widths: the 1.3B DiT with its 15 VACE blocks (random weights), the real VAE."""
    from export.architectures import ARCHITECTURES

    return {**_spec_1_3b(), "transformer": dict(ARCHITECTURES["wan2.1-vace-1.3b"]["transformer"]), "pipeline": "vace"}


def _spec_animate_1_3b() -> dict[str, Any]:
    """Wan2.2-Animate-14B's parts at the 1.3B's widths (there is no 1.3B Animate): the 1.3B DiT's 30 blocks with
    Animate's 36-channel input, pose embedding, real-size motion encoder (512x512 faces), face encoder and face
    adapters (every 5th block), CLIP cross-attention; a 1-layer CLIP of ViT-H's width; the real VAE."""
    from export.architectures import ARCHITECTURES

    animate, small = ARCHITECTURES["wan2.2-animate-14b"], ARCHITECTURES["wan2.1-t2v-1.3b"]["transformer"]
    transformer = {**animate["transformer"], **{k: small[k] for k in ("num_attention_heads", "attention_head_dim",
                                                                       "ffn_dim", "num_layers")}}
    transformer["added_kv_proj_dim"] = transformer["num_attention_heads"] * transformer["attention_head_dim"]
    return {**_spec_1_3b(), "transformer": transformer, "pipeline": "animate",
            "image_encoder": {**animate["image_encoder"], "num_hidden_layers": 1}}


def _spec_animate2_1_3b() -> dict[str, Any]:
    """Wan-Animate 2 at the 1.3B's widths, beside animate-1.3b (there is no 1.3B Wan-Animate 2):
    WanAnimate2Transformer3DModel with the 1.3B DiT's 30 blocks, 12 heads of 128 and its FFN (random weights), its
    36-channel input and CLIP image embedding; a 1-layer CLIP of ViT-H's width; the 1.3b workload's text encoder and
    the real VAE; FlowMatchEuler at the 14B's shift. A modular pipeline (export/tiny.py build_modular)."""
    from export.architectures import ARCHITECTURES

    a2, small = ARCHITECTURES["wan-animate-2-14b"], ARCHITECTURES["wan2.1-t2v-1.3b"]["transformer"]
    transformer = dict(dim=small["num_attention_heads"] * small["attention_head_dim"], ffn_dim=small["ffn_dim"],
                       num_heads=small["num_attention_heads"], num_layers=small["num_layers"])
    scheduler = {k: v for k, v in a2["scheduler"].items() if k != "_class_name"}
    return {**_spec_1_3b(), "transformer": transformer, "pipeline": "animate-2", "scheduler": scheduler,
            "image_encoder": {**a2["image_encoder"], "num_hidden_layers": 1}}


def _spec_df_1_3b() -> dict[str, Any]:
    """SkyReels-V2-DF-1.3B-540P's widths: the 1.3B DiT with its fps embedding (random weights), run by diffusion
    forcing; the 1.3b workload's text encoder and the real VAE."""
    from export.architectures import ARCHITECTURES

    return {**_spec_1_3b(), "transformer": dict(ARCHITECTURES["skyreels-v2-df-1.3b-540p"]["transformer"]),
            "pipeline": "skyreels-df", "flow_shift": 8.0}


def _spec_helios_1_3b() -> dict[str, Any]:
    """Helios at the 1.3B's widths (there is no 1.3B Helios): HeliosTransformer3DModel with the 1.3B DiT's 30 blocks,
    12 heads of 128 and its RoPE split (random weights), HeliosPipeline's scheduler; the 1.3b workload's text encoder
    and the real VAE."""
    from export.architectures import ARCHITECTURES

    helios, small = ARCHITECTURES["helios-base"], ARCHITECTURES["wan2.1-t2v-1.3b"]["transformer"]
    transformer = {**helios["transformer"], **{k: small[k] for k in ("num_attention_heads", "attention_head_dim",
                                                                      "ffn_dim", "num_layers")}}
    scheduler = {k: v for k, v in helios["scheduler"].items() if k != "_class_name"}
    return {**_spec_1_3b(), "transformer": transformer, "pipeline": "helios", "scheduler": scheduler}


def _spec_anyflow_1_3b() -> dict[str, Any]:
    """AnyFlow at the 1.3B's widths (there is no 1.3B AnyFlow): AnyFlowTransformer3DModel with the 1.3B DiT's 30
    blocks and 12 heads of 128 (random weights), FlowMapEulerDiscreteScheduler; the 1.3b workload's text encoder and
    the real VAE."""
    from export.architectures import ARCHITECTURES

    anyflow, small = ARCHITECTURES["anyflow-wan2.1-t2v-14b"], ARCHITECTURES["wan2.1-t2v-1.3b"]["transformer"]
    transformer = {**anyflow["transformer"], **{k: small[k] for k in ("num_attention_heads", "attention_head_dim",
                                                                       "ffn_dim", "num_layers")}}
    scheduler = {k: v for k, v in anyflow["scheduler"].items() if k != "_class_name"}
    return {**_spec_1_3b(), "transformer": transformer, "pipeline": "anyflow", "scheduler": scheduler}


def _spec_far_1_3b() -> dict[str, Any]:
    """AnyFlow-FAR-Wan2.1-1.3B's DiT (anyflow-far-wan2.1-1.3b: 30 blocks, 12 heads of 128, the compressed patch
    embedding, random weights), FlowMapEulerDiscreteScheduler; the 1.3b workload's text encoder and the real VAE. Its
    chunk partition is cut from the shape's latent frames (runtime/far_layout.py)."""
    from export.architectures import ARCHITECTURES

    far = ARCHITECTURES["anyflow-far-wan2.1-1.3b"]
    transformer = {k: v for k, v in far["transformer"].items() if k != "chunk_partition"}
    scheduler = {k: v for k, v in far["scheduler"].items() if k != "_class_name"}
    return {**_spec_1_3b(), "transformer": transformer, "pipeline": "anyflow-far", "scheduler": scheduler}


@dataclass(frozen=True)
class Workload:
    """A model and a shape that a benchmark runs, built once under --work (a diffusers checkpoint, then bundles)."""

    name: str
    about: str
    model: str | Callable[[], dict[str, Any]]  # an embedded tiny variant, or a spec for export/tiny.build_pipeline
    width: int
    height: int
    frames: int
    max_len: int = 512

    @property
    def shape(self) -> str:
        return f"{self.width}x{self.height}, {self.frames} frames, {self.max_len} tokens"


WORKLOADS = {w.name: w for w in (
    Workload("tiny", "the embedded random-weight Wan 2.1 T2V model of the README", "tiny", 256, 144, 17),
    # UMT5-XXL itself (11 GB in bf16, 23 GB in fp32) does not fit this machine beside the rest: its text encoder is
    # one layer of the XXL width, which is what the DiT sees.
    Workload("1.3b", "the real Wan2.1-1.3B DiT and Wan VAE with random weights, a 1-layer UMT5 of the XXL width",
             _spec_1_3b, 128, 128, 9),
    Workload("vace-1.3b", "the 1.3b workload as Wan2.1-VACE-1.3B: its 15 VACE blocks beside the 30 blocks",
             _spec_vace_1_3b, 128, 128, 9),
    Workload("animate-1.3b", "Wan2.2-Animate's parts at the 1.3b workload's widths (512x512 faces), a 1-layer CLIP "
             "ViT-H; 9-frame segments", _spec_animate_1_3b, 128, 128, 9),
    Workload("animate2-1.3b", "Wan-Animate 2 at the 1.3b workload's widths (WanAnimate2Transformer3DModel, 30 "
             "blocks), a 1-layer CLIP ViT-H; 9-frame segments", _spec_animate2_1_3b, 128, 128, 9),
    Workload("df-1.3b", "SkyReels-V2-DF-1.3B's widths (the 1.3b workload's DiT with the fps embedding), diffusion "
             "forcing in 21-frame segments (6 latent frames)", _spec_df_1_3b, 128, 128, 21),
    Workload("helios-1.3b", "Helios at the 1.3b workload's widths (HeliosTransformer3DModel, 30 blocks), chunks of "
             "33 frames (9 latent frames) with the 16/2/1 history", _spec_helios_1_3b, 128, 128, 33),
    Workload("anyflow-1.3b", "AnyFlow at the 1.3b workload's widths (AnyFlowTransformer3DModel, 30 blocks, the flow "
             "map's r embedder)", _spec_anyflow_1_3b, 128, 128, 9),
    Workload("far-1.3b", "AnyFlow-FAR-Wan2.1-1.3B's DiT (AnyFlowFARTransformer3DModel, 30 blocks, its KV cache), "
             "25 frames: 7 latent frames in causal chunks of 1, 3 and 3", _spec_far_1_3b, 128, 128, 25),
)}


def export(args: Sequence[str], out: Path, root: Path = ROOT, quiet: bool = True) -> float:
    """`python -m export ... --out OUT --force` with the exporter of the checkout at `root`; its wall seconds."""
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "export", *args, "--out", str(out), "--force",
                           *(["-q"] if quiet else [])], cwd=root, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"})
    if proc.returncode != 0:
        raise SystemExit(f"error: python -m export {shlex.join(args)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t


def checkpoint(work: Path, wl: Workload) -> Path:
    """The workload's diffusers-format checkpoint, built once."""
    ckpt = work / wl.name / "checkpoint"
    if not any((ckpt / index).is_file() for index in ("model_index.json", "modular_model_index.json")):
        log(f"building the {wl.name} checkpoint in {ckpt}")
        spawn("common:save_checkpoint", {"workload": wl.name, "out": str(ckpt)})  # keeps this process small
    return ckpt


def save_checkpoint(a: dict[str, Any], spawned: float) -> dict[str, Any]:
    from export import tiny

    wl = WORKLOADS[a["workload"]]
    spec = wl.model if isinstance(wl.model, str) else wl.model()
    if isinstance(spec, dict) and spec.get("pipeline") in tiny.MODULAR:  # Wan-Animate 2: a modular directory
        tiny.build_modular(spec).save_pretrained(a["out"], safe_serialization=True, overwrite_modular_index=True)
        return {}
    tiny.build_pipeline(spec).save_pretrained(a["out"], safe_serialization=True)
    return {}


def bundle(work: Path, wl: Workload, dtype: str, target: str, *, quantize: str | None = None,
           shapes: tuple[str, str] | None = None, root: Path = ROOT) -> Path:
    """The workload's bundle for (dtype, target[, quantize][, shapes: (--resolution, --frames)]), exported once by
    the checkout at `root`."""
    name = "-".join(["bundle", dtype, target, *([quantize] if quantize else []),
                     *([f"{shapes[0]}x{shapes[1]}".replace(",", "+")] if shapes else [])])
    out = (work if root == ROOT else work / "baseline") / wl.name / name
    if not (out / "manifest.json").is_file():
        ckpt = checkpoint(work, wl)
        res, frames = shapes or (f"{wl.width}x{wl.height}", str(wl.frames))
        log(f"exporting {out}")
        export(["--model", str(ckpt.resolve()), "--resolution", res, "--frames", frames, "--max-sequence-length",
                str(wl.max_len), "--dtype", dtype, "--target", target,
                *(["--quantize", quantize] if quantize else [])], out, root)
    return out


# -- fresh processes -----------------------------------------------------------------------------------------------

def child_env(device: str = "cpu", root: Path = ROOT, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": device, **extra}


def spawn(func: str, args: dict[str, Any], *, device: str = "cpu", root: Path = ROOT,
          env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `benchmarks.<module>:<function>(args, spawned)` in a fresh process, with the runtime of the checkout at
    `root`; returns the dict it returned. `spawned` is the wall time the process was started at, so that a child
    can report its marks as seconds since spawn."""
    spawned = time.time()
    proc = subprocess.run([sys.executable, str(BENCH), "--child", func, json.dumps(args), repr(spawned)],
                          env=env or child_env(device, root), capture_output=True, text=True, cwd=root)
    if proc.returncode != 0:
        raise SystemExit(f"error: the {func} child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_child(func: str, args_json: str, spawned: str) -> int:
    """The child's side of `spawn` (tools/bench.py --child)."""
    import importlib

    module, name = func.split(":")
    result = getattr(importlib.import_module(f"benchmarks.{module}"), name)(json.loads(args_json), float(spawned))
    print(json.dumps(result))
    return 0


def timed_process(cmd: list[str], env: dict[str, str], cwd: Path = ROOT) -> dict[str, float]:
    """Run `cmd` to completion: its wall seconds, user and system CPU seconds and peak RSS (GB), that process alone
    (wait4's ru_maxrss counts the parent's RSS at the fork too: this process stays small, checkpoints are built in a
    child)."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"error: {shlex.join(cmd[:4])} ... failed:\n{err[-3000:]}")
    return {"wall": wall, "user": usage.ru_utime, "sys": usage.ru_stime, "rss_gb": usage.ru_maxrss / 1e6}


def peak_rss_gb(pid: int | str = "self") -> float:
    """A process's peak RSS since it started its program (VmHWM). Not getrusage's ru_maxrss: Linux carries that over
    from the parent through fork and exec, so a child of a big parent reports the parent's peak."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1e6  # kB
    return float("nan")


# -- figures -------------------------------------------------------------------------------------------------------

def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def ratio(x: float, base: float) -> str:
    return f"{x / base:.2f}x" if base and base == base and x == x else "-"


def num(x: float | None, digits: int = 2, unit: str = "") -> str:
    if x is None or x != x:
        return "-"
    return f"{x:.{digits}f}{unit}"


@dataclass
class Table:
    """One table of a report: a title, columns, rows of cells (strings), and notes printed under it."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        self.rows.append([str(c) for c in cells])

    def markdown(self) -> str:
        lines = [f"### {self.title}", "| " + " | ".join(self.columns) + " |",
                 "| " + " | ".join("---" for _ in self.columns) + " |"]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        if self.notes:
            lines += ["", *self.notes]
        return "\n".join(lines)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def machine(device: str = "cpu") -> str:
    """The machine a report was measured on: CPU model, cores, memory, and the GPU where one runs it."""
    mem = next((int(line.split()[1]) / 2**20 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal:")), float("nan"))
    text = f"{cpu_name()}, {os.cpu_count()} cores, {mem:.0f} GiB"
    if device == "cuda":
        try:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=30).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            gpu = "unknown GPU"
        text += f"; {gpu}"
    return text


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# -- the command line ----------------------------------------------------------------------------------------------

def add_common(p: argparse.ArgumentParser, *, repeats: int = 3, devices: Sequence[str] = ("cpu", "cuda"),
               workloads: Sequence[str] | None = None, dtypes: Sequence[str] | None = None) -> None:
    """The options every measure takes: --repeats, --device, --work, --json; --workload and --dtype where the
    measure runs a workload (several values: one table each, measured in turn)."""
    if workloads is not None:
        p.add_argument("--workload", nargs="+", default=list(workloads), choices=list(WORKLOADS),
                       help=f"workloads by name (default: {' '.join(workloads)}): "
                            + "; ".join(f"{w.name}: {w.about}, {w.shape}" for w in WORKLOADS.values()))
    if dtypes is not None:
        p.add_argument("--dtype", nargs="+", default=list(dtypes), choices=["fp32", "bf16"],
                       help=f"bundle dtypes (default: {' '.join(dtypes)})")
    p.add_argument("--repeats", type=int, default=repeats,
                   help=f"repetitions, interleaved across what is compared; medians reported (default {repeats})")
    p.add_argument("--device", choices=list(devices), default="cpu",
                   help="where the runtime (and torch, where compared) runs; bundles are exported for that target"
                   if len(devices) > 1
                   else "this measure runs on the CPU only")
    p.add_argument("--work", type=Path, default=ROOT / "artifacts" / "bench",
                   help="checkpoints and bundles are built here once (default artifacts/bench)")
    p.add_argument("--json", type=Path, default=None, help="also write the tables and every measurement here")


class Usage(Exception):
    """A bad command line or an unusable input: tools/bench.py prints `error: <message>` and exits 2."""


@dataclass
class Report:
    """What a measure returns: its tables, the raw measurements for --json, and the exit code (load: 1 when a job
    was lost or completed twice)."""

    tables: list[Table]
    raw: Any = None
    exit_code: int = 0


def each_workload(a: Any, measure: Callable[[Any, str, str], tuple[list[Table], dict[str, Any]]]) -> Report:
    """The Report of `measure(a, workload, dtype)` (its tables, its raw figures) for every --workload x --dtype."""
    tables, raw = [], []
    for workload in a.workload:
        for dtype in a.dtype:
            t, r = measure(a, workload, dtype)
            tables += t
            raw.append(r)
    return Report(tables, raw)


def emit(report: Report, argv: list[str], device: str, json_path: Path | None) -> None:
    header = (f"Measured {time.strftime('%Y-%m-%d')} on {machine(device)}, with "
              f"`python tools/bench.py {shlex.join(argv)}`")
    print("\n" + header + "\n")
    for t in report.tables:
        print(t.markdown() + "\n", flush=True)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"command": f"python tools/bench.py {shlex.join(argv)}",
                                         "date": time.strftime("%Y-%m-%d"), "machine": machine(device),
                                         "tables": [asdict(t) for t in report.tables], "raw": report.raw},
                                        indent=1, default=str) + "\n")
        log(f"wrote {json_path}")
