"""How each model family is laid out on the (dp, sp, tp) mesh: one table of rules per family.

Weights: a rule maps a tensor-name pattern to a partition per dimension (first match
wins). Activations: the few constraints the programs pin (DiT blocks, attention,
stage inputs/outputs) are here too, so the whole layout reads in one place.
From DESIGN.md section 5 and the seeds:

- DiT (Megatron style over tp): q/k/v and FFN-up column-parallel, out-proj and
  FFN-down row-parallel; the CFG cond/uncond batch over dp; self-attention heads over
  tp and query sequence over sp; cross-attention query sequence over (tp, sp) with
  K/V replicated (512 text tokens are cheap to gather).
- Image cross-attention (Wan 2.1 I2V/FLF2V): the added K/V projections and their RMS norm
  are column-parallel like K/V; the image embedder (a small MLP on CLIP features) and
  FLF2V's position embedding are replicated.
- Text encoder (UMT5) and image encoder (CLIP ViT): FSDP, every weight split over all
  devices on its first dimension that divides (gathered on use).
- VAE (encoder and decoder): weights replicated; activations split on width over all devices (on height where
  only that divides, e.g. portrait 720x1280).
- Both experts of a two-expert model (transformer, transformer_2) use the DiT rules, and a VACE model's VACE
  blocks those of its blocks (their input and hint projections, width x width, are replicated).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from jax.sharding import PartitionSpec

from runtime.errors import UserError
from runtime.manifest import SCALE_SUFFIX, Target
from runtime.targets import AXES, format_mesh

ALL = AXES  # every device, in mesh order
FSDP = "fsdp"  # rule marker: split over ALL on the first dimension that divides
REPLICATED: tuple = ()

_BLOCK = r"(vace_)?blocks\.\d+\."  # the main blocks and VACE's (the same layers, plus their hint projections)
RULES: dict[str, list[tuple[str, Any]]] = {
    "wan_transformer": [
        (_BLOCK + r"attn[12]\.to_[qkv]\.weight", ("tp", None)),  # column-parallel (out, in)
        (_BLOCK + r"attn[12]\.to_[qkv]\.bias", ("tp",)),
        (_BLOCK + r"attn[12]\.norm_[qk]\.weight", ("tp",)),  # RMS norm across heads: follows q/k columns
        (_BLOCK + r"attn2\.add_[kv]_proj\.weight", ("tp", None)),  # image K/V: column-parallel like K/V
        (_BLOCK + r"attn2\.add_[kv]_proj\.bias", ("tp",)),
        (_BLOCK + r"attn2\.norm_added_k\.weight", ("tp",)),
        (r"condition_embedder\.image_embedder\..*", REPLICATED),  # CLIP features -> model width (small)
        # The time projection (width -> 6 x width, 315 MB in bf16 at 14B) and the time and text embedders' MLPs
        # (108 MB in fp32, 94 MB) are column-parallel: they run once per step (or prompt) on a few rows, and whole on
        # every device they would be most of what a quantized DiT keeps unquantized.
        (r"condition_embedder\.(time_proj|(time|text)_embedder\.linear_[12])\.weight", ("tp", None)),
        (r"condition_embedder\.(time_proj|(time|text)_embedder\.linear_[12])\.bias", ("tp",)),
        (_BLOCK + r"attn[12]\.to_out\.0\.weight", (None, "tp")),  # row-parallel
        (_BLOCK + r"ffn\.net\.0\.proj\.weight", ("tp", None)),
        (_BLOCK + r"ffn\.net\.0\.proj\.bias", ("tp",)),
        (_BLOCK + r"ffn\.net\.2\.weight", (None, "tp")),
        # Wan-Animate's face adapters (8 at 14B, 839M parameters): split as the blocks' attention; their per-head
        # norms replicated.
        (r"face_adapter\.\d+\.to_[qkv]\.weight", ("tp", None)),
        (r"face_adapter\.\d+\.to_[qkv]\.bias", ("tp",)),
        (r"face_adapter\.\d+\.to_out\.weight", (None, "tp")),
        # Wan-Animate 2 (WanAnimate2Transformer3DModel) keeps the original Wan names: self_attn / cross_attn for
        # attn1 / attn2, ffn.0 / ffn.2 for ffn.net.0.proj / ffn.net.2, time_projection.1 for time_proj,
        # time_embedding / text_embedding .0 and .2 for the embedders' linear_1 / linear_2; the same layout.
        (_BLOCK + r"(self|cross)_attn\.to_[qkv]\.weight", ("tp", None)),
        (_BLOCK + r"(self|cross)_attn\.to_[qkv]\.bias", ("tp",)),
        (_BLOCK + r"(self|cross)_attn\.norm_[qk]\.weight", ("tp",)),
        (_BLOCK + r"cross_attn\.add_[kv]_proj\.weight", ("tp", None)),
        (_BLOCK + r"cross_attn\.add_[kv]_proj\.bias", ("tp",)),
        (_BLOCK + r"cross_attn\.norm_added_k\.weight", ("tp",)),
        (_BLOCK + r"(self|cross)_attn\.to_out\.0\.weight", (None, "tp")),
        (_BLOCK + r"ffn\.0\.weight", ("tp", None)),
        (_BLOCK + r"ffn\.0\.bias", ("tp",)),
        (_BLOCK + r"ffn\.2\.weight", (None, "tp")),
        (r"(time_projection\.1|(time|text)_embedding\.[02])\.weight", ("tp", None)),
        (r"(time_projection\.1|(time|text)_embedding\.[02])\.bias", ("tp",)),
        (r".*", REPLICATED),  # embedders, norms, modulation tables, proj_out, RoPE tables, biases after a reduce
    ],
    "umt5": [(r".*", FSDP)],
    "clip_vision": [(r".*", FSDP)],
    "wan_vae": [(r".*", REPLICATED)],
    "taehv": [(r".*", REPLICATED)],  # a tiny decoder: 11 M parameters, on every device
}



@dataclass(frozen=True)
class DitLayout:
    """Activations inside the DiT: the batch over `batch` axes, the token sequence over `seq` axes.

    The CFG programs run cond and uncond as one batch of 2B, split over dp. A program without the
    uncond half (batch B, often 1) cannot split its batch over dp=2, so dp joins the sequence axes
    instead (`dit_layout`): every device still works on its share of the tokens.
    """

    batch: tuple[str, ...] = ("dp",)
    seq: tuple[str, ...] = ("sp",)

    @staticmethod
    def _axes(names: tuple[str, ...]) -> Any:
        return None if not names else names[0] if len(names) == 1 else names

    @property
    def hidden(self) -> PartitionSpec:  # (B, S, dim) entering each transformer block
        return PartitionSpec(self._axes(self.batch), self._axes(self.seq), None)

    @property
    def self_q(self) -> PartitionSpec:  # (B, heads, S, head_dim): heads over tp, queries over seq
        return PartitionSpec(self._axes(self.batch), "tp", self._axes(self.seq), None)

    @property
    def self_kv(self) -> PartitionSpec:
        return PartitionSpec(self._axes(self.batch), "tp", None, None)

    @property
    def cross_q(self) -> PartitionSpec:  # queries over (tp, seq), the text K/V whole
        return PartitionSpec(self._axes(self.batch), None, ("tp", *self.seq), None)

    @property
    def cross_kv(self) -> PartitionSpec:
        return PartitionSpec(self._axes(self.batch), None, None, None)

    @property
    def batch_spec(self) -> PartitionSpec:  # a (B, ...) program input such as the text context
        return PartitionSpec(self._axes(self.batch))

    def query_split(self, mesh: Any) -> int:
        """How many pieces cross-attention queries are cut into (they are padded to divide)."""
        return math.prod(mesh.shape[a] for a in ("tp", *self.seq))


CFG_LAYOUT = DitLayout()
_LAYOUT: contextvars.ContextVar[DitLayout] = contextvars.ContextVar("dit_layout", default=CFG_LAYOUT)


def dit_layout(mesh: dict[str, int], batch: int, tokens: int) -> DitLayout:
    """The layout of a DiT call on `batch` samples of `tokens` tokens: the batch over dp when it divides;
    else dp joins sp on the sequence (when the tokens divide), else dp replicates."""
    if batch % mesh["dp"] == 0:
        return CFG_LAYOUT
    if tokens % (mesh["dp"] * mesh["sp"]) == 0:
        return DitLayout(batch=(), seq=("dp", "sp"))
    return DitLayout(batch=(), seq=("sp",))


def current_layout() -> DitLayout:
    """The layout of the DiT program being traced (the block constraints and attention read it)."""
    return _LAYOUT.get()


@contextlib.contextmanager
def use_layout(layout: DitLayout) -> Iterator[None]:
    token = _LAYOUT.set(layout)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def _axis_size(mesh: dict[str, int], entry: Any) -> int:
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    n = 1
    for a in names:
        n *= mesh[a]
    return n


def partition(family: str, name: str, shape: tuple[int, ...], mesh: dict[str, int]) -> PartitionSpec:
    """The PartitionSpec of weight `name` of `family` (dimensions that don't divide stay whole)."""
    rule = next(r for pattern, r in RULES[family] if re.fullmatch(pattern, name))  # tables end with ".*"
    n_all = _axis_size(mesh, ALL)
    if rule == FSDP:
        for dim, size in enumerate(shape):
            if n_all > 1 and size % n_all == 0:
                return PartitionSpec(*([None] * dim), ALL)
        return PartitionSpec()
    spec = list(rule)[: len(shape)]
    spec = [e if e is not None and shape[i] % _axis_size(mesh, e) == 0 else None for i, e in enumerate(spec)]
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def partitions(family: str, tensors: dict[str, Any], quantized: dict[str, str], mesh: dict[str, int]
               ) -> dict[str, PartitionSpec]:
    """The PartitionSpec of every tensor of a weight group (TensorSpecs by name). A quantized weight is split as
    its rule says; its per-row scale (out, 1) follows the weight's output axis (export/quantize.py)."""
    scales = {w + SCALE_SUFFIX: w for w in quantized}
    out = {k: partition(family, k, tuple(t.shape), mesh) for k, t in tensors.items() if k not in scales}
    for scale, weight in scales.items():
        rows = out[weight][0] if len(out[weight]) else None
        out[scale] = PartitionSpec(rows) if rows is not None else PartitionSpec()
    return out


def spec_to_json(spec: PartitionSpec) -> list[Any]:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def spatial_dim(shape: tuple[int, ...], mesh: dict[str, int]) -> int:
    """The dimension a VAE program's activations split on, from its first input's `shape` (..., height, width):
    the width where it divides over every device, else the height (a portrait shape: 720x1280's latents are 90
    wide and 160 high), else the width (then replicated, `width_split`)."""
    n_all = _axis_size(mesh, ALL)
    return -2 if shape[-1] % n_all and not shape[-2] % n_all else -1


def width_split(shape: tuple[int, ...], mesh: dict[str, int], dim: int = -1) -> PartitionSpec:
    """VAE activations: dimension `dim` (width, or height: `spatial_dim`) over every device if it divides, else
    replicated."""
    n_all = _axis_size(mesh, ALL)
    dim = dim % len(shape)
    if n_all == 1 or shape[dim] % n_all:
        return PartitionSpec()
    return PartitionSpec(*([None] * dim), ALL)


@dataclass(frozen=True)
class DitShape:
    """What the mesh must divide in the DiT: attention heads, tokens per sample, CFG batch."""

    heads: int
    tokens: int
    batch: int  # 2 x videos per call (cond + uncond)


def check_dit(target: Target, d: DitShape, model: str, shape: str = "") -> None:
    """Refuse a mesh the DiT cannot be split over, suggesting one with the same device count that works; `shape`
    names the video shape checked (bundles of several shapes)."""
    m = target.mesh
    problems = []
    if d.heads % m["tp"]:
        problems.append(f"its {d.heads} attention heads do not divide over tp={m['tp']}")
    if d.tokens % m["sp"]:
        problems.append(f"its {d.tokens} tokens per frame stack do not divide over sp={m['sp']}")
    if d.batch % m["dp"]:
        problems.append(f"the CFG batch of {d.batch} (cond + uncond) does not divide over dp={m['dp']}")
    if not problems:
        return
    fits = suggest_meshes(target.num_devices, d)
    hint = (f"try --mesh {fits[0]}" if fits else
            f"no dp x sp x tp split of {target.num_devices} devices works: use a target with fewer devices")
    at = f" at {shape}" if shape else ""
    raise UserError(f"mesh {format_mesh(m)} of target {target.name} does not fit {model}{at}: "
                    f"{'; '.join(problems)} ({hint})")


def suggest_meshes(n: int, d: DitShape) -> list[str]:
    """Meshes of n devices that fit `d`, best first: dp=2 for CFG when possible, then the most tp."""
    out = []
    for dp, sp in itertools.product(range(1, n + 1), repeat=2):
        if n % (dp * sp):
            continue
        tp = n // (dp * sp)
        if d.heads % tp or d.tokens % sp or d.batch % dp:
            continue
        out.append((dp != min(2, d.batch), -tp, sp, {"dp": dp, "sp": sp, "tp": tp}))
    return [format_mesh(m) for *_, m in sorted(out, key=lambda t: t[:3])]


