"""AnyFlow-FAR's chunks and KV cache slots: which latent frames each chunk is, and which frame each cache slot holds.

AnyFlowFARPipeline (diffusers 0.42.1) cuts the latent video into chunks (`chunk_partition`). Chunk k is denoised
attending to itself and to the KV cache; after it, `encode_kv_cache` re-encodes the whole clean video so far and
rewrites the cache: the last `full_chunk_limit - 1` chunks at patch_size (`full_cache`), the older ones at
compressed_patch_size (`compressed_cache`). The step of chunk k reads exactly what that write left (the same split).

The programs (export/far.py) are one per bundle shape, not one per chunk: their tensors are padded to the most any
chunk needs, and what each slot holds is data made here:

- `frame_pos`: each slot's latent frame (its RoPE position), -1 where the slot is empty;
- `frame_chunk` (the cache write's): each slot's chunk (its block-causal mask), -1 where empty.

The slots are frames: the compressed cache's `compressed` frames, then the full cache's `full` frames, then (the
step's) the chunk's `chunk` frames; a frame is `tokens_per_frame` tokens at its patch size. Pure numpy: the export
and the runtime both read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import UserError

DEFAULT_PARTITION = (1, 3, 3, 3, 3, 3, 3, 2)  # AnyFlowFARTransformer3DModel's (81 frames = 21 latent frames)


def partition_for(latent_frames: int, config: dict[str, Any]) -> tuple[int, ...]:
    """The chunks of a video of `latent_frames` latent frames: the transformer config's `chunk_partition` where it
    sums to them (the released checkpoints' for 81 frames), else the first frame alone and chunks of the config's
    largest after it, the last one shorter (the rule the default follows: 1 + 3 x 6 + 2)."""
    config_partition = tuple(int(c) for c in config.get("chunk_partition") or DEFAULT_PARTITION)
    if sum(config_partition) == latent_frames:
        return config_partition
    if latent_frames < 1:
        raise UserError(f"AnyFlow-FAR needs at least one latent frame, not {latent_frames}")
    size = max(config_partition)
    rest = latent_frames - 1
    return (1, *([size] * (rest // size)), *([rest % size] if rest % size else []))


@dataclass(frozen=True)
class Layout:
    """The chunks and cache slots of one bundle shape."""

    partition: tuple[int, ...]
    full_chunk_limit: int

    @classmethod
    def of(cls, latent_frames: int, config: dict[str, Any]) -> Layout:
        return cls(partition_for(latent_frames, config), int(config.get("full_chunk_limit", 3)))

    @property
    def chunks(self) -> int:
        return len(self.partition)

    @property
    def chunk(self) -> int:
        """The frames of the step's chunk slots: the largest chunk."""
        return max(self.partition)

    def start(self, k: int) -> int:
        """Chunk k's first latent frame."""
        return sum(self.partition[:k])

    def frames(self, k: int) -> slice:
        return slice(self.start(k), self.start(k + 1))

    def written(self, k: int) -> tuple[int, int]:
        """(compressed frames, full frames) the cache write after chunk k holds: AnyFlowFARTransformer3DModel's
        _forward_cache over chunk_partition[:k + 1] (full_chunk_limit - 1 chunks at full size at most)."""
        total, limit = k + 1, self.full_chunk_limit - 1
        compressed = total - limit if total > limit else 0
        return self.start(compressed), self.start(k + 1) - self.start(compressed)

    @property
    def compressed(self) -> int:
        """The compressed cache's frames: the most any write holds (at least 1: an empty slot, no empty array)."""
        return max([1, *(self.written(k)[0] for k in range(self.chunks - 1))])

    @property
    def full(self) -> int:
        """The full cache's frames: the most any write holds (at least 1)."""
        return max([1, *(self.written(k)[1] for k in range(self.chunks - 1))])

    def cache_slots(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The cache write after chunk k: each slot's latent frame and chunk (compressed slots, then full ones),
        int32, -1 where empty."""
        compressed, full = self.written(k)
        pos = np.full(self.compressed + self.full, -1, np.int32)
        pos[:compressed] = np.arange(compressed)
        pos[self.compressed:self.compressed + full] = compressed + np.arange(full)
        chunk_of = np.repeat(np.arange(self.chunks), self.partition)
        chunk = np.where(pos >= 0, chunk_of[np.maximum(pos, 0)], -1).astype(np.int32)
        return pos, chunk

    def step_positions(self, k: int) -> np.ndarray:
        """The step of chunk k: each cache slot's latent frame (what the write after chunk k - 1 left), then the
        chunk's frames, int32, -1 where empty."""
        cache = self.cache_slots(k - 1)[0] if k > 0 else np.full(self.compressed + self.full, -1, np.int32)
        own = np.full(self.chunk, -1, np.int32)
        own[:self.partition[k]] = self.start(k) + np.arange(self.partition[k])
        return np.concatenate([cache, own])

    def cache_latents(self, video: np.ndarray, k: int) -> np.ndarray:
        """The write after chunk k's `latents` input: the clean latent frames of `video` (B, z, T, h, w) at their
        slots, zeros in empty ones."""
        pos, _ = self.cache_slots(k)
        out = np.zeros((*video.shape[:2], len(pos), *video.shape[3:]), np.float32)
        out[:, :, pos >= 0] = video[:, :, pos[pos >= 0]]
        return out

    def context_chunks(self, given: int) -> int:
        """How many chunks `given` latent frames of context cover (AnyFlowFARPipeline's num_context_chunks: a chunk
        they end inside counts, its other frames stay zero)."""
        if given <= 0:
            return 0
        if given > sum(self.partition):
            raise UserError(f"{given} latent frames of context, but the video has {sum(self.partition)}")
        return next(i + 1 for i in range(self.chunks) if self.start(i + 1) >= given)

