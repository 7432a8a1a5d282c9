"""Executables compiled ahead: the bytes of each program as XLA compiled it for one kind of host, carried in the
bundle (manifest.Executable), so that a host whose key matches loads them instead of compiling.

Why: a first start compiles every program (a 14B 720p block for v6e-8: minutes), and a new replica in an autoscaling
group is always a first start; the persistent compilation cache helps only a second start on the same host.

What must match (manifest.ExecutableKey, `host_key`): platform, chip, topology, devices and processes, the compiler
(libtpu's or jaxlib's version), jax's version, the XLA options, and on CPU the LLVM CPU and instruction-set features
XLA compiles for. A host reads its own features from a trivial program it compiles (`jit(_host_probe)`, once per
process, milliseconds): exactly what XLA would target here, whatever XLA_FLAGS (--xla_cpu_max_isa) says.

The file is XLA's own serialized executable (what the PJRT client's `serialize_executable` writes), nothing else: no
Python object is pickled or unpickled. jax has no public way to make a runnable `Compiled` from those bytes alone
(its `serialize_executable` module pickles jax's wrapper around them), so `load` lowers the program here (tracing
the Exported's call: no XLA compile) and has jax finish it as a compile would, with the deserialized executable in
place of the compiler's output (`_Ahead`): the shardings and layouts are read back from the executable by jax's own
code. The native code it holds is trusted as the bundle's programs and weights are: its sha256 is in the manifest
and checked before use (runtime/integrity.py, and again as Bundle reads it), and a changed file is refused like any
other bundle file.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import re
import threading
from importlib import metadata
from pathlib import Path
from typing import Any

from . import manifest as mf

log = logging.getLogger("runtime")

FOLDER = "executables"
SUFFIX = ".xla"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"  # how many fake CPU devices: not how code is compiled

def file_of(program: str, part: str) -> str:
    """The bundle path of program `program`'s (or its `part`'s) executable."""
    stem = program.replace("@", "__") + (f"__{part}" if part else "")
    return f"{FOLDER}/{stem}{SUFFIX}"


def xla_flags() -> str:
    """XLA_FLAGS as they shape compiled code: the fake device count dropped, the rest in order."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG + "="))


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "unknown"


def compiler_of(platform: str, device: Any) -> str:
    """The compiler whose output an executable is: libtpu for TPU, jaxlib elsewhere (with the CUDA runtime's version
    for a GPU)."""
    import jax

    if platform == "tpu":
        return f"libtpu {_version('libtpu')}"
    text = f"jaxlib {jax.lib.__version__ if hasattr(jax.lib, '__version__') else _version('jaxlib')}"
    if platform in ("cuda", "gpu", "rocm"):
        try:
            text += f" ({device.client.platform_version})"
        except AttributeError:
            pass
    return text


def cpu_target(payload: bytes) -> tuple[str, str]:
    """(LLVM CPU, feature string) that XLA's CPU compiler wrote into a serialized executable ("", "" if none): its
    target machine options, a protobuf message of the triple (1), the CPU (2) and the features (3)."""
    m = re.search(rb"\n.(?:x86_64|aarch64|arm64|riscv64|powerpc64le|s390x)[-a-z0-9_.]*\x12(.)", payload, re.S)
    if m is None:
        return "", ""
    at = m.end(1)
    cpu = payload[at:at + m.group(1)[0]]
    at += len(cpu)
    if payload[at:at + 1] != b"\x1a":
        return cpu.decode(errors="replace"), ""
    at, length, shift = at + 1, 0, 0
    while True:  # a varint
        byte = payload[at]
        length |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if byte < 0x80:
            break
    return cpu.decode(errors="replace"), payload[at:at + length].decode(errors="replace")


_probe_lock = threading.Lock()


def host_cpu() -> tuple[str, str]:
    """(LLVM CPU, features) XLA compiles for on this host: read from a trivial program compiled here (once)."""
    with _probe_lock:
        return _host_cpu()


@functools.cache
def _host_cpu() -> tuple[str, str]:
    import jax
    import numpy as np
    def _host_probe(x: Any) -> Any:
        return x + 1

    with jax.default_device(jax.devices("cpu")[0]):
        compiled = jax.jit(_host_probe).lower(np.float32(0)).compile()
    return cpu_target(serialize(compiled))


def key_for(mesh: Any, options: dict[str, Any] | None, topology: str = "", payload: bytes | None = None
            ) -> mf.ExecutableKey:
    """The key of a program compiled over `mesh` with XLA `options` (CPU: the target read from its `payload`, or this
    host's when None)."""
    import jax

    devices = list(mesh.devices.flat)
    first = devices[0]
    platform = "cuda" if first.platform == "gpu" else first.platform
    cpu, features = ("", "")
    if platform == "cpu":
        cpu, features = cpu_target(payload) if payload is not None else host_cpu()
    processes = len({d.process_index for d in devices}) if topology else jax.process_count()
    opts = {str(k): str(v) for k, v in sorted((options or {}).items())}
    if flags := xla_flags():
        opts["XLA_FLAGS"] = flags
    return mf.ExecutableKey(platform=platform, chip=str(first.device_kind), topology=topology, devices=len(devices),
                            processes=processes, compiler=compiler_of(platform, first), jax=jax.__version__,
                            options=opts, cpu=cpu, features=features)


def describe(key: mf.ExecutableKey) -> str:
    """A key in one line: "cpu znver5 (x1, jaxlib 0.10.2, jax 0.10.2)", "tpu TPU v6 lite v6e:2x4 (x8, ...)"."""
    where = key.cpu if key.platform == "cpu" else f"{key.chip} {key.topology}".strip()
    extra = f", {key.processes} processes" if key.processes > 1 and key.platform != "tpu" else ""  # TPU: the slice
    return f"{key.platform} {where} (x{key.devices}{extra}, {key.compiler}, jax {key.jax})"


def summary(m: mf.Manifest) -> dict[str, Any]:
    """What `runtime inspect` says of a bundle's executables: count, bytes (each file once), the keys they were built
    for, and each one."""
    files = {e.file: e.bytes for e in m.executables}
    keys = list({mf.canonical_json(mf._encode(e.key)): e.key for e in m.executables}.values())
    return {"count": len(m.executables), "files": len(files), "bytes": sum(files.values()),
            "built_for": [{**mf._encode(k), "describe": describe(k)} for k in keys],
            "programs": [{"program": e.program, "part": e.part, "file": e.file, "bytes": e.bytes, "sha256": e.sha256,
                          "built_for": keys.index(e.key)} for e in m.executables]}


def mismatch(built: mf.ExecutableKey, host: mf.ExecutableKey) -> str | None:
    """Why an executable built for `built` cannot run as this host's own compile would (None: it can)."""
    for name in ("platform", "chip", "devices", "processes", "compiler", "jax", "cpu"):
        if name == "processes" and built.platform == "tpu":
            # one executable for the whole slice, which every host of it loads (as MaxText's train_compile
            # executables): libtpu's compile-only topology splits it into hosts of 4 chips, a v6e-8 VM is one host
            continue
        a, b = getattr(built, name), getattr(host, name)
        if a != b:
            return f"it was built for {name} {a!r}, this host has {b!r}"
    if built.features != host.features:
        want, have = set(built.features.split(",")), set(host.features.split(","))
        diff = sorted((want - have) | {f"({f} here)" for f in have - want})
        return f"it was built for other CPU features ({', '.join(diff[:6])}{', ...' if len(diff) > 6 else ''})"
    if built.options != host.options:
        keys = sorted(k for k in set(built.options) | set(host.options) if built.options.get(k) != host.options.get(k))
        k = keys[0]
        return (f"it was built with XLA option {k}={built.options.get(k)!r}, this host compiles with "
                f"{host.options.get(k)!r}")
    return None


class _Ahead:
    """The one seam through which jax takes an executable it did not compile: `pxla._cached_compilation`, the call
    `UnloadedMeshExecutable.from_hlo` makes for XLA's output. Installed once; it hands over the executable set for the
    calling thread (a context variable), and otherwise compiles as jax does, so other compiles are untouched."""

    pending: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("wan_aot_executable", default=None)
    _lock = threading.Lock()
    _installed = False

    @classmethod
    def install(cls) -> None:
        from jax._src.interpreters import pxla
        from jax._src.lib import xla_client as xc

        with cls._lock:
            if cls._installed:
                return
            compile_here = pxla._cached_compilation

            def cached_compilation(*args: Any, **kwargs: Any) -> Any:
                slot = cls.pending.get()
                if not slot:
                    return compile_here(*args, **kwargs)
                given = [*args, *kwargs.values()]  # the client and the device list, by type (a C++ cache: no names)
                client = next(a for a in given if isinstance(a, xc.Client))
                devices = next(a for a in given if isinstance(a, xc.DeviceList))
                return client.deserialize_executable(slot.pop(), executable_devices=devices)

            cached_compilation.cache_clear = compile_here.cache_clear  # type: ignore[attr-defined]
            pxla._cached_compilation = cached_compilation
            cls._installed = True


def load(payload: bytes, lowered: Any, options: dict[str, Any] | None = None) -> Any:
    """jax's Compiled for `lowered` (the program lowered here for this mesh, as `Bundle.compile` lowers it) from XLA's
    serialized executable `payload`, without compiling; RuntimeError where jax did not take it (then compile)."""
    _Ahead.install()
    slot = [payload]
    token = _Ahead.pending.set(slot)
    try:
        compiled = lowered.compile(options)
    finally:
        _Ahead.pending.reset(token)
    if slot:  # jax finished without asking for XLA's output: this jax has moved its seam
        raise RuntimeError("this jax compiled the program instead of taking the executable")
    return compiled


def serialize(compiled: Any) -> bytes:
    """XLA's bytes of a compiled program (a loaded executable's via its client; a compile-only one's directly)."""
    from jax._src.lib import xla_client as xc

    executable = compiled.runtime_executable()
    if isinstance(executable, xc.LoadedExecutable):
        return bytes(executable.client.serialize_executable(executable))
    return bytes(executable.serialize())


def read(bundle: Path, entry: mf.Executable) -> bytes:
    """An executable's bytes, read from the bundle (checked against its sha256 by the caller's Checker)."""
    return mf.resolve(bundle, entry.file).read_bytes()
