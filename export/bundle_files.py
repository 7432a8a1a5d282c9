"""A bundle's files as the export writes them: weights, programs and the tokenizer, into a temporary sibling of the
bundle's directory that takes its place only when complete, so an interrupted export never leaves a bundle that
looks complete."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from jax.sharding import PartitionSpec

from runtime.files import process_alive
from runtime.manifest import FileRef, ProgramSpec, Target, TensorSpec, WeightFile, sha256_file

from . import sharding
from . import weights as weight_writer
from .trace import export_program

log = logging.getLogger("export")

# Weight group -> partition-rule family (export/sharding.py), in the order the export loads the components.
FAMILIES = {"text_encoder": "umt5", "image_encoder": "clip_vision", "transformer": "wan_transformer",
            "transformer_2": "wan_transformer", "vae": "wan_vae", "tiny_decoder": "taehv"}


class BundleFiles:
    """The files of a bundle being exported into `tmp` for `target` (weights only `with_weights`), and what the
    manifest says of them: each weight group's tensors and partitions, each program's file and signature."""

    def __init__(self, tmp: Path, target: Target, with_weights: bool) -> None:
        self.tmp, self.target, self.with_weights = tmp, target, with_weights
        self.programs: dict[str, ProgramSpec] = {}
        self.weight_files: dict[str, WeightFile] = {}
        self.partitions: dict[str, dict[str, PartitionSpec]] = {}

    def add_weights(self, group: str, weights: dict[str, Any], quantized: dict[str, str]) -> None:
        tensors = {k: weight_writer.spec(t) for k, t in weights.items()}
        self.partitions[group] = sharding.partitions(FAMILIES[group], tensors, quantized, self.target.mesh)
        file = sha = None
        if self.with_weights:
            log.info("writing %s weights", group)
            file = f"weights/{group}.safetensors"
            weight_writer.write(self.tmp / file, weights)
            sha = sha256_file(self.tmp / file)
        self.weight_files[group] = WeightFile(file=file, sha256=sha, tensors=dict(sorted(tensors.items())),
                                              partition={k: sharding.spec_to_json(p)
                                                         for k, p in sorted(self.partitions[group].items())},
                                              quantized=dict(sorted(quantized.items())))

    def write_program(self, name: str, group: str, fn: Any, inputs: dict[str, TensorSpec], outputs: list[str],
                      input_partition: dict[str, PartitionSpec] | None = None,
                      output_partition: Any = PartitionSpec(), tensors: dict[str, str] | None = None
                      ) -> tuple[FileRef, dict[str, TensorSpec]]:
        """Export fn to stages/<name>.jaxexport; its weights are the group's, or with `tensors` (the name fn
        uses -> the group's name) those tensors only. Returns the file and the output specs."""
        t0 = time.perf_counter()
        names = tensors or {k: k for k in self.weight_files[group].tensors}
        blob, outs = export_program(fn, {k: self.weight_files[group].tensors[g] for k, g in names.items()},
                                    {k: self.partitions[group][g] for k, g in names.items()}, inputs,
                                    input_partition or {}, outputs, output_partition, self.target)
        log.info("exported %s in %.2f s", name, time.perf_counter() - t0)
        rel = f"stages/{name}.jaxexport"
        (self.tmp / rel).write_bytes(blob)
        return FileRef(rel, sha256_file(self.tmp / rel)), outs

    def add_program(self, name: str, group: str, fn: Any, inputs: dict[str, TensorSpec], outputs: list[str],
                    input_partition: dict[str, PartitionSpec] | None = None,
                    output_partition: Any = PartitionSpec()) -> None:
        """`write_program`, listed in the manifest's programs as `name`."""
        ref, outs = self.write_program(name, group, fn, inputs, outputs, input_partition, output_partition)
        self.programs[name] = ProgramSpec(file=ref.file, sha256=ref.sha256, weights=group, inputs=inputs,
                                          outputs=outs)


def write_tokenizer(bundle: Path, tokenizer_json: str) -> FileRef:
    rel = "tokenizer/tokenizer.json"
    (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
    (bundle / rel).write_text(tokenizer_json)
    return FileRef(rel, sha256_file(bundle / rel))


def fresh_tmp(out: Path) -> Path:
    """An empty temporary sibling of `out` (same filesystem, so the final rename is atomic)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.partial-*"):  # left by an export that was killed
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not process_alive(int(pid)):
            log.info("removing %s, left by an interrupted export", stale)
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for sub in ("stages", "weights", "tokenizer"):
        (tmp / sub).mkdir(parents=True)
    return tmp


def replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished bundle into place (the old one, with --force, goes only after)."""
    if out.exists():
        trash = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(trash)
        tmp.rename(out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        tmp.rename(out)
