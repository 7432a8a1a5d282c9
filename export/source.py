"""Loading a diffusers-format Wan 2.1 T2V checkpoint (directory, hub id, or the embedded tiny model)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import UserError
from runtime.scheduler import unsupported_reason

from . import tiny


@dataclass
class Source:
    """The pipeline components export needs, plus where they came from."""

    kind: str  # "tiny" | "directory" | "hub"
    id: str
    revision: str | None
    transformer: Any
    text_encoder: Any
    vae: Any
    tokenizer_json: str
    scheduler_config: dict[str, Any]

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "id": self.id,
            "revision": self.revision,
            "config": {
                "transformer": _plain(self.transformer.config),
                "vae": _plain(self.vae.config),
                "text_encoder": _plain(self.text_encoder.config.to_diff_dict()),
                "scheduler": _plain(self.scheduler_config),
            },
        }


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


def load(model: str, dtype: str, revision: str | None = None) -> Source:
    """Load `model` (a tiny variant name, a directory, or a hub id); text encoder and DiT in `dtype`."""
    if model in tiny.VARIANTS:
        with tempfile.TemporaryDirectory(prefix="wan-aot-tiny-") as tmp:
            src = _load_diffusers(tiny.save(model, Path(tmp)), dtype, None)
        src.kind, src.id = "tiny", model
        return src
    path = Path(model)
    if path.exists():
        if not (path / "model_index.json").is_file():
            raise UserError(f"{model} is not a diffusers-format pipeline directory (no model_index.json)")
        src = _load_diffusers(path, dtype, None)
        src.kind, src.id = "directory", str(path.resolve())
        return src
    if model.count("/") != 1 or model.startswith((".", "/")):
        raise UserError(f"unknown model {model!r}: pass a diffusers-format directory, a hub id such as "
                        f"Wan-AI/Wan2.1-T2V-1.3B-Diffusers, or one of {', '.join(tiny.VARIANTS)}")
    src = _load_diffusers(model, dtype, revision)
    src.kind, src.id = "hub", model
    return src


def _load_diffusers(where: Any, dtype: str, revision: str | None) -> Source:
    import torch
    from diffusers import AutoencoderKLWan, DiffusionPipeline, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    index = DiffusionPipeline.load_config(str(where), revision=revision)
    if index.get("_class_name") != "WanPipeline":
        raise UserError(f"{where} is a {index.get('_class_name')}, not a Wan text-to-video WanPipeline")
    if index.get("transformer_2", [None])[0] is not None or index.get("expand_timesteps"):
        raise UserError(f"{where} is a Wan 2.2 two-expert or TI2V pipeline: only Wan 2.1 T2V is supported so far")
    sched = UniPCMultistepScheduler.load_config(str(where), subfolder="scheduler", revision=revision)
    reason = unsupported_reason(sched)
    if reason:
        raise UserError(f"{where}: {reason}")
    kw = dict(revision=revision)
    transformer = WanTransformer3DModel.from_pretrained(str(where), subfolder="transformer", dtype=torch_dtype, **kw)
    text_encoder = UMT5EncoderModel.from_pretrained(str(where), subfolder="text_encoder", dtype=torch_dtype, **kw)
    # diffusers runs the Wan VAE in float32 in every reference pipeline; so do we.
    vae = AutoencoderKLWan.from_pretrained(str(where), subfolder="vae", dtype=torch.float32, **kw)
    tokenizer = AutoTokenizer.from_pretrained(str(where), subfolder="tokenizer", **kw)
    return Source(kind="", id="", revision=revision, transformer=transformer.eval(), text_encoder=text_encoder.eval(),
                  vae=vae.eval(), tokenizer_json=_tokenizer_json(tokenizer), scheduler_config=dict(sched))
