"""GGUF files for the tests and benchmarks: a Q4_K quantizer and a writer of original-layout Wan DiTs.

The `gguf` package (llama.cpp's) quantizes Q8_0, Q4_0 and the other legacy types, and dequantizes the K-quants, but
cannot quantize a K-quant; city96's Wan GGUFs are mostly K-quants. `quantize_q4_k` writes llama.cpp's Q4_K blocks
(`block_q4_K`: fp16 d and dmin, twelve bytes of 6-bit sub-block scales and mins, 128 bytes of 4-bit values; 256
values a block) with a plain min/max fit per 32-value sub-block: not llama.cpp's search for the best scales, so its
error is a little larger than a real Q4_K file's. The bytes are checked against `gguf.quants.dequantize`, the
reference every reader (export, diffusers, llama.cpp) follows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

QK_K = 256  # values per K-quant block


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float rows (..., n), n a multiple of 256 -> Q4_K bytes (..., n / 256 * 144), as GGUFWriter takes them."""
    x = np.asarray(x, np.float32)
    if x.shape[-1] % QK_K:
        raise ValueError(f"Q4_K rows are multiples of {QK_K} values, not {x.shape[-1]}")
    blocks = x.reshape(-1, 8, 32)  # (blocks, sub-blocks, values)
    lo = np.minimum(blocks.min(axis=-1), 0.0)
    hi = blocks.max(axis=-1)
    scale, mins = (hi - lo) / 15.0, -lo  # a value is scale * q - min, q in 0..15
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (mins.max(axis=-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.clip(np.round(scale / df), 0, 63), 0).astype(np.uint8)
        m = np.where(dminf > 0, np.clip(np.round(mins / dminf), 0, 63), 0).astype(np.uint8)
        step = (df * sc)[..., None]
        q = np.where(step > 0, np.clip(np.round((blocks + (dminf * m)[..., None]) / step), 0, 15), 0)
    q = q.astype(np.uint8)
    packed = np.zeros((len(blocks), 12), np.uint8)  # llama.cpp's get_scale_min_k4 layout
    packed[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(blocks), 128)  # chunk i: sub-block 2i low, 2i + 1 high
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * 144)


def quantize(x: np.ndarray, qtype: str) -> np.ndarray:
    """`x` as GGUF type `qtype`'s bytes (Q4_K here, the others through the gguf package), or as F32 / F16 arrays."""
    from gguf import GGMLQuantizationType, quants

    x = np.asarray(x, np.float32)
    if qtype == "F32":
        return x
    if qtype == "F16":
        return x.astype(np.float16)
    if qtype == "Q4_K":
        return quantize_q4_k(x)
    return quants.quantize(x, GGMLQuantizationType[qtype])


def dequantize(x: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """GGUF type `qtype`'s bytes (or array) back to float32 of `shape`, by the gguf package."""
    from gguf import GGMLQuantizationType, quants

    return np.asarray(quants.dequantize(x, GGMLQuantizationType[qtype]), np.float32).reshape(shape)


def write(path: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> Path:
    """A GGUF file (architecture `wan`, as city96's) of `tensors`: name -> (float values, GGUF type name)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "wan")
    for name, (x, qtype) in tensors.items():
        data = quantize(x, qtype)
        if qtype in ("F32", "F16"):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
