"""The DiT's transformer blocks as one residual, for step caching (MagCache).

A MagCache step either runs the blocks and keeps their residual (output of the last block minus
input of the first), or skips them and adds the residual kept from an earlier step to the first
block's input; the head (patch and condition embedding) and the tail (output norm and projection)
always run. Which one a step is, the host decides (runtime/magcache.py), so each is its own program:
these context managers change what the module's blocks do while one program is traced, the way
diffusers' MagCache hooks change them at run time (diffusers/hooks/mag_cache.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def capture(module: Any) -> Iterator[dict[str, Any]]:
    """While active, the returned dict gets the first block's input ("in") and the last block's output ("out")
    (torch tensors of the trace; the blocks' own input constraints have already applied)."""
    box: dict[str, Any] = {}
    blocks = module.blocks

    def first(_: Any, args: tuple) -> None:
        box["in"] = args[0]

    def last(_: Any, args: tuple, out: Any) -> None:
        box["out"] = out

    handles = [blocks[0].register_forward_pre_hook(first), blocks[-1].register_forward_hook(last)]
    try:
        yield box
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def replace(module: Any, first: Any, keep_vace: bool = False) -> Iterator[None]:
    """While active, the first block returns first(hidden_states, *its other arguments) and the others return
    their input, so none of the blocks' work is traced (hooks on the blocks still run). A VACE model's VACE blocks
    (WanVACETransformer3DModel) return zero hints, so the model adds nothing after the blocks they follow, unless
    `keep_vace` (a block loop's head computes the hints)."""
    blocks = list(module.blocks)
    vace = [] if keep_vace else list(getattr(module, "vace_blocks", None) or [])

    def through(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        return hidden_states

    def no_hint(hidden_states: Any, encoder_hidden_states: Any, control_hidden_states: Any, *args: Any) -> Any:
        import torch

        return torch.zeros_like(hidden_states), control_hidden_states

    for i, block in enumerate(blocks):
        block.forward = first if i == 0 else through  # an instance attribute shadows the class's forward
    for block in vace:
        block.forward = no_hint
    try:
        yield
    finally:
        for block in blocks + vace:
            del block.forward


def skip(module: Any, residual: Any) -> contextlib.AbstractContextManager[None]:
    """While active, the first block returns its input plus `residual` and the others return their input,
    so none of the blocks' work is traced."""
    return replace(module, lambda hidden_states, *args, **kwargs: hidden_states + residual)
