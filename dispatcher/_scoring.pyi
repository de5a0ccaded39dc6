"""Scoring a decision's candidates in C (``dispatcher/_scoring.c``): the loop of
:func:`sluice.dispatcher.scoring.score_into_pure`, its reference, and
:func:`~sluice.dispatcher.scoring.group_keys_pure`'s."""

from collections.abc import Callable, Container, Iterable, Mapping

from sluice.dispatcher.routing import Candidate
from sluice.dispatcher.scoring import Best, SpeedsLike, Weights

def score_into(
    acc: Best,
    keep: Callable[[Best, int, str, int, float, tuple[float, float] | None, bool, bool], None],
    candidates: Iterable[Candidate],
    weights: Weights,
    matches: dict[str, int],
    rep_set: frozenset[str],
    n_indexed: int,
    prompt: int,
    rh: int,
    speeds: Mapping[str, SpeedsLike] | None,
    prior: SpeedsLike,
    explores: bool,
    now_s: float,
    common: frozenset[str],
    common_blocks: int,
    rep_common: bool,
    /,
) -> None: ...
def group_keys(
    workers: Iterable[str],
    blocks_of: Mapping[str, int],
    skip: Container[str] | None,
    moved_key: Mapping[str, float],
    keys: Mapping[str, float],
    /,
) -> dict[int, list[tuple[float, str]]]: ...
def held_at_least(
    matches: dict[str, int], need: int, exclude: Container[str] | None, /
) -> list[str]: ...
def least_keys(
    workers: Iterable[str],
    blocks_of: Mapping[str, int],
    skip: Container[str] | None,
    moved_key: Mapping[str, float],
    keys: Mapping[str, float],
    m: int,
    /,
) -> dict[int, tuple[list[tuple[float, str]], int]]: ...
