"""Programs for TPU slices built on this CPU-only machine from an architecture name alone.

Real sizes: the Wan 2.2 / image-to-video family (two experts on a 4-chip v6e at 720p in two shapes, I2V with CLIP on 16
chips), VACE and Wan-Animate at 720p / 81 frames (77 for Animate) for tpu-v6e-8; in the slow tier, Wan2.1-14B's two
shapes for tpu-v6e-8, TI2V-5B at 121 frames, the fp8 I2V-A14B and the 1.3B at 480p for a 4-chip v6e.
Nothing runs here (no TPU); the tests read what was baked into the programs.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec

import runtime.manifest as mf
from export import sharding
from export.bundle_files import FAMILIES
from runtime import kinds
from runtime.bundle import partition_spec

from .conftest import OnDemand, run_cli, run_module

CASES = {  # name: (architecture, resolution, target, devices, heads, frames, --quantize)
    # two shapes (landscape and portrait), one copy of the weights
    "14b-720p-v6e-8": ("wan2.1-t2v-14b", "1280x720,720x1280", "tpu-v6e-8", 8, 40, 81, None),
    "1.3b-480p-v6e-4": ("wan2.1-t2v-1.3b", "480p", "tpu-v6e-4", 4, 12, 81, None),
    "t2v-a14b-720p-v6e-4": ("wan2.2-t2v-a14b", "720p,720x1280", "tpu-v6e-4", 4, 40, 81, "int8-dynamic"),
    "ti2v-5b-720p-v6e-8": ("wan2.2-ti2v-5b", "720p", "tpu-v6e-8", 8, 24, 121, None),
    "i2v-14b-720p-v6e-16": ("wan2.1-i2v-14b-720p", "720p", "tpu-v6e-16", 16, 40, 81, "int8"),
    "i2v-a14b-480p-v6e-8": ("wan2.2-i2v-a14b", "480p", "tpu-v6e-8", 8, 40, 81, "fp8"),
    # VACE: its VACE blocks beside the 40, programs for 0 and 1 reference images
    "vace-14b-720p-v6e-8": ("wan2.1-vace-14b", "720p", "tpu-v6e-8", 8, 40, 81, "int8"),
    # Wan-Animate: one 77-frame segment, the face_motion program, face adapters split and quantized like attention
    "animate-14b-720p-v6e-8": ("wan2.2-animate-14b", "720p", "tpu-v6e-8", 8, 40, 77, "int8"),
}


# The slow tier's cases: the 14B's, TI2V-5B's, the fp8 I2V-A14B's and the 1.3B's programs (an export each). The default
# run's cases cover each target (v6e-4: the A14B; v6e-8: VACE, Animate; v6e-16), one expert and two, two shapes (the
# A14B's landscape and portrait), CLIP, VACE, Animate, int8 and int8-dynamic; test_fit compiles a bundle without
# quantization for tpu-v6e-8 with libtpu.
SLOW = {"14b-720p-v6e-8", "ti2v-5b-720p-v6e-8", "i2v-a14b-480p-v6e-8", "1.3b-480p-v6e-4"}
# The default run's bundle of two shapes (landscape and portrait): one copy of each expert's weights.
TWO_SHAPES = "t2v-a14b-720p-v6e-4"


def _cases(names) -> list:
    """`names` as parameters, those of SLOW marked slow."""
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in names]


@pytest.fixture(scope="module")
def tpu_bundles(tmp_path_factory: pytest.TempPathFactory) -> OnDemand:
    root = tmp_path_factory.mktemp("tpu")

    def export(case: str) -> Path:
        arch, res, target, _, _, frames, quantize = CASES[case]
        quant = ["--quantize", quantize] if quantize else []
        run_module("export", "--model", arch, "--no-weights", "--resolution", res, "--frames", str(frames),
                   "--target", target, "--out", str(root / case), "-q", *quant)
        return root / case

    # the default run's two at a time, the slow tier's when first asked for. How long an export takes is a
    # benchmark's to say (tools/bench.py export, BENCHMARKS.md section 3), not a test's: a bound in seconds failed
    # every test here whenever the machine was busy.
    return OnDemand.start({case: functools.partial(export, case) for case in CASES},
                          now=[case for case in CASES if case not in SLOW])


def _program(bundle: Path, name: str) -> jax.export.Exported:
    """A program by its stage name, or by its file (stages/...)."""
    file = name if name.startswith("stages/") else f"stages/{name}.jaxexport"
    return jax.export.deserialize(bytearray((bundle / file).read_bytes()))


def _weight_specs(exp: jax.export.Exported) -> dict[str, PartitionSpec | None]:
    """Each weight's sharding in the program (None: the program does not use that tensor)."""
    (weights, *_), _ = jax.tree.unflatten(exp.in_tree, exp._in_named_shardings)
    return {k: None if s is None else s.spec for k, s in weights.items()}


def _program_specs(bundle: Path, prog: mf.ProgramSpec) -> dict[str, PartitionSpec | None]:
    """`_weight_specs` of a program, its block loop included: a block's tensors as its block program shards them
    (block i takes "blocks.<i>.<name>"), the others as its head or tail does."""
    specs = _weight_specs(_program(bundle, prog.file))
    if prog.blocks is None:
        return specs
    specs.update({k: v for k, v in _weight_specs(_program(bundle, prog.blocks.tail.file)).items() if v is not None})
    block = _weight_specs(_program(bundle, prog.blocks.block.file))
    for tensor in specs:
        if tensor.startswith(prog.blocks.prefix):
            index, name = tensor.removeprefix(prog.blocks.prefix).split(".", 1)
            assert int(index) < prog.blocks.layers and specs[tensor] is None, tensor  # only the block program
            specs[tensor] = block[name]
    return specs


@pytest.mark.parametrize("case", _cases(CASES))
def test_dit_program_has_the_tpu_kernel_and_the_mesh(tpu_bundles: dict[str, Path], case: str) -> None:
    arch, _, target, devices, heads, frames, _ = CASES[case]
    m = mf.read(tpu_bundles[case])
    kind = kinds.get(m.kind)
    assert m.target.name == target and m.target.num_devices == devices and not m.has_weights
    assert m.attention["dit"]["impl"] == "pallas-tpu-flash"
    assert m.source["config"]["transformer"]["num_attention_heads"] == heads
    assert m.geometry.frames == frames
    assert sorted(m.programs) == sorted(m.stages())
    # every denoise variant attends (in the kernel) but MagCache's cached step, which skips the blocks (Animate's
    # still runs its face adapters' attention, as diffusers' does)
    denoise = {kinds.denoise_program(e, v) for e in range(kind.experts) for v in kinds.DENOISE_VARIANTS
               if v != "cached" or kind.animate}
    for name, spec in m.programs.items():
        # a denoise step attends in its block program (run once per block), not in its head and tail (but a VACE
        # model's head, which runs the VACE blocks)
        base = kinds.base_program(name)
        files = [(spec.file, base in denoise and (spec.blocks is None or kind.vace))]
        if spec.blocks is not None:
            assert base in denoise and spec.blocks.layers == m.source["config"]["transformer"]["num_layers"]
            files += [(spec.blocks.block.file, True), (spec.blocks.tail.file, False)]
        for file, attends in files:
            exp = jax.export.deserialize(bytearray((tpu_bundles[case] / file).read_bytes()))
            assert exp.platforms == ("tpu",) and exp.nr_devices == devices
            mesh = next(s for s in exp._in_named_shardings if s is not None).mesh
            assert dict(zip(mesh.axis_names, mesh.axis_sizes)) == m.target.mesh
            assert mesh.abstract_device.device_kind == "TPU v6 lite"
            assert ("tpu_custom_call" in exp.mlir_module()) == attends, (name, file)


def test_model_kinds_from_architecture_names(tpu_bundles: dict[str, Path]) -> None:
    """Each name builds its kind's stages: two experts share one program, I2V has CLIP and a whole-video VAE encoder,
    VACE its blocks and reference shapes, Animate its face_motion program."""
    moe = mf.read(tpu_bundles["t2v-a14b-720p-v6e-4"])
    assert (moe.kind, moe.boundary_ratio) == ("t2v-moe", 0.875)
    assert moe.programs["denoise_step_2"].file == moe.programs["denoise_step"].file
    assert (moe.programs["denoise_step"].weights, moe.programs["denoise_step_2"].weights) == \
        ("transformer", "transformer_2")
    assert moe.weights["transformer_2"].tensors == moe.weights["transformer"].tensors
    tall = "denoise_step_2@720x1280x81"  # the second expert at the second shape: that shape's file, its weights
    assert moe.programs[tall].file == moe.programs["denoise_step@720x1280x81"].file != moe.programs["denoise_step"].file
    assert moe.programs[tall].weights == "transformer_2"
    i2v = mf.read(tpu_bundles["i2v-14b-720p-v6e-16"])
    assert i2v.kind == "i2v" and i2v.image_processor["crop_size"] == {"height": 224, "width": 224}
    assert i2v.programs["image_encoder"].outputs["image_embeds"].shape == (1, 257, 1280)
    assert i2v.programs["denoise_step"].inputs["condition"].shape == (1, 20, 21, 90, 160)
    assert i2v.programs["vae_encode_next"].inputs["pixels"].shape == (1, 3, 4, 720, 1280)
    vace = mf.read(tpu_bundles["vace-14b-720p-v6e-8"])
    assert vace.kind == "vace" and [g.reference_images for g in vace.shapes] == [0, 1]
    step, one_ref = vace.programs["denoise_step"], vace.programs["denoise_step@1280x720x81r1"]
    assert step.inputs["control"].shape == (1, 96, 21, 90, 160) and step.inputs["control_scale"].shape == (8,)
    assert one_ref.inputs["control"].shape == (1, 96, 22, 90, 160)  # the reference image's latent frame first
    assert one_ref.inputs["state"].shape[3] == 22 and step.blocks.head_takes_shared  # the head runs VACE's blocks
    assert vace.programs["cross_kv"].outputs["kv"].shape[0] == 40 + 8  # the VACE blocks' keys and values too
    assert vace.programs["vae_encode_next"].inputs["pixels"].shape == (1, 3, 4, 720, 1280)
    assert "vace_blocks.0.proj_in.weight" in vace.weights["transformer"].tensors
    animate = mf.read(tpu_bundles["animate-14b-720p-v6e-8"])
    assert (animate.kind, animate.defaults.steps, animate.defaults.guidance, animate.defaults.fps) == \
        ("animate", 20, 1.0, 30)
    assert [g.reference_images for g in animate.shapes] == [1]  # the character image's latent frame
    step = animate.programs["denoise_step"]
    assert step.blocks is None and step.inputs["state"].shape[3] == 21 and step.inputs["condition"].shape[1:3] == \
        (20, 21)
    assert step.inputs["pose"].shape == (1, 16, 20, 90, 160) and step.inputs["motion"].shape == (2, 1, 20, 5, 5120)
    assert animate.programs["face_motion"].inputs["face"].shape == (1, 3, 77, 512, 512)
    assert animate.programs["face_motion"].outputs["motion"].shape == (1, 20, 5, 5120)
    assert animate.weights["transformer"].quantized.get("face_adapter.7.to_out.weight") == "int8"


@pytest.mark.slow  # the slow tier's cases of the test above
def test_model_kinds_from_architecture_names_ti2v_and_i2v_moe(tpu_bundles: dict[str, Path]) -> None:
    """TI2V has 1280x704 at 720p and a one-frame VAE encoder; the I2V A14B no CLIP."""
    ti2v = mf.read(tpu_bundles["ti2v-5b-720p-v6e-8"])
    assert ti2v.kind == "ti2v" and (ti2v.geometry.width, ti2v.geometry.height) == (1280, 704)
    assert ti2v.geometry.latent_shape == (1, 48, 31, 44, 80) and ti2v.defaults.fps == 24
    assert ti2v.programs["denoise_step"].inputs["mask"].shape == (1, 1, 31, 44, 80)
    assert ti2v.programs["vae_encode_first"].inputs["pixels"].shape == (1, 3, 1, 704, 1280)
    i2v_moe = mf.read(tpu_bundles["i2v-a14b-480p-v6e-8"])
    assert (i2v_moe.kind, i2v_moe.boundary_ratio) == ("i2v-moe", 0.9) and "image_encoder" not in i2v_moe.programs


# MagCache's cached step skips the blocks and what only feeds them: the text and image
# embedders and the per-block timestep projection (the head's time embedding still runs).
BLOCKS_ONLY = ("blocks.", "condition_embedder.text_embedder.", "condition_embedder.time_proj.",
               "condition_embedder.image_embedder.", "vace_blocks.", "vace_patch_embedding.")
# What cross_kv computes once per prompt (export/cross_kv.py): the steps leave these weights unused, and it
# leaves every other weight of the DiT unused.
CROSS_KV = re.compile(r"((vace_)?blocks\.\d+\.attn2\.(to_k|to_v|norm_k|add_k_proj|add_v_proj|norm_added_k)"
                      r"|condition_embedder\.(text|image)_embedder)\.")
# What Wan-Animate's face_motion program runs once per segment (export/face_motion.py): the steps leave these unused,
# and it leaves every other weight unused.
FACE_MOTION = ("motion_encoder.", "face_encoder.")


@pytest.mark.parametrize("case", _cases(CASES))
def test_weights_are_sharded_as_the_table_says(tpu_bundles: dict[str, Path], case: str) -> None:
    check_weight_shardings(tpu_bundles[case])


def check_weight_shardings(bundle: Path) -> None:
    """Every program of `bundle` takes each weight as export/sharding.py's table splits it over the target's mesh (and
    the manifest says so); the DiT is Megatron-style over tp, the text encoder FSDP, the VAE replicated."""
    m = mf.read(bundle)
    layers = m.source["config"].get("image_encoder", {}).get("num_hidden_layers")
    for full, prog in m.programs.items():
        name = kinds.base_program(full)
        specs = _program_specs(bundle, prog)
        wf = m.weights[prog.weights]
        assert set(specs) == set(wf.tensors)
        # The VAE's decode programs don't use its encoder, nor encode programs its decoder.
        other = {"decode": ("encoder.", "quant_conv."), "encode": ("decoder.", "post_quant_conv.")}
        # CLIP's output is the penultimate layer's: its last layer and post-layernorm go unused.
        unused = [t for t, spec in specs.items() if spec is None
                  and not (name.startswith("vae_") and t.startswith(other[name.split("_")[1]]))
                  and not (name == "image_encoder" and t.startswith((f"encoder.layers.{layers - 1}.", "post_")))
                  and not (name.endswith("_cached") and t.startswith(BLOCKS_ONLY))
                  and not (name.startswith("denoise_step") and (CROSS_KV.match(t) or t.startswith(FACE_MOTION)))
                  and not (name.startswith("cross_kv") and not CROSS_KV.match(t))
                  and not (name == "face_motion" and not t.startswith(FACE_MOTION))]
        assert len(unused) <= 4, (name, unused)  # vae_decode_first skips the temporal upsamplers
        table = sharding.partitions(FAMILIES[prog.weights], wf.tensors, wf.quantized, m.target.mesh)
        for tensor, spec in specs.items():
            want = table[tensor]
            if tensor.endswith("_scale"):  # a quantized weight's per-row scale: split like the weight's rows
                rows = table[tensor.removesuffix("_scale")]
                assert want == (PartitionSpec(rows[0]) if len(rows) and rows[0] else PartitionSpec()), (name, tensor)
            assert want == partition_spec(wf.partition[tensor]), (name, tensor)
            assert spec in (want, None), (name, tensor)
    dit = _program_specs(bundle, m.programs["denoise_step"])
    if "face_adapter.0.to_q.weight" in dit:  # Wan-Animate's face adapters: as the blocks' attention
        assert dit["face_adapter.0.to_q.weight"] == PartitionSpec("tp")
        assert dit["face_adapter.0.to_out.weight"] == PartitionSpec(None, "tp")
    if "vace_blocks.0.attn1.to_q.weight" in dit:  # a VACE model's VACE blocks: the blocks' rules
        assert dit["vace_blocks.0.attn1.to_q.weight"] == PartitionSpec("tp")
        assert dit["vace_blocks.0.ffn.net.2.weight"] == PartitionSpec(None, "tp")
    assert dit["blocks.0.attn1.to_q.weight"] == PartitionSpec("tp")  # column-parallel
    assert dit["blocks.0.attn2.to_out.0.weight"] == PartitionSpec(None, "tp")  # row-parallel
    assert dit["blocks.0.ffn.net.0.proj.weight"] == PartitionSpec("tp")
    assert dit["blocks.0.ffn.net.2.weight"] == PartitionSpec(None, "tp")
    assert dit["scale_shift_table"] == PartitionSpec()
    te = _weight_specs(_program(bundle, "text_encoder"))
    assert te["shared.weight"] == PartitionSpec(("dp", "sp", "tp"))  # FSDP over every device
    assert all(s in (PartitionSpec(), None) for s in _weight_specs(_program(bundle, "vae_decode_next")).values())
    if "image_encoder" in m.programs:
        kv = _weight_specs(_program(bundle, "cross_kv"))
        assert kv["blocks.0.attn2.add_k_proj.weight"] == PartitionSpec("tp")  # image K/V, column-parallel
        assert kv["blocks.0.attn2.norm_added_k.weight"] == PartitionSpec("tp")
        assert kv["condition_embedder.image_embedder.ff.net.0.proj.weight"] == PartitionSpec()
        clip = _weight_specs(_program(bundle, "image_encoder"))
        assert clip["encoder.layers.0.mlp.fc1.weight"] == PartitionSpec(("dp", "sp", "tp"))
    if "vae_encode_first" in m.programs:
        assert all(s in (PartitionSpec(), None) for s in _weight_specs(_program(bundle, "vae_encode_first")).values())


def test_vae_activations_split_on_width_or_height(tpu_bundles: dict[str, Path]) -> None:
    """1280x720's latents are 160 wide: split on width over the 4 devices; 720x1280's are 90 wide (4 do not divide
    it) and 160 high: on height."""
    every = ("dp", "sp", "tp")
    for name, dim, frames in (("vae_decode_next", -1, (1, 4, 720, 1280, 3)),
                              ("vae_decode_next@720x1280", -2, (1, 4, 1280, 720, 3))):
        exp = _program(tpu_bundles[TWO_SHAPES], name)
        (_, *inputs), _ = jax.tree.unflatten(exp.in_tree, exp._in_named_shardings)
        (_, *avals), _ = jax.tree.unflatten(exp.in_tree, exp.in_avals)
        assert len(inputs) > 1  # the latents, then the caches
        for sharding_, aval in zip(inputs, avals):
            spec = tuple(sharding_.spec) + (None,) * (aval.ndim - len(sharding_.spec))
            assert spec == tuple(every if d == aval.ndim + dim else None for d in range(aval.ndim)), (name, spec)
        assert exp.out_avals[0].shape == frames


def test_several_shapes_share_the_weights_and_have_programs_each(tpu_bundles: dict[str, Path]) -> None:
    """The A14B bundle of two shapes: one set of weights (per expert); each shape's DiT traced for its own tokens (the
    latents of 720x1280 are 160 high and 90 wide), with the same weight shardings."""
    bundle = tpu_bundles[TWO_SHAPES]
    m = mf.read(bundle)
    assert [g.shape for g in m.shapes] == [(1280, 720, 81), (720, 1280, 81)]
    assert set(m.weights) == {"text_encoder", "transformer", "transformer_2", "vae"}
    for expert in ("denoise_step", "denoise_step_2"):
        wide, tall = m.programs[expert], m.programs[f"{expert}@720x1280x81"]
        assert wide.inputs["state"].shape[-2:] == (90, 160) and tall.inputs["state"].shape[-2:] == (160, 90)
        assert wide.file != tall.file and wide.blocks.block.file != tall.blocks.block.file
        assert wide.weights == tall.weights
        assert _program_specs(bundle, wide) == _program_specs(bundle, tall)
    assert "cross_kv@720x1280x81" not in m.programs and "text_encoder@720x1280x81" not in m.programs


def test_runtime_refuses_a_bundle_without_weights(tpu_bundles: dict[str, Path], tmp_path: Path) -> None:
    bundle = tpu_bundles["vace-14b-720p-v6e-8"]
    proc = run_cli("runtime", "generate", str(bundle), "--prompt", "x", "--out", str(tmp_path / "v.mp4"),
                      check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: bundle {bundle} has no weights attached (exported with --no-weights): "
                                   f"run `python -m export attach {bundle} --weights CHECKPOINT` first")
    assert not (tmp_path / "v.mp4").exists()


def _dots(text: str) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) element types of every dot_general in a StableHLO module's text."""
    out = []
    t = r"tensor<(?:\d+x)*([a-z]\w*)>"
    for m in re.finditer(rf"stablehlo\.dot_general[^\n]*: \({t}, {t}\) -> {t}", text):
        out.append(m.groups())
    return out


@pytest.mark.parametrize("case, storage", [("t2v-a14b-720p-v6e-4", "i8"), ("i2v-14b-720p-v6e-16", "i8"),
                                           pytest.param("i2v-a14b-480p-v6e-8", "f8E4M3FN", marks=pytest.mark.slow)])
def test_quantized_tpu_programs_take_8_bit_weights(tpu_bundles: dict[str, Path], case: str, storage: str) -> None:
    """The block programs take the 8-bit weights themselves: int8-dynamic's dots are int8 x int8 -> int32 (no float
    x int dot, which libtpu cannot run); int8 and fp8 convert the weight next to a bf16 dot."""
    m = mf.read(tpu_bundles[case])
    block = m.programs["denoise_step"].blocks.block
    exp = _program(tpu_bundles[case], block.file)
    weights = jax.tree.unflatten(exp.in_tree, exp.in_avals)[0][0]
    assert str(weights["attn1.to_q.weight"].dtype) == {"i8": "int8", "f8E4M3FN": "float8_e4m3fn"}[storage]
    assert weights["attn1.to_q.weight_scale"].shape == (weights["attn1.to_q.weight"].shape[0], 1)
    dots = _dots(exp.mlir_module())
    assert dots
    if m.quantize == "int8-dynamic":
        assert ("i8", "i8", "i32") in dots
        assert not [d for d in dots if ("i8" in d[:2]) != (d[:2] == ("i8", "i8"))]  # never float x int
    else:
        assert not [d for d in dots if storage in d] and ("bf16", "bf16", "f32") in dots
        assert f"tensor<{'x'.join(map(str, weights['attn1.to_q.weight'].shape))}x{storage}>" in exp.mlir_module()
