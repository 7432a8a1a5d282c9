"""Turning a torch module into a pure JAX function and a serialized jax.export program."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, NamedSharding, PartitionSpec

from runtime.manifest import Target, TensorSpec

from . import strided_set
from .attention import AttentionConfig, install
from .torchax_compat import load_torchax


@dataclass
class Extracted:
    """A module as (weights, fn): fn(weights, args, kwargs) is pure JAX.

    `weights` are the module's own torch tensors (parameters, tied ones once, and
    non-persistent buffers such as Wan's RoPE tables), not copies: export only needs
    their shapes, and the weight writer streams them to disk, so a component costs
    its own size in memory once.
    """

    weights: dict[str, Any]
    fn: Callable[..., Any]
    module: Any = None  # the torch module fn calls (hooks on it act inside fn)
    env: Any = None  # the torchax environment fn runs in (to move tensors between torch and jax)
    quantized: dict[str, str] = dataclasses.field(default_factory=dict)  # tensor -> mode (export/quantize.py)


def extract(module: Any, attention: AttentionConfig, mesh: AbstractMesh | None = None,
            constraints: dict[str, PartitionSpec | Callable[[], PartitionSpec]] | None = None, conv_as_2d: bool = False,
            cpu_dots: bool = False) -> Extracted:
    """torchax view of `module` with our attention installed (torchax.extract_jax without the weight copy).

    With `mesh`, attention is pinned to the DiT layout and `constraints` maps submodule-name
    patterns to the PartitionSpec of their first input (e.g. every transformer block's
    hidden states), so the sharding survives the trip through torch code; a callable spec is
    asked at trace time (the DiT's layout depends on the program's batch). `conv_as_2d` runs 3D
    convolutions as 2D ones and depthwise ones as shifted sums (export/conv.py; for CPU targets).
    `cpu_dots` accumulates bf16 matmuls in fp32 (export/cpu_dots.py; for CPU targets).
    """
    tx = load_torchax()
    strided_set.install()  # RoPE's strided channel writes without scatters (same values)
    env = tx.default_env()
    install(env, attention, mesh)
    if conv_as_2d:
        from . import conv

        conv.install(env)
    if cpu_dots:
        from . import cpu_dots as dots

        dots.install(env)
    if mesh is not None:
        for pattern, spec in (constraints or {}).items():
            for name, sub in module.named_modules():
                if re.fullmatch(pattern, name):
                    sub.register_forward_pre_hook(_constrain_first_input(env, mesh, spec))
    jm = tx.interop.JittableModule(module, dedup_parameters=True)
    # torchax dedups tied parameters but not tied buffers, which quantized layers' tensors are (integer tensors
    # cannot require grad): a buffer held under several names is one weight, under its first name.
    first: dict[int, str] = {}
    alias = {k: first.setdefault(id(v), k) for k, v in jm.buffers.items()}

    def fn(weights: dict[str, Any], args: tuple, kwargs: dict[str, Any] | None = None, method: str = "forward") -> Any:
        params = {k: weights[k] for k in jm.params}
        buffers = {k: weights[alias[k]] for k in jm.buffers}
        params, buffers, args, kwargs = env.j2t_iso((params, buffers, args, kwargs or {}))
        with env:
            res = jm.functional_call(method, params, buffers, *args, **kwargs)
        return env.t2j_iso(res)

    tensors = {**{k: v for k, v in jm.buffers.items() if alias[k] == k}, **jm.params}
    return Extracted(weights={k: _jax_int(k, v) for k, v in tensors.items()}, fn=fn,
                     module=module, env=env)


def _jax_int(name: str, t: Any) -> Any:
    """int64 buffers (CLIP's position_ids) as int32: the programs run without jax_enable_x64, so they take int32."""
    import torch

    if t.dtype != torch.int64:
        return t
    if t.device.type != "meta" and t.numel() and (t.max() > 2**31 - 1 or t.min() < -(2**31)):
        raise ValueError(f"int64 tensor {name} does not fit in int32")
    return t.to(torch.int32)


def _constrain_first_input(env: Any, mesh: AbstractMesh, spec: PartitionSpec | Callable[[], PartitionSpec]
                           ) -> Callable[..., Any]:
    def hook(module: Any, args: tuple) -> tuple:
        sharding = NamedSharding(mesh, spec() if callable(spec) else spec)
        x = jax.lax.with_sharding_constraint(env.t2j_iso(args[0]), sharding)
        return (env.j2t_iso(x), *args[1:])

    return hook


def abstract_mesh(target: Target) -> AbstractMesh:
    """The target's mesh without devices (TPU targets carry their device kind), so no TPU is needed."""
    names = tuple(target.mesh)
    sizes = tuple(target.mesh[n] for n in names)
    device = None
    if target.device_kind:
        device = AbstractDevice(device_kind=target.device_kind, num_cores=None, platform=target.platform)
    return AbstractMesh(sizes, names, abstract_device=device)


def dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def spec_of(x: Any) -> TensorSpec:
    return TensorSpec(shape=tuple(int(s) for s in x.shape), dtype=dtype_name(x.dtype))


def sds(spec: TensorSpec) -> jax.ShapeDtypeStruct:
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)

    return jax.ShapeDtypeStruct(spec.shape, np.dtype(spec.dtype))


# Programs carry the source location (file:line) of the Python that traced each op, for debugging. Paths are made
# relative to where the packages are installed (site-packages, or this checkout for `export` itself), so that the
# same commit installed anywhere (another venv, checkout or machine) exports the same bytes: without it two fresh
# installs from the same lock exported different programs (tools/reproducible_install.sh). Each op records its own
# frame, not the whole call stack: the stack's outer frames are whoever called the export (`python -m export`, the
# `wan-aot-export` script, a Python program, a test's process), and with them the same export made other bytes.
SOURCE_ROOTS = r"^.*/(site-packages|dist-packages)/|^" + re.escape(str(Path(__file__).resolve().parents[1])) + "/"


def export_program(fn: Callable[..., Any], weight_specs: dict[str, TensorSpec],
                   weight_partition: dict[str, PartitionSpec], inputs: dict[str, TensorSpec],
                   input_partition: dict[str, PartitionSpec], output_names: list[str], output_partition: Any,
                   target: Target) -> tuple[bytes, dict[str, TensorSpec]]:
    """Export fn(weights, *inputs) for `target`; returns (serialized program, output specs).

    Shardings are recorded against an AbstractMesh, so no device of the target platform
    is needed. `output_partition` is a PartitionSpec pytree prefix of fn's outputs.
    """
    mesh = abstract_mesh(target)
    w_sds = {k: sds(v) for k, v in weight_specs.items()}
    in_sds = [sds(v) for v in inputs.values()]
    w_shardings = {k: NamedSharding(mesh, weight_partition.get(k, PartitionSpec())) for k in w_sds}
    x_shardings = [NamedSharding(mesh, input_partition.get(k, PartitionSpec())) for k in inputs]
    out_shardings = jax.tree.map(lambda p: NamedSharding(mesh, p), output_partition,
                                 is_leaf=lambda x: isinstance(x, PartitionSpec))
    jitted = jax.jit(fn, in_shardings=(w_shardings, *x_shardings), out_shardings=out_shardings)
    settings = {"jax_hlo_source_file_canonicalization_regex": SOURCE_ROOTS,
                "jax_include_full_tracebacks_in_locations": False}
    before = {name: getattr(jax.config, name) for name in settings}
    try:
        for name, value in settings.items():
            jax.config.update(name, value)
        exported = jax.export.export(jitted, platforms=(target.platform,))(w_sds, *in_sds)
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
    outs = exported.out_avals
    if len(outs) != len(output_names):
        raise AssertionError(f"program has {len(outs)} outputs, expected {output_names}")
    return bytes(exported.serialize()), {n: spec_of(a) for n, a in zip(output_names, outs)}
