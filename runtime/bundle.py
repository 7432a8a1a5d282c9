"""Opening a bundle: check it, rebuild the mesh, deserialize programs, place weights per device."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import adapters, compat, host_memory, kinds, lora, signatures
from . import manifest as mf
from . import weights as wio
from .distributed import put
from .errors import BundleError
from .integrity import Checker
from .weights import safetensors_dtype

log = logging.getLogger("runtime")

# XLA options for programs compiled on CPU, by weight group. XLA's CPU backend hands dots,
# convolutions and reductions to YNNPACK fusions by default. For the VAE's 3x3 convolutions those
# ran 4-6x slower than XLA's own Eigen convolution (which is as fast as torch's oneDNN), and the
# whole decode 2.9x slower; for the DiT's matmuls YNNPACK is the faster one (a 1.3B step 8.4 s
# against 12.7 s without it). Measured on the real 1.3B DiT and VAE (docs/why.md).
# The DiT's programs are scheduled for memory: XLA's default CPU schedule, which orders for concurrency,
# keeps the blocks' FFN activations alive together (a 1.3B step at 128x128: 550 MB of temporaries
# against 45 MB, the same step time within noise), which made the step the run's peak host memory.
# The VAE keeps the default: its decode holds 231 MB of temporaries so, 834 MB scheduled for memory.
CPU_COMPILER_OPTIONS = {
    "vae": {"xla_cpu_experimental_ynn_fusion_type": ""},
    **{dit: {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"} for dit in kinds.DIT_GROUPS},
}


def make_mesh(target: mf.Target, devices: list[Any] | None = None, any_platform: bool = False) -> Mesh:
    """The target's mesh over the available devices; refuses a device count or (unless `any_platform`)
    platform mismatch."""
    devices = list(jax.devices() if devices is None else devices)
    platform = devices[0].platform if devices else "none"
    want = target.platform
    if platform != want and not (want == "cuda" and platform == "gpu") and not any_platform:
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
    checker: Checker | None = None  # None: opened with verify=False
    _calls: dict[str, Future] = field(default_factory=dict)
    _programs: dict[str, Future] = field(default_factory=dict)
    _parts: dict[str, Future] = field(default_factory=dict)  # compiled block loop parts, by "<program>:<part>"
    _part_of: dict[tuple[Any, ...], str] = field(default_factory=dict)  # (program, shared shapes) -> block part
    _weights: dict[str, Future] = field(default_factory=dict)
    _layouts: dict[str, Future] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _pool: ThreadPoolExecutor | None = None
    _queued: dict[str, Future] = field(default_factory=dict)  # prefetch's task per program
    timings: dict[str, float] = field(default_factory=dict)  # seconds per "weights <group>" / "compile <program>"
    loras: dict[str, dict[str, list[Any]]] = field(default_factory=dict)  # group -> tensor -> runtime/lora.py Updates
    lora_key: Any = ()  # what identifies the LoRA set `loras` holds (runtime/adapters.py key; () for none)
    # LoRA switching (set_loras): each loaded group's weight file, mapped (its unmodified tensors), the set merged into
    # its placed weights (key, updates), and a count of switches that block loops re-read their blocks' tensors at.
    _sources: dict[str, wio.Source] = field(default_factory=dict)
    _applied: dict[str, tuple[Any, dict[str, list[Any]]]] = field(default_factory=dict)
    _versions: dict[str, int] = field(default_factory=dict)
    _switch_lock: threading.RLock = field(default_factory=threading.RLock)
    _ahead_said: set[str] = field(default_factory=set)  # why executables compiled ahead were not loaded (logged once)

    def _once(self, table: dict[str, Future], key: str, make: Callable[[], Any]) -> Any:
        """make() for `key`, computed once even when several threads ask at the same time (a failure is
        remembered and raised to every caller)."""
        with self._lock:
            fut = table.get(key)
            owner = fut is None
            if owner:
                fut = table[key] = Future()
        if owner:
            try:
                fut.set_result(make())
            except BaseException as e:  # noqa: BLE001  (handed to every waiter)
                fut.set_exception(e)
        return fut.result()

    def program(self, name: str, part: str = "") -> Any:
        """The deserialized program `name`; with `part` ("block", "tail" or "block_t<T>"), that part of its block
        loop (manifest.BlockLoop; the program's own file is the head)."""
        if name not in self.manifest.programs:
            raise BundleError(f"bundle has no program {name!r}: re-export it")
        key = f"{name}:{part}" if part else name
        return self._once(self._programs, key, lambda: self._timed(f"deserialize {key}", load_program, self.path,
                                                                   self.manifest, name, part))

    def _timed(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        t = time.perf_counter()
        out = fn(*args)
        self.timings[what] = time.perf_counter() - t
        log.debug("%s: %.2f s", what, self.timings[what])
        return out

    def call(self, name: str) -> Callable[..., Any]:
        """The program as a compiled callable: fn(*inputs) with the program's weights bound.

        Host (numpy) inputs are placed with the program's input shardings, each process
        placing its own shards, so the same call works on one host or many.
        """
        return self._once(self._calls, name, lambda: self._make_call(name))

    def _make_call(self, name: str) -> Callable[..., Any]:
        group = self.manifest.programs[name].weights
        # Compiled ahead of time, here (the first call runs at once; a server is ready only after this), from the
        # weights' shapes and shardings alone, while the weights are read and placed beside it: on a first start
        # XLA's compile and the read from disk each take seconds. One process: multi-host jobs keep one order.
        # A block loop's block programs compile on first use (`compiled_part`): a run needs the one for its prompt.
        loop = self.manifest.programs[name].blocks
        with ThreadPoolExecutor(1, thread_name_prefix="wan-aot-weights") as loader:
            loading = loader.submit(self.weights, group, name) if jax.process_count() == 1 else None
            compiled = self.executable(name)
            if loop is not None:
                tail = self.compiled_part(name, "tail")
            weights = loading.result() if loading is not None else self.weights(group, name)
        shardings = self.call_shardings(name)

        def place(a: Any, s: Any) -> jax.Array:
            a = put(a, s)
            return a if a.sharding.is_equivalent_to(s, a.ndim) else jax.device_put(a, s)

        if loop is not None:
            per_block, shared = self._block_loop(name, weights)
            layers = [put(np.int32(i), self.input_shardings(name, "block")[-1]) for i in range(loop.layers)]
            seen = [self._versions.get(group, 0)]

        def run(*args: Any) -> Any:
            nonlocal per_block
            placed = [place(a, s) for a, s in zip(args, shardings, strict=True)]
            if loop is None:
                return compiled(weights, *placed)
            if seen[0] != self._versions.get(group, 0):  # a LoRA switch replaced some of the blocks' tensors
                seen[0] = self._versions.get(group, 0)
                per_block, _ = self._block_loop(name, weights)
            block = self.compiled_part(name, self.block_part(name, [placed[j] for j in shared]))
            return run_block_loop(compiled, block, tail, weights, per_block, layers, placed, shared,
                                  loop.head_takes_shared)

        return run

    def compiled_part(self, name: str, part: str) -> Any:
        """Part `part` of program `name`'s block loop, compiled (once)."""
        key = f"{name}:{part}"
        return self._once(self._parts, key, lambda: self.executable(name, part))

    def block_part(self, name: str, shared: list[Any]) -> str:
        """The part of block loop `name` whose block program takes `shared` inputs of these shapes: "block", or the
        "block_t<T>" of a short prompt's keys and values (manifest.BlockLoop.short_blocks)."""
        shapes = tuple(tuple(a.shape) for a in shared)
        key = (name, shapes)
        if key not in self._part_of:
            for part in self.manifest.programs[name].parts:
                if part not in ("", "tail"):
                    exp = self.program(name, part)
                    (_, *avals), _ = jax.tree.unflatten(exp.in_tree, exp.in_avals)
                    if tuple(tuple(a.shape) for a in avals[-1 - len(shapes):-1]) == shapes:
                        self._part_of[key] = part
                        break
            else:
                raise BundleError(f"program {name!r} has no block program for inputs of shapes {list(shapes)}: "
                                  "compute the keys and values with this bundle's cross_kv programs")
        return self._part_of[key]

    def prefetch(self, names: list[str]) -> None:
        """Start loading, placing and compiling these programs in the background, in order, so that reading
        and hashing the next stage's weights overlaps this one's work; `call` waits for what it needs.
        Single-process only (a multi-host job keeps every process's work in one order)."""
        if jax.process_count() != 1:
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(min(2, os.cpu_count() or 1), thread_name_prefix="wan-aot-load")
            pool = self._pool
        for name in names:
            if name in self.manifest.programs:
                self._queued[name] = pool.submit(self._quiet_call, name)

    def cancel_prefetch(self) -> None:
        """Drop the background loads not started yet (after a failure, so the process can exit soon)."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._queued.clear()  # shutdown cancels what has not started
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _quiet_call(self, name: str) -> None:
        self._quiet(self.call, name)

    @staticmethod
    def _quiet(fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except BaseException:  # noqa: BLE001  (remembered; raised where the program is used)
            pass

    def unload(self, groups: Iterable[str]) -> None:
        """Drop these weight groups and the compiled calls that bind them: their memory goes back (the mapped
        weight files unmapped, placed copies freed) once no array of theirs is held elsewhere. A later `call`
        of such a program loads and compiles it again (from the stamp and the compilation cache when warm)."""
        groups = set(groups)
        with self._lock, self._switch_lock:
            for group in groups:
                self._weights.pop(group, None)
                self._sources.pop(group, None)
                self._applied.pop(group, None)
            for name, spec in self.manifest.programs.items():
                if spec.weights in groups:
                    self._calls.pop(name, None)
                    if (task := self._queued.pop(name, None)) is not None:
                        task.cancel()  # still queued: loading it later would undo this (no-op once started)

    def prefetch_part(self, name: str, part: str) -> None:
        """Compile part `part` of block loop `name` in the background (`prefetch`'s pool), e.g. the block program
        of a prompt's length while the prompt is encoded."""
        if jax.process_count() != 1 or name not in self.manifest.programs:
            return
        with self._lock:
            pool = self._pool
        if pool is not None:
            self._queued[f"{name}:{part}"] = pool.submit(self._quiet, self.compiled_part, name, part)

    def call_shardings(self, name: str) -> list[Any]:
        """Shardings of program `name`'s inputs as `call` takes them (a block loop's: its head's, and its blocks'
        for the shared inputs)."""
        shardings = self.input_shardings(name)
        loop = self.manifest.programs[name].blocks
        if loop is not None and not loop.head_takes_shared:
            *block_in, _ = self.input_shardings(name, "block")
            _, shared = self._block_loop(name, None)
            for j, sh in zip(shared, block_in[len(block_in) - len(shared):]):
                shardings.insert(j, sh)
        return shardings

    def input_shardings(self, name: str, part: str = "") -> list[Any]:
        """Shardings of the program's (or its `part`'s) non-weight inputs, in order."""
        exp = self.program(name, part)
        (w, *rest), _ = jax.tree.unflatten(exp.in_tree, exp.in_shardings_jax(self.mesh))
        return [s or NamedSharding(self.mesh, PartitionSpec()) for s in rest]

    def weights(self, group: str, program: str) -> dict[str, jax.Array]:
        layout = self.weight_layout(group, program)
        return self._once(self._weights, group, lambda: self._load_weights(group, layout))

    def _load_weights(self, group: str, layout: dict[str, tuple[Any, tuple[int, ...], np.dtype]]
                      ) -> dict[str, jax.Array]:
        wf = self.manifest.weights[group]
        if wf.file is None:
            raise BundleError(no_weights_message(self.path))
        ref = mf.FileRef(wf.file, wf.sha256)
        path = mf.resolve(self.path, wf.file)
        if not path.is_file():
            raise BundleError(f"bundle file {wf.file} is missing: re-copy or re-export the bundle")
        shardings = {k: s for k, (s, _, _) in layout.items()}
        expected = {k: (shape, dtype) for k, (_, shape, dtype) in layout.items()}

        def check(name: str, entry: wio.Entry | None) -> str | None:
            return entry_mismatch(entry, name, *expected[name], wf.file, "the program expects")

        source = wio.Source(shardings)
        arrays = self._timed(f"weights {group}", wio.load_file, path, ref, self.checker, shardings, expected, check,
                             source)
        with self._switch_lock:  # the set to merge is the one asked for last (set_loras may run meanwhile)
            self._sources[group] = source
            wanted = self.loras.get(group) or {}
            if wanted:
                arrays = self._timed(f"lora {group}", lora.apply, arrays, wanted,
                                     {n: wf.scale_of(n) for n in wf.quantized})
            self._applied[group] = (self.lora_key, wanted)
        return arrays

    def set_loras(self, updates: dict[str, dict[str, list[Any]]], key: Any) -> dict[str, Any] | None:
        """Make `updates` (group -> tensor -> runtime/lora.py Updates, what runtime/adapters.py reads) the LoRA set of
        every weight group, loaded or not; `key` identifies the set, and the same key as now changes nothing (None).

        A loaded group's tensors that the old or the new set changes are placed again from the weight file (its
        unmodified tensors: the mapping load_file kept, the kernel's page cache; on CPU the placed array is that
        mapping, so this copies nothing) and the new set merged into them by the same per-tensor program as at load,
        so the weights after any number of switches are those a fresh load of the set places, bit for bit; nothing is
        ever unmerged by subtraction. A quantized tensor and its scale come back together and are quantized again from
        the unmodified values. Programs already compiled keep running on the new arrays (same shapes and shardings).
        Returns what it did: seconds, tensors merged again, groups."""
        with self._switch_lock:
            if key == self.lora_key:
                return None
            self.loras, self.lora_key = updates, key
            loaded = dict(self._weights)
        t0 = time.perf_counter()
        tensors, groups = 0, []
        for group, fut in loaded.items():
            try:
                arrays = fut.result()  # a load in flight merges the new set itself, or finishes before this
            except BaseException:  # noqa: BLE001  (raised where the weights are used)
                continue
            with self._switch_lock:
                if self._weights.get(group) is not fut or group not in self._sources:
                    continue  # unloaded meanwhile: a later load merges the set
                applied_key, applied = self._applied.get(group, ((), {}))
                if applied_key == self.lora_key:
                    continue
                wanted = self.loras.get(group) or {}
                names = set(applied) | set(wanted)
                if not names:  # neither set changes this group
                    self._applied[group] = (self.lora_key, wanted)
                    continue
                wf = self.manifest.weights[group]
                scales = {n: wf.scale_of(n) for n in wf.quantized}
                try:  # one tensor at a time: a device holds one more unmerged and one more merged tensor at most
                    for name in sorted(names):
                        fresh = self._sources[group].place([name] + ([scales[name]] if name in scales else []))
                        if name in wanted:
                            lora.apply(fresh, {name: wanted[name]}, scales)
                        arrays.update(fresh)
                        del fresh
                except BaseException:
                    # some tensors may hold the new set and some the old: the next switch merges all of both again
                    self._applied[group] = (_PARTIAL, {n: [] for n in names})
                    self.lora_key = _PARTIAL
                    raise
                self._applied[group] = (self.lora_key, wanted)
                self._versions[group] = self._versions.get(group, 0) + 1
                tensors += len(names)
                groups.append(group)
        if groups:
            host_memory.release_freed()  # the replaced tensors and the adapters' placed copies, back to the system
        took = time.perf_counter() - t0
        if groups:
            self.timings["lora switch"] = took
            log.info("LoRA set switched: %d tensors of %s merged again from their unmodified weights in %.3f s",
                     tensors, ", ".join(groups), took)
        return {"seconds": took, "tensors": tensors, "groups": groups}

    def weight_layout(self, group: str, program: str) -> dict[str, tuple[Any, tuple[int, ...], np.dtype]]:
        """(sharding, shape, dtype) of each tensor of a weight group, as `program` (the first to use it) takes it."""
        return self._once(self._layouts, group, lambda: self._layout(group, program))

    def _layout(self, group: str, program: str) -> dict[str, tuple[Any, tuple[int, ...], np.dtype]]:
        wf = self.manifest.weights.get(group)
        if wf is None:
            raise BundleError(f"bundle lists no weights {group!r}: re-export it")
        exp = self.program(program)
        (w_shardings, *_), _ = jax.tree.unflatten(exp.in_tree, exp.in_shardings_jax(self.mesh))
        (w_avals, *_), _ = jax.tree.unflatten(exp.in_tree, exp.in_avals)
        # None: the program does not use this tensor (e.g. the first VAE chunk skips the temporal
        # upsampler); place it as the manifest says, as the group's other programs expect it.
        return {name: (w_shardings[name] or NamedSharding(self.mesh, partition_spec(wf.partition.get(name, []))),
                       tuple(a.shape), np.dtype(a.dtype))
                for name, a in w_avals.items()}

    def executable(self, name: str, part: str = "") -> Any:
        """Program `name` (or its `part`) ready to run: its executable compiled ahead, where the bundle holds one whose
        key matches this host (runtime/executables.py), else compiled here (`compile`). Timed as "load executable
        <key>" or "compile <key>"."""
        key = f"{name}:{part}" if part else name
        entry = self._ahead.get((name, part))
        if entry is not None:
            t = time.perf_counter()
            loaded = self._load_ahead(entry)
            if loaded is not None:
                self.timings[f"load executable {key}"] = time.perf_counter() - t
                return loaded
        return self._timed(f"compile {key}", self.compile, name, part)

    def _load_ahead(self, entry: mf.Executable) -> Any:
        """The executable of `entry`, or None (and one log line per reason) where this host cannot load it. A file
        whose bytes are not the manifest's is refused (BundleError): changed native code is never run."""
        from . import executables as ex

        host = ex.key_for(self.mesh, self.compiler_options(entry.program), entry.key.topology)
        why = ex.mismatch(entry.key, host)
        payload = None
        if why is None:
            path = mf.resolve(self.path, entry.file)
            if not path.is_file():
                raise BundleError(f"bundle file {entry.file} is missing: re-copy or re-export the bundle")
            payload = path.read_bytes()  # hashed as read, whatever was checked at open: native code runs from these
            if hashlib.sha256(payload).hexdigest() != entry.sha256:
                raise BundleError(f"bundle file {entry.file} does not match its sha256 in the manifest (tampered or "
                                  "truncated): re-copy or re-export the bundle")
            try:
                return ex.load(payload, self.lower(entry.program, entry.part), self.compiler_options(entry.program))
            except Exception as e:  # noqa: BLE001  (any failure: compile as a bundle without executables does)
                first = str(e).splitlines()[0][:200] if str(e) else ""
                why = f"loading one failed: {type(e).__name__}: {first}"
        with self._lock:
            said = why in self._ahead_said
            self._ahead_said.add(why)
        if not said:
            log.warning("not loading the bundle's executables compiled ahead (%s): compiling its programs here", why)
        return None

    @property
    def _ahead(self) -> dict[tuple[str, str], mf.Executable]:
        return {(e.program, e.part): e for e in self.manifest.executables}

    def compile(self, name: str, part: str = "") -> Any:
        """Compile a program (or its `part`, see `program`) for this mesh without weights or inputs (fills the
        persistent compilation cache); returns the jax Compiled object (its HLO and cost analysis are what
        `tools/bench.py roofline` reads)."""
        return self.lower(name, part).compile(self.compiler_options(name))

    def lower(self, name: str, part: str = "") -> Any:
        """Program `name` (or its `part`) lowered for this mesh, its donations as the runtime calls it: what `compile`
        compiles, and what an executable compiled ahead is loaded into (runtime/executables.py)."""
        donate = () if part else signatures.donated(name, kinds.get(self.manifest.kind), self.manifest.programs[name])
        return jax.jit(self.program(name, part).call, donate_argnums=donate).lower(*self._abstract(name, part))

    def _abstract(self, name: str, part: str = "") -> list[Any]:
        """The weights and inputs of program `name` (or its `part`) as shapes, dtypes and shardings."""
        exp = self.program(name, part)
        spec = self.manifest.programs[name]
        layout = self.weight_layout(spec.weights, name)
        (w_avals, *avals), _ = jax.tree.unflatten(exp.in_tree, exp.in_avals)
        if part not in ("", "tail"):  # a block program: block 0's tensors, named as the block program names them
            layout = {k: layout[f"{spec.blocks.prefix}0.{k}"] for k in w_avals}
        weights = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=s) for k, (s, shape, dtype) in layout.items()}
        return [weights, *[jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                           for a, s in zip(avals, self.input_shardings(name, part))]]

    def traceable(self, name: str) -> Callable[..., Any]:
        """fn(weights, *inputs) running program `name` as JAX code (its parts in turn for a block loop), to trace
        it as one function: a SavedModel signature (export/savedmodel.py), XLA's analysis of a whole step."""
        spec = self.manifest.programs[name]
        head = self.program(name)
        if spec.blocks is None:
            return head.call
        block, tail = self.program(name, "block").call, self.program(name, "tail").call
        layers = [np.int32(i) for i in range(spec.blocks.layers)]

        def fn(weights: dict[str, Any], *inputs: Any) -> Any:
            per_block, shared = self._block_loop(name, weights)
            return run_block_loop(head.call, block, tail, weights, per_block, layers, inputs, shared,
                                  spec.blocks.head_takes_shared)

        return fn

    def _block_loop(self, name: str, weights: dict[str, Any] | None) -> tuple[list[dict[str, Any]], list[int]]:
        """For block loop `name`: each block's tensors from the group's `weights` (if given), named as the block
        program names them, and the positions of the loop's shared inputs among the program's inputs."""
        spec = self.manifest.programs[name]
        exp = self.program(name, "block")
        (names, *_), _ = jax.tree.unflatten(exp.in_tree, exp.in_avals)
        per_block = [] if weights is None else [{k: weights[f"{spec.blocks.prefix}{i}.{k}"] for k in names}
                                                for i in range(spec.blocks.layers)]
        order = signatures.call_order(name, kinds.get(self.manifest.kind), spec).inputs
        return per_block, [order.index(n) for n in spec.blocks.shared]

    def compile_whole(self, name: str) -> Any:
        """`compile`, but a block loop's parts as one XLA program (what `tools/bench.py roofline` analyses)."""
        spec = self.manifest.programs[name]
        weights, *_ = self._abstract(name)
        order = signatures.call_order(name, kinds.get(self.manifest.kind), spec).inputs
        inputs = [jax.ShapeDtypeStruct(spec.inputs[n].shape, jax.numpy.dtype(spec.inputs[n].dtype), sharding=s)
                  for n, s in zip(order, self.call_shardings(name), strict=True)]
        return jax.jit(self.traceable(name)).lower(weights, *inputs).compile(self.compiler_options(name))

    def compiler_options(self, name: str) -> dict[str, Any] | None:
        """XLA options for compiling program `name` on this bundle's platform (None: XLA's defaults)."""
        if self.manifest.target.platform != "cpu":
            return None
        return CPU_COMPILER_OPTIONS.get(self.manifest.programs[name].weights)


_PARTIAL = object()  # a LoRA key no set has: a switch that failed half way (set_loras)


def entry_mismatch(entry: wio.Entry | None, name: str, want_shape: tuple[int, ...], want_dtype: np.dtype,
                   label: str, who: str) -> str | None:
    """Why the header entry of tensor `name` is not what `who` wants, or None."""
    if entry is None:
        return f"weights file {label} has no tensor {name!r}: re-export the bundle"
    if entry.shape != tuple(want_shape) or entry.dtype != want_dtype:
        return (f"tensor {name!r} in {label} is {entry.dtype.name}{list(entry.shape)}, {who} "
                f"{np.dtype(want_dtype).name}{list(want_shape)}: re-export the bundle")
    return None


def tensor_mismatch(f: Any, present: set[str], name: str, want_shape: tuple[int, ...], want_dtype: np.dtype,
                    label: str, who: str) -> str | None:
    """`entry_mismatch` for tensor `name` of a file opened with safetensors' safe_open (headers only)."""
    entry = None
    if name in present:
        sl = f.get_slice(name)
        entry = wio.Entry(name, safetensors_dtype(sl.get_dtype()), tuple(sl.get_shape()), 0, 0)
    return entry_mismatch(entry, name, want_shape, want_dtype, label, who)


def run_block_loop(head: Callable[..., Any], block: Callable[..., Any], tail: Callable[..., Any],
                   weights: dict[str, Any], per_block: list[dict[str, Any]], layers: list[Any], inputs: list[Any],
                   shared: list[int], head_takes_shared: bool = False) -> Any:
    """Head, then the block program once per block with that block's tensors and index, then the tail
    (manifest.BlockLoop). `inputs` are the program's; those at `shared` go to the blocks (and, for v5 bundles'
    loops, `head_takes_shared`, to the head and tail too)."""
    own = list(inputs) if head_takes_shared else [x for i, x in enumerate(inputs) if i not in shared]
    hidden, *carried = head(weights, *own)
    for mine, layer in zip(per_block, layers, strict=True):
        hidden = block(mine, hidden, *carried, *[inputs[j] for j in shared], layer)
    return tail(weights, *own, hidden)


def partition_spec(data: list[Any]) -> PartitionSpec:
    """A manifest partition entry (None, an axis, or a list of axes per dimension) as a PartitionSpec."""
    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in data])


def load_program(path: Path, manifest: mf.Manifest, name: str, part: str = "") -> Any:
    """Deserialize one of the bundle's programs (or a part of its block loop, manifest.BlockLoop.file); refuses what
    this jax cannot run."""
    spec = manifest.programs[name]
    file = spec.file
    if part:
        if spec.blocks is None:
            raise BundleError(f"program {name!r} has no block loop: re-export the bundle")
        file = spec.blocks.file(part).file
    blob = mf.resolve(path, file).read_bytes()
    exported_jax = manifest.versions.get("jax")
    try:
        exp = jax.export.deserialize(bytearray(blob))
    except Exception as e:  # noqa: BLE001  (any failure here means an unusable file)
        raise BundleError(f"cannot deserialize {file} ({type(e).__name__}: {e}); it was exported with jax "
                          f"{exported_jax}: re-export with this jax ({jax.__version__})") from None
    compat.check_program(name, exp, exported_jax)
    return exp


def no_weights_message(path: Path) -> str:
    return (f"bundle {path} has no weights attached (exported with --no-weights): run `python -m export "
            f"attach {path} --weights CHECKPOINT` first")


def open_bundle(path: str | Path, verify: bool = True, on_host: bool = False,
                loras: list[adapters.LoraSpec] | None = None,
                named: dict[str, lora.Adapter] | None = None) -> Bundle:
    """Read and check `path`; programs and weights load lazily on first use.

    `on_host` places the weights on this host's CPU devices whatever the target platform: to read or
    convert a bundle (export/savedmodel.py), not to run it; its programs still run only on their platform.

    The programs and tokenizer are checked against their sha256 now; each weight file is checked
    as it is read, before its arrays are used (runtime/integrity.py: unchanged files that matched
    before are not hashed again). `loras` are adapters (path, scale) merged into the weights they change as
    those are placed (runtime/lora.py); they are read and checked against the bundle now (`named`: adapters they may
    name, runtime/adapters.py). Bundle.set_loras switches to another set later.
    """
    path = Path(path)
    manifest = mf.read(path)
    for warning in compat.check_versions(manifest.versions):
        log.warning("%s", warning)
    if not manifest.has_weights:
        raise BundleError(no_weights_message(path))
    resolved = adapters.resolve(loras, manifest, named)  # a bad adapter fails before any file is hashed
    updates = adapters.updates(resolved, manifest)
    checker = None
    if verify:
        checker = Checker(path, manifest)
        t = time.perf_counter()
        weight_files = {w.file for w in manifest.weights.values()}
        checker.check([ref for ref in manifest.files() if ref.file not in weight_files])
        checked = time.perf_counter() - t
    mesh = make_mesh(manifest.target, jax.devices("cpu") if on_host else None, any_platform=on_host)
    bundle = Bundle(path=path, manifest=manifest, mesh=mesh, checker=checker, loras=updates,
                    lora_key=adapters.key(resolved))
    if verify:
        bundle.timings["check programs and tokenizer"] = checked
    return bundle
