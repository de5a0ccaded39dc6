"""The cluster cache index: the pure reference and the native index, each on every test,
and the two against each other on random operations."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.dispatcher.cacheindex import NATIVE, CacheIndex, PureCacheIndex

_IMPLS = [PureCacheIndex, CacheIndex] if NATIVE else [PureCacheIndex]
each = pytest.mark.parametrize("make", _IMPLS, ids=["pure", "native"][: len(_IMPLS)])


@each
def test_longest_match_per_worker(make: Any) -> None:
    idx = make()
    idx.apply_snapshot("a", 0, [1, 2, 3], 0.0)
    idx.apply_snapshot("b", 0, [1, 2], 0.0)
    idx.apply_snapshot("c", 0, [9], 0.0)
    assert idx.match([1, 2, 3, 4], 0.0) == {"a": 3, "b": 2}
    assert idx.match([9, 1], 0.0) == {"c": 1}
    assert idx.match([5], 0.0) == {}
    assert idx.match([], 0.0) == {}


@each
def test_deltas_apply_in_order_and_a_gap_asks_for_a_snapshot(make: Any) -> None:
    idx = make()
    idx.apply_snapshot("a", 10, [1], 0.0)
    assert idx.apply_delta("a", 11, stored=[2, 3], evicted=[], now_s=0.0)
    assert idx.match([1, 2, 3], 0.0) == {"a": 3}
    assert idx.apply_delta("a", 12, stored=[], evicted=[3], now_s=0.0)
    assert idx.match([1, 2, 3], 0.0) == {"a": 2}
    # delta 13 is lost: 14 must not be applied on a stale view
    assert not idx.apply_delta("a", 14, stored=[7], evicted=[1], now_s=0.0)
    assert idx.needs_snapshot("a")
    assert not idx.apply_delta("a", 15, stored=[8], evicted=[], now_s=0.0)
    assert idx.match([1, 2], 0.0) == {"a": 2}  # unchanged while stale
    idx.apply_snapshot("a", 15, [7, 8], 0.0)  # resync
    assert not idx.needs_snapshot("a")
    assert idx.match([1], 0.0) == {} and idx.match([7, 8], 0.0) == {"a": 2}
    assert idx.apply_delta("a", 16, stored=[9], evicted=[], now_s=0.0)


@each
def test_guesses_expire_after_their_ttl_reports_do_not(make: Any) -> None:
    idx = make(guess_ttl_s=10.0)
    idx.guess("a", [1, 2], now_s=0.0)
    idx.apply_snapshot("b", 0, [1], 0.0)
    assert idx.match([1, 2], 5.0) == {"a": 2, "b": 1}
    assert idx.match([1, 2], 10.5) == {"b": 1}
    assert idx.expire(10.5) == 1  # block 2 had only the guess
    assert len(idx) == 1


@each
def test_completion_refreshes_the_whole_prefix(make: Any) -> None:
    idx = make(guess_ttl_s=10.0)
    idx.guess("a", [1, 2, 3], now_s=0.0)
    idx.completed("a", [1, 2, 3, 4], now_s=8.0)
    assert idx.match([1, 2, 3, 4], 15.0) == {"a": 4}


@each
def test_lru_bound_drops_least_recently_used_blocks(make: Any) -> None:
    idx = make(max_blocks=3)
    idx.apply_snapshot("a", 0, [1, 2, 3], 0.0)
    idx.guess("c", [1], 0.0)  # routed again: block 2 is now the least recently used
    assert idx.match([1, 2, 3], 0.0) == {"a": 3, "c": 1}  # a lookup changes nothing
    idx.guess("b", [4], 0.0)
    assert len(idx) == 3
    assert idx.holders(2, 0.0) == set() and idx.holders(1, 0.0) == {"a", "c"}


@each
def test_worker_removal_forgets_it_everywhere(make: Any) -> None:
    idx = make()
    idx.apply_snapshot("a", 0, [1, 2], 0.0)
    idx.guess("b", [1], 0.0)
    idx.remove_worker("a")
    assert idx.match([1, 2], 0.0) == {"b": 1}
    assert idx.holders(2, 0.0) == set() and len(idx) == 1
    assert idx.apply_delta("a", 0, stored=[5], evicted=[], now_s=0.0)  # starts afresh


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["snap", "guess", "remove", "match"]),
            st.sampled_from(["a", "b", "c"]),
            st.lists(st.integers(0, 12), max_size=6),
        ),
        max_size=40,
    ),
    max_blocks=st.integers(1, 8),
)
@each
def test_match_agrees_with_a_brute_force_model_and_memory_stays_bounded(
    make: Any, ops: list[tuple[str, str, list[int]]], max_blocks: int
) -> None:
    idx = make(max_blocks=max_blocks, guess_ttl_s=1e9)
    for op, worker, hashes in ops:
        if op == "snap":
            idx.apply_snapshot(worker, 0, hashes, 0.0)
        elif op == "guess":
            idx.guess(worker, hashes, 0.0)
        elif op == "remove":
            idx.remove_worker(worker)
        else:
            got = idx.match(hashes, 0.0)
            held = {w: {h for h in range(13) if w in idx.holders(h, 0.0)} for w in "abc"}
            want = {}
            for w, blocks in held.items():
                n = 0
                while n < len(hashes) and hashes[n] in blocks:
                    n += 1
                if n:
                    want[w] = n
            assert got == want
        assert len(idx) <= max_blocks


@each
def test_a_reported_eviction_also_ends_a_guess(make: Any) -> None:
    idx = make(guess_ttl_s=100.0)
    idx.apply_snapshot("a", 0, [], 0.0)
    idx.guess("a", [1, 2, 3], 0.0)
    assert idx.match([1, 2, 3], 1.0) == {"a": 3}
    assert idx.apply_delta("a", 1, [1, 2], [3], 1.0)
    assert idx.match([1, 2, 3], 1.0) == {"a": 2}
    idx.guess("a", [1, 2, 3], 2.0)  # routed there again: it will store block 3 again
    assert idx.match([1, 2, 3], 2.0) == {"a": 3}


class _RefIndex:
    """The index's semantics with one (reported, guessed until) pair per hold, as it was
    written before holds became one float."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.holds: dict[tuple[int, str], list[object]] = {}
        self.reported: dict[str, set[int]] = {}

    def _unreport(self, w: str, h: int, forget: bool) -> None:
        hold = self.holds.get((h, w))
        if hold is None:
            return
        hold[0] = False
        self.reported.get(w, set()).discard(h)
        if forget or hold[1] == float("-inf"):
            del self.holds[(h, w)]

    def snapshot(self, w: str, blocks: list[int]) -> None:
        keep, old = set(blocks), self.reported.get(w, set())
        for h in old - keep:
            self._unreport(w, h, False)
        for h in keep - old:
            self.holds.setdefault((h, w), [False, float("-inf")])[0] = True
        self.reported[w] = keep

    def delta(self, w: str, stored: list[int], evicted: list[int]) -> None:
        for h in evicted:
            self._unreport(w, h, True)
        for h in stored:
            self.holds.setdefault((h, w), [False, float("-inf")])[0] = True
            self.reported.setdefault(w, set()).add(h)

    def guess(self, w: str, hashes: list[int], now_s: float) -> None:
        for h in hashes:
            hold = self.holds.setdefault((h, w), [False, now_s + self.ttl_s])
            hold[1] = max(float(hold[1]), now_s + self.ttl_s)  # type: ignore[arg-type]

    def expire(self, now_s: float) -> None:
        for key in [k for k, (r, t) in self.holds.items() if not r and t <= now_s]:  # type: ignore[operator]
            del self.holds[key]

    def remove(self, w: str) -> None:
        for key in [k for k in self.holds if k[1] == w]:
            del self.holds[key]
        self.reported.pop(w, None)

    def holders(self, h: int, now_s: float) -> set[str]:
        return {w for (b, w), (r, t) in self.holds.items() if b == h and (r or t > now_s)}  # type: ignore[operator]


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["snap", "delta", "guess", "guess", "expire", "remove"]),
            st.sampled_from(["a", "b"]),
            st.lists(st.integers(0, 6), max_size=4),
            st.lists(st.integers(0, 6), max_size=3),
        ),
        max_size=40,
    )
)
@each
def test_a_hold_as_one_float_keeps_reports_and_guesses_apart(
    make: Any,
    ops: list[tuple[str, str, list[int], list[int]]],
) -> None:
    idx, ref = make(guess_ttl_s=5.0), _RefIndex(5.0)
    seq: dict[str, int] = {}
    for step, (op, w, hashes, other) in enumerate(ops):
        now = float(step)
        if op == "snap":
            seq[w] = 0
            idx.apply_snapshot(w, 0, hashes, now)
            ref.snapshot(w, hashes)
        elif op == "delta" and w in seq:
            seq[w] += 1
            assert idx.apply_delta(w, seq[w], hashes, other, now)
            ref.delta(w, hashes, other)
        elif op == "guess":
            idx.guess(w, hashes, now)
            ref.guess(w, hashes, now)
        elif op == "expire":
            idx.expire(now)
            ref.expire(now)
        elif op == "remove":
            idx.remove_worker(w)
            ref.remove(w)
            seq.pop(w, None)
        for t in (now, now + 3.0, now + 6.0):
            for h in range(7):
                assert idx.holders(h, t) == ref.holders(h, t), (op, h, t)
        for x in "ab":
            assert idx.reported_blocks(x) == len(ref.reported.get(x, ()))


@each
def test_a_bounded_expiry_sweeps_every_block_over_successive_calls(make: Any) -> None:
    """Blocks that keep a live hold stay the least recently used: a bounded pass that looked
    only at those would never reach the expired guesses behind them. Mutation: each call
    looks at the least recently used ``max_blocks`` again (the index stays at 10 blocks)."""
    idx = make(guess_ttl_s=10.0)
    idx.apply_snapshot("b", 0, [1, 2, 3], 0.0)  # reported: alive for good
    idx.guess("a", list(range(1, 11)), 0.0)  # blocks 1-10, in that order; 4-10 guesses only
    assert len(idx) == 10
    freed = [idx.expire(100.0, max_blocks=3) for _ in range(4)]
    assert freed == [0, 3, 3, 1] and len(idx) == 3
    assert idx.match([1, 2, 3], 100.0) == {"b": 3}
    idx.guess("a", [20, 21], 100.0)  # a sweep that ended starts again over what is there now
    assert idx.expire(200.0, max_blocks=5) == 2 and len(idx) == 3


def test_the_native_index_is_built() -> None:
    """What the dispatcher and the simulator run is the native index: ``pip install`` compiles
    it (it is optional only so that an install without a C compiler still works)."""
    assert NATIVE, "sluice.dispatcher._cacheindex was not built: install with a C compiler"


_WORKERS = ["a", "b", "c"]
_OP = st.one_of(
    st.tuples(st.just("snap"), st.sampled_from(_WORKERS), st.lists(st.integers(0, 9), max_size=6)),
    st.tuples(
        st.just("delta"),
        st.sampled_from(_WORKERS),
        st.lists(st.integers(0, 9), max_size=4),
        st.lists(st.integers(0, 9), max_size=3),
        st.integers(-1, 2),  # the digest number's step: 1 in order, else a gap or a repeat
    ),
    st.tuples(st.just("guess"), st.sampled_from(_WORKERS), st.lists(st.integers(0, 9), max_size=6)),
    st.tuples(st.just("done"), st.sampled_from(_WORKERS), st.lists(st.integers(0, 9), max_size=6)),
    st.tuples(st.just("expire"), st.one_of(st.none(), st.integers(0, 4))),
    st.tuples(st.just("remove"), st.sampled_from(_WORKERS)),
    # Steps that land exactly on a guess's end: a hold ends at its time, not after it.
    st.tuples(st.just("tick"), st.sampled_from([0.5, 1.0, 2.0, 2.5])),
)


@pytest.mark.skipif(not NATIVE, reason="the native index was not built")
@settings(max_examples=400, deadline=None)
@given(
    ops=st.lists(_OP, max_size=60),
    max_blocks=st.integers(1, 12),
    ttl=st.sampled_from([0.5, 2.0, 5.0]),
)
def test_the_native_index_answers_as_the_reference(
    ops: list[tuple[Any, ...]], max_blocks: int, ttl: float
) -> None:
    """The same operations on both, every answer compared after each: lookups, holders at
    several times, reports, staleness, what each expiry freed and what the bound kept (the
    recency order decides which blocks a full index drops, so it is compared through them)."""
    ref = PureCacheIndex(max_blocks=max_blocks, guess_ttl_s=ttl)
    nat = CacheIndex(max_blocks=max_blocks, guess_ttl_s=ttl)
    seq: dict[str, int] = {}
    now = 0.0
    for op in ops:
        now = _apply_both(op, ref, nat, seq, now)
        assert len(ref) == len(nat)
        for h in range(10):
            for t in (now, now + ttl / 2, now + ttl):
                assert ref.holders(h, t) == nat.holders(h, t), (op, h, t)
        for prefix in ([0, 1, 2, 3], [1, 2, 3], [4, 5, 6, 7, 8, 9], [9, 0]):
            assert ref.match(prefix, now) == nat.match(prefix, now), (op, prefix)
        for w in _WORKERS:
            assert ref.reported_blocks(w) == nat.reported_blocks(w)
            assert ref.needs_snapshot(w) == nat.needs_snapshot(w)
            assert ref.blocks_of(w) == nat.blocks_of(w)


def _apply_both(
    op: tuple[Any, ...], ref: PureCacheIndex, nat: Any, seq: dict[str, int], now: float
) -> float:
    """One operation on both indexes (their answers compared); returns the time after it."""
    kind = op[0]
    if kind == "snap":
        seq[op[1]] = seq.get(op[1], 0) + 5
        for idx in (ref, nat):
            idx.apply_snapshot(op[1], seq[op[1]], op[2], now)
    elif kind == "delta":
        n = seq.get(op[1], 0) + op[4]
        seq[op[1]] = max(seq.get(op[1], 0), n)
        assert ref.apply_delta(op[1], n, op[2], op[3], now) == nat.apply_delta(
            op[1], n, op[2], op[3], now
        )
    elif kind in ("guess", "done"):
        for idx in (ref, nat):
            (idx.guess if kind == "guess" else idx.completed)(op[1], op[2], now)
    elif kind == "expire":
        assert ref.expire(now, op[1]) == nat.expire(now, op[1])
    elif kind == "remove":
        for idx in (ref, nat):
            idx.remove_worker(op[1])
    else:
        now += op[1]
    return now


@pytest.mark.skipif(not NATIVE, reason="the native index was not built")
def test_the_native_index_rejects_what_is_not_a_block_hash() -> None:
    idx = CacheIndex()
    with pytest.raises(ValueError, match="2\\*\\*64"):
        idx.guess("a", [2**64], 0.0)
    with pytest.raises(ValueError, match="2\\*\\*64"):
        idx.match([-1], 0.0)
    with pytest.raises(TypeError, match="int"):
        idx.guess("a", ["x"], 0.0)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="str"):
        idx.guess(1, [1], 0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_blocks"):
        CacheIndex(max_blocks=0)
    with pytest.raises(ValueError, match="max_blocks"):
        idx.expire(0.0, -1)
    with pytest.raises(TypeError, match="max_blocks"):
        idx.expire(0.0, "3")  # type: ignore[arg-type]
    idx.guess("a", [2**64 - 1, 0], 0.0)
    assert idx.match([2**64 - 1, 0], 0.0) == {"a": 2}
    ref = PureCacheIndex()
    ref.guess("a", [2**64 - 1, 0], 0.0)
    for bound in (1, 2**62, 2**70):  # a bound past every block is every block
        assert idx.expire(400.0, bound) == ref.expire(400.0, bound)
        assert len(idx) == len(ref)


@pytest.mark.skipif(not NATIVE, reason="the native index was not built")
def test_the_native_index_refuses_a_call_made_from_inside_one_of_its_calls() -> None:
    """A call may run Python code midway (here: consuming a generator of hashes; as well a
    collection's callback or a finaliser when it allocates). Code that called the index again
    there changed the arrays the call was working on: a hold on a freed worker slot, a crash
    later (found by a review). Such a call is refused, and the index stays as it was."""
    idx = CacheIndex()
    idx.apply_snapshot("a", 0, [1, 2], 0.0)

    def hashes() -> Any:
        yield 1
        idx.remove_worker("a")
        yield 2

    with pytest.raises(RuntimeError, match="another of its calls"):
        idx.guess("a", hashes(), 0.0)
    assert idx.match([1, 2], 0.0) == {"a": 2}
    assert idx.holders(1, 0.0) == {"a"}

    class Seq(int):  # a delta's sequence number whose comparison calls the index
        def __ne__(self, other: object) -> bool:
            idx.guess("b", [3], 0.0)
            return False

    with pytest.raises(RuntimeError, match="another of its calls"):
        idx.apply_delta("a", Seq(1), [3], [], 0.0)
    assert idx.holders(3, 0.0) == set()
    assert idx.apply_delta("a", 1, [3], [], 0.0)  # the index goes on as before
    assert idx.holders(3, 0.0) == {"a"}


@pytest.mark.skipif(not NATIVE, reason="the native index was not built")
def test_the_native_index_takes_worker_ids_that_are_plain_str() -> None:
    """A str subclass's __hash__ or __eq__ runs Python code while a slot is being made (a
    review crashed the index with one): refused."""

    class Name(str):
        pass

    idx = CacheIndex()
    with pytest.raises(TypeError, match="str"):
        idx.guess(Name("a"), [1], 0.0)
    assert len(idx) == 0


@pytest.mark.skipif(not NATIVE, reason="the native index was not built")
def test_a_snapshot_with_a_bad_hash_changes_nothing() -> None:
    """One bad item in a snapshot fails it before anything changes: the native index had
    dropped the worker's reports from its set but kept their holds, with nothing left to drop
    them (found by a review). (The reference checks no hash: the wire bounds them.)"""
    idx = CacheIndex()
    idx.apply_snapshot("a", 0, [1, 2], 0.0)
    with pytest.raises(ValueError, match="2\\*\\*64"):
        idx.apply_snapshot("a", 1, [5, 2**64], 0.0)
    assert idx.reported_blocks("a") == 2
    assert idx.holders(1, 0.0) == {"a"} and idx.holders(5, 0.0) == set()
    idx.apply_snapshot("a", 2, [5], 0.0)
    assert idx.holders(1, 0.0) == set() and idx.holders(5, 0.0) == {"a"}


@pytest.mark.skipif(not NATIVE, reason="the native index was not built")
def test_the_native_index_grows_its_table_and_deletes_from_it() -> None:
    """Many blocks in and out again (the table grows, deletions shift entries back), with
    the reference on the same operations."""
    ref, nat = PureCacheIndex(max_blocks=5_000), CacheIndex(max_blocks=5_000)
    for idx in (ref, nat):
        for i in range(0, 20_000, 50):
            idx.guess(
                f"w{i % 7}", list(range(i * 2654435761 % 2**40, i * 2654435761 % 2**40 + 50)), i
            )
        idx.expire(19_000.0 + 30.0)
    assert len(ref) == len(nat)
    probe = [i * 2654435761 % 2**40 for i in range(0, 20_000, 50)]
    for h in probe:
        assert ref.holders(h, 0.0) == nat.holders(h, 0.0)
        assert ref.match([h, h + 1, h + 2], 19_000.0) == nat.match([h, h + 1, h + 2], 19_000.0)


def _expanded(split: tuple[frozenset[str], int, dict[str, int]]) -> dict[str, int]:
    common, blocks, own = split
    return {**dict.fromkeys(common, blocks), **own}


@pytest.mark.skipif(not NATIVE, reason="the native index was not built")
@settings(max_examples=400, deadline=None)
@given(
    ops=st.lists(_OP, max_size=60),
    max_blocks=st.integers(1, 12),
    ttl=st.sampled_from([0.5, 2.0, 5.0]),
    memo_min=st.integers(1, 3),
)
def test_the_native_split_match_answers_as_the_reference_with_its_memo(
    ops: list[tuple[Any, ...]], max_blocks: int, ttl: float, memo_min: int
) -> None:
    """``match_split`` (the native index's memo of chains many workers hold, here 1-3) is
    ``match`` after every operation, at times before, at and after the holds' ends (so that a
    memo made at a later time is asked at an earlier one too), for prefixes that share their
    first entries (one memo slot for several chains)."""
    ref = PureCacheIndex(max_blocks=max_blocks, guess_ttl_s=ttl)
    nat = CacheIndex(max_blocks=max_blocks, guess_ttl_s=ttl, memo_min_holders=memo_min)
    seq: dict[str, int] = {}
    now = 0.0
    prefixes = ([0, 1, 2, 3], [0, 1, 2], [0, 1, 4, 5], [1, 2, 3], [4, 5, 6, 7, 8, 9], [9, 0])
    for op in ops:
        now = _apply_both(op, ref, nat, seq, now)
        for t in (now + ttl, now, now + ttl / 2, now):
            for prefix in prefixes:
                want = ref.match(prefix, t)
                assert _expanded(nat.match_split(prefix, t)) == want, (op, prefix, t)
                assert _expanded(ref.match_split(prefix, t)) == want


@pytest.mark.skipif(not NATIVE, reason="the native index was not built")
def test_a_chain_every_worker_holds_is_one_set_until_its_holds_change() -> None:
    """A system prompt 200 workers report: each decision gets the same set of them (not a
    list it would have to read), and the few that hold more of the prompt by count; a change
    of one of the chain's holds makes a new set, a guess lengthened under its time does not."""
    idx = CacheIndex(guess_ttl_s=10.0)
    system = list(range(1, 33))
    for w in range(200):
        idx.apply_snapshot(f"w{w}", 1, system, 0.0)
    idx.guess("w7", [*system, 100, 101], 0.0)
    common, blocks, own = idx.match_split([*system, 100, 101, 102], 1.0)
    assert (len(common), blocks, own) == (200, 32, {"w7": 34})
    again = idx.match_split([*system, 200], 2.0)
    assert again[0] is common and again[1:] == (32, {})
    idx.guess("w7", [*system, 100], 3.0)  # under reports: nothing changes
    assert idx.match_split(system, 4.0)[0] is common
    idx.apply_delta("w3", 2, [], [system[5]], 5.0)  # an eviction inside the chain
    common2, blocks2, own2 = idx.match_split([*system, 100], 6.0)
    assert common2 is not common and "w3" not in common2 and own2["w3"] == 5
    assert _expanded((common2, blocks2, own2)) == idx.match([*system, 100], 6.0)
    # A guess the memo saw alive ends at its time: the memo does not outlive it.
    idx.guess("w3", system, 6.0)
    common3, _, _ = idx.match_split(system, 7.0)
    assert "w3" in common3
    assert _expanded(idx.match_split(system, 16.5)) == idx.match(system, 16.5)
    assert "w3" not in idx.match_split(system, 16.5)[0]
    # ... and a guess past its time that comes back to life (nothing swept it) is in again.
    idx.guess("w3", system, 17.0)
    assert "w3" in idx.match_split(system, 17.5)[0]
    # A time that is no time holds no memo (NaN compares false both ways).
    assert _expanded(idx.match_split(system, float("nan"))) == idx.match(system, float("nan"))


@pytest.mark.skipif(not NATIVE, reason="the native index was not built")
def test_chains_that_start_alike_keep_a_memo_each() -> None:
    """One system prompt, then one of three prompts 100 workers hold each: requests that
    alternate between them each get their chain's own set back, not one made again."""
    idx = CacheIndex()
    system = list(range(1, 33))
    subs = [list(range(100 * k, 100 * k + 16)) for k in (1, 2, 3)]
    for w in range(300):
        idx.apply_snapshot(f"w{w}", 1, system + subs[w % 3], 0.0)
    first = [idx.match_split([*system, *sub, 9999], 1.0) for sub in subs]
    for k, sub in enumerate(subs):
        common, blocks, own = idx.match_split([*system, *sub, 9999], 2.0)
        assert common is first[k][0] and blocks == 48 and len(common) == 100
        assert _expanded((common, blocks, own)) == idx.match([*system, *sub, 9999], 2.0)


@pytest.mark.skipif(not NATIVE, reason="the native index was not built")
def test_a_chain_that_changes_often_makes_its_memo_again_in_its_own_way() -> None:
    """Four chains share a first block; only A's last block changes, and A is asked for the
    most: its memo is made again where its old one was, so B, C and D keep theirs (a
    reviewer's case: made in the least recently used way instead, A pushed them out 15
    times of 18)."""
    idx = CacheIndex(memo_min_holders=2)
    chains = {k: [7, 100 * i + 101, 100 * i + 102] for i, k in enumerate("ABCD")}
    for w in ("w0", "w1", "w2"):
        idx.apply_snapshot(w, 0, sorted({h for c in chains.values() for h in c}), 0.0)
    sets = {k: idx.match_split(c, 1.0)[0] for k, c in chains.items()}
    for r in range(6):
        for k in "BCD":
            assert idx.match_split(chains[k], 1.0)[0] is sets[k]
        for _ in range(3):
            idx.match_split(chains["A"], 1.0)
        idx.apply_snapshot("x", r + 1, [chains["A"][2]] if r % 2 == 0 else [], 1.0)
        sets["A"] = idx.match_split(chains["A"], 1.0)[0]


@pytest.mark.skipif(not NATIVE, reason="the native index was not built")
def test_a_memo_reads_a_prompt_in_order_as_the_walk_does() -> None:
    """A prompt that leaves the memo's chain at its second block answers as match() does,
    whatever comes later in it (a memo read from the end refused a bad hash the walk never
    reads)."""
    idx = CacheIndex(memo_min_holders=2)
    for w in ("a", "b"):
        idx.apply_snapshot(w, 0, [1, 2, 3], 0.0)
    idx.match_split([1, 2, 3], 1.0)  # the memo of 1, 2, 3
    assert _expanded(idx.match_split([1, 5, -1], 1.0)) == idx.match([1, 5, -1], 1.0)
