"""The embedded default model: a small random-weight Wan 2.1 T2V pipeline built in code.

It needs no network and is bit-for-bit reproducible (fixed torch seed, fixed
vocabulary), so `python -m export --model tiny` gives the same bundle on every
machine with the same tool versions. The shapes follow diffusers' own Wan tests;
the text encoder is a small UMT5 and the tokenizer a SentencePiece-style Unigram
model written with the `tokenizers` library.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

# Named variants; "tiny" is the default. "tiny-wide" exists so tests cover a second
# architecture (more heads and layers, a wider VAE with a channel multiplier).
VARIANTS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        transformer=dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
            out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        ),
        vae=dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                 temperal_downsample=[False, True, True]),
        text_encoder=dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
        flow_shift=3.0,
    ),
    "tiny-wide": dict(
        transformer=dict(
            patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=16,
            out_channels=16, text_dim=48, freq_dim=64, ffn_dim=64, num_layers=3,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
        ),
        vae=dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                 temperal_downsample=[False, True, True]),
        text_encoder=dict(d_model=48, d_kv=12, d_ff=96, num_layers=3, num_heads=4),
        flow_shift=5.0,
    ),
}

_WORDS = (
    "a an the of in on at with and or to from by for is are cat dog robot city street night "
    "day sky sea water fire light dark red blue green white black small big walking running "
    "flying dancing playing piano jazz club kitchen cake baking together garden video scene "
    "camera slow motion cinematic detailed high quality blurry low static"
).split()


def tokenizer_json() -> str:
    """A deterministic T5-style tokenizer: pad 0, eos 1, unk 2, post-processor `$A </s>`."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pieces = ["<pad>", "</s>", "<unk>", "\u2581"]
    pieces += [c for c in string.ascii_letters + string.digits + string.punctuation]
    pieces += ["\u2581" + w for w in _WORDS]
    vocab = [(p, 0.0 if i < 3 else -float(len(p) <= 1) * 5.0 - 1.0 / (1 + len(p)))
             for i, p in enumerate(pieces)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    for special in ("<pad>", "</s>", "<unk>"):
        tok.add_special_tokens([special])
    return tok.to_str()


def build_pipeline(variant: str | dict[str, Any] = "tiny") -> Any:
    """A WanPipeline with seeded random weights: a named variant, or a spec shaped like VARIANTS' values."""
    """Build the random-weight WanPipeline for `variant` (fp32, CPU)."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    spec = variant if isinstance(variant, dict) else VARIANTS[variant]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tokenizer_json()),
        pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=512,
    )
    torch.manual_seed(0)
    te = spec["text_encoder"]
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=te["d_model"], d_kv=te["d_kv"], d_ff=te["d_ff"],
        num_layers=te["num_layers"], num_heads=te["num_heads"], relative_attention_num_buckets=32,
        relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )).eval()
    torch.manual_seed(1)
    transformer = WanTransformer3DModel(**spec["transformer"]).eval()
    torch.manual_seed(2)
    vae = AutoencoderKLWan(**spec["vae"]).eval()
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
        flow_shift=spec["flow_shift"], solver_order=2, solver_type="bh2", lower_order_final=True,
        final_sigmas_type="zero",
    )
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                       scheduler=scheduler, transformer=transformer)


def save(variant: str, directory: Path) -> Path:
    """Write the tiny pipeline to `directory` in diffusers format (safetensors)."""
    pipe = build_pipeline(variant)
    directory.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(str(directory), safe_serialization=True)
    return directory
