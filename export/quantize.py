"""Weight quantization at export: int8 or fp8 weights with one scale per output channel.

What is quantized is one table (QUANTIZED): the linear layers of the DiT blocks, of the text
encoder and of the CLIP image encoder, and UMT5's token embedding table (per row: it is only
looked up). Everything else (the DiT's patch, text, time and image embedders, modulation tables,
norms, the output head, the VAE) keeps the bundle's dtype: those are small, and the embedders and
head are where errors are amplified.

A quantized layer is stored as `<layer>.weight` (int8 or float8_e4m3fn, [out, in]) and
`<layer>.weight_scale` (float32, [out, 1]): symmetric absmax per output row, the layout lightx2v's
Wan checkpoints use, so their files attach as they are (export/prequantized.py). The module is
swapped for a QuantLinear before it is traced, so every program that uses the layer (denoise
blocks, cross_kv, the text encoder) takes the quantized tensors, and the bundle holds nothing else:

- int8, fp8: the program dequantizes next to the matmul, `x @ (q * scale)`. On TPU XLA fuses the
  convert into the dot, so memory and bandwidth are the 8-bit weight's; XLA's CPU backend does not,
  and converts each weight at every step (1.5-1.7x bf16's step on a 2-core Xeon, BENCHMARKS.md section 5).
- int8-dynamic: the activations are quantized per token at run time too, and the dot is
  int8 x int8 -> int32 (`preferred_element_type`), scaled after: the int8 units of TPU v5e/v6e.
  Both operands stay integer (a float x int dot with an int32 accumulator crashes libtpu).
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp

from runtime.manifest import SCALE_SUFFIX  # <layer>.weight -> <layer>.weight_scale

MODES = ("int8", "fp8", "int8-dynamic")
STORAGE = {"int8": "int8", "fp8": "float8_e4m3fn", "int8-dynamic": "int8"}  # the weights' dtype per mode
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}  # the largest magnitude of the storage dtype

_BLOCK = r"(vace_)?blocks\.\d+\."  # VACE models' VACE blocks are blocks too
_DIT = [_BLOCK + r"attn[12]\.(to_[qkv]|to_out\.0|add_[kv]_proj)", _BLOCK + r"ffn\.net\.(0\.proj|2)",
        r"face_adapter\.\d+\.to_(q|k|v|out)"]  # Wan-Animate's face adapters
# Weight group -> patterns of the module names whose weight is quantized (Linear, or Embedding per row).
QUANTIZED: dict[str, list[str]] = {
    "transformer": _DIT,
    "transformer_2": _DIT,
    "text_encoder": [r"encoder\.block\.\d+\.layer\.\d+\.(SelfAttention\.[qkvo]|DenseReluDense\.(wi|wi_0|wi_1|wo))",
                     r"shared"],
    "image_encoder": [r"(vision_model\.)?encoder\.layers\.\d+\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])"],
    "vae": [],
}


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


def quantized_layers(group: str, names: list[str]) -> list[str]:
    """The module names of `group` (of `names`) whose weight the table quantizes."""
    patterns = [re.compile(p) for p in QUANTIZED.get(group, [])]
    return [n for n in names if any(p.fullmatch(n) for p in patterns)]


def quantize_tensor(w: Any, mode: str) -> tuple[Any, Any]:
    """(q, scale) of a torch [out, in] weight: q = round(w / scale) in the mode's storage dtype, scale =
    absmax(row) / qmax in float32 [out, 1] (1 for an all-zero row). Meta tensors give meta results."""
    import torch

    storage = getattr(torch, STORAGE[mode])
    if w.device.type == "meta":
        return (torch.empty(w.shape, dtype=storage, device="meta"),
                torch.empty((w.shape[0], 1), dtype=torch.float32, device="meta"))
    wf = w.detach().to(torch.float32)
    amax = wf.abs().amax(dim=1, keepdim=True)
    qmax = QMAX[STORAGE[mode]]
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    x = wf / scale
    q = x.round().clamp(-qmax, qmax).to(storage) if storage == torch.int8 else x.clamp(-qmax, qmax).to(storage)
    return q.contiguous(), scale.contiguous()


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """q x scale in fp32, rounded once to `dtype`."""
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)


def linear_weight_only(x: jax.Array, q: jax.Array, scale: jax.Array, bias: jax.Array | None) -> jax.Array:
    """x @ (q x scale).T + bias, accumulated in fp32 and rounded once to x's dtype."""
    w = dequantize(q, scale, x.dtype)
    y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def linear_dynamic(x: jax.Array, q: jax.Array, scale: jax.Array, bias: jax.Array | None) -> jax.Array:
    """int8 activations (symmetric absmax per token) x int8 weights -> int32, then both scales applied."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    x_scale = jnp.where(amax > 0, amax / QMAX["int8"], 1.0)
    xq = jnp.clip(jnp.round(xf / x_scale), -QMAX["int8"], QMAX["int8"]).astype(jnp.int8)
    acc = jax.lax.dot_general(xq, q, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    y = acc.astype(jnp.float32) * x_scale * scale[:, 0].astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def lookup(ids: jax.Array, q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """Rows `ids` of a per-row quantized table, dequantized."""
    return dequantize(jnp.take(q, ids, axis=0), jnp.take(scale, ids, axis=0), dtype)


def _modules() -> tuple[type, type]:
    """QuantLinear and QuantEmbedding (defined on first use: torch is a build-time dependency only)."""
    global _CLASSES
    if _CLASSES is None:
        import torch

        from .torchax_compat import load_torchax

        interop = load_torchax().interop

        class QuantLinear(torch.nn.Module):
            """A Linear whose weight is stored quantized; traced under torchax only."""

            def __init__(self, layer: torch.nn.Linear, mode: str):
                super().__init__()
                q, scale = quantize_tensor(layer.weight, mode)
                self.mode = mode
                self.weight = torch.nn.Parameter(q, requires_grad=False)
                self.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
                self.bias = layer.bias

            def forward(self, x: Any) -> Any:
                fn = linear_dynamic if self.mode == "int8-dynamic" else linear_weight_only
                return interop.call_jax(fn, x, self.weight, self.weight_scale, self.bias)

        class QuantEmbedding(torch.nn.Module):
            """An Embedding whose table is stored quantized per row (weight-only in every mode)."""

            def __init__(self, layer: torch.nn.Embedding, mode: str):
                super().__init__()
                q, scale = quantize_tensor(layer.weight, "fp8" if mode == "fp8" else "int8")
                self.dtype = layer.weight.dtype
                self.weight = torch.nn.Parameter(q, requires_grad=False)
                self.weight_scale = torch.nn.Parameter(scale, requires_grad=False)

            def forward(self, ids: Any) -> Any:
                dtype = interop.jax_view(self.dtype)
                return interop.call_jax(lambda i, q, s: lookup(i, q, s, dtype), ids, self.weight, self.weight_scale)

        _CLASSES = QuantLinear, QuantEmbedding
    return _CLASSES


_CLASSES: tuple[type, type] | None = None


def apply(module: Any, group: str, mode: str) -> dict[str, str]:
    """Swap the table's layers of `module` (weight group `group`) for quantized ones, in place; returns the
    quantized tensors' names -> mode (what the manifest records). Tied layers (UMT5's shared embedding is also
    encoder.embed_tokens, another module holding the same Parameter) are swapped everywhere, as one."""
    import torch

    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}")
    QuantLinear, QuantEmbedding = _modules()
    named = dict(module.named_modules(remove_duplicate=False))
    swapped: dict[int, Any] = {}  # by the id of the layer's weight: tied layers (one Parameter) become one module
    quantized: dict[str, str] = {}
    for name in quantized_layers(group, list(named)):
        old = named[name]
        if id(old.weight) not in swapped:
            if isinstance(old, torch.nn.Linear):
                swapped[id(old.weight)] = QuantLinear(old, mode)
            elif isinstance(old, torch.nn.Embedding):
                swapped[id(old.weight)] = QuantEmbedding(old, mode)
            else:
                raise TypeError(f"{group} layer {name} is a {type(old).__name__}, not a Linear or Embedding")
    for parent in list(module.modules()):
        for child_name, child in list(parent._modules.items()):
            if isinstance(child, (torch.nn.Linear, torch.nn.Embedding)) and id(child.weight) in swapped:
                parent._modules[child_name] = swapped[id(child.weight)]
    for name, sub in module.named_modules():  # deduplicated: a tied table is recorded under its first name
        if isinstance(sub, (QuantLinear, QuantEmbedding)):
            quantized[f"{name}.weight"] = mode
        if type(sub).__name__.endswith(("DenseGatedActDense", "DenseActDense")) and isinstance(sub.wo, QuantLinear):
            _keep_wo_input_dtype(sub)
    return quantized


def _keep_wo_input_dtype(ff: Any) -> None:
    """T5's feed-forward casts its hidden states to `wo.weight`'s dtype (for models that keep wo in fp32), which for
    an fp8 weight would round the activations to fp8: run the same layers without that cast."""
    def forward(hidden: Any) -> Any:
        if hasattr(ff, "wi_0"):
            h = ff.act(ff.wi_0(hidden)) * ff.wi_1(hidden)
        else:
            h = ff.act(ff.wi(hidden))
        return ff.wo(ff.dropout(h))

    ff.forward = forward
