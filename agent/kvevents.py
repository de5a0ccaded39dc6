"""vLLM's KV cache events, and SGLang's in the same layout (pure): decoding the frames and
turning them into Sluice's digest.

The layout (vLLM's ``ZmqEventPublisher``): every message on the PUB socket has three frames,
``(topic, sequence, payload)``, the sequence an 8-byte big-endian integer; the payload is a
msgpack event batch ``[ts, events, data_parallel_rank]``. Each event is a tagged struct, either
in msgspec's array-like form, ``["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, ...]``, ``["BlockRemoved", block_hashes, medium]`` and
``["AllBlocksCleared"]``, or as a map with a ``type`` tag and named fields. Fields beyond those
named here and unknown event types are ignored; an event that does not decode is skipped and
counted (the batch's other events kept); a message or batch that does not decode raises
:class:`~sluice.agent.errors.KVEventError` (the caller counts and drops it). The replay socket
(ROUTER) answers a request of an empty frame and the 8-byte big-endian starting sequence (as
a REQ socket frames it; vLLM's and SGLang's servers answer nothing else) with ``(empty,
sequence, payload)`` messages, ending with sequence -1.

The engine's block hashes are not Sluice's: :class:`KVEventTracker` hashes each stored block's
token ids with Sluice's own chained block hashing (:mod:`sluice.schemas.hashing`), remembers
which engine hash is which Sluice blocks (engine blocks of any size: a vLLM block of 32
tokens is two Sluice blocks; of SGLang's 1-token pages, every 16th ends one), and yields the
digest's changes (stored, evicted), as the in-process engine's ``cache_changes()`` does, every
``stride``-th block of a chain (the dispatcher's index resolution). A sequence gap is
reported so the caller can replay from it.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from sluice.agent.defaults import KV_MAX_BLOCKS
from sluice.agent.errors import KVEventError
from sluice.schemas.hashing import pack_tokens, packed_block_hashes, unpack_tokens

EngineHash = int | bytes
_SEQ = struct.Struct(">q")
REPLAY_END = -1
"""The sequence that ends a replay."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    tokens: bytes
    """The token ids, packed as Sluice hashes them (:func:`~sluice.schemas.hashing.pack_tokens`):
    the packing checks them, in C, and the hashing needs no second pass."""
    block_size: int

    @property
    def token_ids(self) -> list[int]:
        return unpack_tokens(self.tokens)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[EngineHash, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: tuple[KVEvent, ...]
    dp_rank: int | None = None
    unknown: int = 0
    """Events of types this decoder does not know (skipped)."""
    other_tier: int = 0
    """Events of a tier below the GPU's (skipped): vLLM's CPU offloading, SGLang's host
    cache."""
    malformed: int = 0
    """Events that do not decode (skipped; the batch's others are kept)."""
    error: str | None = None
    """The first of those events' error."""


def replay_endpoint(events: str) -> str:
    """The replay socket beside a KV event publisher at ``events``, by Sluice's convention
    (vLLM takes both as settings): the next port of ``tcp://host:port``, ``PATH.replay`` beside
    ``ipc://PATH``. Another address is a ``KVEventError``."""
    if events.startswith("ipc://") and len(events) > len("ipc://"):
        return f"{events}.replay"
    host, _, port = events.rpartition(":")
    if events.startswith("tcp://") and port.isdigit() and int(port) < 65535:
        return f"{host}:{int(port) + 1}"
    raise KVEventError(f"KV events need tcp://host:port or ipc:///path, not {events!r}")


def encode_seq(seq: int) -> bytes:
    return _SEQ.pack(seq)


def decode_seq(frame: bytes) -> int:
    if len(frame) != _SEQ.size:
        raise KVEventError(f"a sequence frame has 8 bytes, not {len(frame)}")
    value: int = _SEQ.unpack(frame)[0]
    return value


def decode_message(frames: Sequence[bytes]) -> tuple[int, EventBatch]:
    """A PUB message ``(topic, sequence, payload)``: its sequence and batch."""
    if len(frames) != 3:
        raise KVEventError(f"a KV event message has 3 frames, not {len(frames)}")
    return decode_seq(frames[1]), decode_batch(frames[2])


def decode_batch(payload: bytes) -> EventBatch:
    """One msgpack event batch."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # (a map keyed by a list)
        raise KVEventError(f"not msgpack: {exc}") from exc
    if not isinstance(raw, list | tuple) or len(raw) < 2 or not isinstance(raw[1], list):
        raise KVEventError("an event batch is [ts, events, dp_rank]")
    ts, items = raw[0], raw[1]
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise KVEventError("an event batch's ts is a number")
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    events: list[KVEvent] = []
    unknown = other_tier = malformed = 0
    error = None
    for item in items:
        try:
            ev = _event(item)
        except KVEventError as exc:
            # One event nothing can read (SGLang's bigram pages carry token pairs, say): the
            # batch's other events still hold, and dropping them lost what they stored.
            malformed += 1
            error = error or str(exc)
            continue
        if ev is None:
            unknown += 1
        elif isinstance(ev, _OtherTier):
            other_tier += 1
        else:
            events.append(ev)
    return EventBatch(float(ts), tuple(events), rank, unknown, other_tier, malformed, error)


_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}  # fmt: skip


class _OtherTier:
    """What :func:`_event` returns for an event of a tier below the GPU's."""


_OTHER_TIER = _OtherTier()


def _event(item: Any) -> KVEvent | _OtherTier | None:
    if isinstance(item, dict):
        tag = item.get("type")
        values = {k: item.get(k) for k in _FIELDS.get(tag, ())} if isinstance(tag, str) else {}
    elif isinstance(item, list | tuple) and item and isinstance(item[0], str):
        tag = item[0]
        names = _FIELDS.get(tag, ())
        values = dict(zip(names, list(item[1:]) + [None] * len(names), strict=False))
    else:
        raise KVEventError(f"an event is a tagged array or map, not {type(item).__name__}")
    if tag not in _FIELDS:
        return None
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    medium = values.get("medium")
    if medium is not None and not (isinstance(medium, str) and medium.upper() == "GPU"):
        # A lower tier's copy (vLLM's CPU offloading sends token-less BlockStored events of
        # size 0, SGLang's host cache its own): the mirror follows the GPU's cache, and such
        # an event made its whole batch malformed, the GPU's events in it lost.
        return _OTHER_TIER
    hashes = _hashes(values.get("block_hashes"))
    if tag == "BlockRemoved":
        return BlockRemoved(hashes)
    tokens, size = values.get("token_ids"), values.get("block_size")
    if not isinstance(tokens, list):
        raise KVEventError("BlockStored.token_ids is a list of integers")
    try:
        packed = pack_tokens(tokens)
    except ValueError as exc:
        raise KVEventError(f"BlockStored.token_ids: {exc}") from None
    if not isinstance(size, int) or size < 1:
        raise KVEventError("BlockStored.block_size is an integer >= 1")
    if len(tokens) != size * len(hashes):
        raise KVEventError(
            f"BlockStored has {len(tokens)} token ids for {len(hashes)} blocks of {size}"
        )
    parent = values.get("parent_block_hash")
    if parent is not None and not isinstance(parent, int | bytes):
        raise KVEventError("BlockStored.parent_block_hash is an integer, bytes or null")
    return BlockStored(hashes, parent, packed, size)


def _hashes(value: Any) -> tuple[EngineHash, ...]:
    if not isinstance(value, list) or not all(isinstance(h, int | bytes) for h in value):
        raise KVEventError("block_hashes is a list of integers or bytes")
    return tuple(value)


@dataclass
class TrackerStats:
    batches: int = 0
    gaps: int = 0
    orphans: int = 0
    """Stored blocks whose parent the tracker never saw (its chain cannot be hashed)."""
    unknown_events: int = 0
    other_tier_events: int = 0
    """Events of a tier below the GPU's, skipped (:attr:`EventBatch.other_tier`)."""
    malformed_events: int = 0
    """Events that did not decode, skipped (:attr:`EventBatch.malformed`)."""
    unfilled: int = 0
    """Batches of a gap that its replay did not return (gone from the publisher's buffer)."""
    conflicts: int = 0
    """Stored blocks whose engine hash the mirror holds at another depth: a publisher whose
    block hashes are not chained, whose events map onto wrong Sluice blocks."""
    restarts: int = 0
    """Times the live sequence went back: a restarted publisher (its engine's cache is empty
    again)."""
    publishers_lost: int = 0
    """Times the link to the publisher closed (:meth:`KVEventTracker.publisher_lost`)."""


class _Block:
    """An engine block that ends where a Sluice block ends (vLLM's blocks: every one)."""

    __slots__ = ("depth", "sluice")

    def __init__(self, sluice: tuple[int, ...], depth: int) -> None:
        self.sluice = sluice
        """The Sluice blocks this engine block completes: one for a block of Sluice's size,
        ``block_size / block_tokens`` for a whole multiple of it, none for most of the pages
        of an engine whose pages are smaller (SGLang's 1-token pages: every 16th ends one)."""
        self.depth = depth
        """Sluice blocks complete through the end of this engine block (1: the prompt's
        first)."""

    @property
    def last(self) -> int:
        """The Sluice hash of the last of them (0: none yet), the parent of the chain's next."""
        return self.sluice[-1]

    @property
    def tail(self) -> bytes:
        """The packed token ids past that block (fewer than a Sluice block), which the
        chain's next engine block continues."""
        return b""

    def reported(self, stride: int) -> list[int]:
        """Its Sluice blocks the digest carries (every ``stride``-th of the prompt)."""
        first = self.depth - len(self.sluice) + 1
        return [h for i, h in enumerate(self.sluice) if (first + i) % stride == 0]


class _Partial(_Block):
    """An engine block that ends inside a Sluice block (an SGLang page, a 24-token block):
    it keeps the chain's last Sluice hash and the tokens since. A class apart, so that vLLM's
    blocks, the common case, carry neither (16 bytes a block)."""

    __slots__ = ("_last", "_tail")

    def __init__(self, sluice: tuple[int, ...], depth: int, last: int, tail: bytes) -> None:
        super().__init__(sluice, depth)
        self._last, self._tail = last, tail

    @property
    def last(self) -> int:
        return self._last

    @property
    def tail(self) -> bytes:
        return self._tail


@dataclass
class KVEventTracker:
    """What an engine's KV events say its cache holds, as Sluice digest changes. It mirrors
    at most ``max_blocks`` blocks: past that, the oldest stored are dropped (and reported
    evicted), as if the engine had evicted them: a block whose removal event was lost (a gap
    no replay filled) must not stay forever."""

    block_tokens: int
    stride: int = 1
    max_blocks: int = KV_MAX_BLOCKS
    expected_seq: int | None = None
    stats: TrackerStats = field(default_factory=TrackerStats)
    _blocks: dict[EngineHash, _Block] = field(default_factory=dict)
    _stored: list[int] = field(default_factory=list)
    _evicted: list[int] = field(default_factory=list)
    _lost: bool = False

    def __post_init__(self) -> None:
        if self.max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")

    def __len__(self) -> int:
        """Engine blocks mirrored now."""
        return len(self._blocks)

    def apply(self, seq: int, batch: EventBatch) -> int | None:
        """:meth:`check` live batch ``seq``, then :meth:`fill` it: the sequence to replay
        from if it skipped some (the batch is applied anyway: what it stores is true). A
        follower that can replay does it between the two, so that a chain the missed batches
        started is known when the live batch continues it."""
        gap = self.check(seq)
        self.fill(seq, batch)
        return gap

    def check(self, seq: int) -> int | None:
        """The bookkeeping of live batch ``seq``, before it is applied: returns the first
        sequence it skipped (to replay, through :meth:`fill`), else None. A live sequence that
        goes back is a restarted engine (vLLM's publisher counts from 0 again, and its first
        batches may be missed): the mirror empties, and follows it."""
        gap = None
        if self._lost:
            # The first batch heard after the link closed: a restarted engine's, whose first
            # batches the new link may have missed.
            self._lost = False
            if seq > 0:
                gap = 0
                self.stats.gaps += 1
        elif self.expected_seq is not None and seq < self.expected_seq:
            # What the mirror holds is gone with the engine. (Only a 0, or a sequence 1,000
            # back, counted as a restart: one that restarted within its first 1,000 batches,
            # or whose first batches after it were missed, had its events ignored until its
            # count passed the old one's, and its lost blocks kept.)
            self.stats.restarts += 1
            for h in list(self._blocks):
                self._remove(h)
            if seq > 0:  # the new publisher's first batches were missed: replay them
                gap = 0
                self.stats.gaps += 1
        elif self.expected_seq is not None and seq > self.expected_seq:
            gap = self.expected_seq
            self.stats.gaps += 1
        self.expected_seq = seq + 1
        return gap

    def publisher_lost(self) -> None:
        """The link to the publisher closed (its engine stopped, or the link broke): what the
        mirror holds may be gone with the engine, so it empties, and the next sequence heard
        starts afresh (a restarted engine's, which may be past the old one's; past 0, its
        earlier batches are replayed)."""
        self.stats.publishers_lost += 1
        for h in list(self._blocks):
            self._remove(h)
        self.expected_seq = None
        self._lost = True

    def fill(self, seq: int, batch: EventBatch) -> None:
        """Apply batch ``seq``: a live one :meth:`check` passed, or a replayed one a gap
        skipped."""
        self.stats.batches += 1
        self.stats.unknown_events += batch.unknown
        self.stats.other_tier_events += batch.other_tier
        self.stats.malformed_events += batch.malformed
        self._apply_events(batch)

    def _apply_events(self, batch: EventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._store(ev)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._remove(h)
            else:
                for h in list(self._blocks):
                    self._remove(h)

    def _store(self, ev: BlockStored) -> None:
        # Engine blocks of any size map onto Sluice's: the chain's tokens are hashed in Sluice
        # blocks, and each Sluice block belongs to the engine block it ends in (vLLM's
        # --block-size 32 is two a block; SGLang's page of 1 token ends one every 16th page).
        if ev.parent_block_hash is None:
            last, depth, tail = 0, 0, b""
        else:
            parent = self._blocks.get(ev.parent_block_hash)
            if parent is None:
                self.stats.orphans += 1
                return
            last, depth, tail = parent.last, parent.depth, parent.tail
        bt = self.block_tokens
        data = tail + ev.tokens if tail else ev.tokens
        ours = packed_block_hashes(data, bt, last)
        blocks = self._blocks
        start = len(tail) // 4  # tokens of the chain before this event's, past its last block
        done = 0
        for i, engine_hash in enumerate(ev.block_hashes):
            end = start + (i + 1) * ev.block_size
            through = end // bt
            known = blocks.get(engine_hash)
            if known is not None:
                if known.depth != depth + through:
                    # The same engine hash at another place in a chain: a publisher whose
                    # hashes are not chained (older SGLang hashed a page's tokens alone).
                    self.stats.conflicts += 1
            else:
                mine = tuple(ours[done:through])
                if mine and end == through * bt:
                    block = blocks[engine_hash] = _Block(mine, depth + through)
                else:
                    block = blocks[engine_hash] = _Partial(
                        mine,
                        depth + through,
                        ours[through - 1] if through else last,
                        data[through * bt * 4 : end * 4],
                    )
                if mine:
                    self._stored.extend(block.reported(self.stride))
            done = through
        if len(blocks) > self.max_blocks:
            # The oldest stored go, a hundredth of the bound at a time: the dict's first key
            # is found past every slot deleted before it, so one at a time cost a scan of all
            # those deleted since its last resize, for every block stored at the bound.
            over = len(blocks) - self.max_blocks + self.max_blocks // 100
            for h in list(itertools.islice(blocks, over)):
                self._remove(h)

    def _remove(self, engine_hash: EngineHash) -> None:
        block = self._blocks.pop(engine_hash, None)
        if block is not None:
            self._evicted.extend(block.reported(self.stride))

    def cache_changes(self) -> tuple[list[int], list[int]]:
        """Sluice block hashes stored and evicted since the last call (for the digest)."""
        out = (self._stored, self._evicted)
        self._stored, self._evicted = [], []
        return out

    def cached_blocks(self) -> list[int]:
        """Every reported Sluice block hash the engine holds now (for a snapshot)."""
        return [h for b in self._blocks.values() if b.sluice for h in b.reported(self.stride)]
