"""export/strided_set.py: slice writes as contiguous updates, equal to jax's scatter, and none left in the DiT."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np
import pytest

from export.strided_set import strided_set
from runtime import manifest as mf

E = Ellipsis
# (index, whether it is written without a scatter), on an array of shape (3, 5, 7, 10)
INDEXES = [
    ((E, slice(0, None, 2)), True),  # RoPE's even channels
    ((E, slice(1, None, 2)), True),  # and odd ones (the window starts one position early)
    ((E, slice(1, 8, 3)), True),
    ((E, slice(9, None, 2)), True),  # one position
    ((E, slice(-3, None, 2)), True),
    ((E, slice(0, None, 10)), True),
    ((slice(None), slice(1, None, 2)), True),
    ((slice(0, 2), E, slice(2, 9, 2)), True),
    (slice(1, 3), True),  # contiguous
    ((E, slice(3, 3, 2)), True),  # empty: nothing written
    ((slice(None, None, 2),), False),  # 2 groups of 2 do not fit in 3: jax's own
    ((E, slice(0, None, 7)), False),
    ((slice(1, None, 2), slice(None, None, 2)), False),  # two strided dimensions
    ((E, slice(None, None, -1)), False),  # reversed
    ((0, slice(None, None, 2)), False),  # an integer index
]


@pytest.mark.parametrize("index, contiguous", INDEXES, ids=[str(i) for i, _ in INDEXES])
def test_strided_set_writes_what_at_set_writes(index, contiguous: bool) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 7, 10)).astype(np.float32)
    target = x[index].shape
    for value in (rng.standard_normal(target).astype(np.float32), np.float32(2.5),
                  rng.standard_normal(target[-1:]).astype(np.float32), rng.standard_normal(target).astype(np.float64)):
        want = jax.numpy.asarray(x).at[index].set(value)
        got = jax.jit(lambda a, v: strided_set(a, index, v))(x, value)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    lowered = jax.jit(lambda a: strided_set(a, index, 1.0)).lower(x).as_text()
    assert ("scatter" not in lowered) == contiguous


def test_exported_programs_write_rope_without_scatters(fp32_bundles: dict[str, Path]) -> None:
    """diffusers' RoPE (`out[..., 0::2] = ...`) was four scatters per block; every program of a bundle is now
    free of them (the parity tests show the frames did not change)."""
    bundle = fp32_bundles["tiny-64x32-f9"]
    m = mf.read(bundle)
    for name, spec in m.programs.items():
        for ref in spec.files():  # a denoise step's head, block and tail programs
            text = jax.export.deserialize(bytearray((bundle / ref.file).read_bytes())).mlir_module()
            assert not re.findall(r"stablehlo\.scatter", text), (name, ref.file)
