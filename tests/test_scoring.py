"""Scoring a decision's candidates: the native loop against the pure reference, on random
candidates, and what each does with bad input."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.dispatcher.routing import Candidate
from sluice.dispatcher.scoring import (
    LEAST_MAX,
    NATIVE,
    Best,
    Weights,
    group_keys,
    group_keys_pure,
    held_at_least,
    held_at_least_pure,
    keep,
    least_keys,
    least_keys_pure,
    score_into,
    score_into_pure,
)

_IMPLS = [score_into_pure, score_into] if NATIVE else [score_into_pure]
each = pytest.mark.parametrize("run", _IMPLS, ids=["pure", "native"][: len(_IMPLS)])

_WORKERS = [f"w{i}" for i in range(12)]
_WEIGHTS = Weights(32, 0.2, 2.0, 0.5, 1.0, 1.0, 0.3, 0.9, 5.0, 30.0)


@dataclass(frozen=True)
class _Speeds:
    prefill_s_per_token: float
    decode_s_per_token: float


_PRIOR = _Speeds(1e-4, 0.02)


def test_the_native_scoring_is_built() -> None:
    """What the dispatcher and the simulator run is the native loop: ``pip install`` compiles
    it (optional only so that an install without a C compiler still works)."""
    assert NATIVE, "sluice.dispatcher._scoring was not built: install with a C compiler"


_FLOAT = st.floats(0.0, 50.0, allow_nan=False)
_TOKENS = st.integers(0, 20_000)


@st.composite
def _candidate(draw: st.DrawFn, worker: str) -> Candidate:
    capacity = draw(st.integers(0, 64))
    return Candidate(
        worker,
        capacity,
        draw(st.integers(0, max(capacity, 1))),
        draw(_TOKENS),
        draw(_TOKENS),
        draw(_TOKENS),
        draw(_TOKENS),
        draw(_FLOAT),
        draw(st.sampled_from([float("-inf"), -100.0, 90.0, 99.5, 100.0])),
    )


@st.composite
def _case(draw: st.DrawFn) -> dict[str, Any]:
    workers = draw(st.lists(st.sampled_from(_WORKERS), min_size=1, max_size=10, unique=True))
    # Two batches, as a decision scores the shortlist, then more: the second starts from
    # what the first kept.
    batches = [[draw(_candidate(w)) for w in part] for part in (workers[::2], workers[1::2])]
    n_indexed = draw(st.integers(0, 40))
    held = draw(st.lists(st.sampled_from(workers), unique=True))
    matches = {w: draw(st.integers(1, max(n_indexed, 1))) for w in held}
    reps = frozenset(draw(st.lists(st.sampled_from(workers), unique=True, max_size=4)))
    # Holders in match_split()'s form too: a set of workers holding as many entries, the
    # others by count (some of the set among them, holding more).
    common = frozenset(draw(st.lists(st.sampled_from(_WORKERS), unique=True)))
    learned = draw(
        st.none()
        | st.dictionaries(
            st.sampled_from(_WORKERS),
            st.builds(_Speeds, st.floats(1e-6, 1e-2), st.floats(1e-3, 0.5)),
        )
    )
    return {
        "batches": batches,
        "matches": matches,
        "reps": reps,
        "common": common,
        "common_blocks": draw(st.integers(1, max(n_indexed, 1))) if common else 0,
        "rep_common": draw(st.booleans()),
        "n_indexed": n_indexed,
        "prompt": draw(st.integers(1, 8_000)),
        "rh": draw(st.integers(0, 2**64 - 1)),
        "learned": learned,
        "explores": draw(st.booleans()),
        "lazy": draw(st.booleans()),
    }


class _Learned(dict[str, Any]):
    """Learned speeds by worker, the prior for the others (as ``Calibration.table()``
    computes a missing one on reading)."""

    def __missing__(self, worker_id: str) -> Any:
        return _PRIOR


def _scored(run: Any, case: dict[str, Any]) -> tuple[Best, list[tuple[Any, ...]]]:
    """Run ``run`` on the case's batches; what it kept, and every keep() call it made."""
    calls: list[tuple[Any, ...]] = []

    def recording(acc: Best, *args: Any) -> None:
        calls.append(args)
        keep(acc, *args)

    learned = case["learned"]
    speeds = None if learned is None else _Learned(learned)
    acc = Best()
    for batch in case["batches"]:
        candidates: Any = batch
        if case["lazy"]:
            # A generator that reads acc between two candidates, as _beyond() does.
            def lazily(batch: list[Candidate] = batch) -> Iterator[Candidate]:
                for cand in batch:
                    if acc.best is not None and acc.best[0] < -1.0:
                        return
                    yield cand

            candidates = lazily()
        run(
            acc,
            recording,
            candidates,
            _WEIGHTS,
            case["matches"],
            case["reps"],
            case["n_indexed"],
            case["prompt"],
            case["rh"],
            speeds,
            _PRIOR,
            case["explores"],
            100.0,
            case["common"],
            case["common_blocks"],
            case["rep_common"],
        )
    return acc, calls


@pytest.mark.skipif(not NATIVE, reason="the native loop was not built")
@settings(max_examples=400, deadline=None)
@given(_case())
def test_the_native_loop_keeps_what_the_reference_keeps(case: dict[str, Any]) -> None:
    """The same candidates give the same minimums, through the same keep() calls with the
    same terms (bit for bit: a score off by one ulp could change a decision). Fails if the
    C computes any term otherwise, or filters a candidate the reference keeps."""
    acc_pure, calls_pure = _scored(score_into_pure, case)
    acc_native, calls_native = _scored(score_into, case)
    assert calls_native == calls_pure
    assert acc_native == acc_pure


@each
def test_a_candidate_on_the_prefix_and_idle_wins(run: Any) -> None:
    """The terms, by example: of two idle workers the holder of the prefix scores lower."""
    acc = Best()
    cands = [Candidate("a", 8, 0, 0), Candidate("b", 8, 0, 0)]
    none: frozenset[str] = frozenset()
    args = (10, 1000, 7, None, _PRIOR, False, 0.0)
    run(acc, keep, cands, _WEIGHTS, {"b": 10}, none, *args, none, 0, False)
    assert acc.best is not None and acc.best[2] == "b" and acc.best[3] == 320
    assert acc.sticky is None and acc.expand is None and acc.cold is None
    # The same holder as a member of the common set, a replica with it.
    acc = Best()
    run(acc, keep, cands, _WEIGHTS, {}, none, *args, frozenset({"b", "c"}), 10, True)
    assert acc.best is not None and acc.best[2] == "b" and acc.best[3] == 320
    assert acc.sticky is not None and acc.sticky[2] == "b"


@each
def test_an_error_in_keep_reaches_the_caller(run: Any) -> None:
    def failing(*_: Any) -> None:
        raise RuntimeError("keep failed")

    with pytest.raises(RuntimeError, match="keep failed"):
        run(
            Best(),
            failing,
            [Candidate("a", 8, 0, 0)],
            _WEIGHTS,
            {},
            frozenset(),
            0,
            10,
            1,
            None,
            _PRIOR,
            False,
            0.0,
            frozenset(),
            0,
            False,
        )


@pytest.mark.skipif(not NATIVE, reason="the native loop was not built")
@pytest.mark.parametrize(
    "change",
    [
        {2: [("a", 8)]},  # a candidate that is no Candidate
        {2: [Candidate("a", "eight", 0, 0)]},  # type: ignore[arg-type]
        {4: [("a", 1)]},  # matches not a dict
        {5: ["a"]},  # replicas not a set
        {3: (1, 2)},  # weights too short
        {10: object()},  # a prior without speeds
        {9: lambda w: _PRIOR},  # speeds not a dict
        {13: ["a"]},  # the common set not a set
        {14: "1"},  # its count not an int
    ],
)
def test_bad_input_to_the_native_loop_is_a_type_error(change: dict[int, Any]) -> None:
    args: list[Any] = [
        Best(),
        keep,
        [Candidate("a", 8, 0, 0)],
        _WEIGHTS,
        {},
        frozenset({"a"}),
        0,
        10,
        1,
        None,
        _PRIOR,
        False,
        0.0,
        frozenset({"a"}),
        1,
        False,
    ]
    for i, v in change.items():
        args[i] = v
    with pytest.raises((TypeError, AttributeError)):
        score_into(*args)
    with pytest.raises(TypeError):
        score_into(*args[:15])  # one argument short


# ------------------------------------------------------------------- grouping the holders


_V = TypeVar("_V")


class _View(Mapping[str, _V]):
    """A mapping that is no dict (the scheduler hands out read-only views)."""

    def __init__(self, d: dict[str, _V]) -> None:
        self._d = d

    def __getitem__(self, k: str) -> _V:
        return self._d[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


_KEY = st.sampled_from([0.0, 0.25, 0.5, 0.5, 1.0, 3.0])


@given(
    workers=st.lists(st.sampled_from(_WORKERS), max_size=20),
    blocks=st.dictionaries(st.sampled_from(_WORKERS), st.integers(0, 4), max_size=12),
    skip=st.none() | st.frozensets(st.sampled_from(_WORKERS), max_size=6),
    moved=st.dictionaries(st.sampled_from(_WORKERS), _KEY | st.just(float("inf")), max_size=6),
    keys=st.dictionaries(st.sampled_from(_WORKERS), _KEY, max_size=12),
    view=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_the_native_grouping_is_the_reference(
    workers: list[str],
    blocks: dict[str, int],
    skip: frozenset[str] | None,
    moved: dict[str, float],
    keys: dict[str, float],
    view: bool,
) -> None:
    """The holders of a prefix grouped by how much of it each holds, with their load keys:
    the plan's own moves first (inf: full), then the scheduler's order, no key no candidate."""
    expected = group_keys_pure(workers, blocks, skip, moved, keys)
    for w, b in ((w, b) for b, g in expected.items() for _, w in g):
        assert blocks.get(w, 0) == b and (skip is None or w not in skip)
    held: Mapping[str, float] = _View(keys) if view else keys
    of: Mapping[str, int] = _View(blocks) if view else blocks
    assert group_keys(workers, of, skip, moved, held) == expected


@pytest.mark.skipif(not NATIVE, reason="the native loop was not built")
def test_bad_input_to_the_native_grouping_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        group_keys(["w0"], {}, None, {"w0": "fast"}, {})  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        group_keys(5, {}, None, {}, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        group_keys([], {}, None, {})  # type: ignore[call-arg]


@given(
    matches=st.dictionaries(st.sampled_from(_WORKERS), st.integers(0, 6), max_size=12),
    need=st.integers(0, 6),
    exclude=st.none() | st.sets(st.sampled_from(_WORKERS), max_size=6),
)
@settings(max_examples=300, deadline=None)
def test_the_native_holders_of_a_whole_prefix_are_the_reference(
    matches: dict[str, int], need: int, exclude: set[str] | None
) -> None:
    expected = held_at_least_pure(matches, need, exclude)
    assert expected == [
        w for w, b in matches.items() if b >= need and (exclude is None or w not in exclude)
    ]
    assert held_at_least(matches, need, exclude) == expected


@pytest.mark.parametrize("holders", [held_at_least_pure, held_at_least])
def test_holders_changed_while_they_are_read_is_an_error_not_a_freed_id(holders: Any) -> None:
    """An ``exclude`` whose membership test changes ``matches`` (Python code run midway): the
    native loop kept a borrowed id across it and appended it freed (found by a review); both
    now raise as iterating a changed dict does."""
    matches = {"".join(["w", str(i)]): 3 for i in range(4)}

    class Meddling(set[str]):
        def __contains__(self, w: object) -> bool:
            matches.pop(str(w), None)
            return False

    with pytest.raises(RuntimeError, match="changed size"):
        holders(matches, 1, Meddling())


@pytest.mark.skipif(not NATIVE, reason="the native loop was not built")
def test_bad_input_to_the_native_holders_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        held_at_least([("w0", 1)], 1, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        held_at_least({"w0": "many"}, 1, None)  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        held_at_least({"w0": 1}, 1, 5)  # type: ignore[arg-type]


@given(
    workers=st.lists(st.sampled_from(_WORKERS), max_size=20),
    blocks=st.dictionaries(st.sampled_from(_WORKERS), st.integers(0, 3), max_size=12),
    skip=st.none() | st.frozensets(st.sampled_from(_WORKERS), max_size=6),
    moved=st.dictionaries(st.sampled_from(_WORKERS), _KEY | st.just(float("inf")), max_size=6),
    keys=st.dictionaries(st.sampled_from(_WORKERS), _KEY, max_size=12),
    m=st.integers(1, 5),
    view=st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_the_native_least_keys_are_the_reference(
    workers: list[str],
    blocks: dict[str, int],
    skip: frozenset[str] | None,
    moved: dict[str, float],
    keys: dict[str, float],
    m: int,
    view: bool,
) -> None:
    """Each group's m least (load key, worker), least first (equal keys by worker id, as
    tuples compare), and its size: the grouping's groups, cut."""
    expected = least_keys_pure(workers, blocks, skip, moved, keys, m)
    full = group_keys_pure(workers, blocks, skip, moved, keys)
    assert expected == {b: (sorted(g)[:m], len(g)) for b, g in full.items()}
    held: Mapping[str, float] = _View(keys) if view else keys
    assert least_keys(workers, blocks, skip, moved, held, m) == expected


@pytest.mark.skipif(not NATIVE, reason="the native loop was not built")
def test_bad_input_to_the_native_least_keys_is_an_error() -> None:
    for m in (0, LEAST_MAX + 1):
        with pytest.raises(ValueError):
            least_keys([], {}, None, {}, {}, m)
    with pytest.raises(TypeError):
        least_keys(["w0"], {}, None, {"w0": "fast"}, {}, 2)  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        least_keys(["w0"], {"w0": "all"}, None, {}, {"w0": 0.5}, 2)  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        least_keys([5, 6], {}, None, {}, {5: 0.5, 6: 0.5}, 2)  # type: ignore[list-item, dict-item]
