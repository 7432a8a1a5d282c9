"""`python -m runtime fit`: compile every program of a TPU bundle with XLA's TPU compiler here, on a machine without
a TPU, and say whether the bundle fits its slice's HBM.

Why: exporting only traces and lowers a program for TPU. Whether Wan 14B at 720p x 81 fits a v5e-8 was arithmetic
over the weights, blind to activations and to the VAE decoder's working set, and the flash kernel's tiling had only
run in interpret mode. libtpu compiles for a slice it does not have (jax's compile-only topologies, what MaxText's
train_compile.py uses before anyone rents one): the compiler refuses a program that overflows HBM or a kernel's VMEM,
and `memory_analysis()` gives each program's per-device argument, temporary, output and code bytes.

The peak is what the runtime holds at once, as it loads and unloads stages (`MODES`): the weight groups resident
then, the arrays a stage keeps between its programs (the denoising state and conditioning, every expert's
cross-attention keys and values, the decoder's previous chunk), the compiled programs, and the working set of the
program running (its other inputs, its outputs and temporaries). Weight bytes come from the manifest's shapes and
shardings; everything else from the compiler. The compiler's cost analysis counts nothing inside a custom call, so
its FLOPs leave out the flash kernel's attention.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import resource
import tempfile
import time
import warnings
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers the "bfloat16" dtype name with numpy)
import numpy as np

from . import kinds, targets
from . import manifest as mf
from .errors import UserError

GIB = 1 << 30
MOSAIC = "tpu_custom_call"  # the custom call a Pallas TPU kernel lowers to
INSTALL = "pip install 'wan-aot[tpu]' (or: pip install -r requirements/tpu.lock)"


class DoesNotFit(Exception):
    """The bundle does not fit (exit status 1): its message is the one line that says where and what would help."""


@dataclass(frozen=True)
class Compiled:
    """One compiled program file: what XLA's TPU compiler says of it, per device."""

    key: str  # the manifest name of its program, or the file's stem for a block loop's block or tail
    program: str  # a manifest program that runs the file
    part: str  # "" (the program's own file), "block" or "tail" (manifest.BlockLoop)
    compile_s: float  # wall seconds
    compile_cpu_s: float  # this process's CPU seconds meanwhile (a figure that holds on a loaded machine)
    argument_bytes: int
    temp_bytes: int
    output_bytes: int
    code_bytes: int
    alias_bytes: int
    flops: float
    bytes_accessed: float
    weight_bytes: int  # the part of argument_bytes that is the program's weights (from their shapes and shardings)
    inputs: list[tuple[str, int]]  # the other arguments, by name where the manifest names them, and their bytes
    outputs: list[int]  # bytes of each result
    traced_kernel: bool  # the exported program calls the Pallas kernel
    kernel: bool  # the compiled program runs it (Mosaic)

    def to_json(self) -> dict[str, Any]:
        return {"program": self.program, "part": self.part, "compile_s": round(self.compile_s, 3),
                "compile_cpu_s": round(self.compile_cpu_s, 3),
                "argument_bytes": self.argument_bytes, "temp_bytes": self.temp_bytes,
                "output_bytes": self.output_bytes, "code_bytes": self.code_bytes, "flops": self.flops,
                "bytes_accessed": self.bytes_accessed, "weight_bytes": self.weight_bytes, "kernel": self.kernel}


@dataclass(frozen=True)
class Moment:
    """What each device holds while one program runs."""

    stage: str  # kinds.PIPELINE_STAGES
    program: str  # the Compiled key running
    weights: dict[str, int]  # resident weight groups
    held: dict[str, int]  # arrays kept between programs
    code: int  # compiled programs loaded
    working: int  # the running program's other inputs, outputs and temporaries

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + sum(self.held.values()) + self.code + self.working

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "program": self.program, "bytes": self.total, "weights": self.weights,
                "held": self.held, "code_bytes": self.code, "working_bytes": self.working}


@dataclass
class Report:
    bundle: Path
    target: mf.Target
    topology: str
    chip: targets.Chip
    hbm_bytes: int
    mode: str
    programs: list[Compiled] = field(default_factory=list)
    peaks: dict[str, Moment] = field(default_factory=dict)  # by mode

    @property
    def peak(self) -> Moment:
        return self.peaks[self.mode]

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.hbm_bytes

    def to_json(self) -> dict[str, Any]:
        return {"bundle": str(self.bundle), "target": self.target.name, "topology": self.topology,
                "chip": self.chip.name, "mode": self.mode,
                "programs": {c.key: c.to_json() for c in self.programs},
                "compile_s": round(sum(c.compile_s for c in self.programs), 3),
                "peak_bytes": self.peak.total, "hbm_bytes": self.hbm_bytes, "fits": self.fits,
                "peak": self.peak.to_json(), "peaks": {m: p.to_json() for m, p in self.peaks.items()}}


# -- the compiler --------------------------------------------------------------------------------------------------

def check_libtpu() -> None:
    """UserError (with the pip command) unless XLA's TPU compiler is installed: libtpu, or $TPU_LIBRARY_PATH."""
    path = os.environ.get("TPU_LIBRARY_PATH")
    if path and Path(path).is_file():
        return
    try:
        found = importlib.util.find_spec("libtpu") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UserError(f"fitting a bundle to a TPU slice needs the tpu extra (libtpu, XLA's TPU compiler, is not "
                        f"installed; no TPU is needed): {INSTALL}")


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[list[str]]:
    """Hold what C++ writes to file descriptor 2 (libtpu's start-up complaints on a machine without a TPU: GCE
    metadata, TPU_WORKER_HOSTNAMES); the list gets it, for an error that needs it."""
    captured: list[str] = []
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.append(sink.read().decode(errors="replace"))


def _share_libtpu() -> None:
    """Let several processes load libtpu at once on a machine without a TPU. libtpu takes /tmp/libtpu_lockfile when
    it loads, so that two processes never drive one TPU; compile-only devices drive nothing, and two fits (or a fit
    beside an export --fit) would otherwise refuse each other. Where a TPU is attached the lock stays."""
    from jax._src import hardware_utils

    if not hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def compile_only_mesh(target: mf.Target) -> tuple[Any, str]:
    """A mesh of the target's slice made of libtpu's compile-only devices (nothing runs on them), and its topology
    name."""
    from jax.experimental import topologies

    from .bundle import make_mesh

    check_libtpu()
    _share_libtpu()
    name = targets.topology(target)
    chip = targets.chip(target)
    options = {"chip_config_name": chip.chip_config} if chip.chip_config else {}
    with _quiet_stderr() as said:
        try:
            topo = topologies.get_topology_desc(platform="tpu", topology_name=name, **options)
        except Exception as e:  # noqa: BLE001  (libtpu's own message, in one line)
            raise UserError(f"libtpu cannot make a {name} topology ({one_line(e)}): check the libtpu install "
                            f"({INSTALL})") from None
    del said
    return make_mesh(target, list(topo.devices)), name


def one_line(e: BaseException | str) -> str:
    """An error's message as one line: XLA's messages run over many, with the cause first."""
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return "; ".join(lines[:3])[:600] if lines else type(e).__name__


def _nbytes(aval: Any, sharding: Any) -> int:
    shape = tuple(aval.shape) if sharding is None else sharding.shard_shape(tuple(aval.shape))
    return math.prod(shape) * np.dtype(aval.dtype).itemsize


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def memo_key(ref: mf.FileRef, topology: str) -> str:
    """What a compiled file's figures depend on: its bytes (the program, its weights' shapes, dtypes and shardings),
    the slice, and the compiler."""
    from importlib import metadata

    try:
        libtpu = metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        libtpu = "unknown"
    return f"{ref.sha256}:{topology}:libtpu-{libtpu}"


COMPILER_FIELDS = ("compile_s", "compile_cpu_s", "argument_bytes", "temp_bytes", "output_bytes", "code_bytes",
                   "alias_bytes", "flops", "bytes_accessed", "kernel")  # what compiling a file tells (the memo's)


def refusal(where: str, target: mf.Target, error: BaseException | str) -> str:
    """The one line for a program the TPU compiler refuses: its own message, and what would help. Out of HBM here
    means the program's own temporaries: a smaller working set per chip helps (quantized weights would not)."""
    text = one_line(error).rstrip(".")
    if "vmem" in text.lower():
        hint = " (lower --flash-block-q/-kv at export)"
    elif "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        hint = f"; try {', '.join(_helps(None, targets.chip(target), target))}"
    else:
        hint = ""
    return f"the TPU compiler refuses {where} for {target.name}: {text}{hint}"


def _compile(bundle: Any, name: str, part: str) -> dict[str, Any]:
    """Compile program `name`'s `part` and read what the compiler says of it (COMPILER_FIELDS)."""
    import jax

    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    try:
        compiled = bundle.compile(name, part)
    except jax.errors.JaxRuntimeError as e:
        raise DoesNotFit(refusal(name if not part else f"{name} ({part})", bundle.manifest.target, e)) from None
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if cost else {}) if isinstance(cost, list) else (cost or {})
    return {"compile_s": seconds, "compile_cpu_s": cpu, "argument_bytes": int(mem.argument_size_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes), "output_bytes": int(mem.output_size_in_bytes),
            "code_bytes": int(mem.generated_code_size_in_bytes), "alias_bytes": int(mem.alias_size_in_bytes),
            "flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "kernel": MOSAIC in compiled.as_text()}


def compile_bundle(bundle: Any, on_compiled: Callable[[Compiled], None] | None = None,
                   memo: dict[str, dict[str, Any]] | None = None, topology: str = "",
                   only: Collection[str] | None = None) -> list[Compiled]:
    """Compile each program file of `bundle` (a runtime.bundle.Bundle over a compile-only mesh) once, in manifest
    order. DoesNotFit where the compiler refuses one (out of HBM, a kernel's VMEM), with its own message. `memo`
    (memo_key -> Compiled fields) gives the figures of files compiled before, by their bytes, and takes the new ones
    (tools/bench.py fit: bundles that share their text encoder or VAE programs). `only`: these programs alone."""
    from . import signatures

    m = bundle.manifest
    kind = kinds.get(m.kind)
    done: set[str] = set()
    out = []
    for name, spec in m.programs.items():
        if only is not None and name not in only:
            continue
        for part in spec.parts:
            ref = spec.blocks.file(part) if part else mf.FileRef(spec.file, spec.sha256)
            if ref.file in done:
                continue
            done.add(ref.file)
            key = name if not part else Path(ref.file).stem
            exp = bundle.program(name, part)
            stats = None if memo is None else memo.get(memo_key(ref, topology))
            if stats is None:
                stats = _compile(bundle, name, part)
                if memo is not None:
                    memo[memo_key(ref, topology)] = stats
            # the arguments as this bundle places them (the weights a program does not use have no sharding in it,
            # but are passed as the group's layout says)
            weights, *avals = bundle._abstract(name, part)
            names = list(signatures.call_order(name, kind, spec).inputs) if not part else []
            if not part and spec.blocks is not None and not spec.blocks.head_takes_shared:  # VACE's head takes kv
                names = [n for n in names if n not in spec.blocks.shared]
            if part == "block":
                shared = list(spec.blocks.shared)
                names = [""] * (len(avals) - len(shared) - 1) + shared + ["layer"]
            names += [""] * (len(avals) - len(names))
            wrong = [n for n, a in zip(names, avals) if n in spec.inputs and tuple(spec.inputs[n].shape) != a.shape]
            if wrong:  # the peak adds inputs by name (held between steps or not): a misnamed one is counted wrong
                raise AssertionError(f"{key}: inputs {wrong} paired with another input's shape")
            c = Compiled(key=key, program=name, part=part, **{k: stats[k] for k in COMPILER_FIELDS},
                         weight_bytes=sum(_nbytes(a, a.sharding) for a in weights.values()),
                         inputs=[(n, _nbytes(a, a.sharding)) for n, a in zip(names, avals)],
                         outputs=[_nbytes(a, s) for a, s in zip(exp.out_avals, exp.out_shardings_jax(bundle.mesh))],
                         traced_kernel=MOSAIC in exp.mlir_module())
            out.append(c)
            if on_compiled is not None:
                on_compiled(c)
    return out


# -- what the runtime holds at once --------------------------------------------------------------------------------

# Which weight groups each stage has resident, by how the runtime runs:
#   serve: `runtime serve` and the Python API place every group and compile every program before the first job, and
#          keep them (Pipeline.prepare);
#   generate: `runtime generate` loads the denoising stage's groups in the background while it encodes, drops the
#          encoders' before the first step and the DiT's before the VAE decodes (Pipeline.generate, low_memory).
MODES = ("serve", "generate")
HELD = ("state", "kv", "context")  # inputs the denoising loop keeps on the devices between steps (and conditioning)


def group_bytes(m: mf.Manifest) -> dict[str, int]:
    """Each weight group's bytes per device, as the manifest's shapes and partition specs place them."""
    out = {}
    for group, wf in m.weights.items():
        total = 0
        for name, t in wf.tensors.items():
            split = math.prod(m.target.mesh[a] for a in _axes(wf.partition.get(name, [])))
            total += math.prod(t.shape) * np.dtype(t.dtype).itemsize // split
        out[group] = total
    return out


def _axes(entry: list[Any]) -> list[str]:
    return [a for e in entry for a in ([e] if isinstance(e, str) else e if isinstance(e, list) else [])]


def plan(m: mf.Manifest, compiled: list[Compiled], mode: str) -> list[Moment]:
    """Every moment of a run in `mode` (MODES), with what each device holds then. With only some programs compiled
    yet, the moments of those (each a lower bound: the others' code and results count nothing)."""
    kind = kinds.get(m.kind)
    weights = group_bytes(m)
    by_ref = {_file(m, c): c for c in compiled}
    files = {(n, p): by_ref[ref] for n, spec in m.programs.items() for p in spec.parts  # (program, part) -> Compiled
             if (ref := spec.blocks.file(p).file if p else spec.file) in by_ref}
    stage_of = {name: kinds.pipeline_stage(name) for name in m.programs}
    groups_in = {s: {m.programs[n].weights for n in m.programs if stage_of[n] == s} for s in kinds.PIPELINE_STAGES}
    if mode == "serve":
        resident = {s: set(weights) for s in kinds.PIPELINE_STAGES}
    else:
        encoder = {m.programs[n].weights for n in m.programs if n.startswith("vae_encode")}  # the VAE, if it encodes
        resident = {"encode": groups_in["encode"] | groups_in["denoise"],
                    "denoise": groups_in["denoise"] | encoder, "decode": groups_in["decode"]}

    def moment(stage: str, c: Compiled, held: dict[str, int], kept: set[str] = frozenset(),
               extra: int = 0) -> Moment:
        """Program `c` running in `stage` while `held` is kept; `kept`: its inputs that are among `held`."""
        code = sum(files[(n, p)].code_bytes for n, spec in m.programs.items() for p in spec.parts
                   if spec.weights in resident[stage] and (n, p) in files)  # each program loads its own executables
        padding = max(0, c.argument_bytes - c.weight_bytes - sum(b for _, b in c.inputs))  # the compiler's layout
        mine = sum(b for n, b in c.inputs if n not in kept)
        return Moment(stage, c.key, {g: weights[g] for g in sorted(resident[stage])}, held, code,
                      mine + padding + c.output_bytes + c.temp_bytes - c.alias_bytes + extra)

    moments = [moment("encode", files[(n, "")], {}) for n in m.programs if stage_of[n] == "encode" and (n, "") in files]
    kv = {kinds.DIT_GROUPS[e]: sum(files[(kinds.cross_kv_program(e), "")].outputs) for e in range(kind.experts)
          if (kinds.cross_kv_program(e), "") in files}  # each expert's keys and values: computed once, kept
    for g in m.shapes:
        steps = [s for s in (m.program_for(kinds.denoise_program(e, v), g) for e in range(kind.experts)
                             for v in kinds.DENOISE_VARIANTS) if (s, "") in files]
        if not steps:
            continue
        loop = {n: b for n, b in files[(steps[0], "")].inputs if n == "state" or n in kind.conditioning_inputs}
        every_kv = {f"kv {group}": b for group, b in kv.items()}
        for e, group in enumerate(kv):  # an expert's first step computes its keys and values, the other's kept
            others = {k: b for k, b in every_kv.items() if k != f"kv {group}"}
            moments.append(moment("denoise", files[(kinds.cross_kv_program(e), "")], {**loop, **others}))
        motion = m.program_for("face_motion", g)
        if (motion, "") in files:  # Wan-Animate: the face video's motion, once per segment
            moments.append(moment("denoise", files[(motion, "")], {**loop, **every_kv}))
        for name in steps:
            spec = m.programs[name]
            variant = kinds.denoise_variant(name)
            # a MagCache full step makes a residual while the previous one is still referenced
            cached = m.program_for(kinds.denoise_program(0, "cached"), g)
            residual = 0 if variant.residual != "out" or (cached, "") not in files else next(
                (b for n, b in files[(cached, "")].inputs if n == "residual"), 0)
            for part in spec.parts:
                if (name, part) not in files:
                    continue
                c = files[(name, part)]
                kept = {n for n, _ in c.inputs if n in loop or n in HELD}
                moments.append(moment("denoise", c, {**loop, **every_kv}, kept, residual))
    for size, prefix in ((size, prefix) for size in dict.fromkeys(g.size for g in m.shapes)
                         for prefix in kinds.DECODERS.values()):  # each decoder: chunk after chunk
        g = max((x for x in m.shapes if x.size == size), key=lambda x: x.latent_frames)
        first = files.get((m.program_for(f"{prefix}_first", g), ""))
        if first is None:
            continue
        moments.append(moment("decode", first, {}))
        nxt = m.program_for(f"{prefix}_next", g)
        if (nxt, "") in files and g.latent_frames > 1:
            c = files[(nxt, "")]
            # the chunk before, copied to the host while this one runs (Pipeline.decode)
            moments.append(moment("decode", c, {"decoded frames": max(first.outputs[0], c.outputs[0])}))
    return moments


def _file(m: mf.Manifest, c: Compiled) -> str:
    spec = m.programs[c.program]
    return spec.blocks.file(c.part).file if c.part else spec.file


# -- the whole check -----------------------------------------------------------------------------------------------

def fit(path: Path, hbm_gib: float | None = None, mode: str = "serve", manifest: mf.Manifest | None = None,
        on_compiled: Callable[[Compiled], None] | None = None, verify: bool = True,
        memo: dict[str, dict[str, Any]] | None = None) -> Report:
    """Compile every program of the TPU bundle at `path` for its target's slice and model its per-device peak
    against the chip's HBM (or `hbm_gib`). UserError for a bundle that is not for TPU or a missing libtpu;
    DoesNotFit where the compiler refuses a program. `manifest`: the bundle's, when it is not yet at `path`'s
    manifest.json (export --fit checks a bundle before writing it)."""
    from .bundle import Bundle
    from .integrity import Checker

    if mode not in MODES:
        raise UserError(f"--mode {mode!r}: choose one of {', '.join(MODES)}")
    m = manifest if manifest is not None else mf.read(path)
    if m.target.platform != "tpu":
        raise UserError(f"{path} is a {m.target.platform} bundle (target {m.target.name}): fit compiles TPU bundles; "
                        "export one with --target tpu-... (e.g. tpu-v6e-8)")
    chip = targets.chip(m.target)
    if hbm_gib is not None and not (0 < hbm_gib < float("inf")):
        raise UserError(f"--hbm {hbm_gib} must be a number of GiB > 0")
    hbm = int((chip.hbm_gib if hbm_gib is None else hbm_gib) * GIB)
    if verify:  # every program file against its sha256 before it is read (the weights are not needed)
        Checker(path, m).check([ref for p in m.programs.values() for ref in p.files()])
    mesh, topology = compile_only_mesh(m.target)
    bundle = Bundle(path=path, manifest=m, mesh=mesh)
    report = Report(bundle=path, target=m.target, topology=topology, chip=chip, hbm_bytes=hbm, mode=mode)
    weights = group_bytes(m)
    if sum(weights.values()) > hbm and mode == "serve":  # no compile can make this fit: say so at once
        raise DoesNotFit(_advice(m, f"its weights alone need {_gib(sum(weights.values()))} per device", hbm, chip))
    so_far: list[Compiled] = []

    def compiled(c: Compiled) -> None:  # stop at the first program that cannot fit, whatever the others need
        so_far.append(c)
        if on_compiled is not None:
            on_compiled(c)
        peak = max(plan(m, so_far, mode), key=lambda x: x.total, default=None)
        if peak is not None and peak.total > hbm:
            raise DoesNotFit(_advice(m, _peak_text(peak), hbm, chip))

    with warnings.catch_warnings():
        # jax's persistent compilation cache cannot load executables for compile-only devices; where a process has
        # one enabled, each read fails with a warning and the program is compiled anyway
        warnings.filterwarnings("ignore", message=r"Error reading persistent compilation cache entry")
        report.programs = compile_bundle(bundle, compiled, memo, topology)
    for each in MODES:
        report.peaks[each] = max(plan(m, report.programs, each), key=lambda x: x.total)
    return report


def check(report: Report) -> None:
    """DoesNotFit with the one line that says where and what would help, unless the report fits."""
    if report.fits:
        return
    m = mf.read(report.bundle) if (report.bundle / mf.MANIFEST_FILE).is_file() else None
    raise DoesNotFit(_advice(m, _peak_text(report.peak), report.hbm_bytes, report.chip, report.target))


def _peak_text(p: Moment) -> str:
    return (f"{p.program} ({p.stage}) needs {_gib(p.total)} per device (weights {_gib(sum(p.weights.values()))}, "
            f"the rest {_gib(p.total - sum(p.weights.values()))})")


def _helps(m: mf.Manifest | None, chip: targets.Chip, target: mf.Target | None) -> list[str]:
    """What would make a bundle fit: int8 weights where `m` is a bf16 bundle, then a larger slice, fewer frames, a
    smaller shape."""
    helps = ["--quantize int8"] if m is not None and m.quantize is None else []
    bigger = f"tpu-{chip.name}-{2 * target.num_devices}" if target is not None else "a larger slice"
    return [*helps, f"a larger slice ({bigger})", "fewer frames", "a smaller shape"]


def _advice(m: mf.Manifest | None, what: str, hbm: int, chip: targets.Chip, target: mf.Target | None = None) -> str:
    target = target or (m.target if m else None)
    return (f"{target.name if target else 'the bundle'} ({chip.name}, {_gib(hbm)} HBM per chip) does not fit: {what}; "
            f"try {', '.join(_helps(m, chip, target))}")


RECORD = "fit.json"  # what `fit --record` and `export --fit` leave in the bundle, for `inspect` and `verify`


def record(report: Report, bundle_id: str, directory: Path | None = None) -> Path:
    """Write the report into the bundle (RECORD), with where and with what it was compiled: it is not part of the
    bundle's content (not in the manifest, never used to run anything), so only a record for this bundle_id is
    shown."""
    import platform
    from importlib import metadata

    from .files import atomic_path

    versions = {}
    for pkg in ("jax", "jaxlib", "libtpu"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = "unknown"
    data = {**report.to_json(), "bundle_id": bundle_id, "compiled_on": {
        "host": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), **versions}}
    data.pop("bundle", None)
    path = (directory or report.bundle) / RECORD
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1) + "\n")
    return path


def read_record(path: Path, m: mf.Manifest) -> dict[str, Any] | None:
    """The fit recorded in bundle `path` for this manifest's bundle_id, or None."""
    try:
        data = json.loads((path / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("bundle_id") == m.bundle_id else None


def describe_record(data: dict[str, Any]) -> str:
    """One line: what was compiled for which slice, where, and whether it fit."""
    on = data.get("compiled_on", {})
    verdict = "fits" if data.get("fits") else "does NOT fit"
    return (f"{len(data.get('programs', {}))} programs compiled for {data.get('target')} ({data.get('topology')}) by "
            f"XLA's TPU compiler (libtpu {on.get('libtpu')}) on {on.get('host')} ({on.get('machine')}, "
            f"{on.get('cpus')} cores) {on.get('date')}: peak {data.get('peak_bytes', 0) / GIB:.2f} of "
            f"{data.get('hbm_bytes', 0) / GIB:.2f} GiB per chip ({data.get('mode')}), {verdict}")


def _gib(n: float) -> str:
    """Bytes as GiB, or MiB below one GiB (tiny test models)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def format_text(report: Report) -> str:
    rows = [("program", "compile s", "argument", "temp", "output", "code", "GFLOP", "kernel")]
    for c in report.programs:
        rows.append((c.key, f"{c.compile_s:.1f}", _mib(c.argument_bytes), _mib(c.temp_bytes), _mib(c.output_bytes),
                     _mib(c.code_bytes), f"{c.flops / 1e9:,.1f}", "mosaic" if c.kernel else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"{report.bundle}: {len(report.programs)} programs compiled for {report.target.name} "
             f"({report.topology}, {report.chip.name}) in {sum(c.compile_s for c in report.programs):.1f} s; "
             "bytes per device"]
    for i, r in enumerate(rows):
        lines.append("  " + "  ".join(v.ljust(w) if j == 0 else v.rjust(w) for j, (v, w) in enumerate(zip(r, widths))))
        if i == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    lines.append("")
    for mode, p in report.peaks.items():
        parts = [f"weights {_gib(sum(p.weights.values()))} ({', '.join(p.weights) or 'none'})"]
        if p.held:
            parts.append(f"held {_gib(sum(p.held.values()))} ({', '.join(p.held)})")
        parts += [f"code {_gib(p.code)}", f"working set {_gib(p.working)}"]
        mark = "*" if mode == report.mode else " "
        lines.append(f"{mark} peak, {mode:<8}: {_gib(p.total)} per device during {p.program} ({p.stage}): "
                     + ", ".join(parts))
    verdict = "fits" if report.fits else "does NOT fit"
    lines.append(f"{_gib(report.peak.total)} of {_gib(report.hbm_bytes)} HBM per chip ({report.mode}): {verdict}")
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"
