"""The bytes a `DistributedTraceLogger` moves between ranks: the run name, and frames of candidates.

A rank's frame is a header length, an orjson header, then the payloads back to back. torch is
imported by whoever builds a `Collective`, never when this module is imported.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson

from .._fronts.selection import Ended
from .._security import shown
from .._select.base import Entry

if TYPE_CHECKING:
    import torch

__all__ = ["Collective", "Parts", "RankPart", "frame", "unframe"]

_FRAME = struct.Struct(">I")
# Every buffer a collective moves starts with the real length of what it carries: buffers are
# padded, to the longest frame of a reduction (gather needs equal sizes) or to a fixed size.
_LENGTH = struct.Struct(">Q")
# A run name, and the seed a group sampler drew (see DistributedTraceLogger), fit in this.
_RUN_NAME_BYTES = 320

Cands = list[tuple[Entry, bytes]]


class RankPart(NamedTuple):
    """One rank's part of a step, as the writing rank reads it from the rank's frame: how many
    samples it was offered, and its candidates and watched samples, each with its payload."""

    rank: int
    offered: int
    cands: Cands
    watched: Cands


# (split, step) -> each rank's part of it, in the order of the frames
Parts = dict[tuple[str, int], list[RankPart]]


class Collective:
    """One rank's place in `group` (a world of one without an initialised process group)."""

    def __init__(self, group: Any, dst: int | None, device: torch.device | str | None) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist, self.group = torch, dist, group
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.dst = dist.get_global_rank(group, 0) if dst is None and group is not None else (dst or 0)
            self.dst_group_rank = dist.get_group_rank(group, self.dst) if group is not None else self.dst
        else:
            self.rank, self.world_size, self.dst, self.dst_group_rank = 0, 1, 0, 0
        self.device = self._pick_device(device)

    @property
    def alone(self) -> bool:
        return not self.distributed or self.world_size == 1

    def _pick_device(self, device: torch.device | str | None) -> torch.device:
        import torch

        if device is not None:
            return torch.device(device)
        if not self.distributed:
            return torch.device("cpu")
        backend = str(self._dist.get_backend(self.group)).lower()
        # Gloo (alone or in a "cpu:gloo,cuda:nccl" pair) moves CPU tensors; NCCL alone needs
        # tensors on this rank's current GPU.
        if "gloo" in backend or "nccl" not in backend:
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def agree(self, name: str) -> str:
        """Rank 0's `name`, on every rank, so each writes to (or names its run after) the same run."""
        if self.alone:
            return name
        raw = name.encode()
        if len(raw) > _RUN_NAME_BYTES:
            raise ValueError(f"run name is longer than {_RUN_NAME_BYTES} bytes: {shown(name)}")
        src = self._dist.get_global_rank(self.group, 0) if self.group is not None else 0
        return self._broadcast(raw, src).decode()

    def told_by_writer(self, text: str) -> str:
        """The writing rank's `text` (cut to a few hundred bytes), on every rank."""
        if self.alone:
            return text
        raw = text.encode()[:_RUN_NAME_BYTES]
        return self._broadcast(raw, self.dst).decode(errors="replace")

    def _broadcast(self, raw: bytes, src: int) -> bytes:
        buf = _padded(raw, _RUN_NAME_BYTES)
        tensor = self._torch.frombuffer(buf, dtype=self._torch.uint8).to(self.device)
        self._dist.broadcast(tensor, src=src, group=self.group)
        return _unpadded(_tensor_bytes(tensor))

    def gather(self, frame: bytes) -> tuple[list[bytes] | None, int]:
        """Every rank's frame, on the writing rank (None elsewhere), and the bytes this rank sent."""
        if self.alone:
            return [frame], 0
        torch, dist = self._torch, self._dist
        size = torch.tensor([len(frame)], dtype=torch.int64, device=self.device)
        dist.all_reduce(size, op=dist.ReduceOp.MAX, group=self.group)
        longest = int(size.item())
        sent = size.element_size()
        writes = self.rank == self.dst_group_rank
        if longest == 0:  # no rank has candidates: skip the gather altogether
            return ([b""] * self.world_size if writes else None), sent
        tensor = torch.frombuffer(_padded(frame, longest), dtype=torch.uint8).to(self.device)
        sent += tensor.numel()
        if not writes:
            dist.gather(tensor, gather_list=None, dst=self.dst, group=self.group)
            return None, sent
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.gather(tensor, gather_list=parts, dst=self.dst, group=self.group)
        return [_unpadded(_tensor_bytes(part)) for part in parts], sent


def frame(rank: int, ended: Ended) -> tuple[bytes, int]:
    """This rank's candidates of the `ended` steps as one frame, and the bytes of their payloads."""
    steps = []
    payloads: list[bytes] = []
    for (split, step), opened in ended:
        entries = []
        for seq, (entry, payload) in sorted(opened.kept.items()):
            # The key a sampler drew travels with the entry, so the merge can rank by it.
            row = [seq, entry.score, len(payload)]
            entries.append(row if entry.key is None else [*row, entry.key])
            payloads.append(payload)
        watched = []
        for entry, payload in opened.watched:
            watched.append([entry.seq, entry.score, len(payload)])
            payloads.append(payload)
        steps.append([split, step, opened.offered, entries, watched])
    if not steps:
        return b"", 0
    head = orjson.dumps({"rank": rank, "steps": steps})
    blob = b"".join(payloads)
    return _FRAME.pack(len(head)) + head + blob, len(blob)


def unframe(frames: Sequence[bytes], group_of: Callable[[bytes], Hashable | None]) -> Parts:
    """Every rank's candidates by (split, step), from the gathered frames, each step's parts in
    the order of `frames`."""
    by_step: Parts = {}
    for raw in frames:
        if not raw:
            continue
        (head_len,) = _FRAME.unpack_from(raw)
        head = orjson.loads(raw[_FRAME.size : _FRAME.size + head_len])
        offset = _FRAME.size + head_len
        rank = int(head["rank"])
        for split, step, offered, *lists in head["steps"]:
            read: list[Cands] = []
            for entries in lists:
                cands = []
                for seq, score, size, *key_if_any in entries:
                    key = key_if_any[0] if key_if_any else None
                    payload = raw[offset : offset + size]
                    cands.append((Entry(score, int(seq), key=key, group=group_of(payload)), payload))
                    offset += size
                read.append(cands)
            by_step.setdefault((split, int(step)), []).append(RankPart(rank, int(offered), read[0], read[1]))
    return by_step


def _padded(data: bytes, size: int) -> bytearray:
    """`data` after its length, padded with zeros to `size` bytes of data."""
    buf = bytearray(_LENGTH.size + size)
    _LENGTH.pack_into(buf, 0, len(data))
    buf[_LENGTH.size : _LENGTH.size + len(data)] = data
    return buf


def _unpadded(raw: bytes) -> bytes:
    """The data of a `_padded` buffer, without its length and padding."""
    (n,) = _LENGTH.unpack_from(raw)
    return raw[_LENGTH.size : _LENGTH.size + n]


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A uint8 tensor's bytes, without numpy (torch does not require it)."""
    # clone(): a storage of its own, exactly the tensor's size.
    return bytes(tensor.detach().cpu().clone().untyped_storage())
