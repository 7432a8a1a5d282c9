"""Opening a bundle: check it, rebuild the mesh, deserialize programs, place weights per device."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import compat
from . import manifest as mf
from .distributed import put
from .errors import BundleError

log = logging.getLogger("runtime")


def make_mesh(target: mf.Target, devices: list[Any] | None = None) -> Mesh:
    """The target's mesh over the available devices; refuses a device count or platform mismatch."""
    devices = list(jax.devices() if devices is None else devices)
    platform = devices[0].platform if devices else "none"
    want = target.platform
    if platform != want and not (want == "cuda" and platform == "gpu"):
        raise BundleError(f"bundle was exported for platform {want!r} (target {target.name}) but this machine "
                          f"runs {platform!r}: export a bundle with --target for this platform")
    if len(devices) != target.num_devices:
        n = target.num_devices
        hint = f"; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n} makes {n}" if platform == "cpu" else ""
        raise BundleError(f"bundle was exported for {n} device(s) (target {target.name}) but {len(devices)} are "
                          f"available: run it where {n} are, or re-export{hint}")
    sizes = tuple(target.mesh.values())
    if platform == "tpu":  # order devices along the physical torus (the seeds measured ~4% from this)
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(sizes, devices, allow_split_physical_axes=True)
    else:
        grid = np.array(devices).reshape(sizes)
    return Mesh(grid, tuple(target.mesh))


@dataclass
class Bundle:
    path: Path
    manifest: mf.Manifest
    mesh: Mesh
    _programs: dict[str, Any] = field(default_factory=dict)
    _calls: dict[str, Callable[..., Any]] = field(default_factory=dict)
    _weights: dict[str, dict[str, jax.Array]] = field(default_factory=dict)
    _layouts: dict[str, dict[str, tuple[Any, tuple[int, ...], np.dtype]]] = field(default_factory=dict)
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def program(self, name: str) -> Any:
        if name not in self._programs:
            spec = self.manifest.programs.get(name)
            if spec is None:
                raise BundleError(f"bundle has no program {name!r}: re-export it")
            self._programs[name] = load_program(self.path, self.manifest, name)
        return self._programs[name]

    def call(self, name: str) -> Callable[..., Any]:
        """The program as a jitted callable: fn(*inputs) with the program's weights bound.

        Host (numpy) inputs are placed with the program's input shardings, each process
        placing its own shards, so the same call works on one host or many.
        """
        if name not in self._calls:
            exp = self.program(name)
            weights = self.weights(self.manifest.programs[name].weights, name)
            shardings = self.input_shardings(name)
            # Compiled ahead of time, here: the first call runs at once (a server is ready only after this).
            (_, *avals), _ = jax.tree.unflatten(exp.in_tree, exp.in_avals)
            inputs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(avals, shardings)]
            compiled = jax.jit(exp.call).lower(weights, *inputs).compile()

            def place(a: Any, s: Any) -> jax.Array:
                a = put(a, s)
                return a if a.sharding.is_equivalent_to(s, a.ndim) else jax.device_put(a, s)

            def run(*args: Any) -> Any:
                return compiled(weights, *[place(a, s) for a, s in zip(args, shardings)])

            self._calls[name] = run
        return self._calls[name]

    def input_shardings(self, name: str) -> list[Any]:
        """Shardings of the program's non-weight inputs, in order."""
        exp = self.program(name)
        (w, *rest), _ = jax.tree.unflatten(exp.in_tree, exp.in_shardings_jax(self.mesh))
        return [s or NamedSharding(self.mesh, PartitionSpec()) for s in rest]

    def weights(self, group: str, program: str) -> dict[str, jax.Array]:
        layout = self.weight_layout(group, program)
        with self._lock:
            if group not in self._weights:
                wf = self.manifest.weights[group]
                if wf.file is None:
                    raise BundleError(no_weights_message(self.path))
                shardings = {k: s for k, (s, _, _) in layout.items()}
                expected = {k: (shape, dtype) for k, (_, shape, dtype) in layout.items()}
                self._weights[group] = load_sharded(mf.resolve(self.path, wf.file), shardings, expected, wf.file)
            return self._weights[group]

    def weight_layout(self, group: str, program: str) -> dict[str, tuple[Any, tuple[int, ...], np.dtype]]:
        """(sharding, shape, dtype) of each tensor of a weight group, as `program` (the first to use it) takes it."""
        with self._lock:
            if group not in self._layouts:
                wf = self.manifest.weights.get(group)
                if wf is None:
                    raise BundleError(f"bundle lists no weights {group!r}: re-export it")
                exp = self.program(program)
                (w_shardings, *_), _ = jax.tree.unflatten(exp.in_tree, exp.in_shardings_jax(self.mesh))
                (w_avals, *_), _ = jax.tree.unflatten(exp.in_tree, exp.in_avals)
                # None: the program does not use this tensor (e.g. the first VAE chunk skips the temporal
                # upsampler); place it as the manifest says, as the group's other programs expect it.
                self._layouts[group] = {
                    name: (w_shardings[name] or NamedSharding(self.mesh, partition_spec(wf.partition.get(name, []))),
                           tuple(a.shape), np.dtype(a.dtype))
                    for name, a in w_avals.items()}
            return self._layouts[group]

    def compile(self, name: str) -> Any:
        """Compile a program for this mesh without weights or inputs (fills the persistent compilation cache);
        returns the jax Compiled object (its HLO and cost analysis are what tools/roofline.py reads)."""
        exp = self.program(name)
        layout = self.weight_layout(self.manifest.programs[name].weights, name)
        weights = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=s) for k, (s, shape, dtype) in layout.items()}
        (_, *avals), _ = jax.tree.unflatten(exp.in_tree, exp.in_avals)
        inputs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(avals, self.input_shardings(name))]
        return jax.jit(exp.call).lower(weights, *inputs).compile()


def load_sharded(path: Path, shardings: dict[str, Any], expected: dict[str, tuple[tuple[int, ...], np.dtype]],
                 label: str) -> dict[str, jax.Array]:
    """Global arrays for the tensors of a safetensors file, each device's shard read straight from the file.

    Only this process's addressable shards are read, one tensor at a time, so the host
    memory a load needs beyond the placed arrays is about one shard.
    """
    from safetensors import safe_open

    out: dict[str, jax.Array] = {}
    with safe_open(str(path), framework="numpy") as f:
        present = set(f.keys())
        for name, (want_shape, want_dtype) in expected.items():
            problem = tensor_mismatch(f, present, name, want_shape, want_dtype, label, "the program expects")
            if problem:
                raise BundleError(problem)
            out[name] = _place(f.get_slice(name), want_shape, shardings[name])
    return out


def tensor_mismatch(f: Any, present: set[str], name: str, want_shape: tuple[int, ...], want_dtype: np.dtype,
                    label: str, who: str) -> str | None:
    """Why tensor `name` of the open safetensors file `f` is not what `who` wants (headers only), or None."""
    if name not in present:
        return f"weights file {label} has no tensor {name!r}: re-export the bundle"
    sl = f.get_slice(name)
    shape, dtype = tuple(sl.get_shape()), safetensors_dtype(sl.get_dtype())
    if shape != tuple(want_shape) or dtype != want_dtype:
        return (f"tensor {name!r} in {label} is {dtype.name}{list(shape)}, {who} {np.dtype(want_dtype).name}"
                f"{list(want_shape)}: re-export the bundle")
    return None


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I32": np.int32,
              "I64": np.int64, "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "F64": np.float64}


def safetensors_dtype(st: str) -> np.dtype:
    return np.dtype(_ST_DTYPES.get(st, np.void))


def partition_spec(data: list[Any]) -> PartitionSpec:
    """A manifest partition entry (None, an axis, or a list of axes per dimension) as a PartitionSpec."""
    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in data])


def _place(sl: Any, shape: tuple[int, ...], sharding: Any) -> jax.Array:
    """Build a global array whose every addressable shard is read straight from the file slice."""
    cache: dict[tuple, np.ndarray] = {}

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in cache:
            full = tuple(slice(0 if s.start is None else s.start, dim if s.stop is None else s.stop)
                         for s, dim in zip(index, shape))
            cache[key] = np.asarray(sl[full]).reshape(tuple(s.stop - s.start for s in full))
        return cache[key]

    return jax.make_array_from_callback(shape, sharding, shard)


def load_program(path: Path, manifest: mf.Manifest, name: str) -> Any:
    """Deserialize one of the bundle's programs; refuses what this jax cannot run."""
    spec = manifest.programs[name]
    blob = mf.resolve(path, spec.file).read_bytes()
    exported_jax = manifest.versions.get("jax")
    try:
        exp = jax.export.deserialize(bytearray(blob))
    except Exception as e:  # noqa: BLE001  (any failure here means an unusable file)
        raise BundleError(f"cannot deserialize {spec.file} ({type(e).__name__}: {e}); it was exported with jax "
                          f"{exported_jax}: re-export with this jax ({jax.__version__})") from None
    compat.check_program(name, exp, exported_jax)
    return exp


def no_weights_message(path: Path) -> str:
    return (f"bundle {path} has no weights attached (exported with --no-weights): run `python -m export "
            f"--attach-weights {path} --weights CHECKPOINT` first")


def open_bundle(path: str | Path, verify: bool = True) -> Bundle:
    """Read and check `path`; programs and weights load lazily on first use."""
    path = Path(path)
    manifest = mf.read(path)
    for warning in compat.check_versions(manifest.versions):
        log.warning("%s", warning)
    if not manifest.has_weights:
        raise BundleError(no_weights_message(path))
    if verify:
        mf.verify_files(path, manifest)
    mesh = make_mesh(manifest.target)
    return Bundle(path=path, manifest=manifest, mesh=mesh)
