"""The DiT's programs of one shape: the denoise steps (one per variant, or a block loop's head, blocks and tail) and
Wan-Animate's face_motion program."""

from __future__ import annotations

from typing import Any

from jax.sharding import NamedSharding, PartitionSpec

from runtime import kinds
from runtime import scheduler as sched
from runtime.kinds import Kind
from runtime.manifest import BlockLoop, Chunks, FileRef, Geometry, ProgramSpec, Target, TensorSpec
from runtime.programs import Program

from . import denoise, denoise_blocks, face_motion, sharding
from .bundle_files import BundleFiles
from .shapes import dit_shape
from .source import Source
from .trace import Extracted, abstract_mesh


def export_face_motion(ex: Extracted, name: str, g: Geometry, model_dtype: Any, add_program: Any) -> None:
    """Wan-Animate's face_motion program `name` (export/face_motion.py) for shape `g`: a face video of the shape's
    frames at motion_encoder_size x motion_encoder_size, float32 in [-1, 1], to the face encoder's vectors."""
    size = int(ex.module.config.motion_encoder_size)
    add_program(name, "transformer", face_motion.build(ex, model_dtype),
                {"face": TensorSpec((1, 3, g.frames, size, size), "float32")}, ["motion"])


def export_denoise(src: Source, ex: Extracted, block: Extracted, kind: Kind, geo: Geometry, target: Target,
                   order: int, model_dtype: Any, extras: dict[str, TensorSpec], files: BundleFiles,
                   step_programs: list[Program], chunks: Chunks | None = None) -> None:
    """The first expert's denoise programs `step_programs` of one shape and pyramid stage (one per variant,
    kinds.DENOISE_VARIANTS), for the DiT's latent geometry `geo`, each traced with the DiT layout of its batch
    (export/sharding.py): 2B for the CFG ones, B for the cond-only one. Those that run the blocks take the cross_kv
    program's keys and values (exported before them), replicated: the cross-attention layout wants them whole on
    every device (export/attention.py).

    A variant that runs the transformer blocks runs them as one block program per batch size, called once per
    block (export/denoise_blocks.py; `block` extracts block 0 of the DiT): the program's own file is the head,
    and its tail is listed beside it; with cross_kv_t<T> programs, a block program per T too, for their keys and
    values. The variants of one batch size share their head and block programs (traced once), so a variant costs
    its tail. MagCache's cached step runs no block and stays one program, taking no kv."""
    add_program, write_program, programs = files.add_program, files.write_program, files.programs
    # what the programs' names end with, after the variant's: the pyramid stage's, the shape's (block and tail files)
    suffix = step_programs[0].name.removeprefix(step_programs[0].replace(stage=None, shape="").name)
    patch = tuple(src.transformer_config["patch_size"][1:])
    L = geo.max_sequence_length
    kv = programs[kinds.cross_kv_program(0)].outputs["kv"]
    short_kv = {t: programs[kinds.cross_kv_program(0, t)].outputs["kv"] for t in kinds.short_text_lengths(L)
                if kinds.cross_kv_program(0, t) in programs}
    tokens = dit_shape(src, geo).tokens
    layers = len(ex.module.blocks)
    block_files: dict[tuple[int, int], FileRef] = {}  # by (batch, text rows; L: the whole text)
    heads: dict[int, tuple[FileRef, dict[str, TensorSpec], denoise_blocks.Carry]] = {}  # by batch
    tensors = {k: f"{denoise_blocks.BLOCK_PREFIX}0.{k}" for k in block.weights}
    frames = geo.latent_shape[2] if kind.forcing else None  # diffusion forcing: a timestep and a row per frame
    shared = ("kv", "causal_block") if kind.forcing else ("kv",)  # what the blocks take, not the head and tail
    for p in step_programs:
        v = p.denoise_variant
        batch = (2 if v.cfg else 1) * geo.batch
        layout = sharding.dit_layout(target.mesh, batch, tokens)
        name = p.name
        inputs = {
            "state": TensorSpec((sched.state_rows(order), *geo.latent_shape), "float32"),
            "kv": kv,
            "timestep": TensorSpec(() if frames is None else (frames,), "float32"),
            "guidance": TensorSpec((), "float32"),
            "row": TensorSpec((sched.row_size(order),) if frames is None else (frames, sched.row_size(order)),
                              "float32"),
            **extras,
        }
        outputs, out_partition = ["state", "finite"], [PartitionSpec(), PartitionSpec()]
        if v.residual == "in":  # as the "residual" variant (exported before this one) returns it
            inputs["residual"] = programs[p.replace(variant="residual").name].outputs["residual"]
        if v.residual == "out":
            outputs.append("residual")
            out_partition.append(layout.hidden)
        with sharding.use_layout(layout):
            # What runs no block takes no kv: the whole step is traced with zeros there, which nothing reads.
            step = denoise.build(ex, order, model_dtype, kind, L, patch, v,
                                 (chunks or Chunks()).history_sizes)
            no_kv = denoise.without(step, list(inputs), {k: inputs[k] for k in shared})
            without_kv = {k: t for k, t in inputs.items() if k not in shared}
            if v.residual == "in":
                add_program(name, "transformer", no_kv, without_kv, outputs, {"residual": layout.hidden},
                            tuple(out_partition))
                continue
            hidden = layout.hidden
            # A VACE model's head runs the VACE blocks (their cross-attention reads kv): its head and tail take every
            # input (BlockLoop.head_takes_shared), and it carries the hints, split like the hidden states.
            own_step, own_inputs = (step, inputs) if kind.vace else (no_kv, without_kv)
            if not kind.block_loop:  # one program per variant
                add_program(name, "transformer", step, inputs, outputs, output_partition=tuple(out_partition))
                continue
            # A VACE head's hints (VACE layers, B, S, dim) split over tp on dim too (it divides: check_dit made the
            # heads divide), each block gathering its one hint where it adds it: the 14B's 8 at 720p x 81 are 6.2 GB
            # per device whole. Its head on tpu-v5e-8 needed 22.0 GiB of temporaries with them whole, 15.9 with the
            # stack split, 3.4 with each hint scaled and split as its VACE block makes it (denoise_blocks.head)
            hint = PartitionSpec(*hidden[:-1], "tp")
            hints = PartitionSpec(None, *hint)
            if batch not in heads:  # the step up to the first block is the same for every variant of this batch
                carry = denoise_blocks.Carry()
                scale_at = list(inputs).index("control_scale") if kind.vace else None
                head_outputs = denoise_blocks.VACE_HEAD_OUTPUTS if kind.vace else denoise_blocks.HEAD_OUTPUTS
                head, carried = write_program(name, "transformer",
                                              denoise_blocks.head(ex, own_step, carry, scale_at, kind.forcing,
                                                                  NamedSharding(abstract_mesh(target), hint)
                                                                  if kind.vace else None),
                                              own_inputs, head_outputs,
                                              output_partition=(hidden, PartitionSpec(), PartitionSpec(),
                                                                *([hints] if kind.vace else [])))
                heads[batch] = head, carried, carry
            head, carried, carry = heads[batch]
            for t, t_kv in [(L, kv), *short_kv.items()]:  # one block program per batch size, shared by the variants
                if (batch, t) not in block_files:
                    rows = "" if t == L else f"_t{t}"
                    block_files[batch, t], _ = write_program(
                        f"denoise_block_{batch}{rows}{suffix}", "transformer",
                        denoise_blocks.block(block, carry, kind.image_encoder, L - t,
                                             denoise_blocks.vace_index(ex.module) if kind.vace else None,
                                             kind.forcing),
                        {**carried, "kv": t_kv, **{k: inputs[k] for k in shared[1:]}, "layer": TensorSpec((), "int32")},
                        ["hidden"],
                        {"hidden": hidden, "hints": hints}, hidden, tensors)
            tail_name = f"{kinds.denoise_program(0, v.name)}_tail{suffix}"
            tail, outs = write_program(tail_name, "transformer", denoise_blocks.tail(ex, own_step),
                                       {**own_inputs, "hidden": carried["hidden"]}, outputs,
                                       {"residual": hidden, "hidden": hidden}, tuple(out_partition))
            loop = BlockLoop(block=block_files[batch, L], tail=tail, layers=layers, prefix=denoise_blocks.BLOCK_PREFIX,
                             shared=shared, short_blocks={str(t): block_files[batch, t] for t in short_kv},
                             head_takes_shared=kind.vace)
            programs[name] = ProgramSpec(file=head.file, sha256=head.sha256, weights="transformer", inputs=inputs,
                                         outputs=outs, blocks=loop)
