"""The rank's tensors: named parts per tensor kind, allocation and freeing, wire packing, live-byte accounting.

Parts by kind (token-major, as the dumps: [B, T, H·, D]; LSE and D fp32 [B, H, T]):
``q``: q; ``kv``: k, v (Hkv heads); ``out``: o, lse; ``dout``: do; ``qside``: q, do, lse, delta;
``dside``: do, lse, delta; ``dq``: dq; ``dkv``: dk, dv (Hkv heads). Value parts are stored in the
tensor's dtype and travel in the send's dtype; LSE and D are always fp32. On the wire a tensor is its
parts' bytes concatenated in this order, so a transfer moves exactly the schedule's ``size_bytes``.
"""

from __future__ import annotations

import threading

import torch

from meshplan.executor.kernels import TORCH_DTYPE
from meshplan.executor.program import FP32_PARTS, PARTS, Layout


class Store:
    """Live tensors of one rank: id -> {part: torch.Tensor}; counts live bytes and their peak."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.data: dict[int, dict[str, torch.Tensor]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._lock = threading.Lock()

    def alloc(self, tid: int, layout: Layout, dtype: str) -> dict[str, torch.Tensor]:
        """Create tensor ``tid`` at the identity: values 0, LSE −inf (semantics rule 6)."""
        parts = {}
        for part in PARTS[layout.kind]:
            dt = torch.float32 if part in FP32_PARTS else TORCH_DTYPE[dtype]
            fill = float("-inf") if part == "lse" else 0.0
            parts[part] = torch.full(layout.shape(part), fill, dtype=dt, device=self.device)
        self.put(tid, parts)
        return parts

    def put(self, tid: int, parts: dict[str, torch.Tensor]) -> None:
        """Register (or replace) tensor ``tid``."""
        size = sum(t.numel() * t.element_size() for t in parts.values())
        with self._lock:
            old = self.data.get(tid)
            if old is not None:
                self.live_bytes -= sum(t.numel() * t.element_size() for t in old.values())
            self.data[tid] = parts
            self.live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def free(self, tid: int) -> None:
        """Drop tensor ``tid`` (its memory returns to torch's allocator)."""
        with self._lock:
            parts = self.data.pop(tid, None)
            if parts is not None:
                self.live_bytes -= sum(t.numel() * t.element_size() for t in parts.values())

    def get(self, tid: int) -> dict[str, torch.Tensor]:
        """The parts of a live tensor (KeyError names the tensor if it is not allocated)."""
        try:
            return self.data[tid]
        except KeyError:
            raise KeyError(f"tensor {tid} is used but not allocated (or already freed)") from None


def pack(parts: dict[str, torch.Tensor], kind: str, dtype: str) -> torch.Tensor:
    """The wire image of a tensor: its parts in order, value parts cast to ``dtype``, as one uint8 tensor."""
    wire = TORCH_DTYPE[dtype]
    pieces = []
    for part in PARTS[kind]:
        t = parts[part]
        t = t.float() if part in FP32_PARTS else t.to(wire)
        pieces.append(t.contiguous().view(-1).view(torch.uint8))
    return torch.cat(pieces)


def unpack(buf: torch.Tensor, into: dict[str, torch.Tensor], kind: str, dtype: str) -> None:
    """Write a wire image into a tensor's parts (converted to their dtypes)."""
    wire = TORCH_DTYPE[dtype]
    at = 0
    for part in PARTS[kind]:
        dst = into[part]
        dt = torch.float32 if part in FP32_PARTS else wire
        n = dst.numel() * dt.itemsize
        dst.copy_(buf[at:at + n].view(dt).view(dst.shape))
        at += n
    if at != buf.numel():
        raise ValueError(f"wire image of {buf.numel()} bytes for a {kind} tensor of {at} bytes")
