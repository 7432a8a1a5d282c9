"""The torchax 0.0.13 / torch 2.13 import guard is scoped: it only lasts while torchax loads."""

from __future__ import annotations

import pytest


def test_guard_loads_torchax_and_restores_torch() -> None:
    import torch

    from export.torchax_compat import MissingOverload, load_torchax, tolerate_missing_overloads

    tx = load_torchax()
    assert tx.default_env() is not None
    assert load_torchax() is tx
    with pytest.raises(AttributeError):
        torch.ops.aten.prod.no_such_overload  # noqa: B018  (the guard is gone again)
    with tolerate_missing_overloads() as missing:
        placeholder = torch.ops.aten.prod.no_such_overload
    assert isinstance(placeholder, MissingOverload) and missing == ["aten::prod.no_such_overload"]
    with pytest.raises(NotImplementedError):
        placeholder()
