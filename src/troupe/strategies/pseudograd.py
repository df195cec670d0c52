"""DiLoCo's pseudo-gradients on the wire (`pseudo_grad_dtype`): fp32, bf16, fp8, int8 or int4.

fp32 travels as one all-reduce (sum). The others are not summed on the wire: a bf16 or
integer sum rounds differently on every path through the reduction, and the groups must end
each outer step bit for bit equal. So each group encodes its flat pseudo-gradient, the groups
all-gather the encoded bytes, and every worker decodes each group's piece and adds them in fp32
in group order: the same bytes, the same operations in the same order, the same result everywhere.

int8 and int4 use absmax scaling per chunk of `CHUNK` consecutive elements of the flat vector
(scale = absmax / 127 or / 7, round to nearest), so a chunk of small values (a bias) keeps its
precision beside one of large values. Round trip error per element <= scale / 2, that is
absmax/254 (int8) and absmax/14 (int4) of its chunk. int4 packs two codes (offset by 8) per byte.
fp8 is float8 e4m3 (3 mantissa bits, largest 448) with the same per-chunk scaling (scale = absmax / 448),
so its error is relative: |x - round trip| <= max(|x| / 16, scale / 1024) per element (half an ulp of
the scaled value; below 2**-6, fp8's subnormals, half their spacing 2**-9).

Wire bytes per outer step and worker, for P elements over G groups (all-gather: (G - 1) pieces
reach each worker): fp32 2(G-1)/G * 4P (ring all-reduce); bf16 (G-1) * 2P; int8 (G-1) * (P + 4P/CHUNK);
int4 (G-1) * (P/2 + 4P/CHUNK); fp8 as int8. With 2 groups bf16/int8/int4 send 1/2, 1/4 and 1/8 of fp32; the
all-gather grows with G, so past G = 4 bf16 sends more than the fp32 all-reduce (int8 past G = 8).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from troupe.runtime.comm import Communicator, Handle

PseudoGradDtype = Literal["fp32", "bf16", "fp8", "int8", "int4"]

CHUNK = 1024
"""Elements sharing one fp8/int8/int4 scale (even, so that int4's codes pair up within a chunk)."""

LEVELS = {"int8": 127, "int4": 7, "fp8": 448}
"""The largest code magnitude: integer codes in [-LEVELS, LEVELS]; fp8's, float8 e4m3 values up to 448."""


def _chunked(flat: Tensor) -> Tensor:
    """`flat` zero-padded to whole chunks, shaped (chunks, CHUNK)."""
    pad = -flat.numel() % CHUNK
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, CHUNK)


def encode(flat: Tensor, dtype: PseudoGradDtype) -> Tensor:
    """One flat fp32 vector as the bytes (uint8) that travel for `dtype`."""
    if dtype == "fp32":
        return flat.float().contiguous().view(torch.uint8)
    if dtype == "bf16":
        return flat.to(torch.bfloat16).view(torch.uint8)
    levels = LEVELS[dtype]
    chunks = _chunked(flat.float())
    scale = chunks.abs().amax(dim=1) / levels
    # A chunk of zeros has scale 0; dividing by 1 there keeps its codes 0 (not NaN).
    scaled = chunks / torch.where(scale > 0, scale, 1.0).unsqueeze(1)
    if dtype == "fp8":  # (x / scale is within [-448, 448]: the cast rounds to nearest, never overflows)
        return torch.cat([scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1),
                          scale.contiguous().view(torch.uint8)])
    codes = torch.round(scaled).clamp_(-levels, levels)
    if dtype == "int8":
        packed = codes.to(torch.int8).view(torch.uint8).reshape(-1)
    else:
        nibbles = (codes + 8).to(torch.uint8).view(-1, 2)
        packed = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return torch.cat([packed, scale.contiguous().view(torch.uint8)])


def decode(payload: Tensor, numel: int, dtype: PseudoGradDtype) -> Tensor:
    """The flat fp32 vector of `numel` elements that `encode` turned into `payload`."""
    if dtype == "fp32":
        return payload.view(torch.float32)[:numel].clone()
    if dtype == "bf16":
        return payload.view(torch.bfloat16)[:numel].float()
    nchunks = -(-numel // CHUNK)
    code_bytes = nchunks * CHUNK // (2 if dtype == "int4" else 1)
    packed, scale = payload[:code_bytes], payload[code_bytes:].view(torch.float32)
    if dtype == "fp8":
        codes = packed.view(torch.float8_e4m3fn).float()
    elif dtype == "int8":
        codes = packed.view(torch.int8).float()
    else:
        codes = torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1).float() - 8
    return (codes.view(nchunks, CHUNK) * scale.unsqueeze(1)).reshape(-1)[:numel]


def wire_size(numel: int, dtype: PseudoGradDtype) -> int:
    """Bytes `encode` makes of `numel` elements."""
    if dtype in ("fp32", "bf16"):
        return numel * (4 if dtype == "fp32" else 2)
    nchunks = -(-numel // CHUNK)
    return nchunks * CHUNK // (2 if dtype == "int4" else 1) + 4 * nchunks


class PendingMean:
    """The groups' mean pseudo-gradient in flight (`start_mean`): `wait()` writes it into the deltas."""

    def __init__(self, deltas: Sequence[Tensor], groups: int, dtype: PseudoGradDtype, handle: Handle, numel: int):
        self.deltas, self.groups, self.dtype, self.handle, self.numel = list(deltas), groups, dtype, handle, numel

    def wait(self) -> list[Tensor]:
        """Complete the exchange; the deltas now hold the mean, bit for bit the same on every worker."""
        if self.dtype == "fp32":
            self.handle.wait()
            # A sum then one division, the same on every worker: the groups end bit for bit equal.
            for d in self.deltas:
                d.div_(self.groups)
            return self.deltas
        total = torch.zeros(self.numel)
        for (piece,) in self.handle.result():  # group order: the same additions everywhere
            total += decode(piece, self.numel, self.dtype)
        total /= self.groups
        offset = 0
        for d in self.deltas:
            d.copy_(total[offset:offset + d.numel()].view_as(d))
            offset += d.numel()
        return self.deltas


def start_mean(comm: Communicator, deltas: Sequence[Tensor], dtype: PseudoGradDtype) -> PendingMean:
    """Start averaging `deltas` (this group's pseudo-gradients) over `comm`'s groups, in the background."""
    if dtype == "fp32":
        handle = comm.fused_all_reduce(deltas, "sum", async_op=True)
        return PendingMean(deltas, comm.world_size, dtype, handle, 0)
    flat = torch.cat([d.detach().reshape(-1).float() for d in deltas])
    future = comm.all_gather_packed([encode(flat, dtype)], same_sizes=True)
    return PendingMean(deltas, comm.world_size, dtype, future, flat.numel())


def mean_over_groups(comm: Communicator, deltas: Sequence[Tensor], dtype: PseudoGradDtype) -> None:
    """Replace `deltas` (this group's pseudo-gradients) by their mean over `comm`'s groups, in place,
    bit for bit the same on every worker of `comm`."""
    start_mean(comm, deltas, dtype).wait()
