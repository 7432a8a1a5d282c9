"""Turning a torch module into a pure JAX function and a serialized jax.export program."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from runtime.manifest import Target, TensorSpec

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


def extract(module: Any, attention: AttentionConfig) -> Extracted:
    """torchax view of `module` with our attention installed (torchax.extract_jax without the weight copy)."""
    tx = load_torchax()
    env = tx.default_env()
    install(env, attention)
    jm = tx.interop.JittableModule(module, dedup_parameters=True)

    def fn(weights: dict[str, Any], args: tuple, kwargs: dict[str, Any] | None = None) -> Any:
        params = {k: weights[k] for k in jm.params}
        buffers = {k: weights[k] for k in jm.buffers}
        params, buffers, args, kwargs = env.j2t_iso((params, buffers, args, kwargs or {}))
        with env:
            res = jm.functional_call("forward", params, buffers, *args, **kwargs)
        return env.t2j_iso(res)

    return Extracted(weights={**jm.buffers, **jm.params}, fn=fn)


def abstract_mesh(target: Target) -> jax.sharding.AbstractMesh:
    names = tuple(target.mesh)
    sizes = tuple(target.mesh[n] for n in names)
    return jax.sharding.AbstractMesh(sizes, names)


def dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def spec_of(x: Any) -> TensorSpec:
    return TensorSpec(shape=tuple(int(s) for s in x.shape), dtype=dtype_name(x.dtype))


def sds(spec: TensorSpec) -> jax.ShapeDtypeStruct:
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)

    return jax.ShapeDtypeStruct(spec.shape, np.dtype(spec.dtype))


def export_program(fn: Callable[..., Any], weight_specs: dict[str, TensorSpec], inputs: dict[str, TensorSpec],
                   output_names: list[str], target: Target) -> tuple[bytes, dict[str, TensorSpec]]:
    """Export fn(weights, *inputs) for `target`; returns (serialized program, output specs).

    Everything is laid out replicated over the target mesh; the program's shardings
    are recorded against an AbstractMesh, so no device of the target platform is needed.
    """
    mesh = abstract_mesh(target)
    replicated = NamedSharding(mesh, PartitionSpec())
    w_sds = {k: sds(v) for k, v in weight_specs.items()}
    in_sds = [sds(v) for v in inputs.values()]
    in_shardings = (jax.tree.map(lambda _: replicated, w_sds), *[replicated for _ in in_sds])
    jitted = jax.jit(fn, in_shardings=in_shardings)
    exported = jax.export.export(jitted, platforms=(target.platform,))(w_sds, *in_sds)
    outs = exported.out_avals
    if len(outs) != len(output_names):
        raise AssertionError(f"program has {len(outs)} outputs, expected {output_names}")
    return bytes(exported.serialize()), {n: spec_of(a) for n, a in zip(output_names, outs)}
