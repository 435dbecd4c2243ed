"""The known byte pattern a prefill writes for a room and a decode checks, page by page.

Every byte is a function of where it belongs in the request, not of where it sits in memory:
(room, KV buffer, the request's page number, token in page, global KV head, byte in head).
So a page that lands on the wrong destination page, a head slice at the wrong offset, or the
bytes of an earlier room all read as wrong. Both processes compute it with the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Bytes = npt.NDArray[np.uint8]

#: Odd 64-bit multipliers: each coordinate moves the hash differently.
_MIX = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5)


def _mix(*coords: npt.NDArray[np.uint64] | int) -> Bytes:
    with np.errstate(over="ignore"):  # wrapping multiplication is the point
        acc = np.uint64(0x5851F42D4C957F2D)
        for i, coord in enumerate(coords):
            acc = (acc ^ np.asarray(coord, dtype=np.uint64)) * np.uint64(_MIX[i % len(_MIX)])
        out: Bytes = ((acc >> np.uint64(29)) & np.uint64(0xFF)).astype(np.uint8)
    return out


@dataclass(frozen=True)
class Geometry:
    """One side's KV layout: ``layers`` K and V buffers of ``slots`` pages each; a page is
    ``page_size`` tokens of ``heads`` KV heads (this rank's) of ``head_bytes`` bytes. MLA keeps
    one latent "head" that every rank holds whole."""

    layers: int = 2
    slots: int = 96
    page_size: int = 1
    heads: int = 4
    head_bytes: int = 32
    aux_item_len: int = 24
    aux_slots: int = 16
    state_item_len: int = 40
    state_slots: int = 8

    @property
    def buffers(self) -> int:
        return 2 * self.layers  # K of every layer, then V of every layer (SGLang's order)

    @property
    def item_len(self) -> int:
        return self.page_size * self.heads * self.head_bytes


def page_bytes(
    room: int, buffer: int, page: int, geometry: Geometry, first_head: int, heads: int
) -> Bytes:
    """The ``page``-th page of ``room`` in KV ``buffer``, heads ``first_head`` onward:
    ``page_size * heads * head_bytes`` bytes, token-major as SGLang's pools lay them out."""
    token = np.arange(geometry.page_size, dtype=np.uint64).reshape(-1, 1, 1)
    head = np.arange(first_head, first_head + heads, dtype=np.uint64).reshape(1, -1, 1)
    byte = np.arange(geometry.head_bytes, dtype=np.uint64).reshape(1, 1, -1)
    return _mix(room, buffer, page, token, head, byte).reshape(-1)


def aux_bytes(room: int, buffer: int, length: int) -> Bytes:
    return _mix(room, 1_000_000 + buffer, np.arange(length, dtype=np.uint64))


def state_bytes(room: int, buffer: int, length: int) -> Bytes:
    return _mix(room, 2_000_000 + buffer, np.arange(length, dtype=np.uint64))
