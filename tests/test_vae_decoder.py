"""The channels-last JAX decoder (export/vae_decoder.py, CPU targets) equals diffusers' Wan VAE decoder run
chunk by chunk in torch, Wan 2.1 and Wan 2.2 (residual, patchified) alike, caches included."""

from __future__ import annotations

import numpy as np
import pytest

CONFIGS = {
    # attention in the mid block, two res blocks per stage, channel multipliers: the 2.1 shape in miniature
    "wan2.1": dict(base_dim=4, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                   temperal_downsample=[False, True, True]),
    "wan2.2": dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                   temperal_downsample=[False, True, True], is_residual=True, patch_size=2, in_channels=12,
                   out_channels=12, scale_factor_spatial=16),
}


@pytest.mark.parametrize("name,batch,size", [("wan2.1", 1, (6, 10)), ("wan2.1", 2, (5, 3)), ("wan2.2", 1, (4, 6))])
def test_decoder_matches_diffusers_chunk_by_chunk(name: str, batch: int, size: tuple[int, int]) -> None:
    import jax
    import torch
    from diffusers import AutoencoderKLWan
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    from export import vae as vae_stage
    from export import vae_decoder
    from export.attention import AttentionConfig

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**CONFIGS[name]).eval()
    with torch.no_grad():  # away from the initial ones and zeros, so every weight matters
        for p in vae.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    h, w = size
    specs = vae_stage.cache_specs(vae, "decode", batch, h, w)
    fn = vae_decoder.build(vae, AttentionConfig())
    weights = {k: v.detach().numpy() for k, v in vae_stage.module(vae, encode=False).state_dict().items()}

    def chunk(weights, z, caches):
        out, feat = fn(weights, (z, caches), {})
        return out, vae_stage._normalise(feat, specs)

    step = jax.jit(chunk)
    z = np.random.default_rng(1).standard_normal((batch, 16, 3, h, w)).astype(np.float32)
    vae.clear_cache()
    caches = None
    with torch.no_grad():
        x = vae.post_quant_conv(torch.from_numpy(z))
        for i in range(3):
            vae._conv_idx = [0]
            want = vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0)
            if vae.config.patch_size:
                want = unpatchify(want, patch_size=vae.config.patch_size)
            want = torch.clamp(want, -1.0, 1.0).numpy()
            got, new = step(weights, z[:, :, i:i + 1], caches)
            assert got.shape == want.shape
            np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)
            # the caches a later chunk takes are diffusers' (zero-padded to the slot's frames), slot by slot
            ref = vae_stage._normalise([None if f is None else (f if isinstance(f, str) else jax.numpy.asarray(
                f.numpy())) for f in vae._feat_map], specs)
            assert len(new) == len(ref)
            for a, b in zip(new, ref):
                b = np.asarray(b)  # unclamped activations of O(1): within 2e-4 of their scale (fp32 sum order)
                np.testing.assert_allclose(np.asarray(a), b, atol=2e-4 * max(1.0, float(np.abs(b).max())), rtol=0)
            caches = vae_stage._slots(tuple(new), specs)


@pytest.mark.parametrize("frames", [1, 2, 4])
def test_conv3d_with_implicit_zero_frames_matches_torch(frames: int) -> None:
    """A first chunk's causal zero frames, skipped rather than convolved, give torch's padded conv3d."""
    import torch

    from export.vae_decoder import conv3d

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, frames, 5, 6, 3)).astype(np.float32)  # (B, T, H, W, C)
    w = rng.standard_normal((4, 3, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    want = torch.nn.functional.conv3d(torch.nn.functional.pad(torch.from_numpy(x).permute(0, 4, 1, 2, 3),
                                                              (1, 1, 1, 1, 2, 0)), torch.from_numpy(w),
                                      torch.from_numpy(b)).permute(0, 2, 3, 4, 1).numpy()
    got = np.asarray(conv3d(x, w, b, (1, 1), zeros_in_front=2))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
