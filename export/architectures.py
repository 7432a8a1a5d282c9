"""The official Wan 2.1 T2V architectures, by name, so programs can be built from a config alone.

`python -m export --model wan2.1-t2v-14b --no-weights ...` traces every stage on
`meta` tensors (no weights, no download) and the weights are attached later from
the real checkpoint (`--attach-weights`). The values are those of the
Wan-AI/Wan2.1-T2V-*-Diffusers repositories; the VAE is diffusers' default
AutoencoderKLWan (the Wan 2.1 VAE) and the text encoder is UMT5-XXL.
"""

from __future__ import annotations

from typing import Any

_UMT5_XXL: dict[str, Any] = dict(
    vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_decoder_layers=24, num_heads=64,
    relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.1,
    layer_norm_epsilon=1e-6, feed_forward_proj="gated-gelu", tie_word_embeddings=False, pad_token_id=0,
    eos_token_id=1, decoder_start_token_id=0,
)

_SCHEDULER: dict[str, Any] = dict(
    _class_name="UniPCMultistepScheduler", num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02,
    beta_schedule="linear", solver_order=2, prediction_type="flow_prediction", thresholding=False,
    predict_x0=True, solver_type="bh2", lower_order_final=True, disable_corrector=[], use_flow_sigmas=True,
    flow_shift=3.0, timestep_spacing="linspace", steps_offset=0, final_sigmas_type="zero",
    use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False,
)


def _transformer(heads: int, ffn: int, layers: int) -> dict[str, Any]:
    return dict(patch_size=[1, 2, 2], num_attention_heads=heads, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=ffn, num_layers=layers, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                rope_max_seq_len=1024)


ARCHITECTURES: dict[str, dict[str, Any]] = {
    "wan2.1-t2v-1.3b": dict(transformer=_transformer(12, 8960, 30), vae={}, text_encoder=_UMT5_XXL,
                            scheduler=_SCHEDULER, hub_id="Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
    "wan2.1-t2v-14b": dict(transformer=_transformer(40, 13824, 40), vae={}, text_encoder=_UMT5_XXL,
                           scheduler=_SCHEDULER, hub_id="Wan-AI/Wan2.1-T2V-14B-Diffusers"),
}
