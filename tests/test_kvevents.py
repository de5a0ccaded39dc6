"""The KV event decoder and tracker, on frames built from vLLM's layout (both encodings)."""

from __future__ import annotations

import itertools
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.agent.errors import KVEventError
from sluice.agent.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventTracker,
    decode_batch,
    decode_message,
    encode_seq,
)
from sluice.schemas.hashing import block_hashes, pack_tokens

BT = 16


def _stored_array(hashes: list[Any], parent: Any, tokens: list[int]) -> list[Any]:
    # msgspec array_like + tag: [tag, fields...], with fields vLLM added later at the end.
    return ["BlockStored", hashes, parent, tokens, BT, None, "GPU", "extra-field"]


def _stored_map(hashes: list[Any], parent: Any, tokens: list[int]) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BT,
        "lora_id": None,
        "future": 1,
    }


def _message(seq: int, events: list[Any], ts: float = 1.5) -> list[bytes]:
    return [b"kv-events", encode_seq(seq), msgpack.packb([ts, events, 0])]


@pytest.mark.parametrize("form", [_stored_array, _stored_map])
def test_both_encodings_decode_to_the_same_events(form: Any) -> None:
    tokens = list(range(2 * BT))
    events = [
        form([11, 12], None, tokens),
        ["BlockRemoved", [11], "GPU"] if form is _stored_array else {"type": "BlockRemoved",
                                                                       "block_hashes": [11]},
        ["AllBlocksCleared"] if form is _stored_array else {"type": "AllBlocksCleared"},
        ["SomethingNew", 1, 2] if form is _stored_array else {"type": "SomethingNew"},
    ]  # fmt: skip
    seq, batch = decode_message(_message(7, events))
    assert seq == 7 and batch.ts == 1.5 and batch.dp_rank == 0 and batch.unknown == 1
    assert batch.events == (
        BlockStored((11, 12), None, pack_tokens(tokens), BT),
        BlockRemoved((11,)),
        AllBlocksCleared(),
    )


@pytest.mark.parametrize(
    "frames",
    [
        [b"topic", encode_seq(1)],  # a frame missing
        [b"topic", b"\x00\x01", msgpack.packb([0.0, [], 0])],  # a short sequence
        [b"topic", encode_seq(1), b"\xc1\xc1 not msgpack"],
        [b"topic", encode_seq(1), msgpack.packb({"ts": 1})],  # not a batch
        [b"topic", encode_seq(1), msgpack.packb(["soon", [], 0])],  # ts not a number
    ],
)
def test_malformed_messages_raise_a_typed_error(frames: list[bytes]) -> None:
    with pytest.raises(KVEventError):
        decode_message(frames)


@pytest.mark.parametrize(
    "bad",
    [
        42,  # an event that is a number
        ["BlockStored", [1], None, [1, 2], 16],
        ["BlockStored", "x", None, [], 16],
        ["BlockStored", [1], None, [0] * 16, 0],
        ["BlockRemoved", [1.5]],
        # Token ids Sluice cannot hash (little-endian uint32s): caught here, not by the tracker.
        *(["BlockStored", [1], None, ids, 4] for ids in ([1, 2, 3, -1], [1, 2, 3, 2**32],
                                                         [1, 2, 3, 1.5], [1, 2, 3, "4"])),
        # SGLang's bigram (EAGLE) pages: token pairs.
        ["BlockStored", [1], None, [[1, 2]], 1, None, "GPU"],
    ],
)  # fmt: skip
def test_an_event_that_does_not_decode_is_skipped_and_the_batch_kept(bad: Any) -> None:
    """It made its whole batch malformed: the batch's other events, which decode, were lost
    with it (seen failing so)."""
    good = ["BlockStored", [b"g"], None, list(range(BT)), BT, None, "GPU"]
    batch = decode_batch(msgpack.packb([0.0, [bad, good], 0]))
    assert batch.malformed == 1 and batch.error
    assert batch.events == (BlockStored((b"g",), None, pack_tokens(range(BT)), BT),)
    t = KVEventTracker(BT)
    t.apply(0, batch)
    assert t.stats.malformed_events == 1 and t.cached_blocks() == block_hashes(range(BT), BT)


def test_stored_chains_become_sluice_hashes_of_the_same_tokens() -> None:
    """The blocks line up with what client and dispatcher compute for the prompt's tokens."""
    prompt = list(range(1000, 1000 + 5 * BT))
    t = KVEventTracker(BT)
    first = _stored_array([b"e1", b"e2"], None, prompt[: 2 * BT])
    rest = _stored_array([b"e3", b"e4", b"e5"], b"e2", prompt[2 * BT :])
    assert t.apply(0, decode_batch(msgpack.packb([0.0, [first], 0]))) is None
    assert t.apply(1, decode_batch(msgpack.packb([0.0, [rest], 0]))) is None
    stored, evicted = t.cache_changes()
    assert stored == block_hashes(prompt, BT) and evicted == []
    t.apply(2, decode_batch(msgpack.packb([0.0, [["BlockRemoved", [b"e5", b"unknown"]]]])))
    assert t.cache_changes() == ([], [block_hashes(prompt, BT)[4]])
    t.apply(3, decode_batch(msgpack.packb([0.0, [["AllBlocksCleared"]]])))
    assert sorted(t.cache_changes()[1]) == sorted(block_hashes(prompt, BT)[:4])
    assert t.cached_blocks() == []


@pytest.mark.parametrize(
    ("before", "first_seen", "replay_from"),
    [
        (1500, 0, None),  # vLLM's publisher counts from 0 again
        # Restarted within its first 1,000 batches, its first batches after the restart
        # missed (a SUB socket reconnecting): only a 0 or a sequence 1,000 back counted as a
        # restart, so batches 3-19 were ignored as a replay's overlap and the lost blocks
        # kept (seen failing so). Its batches 0-2 are still in its replay buffer: replayed.
        (20, 3, 0),
    ],
)
def test_a_restarted_engine_is_followed_and_its_old_blocks_evicted(
    before: int, first_seen: int, replay_from: int | None
) -> None:
    """A live sequence that goes back is a restarted engine: its old blocks are evicted and
    its new ones followed (every batch under the old sequence was ignored as a replay's
    overlap, the restart's own events with it: seen, by a helper's probe)."""
    prompt = list(range(1000, 1000 + 2 * BT))
    t = KVEventTracker(BT)
    stored = _stored_array([b"e1", b"e2"], None, prompt)
    for seq in range(before):
        t.apply(seq, decode_batch(msgpack.packb([0.0, [stored] if seq == 0 else [], 0])))
    t.cache_changes()
    again = _stored_array([b"n1"], None, prompt[:BT])
    assert t.apply(first_seen, decode_batch(msgpack.packb([0.0, [again], 0]))) == replay_from
    assert t.stats.restarts == 1 and t.stats.gaps == (replay_from is not None)
    stored_now, evicted = t.cache_changes()
    assert sorted(evicted) == sorted(block_hashes(prompt, BT))
    assert t.cached_blocks() == stored_now == block_hashes(prompt, BT)[:1]
    assert t.apply(first_seen + 1, decode_batch(msgpack.packb([0.0, [], 0]))) is None


def test_a_batch_msgpack_decodes_but_python_cannot_is_a_kv_event_error() -> None:
    # A map keyed by a list: valid msgpack, and a TypeError out of the decoder that ended the
    # agent's KV event loop for good (seen).
    with pytest.raises(KVEventError):
        decode_batch(b"\x81\x91\x01\x02")


def test_gaps_are_reported_and_filled_by_the_replay() -> None:
    t = KVEventTracker(BT)
    empty = decode_batch(msgpack.packb([0.0, [], 0]))
    assert t.apply(5, empty) is None
    assert t.apply(8, empty) == 6  # 6 and 7 were missed: replay from 6
    assert t.stats.gaps == 1
    t.fill(6, empty)  # the replay's batches come as fills
    t.fill(7, empty)
    assert t.apply(9, empty) is None and t.stats.batches == 5 and t.stats.restarts == 0


def test_orphans_and_strides() -> None:
    prompt = list(range(8 * BT))
    t = KVEventTracker(BT, stride=4)
    orphan = _stored_array([1], 999, prompt[:BT])
    chain = _stored_array(list(range(10, 18)), None, prompt)
    t.apply(0, decode_batch(msgpack.packb([0.0, [orphan, chain], 0])))
    assert t.stats.orphans == 1
    full = block_hashes(prompt, BT)
    assert t.cache_changes() == ([full[3], full[7]], [])  # every 4th block, as the index keeps
    assert t.cached_blocks() == [full[3], full[7]]


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 4), blocks=st.integers(1, 8), cut=st.integers(0, 8), stride=st.integers(1, 3)
)
def test_engine_blocks_of_a_multiple_of_sluices_are_that_many_sluice_blocks(
    k: int, blocks: int, cut: int, stride: int
) -> None:
    """vLLM run with ``--block-size 32`` (or 48, 64) against Sluice's 16: each engine block is
    ``k`` Sluice blocks, the prompt's hashes the same as Sluice's own, whatever the split into
    events; removing an engine block evicts its ``k``. Every such block was dropped as a
    wrong size before (counted only; a helper's probe)."""
    prompt = [(7 + i * 31) % 32_000 for i in range(blocks * k * BT)]
    t = KVEventTracker(BT, stride=stride)
    cut = min(cut, blocks)
    first = [f"e{i}".encode() for i in range(cut)]
    rest = [f"e{i}".encode() for i in range(cut, blocks)]
    events = []
    if first:
        events.append(["BlockStored", first, None, prompt[: cut * k * BT], k * BT])
    if rest:
        parent = first[-1] if first else None
        events.append(["BlockStored", rest, parent, prompt[cut * k * BT :], k * BT])
    t.apply(0, decode_batch(msgpack.packb([0.0, events, 0])))
    full = block_hashes(prompt, BT)
    kept = [h for i, h in enumerate(full) if (i + 1) % stride == 0]
    assert t.cache_changes() == (kept, []) and sorted(t.cached_blocks()) == sorted(kept)
    t.apply(1, decode_batch(msgpack.packb([0.0, [["BlockRemoved", [b"e0"]]], 0])))
    gone = [h for i, h in enumerate(full[:k]) if (i + 1) % stride == 0]
    assert t.cache_changes() == ([], gone)


@settings(max_examples=60, deadline=None)
@given(
    blocks=st.integers(1, 24),
    cuts=st.lists(st.integers(1, 23), max_size=6),
    seed=st.integers(0, 1000),
)
def test_any_split_of_a_prompt_into_events_gives_its_block_hashes(
    blocks: int, cuts: list[int], seed: int
) -> None:
    prompt = [(seed * 7919 + i * 31) % 32_000 for i in range(blocks * BT)]
    bounds = sorted({c for c in cuts if c < blocks} | {0, blocks})
    t = KVEventTracker(BT)
    parent = None
    for seq, (a, b) in enumerate(itertools.pairwise(bounds)):
        hashes = [f"h{i}".encode() for i in range(a, b)]
        ev = _stored_map(hashes, parent, prompt[a * BT : b * BT])
        assert t.apply(seq, decode_batch(msgpack.packb([float(seq), [ev], 0]))) is None
        parent = hashes[-1]
    assert t.cache_changes()[0] == block_hashes(prompt, BT)


def _pages(tokens: list[int], size: int, first: int) -> list[tuple[bytes, list[int]]]:
    return [
        (f"p{first + i}".encode(), tokens[i * size : (i + 1) * size])
        for i in range(len(tokens) // size)
    ]


@settings(max_examples=80, deadline=None)
@given(
    size=st.sampled_from([1, 2, 4, 8, 3, 5, 24, 40]),
    pages=st.integers(1, 40),
    branch=st.integers(0, 40),
    stride=st.integers(1, 3),
    group=st.integers(1, 5),
)
def test_engine_pages_of_any_size_give_the_prompts_sluice_blocks(
    size: int, pages: int, branch: int, stride: int, group: int
) -> None:
    """SGLang's pages (1 token by default; one BlockStored per page, as its radix cache sent
    them, or ``group`` chained pages an event, as its recorder coalesces them now) and engine
    blocks of sizes that are not a multiple of Sluice's: the digest holds
    every Sluice block that the stored pages cover whole, the same hashes as Sluice's own of
    the prompt, on a shared chain and on a branch from it; removing the page a Sluice block
    ends in evicts it. Every such page was dropped as a wrong size before (seen failing)."""
    prompt = [(11 + i * 37) % 32_000 for i in range(pages * size)]
    t = KVEventTracker(BT, stride=stride)
    chain = _pages(prompt, size, 0)

    def stored(run: list[tuple[bytes, list[int]]], parent: bytes | None) -> list[Any]:
        out = []
        for i in range(0, len(run), group):
            part = run[i : i + group]
            tokens = [t for _, toks in part for t in toks]
            out.append(["BlockStored", [h for h, _ in part], parent, tokens, size, None, "GPU"])
            parent = part[-1][0]
        return out

    events = stored(chain, None)
    # A second prompt sharing the first ``cut`` pages, then its own.
    cut = min(branch, pages)
    other = prompt[: cut * size] + [(5 + i * 13) % 32_000 for i in range(pages * size)]
    events += stored(_pages(other[cut * size :], size, 1000), chain[cut - 1][0] if cut else None)
    t.apply(0, decode_batch(msgpack.packb([0.0, events, 0])))

    def reported(tokens: list[int]) -> list[int]:
        return [h for i, h in enumerate(block_hashes(tokens, BT)) if (i + 1) % stride == 0]

    mine, theirs = reported(prompt), reported(other)
    shared = set(mine) & set(theirs)
    stored, evicted = t.cache_changes()
    assert sorted(stored) == sorted(mine + [h for h in theirs if h not in shared])
    assert sorted(t.cached_blocks()) == sorted(stored) and evicted == []
    # The first prompt's last page goes, a leaf when the branch left before it (a radix
    # cache evicts leaves first): the Sluice blocks it ends, if any, are evicted, and
    # nothing else.
    if cut == pages:
        return
    end = pages * size
    t.apply(1, decode_batch(msgpack.packb([0.0, [["BlockRemoved", [chain[-1][0]]]], 0])))
    ended = block_hashes(prompt, BT)[(end - size) // BT : end // BT]
    gone = [h for h in ended if h in mine]
    assert t.cache_changes() == ([], gone)


def test_events_of_a_lower_tier_are_skipped_and_the_gpus_kept() -> None:
    """vLLM's CPU offloading publishes token-less ``BlockStored`` events of size 0 with
    ``medium: "CPU"`` in the batches of the GPU's events, and SGLang's host cache its own
    (``"CPU_PINNED"``): such an event made the whole batch malformed, and the GPU's events in
    it were lost (seen failing so). The mirror follows the GPU: a block the GPU evicts is
    evicted, whatever a lower tier keeps (as SGLang's demotion means it)."""
    prompt = list(range(3000, 3000 + 2 * BT))
    full = block_hashes(prompt, BT)
    t = KVEventTracker(BT)
    events = [
        ["BlockStored", [b"g1", b"g2"], None, prompt, BT, None, "GPU"],
        ["BlockStored", [b"g1", b"g2"], None, [], 0, None, "CPU"],  # vLLM's offloading
        {"type": "BlockStored", "block_hashes": [b"g2"], "parent_block_hash": b"g1",
         "token_ids": [], "block_size": 0, "medium": "CPU_PINNED"},
        ["BlockRemoved", [b"g2"], "CPU"],  # a lower tier's removal evicts nothing here
    ]  # fmt: skip
    batch = decode_batch(msgpack.packb([0.0, events, 0]))
    assert (len(batch.events), batch.other_tier, batch.unknown) == (1, 3, 0)
    t.apply(0, batch)
    assert t.cache_changes() == (full, []) and t.stats.other_tier_events == 3
    # SGLang's demotion: removed from the GPU, kept on the host: evicted for Sluice.
    demoted = [["BlockRemoved", [b"g2"], "GPU"], ["BlockStored", [b"g2"], b"g1", [], 0, None,
                                                 "CPU_PINNED"]]  # fmt: skip
    t.apply(1, decode_batch(msgpack.packb([0.0, demoted, 0])))
    assert t.cache_changes() == ([], full[1:])
    # A medium that is no string is not the GPU either; a missing one (older vLLM) is.
    odd = decode_batch(
        msgpack.packb([0.0, [["BlockRemoved", [b"g1"], 7], ["BlockRemoved", [b"g1"]]], 0])
    )
    assert (odd.other_tier, len(odd.events)) == (1, 1)


def test_an_engine_hash_at_two_places_of_a_chain_is_counted_as_a_conflict() -> None:
    """Older SGLang hashed a page's tokens alone: with 1-token pages, a block of tokens that
    repeats in a prompt repeats its pages' hashes at another depth, and the chain after it maps
    onto wrong Sluice blocks. Nothing said so; the tracker counts such a conflict (none for a
    publisher whose hashes are chained, over the same tokens)."""
    first = [(7 + i * 31) % 997 for i in range(BT)]
    prompt = first + first  # the same 16 tokens twice

    def stored(hashes: list[bytes]) -> list[Any]:
        parents = [None, *hashes[:-1]]
        return [
            ["BlockStored", [h], p, [tok], 1, None, "GPU"]
            for h, p, tok in zip(hashes, parents, prompt, strict=True)
        ]

    chained = KVEventTracker(BT)
    by_place = [f"p{i}".encode() for i in range(len(prompt))]
    chained.apply(0, decode_batch(msgpack.packb([0.0, stored(by_place), 0])))
    assert chained.stats.conflicts == 0
    assert chained.cache_changes()[0] == block_hashes(prompt, BT)
    unchained = KVEventTracker(BT)
    by_token = [f"t{tok}".encode() for tok in prompt]
    unchained.apply(0, decode_batch(msgpack.packb([0.0, stored(by_token), 0])))
    assert unchained.stats.conflicts >= 1


def test_after_a_lost_link_the_first_batch_heard_past_0_is_replayed_from_0() -> None:
    """A lost link empties the mirror, and the restarted engine's first batches may come
    before the new link is up: the first heard past 0 asks for a replay from 0 (it was taken
    as a fresh start, and a chain those batches began left its continuation orphaned)."""
    prompt = list(range(BT))
    t = KVEventTracker(BT)
    t.apply(0, decode_batch(msgpack.packb([0.0, [_stored_array([b"e"], None, prompt)], 0])))
    t.cache_changes()
    t.publisher_lost()
    assert t.cached_blocks() == [] and t.cache_changes() == ([], block_hashes(prompt, BT))
    assert t.check(3) == 0 and t.stats.gaps == 1 and t.stats.restarts == 0
    assert t.check(4) is None  # followed on
    t.publisher_lost()
    assert t.check(0) is None  # heard from its first batch: nothing to replay
