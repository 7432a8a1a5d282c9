"""Import torchax 0.0.13 on torch 2.13.

torchax 0.0.13 looks up about twenty named-tensor ATen overloads
(``aten.prod.dim_Dimname``, ``aten.all.dimname``, ...) at import time and when
its first ``Environment`` is built. torch 2.13 removed them, so a plain
``import torchax`` raises ``AttributeError``. While torchax imports and builds
its default environment we make a missing overload lookup return an inert,
hashable placeholder; nothing ever dispatches to those overloads because no
tensor carries dimension names.

Drop this module once torchax > 0.0.13 (the upstream fix) is pinned.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

_lock = threading.Lock()
_loaded: Any = None


class MissingOverload:
    """Stands in for an ATen overload that this torch no longer has."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<missing overload {self.name}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{self.name} does not exist in torch {torch.__version__}")


@contextlib.contextmanager
def tolerate_missing_overloads() -> Iterator[list[str]]:
    """Within the block, ``torch.ops.aten.<op>.<missing_overload>`` yields a placeholder."""
    packet = torch._ops.OpOverloadPacket
    original = packet.__getattr__
    missing: list[str] = []

    def lenient_getattr(self: Any, key: str) -> Any:
        try:
            return original(self, key)
        except AttributeError:
            if key.startswith("__"):
                raise
            name = f"{self._qualified_op_name}.{key}"
            missing.append(name)
            return MissingOverload(name)

    packet.__getattr__ = lenient_getattr
    try:
        yield missing
    finally:
        packet.__getattr__ = original


def load_torchax() -> Any:
    """Import torchax and build its default environment; returns the module."""
    global _loaded
    with _lock:
        if _loaded is None:
            with tolerate_missing_overloads():
                import torchax

                torchax.default_env()
            _type_as_takes_views(torchax)
            _getitem_takes_views(torchax)
            _loaded = torchax
    return _loaded


def _type_as_takes_views(torchax: Any) -> None:
    """torchax 0.0.13's `Tensor.type_as(other)` reads `other._elem`, which a view (a slice, torchax.view.View) does not
    have: HeliosOutputNorm's `(...).type_as(hidden_states[:, -n:])` fails. Take the dtype from the view's array then;
    otherwise the same (torchax's own in-place cast)."""
    from torchax.tensor import Tensor

    def type_as(self: Any, other: Any) -> Any:
        dtype = other._elem.dtype if hasattr(other, "_elem") else other.jax().dtype
        self._elem = self._elem.astype(dtype)
        return self

    Tensor.type_as = type_as


def _getitem_takes_views(torchax: Any) -> None:
    """torchax 0.0.13's `x[index]` with an advanced index (a list or a tensor) reads `x._elem`, which a view (a slice,
    torchax.view.View) does not have: ChronoEditRotaryPosEmbed's `freqs_cos[0][:8][[0, -1]]` fails. Index the view's
    array then (advanced indexing copies in torch too); slices of views stay views, as before."""
    from torchax.ops import ops_registry
    from torchax.tensor import Tensor

    op = ops_registry.all_torch_functions[torch.Tensor.__getitem__]  # the environments' own Operator object
    original = op.func

    def getitem(self: Any, indexes: Any) -> Any:
        advanced = isinstance(indexes, (list, torch.Tensor)) or (
            isinstance(indexes, tuple) and any(isinstance(i, (list, torch.Tensor)) for i in indexes))
        if advanced and not hasattr(self, "_elem"):
            self = Tensor(self.jax(), self._env)
        return original(self, indexes)

    op.func = getitem
