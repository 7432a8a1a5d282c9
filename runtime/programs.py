"""A bundle's programs by identity: what each one computes as typed fields (`Program`), and its name on disk.

A program is named in a bundle's manifest and its stages/ file by a string (`denoise_step_2_cond@64x32x9r1`), and the
names must not change: every bundle ever exported is read by them. The code does not build or take those strings
apart by hand: it makes a `Program` (the stage it is, the expert, the denoise variant, the VAE chunk, the prompt's
rows, the pyramid stage, the shape) and asks for its `name`; a name read from a manifest becomes a `Program` with
`Program.parse`, the one place that reads the grammar:

    text_encoder[_<rows>]                     the text encoder over all max_sequence_length tokens, or the first rows
    image_encoder                             CLIP's image embeddings
    face_motion[@shape]                       Wan-Animate's face video to motion vectors
    cross_kv[_<expert+1>][_t<rows>]           an expert's cross-attention keys and values of a prompt (a short one's)
    denoise_step[_<expert+1>][_<variant>][_stage<k>][@shape]   a step (DENOISE_VARIANTS; a pyramid's lower stage k)
    cache_step[_cond][@shape]                 AnyFlow-FAR's KV cache write after a chunk (CFG's both halves, or not)
    reference_step[@shape]                    Wan-Animate 2's reference pass: a driving segment's K/V into its cache
    vae_encode_<chunk>[@size], vae_decode_<chunk>[@size], tiny_decode_<chunk>[@size]   chunk "first" or "next"

The shape suffix (manifest.shape_suffix) is "@<W>x<H>x<F>[r<R>]" for the programs of a non-default video shape,
"@<W>x<H>" for those of a non-default size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

TEXT_ENCODER = "text_encoder"
IMAGE_ENCODER = "image_encoder"
FACE_MOTION = "face_motion"
CROSS_KV = "cross_kv"
DENOISE = "denoise_step"
VAE_ENCODE = "vae_encode"
VAE_DECODE = "vae_decode"
TINY_DECODE = "tiny_decode"
CACHE_STEP = "cache_step"  # AnyFlow-FAR's KV cache write (variant "cfg" or "cond", as the denoise step's)
# Its inputs and outputs in call order: the clean latents so far at their cache slots, each slot's frame position and
# chunk (-1: empty), the prompt's cross-attention keys and values; the cache, taken and returned (donated).
CACHE_STEP_INPUTS = ("latents", "frame_pos", "frame_chunk", "kv", "full_cache", "compressed_cache")
CACHE_STEP_OUTPUTS = ("full_cache", "compressed_cache")
REFERENCE_STEP = "reference_step"  # Wan-Animate 2's reference-extraction pass (export/animate2.py)
# Its inputs and outputs in call order: the driving segment's DiT input, the reference prompt's cross-attention keys
# and values; the reference cache, taken and returned (donated).
REFERENCE_STEP_INPUTS = ("reference", "kv", "ref_cache")
REFERENCE_STEP_OUTPUTS = ("ref_cache",)
DONATED = (*CACHE_STEP_OUTPUTS, *REFERENCE_STEP_OUTPUTS)  # caches a program takes and returns (their buffers reused)
CHUNKED = (VAE_ENCODE, VAE_DECODE, TINY_DECODE)  # programs per chunk of frames: "<base>_first", "<base>_next"
CHUNKS = ("first", "next")

DIT_GROUPS = ("transformer", "transformer_2")  # the DiT experts' weight groups, in expert order

# What a program's tensor shapes depend on (kinds.shape_scope): "" nothing, "size" width x height, "video" the shape.
SCOPES = {TEXT_ENCODER: "", IMAGE_ENCODER: "", CROSS_KV: "", FACE_MOTION: "video", DENOISE: "video",
          VAE_ENCODE: "size", VAE_DECODE: "size", TINY_DECODE: "size", CACHE_STEP: "video",
          REFERENCE_STEP: "video"}
# The stage of a generation (kinds.PIPELINE_STAGES) each program runs in.
PIPELINE_STAGE = {TEXT_ENCODER: "encode", IMAGE_ENCODER: "encode", VAE_ENCODE: "encode", CROSS_KV: "denoise",
                  FACE_MOTION: "denoise", DENOISE: "denoise", VAE_DECODE: "decode", TINY_DECODE: "decode",
                  CACHE_STEP: "denoise", REFERENCE_STEP: "denoise"}

SHAPE_SEPARATOR = "@"  # a program of a bundle's other shapes: "<program>@<W>x<H>x<F>" or "<program>@<W>x<H>"
STAGE_SUFFIX = "_stage"  # a Helios pyramid's lower stages' DiT programs: "<program>_stage<k>" (runtime/helios.py)
ROWS_SUFFIX = "_t"  # a short prompt's cross_kv program: "cross_kv_t<T>"


@dataclass(frozen=True)
class DenoiseVariant:
    """One of the denoise programs of an expert; the host picks one per step (runtime/pipeline.py).

    cfg: the DiT runs cond and uncond as one batch of 2B and guidance mixes them; without, it runs the
    cond half only (batch B), for steps whose guidance is <= 1, where the result is cond alone anyway.
    residual: "" (plain step), "out" (also returns the transformer blocks' residual, a MagCache full
    step) or "in" (takes a residual and skips the blocks, a MagCache cached step).
    """

    name: str
    suffix: str
    cfg: bool
    residual: str


DENOISE_VARIANTS: dict[str, DenoiseVariant] = {v.name: v for v in (
    DenoiseVariant("cfg", "", cfg=True, residual=""),
    DenoiseVariant("cond", "_cond", cfg=False, residual=""),
    DenoiseVariant("residual", "_residual", cfg=True, residual="out"),
    DenoiseVariant("cached", "_cached", cfg=True, residual="in"),
)}


@dataclass(frozen=True)
class Program:
    """One program of a bundle, as what it computes.

    base: the stage (TEXT_ENCODER ... TINY_DECODE). expert: the DiT expert whose weights a cross_kv or denoise program
    takes (0 the first, high-noise one). variant: a denoise program's DENOISE_VARIANTS key. chunk: a chunked program's
    "first" or "next" chunk of frames. text_rows: a text encoder's length, or a short prompt's cross_kv rows, where it
    is not the whole max_sequence_length (None). stage: a Helios pyramid's lower stage k of a denoise program (None:
    the full-resolution stage, the only one of other bundles). shape: the shape suffix without its "@" ("" for the
    default shape and for programs whose shapes depend on neither)."""

    base: str
    expert: int = 0
    variant: str = ""
    chunk: str = ""
    text_rows: int | None = None
    stage: int | None = None
    shape: str = ""

    def __post_init__(self) -> None:
        if self.base not in SCOPES:
            raise ValueError(f"unknown program {self.base!r}")
        if self.base in (DENOISE, CACHE_STEP) and self.variant not in DENOISE_VARIANTS:
            raise ValueError(f"unknown denoise variant {self.variant!r}")
        if (self.base in CHUNKED) != (self.chunk in CHUNKS):
            raise ValueError(f"{self.base}: chunk {self.chunk!r}")

    @classmethod
    def denoise(cls, expert: int = 0, variant: str = "cfg", stage: int | None = None) -> Program:
        return cls(DENOISE, expert=expert, variant=variant, stage=stage)

    @classmethod
    def cross_kv(cls, expert: int = 0, text_rows: int | None = None) -> Program:
        return cls(CROSS_KV, expert=expert, text_rows=text_rows)

    @property
    def name(self) -> str:
        """The program's name in a manifest and its file's, stages/<name>.jaxexport (the module docstring)."""
        expert = f"_{self.expert + 1}" if self.expert else ""
        if self.base == TEXT_ENCODER:
            body = TEXT_ENCODER + (f"_{self.text_rows}" if self.text_rows is not None else "")
        elif self.base == CROSS_KV:
            body = CROSS_KV + expert + (f"{ROWS_SUFFIX}{self.text_rows}" if self.text_rows is not None else "")
        elif self.base == DENOISE:
            stage = f"{STAGE_SUFFIX}{self.stage}" if self.stage is not None else ""
            body = DENOISE + expert + DENOISE_VARIANTS[self.variant].suffix + stage
        elif self.base == CACHE_STEP:
            body = CACHE_STEP + DENOISE_VARIANTS[self.variant].suffix
        elif self.base in CHUNKED:
            body = f"{self.base}_{self.chunk}"
        else:
            body = self.base
        return body + (SHAPE_SEPARATOR + self.shape if self.shape else "")

    @property
    def scope(self) -> str:
        """What its tensor shapes depend on (SCOPES), so what a bundle of several shapes holds one of per shape."""
        return SCOPES[self.base]

    @property
    def pipeline_stage(self) -> str:
        return PIPELINE_STAGE[self.base]

    @property
    def group(self) -> str:
        """The weight group (the component) whose weights it takes."""
        if self.base in (CROSS_KV, DENOISE, CACHE_STEP, REFERENCE_STEP):
            return DIT_GROUPS[self.expert]
        return {FACE_MOTION: "transformer", VAE_ENCODE: "vae", VAE_DECODE: "vae",
                TINY_DECODE: "tiny_decoder"}.get(self.base, self.base)

    @property
    def denoise_variant(self) -> DenoiseVariant | None:
        return DENOISE_VARIANTS[self.variant] if self.base == DENOISE else None

    def replace(self, **changes: object) -> Program:
        return dataclasses.replace(self, **changes)

    @classmethod
    def parse(cls, name: str) -> Program | None:
        """The program named `name` (as `name` writes it), or None where `name` is no program's name (a block loop's
        part file, say)."""
        body, _, shape = name.partition(SHAPE_SEPARATOR)
        if body in (IMAGE_ENCODER, FACE_MOTION, TEXT_ENCODER, REFERENCE_STEP):
            return cls(body, shape=shape)
        if body.startswith(TEXT_ENCODER + "_"):
            rows = _count(body.removeprefix(TEXT_ENCODER + "_"))
            return cls(TEXT_ENCODER, text_rows=rows, shape=shape) if rows is not None else None
        for v in ("cfg", "cond"):
            if body == CACHE_STEP + DENOISE_VARIANTS[v].suffix:
                return cls(CACHE_STEP, variant=v, shape=shape)
        for base in CHUNKED:
            for chunk in CHUNKS:
                if body == f"{base}_{chunk}":
                    return cls(base, chunk=chunk, shape=shape)
        for base in (CROSS_KV, DENOISE):
            if body == base or body.startswith(base + "_"):
                return _parse_dit(base, body.removeprefix(base), shape)
        return None


def _count(text: str) -> int | None:
    return int(text) if text.isdigit() and text.isascii() else None


def _parse_dit(base: str, rest: str, shape: str) -> Program | None:
    """A cross_kv or denoise program from what follows its base name: [_<expert+1>], then cross_kv's [_t<rows>] or
    denoise's [_<variant>][_stage<k>]."""
    expert = 0
    head, sep, tail = rest[1:].partition("_")
    if rest and (n := _count(head)) is not None and n >= 2:
        expert, rest = n - 1, sep + tail
    if base == CROSS_KV:
        if not rest:
            return Program(CROSS_KV, expert=expert, shape=shape)
        rows = _count(rest.removeprefix(ROWS_SUFFIX)) if rest.startswith(ROWS_SUFFIX) else None
        return Program(CROSS_KV, expert=expert, text_rows=rows, shape=shape) if rows is not None else None
    stage = None
    body, sep, k = rest.rpartition(STAGE_SUFFIX)
    if sep and (n := _count(k)) is not None:
        stage, rest = n, body
    for v in DENOISE_VARIANTS.values():
        if rest == v.suffix:
            return Program(DENOISE, expert=expert, variant=v.name, stage=stage, shape=shape)
    return None
