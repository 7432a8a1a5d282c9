"""Each program's inputs and outputs in call order.

The manifest names a program's inputs and outputs (JSON objects, so sorted); the programs take and
return them positionally. This is the one place that says in which order, for anything that calls a
program by name rather than through runtime/pipeline.py (the SavedModel's signatures, its client).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import kinds, programs
from . import manifest as mf
from .errors import BundleError
from .kinds import Kind

DENOISE_INPUTS = ("state", "kv", "timestep", "guidance", "row")  # then kind.conditioning_inputs
# Bundles exported before the cross_kv programs: the step took the embeddings, then kind.denoise_extras.
DENOISE_INPUTS_WITH_CONTEXT = ("state", "context", "timestep", "guidance", "row")


@dataclass(frozen=True)
class CallOrder:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def call_order(name: str, kind: Kind, spec: mf.ProgramSpec) -> CallOrder:
    """The positional order of program `name`'s inputs and outputs; BundleError if the manifest disagrees."""
    caches_in, caches_out = _caches(spec.inputs), _caches(spec.outputs)
    if kinds.is_text_encoder(name):
        order = CallOrder(("ids", "mask"), ("embeds",))
    elif kinds.base_program(name) == "image_encoder":
        order = CallOrder(("pixels",), ("image_embeds",))
    elif kinds.base_program(name) == "face_motion":  # (a shape's own: face_motion@<shape>)
        order = CallOrder(("face",), ("motion",))
    elif kinds.is_cross_kv(name):
        order = CallOrder(kind.kv_inputs, ("kv",))
    elif (variant := kinds.denoise_variant(name)) is not None:
        head = DENOISE_INPUTS + kind.conditioning_inputs
        if "context" in spec.inputs:
            head = DENOISE_INPUTS_WITH_CONTEXT + kind.denoise_extras
        elif variant.residual == "in" and "kv" not in spec.inputs:  # runs no block: takes no kv (schema 6)
            head = tuple(n for n in head if n != "kv")
        order = CallOrder(head + (("residual",) if variant.residual == "in" else ()),
                          ("state", "finite") + (("residual",) if variant.residual == "out" else ()))
    elif name.partition(kinds.SHAPE_SEPARATOR)[0] in (programs.CACHE_STEP, programs.CACHE_STEP + "_cond"):
        order = CallOrder(programs.CACHE_STEP_INPUTS, programs.CACHE_STEP_OUTPUTS)  # AnyFlow-FAR's KV cache write
    elif kinds.base_program(name) == programs.REFERENCE_STEP:  # Wan-Animate 2's reference pass
        order = CallOrder(programs.REFERENCE_STEP_INPUTS, programs.REFERENCE_STEP_OUTPUTS)
    elif name.startswith("vae_encode_"):
        order = CallOrder(("pixels", *caches_in), ("latents", *caches_out))
    elif name.startswith(("vae_decode_", "tiny_decode_")):
        order = CallOrder(("latents", *caches_in), ("frames", *caches_out))
    else:
        raise BundleError(f"program {name!r} is unknown to this runtime: upgrade wan-aot")
    if set(order.inputs) != set(spec.inputs) or set(order.outputs) != set(spec.outputs):
        raise BundleError(f"program {name!r} lists inputs {sorted(spec.inputs)} and outputs {sorted(spec.outputs)}, "
                          f"not the {kind.name} layout: re-export the bundle")
    return order


def donated(name: str, kind: Kind, spec: mf.ProgramSpec) -> tuple[int, ...]:
    """The positions (after the weights, argument 0) of program `name`'s inputs that it returns updated and whose
    buffers it may reuse: AnyFlow-FAR's KV cache, which the cache write takes and returns, and Wan-Animate 2's
    reference cache, which its reference pass does (the caller drops what it passed)."""
    order = call_order(name, kind, spec)
    return tuple(1 + i for i, n in enumerate(order.inputs)
                 if n in programs.DONATED and n in order.outputs and spec.inputs[n] == spec.outputs[n])


def _caches(names: dict[str, mf.TensorSpec]) -> tuple[str, ...]:
    """The VAE's `cache_<i>` tensors in the order of i (the program's order)."""
    caches = [k for k in names if k.startswith("cache_")]
    try:
        return tuple(sorted(caches, key=lambda k: int(k.removeprefix("cache_"))))
    except ValueError:
        raise BundleError(f"bad cache tensor names {caches}: re-export the bundle") from None
