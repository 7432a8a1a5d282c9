"""`python -m runtime verify`: everything that can be checked about a bundle before it runs.

Schema and manifest integrity, every file's sha256, the weight files' tensors against the
manifest, the programs against this jax, and the devices this machine has against the target.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jax

from . import compat
from . import manifest as mf
from .errors import BundleError

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True)
class Check:
    status: str  # OK, WARN or FAIL
    message: str


def verify(path: Path) -> list[Check]:
    """Run every check; stops early only when the manifest itself cannot be read."""
    checks: list[Check] = []
    try:
        m = mf.read(path)
    except BundleError as e:
        return [Check(FAIL, str(e))]
    raw_version = json.loads((path / mf.MANIFEST_FILE).read_text())["schema_version"]
    migrated = f", read through the migration from {raw_version}" if raw_version != mf.SCHEMA_VERSION else ""
    checks.append(Check(OK, f"manifest: schema {raw_version} (this runtime reads {mf.SCHEMA_VERSION}{migrated}), "
                            f"bundle id {m.bundle_id} matches its content"))
    checks += _check_shapes(m)
    if not m.has_weights:
        from .bundle import no_weights_message

        checks.append(Check(FAIL, no_weights_message(path)))

    files_ok = True
    total = 0
    for ref in m.files():
        try:
            total += mf.check_file(path, ref).stat().st_size
        except BundleError as e:
            files_ok = False
            checks.append(Check(FAIL, str(e)))
    if files_ok:
        checks.append(Check(OK, f"files: {len(m.files())} match their sha256 ({total / 1e6:.1f} MB)"))
        checks += _check_tensors(path, m)
        checks += _check_programs(path, m)

    try:
        warnings = compat.check_versions(m.versions)
        checks += [Check(WARN, w) for w in warnings]
        if not warnings:
            checks.append(Check(OK, f"versions: exported with jax {m.versions['jax']}, jaxlib "
                                    f"{m.versions.get('jaxlib')}, as installed"))
    except BundleError as e:
        checks.append(Check(FAIL, str(e)))

    if m.target.platform == "tpu":
        from .fit import describe_record, read_record

        record = read_record(path, m)
        if record is None:
            checks.append(Check(WARN, "tpu: never compiled for TPU here: `python -m runtime fit BUNDLE --record` "
                                      "compiles every program for the slice with libtpu (no TPU needed)"))
        else:
            checks.append(Check(OK if record.get("fits") else WARN, f"tpu: {describe_record(record)}"))
    try:
        from .bundle import make_mesh

        mesh = make_mesh(m.target)
        checks.append(Check(OK, f"devices: {mesh.devices.size} x {jax.devices()[0].platform} "
                                f"({jax.devices()[0].device_kind}) for target {m.target.name}"))
        if m.target.device_kind and m.target.device_kind != jax.devices()[0].device_kind:
            checks.append(Check(WARN, f"programs were tuned for {m.target.device_kind!r}, this machine has "
                                      f"{jax.devices()[0].device_kind!r}"))
    except BundleError as e:
        checks.append(Check(FAIL, str(e)))
        mesh = None
    checks += _check_executables(m, mesh, files_ok)
    return checks


def _check_executables(m: mf.Manifest, mesh: object, files_ok: bool) -> list[Check]:
    """The executables compiled ahead: their files (checked with every file above) and whether this host's key is
    theirs, i.e. whether a run here loads them or compiles (runtime/executables.py)."""
    from . import executables as ex

    if not m.executables:
        return []
    info = ex.summary(m)
    what = (f"executables: {info['count']} compiled ahead ({info['files']} files, {info['bytes'] / 1e6:.1f} MB) for "
            + "; ".join(dict.fromkeys(k["describe"] for k in info["built_for"])))
    if not files_ok:
        return [Check(FAIL, what + ": not all match their sha256 (above): a run refuses the bundle")]
    if mesh is None:
        return [Check(WARN, what + ": this machine cannot run the target (above)")]
    from .bundle import Bundle

    bundle = Bundle(path=Path("."), manifest=m, mesh=mesh)
    reasons = {ex.mismatch(e.key, ex.key_for(mesh, bundle.compiler_options(e.program), e.key.topology))
               for e in m.executables}
    reasons.discard(None)
    if reasons:
        return [Check(WARN, what + f": not loaded here ({sorted(reasons)[0]}); a run compiles its programs")]
    return [Check(OK, what + ": this host matches, a run loads them instead of compiling")]


def _check_shapes(m: mf.Manifest) -> list[Check]:
    """Every shape has each of the programs a run of it calls (kinds.shape_scope)."""
    from . import kinds

    missing = []
    for g in m.shapes:
        for program in {kinds.base_program(n) for n in m.programs if kinds.shape_scope(n)}:
            name = m.program_for(program, g)
            if name not in m.programs and not (program.endswith("_next") and g.latent_frames == 1):
                missing.append(f"{name} ({g.size} x {g.frames} frames)")
    if missing:
        return [Check(FAIL, f"shapes: the manifest lists no program {missing[0]}: re-export the bundle")]
    return [Check(OK, f"shapes: {len(m.shapes)} ({m.shapes_text()}), each with its programs")]


def _check_tensors(path: Path, m: mf.Manifest) -> list[Check]:
    """Each weight file holds exactly the manifest's tensors, with their shapes and dtypes (headers only)."""
    import numpy as np
    from safetensors import safe_open

    from .bundle import tensor_mismatch

    out: list[Check] = []
    count = files = 0
    for wf in m.weights.values():
        if wf.file is None:
            continue
        files += 1
        with safe_open(str(mf.resolve(path, wf.file)), framework="numpy") as f:
            present = set(f.keys())
            for name, spec in wf.tensors.items():
                problem = tensor_mismatch(f, present, name, spec.shape, np.dtype(spec.dtype), wf.file,
                                          "the manifest says")
                if problem:
                    out.append(Check(FAIL, problem))
            count += len(wf.tensors)
    if not out and files:
        out.append(Check(OK, f"weights: {count} tensors in {files} files, names, shapes and dtypes "
                             "as the manifest lists"))
    return out


def _check_programs(path: Path, m: mf.Manifest) -> list[Check]:
    from .bundle import load_program

    out: list[Check] = []
    conventions = set()
    parts = [(name, part) for name, spec in m.programs.items() for part in spec.parts]
    for name, part in parts:
        try:
            exp = load_program(path, m, name, part)
        except BundleError as e:
            out.append(Check(FAIL, str(e)))
            continue
        conventions.add(exp.calling_convention_version)
        want = "cuda" if m.target.platform == "cuda" else m.target.platform
        if want not in exp.platforms:
            what = f"{name} ({part})" if part else name
            out.append(Check(FAIL, f"program {what} was exported for {exp.platforms}, the manifest says {want}: "
                                   "re-export the bundle"))
    if not out:
        lo = jax.export.minimum_supported_calling_convention_version
        hi = jax.export.maximum_supported_calling_convention_version
        out.append(Check(OK, f"programs: {len(m.programs)} deserialize, calling convention "
                             f"{', '.join(map(str, sorted(conventions)))} (this jax runs {lo}..{hi})"))
    return out
