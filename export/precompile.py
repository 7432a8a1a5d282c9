"""`python -m export precompile BUNDLE` (and the build's `--precompile`): compile every program of a bundle for its
target and write the executables into it (runtime/executables.py says what they are and when a host loads them).

Where each target is compiled: a `cpu` bundle on this machine (its executables then run on hosts whose CPU features
are this one's); a TPU bundle with libtpu's compile-only devices for the target's topology (runtime/fit.py, no TPU
needed); a `cuda` bundle only on a machine with the GPUs, since XLA's GPU compiler compiles for the devices it sees.
The executables do not depend on the weights (they are inputs), so a --no-weights bundle can be precompiled and
weights attached later, quantized or not, and a LoRA merged per request, all run on them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from runtime import executables as ex
from runtime import manifest as mf
from runtime.errors import UserError

log = logging.getLogger("export")


def _mesh(target: mf.Target) -> tuple[Any, str]:
    """The mesh to compile over (and the TPU topology's name, "" elsewhere); one line where this machine cannot."""
    import jax

    from runtime.bundle import make_mesh
    from runtime.errors import BundleError

    if target.platform == "tpu":
        from runtime import fit

        return fit.compile_only_mesh(target)
    if target.platform == "cuda":
        try:
            gpus = jax.devices("cuda")
        except RuntimeError:
            gpus = []
        if not gpus:
            raise UserError(f"precompiling a cuda bundle (target {target.name}) needs its {target.num_devices} GPU(s) "
                            "on this machine (XLA's GPU compiler compiles for the devices it sees): run "
                            "`python -m export precompile BUNDLE` where they are")
        devices: list[Any] = gpus
    else:
        devices = jax.devices("cpu")
    try:
        return make_mesh(target, devices[:target.num_devices] if len(devices) > target.num_devices else devices), ""
    except BundleError as e:
        raise UserError(str(e)) from None


def precompile(path: Path) -> mf.Manifest:
    """Compile every program (every shape, expert and block-loop part) of the bundle at `path` for its target and
    write the executables and the new manifest into it (replacing any executables it held); returns the manifest."""
    from runtime import kinds, signatures
    from runtime.bundle import Bundle
    from runtime.files import atomic_path
    from runtime.fit import RECORD, read_record
    from runtime.integrity import Checker

    m = mf.read(path)
    Checker(path, m).check([ref for p in m.programs.values() for ref in p.files()])  # programs as exported
    mesh, topology = _mesh(m.target)
    bundle = Bundle(path=path, manifest=m, mesh=mesh)
    kind = kinds.get(m.kind)
    staging = path / f".{ex.FOLDER}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    entries: list[mf.Executable] = []
    done: dict[tuple[str, ...], mf.Executable] = {}  # the same program file, donation and options: one executable
    t_all = time.perf_counter()
    try:
        for name, spec in m.programs.items():
            for part in spec.parts:
                ref = spec.blocks.file(part) if part else mf.FileRef(spec.file, spec.sha256)
                donate = () if part else signatures.donated(name, kind, spec)
                options = bundle.compiler_options(name)
                same = (ref.sha256, part, repr(donate), repr(sorted((options or {}).items())))
                if same in done:
                    entries.append(dataclasses.replace(done[same], program=name, part=part))
                    continue
                t0 = time.perf_counter()
                payload = ex.serialize(bundle.compile(name, part))
                seconds = time.perf_counter() - t0
                rel = ex.file_of(name, part)
                (staging / Path(rel).name).write_bytes(payload)
                entry = mf.Executable(program=name, part=part, file=rel, sha256=hashlib.sha256(payload).hexdigest(),
                                      bytes=len(payload), key=ex.key_for(mesh, options, topology, payload))
                done[same] = entry
                entries.append(entry)
                log.info("compiled %s%s in %.1f s: %s (%.1f MB)", name, f" ({part})" if part else "", seconds, rel,
                         len(payload) / 1e6)
        new = dataclasses.replace(m, executables=tuple(entries)).with_id()
        record = read_record(path, m) if m.target.platform == "tpu" else None
        old = path / ex.FOLDER
        trash = path / f".{ex.FOLDER}.old-{os.getpid()}"
        if old.exists():
            old.rename(trash)
        staging.rename(old)
        with atomic_path(path / mf.MANIFEST_FILE) as tmp:
            tmp.write_text(mf.canonical_json(new.to_json()))
        shutil.rmtree(trash, ignore_errors=True)
        if record is not None:  # the fit of these programs holds for the new id (executables change no program)
            import json

            with atomic_path(path / RECORD) as tmp:
                tmp.write_text(json.dumps({**record, "bundle_id": new.bundle_id}, indent=1) + "\n")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    total = sum(e.bytes for e in {e.file: e for e in entries}.values())
    log.info("precompiled %d programs for %s (%s) in %.1f s: %.1f MB of executables", len(done), m.target.name,
             ex.describe(entries[0].key) if entries else "-", time.perf_counter() - t_all, total / 1e6)
    return new
