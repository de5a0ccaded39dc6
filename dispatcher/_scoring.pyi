"""Scoring a decision's candidates in C (``dispatcher/_scoring.c``): the loop of
:func:`sluice.dispatcher.scoring.score_into_pure`, its reference."""

from collections.abc import Callable, Iterable

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
    speeds: Callable[[str], SpeedsLike] | None,
    prior: SpeedsLike,
    explores: bool,
    now_s: float,
    /,
) -> None: ...
