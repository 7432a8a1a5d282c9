"""bf16 matmuls with fp32 accumulation, for CPU targets.

XLA's CPU backend has no bf16 GEMM for a bf16 x bf16 -> bf16 dot: it rewrites it to an
fp32 dot with converts around every operand, so a bf16 bundle ran slower than an fp32
one. Asking for an fp32 result (`preferred_element_type`) keeps the operands in bf16 and
lets XLA call its bf16-input kernel (2.5x faster on the Wan block's matmuls,
docs/why.md). The product is then rounded to bf16 once, after the bias is
added in fp32, which is also what torch's oneDNN linear does. fp32 inputs are untouched;
TPU and GPU programs keep torchax's lowering (bf16 dots are native there).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

LOW = (jnp.bfloat16, jnp.float16)


def _low(*xs: Any) -> Any:
    """The common low-precision dtype of the operands, or None when any is not bf16/fp16."""
    dtypes = {x.dtype for x in xs}
    if len(dtypes) == 1 and next(iter(dtypes)) in LOW:
        return next(iter(dtypes))
    return None


def matmul(x: Any, y: Any, bias: Any = None) -> Any:
    """x @ y (+ bias), accumulated in fp32 and rounded once when x and y are bf16 (or fp16)."""
    dtype = _low(x, y)
    if dtype is None:
        out = x @ y
        return out if bias is None else out + bias
    out = jnp.matmul(x, y, preferred_element_type=jnp.float32)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return out.astype(dtype)


def install(env: Any) -> None:
    """Route torch's linear, matmul, mm, addmm and bmm in torchax `env` through `matmul`.

    torchax lowers `F.linear` at the torch-function level (before aten), so both keys are replaced.
    """
    import torch
    from torchax.ops import ops_registry

    def linear(x: Any, w: Any, bias: Any = None) -> Any:
        return matmul(x, jnp.transpose(w), bias)

    def mm(x: Any, y: Any) -> Any:
        return matmul(x, y)

    def addmm(bias: Any, x: Any, y: Any, *, beta: float = 1.0, alpha: float = 1.0) -> Any:
        if beta != 1 or alpha != 1:
            return beta * bias + alpha * matmul(x, y)
        return matmul(x, y, bias)

    env._ops[torch.nn.functional.linear] = ops_registry.Operator(
        torch.nn.functional.linear, linear, is_jax_function=True, is_user_defined=True, needs_env=False,
        is_view_op=False)
    for op, fn in ((torch.ops.aten.linear, linear), (torch.ops.aten.matmul, mm), (torch.ops.aten.mm, mm),
                   (torch.ops.aten.bmm, mm), (torch.ops.aten.addmm, addmm)):
        for key in (op, op.default):
            env._ops[key] = ops_registry.Operator(key, fn, is_jax_function=True, is_user_defined=True,
                                                  needs_env=False, is_view_op=False)
