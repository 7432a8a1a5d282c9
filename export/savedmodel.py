"""A finished bundle as a TensorFlow SavedModel in TF Serving's layout, with orbax-export.

    DIR/1/saved_model.pb, DIR/1/variables/   the SavedModel (version 1): one serving signature per
                                             program, plus `initial_latents` (the runtime's noise)
    DIR/wan-aot.json                         what a client needs beside it (INFO_FILE below)
    DIR/tokenizer.json                       the bundle's tokenizer

Each signature runs the bundle's own jax.export program: the orbax `JaxModule` method calls the
deserialized `Exported`, and jax2tf (native serialization) wraps that same StableHLO in an
XlaCallModule op, so TF runs exactly what the runtime runs (a denoise step whose blocks are a program of
their own runs its head, its block program once per block and its tail in one signature). Weights become
tf.Variables (bf16 stays bf16); programs that share a weight group share its variables (the VAE's, a two-expert bundle's
`denoise_step` / `denoise_step_2` program with their own groups).

This step reads only the bundle: no torch, torchax or diffusers (a test blocks them). The programs
are the ones in the bundle, so only single-device `cpu` and `cuda` bundles convert: a TPU bundle's
DiT calls the Pallas kernel (a `tpu_custom_call` only a TPU can run) and a multi-device bundle's
programs are partitioned for a mesh a SavedModel signature does not have.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from runtime import kinds
from runtime import manifest as mf
from runtime.errors import UserError
from runtime.extras import pip_command
from runtime.signatures import call_order

log = logging.getLogger("export")

PIP = pip_command("savedmodel")
VERSION = "1"  # TF Serving loads the highest numbered subdirectory
INFO_FILE = "wan-aot.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT = "wan-aot-savedmodel"
NOISE = "initial_latents"  # the signature that draws the runtime's initial noise from a seed
PLATFORMS = ("cpu", "cuda")


def import_tf() -> tuple[Any, Any]:
    """(tensorflow, orbax.export), or the one-line error that names the pip command."""
    try:
        import tensorflow as tf
        from orbax import export as oex
    except ImportError as e:
        raise UserError(f"python -m export savedmodel needs TensorFlow and orbax-export ({e.name or e} is not "
                        f"installed): {PIP}") from None
    return tf, oex


def check_convertible(manifest: mf.Manifest, bundle: Path) -> None:
    """Refuse, in one line, a bundle whose programs a SavedModel cannot carry or that has no weights."""
    t = manifest.target
    if t.platform == "tpu":
        raise UserError(f"{bundle} is a TPU bundle (target {t.name}): its DiT calls the Pallas TPU kernel, which TF "
                        "cannot run outside a TPU; export a cpu or cuda bundle for the SavedModel "
                        "(python -m export --target cpu|cuda ...)")
    if t.platform not in PLATFORMS:
        raise UserError(f"{bundle} targets {t.platform}; a SavedModel is made from a cpu or cuda bundle")
    if t.num_devices != 1:
        raise UserError(f"{bundle} is partitioned over {t.num_devices} devices (target {t.name}); a SavedModel "
                        "signature runs on one device: export the bundle with --target cpu or cuda")
    if not manifest.has_weights:
        raise UserError(f"{bundle} has no weights (exported with --no-weights): attach them first with "
                        f"python -m export attach {bundle} --weights CHECKPOINT")


def convert(bundle: Path, out: Path, force: bool = False, validate: bool = False) -> dict[str, Any]:
    """Write the SavedModel of `bundle` to `out` (all or nothing); returns what INFO_FILE records.

    With `validate`, every signature is run once in TF and in JAX on the same inputs (orbax's
    ValidationManager) before the directory is put in place; cpu bundles only.
    """
    if out.exists() and not force:
        raise UserError(f"{out} already exists: choose another --out or pass --force to replace it")
    manifest = mf.read(bundle)
    check_convertible(manifest, bundle)
    if validate and manifest.target.platform != "cpu":
        raise UserError("--validate runs the programs here, on the CPU: it needs a cpu bundle")
    tf, oex = import_tf()

    import jax

    from runtime.bundle import open_bundle

    b = open_bundle(bundle, on_host=True)  # checks every file against the manifest; weights on the host CPU
    kind = kinds.get(manifest.kind)
    platform = manifest.target.platform
    groups: dict[str, str] = {}  # weight group -> the first program that takes it (its layout)
    for name, spec in manifest.programs.items():
        groups.setdefault(spec.weights, name)
    params = {g: b.weights(g, program) for g, program in groups.items()}  # sha256-checked as they are read

    methods: dict[str, Any] = {}
    configs = []
    signatures: dict[str, Any] = {}
    # The signatures take the whole text's keys and values (`cross_kv`'s); the short-prompt programs of CPU bundles
    # (export/cross_kv.py) feed only the runtime's short block programs, which a signature does not run.
    L = manifest.geometry.max_sequence_length
    short = {kinds.cross_kv_program(e, t) for e in range(kind.experts) for t in kinds.short_text_lengths(L)}
    if len(manifest.shapes) > 1:
        log.info("the SavedModel carries the bundle's default shape, %s x %d frames, of its %d",
                 manifest.geometry.size, manifest.geometry.frames, len(manifest.shapes))
    for name, spec in manifest.programs.items():
        if name in short or kinds.base_program(name) != name:  # another shape's program
            continue
        order = call_order(name, kind, spec)
        methods[name] = _method(b.traceable(name), spec.weights, order.inputs, order.outputs)
        inputs = {n: spec.inputs[n] for n in order.inputs}
        configs.append(oex.ServingConfig(name, method_key=name, input_signature=[
            {n: tf.TensorSpec(s.shape, tf.dtypes.as_dtype(s.dtype), name=n) for n, s in inputs.items()}]))
        signatures[name] = {"weights": spec.weights,
                            "inputs": [_io(n, spec.inputs[n]) for n in order.inputs],
                            "outputs": [_io(n, spec.outputs[n]) for n in order.outputs]}
    g = manifest.geometry
    methods[NOISE] = _noise(g.latent_shape)
    configs.append(oex.ServingConfig(NOISE, method_key=NOISE, input_signature=[
        {"seed": tf.TensorSpec((), tf.uint32, name="seed")}]))
    signatures[NOISE] = {"weights": None, "inputs": [{"name": "seed", "shape": [], "dtype": "uint32"}],
                         "outputs": [{"name": "latents", "shape": list(g.latent_shape), "dtype": "float32"}]}

    module = oex.JaxModule(params, methods, trainable=False,
                           jax2tf_kwargs={k: {"native_serialization_platforms": (platform,)} for k in methods})
    info = {
        "format": FORMAT,
        "version": VERSION,
        "bundle_id": manifest.bundle_id,
        "kind": manifest.kind,
        "dtype": manifest.dtype,
        "platform": platform,
        "boundary_ratio": manifest.boundary_ratio,
        "image_processor": manifest.image_processor,
        "geometry": dataclasses.asdict(g),
        "defaults": dataclasses.asdict(manifest.defaults),
        "scheduler": manifest.scheduler,
        "tokenizer": TOKENIZER_FILE,
        "signatures": signatures,
        "versions": {"jax": jax.__version__, "tensorflow": tf.__version__, "orbax-export": oex.__version__},
    }
    tmp = _fresh_tmp(out)
    try:
        log.info("writing the SavedModel (%d signatures)", len(configs))
        oex.ExportManager(module, configs).save(str(tmp / VERSION))
        if validate:
            _validate(tf, oex, module, configs, tmp / VERSION, manifest)
        shutil.copyfile(mf.resolve(bundle, manifest.tokenizer.file), tmp / TOKENIZER_FILE)
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def _io(name: str, spec: mf.TensorSpec) -> dict[str, Any]:
    return {"name": name, "shape": list(spec.shape), "dtype": spec.dtype}


def _method(call: Any, group: str, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> Any:
    """apply_fn(params, {input: array}) -> {output: array} running the bundle's program (`Bundle.traceable`)."""
    import jax

    def apply(params: dict[str, Any], x: dict[str, Any]) -> dict[str, Any]:
        result = jax.tree.leaves(call(params[group], *[x[n] for n in inputs]))
        return dict(zip(outputs, result, strict=True))

    return apply


def _noise(shape: tuple[int, ...]) -> Any:
    """The runtime's initial noise (Pipeline.initial_latents) as a function of a uint32 seed: the same
    threefry bits, so a TF client and the runtime start from the same latents for the same seed."""
    import jax
    import jax.numpy as jnp

    def apply(params: dict[str, Any], x: dict[str, Any]) -> dict[str, Any]:
        del params
        return {"latents": jax.random.normal(jax.random.key(x["seed"]), shape, jnp.float32)}

    return apply


def _validate(tf: Any, oex: Any, module: Any, configs: list[Any], path: Path, manifest: mf.Manifest) -> None:
    """Every signature in TF against the same function in JAX, on one input each (orbax's validator)."""
    import numpy as np
    from orbax.export.validate import ValidationManager, ValidationReportOption

    rng = np.random.default_rng(0)
    inputs = {}
    for sc in configs:
        (sig,) = sc.input_signature
        inputs[sc.signature_key] = [{n: _sample(rng, s, n) for n, s in sig.items()}]
    loaded = tf.saved_model.load(str(path))
    tol = 1e-4 if manifest.dtype == "fp32" else 2e-2
    reports = ValidationManager(module, configs, inputs).validate(
        loaded, report_option=ValidationReportOption(floating_atol=tol, floating_rtol=tol))
    failed = [k for k, r in reports.items() if r.status.name != "Pass"]
    for key, r in reports.items():
        diff = r.outputs.get("FloatingPointDiffReport")
        log.info("validated %s: %s (max abs diff %s)", key, r.status.name, None if diff is None else diff.max_diff)
    if failed:
        raise UserError(f"validation failed: TF and JAX outputs differ beyond {tol} for {', '.join(failed)}")


def _sample(rng: Any, spec: Any, name: str) -> Any:
    """A valid input for a validation run: small token ids, an in-range timestep, bounded floats."""
    import numpy as np

    shape, dtype = tuple(spec.shape), spec.dtype.as_numpy_dtype
    if name == "ids":
        return rng.integers(0, 100, shape).astype(dtype)
    if name == "mask":
        return np.ones(shape, dtype)
    if name == "timestep":
        return np.asarray(500, dtype)
    if name == "seed":
        return np.asarray(7, dtype)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return np.zeros(shape, dtype)


def _fresh_tmp(out: Path) -> Path:
    """An empty temporary sibling of `out` (same filesystem, so the final rename is atomic)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished directory into place (an old one, with --force, goes only after)."""
    if not out.exists():
        tmp.rename(out)
        return
    trash = out.parent / f".{out.name}.old-{os.getpid()}"
    out.rename(trash)
    tmp.rename(out)
    with contextlib.suppress(OSError):
        shutil.rmtree(trash)
