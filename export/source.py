"""Loading a diffusers-format Wan checkpoint (directory, hub id, an embedded tiny model), or only its
architecture (a named official one, or any checkpoint's configs) for a bundle without weights.

The model kind (runtime/kinds.py) is detected here, from model_index.json and the configs, and
nowhere else."""

from __future__ import annotations

import dataclasses
import inspect
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime import kinds
from runtime.errors import UserError
from runtime.kinds import Kind
from runtime.samplers import from_checkpoint

from . import architectures, tiny
from .vae_file import VaeFile


@dataclass
class Source:
    """Where the pipeline comes from, its configs, and loaders for one component at a time.

    Components are loaded on demand so that the build holds one of them in memory at a
    time (the real text encoder alone is 11 GB in bf16).
    """

    kind: str  # "tiny" | "directory" | "hub" | "architecture"
    id: str
    revision: str | None
    location: str | None
    dtype: str  # "bf16" | "fp32": text encoder, image encoder and DiT
    transformer_config: dict[str, Any]  # both experts' (they share one architecture)
    vae_config: dict[str, Any]
    text_encoder_config: dict[str, Any]
    scheduler_config: dict[str, Any]
    tokenizer_json: str | None
    keepalive: Any = None  # a TemporaryDirectory for the embedded model
    weights: bool = True  # False: components are built on `meta` from their configs (shapes only)
    model_kind: str = "t2v"  # a row of runtime/kinds.py
    boundary_ratio: float | None = None
    image_encoder_config: dict[str, Any] | None = None  # CLIPVisionConfig
    image_processor_config: dict[str, Any] | None = None  # the CLIP image processor's preprocessor_config
    video_to_video: bool = False  # a text-to-video model that also takes a source video (VAE encoder programs)
    vae_file: VaeFile | None = None  # --vae: the VAE from a file in the original Wan layout (export/vae_file.py)
    # the pipeline's own settings that shape the run (Helios: {"pyramid", "is_distilled", "is_cfg_zero_star"})
    pipeline_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def model(self) -> Kind:
        return kinds.get(self.model_kind)

    def describe(self) -> dict[str, Any]:
        config = {
            "transformer": _plain(self.transformer_config),
            "vae": _plain(self.vae_config),
            "text_encoder": _plain(self.text_encoder_config),
            "scheduler": _plain(self.scheduler_config),
        }
        if self.image_encoder_config is not None:
            config["image_encoder"] = _plain(self.image_encoder_config)
            config["image_processor"] = _plain(self.image_processor_config or {})
        described = {"kind": self.kind, "id": self.id, "revision": self.revision, "config": config}
        if self.vae_file is not None:
            described["vae_file"] = self.vae_file.describe()
        return described

    def _torch_dtype(self) -> Any:
        import torch

        return {"bf16": torch.bfloat16, "fp32": torch.float32}[self.dtype]

    def load_transformer(self, subfolder: str = "transformer") -> Any:
        """One expert: "transformer", or "transformer_2" (the low-noise expert of a two-expert model)."""
        cls = transformer_class(self.model)
        if not self.weights:
            args = _init_args(self.transformer_config)
            takes = inspect.signature(cls.__init__).parameters
            args = {k: v for k, v in args.items() if k in takes}  # (Wan-Animate 2's aliases, `animate2_aliases`)
            return _empty(lambda: cls(**args), self._torch_dtype())
        return cls.from_pretrained(self.location, subfolder=subfolder, revision=self.revision,
                                   dtype=self._torch_dtype()).eval()

    def load_image_encoder(self) -> Any:
        from transformers import CLIPVisionConfig, CLIPVisionModel

        if not self.weights:
            config = CLIPVisionConfig(**_init_args(self.image_encoder_config or {}))
            return _empty(lambda: CLIPVisionModel(config), self._torch_dtype())
        return CLIPVisionModel.from_pretrained(self.location, subfolder="image_encoder", revision=self.revision,
                                               dtype=self._torch_dtype()).eval()

    def load_text_encoder(self) -> Any:
        from transformers import UMT5Config, UMT5EncoderModel

        if not self.weights:
            config = UMT5Config(**_init_args(self.text_encoder_config))
            return _empty(lambda: UMT5EncoderModel(config), self._torch_dtype())
        return UMT5EncoderModel.from_pretrained(self.location, subfolder="text_encoder", revision=self.revision,
                                                dtype=self._torch_dtype()).eval()

    def load_vae(self) -> Any:
        import torch
        from diffusers import AutoencoderKLWan

        # diffusers runs the Wan VAE in float32 in every reference pipeline; so do we.
        if not self.weights:
            return _empty(lambda: AutoencoderKLWan(**_init_args(self.vae_config)), torch.float32)
        if self.vae_file is not None:
            vae = _empty(lambda: AutoencoderKLWan(**_init_args(self.vae_config)), torch.float32)
            vae.load_state_dict(self.vae_file.tensors(), strict=True, assign=True)
            return vae.eval()
        return AutoencoderKLWan.from_pretrained(self.location, subfolder="vae", revision=self.revision,
                                                dtype=torch.float32).eval()


def with_vae_file(src: Source, path: Path) -> Source:
    """`src` with its VAE (encoder and decoder) from `path`, a Wan 2.1 VAE in the original layout (--vae): the
    config is the file's architecture over the checkpoint's latent space, checked from the file's header now; the
    weights load with the VAE, and the manifest's source records the file."""
    from . import vae_file

    found = vae_file.read(path, src.vae_config)
    return dataclasses.replace(src, vae_config=found.config, vae_file=found)


def transformer_class(kind: Kind) -> Any:
    """diffusers' DiT class of a kind: WanVACETransformer3DModel for VACE, WanAnimateTransformer3DModel for Animate,
    else WanTransformer3DModel."""
    import diffusers

    if kind.dit == "skyreels":
        return diffusers.SkyReelsV2Transformer3DModel
    if kind.dit == "helios":
        return diffusers.HeliosTransformer3DModel
    if kind.dit == "anyflow":
        return diffusers.AnyFlowTransformer3DModel
    if kind.dit == "anyflow-far":
        return diffusers.AnyFlowFARTransformer3DModel
    if kind.dit == "chronoedit":
        return diffusers.ChronoEditTransformer3DModel
    if kind.dit == "animate-2":
        return diffusers.WanAnimate2Transformer3DModel
    if kind.animate:
        return diffusers.WanAnimateTransformer3DModel
    return diffusers.WanVACETransformer3DModel if kind.vace else diffusers.WanTransformer3DModel


def _empty(build: Any, dtype: Any) -> Any:
    """The module with parameters on `meta` (no memory) and real buffers (RoPE tables are computed in
    __init__ and are not in checkpoints), cast like `from_pretrained(dtype=...)` casts, including the
    model's keep-in-fp32 modules."""
    import torch
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        module = build()
    if hasattr(module, "tie_weights"):  # transformers ties shared embeddings in from_pretrained; do the same
        module.tie_weights()
    keep = _fp32_kept(module, dtype)
    cast: dict[int, Any] = {}  # by identity, so tied weights (UMT5's shared embedding) stay tied
    entries = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, t in entries:
        if not t.is_floating_point():
            continue
        if id(t) not in cast:
            want = torch.float32 if dtype == torch.float32 or any(k in name for k in keep) else dtype
            new = t.to(want)
            cast[id(t)] = torch.nn.Parameter(new) if isinstance(t, torch.nn.Parameter) else new
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner)
        (sub._parameters if leaf in sub._parameters else sub._buffers)[leaf] = cast[id(t)]
    return module.eval()


def _fp32_kept(module: Any, dtype: Any) -> list[str]:
    """Name fragments the library's from_pretrained keeps in fp32 at `dtype` (diffusers: always;
    transformers: `_keep_in_fp32_modules` for fp16 only, `_keep_in_fp32_modules_strict` for fp16/bf16)."""
    import torch

    if dtype == torch.float32:
        return []
    if hasattr(module, "_keep_in_fp32_modules_strict"):  # transformers
        keep = list(module._keep_in_fp32_modules_strict or [])
        if dtype == torch.float16:
            keep += list(module._keep_in_fp32_modules or [])
        return keep
    return list(getattr(module, "_keep_in_fp32_modules", None) or [])


def _init_args(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def _plain(cfg: Any) -> Any:
    """A JSON-safe, deterministic copy of a config (private and path-like keys dropped)."""
    drop = {"_name_or_path", "_diffusers_version", "transformers_version", "_commit_hash", "_use_default_values"}
    data = json.loads(json.dumps(dict(cfg), default=str))
    return {k: v for k, v in sorted(data.items()) if k not in drop}


def _tokenizer_json(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UserError("the checkpoint's tokenizer has no fast (tokenizer.json) form: install the `export` "
                        "extra (sentencepiece, protobuf) so transformers can convert it")
    from tokenizers import Tokenizer

    clean = Tokenizer.from_str(backend.to_str())
    clean.no_truncation()
    clean.no_padding()
    return clean.to_str()


def load(model: str, dtype: str, revision: str | None = None, weights: bool = True) -> Source:
    """Open `model` (a tiny variant name, an architecture name, a directory, or a hub id); components load
    later, one at a time. With weights=False they are built from the configs on `meta`."""
    src = _open(model, dtype, revision)
    if not weights:
        src.weights = False
    elif src.kind == "architecture":
        raise UserError(f"{model} is an architecture name without weights: pass --no-weights to build its "
                        f"programs, then attach weights with python -m export attach BUNDLE --weights "
                        f"{architectures.ARCHITECTURES[model]['hub_id']} (or a local copy)")
    return src


def _open(model: str, dtype: str, revision: str | None) -> Source:
    if model in architectures.ARCHITECTURES:
        arch = architectures.ARCHITECTURES[model]
        src = Source(kind="architecture", id=model, revision=None, location=None, dtype=dtype,
                     transformer_config=_full_config({"WanVACEPipeline": "vace_transformer",
                                                      "WanAnimatePipeline": "animate_transformer",
                                                      "HeliosPipeline": "helios_transformer",
                                                      "HeliosPyramidPipeline": "helios_transformer",
                                                      "ChronoEditPipeline": "chronoedit_transformer",
                                                      "AnyFlowPipeline": "anyflow_transformer",
                                                      "AnyFlowFARPipeline": "anyflow_far_transformer",
                                                      "WanAnimate2ModularPipeline": "animate2_transformer",
                                                      "WanAnimate2DistilledModularPipeline": "animate2_transformer",
                                                      **dict.fromkeys(SKYREELS_PIPELINES, "skyreels_transformer")}.get(
                                                         arch["pipeline"], "transformer"), arch["transformer"]),
                     vae_config=_full_config("vae", arch["vae"]), text_encoder_config=dict(arch["text_encoder"]),
                     scheduler_config=dict(arch["scheduler"]), tokenizer_json=None, weights=False,
                     boundary_ratio=arch.get("boundary_ratio"),
                     image_encoder_config=arch.get("image_encoder"), image_processor_config=arch.get("image_processor"))
        if PIPELINES[arch["pipeline"]] == "animate-2":
            src.transformer_config = animate2_aliases(src.transformer_config)
        if PIPELINES[arch["pipeline"]] == "helios":
            src.pipeline_options = {"pyramid": arch["pipeline"] == "HeliosPyramidPipeline",
                                    **{k: bool(arch["options"].get(k)) for k in ("is_distilled", "is_cfg_zero_star")}}
        src.model_kind = detect_kind(arch["pipeline"], arch.get("boundary_ratio") is not None,
                                     bool(arch.get("expand_timesteps")), src.transformer_config,
                                     src.image_encoder_config is not None, model, src.pipeline_options,
                                     src.scheduler_config)
        check_consistent(src)
        return src
    if model in tiny.VARIANTS:
        tmp = tempfile.TemporaryDirectory(prefix="wan-aot-tiny-")
        src = _open_diffusers(str(tiny.save(model, Path(tmp.name))), dtype, None)
        src.kind, src.id, src.keepalive = "tiny", model, tmp
        return src
    path = Path(model)
    if path.exists():
        if not (path / "model_index.json").is_file() and not (path / MODULAR_INDEX).is_file():
            raise UserError(f"{model} is not a diffusers-format pipeline directory (no model_index.json or "
                            f"{MODULAR_INDEX})")
        src = _open_diffusers(str(path), dtype, None)
        src.kind, src.id = "directory", str(path.resolve())
        return src
    if model.count("/") != 1 or model.startswith((".", "/")):
        raise UserError(f"unknown model {model!r}: pass a diffusers-format directory, a hub id such as "
                        f"Wan-AI/Wan2.1-T2V-1.3B-Diffusers, an architecture name "
                        f"({', '.join(architectures.ARCHITECTURES)}) or one of {', '.join(tiny.VARIANTS)}")
    src = _open_diffusers(model, dtype, revision)
    src.kind, src.id = "hub", model
    return src


def _open_diffusers(where: str, dtype: str, revision: str | None) -> Source:
    from diffusers import (
        AutoencoderKLWan,
        DiffusionPipeline,
        UniPCMultistepScheduler,
        WanTransformer3DModel,
    )
    from transformers import AutoTokenizer, UMT5Config

    if (Path(where) / MODULAR_INDEX).is_file() and not (Path(where) / "model_index.json").is_file():
        return _open_modular(where, dtype)
    index = DiffusionPipeline.load_config(where, revision=revision)
    pipeline = index.get("_class_name")
    if pipeline not in PIPELINES:
        raise UserError(f"{where} is a {pipeline}, not one of the Wan pipelines wan-aot exports "
                        f"({', '.join(PIPELINES)})")
    # Any scheduler's config reads this way (it is scheduler_config.json); samplers.from_checkpoint says whether its
    # sampler is one the runtime's coefficient rows reproduce.
    sched = dict(UniPCMultistepScheduler.load_config(where, subfolder="scheduler", revision=revision))
    try:
        from_checkpoint(sched)
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None

    def present(component: str) -> bool:
        return (index.get(component) or [None])[0] is not None

    transformer = dict(WanTransformer3DModel.load_config(where, subfolder="transformer", revision=revision))
    two = present("transformer_2")
    if two:
        second = dict(WanTransformer3DModel.load_config(where, subfolder="transformer_2", revision=revision))
        if _plain(second) != _plain(transformer):
            raise UserError(f"{where}: transformer and transformer_2 have different configs; wan-aot runs both "
                            "experts with one program, so they must share an architecture")
        if index.get("boundary_ratio") is None:
            raise UserError(f"{where} has a transformer_2 but no boundary_ratio in model_index.json: set it "
                            "(Wan2.2 A14B: 0.875 for T2V, 0.9 for I2V)")
    image_encoder = image_processor = None
    if present("image_encoder"):
        from transformers import AutoImageProcessor, CLIPVisionConfig

        image_encoder = CLIPVisionConfig.from_pretrained(where, subfolder="image_encoder", revision=revision).to_dict()
        image_processor = AutoImageProcessor.from_pretrained(where, subfolder="image_processor",
                                                             revision=revision).to_dict()
    tokenizer = AutoTokenizer.from_pretrained(where, subfolder="tokenizer", revision=revision)
    src = Source(
        kind="", id=where, revision=revision, location=where, dtype=dtype, transformer_config=transformer,
        vae_config=dict(AutoencoderKLWan.load_config(where, subfolder="vae", revision=revision)),
        text_encoder_config=UMT5Config.from_pretrained(where, subfolder="text_encoder", revision=revision).to_dict(),
        scheduler_config=sched, tokenizer_json=_tokenizer_json(tokenizer),
        boundary_ratio=index.get("boundary_ratio") if two else None,
        image_encoder_config=image_encoder, image_processor_config=image_processor,
        video_to_video=PIPELINES[pipeline] == "v2v",
        pipeline_options={"pyramid": pipeline == "HeliosPyramidPipeline",
                          **{k: bool(index.get(k)) for k in ("is_distilled", "is_cfg_zero_star")}}
        if PIPELINES[pipeline] == "helios" else {})
    src.model_kind = detect_kind(pipeline, two, bool(index.get("expand_timesteps")), transformer,
                                 image_encoder is not None, where, src.pipeline_options, sched)
    check_consistent(src)
    return src


MODULAR_INDEX = "modular_model_index.json"  # what a modular pipeline's save_pretrained writes (Wan-Animate 2)
# Wan-Animate 2's modular pipelines (diffusers 0.42.1 has no other form of it): the kind by the index's _class_name.
MODULAR_PIPELINES = {"WanAnimate2ModularPipeline": "animate-2",
                     "WanAnimate2DistilledModularPipeline": "animate-2-distilled"}


def animate2_aliases(cfg: dict[str, Any]) -> dict[str, Any]:
    """A WanAnimate2Transformer3DModel config with the WanTransformer3DModel names the rest of the export reads
    (in_channels, out_channels, num_attention_heads, attention_head_dim, image_dim, added_kv_proj_dim) beside its own
    (in_dim, out_dim, num_heads, dim); `load_transformer` passes the class only its own."""
    dim, heads = int(cfg["dim"]), int(cfg["num_heads"])
    return {**cfg, "in_channels": int(cfg["in_dim"]), "out_channels": int(cfg["out_dim"]),
            "num_attention_heads": heads, "attention_head_dim": dim // heads,
            "image_dim": 1280 if cfg.get("use_img_emb", True) else None, "added_kv_proj_dim": dim}


def _open_modular(where: str, dtype: str) -> Source:
    """A modular pipeline's directory (`save_pretrained` of WanAnimate2ModularPipeline: its components in subfolders
    beside modular_model_index.json)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanAnimate2Transformer3DModel
    from transformers import AutoTokenizer, CLIPVisionConfig, UMT5Config

    index = json.loads((Path(where) / MODULAR_INDEX).read_text())
    pipeline = index.get("_class_name")
    if pipeline not in MODULAR_PIPELINES:
        raise UserError(f"{where} is a modular {pipeline}, not one wan-aot exports ({', '.join(MODULAR_PIPELINES)})")
    for part in ("transformer", "vae", "text_encoder", "tokenizer", "image_encoder", "scheduler"):
        if not (Path(where) / part).is_dir():
            raise UserError(f"{where}: the modular pipeline has no {part}/ folder; save it with save_pretrained after "
                            "loading every component")
    sched = dict(FlowMatchEulerDiscreteScheduler.load_config(where, subfolder="scheduler"))
    try:
        from_checkpoint(sched)
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None
    transformer = animate2_aliases(dict(WanAnimate2Transformer3DModel.load_config(where, subfolder="transformer")))
    src = Source(
        kind="", id=where, revision=None, location=where, dtype=dtype, transformer_config=transformer,
        vae_config=dict(AutoencoderKLWan.load_config(where, subfolder="vae")),
        text_encoder_config=UMT5Config.from_pretrained(where, subfolder="text_encoder").to_dict(),
        scheduler_config=sched,
        tokenizer_json=_tokenizer_json(AutoTokenizer.from_pretrained(where, subfolder="tokenizer")),
        image_encoder_config=CLIPVisionConfig.from_pretrained(where, subfolder="image_encoder").to_dict(),
        image_processor_config={})
    src.model_kind = MODULAR_PIPELINES[pipeline]
    check_consistent(src)
    return src


PIPELINES = {"WanPipeline": "t2v", "WanImageToVideoPipeline": "i2v", "WanVACEPipeline": "vace",
             "WanVideoToVideoPipeline": "v2v", "WanAnimatePipeline": "animate",
             "LucyEditPipeline": "lucy"}

# SkyReels-V2 (runtime/kinds.py's skyreels-* rows): the three diffusion forcing pipelines run the same checkpoints,
# so any of them gives one skyreels-df bundle (text, image and video extension).
SKYREELS_PIPELINES = {"SkyReelsV2Pipeline": "skyreels-t2v", "SkyReelsV2ImageToVideoPipeline": "skyreels-i2v",
                      "SkyReelsV2DiffusionForcingPipeline": "skyreels-df",
                      "SkyReelsV2DiffusionForcingImageToVideoPipeline": "skyreels-df",
                      "SkyReelsV2DiffusionForcingVideoToVideoPipeline": "skyreels-df"}
PIPELINES.update({name: "skyreels" for name in SKYREELS_PIPELINES})
# Helios (runtime/kinds.py's helios row; runtime/helios.py): text, image or video in, chunks of any count.
PIPELINES.update(HeliosPipeline="helios", HeliosPyramidPipeline="helios")
# ChronoEdit (runtime/kinds.py's chronoedit row; runtime/chronoedit.py): Wan 2.1 I2V with its own RoPE, an image edit.
PIPELINES.update(ChronoEditPipeline="chronoedit")
# AnyFlow (runtime/kinds.py's anyflow row): a flow-map Wan 2.1 T2V; AnyFlowFARPipeline (its causal chunks with a KV
# cache: the anyflow-far row, runtime/far.py) is a kind of its own.
PIPELINES.update(AnyFlowPipeline="anyflow", AnyFlowFARPipeline="anyflow-far")
# Wan-Animate 2 (runtime/kinds.py's animate-2 rows; runtime/animate2.py): modular pipelines (MODULAR_PIPELINES).
PIPELINES.update(WanAnimate2ModularPipeline="animate-2", WanAnimate2DistilledModularPipeline="animate-2")


def detect_kind(pipeline: str, two_experts: bool, expand_timesteps: bool, transformer: dict[str, Any],
                image_encoder: bool, where: str, options: dict[str, Any] | None = None,
                scheduler: dict[str, Any] | None = None) -> str:
    """The runtime/kinds.py row of a diffusers Wan pipeline, from its model_index.json and configs."""
    if pipeline in SKYREELS_PIPELINES:
        return detect_skyreels(pipeline, two_experts, transformer, image_encoder, where)
    if PIPELINES[pipeline] == "helios":
        return detect_helios(pipeline, two_experts or image_encoder, options or {}, scheduler or {}, where)
    if PIPELINES[pipeline] == "animate-2":
        return MODULAR_PIPELINES[pipeline]
    if PIPELINES[pipeline] in ("anyflow", "anyflow-far"):
        if two_experts or image_encoder:
            raise UserError(f"{where}: AnyFlow with two experts or an image encoder is not a configuration wan-aot "
                            "knows (nvidia/AnyFlow-Wan2.1-T2V-14B-Diffusers has one transformer and no image encoder)")
        if (scheduler or {}).get("_class_name", "FlowMapEulerDiscreteScheduler") != "FlowMapEulerDiscreteScheduler":
            raise UserError(f"{where}: AnyFlow's transformer predicts mean velocities, which only "
                            f"FlowMapEulerDiscreteScheduler steps; this one has {(scheduler or {}).get('_class_name')}")
        return PIPELINES[pipeline]
    if PIPELINES[pipeline] == "chronoedit" or transformer.get("_class_name") == "ChronoEditTransformer3DModel":
        if two_experts or not image_encoder:  # (its RoPE is the transformer class's: either name says ChronoEdit)
            raise UserError(f"{where}: ChronoEdit with two experts or without a CLIP image_encoder is not a "
                            "configuration wan-aot knows (nvidia/ChronoEdit-14B-Diffusers has one transformer and "
                            "CLIP)")
        return "chronoedit"
    if PIPELINES[pipeline] == "lucy":  # Lucy Edit: TI2V-5B's DiT (expand_timesteps) on [noise, source video latents]
        if two_experts or image_encoder:
            raise UserError(f"{where}: Lucy Edit with two experts or an image encoder is not a configuration wan-aot "
                            "knows (decart-ai/Lucy-Edit-Dev has one transformer and no image encoder)")
        return "lucy-edit"
    if expand_timesteps:  # TI2V-5B, saved as either pipeline class: one bundle does text and image
        if two_experts or image_encoder:
            raise UserError(f"{where}: expand_timesteps with two experts or an image encoder is not a Wan "
                            "configuration wan-aot knows")
        return "ti2v"
    if PIPELINES[pipeline] == "animate":
        if two_experts or not image_encoder:
            raise UserError(f"{where}: Wan-Animate with two experts or without a CLIP image encoder is not a "
                            "configuration wan-aot knows")
        return "animate"
    if PIPELINES[pipeline] in ("t2v", "v2v"):  # video-to-video is text-to-video with a source video
        return "t2v-moe" if two_experts else "t2v"
    if PIPELINES[pipeline] == "vace" or transformer.get("vace_layers") is not None:
        if image_encoder:
            raise UserError(f"{where}: a VACE model with an image encoder is not a Wan configuration wan-aot knows")
        return "vace-moe" if two_experts else "vace"
    if two_experts:
        return "i2v-moe"
    if not image_encoder:
        raise UserError(f"{where}: an image-to-video pipeline with one expert needs a CLIP image_encoder "
                        "(Wan 2.1 I2V); wan-aot knows no other one-expert I2V configuration")
    return "flf2v" if transformer.get("pos_embed_seq_len") else "i2v"


def detect_helios(pipeline: str, other_parts: bool, options: dict[str, Any], scheduler: dict[str, Any],
                  where: str) -> str:
    """helios (HeliosPipeline), helios-pyramid or helios-distilled (HeliosPyramidPipeline, is_distilled: its
    HeliosDMDScheduler's steps). diffusers steps a distilled pipeline's scheduler with DMD's arguments, which only
    HeliosDMDScheduler takes, and a HeliosDMDScheduler with them only: refuse a mismatch."""
    if other_parts:
        raise UserError(f"{where}: Helios with two experts or an image encoder is not a configuration wan-aot knows "
                        "(BestWishYsh/Helios-Base has one transformer and no image encoder)")
    dmd = scheduler.get("_class_name") == "HeliosDMDScheduler"
    if pipeline == "HeliosPipeline":
        if dmd:
            raise UserError(f"{where}: HeliosPipeline with a HeliosDMDScheduler does not run (diffusers steps it "
                            "without DMD's arguments): the distilled model is a HeliosPyramidPipeline")
        return "helios"
    if bool(options.get("is_distilled")) != dmd:
        raise UserError(f"{where}: model_index.json says is_distilled={bool(options.get('is_distilled'))} but the "
                        f"scheduler is {scheduler.get('_class_name')}: a distilled Helios needs HeliosDMDScheduler, "
                        "and HeliosDMDScheduler a distilled pipeline")
    return "helios-distilled" if dmd else "helios-pyramid"


def detect_skyreels(pipeline: str, two_experts: bool, transformer: dict[str, Any], image_encoder: bool,
                    where: str) -> str:
    """The skyreels-* row of a SkyReels-V2 pipeline: one expert always; I2V with CLIP (FLF2V with pos_embed_seq_len);
    the plain pipelines never pass the fps the DiT's `inject_sample_info` needs (diffusers fails there too)."""
    kind = SKYREELS_PIPELINES[pipeline]
    if two_experts:
        raise UserError(f"{where}: a SkyReels-V2 pipeline with two experts is not a configuration wan-aot knows")
    if kind == "skyreels-i2v":
        if not image_encoder:
            raise UserError(f"{where}: SkyReels-V2 image-to-video needs its CLIP image_encoder")
        kind = "skyreels-flf2v" if transformer.get("pos_embed_seq_len") else kind
    elif image_encoder:
        raise UserError(f"{where}: {pipeline} with an image encoder is not a configuration wan-aot knows")
    if kind != "skyreels-df" and transformer.get("inject_sample_info"):
        raise UserError(f"{where}: {pipeline}'s DiT has inject_sample_info (an fps embedding) that only the diffusion "
                        "forcing pipelines feed: export it as SkyReelsV2DiffusionForcingPipeline")
    return kind


def check_consistent(src: Source) -> None:
    """The DiT's input channels must be what the kind feeds it (noise, noise + mask + condition, or noise + the
    source video's latents)."""
    kind, t = src.model, src.transformer_config
    z = int(src.vae_config.get("z_dim") or 16)
    mask = int(src.vae_config.get("scale_factor_temporal") or 4)  # one mask channel per frame of a latent frame
    want = z + {"mask+latents": mask + z, "latents": z}.get(kind.channel_condition, 0)
    if int(t["in_channels"]) != want or int(t["out_channels"]) != z:
        raise UserError(f"{src.id}: the transformer takes {t['in_channels']} channels and gives {t['out_channels']}, "
                        f"but a {kind.title} model with a z_dim {z} VAE needs {want} in and {z} out")
    if kind.vace:  # inactive + reactive latents, and the mask folded s x s onto the latent grid
        spatial = int(src.vae_config.get("scale_factor_spatial") or 8)
        control = 2 * z + spatial * spatial
        if int(t.get("vace_in_channels") or 0) != control:
            raise UserError(f"{src.id}: the VACE branch takes {t.get('vace_in_channels')} channels, but a z_dim {z} "
                            f"VAE with a {spatial}x spatial scale gives {control} (2 x {z} + {spatial}x{spatial})")
    if kind.image_encoder and int(t.get("image_dim") or 0) != int((src.image_encoder_config or {})["hidden_size"]):
        raise UserError(f"{src.id}: the transformer's image_dim {t.get('image_dim')} is not the image encoder's "
                        f"hidden_size {(src.image_encoder_config or {}).get('hidden_size')}")


def _full_config(component: str, args: dict[str, Any]) -> dict[str, Any]:
    """The complete diffusers config (defaults filled in) of a component built from `args`."""
    from diffusers import (
        AnyFlowFARTransformer3DModel,
        AnyFlowTransformer3DModel,
        AutoencoderKLWan,
        ChronoEditTransformer3DModel,
        HeliosTransformer3DModel,
        SkyReelsV2Transformer3DModel,
        WanAnimate2Transformer3DModel,
        WanAnimateTransformer3DModel,
        WanTransformer3DModel,
        WanVACETransformer3DModel,
    )

    cls = {"transformer": WanTransformer3DModel, "vace_transformer": WanVACETransformer3DModel,
           "animate_transformer": WanAnimateTransformer3DModel, "skyreels_transformer": SkyReelsV2Transformer3DModel,
           "helios_transformer": HeliosTransformer3DModel,
           "chronoedit_transformer": ChronoEditTransformer3DModel, "anyflow_transformer": AnyFlowTransformer3DModel,
           "anyflow_far_transformer": AnyFlowFARTransformer3DModel,
           "animate2_transformer": WanAnimate2Transformer3DModel,
           "vae": AutoencoderKLWan}[component]
    params = inspect.signature(cls.__init__).parameters.values()
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    return {**defaults, **args, "_class_name": cls.__name__}
