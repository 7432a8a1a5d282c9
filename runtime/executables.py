"""Executables compiled ahead: the bytes of each program as XLA compiled it for one kind of host, carried in the
bundle (manifest.Executable), so that a host whose key matches loads them instead of compiling.

Why: a first start compiles every program (a 14B 720p block for v6e-8: minutes), and a new replica in an autoscaling
group is always a first start; the persistent compilation cache helps only a second start on the same host.

What must match (manifest.ExecutableKey, `host_key`): platform, chip, topology, devices and processes, the compiler
(libtpu's or jaxlib's version), jax's version, the XLA options, and on CPU the LLVM CPU and instruction-set features
XLA compiles for. A host reads its own features from a trivial program it compiles (`jit(_host_probe)`, once per
process, milliseconds): exactly what XLA would target here, whatever XLA_FLAGS (--xla_cpu_max_isa) says.

The file is jax's `serialize_executable` payload: a pickle of jax's executable wrapper around XLA's bytes. It is read
by `load`'s unpickler, which admits only the jax and numpy classes such a payload names (ALLOWED), so no other Python
runs; the native code it holds is trusted as the bundle's programs and weights are: its sha256 is in the manifest and
checked before use (runtime/integrity.py, and again as Bundle reads it), and a changed file is refused like any other
bundle file.
"""

from __future__ import annotations

import functools
import io
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

# (module, name) a serialized executable's payload may name: jax's executable wrapper, its shardings, meshes, avals
# and layouts, numpy's arrays and dtypes (device assignments), ml_dtypes' dtypes. Anything else is refused.
ALLOWED = {
    ("jax", "P"), ("jax.sharding", "PartitionSpec"), ("jax._src.partition_spec", "PartitionSpec"),
    ("jax._src.interpreters.pxla", "UnloadedMeshExecutable"), ("jax._src.interpreters.pxla", "AllArgsInfo"),
    ("jax._src.stages", "ArgInfo"), ("jax._src.linear_util", "DebugInfo"), ("jax._src.core", "ShapedArray"),
    ("jax._src.core", "ManualAxisType"), ("jax._src.core", "MemorySpace"), ("jax._src.layout", "Layout"),
    ("jax._src.layout", "AutoLayoutSingleton"), ("jax._src.layout", "Format"),
    ("jax._src.mesh", "AbstractDevice"), ("jax._src.mesh", "AbstractMesh"), ("jax._src.mesh", "AxisType"),
    ("jax._src.mesh", "Mesh"), ("jax._src.named_sharding", "_unpickle_named_sharding"),
    ("jax._src.sharding_impls", "_unpickle_gspmd_sharding"), ("jax._src.sharding_impls", "GSPMDSharding"),
    ("jax._src.sharding_impls", "SingleDeviceSharding"), ("jax._src.sharding_impls", "UnspecifiedValue"),
    ("jaxlib._jax", "DeviceList"), ("jaxlib._jax", "HloSharding"),
    ("numpy", "dtype"), ("numpy", "ndarray"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "scalar"),
    *{("ml_dtypes", n) for n in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "int4", "uint4")},
}


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
    from jax.experimental import serialize_executable

    def _host_probe(x: Any) -> Any:
        return x + 1

    with jax.default_device(jax.devices("cpu")[0]):
        compiled = jax.jit(_host_probe).lower(np.float32(0)).compile()
    payload, _, _ = serialize_executable.serialize(compiled)
    return cpu_target(payload)


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


def load(payload: bytes, in_tree: Any, out_tree: Any, devices: list[Any]) -> Any:
    """jax's Compiled from a serialized executable, for these execution devices, with the program's own trees;
    ValueError for a payload that names anything outside ALLOWED."""
    import jax
    from jax.experimental import serialize_executable as se

    class Restricted(se._JaxPjrtUnpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) not in ALLOWED:
                raise ValueError(f"the executable names {module}.{name}, which is not part of a jax executable")
            return super().find_class(module, name)

    client = devices[0].client
    unloaded, args_info_flat, no_kwargs = Restricted(io.BytesIO(payload), client, devices).load()
    args_info = in_tree.unflatten(args_info_flat)
    return jax.stages.Compiled(unloaded.load(), [], args_info, out_tree, no_kwargs=no_kwargs)


def serialize(compiled: Any) -> bytes:
    """The executable's bytes (jax's serialize_executable payload; its trees are the program's own)."""
    from jax.experimental import serialize_executable

    payload, _, _ = serialize_executable.serialize(compiled)
    return payload


def read(bundle: Path, entry: mf.Executable) -> bytes:
    """An executable's bytes, read from the bundle (checked against its sha256 by the caller's Checker)."""
    return mf.resolve(bundle, entry.file).read_bytes()
