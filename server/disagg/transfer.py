"""The Mooncake transfer engine, as the connectors use it: one engine per server (per
tensor-parallel rank), memory registered once, KV written with one-sided batched writes (packed
head-major first where the two sides split the heads differently), and the arrival record.

An arrival record is the last thing prefill writes for a request, after all of its KV pages: the
decode side polls its record slot and treats a valid record for its own room as "KV complete".
"""

from __future__ import annotations

import itertools
import logging
import struct
import threading
from dataclasses import dataclass

import torch

from tandem.server.disagg.layout import Packed, Writes, destination_runs
from tandem.server.env import quiet_native_logs

log = logging.getLogger("tandem.transfer")

# Mooncake refuses very large batches (3,000 entries failed where 1,000 succeed); stay well below.
MAX_BATCH_ENTRIES = 512

_RECORD = struct.Struct("<qqqdq")  # room, first token, cached tokens, first-token logprob, check
RECORD_BYTES = _RECORD.size
_MAGIC = 0x7A4E_DE3D_C0DE_2025


class TransferError(RuntimeError):
    """A write to a peer failed (the peer died, or its memory is not registered)."""


@dataclass(frozen=True)
class ArrivalRecord:
    room: int
    first_token: int
    cached_tokens: int  # prompt tokens the prefill served from its prefix cache
    logprob: float  # of the first token (0.0 when the request did not ask)

    def pack(self) -> bytes:
        return _RECORD.pack(self.room, self.first_token, self.cached_tokens, self.logprob, self._check())

    def _check(self) -> int:
        mixed = (self.room * 0x9E37_79B9) ^ (self.first_token * 0x85EB_CA6B) ^ (self.cached_tokens * 0xC2B2_AE35)
        return (mixed ^ _MAGIC) & 0x7FFF_FFFF_FFFF_FFFF

    @classmethod
    def unpack(cls, data: bytes) -> "ArrivalRecord | None":
        """The record in `data`, or None while it is empty or incomplete (a torn read)."""
        room, token, cached, logprob, check = _RECORD.unpack(data)
        record = cls(room, token, cached, logprob)
        return record if check == record._check() and check != 0 else None


class RecordBuffer:
    """One arrival-record slot per request slot, in registered host memory."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.tensor = torch.zeros(num_slots * RECORD_BYTES, dtype=torch.uint8)

    @property
    def base(self) -> int:
        return self.tensor.data_ptr()

    def address(self, slot: int) -> int:
        return self.base + slot * RECORD_BYTES

    def clear(self, slot: int) -> None:
        self.tensor[slot * RECORD_BYTES : (slot + 1) * RECORD_BYTES] = 0

    def read(self, slot: int) -> ArrivalRecord | None:
        raw = self.tensor[slot * RECORD_BYTES : (slot + 1) * RECORD_BYTES].numpy().tobytes()
        return ArrivalRecord.unpack(raw)

    def write(self, slot: int, record: ArrivalRecord) -> None:
        data = torch.frombuffer(bytearray(record.pack()), dtype=torch.uint8)
        self.tensor[slot * RECORD_BYTES : (slot + 1) * RECORD_BYTES] = data


class MooncakeTransfer:
    """One Mooncake TransferEngine in P2P-handshake mode. `session` is what peers write to."""

    def __init__(self, host: str, protocol: str, ib_devices: str = ""):
        quiet_native_logs()
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise RuntimeError(
                "prefill/decode roles need the Mooncake transfer engine: pip install "
                "mooncake-transfer-engine-non-cuda (CPU; needs Debian's libibverbs1 and libnuma1) "
                f"or mooncake-transfer-engine (CUDA): {e}"
            ) from e
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", protocol, ib_devices)
        if rc != 0:
            raise RuntimeError(f"Mooncake initialize({host!r}, protocol={protocol!r}, devices={ib_devices!r}) returned {rc}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: list[torch.Tensor] = []  # kept alive as long as Mooncake may touch them
        self._lock = threading.Lock()  # sender threads register and unregister staging tensors

    def register(self, tensor: torch.Tensor) -> int:
        """Register a contiguous tensor's memory for one-sided access; returns its address."""
        assert tensor.is_contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        rc = self.engine.register_memory(tensor.data_ptr(), nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory of {nbytes} bytes returned {rc}")
        with self._lock:
            self._registered.append(tensor)
        return tensor.data_ptr()

    def unregister(self, tensor: torch.Tensor) -> None:
        rc = self.engine.unregister_memory(tensor.data_ptr())
        if rc != 0:  # it stays registered (and alive): nothing can write to freed memory
            log.warning("Mooncake unregister_memory of %d bytes returned %d", tensor.numel() * tensor.element_size(), rc)
            return
        with self._lock:
            self._registered = [t for t in self._registered if t is not tensor]

    def send(self, buffer: torch.Tensor, writes: list[Writes]) -> None:
        """Make `writes` from `buffer` (this rank's KV pool, [layers, 2, pages, page_size, heads,
        head_dim]); a packed write first copies its heads head-major into a registered staging
        tensor, freed once written. Raises TransferError."""
        for w in writes:
            if w.packed is None:
                self.write(w.session, w.srcs, w.dsts, w.lens)
                continue
            staging = pack(buffer, w.packed)
            if staging.is_cuda:  # the copies must be done before the NIC reads them
                torch.cuda.current_stream(staging.device).synchronize()
            base = self.register(staging)
            srcs = [base + offset for offset in itertools.accumulate(w.lens, initial=0)][:-1]
            try:
                self.write(w.session, srcs, w.dsts, w.lens)
            finally:
                self.unregister(staging)

    def write(self, session: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        """Copy local [src, src+len) onto the peer's [dst, dst+len), blocking; raise TransferError."""
        for i in range(0, len(srcs), MAX_BATCH_ENTRIES):
            j = i + MAX_BATCH_ENTRIES
            rc = self.engine.batch_transfer_sync_write(session, srcs[i:j], dsts[i:j], lens[i:j])
            if rc != 0:
                raise TransferError(f"Mooncake write of {sum(lens[i:j])} bytes to {session} failed (rc={rc})")


def pack(buffer: torch.Tensor, packed: Packed) -> torch.Tensor:
    """The source side of a packed write: its chunks, in (run, layer, K|V) order, each a run's
    pages of the packed heads laid out [heads, pages, page_size, head_dim]; one flat tensor."""
    return torch.cat([buffer[:, :, pages, :, packed.first : packed.last].permute(0, 1, 4, 2, 3, 5).reshape(-1)
                      for pages in packed.runs])


def token_major(buffer: torch.Tensor, pages: list[int]) -> None:
    """Turn `pages` of a KV pool that arrived head-major (packed writes: [heads, pages,
    page_size, head_dim] per run of consecutive pages, layer and K|V) back into the pool's
    token-major layout, in place."""
    layers, kv, _, page_size, heads, head_dim = buffer.shape
    for start, count in destination_runs(pages):
        run = buffer[:, :, start : start + count]
        arrived = run.clone().view(layers, kv, heads, count, page_size, head_dim)  # a copy: run is overwritten
        run.copy_(arrived.permute(0, 1, 3, 4, 2, 5))
