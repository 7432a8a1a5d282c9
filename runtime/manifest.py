"""The bundle manifest: the one contract between `export` and `runtime`.

A bundle is a directory::

    manifest.json                 this schema, as JSON
    stages/<program>.jaxexport    serialized jax.export programs (weights are arguments)
    weights/<group>.safetensors   one file per model component, tensors named as in torch
    tokenizer/tokenizer.json      a `tokenizers` fast tokenizer
    executables/<program>.xla     optional: each program compiled ahead for one host (runtime/executables.py)

Every file is listed with its sha256 and checked before use.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import types
import typing
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from . import kinds
from .errors import BundleError
from .programs import DENOISE, SHAPE_SEPARATOR, Program

# Schema history. Bump SCHEMA_VERSION on purpose, for any change an older runtime would misread, and
# add a migration from the previous version to MIGRATIONS (or let the old version be refused with a
# message that says to re-export). Keep a golden bundle of every readable version in artifacts/golden/.
#   1: first release.
#   2: target.device_kind, per-tensor partition specs, weights attached later (file/sha256 may be null).
#   3: model kinds (runtime/kinds.py): kind, boundary_ratio, image_processor; programs may share a file
#      (the second expert's denoise_step_2); geometry.latent_channels is the VAE's z_dim.
#   4: cross_kv programs (cross-attention keys and values once per prompt); the denoise programs take their
#      `kv` instead of `context` (and CLIP kinds' `image_embeds`).
#   5: a denoise program may run its transformer blocks as a program of their own (ProgramSpec.blocks): its file
#      is then the head, and the block and tail programs are listed beside it.
#   6: short-prompt programs (CPU targets): cross_kv_t<T> programs and BlockLoop.short_blocks, keys and values over
#      a prompt's first T text rows and one row for the rest; a block loop's head and tail no longer take the
#      shared inputs (kv), nor does MagCache's cached step.
#   7: several shapes per bundle: `shapes` (a Geometry each, the default first) replaces `geometry`; the programs of
#      the shapes after the first that depend on the shape are named "<program>@<W>x<H>x<F>" (the DiT's) or
#      "<program>@<W>x<H>" (the VAE's), see Manifest.program_for.
#   8: quantized weights: Manifest.quantize (the --quantize mode or null) and WeightFile.quantized (each quantized
#      tensor -> its mode; its scale is the tensor "<name>_scale", export/quantize.py).
#   9: samplers (runtime/samplers.py): the denoise programs take the timestep as float32 (Euler's are fractional;
#      older programs take int32), and Defaults has the run's sampler, custom sigmas and second guidance. Video in:
#      the VACE kinds, Geometry.reference_images (their DiT programs' extra leading latent frames, per count), and
#      Manifest.video_to_video (a text-to-video bundle with the VAE encoder for a source video).
#  10: Defaults.timestep_scale: the DiT is fed t = sigma x timestep_scale (released Wan: 1000; a TorchTitan-trained
#      checkpoint: 1, export --defaults timestep_scale=1); older bundles' DiTs all take sigma x 1000.
#  11: Manifest.executables: programs compiled ahead (export --precompile, `python -m export precompile`), each with
#      the key it was built for (ExecutableKey); a runtime whose host matches the key loads them instead of compiling.
#  12: an executable's file is XLA's own serialized executable (no Python object in it); schema 11's were jax's
#      pickled wrapper around those bytes, which this runtime never unpickles: the migration drops them, and such a
#      bundle compiles its programs where it runs, as before its precompile (re-run `python -m export precompile`).
SCHEMA_VERSION = 12
MANIFEST_FILE = "manifest.json"
SCALE_SUFFIX = "_scale"  # a quantized tensor's per-row scale is the tensor "<name>_scale" (export/quantize.py)


def _from_v1(d: dict[str, Any]) -> dict[str, Any]:
    """v1 bundles are single-device: no device kind, and weights unpartitioned (replicated)."""
    d = copy.deepcopy(d)
    d["target"].setdefault("device_kind", "")
    for w in d["weights"].values():
        w.setdefault("partition", {})
    d["schema_version"] = 2
    return d


def _from_v2(d: dict[str, Any]) -> dict[str, Any]:
    """v2 bundles are all Wan 2.1 text-to-video."""
    d = copy.deepcopy(d)
    d.update(kind="t2v", boundary_ratio=None, image_processor=None, schema_version=3)
    return d


def _from_v3(d: dict[str, Any]) -> dict[str, Any]:
    """v3 bundles have no cross_kv programs; their denoise programs, which take the embeddings, run as they are
    (the runtime tells them apart by the programs they hold: runtime/signatures.py, Pipeline.precomputes_kv)."""
    d = copy.deepcopy(d)
    d["schema_version"] = 4
    return d


def _from_v4(d: dict[str, Any]) -> dict[str, Any]:
    """v4 bundles run every program whole (no ProgramSpec.blocks)."""
    d = copy.deepcopy(d)
    d["schema_version"] = 5
    return d


def _from_v5(d: dict[str, Any]) -> dict[str, Any]:
    """v5 block loops pass the shared inputs (kv) to the head and tail too, and have no short-prompt blocks."""
    d = copy.deepcopy(d)
    for p in d["programs"].values():
        if p.get("blocks") is not None:
            p["blocks"]["head_takes_shared"] = True
    d["schema_version"] = 6
    return d


def _from_v6(d: dict[str, Any]) -> dict[str, Any]:
    """v6 bundles have one shape, their geometry."""
    d = copy.deepcopy(d)
    d["shapes"] = [d.pop("geometry")]
    d["schema_version"] = 7
    return d


def _from_v7(d: dict[str, Any]) -> dict[str, Any]:
    """v7 bundles hold no quantized weights."""
    d = copy.deepcopy(d)
    d["quantize"] = None
    for w in d["weights"].values():
        w["quantized"] = {}
    d["schema_version"] = 8
    return d


def _from_v8(d: dict[str, Any]) -> dict[str, Any]:
    """v8 bundles run UniPC by default, on its own schedule, the second expert at the first's guidance; their
    programs take the timestep as int32 (the manifest's input specs say so, and the runtime casts)."""
    d = copy.deepcopy(d)
    d["defaults"].update(sampler="unipc", sigmas=None, guidance_2=None)
    d["schema_version"] = 9
    return d


def _from_v9(d: dict[str, Any]) -> dict[str, Any]:
    """v9 bundles' DiTs take released Wan's timesteps, sigma x 1000."""
    d = copy.deepcopy(d)
    d["defaults"]["timestep_scale"] = 1000.0
    d["schema_version"] = 10
    return d


def _from_v10(d: dict[str, Any]) -> dict[str, Any]:
    """v10 bundles hold no executables compiled ahead: every program is compiled where it runs."""
    d = copy.deepcopy(d)
    d["executables"] = []
    d["schema_version"] = 11
    return d


_said_v11: set[str] = set()


def _from_v11(d: dict[str, Any]) -> dict[str, Any]:
    """v11 executables are jax pickles, which are never unpickled: they are dropped (the programs compile where they
    run), with one log line per bundle saying so."""
    d = copy.deepcopy(d)
    if d.get("executables") and d.get("bundle_id") not in _said_v11:
        _said_v11.add(d.get("bundle_id"))
        logging.getLogger("runtime").warning(
            "not loading the bundle's %d executables compiled ahead: schema 11 wrote them as Python pickles, which "
            "this runtime never reads; it compiles its programs (re-run `python -m export precompile BUNDLE`)",
            len(d["executables"]))
    d["executables"] = []
    d["schema_version"] = 12
    return d


# version -> function taking that version's JSON to the next version's
MIGRATIONS = {1: _from_v1, 2: _from_v2, 3: _from_v3, 4: _from_v4, 5: _from_v5, 6: _from_v6, 7: _from_v7,
              8: _from_v8, 9: _from_v9, 10: _from_v10, 11: _from_v11}


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(shape=tuple(int(s) for s in d["shape"]), dtype=str(d["dtype"]))


@dataclass(frozen=True)
class FileRef:
    file: str
    sha256: str


@dataclass(frozen=True)
class BlockLoop:
    """A program run as head -> block x layers -> tail (export/denoise_blocks.py). The head is the program's own
    file: it takes the program's inputs but `shared` and returns the block's leading inputs (hidden states first).
    The block program takes block i's tensors of the group (named `prefix` + "<i>." + the name the block program
    uses), the head's outputs with the hidden states replaced by the previous block's, then the program's `shared`
    inputs and the block index (int32), and returns the hidden states. The tail takes the head's inputs and the
    last block's hidden states and returns the program's outputs.

    `short_blocks` ("<T>": file): block programs for a short prompt's keys and values, as the cross_kv_t<T>
    programs make them (export/cross_kv.py); the runtime runs the one whose kv the step is given. v5 bundles
    (`head_takes_shared`) pass the shared inputs to the head and tail too."""

    block: FileRef
    tail: FileRef
    layers: int
    prefix: str
    shared: tuple[str, ...]
    short_blocks: dict[str, FileRef] = dataclasses.field(default_factory=dict)
    head_takes_shared: bool = False

    def file(self, part: str) -> FileRef:
        """The file of part "block", "tail" or "block_t<T>" (a short prompt's block)."""
        if part in ("block", "tail"):
            return getattr(self, part)
        rows = part.removeprefix(SHORT_BLOCK)
        if not part.startswith(SHORT_BLOCK) or rows not in self.short_blocks:
            raise BundleError(f"this block loop has no part {part!r}: re-export the bundle")
        return self.short_blocks[rows]


SHORT_BLOCK = "block_t"  # the part name of a short prompt's block program: "block_t<T>"


@dataclass(frozen=True)
class ProgramSpec:
    """One serialized program. `weights` names the weight group passed as its first argument. With `blocks`,
    the program runs in three parts (BlockLoop), `file` being the first."""

    file: str
    sha256: str
    weights: str
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    blocks: BlockLoop | None = None

    @property
    def parts(self) -> tuple[str, ...]:
        """"" (the program's own file), then for a block loop "block", "tail" and the short prompts' blocks."""
        if self.blocks is None:
            return ("",)
        return ("", "block", "tail", *[SHORT_BLOCK + t for t in sorted(self.blocks.short_blocks, key=int)])

    def files(self) -> list[FileRef]:
        """The program's files: its own, and its block loop's."""
        return [FileRef(self.file, self.sha256)] + [self.blocks.file(p) for p in self.parts[1:]]


@dataclass(frozen=True)
class WeightFile:
    """One component's weights. `partition` is each tensor's PartitionSpec over the target mesh, as
    JSON (None, an axis name, or a list of axis names per dimension). `file` and `sha256` are None
    in a bundle exported with --no-weights until weights are attached. `quantized` names each tensor stored
    quantized and its mode; its per-row scale is the tensor `<name>_scale` (export/quantize.py)."""

    file: str | None
    sha256: str | None
    tensors: dict[str, TensorSpec]
    partition: dict[str, list[Any]] = dataclasses.field(default_factory=dict)
    quantized: dict[str, str] = dataclasses.field(default_factory=dict)

    def scale_of(self, name: str) -> str | None:
        """The scale tensor of quantized tensor `name` (None: `name` is not quantized)."""
        return name + SCALE_SUFFIX if name in self.quantized else None


@dataclass(frozen=True)
class Target:
    """A platform and a device mesh (axes in device order)."""

    name: str
    platform: str
    mesh: dict[str, int]
    device_kind: str = ""  # e.g. "TPU v6 lite"; recorded in the programs' abstract mesh

    @property
    def num_devices(self) -> int:
        n = 1
        for size in self.mesh.values():
            n *= size
        return n


@dataclass(frozen=True)
class ExecutableKey:
    """What an executable compiled ahead was built for: a host loads it only where all of it matches its own
    (runtime/executables.py host_key), else compiles the program as a bundle without executables does."""

    platform: str  # "cpu", "tpu", "cuda"
    chip: str  # the devices' device_kind ("TPU v6 lite", "cpu", the GPU's name)
    topology: str  # TPU: libtpu's topology name ("v6e:2x4"); "" elsewhere
    devices: int  # devices of the mesh it runs on
    processes: int  # processes of the job (a multi-host slice: one per host)
    compiler: str  # "libtpu 0.0.42.1" for TPU; "jaxlib 0.10.2" (and the CUDA version) elsewhere
    jax: str
    options: dict[str, str]  # the XLA options it was compiled with (Bundle.compiler_options and XLA_FLAGS)
    cpu: str = ""  # CPU targets: the LLVM CPU XLA compiled for ("znver5")
    features: str = ""  # CPU targets: the instruction-set features XLA compiled for (LLVM's "+avx2,-avx512f,...")


@dataclass(frozen=True)
class Executable:
    """One program (or one `part` of its block loop) compiled ahead: the file of XLA's serialized executable."""

    program: str
    part: str  # "" (the program's own file), or a BlockLoop part ("block", "tail", "block_t<T>")
    file: str
    sha256: str
    bytes: int
    key: ExecutableKey


@dataclass(frozen=True)
class Geometry:
    """What the programs were traced for: pixels, frames, batch and the latent/text shapes they imply."""

    width: int
    height: int
    frames: int
    batch: int
    max_sequence_length: int
    latent_channels: int
    latent_frames: int
    latent_height: int
    latent_width: int
    text_dim: int
    temporal_scale: int
    spatial_scale: int
    reference_images: int = 0  # VACE: reference images, each a latent frame before the video's (kinds.Kind.vace)

    @property
    def latent_shape(self) -> tuple[int, int, int, int, int]:
        """The denoised latents: the video's latent frames, after the reference images' (VACE)."""
        return (self.batch, self.latent_channels, self.reference_images + self.latent_frames, self.latent_height,
                self.latent_width)

    @property
    def video_latent_shape(self) -> tuple[int, int, int, int, int]:
        """The video's latents, what the VAE decodes (the reference images' frames dropped)."""
        return (self.batch, self.latent_channels, self.latent_frames, self.latent_height, self.latent_width)

    @property
    def embeds_shape(self) -> tuple[int, int, int]:
        return (self.batch, self.max_sequence_length, self.text_dim)

    @property
    def size(self) -> str:
        """"<width>x<height>", as the OpenAI videos API and `--size` write it."""
        return f"{self.width}x{self.height}"

    @property
    def shape(self) -> tuple[int, int, int]:
        """(width, height, frames): the video a shape makes."""
        return (self.width, self.height, self.frames)

    @property
    def key(self) -> tuple[int, int, int, int]:
        """(width, height, frames, reference images): what a bundle's shapes are told apart by."""
        return (*self.shape, self.reference_images)

    def describe(self) -> str:
        """"64x32 x 9 frames" (", 1 reference image" where it takes some)."""
        refs = self.reference_images
        return f"{self.size} x {self.frames} frames" + (f", {refs} reference image{'s' * (refs > 1)}" if refs else "")


def shape_suffix(scope: str, g: Geometry, default: Geometry) -> str:
    """What the names of shape `g`'s programs of scope `scope` (kinds.shape_scope) end with in a bundle whose default
    shape is `default`: nothing for the default shape, or where the scope does not tell the two apart; else
    "@<W>x<H>x<F>" ("video"; "@<W>x<H>x<F>r<R>" for R reference images) or "@<W>x<H>" ("size")."""
    if scope == "video" and g.key != default.key:
        refs = f"r{g.reference_images}" if g.reference_images else ""
        return f"{kinds.SHAPE_SEPARATOR}{g.width}x{g.height}x{g.frames}{refs}"
    if scope == "size" and g.size != default.size:
        return f"{kinds.SHAPE_SEPARATOR}{g.size}"
    return ""


def bundle_programs(kind: kinds.Kind, shapes: typing.Sequence[Geometry], short_prompts: bool = False,
                    video_to_video: bool = False, tiny_decoder: bool = False, pyramid: int = 1
                    ) -> dict[Program, Geometry]:
    """Every program a bundle of `kind` and `shapes` (the default first) holds, named for its shape, with the shape it
    is made for: kinds.Kind.programs for each shape, a Helios pyramid of `pyramid` stages' lower stages' denoise
    programs too. A program whose shapes depend on no shape is made for the default one; one that depends on the size
    for the size's longest shape (its chunks serve every frame count of the size). The one list of a bundle's
    programs: the export builds it (export/build.py), Manifest.stages names it."""
    default = shapes[0]
    out: dict[Program, Geometry] = {}
    for g in shapes:
        longest = max((x for x in shapes if x.size == g.size), key=lambda x: x.latent_frames)
        for p in kind.programs(g.latent_frames, default.max_sequence_length, short_prompts, video_to_video,
                               tiny_decoder):
            at = {"video": g, "size": longest}.get(p.scope, default)
            shape = shape_suffix(p.scope, g, default).removeprefix(SHAPE_SEPARATOR)
            stages = range(pyramid) if p.base == DENOISE else (pyramid - 1,)
            for k in stages:
                out.setdefault(p.replace(shape=shape, stage=None if k == pyramid - 1 else k), at)
    return out


@dataclass(frozen=True)
class TinyDecoder:
    """A tiny decoder beside the VAE (export/tiny_decoder.py): its programs `tiny_decode_first` / `tiny_decode_next`
    and weight group `tiny_decoder` decode the same latents to [0, 1] frames, faster and coarser."""

    latents: str  # "normalized": takes the DiT's (Wan-normalised) latents | "raw": z * std + mean first (lighttae)
    variant: str  # "base" | "super" (TAEHV's two decoders)
    latent_channels: int
    file: str  # the name of the file it was read from (provenance)

    def describe(self) -> str:
        return f"{self.file} ({self.variant} TAEHV decoder, {self.latent_channels} channels, {self.latents} latents)"


@dataclass(frozen=True)
class Chunks:
    """How a Helios bundle makes a video in chunks (runtime/helios.py): the clean history each chunk sees, and the
    schedule its HeliosScheduler computes (the chunk's latent frames are the default shape's)."""

    history_sizes: tuple[int, ...] = (16, 2, 1)  # long, mid, short: latent frames of history at each scale
    patch_size: tuple[int, ...] = (1, 2, 2)  # the DiT's (t, h, w) patch: a chunk's tokens, for the shift
    use_dynamic_shifting: bool = True  # sigmas shifted by mu from the chunk's token count
    time_shift_type: str = "exponential"  # "exponential" | "linear"
    shift: float = 1.0  # the fixed shift where use_dynamic_shifting is False
    base_image_seq_len: int = 256  # calculate_shift's line: base_shift at base, max_shift at max tokens
    max_image_seq_len: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15
    # HeliosPyramidPipeline: each chunk in `stages` stages from 1/2^(stages-1) of the resolution up (the DiT's programs
    # of the lower stages are "<program>_stage<k>"), its scheduler's stage_range and gamma (the renoising between
    # stages); `distilled`: HeliosDMDScheduler's steps (x0, renoised towards the stage's start); `cfg_zero_star`:
    # CFG-Zero* guidance. 1 stage: HeliosPipeline.
    stages: int = 1
    stage_range: tuple[float, ...] = (0.0, 1 / 3, 2 / 3, 1.0)
    gamma: float = 1 / 3
    distilled: bool = False
    cfg_zero_star: bool = False


@dataclass(frozen=True)
class Defaults:
    """What a run uses where it says nothing: from the checkpoint, or set at export (`--defaults`)."""

    steps: int
    guidance: float
    flow_shift: float
    fps: int = 16
    sampler: str = "unipc"  # runtime/samplers.py SAMPLERS
    sigmas: tuple[float, ...] | None = None  # custom sigmas (one per step, before the shift), with `steps` of them
    guidance_2: float | None = None  # the second expert's guidance (None: `guidance`, as diffusers)
    # The DiT is fed t = sigma x timestep_scale: 1000 as released Wan was trained (the schedule's timesteps as they
    # are); TorchTitan's Wan trainer feeds t = sigma, so a checkpoint it trained samples right only with 1. A property
    # of the weights, not of a run: set at export (--defaults timestep_scale=1), never per request.
    timestep_scale: float = 1000.0


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    source: dict[str, Any]
    shapes: tuple[Geometry, ...]  # what the programs were traced for, the default first
    target: Target
    defaults: Defaults
    scheduler: dict[str, Any]
    dtype: str
    attention: dict[str, Any]
    programs: dict[str, ProgramSpec]
    weights: dict[str, WeightFile]
    tokenizer: FileRef | None
    versions: dict[str, str]
    kind: str = "t2v"  # a row of runtime/kinds.py
    boundary_ratio: float | None = None  # two experts: expert 1 where t >= boundary_ratio x num_train_timesteps
    image_processor: dict[str, Any] | None = None  # the CLIP stage's preprocessing (runtime/images.py)
    quantize: str | None = None  # the weights' quantization mode (export/quantize.py MODES), None: unquantized
    video_to_video: bool = False  # a text-to-video kind with the VAE encoder programs for a source video
    tiny_decoder: TinyDecoder | None = None  # a second, tiny decoder (export --tiny-decoder); None: the VAE's only
    chunks: Chunks | None = None  # Helios: its chunks' history and schedule (kinds.Kind.helios); None for the others
    executables: tuple[Executable, ...] = ()  # programs compiled ahead (schema 11), at most one per (program, part)
    bundle_id: str = ""

    @property
    def geometry(self) -> Geometry:
        """The default shape."""
        return self.shapes[0]

    def program_for(self, program: str, g: Geometry) -> str:
        """The name of program `program` (as kinds names it) for shape `g`: the name itself for the default shape
        and for programs that do not depend on the shape (kinds.shape_scope), else suffixed with what it depends
        on. A bundle of one shape, and every older bundle, therefore names its programs as before."""
        return program + shape_suffix(kinds.shape_scope(program), g, self.geometry)

    def stages(self, short_prompts: bool = False) -> tuple[str, ...]:
        """The programs a bundle of this kind and these shapes holds (kinds.Kind.stages, named for each shape; a
        Helios pyramid's lower stages' DiT programs too): `bundle_programs`' names."""
        return tuple(p.name for p in bundle_programs(kinds.get(self.kind), self.shapes, short_prompts,
                                                     self.video_to_video, self.tiny_decoder is not None,
                                                     self.chunks.stages if self.chunks is not None else 1))

    def find_shape(self, width: int | None = None, height: int | None = None, frames: int | None = None,
                   reference_images: int | None = None) -> Geometry | None:
        """The first of the bundle's shapes with this width, height, frames and reference images (None: any), or
        None."""
        for g in self.shapes:
            if (width in (None, g.width) and height in (None, g.height) and frames in (None, g.frames)
                    and reference_images in (None, g.reference_images)):
                return g
        return None

    def shapes_text(self) -> str:
        """The bundle's shapes for an error message: "64x32 x 9 frames (default), 32x64 x 9 frames"."""
        return ", ".join(g.describe() + (" (default)" if i == 0 else "") for i, g in enumerate(self.shapes))

    @property
    def reference_counts(self) -> list[int]:
        """The reference image counts the bundle's DiT programs serve (VACE; [0] for other kinds)."""
        return sorted({g.reference_images for g in self.shapes})

    def files(self) -> list[FileRef]:
        """Every file the manifest lists, once (the experts' denoise programs share one file)."""
        refs = [ref for p in self.programs.values() for ref in p.files()]
        refs += [FileRef(w.file, w.sha256) for w in self.weights.values() if w.file is not None]
        if self.tokenizer is not None:
            refs.append(self.tokenizer)
        refs += [FileRef(e.file, e.sha256) for e in self.executables]
        return list(dict.fromkeys(refs))

    @property
    def has_weights(self) -> bool:
        return self.tokenizer is not None and all(w.file is not None for w in self.weights.values())

    def to_json(self) -> dict[str, Any]:
        return _encode(self)

    def with_id(self) -> Manifest:
        """The manifest with `bundle_id` set to the sha256 of its own canonical content."""
        return dataclasses.replace(self, bundle_id=content_id(self.to_json()))

    @classmethod
    def from_json(cls, d: Any) -> Manifest:
        """Decode manifest JSON of this or an older (migrated) schema version."""
        version = schema_version(d)
        try:
            while version < SCHEMA_VERSION:
                d = MIGRATIONS[version](d)
                version = d["schema_version"]
            m = _decode(cls, d)
            if not m.shapes:
                raise ValueError("it lists no shapes")
            return m
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise BundleError(f"manifest.json is malformed ({type(e).__name__}: {e}): re-export the bundle") from None


def schema_version(d: Any) -> int:
    """The manifest's schema version, if this runtime reads it (directly or by migration)."""
    if not isinstance(d, dict):
        raise BundleError("manifest.json is not a JSON object: re-export the bundle")
    version = d.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise BundleError(f"manifest.json has no valid schema_version ({version!r}): re-export the bundle")
    if version > SCHEMA_VERSION:
        raise BundleError(f"bundle schema version {version} is newer than this runtime reads ({SCHEMA_VERSION}): "
                          "upgrade the runtime (wan-aot) to the exporter's version")
    oldest = SCHEMA_VERSION
    while oldest - 1 in MIGRATIONS:
        oldest -= 1
    if version < oldest:
        raise BundleError(f"bundle schema version {version} is no longer supported (this runtime reads "
                          f"{oldest}..{SCHEMA_VERSION}): re-export the bundle")
    return version


def content_id(data: dict[str, Any]) -> str:
    """A bundle's id: sha256 of its manifest's canonical JSON without the id itself (16 hex digits)."""
    body = {k: v for k, v in data.items() if k != "bundle_id"}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()[:16]


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=True) + "\n"


def _encode(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v) for v in obj]
    return obj


def _decode(tp: Any, value: Any) -> Any:
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError(f"{tp.__name__} must be an object")
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = _decode(hints[f.name], value[f.name])
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise KeyError(f"{tp.__name__}.{f.name}")
        return tp(**kwargs)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):  # X | None
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _decode(inner, value)
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError("expected an object")
        return {str(k): _decode(args[1], v) for k, v in value.items()}
    if origin is tuple:
        return tuple(_decode(args[0], v) for v in value)
    if tp in (int, float, str):
        if tp is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, tp) or isinstance(value, bool):
            raise TypeError(f"expected {tp.__name__}, got {value!r}")
        return value
    return value


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def resolve(bundle: Path, rel: str) -> Path:
    """A manifest path inside the bundle; refuses absolute paths and `..` escapes."""
    p = PurePosixPath(rel)
    if p.is_absolute() or ".." in p.parts or rel.strip() == "" or "\\" in rel:
        raise BundleError(f"manifest path {rel!r} escapes the bundle: the bundle is corrupt or hostile, re-export it")
    full = (bundle / Path(*p.parts)).resolve()
    if bundle.resolve() not in full.parents:
        raise BundleError(f"manifest path {rel!r} escapes the bundle: the bundle is corrupt or hostile, re-export it")
    return full


def read(bundle: Path) -> Manifest:
    path = bundle / MANIFEST_FILE
    if not bundle.is_dir():
        raise BundleError(f"{bundle} is not a bundle directory: pass the directory `python -m export` wrote")
    if not path.is_file():
        raise BundleError(f"{bundle} has no {MANIFEST_FILE}: it is not a complete bundle, re-export it")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{path} is not valid JSON ({e}): re-export the bundle") from None
    schema_version(data)  # first: a newer schema may define its id differently
    # The id covers the manifest as written (before any migration), so old bundles keep their ids.
    if data.get("bundle_id") != content_id(data):
        raise BundleError(f"{path} was modified after export (its bundle_id does not match its content): re-export it")
    return Manifest.from_json(data)


def check_file(bundle: Path, ref: FileRef) -> Path:
    """The path of a listed file, after checking that it exists and matches its sha256."""
    path = resolve(bundle, ref.file)
    if not path.is_file():
        raise BundleError(f"bundle file {ref.file} is missing: re-copy or re-export the bundle")
    if sha256_file(path) != ref.sha256:
        raise BundleError(f"bundle file {ref.file} does not match its sha256 in the manifest "
                          "(tampered or truncated): re-copy or re-export the bundle")
    return path


def verify_files(bundle: Path, manifest: Manifest) -> None:
    """Check every file the manifest lists against its sha256."""
    for ref in manifest.files():
        check_file(bundle, ref)
