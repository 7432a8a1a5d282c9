"""CPU targets' convolution rewrites (export/conv.py) equal torch's: 3D as sums of 2D, depthwise as shifted sums."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.parametrize("kernel,stride,padding,dilation,bias", [
    ((3, 3, 3), (1, 1, 1), (0, 1, 1), (1, 1, 1), True),    # the VAE's causal 3x3x3 (time padded outside)
    ((3, 1, 1), (1, 1, 1), (1, 0, 0), (1, 1, 1), True),    # time_conv of the 3D upsampler
    ((3, 1, 1), (2, 1, 1), (0, 0, 0), (1, 1, 1), False),   # time_conv of the 3D downsampler (stride 2)
    ((1, 1, 1), (1, 1, 1), (0, 0, 0), (1, 1, 1), True),    # shortcut
    ((2, 3, 3), (1, 2, 2), (1, 2, 0), (2, 1, 2), True),    # anything else torch allows
])
def test_conv3d_as_2d_matches_torch(kernel, stride, padding, dilation, bias) -> None:
    import torch

    from export.conv import conv3d_as_2d

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 7, 9, 11)).astype(np.float32)
    w = rng.standard_normal((4, 5, *kernel)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32) if bias else None
    want = torch.nn.functional.conv3d(torch.from_numpy(x), torch.from_numpy(w), None if b is None else
                                      torch.from_numpy(b), stride, padding, dilation).numpy()
    got = np.asarray(conv3d_as_2d(x, w, b, stride, padding, dilation))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel,stride,padding,dilation,bias", [
    ((4, 4), (1, 1), (2, 2), (1, 1), False),   # Wan-Animate's motion encoder blur (a 4x4 FIR, padded around)
    ((4, 4), (1, 1), (1, 1), (1, 1), False),   # its blur before a stride-2 convolution
    ((3, 5), (2, 1), (1, 0), (1, 2), True),    # anything else torch allows
])
def test_depthwise_as_shifts_matches_torch(kernel, stride, padding, dilation, bias) -> None:
    import torch

    from export.conv import depthwise_as_shifts

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 6, 13, 11)).astype(np.float32)
    w = rng.standard_normal((6, 1, *kernel)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32) if bias else None
    want = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), None if b is None else
                                      torch.from_numpy(b), stride, padding, dilation, groups=6).numpy()
    got = np.asarray(depthwise_as_shifts(x, w, b, stride, padding, dilation))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
