"""The wire contract: codec, names, prefix hashing."""

from __future__ import annotations

import json
import pickle
import struct
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.schemas import (
    Assignment,
    DecodeError,
    Heartbeat,
    Result,
    SubmitRequest,
    WorkerLoad,
    decode,
    encode,
    names,
)
from sluice.schemas.codec import encode_nested
from sluice.schemas.hashing import (
    block_hashes,
    estimate_text_tokens,
    prompt_hashes,
    text_block_hashes,
)
from sluice.schemas.models import AssignmentHead
from sluice.schemas.tokens import TokenIds


def _req(**kw: object) -> SubmitRequest:
    base: dict[str, object] = {
        "request_id": "r1",
        "model": "m",
        "prompt_tokens": [1, 2, 3],
        "submitted_unix_ms": 1,
    }
    base.update(kw)
    return SubmitRequest.model_validate(base)


def test_codec_round_trip() -> None:
    r = _req(deadline_unix_ms=5, band="batch", tenant="acme")
    assert decode(encode(r), SubmitRequest) == r
    hb = Heartbeat(
        worker_id="w",
        models=["m"],
        seq=1,
        sent_unix_ms=2,
        capacity=4,
        in_flight=["a", "b"],
        load=WorkerLoad(
            running=1,
            waiting=0,
            pending_prefill_tokens=3,
            active_decode_tokens=4,
            kv_blocks_used=5,
            kv_blocks_total=6,
            busy_s_total=0.5,
        ),
    )
    assert decode(encode(hb), Heartbeat) == hb


@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**31 - 1), min_size=1, max_size=300),
    attempt=st.integers(min_value=1, max_value=10),
    queued_s=st.floats(min_value=0, max_value=1e6),
    epoch=st.integers(min_value=0, max_value=2**40),
)
def test_an_assignment_around_the_producers_bytes_decodes_as_one_encoded_whole(
    tokens: list[int], attempt: int, queued_s: float, epoch: int
) -> None:
    """The dispatcher sends a request's body as the producer encoded it (it keeps only those
    bytes): the agent decodes the same Assignment as if it had been encoded whole."""
    req = _req(prompt_tokens=tokens, tenant="acme", max_tokens=7)
    head = AssignmentHead(attempt=attempt, dispatcher_id="d", queued_s=queued_s, epoch=epoch)
    whole = Assignment(request=req, **head.model_dump(exclude={"v"}))
    assert decode(encode_nested(head, "request", encode(req)), Assignment) == whole
    with pytest.raises(ValueError, match="attempt"):
        encode_nested(head, "attempt", encode(req))


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x93\x01\x02\x03", msgpack.packb({"request_id": "x"}), b"not msgpack at all"],
)
def test_decode_rejects_bad_bytes_with_typed_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        decode(data, SubmitRequest)


def test_decode_keeps_partial_for_answering() -> None:
    raw = msgpack.packb({"v": 1, "request_id": "abc", "model": "m"})
    with pytest.raises(DecodeError) as info:
        decode(raw, SubmitRequest)
    assert info.value.partial["request_id"] == "abc"


def test_unknown_schema_version_is_rejected() -> None:
    raw = msgpack.packb({**_req().model_dump(), "v": 2})
    with pytest.raises(DecodeError, match="v"):
        decode(raw, SubmitRequest)


def test_request_needs_exactly_one_prompt() -> None:
    with pytest.raises(ValueError):
        _req(prompt_text="hi")  # both set
    with pytest.raises(ValueError):
        _req(prompt_tokens=None)  # neither set


@pytest.mark.parametrize(
    "tokens", [[1, -1], [2**32], [7, 1.5], ["a"], [None], [[1]], "1 2 3", {"1": 2}, 12]
)
def test_token_ids_out_of_range_or_not_integers_are_a_decode_error(tokens: object) -> None:
    raw = msgpack.packb({**_req().model_dump(), "prompt_tokens": tokens})
    with pytest.raises(DecodeError, match="prompt_tokens"):
        decode(raw, SubmitRequest)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=300))
def test_token_ids_in_range_decode_as_sent(tokens: list[int]) -> None:
    raw = encode(_req(prompt_tokens=tokens))
    decoded = decode(raw, SubmitRequest)
    assert decoded.prompt_tokens == tokens
    assert all(type(t) is int for t in decoded.prompt_tokens or [])


def test_token_ids_travel_as_one_bin_of_little_endian_uint32s() -> None:
    ids = [0, 1, 70_000, 2**32 - 1]
    raw = msgpack.unpackb(encode(_req(prompt_tokens=ids)))
    assert raw["prompt_tokens"] == struct.pack("<4I", *ids)
    # The assignment that nests a request carries the same bytes.
    body = encode(_req(prompt_tokens=ids))
    head = AssignmentHead(attempt=1, dispatcher_id="d", queued_s=0.0)
    nested = msgpack.unpackb(encode_nested(head, "request", body))
    assert nested["request"]["prompt_tokens"] == struct.pack("<4I", *ids)


def test_token_ids_sent_as_a_list_by_an_older_producer_still_decode() -> None:
    raw = msgpack.packb({**_req().model_dump(), "prompt_tokens": [5, 6, 7]})
    assert decode(raw, SubmitRequest).prompt_tokens == [5, 6, 7]


def test_packed_token_ids_of_a_length_not_a_multiple_of_four_are_a_decode_error() -> None:
    raw = msgpack.packb({**_req().model_dump(), "prompt_tokens": b"\x01\x00\x00"})
    with pytest.raises(DecodeError, match=r"prompt_tokens.*4 bytes"):
        decode(raw, SubmitRequest)


def test_token_ids_are_a_list_in_a_dump_and_in_json() -> None:
    r = _req(prompt_tokens=(4, 5))
    assert r.model_dump()["prompt_tokens"] == [4, 5]
    assert json.loads(r.model_dump_json())["prompt_tokens"] == [4, 5]
    schema = SubmitRequest.model_json_schema()["properties"]["prompt_tokens"]["anyOf"][0]
    assert schema["type"] == "array" and schema["items"]["maximum"] == 2**32 - 1


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(-5, 205), st.integers(0, 3))
def test_packed_token_ids_behave_as_the_list_of_them(ids: list[int], i: int, step: int) -> None:
    t = TokenIds(ids)
    assert len(t) == len(ids) and list(t) == ids and t.tolist() == ids and t == ids
    assert t == tuple(ids) and TokenIds.from_packed(t.packed) == t
    assert t[i : i + 7 : step or None] == ids[i : i + 7 : step or None]
    if -len(ids) <= i < len(ids):
        assert t[i] == ids[i]
    assert t != [*ids, 1] and (t == "x") is False
    assert pickle.loads(pickle.dumps(t)) == ids
    assert block_hashes(t, 4) == block_hashes(ids, 4) and block_hashes(t[1:], 4) == block_hashes(
        ids[1:], 4
    )


def test_models_are_frozen() -> None:
    r = Result(request_id="a", ok=True)
    with pytest.raises(ValueError):
        r.ok = False  # type: ignore[misc]


@given(st.text(min_size=1, max_size=40))
def test_subject_tokens_round_trip_and_are_safe(value: str) -> None:
    token = names.subject_token(value)
    assert names.token_value(token) == value
    assert not any(c in token for c in ".*> \t\r\n")


def _reference_token(value: str) -> str:
    """:func:`names.subject_token` character by character, as it was before its fast path."""
    return "".join(
        ch
        if ch.isascii() and (ch.isalnum() or ch in "_-")
        else "".join(f"~{b:02X}" for b in ch.encode("utf-8"))
        for ch in value
    )


@given(st.text(alphabet=st.sampled_from("aZ09_-~.* é\n\u4e2d"), min_size=1, max_size=12))
def test_subject_tokens_keep_safe_names_whole_and_encode_the_rest(value: str) -> None:
    """The fast paths (a name of safe characters is its own token; a token without ``~``
    decodes to itself) give what encoding character by character gives. Fails if the fast
    path of ``subject_token`` lets ``~`` or ``.`` through, or ``token_value`` skips decoding."""
    assert names.subject_token(value) == _reference_token(value)
    assert names.token_value(_reference_token(value)) == value


def test_request_subject_parses_back() -> None:
    subject = names.request_subject("interactive", "qwen2.5-7b", "acme corp")
    assert subject.count(".") == 4
    assert names.parse_request_subject(subject) == ("interactive", "qwen2.5-7b", "acme corp")
    with pytest.raises(ValueError):
        names.parse_request_subject("sluice.req.a.b")


def test_stream_names_are_valid() -> None:
    for band in ("interactive", "batch", "x.y"):
        stream = names.request_stream(band)
        assert all(c.isalnum() or c == "_" for c in stream)


@given(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=200), st.integers(1, 32))
def test_block_hashes_cover_full_blocks_only(tokens: list[int], bt: int) -> None:
    assert len(block_hashes(tokens, bt)) == len(tokens) // bt


@given(
    st.lists(st.integers(0, 50_000), min_size=32, max_size=96),
    st.lists(st.integers(0, 50_000), min_size=16, max_size=64),
)
def test_block_hashes_are_prefix_chained(prefix: list[int], suffix: list[int]) -> None:
    a = block_hashes(prefix + suffix)
    b = block_hashes(prefix)
    assert a[: len(b)] == b  # a shared prefix gives shared leading hashes
    changed = list(prefix)
    changed[0] = (changed[0] + 1) % 50_000
    c = block_hashes(changed + suffix)
    assert not set(a) & set(c)  # a change in block 0 changes every later hash


def test_text_fallback_is_chained_and_distinct_from_tokens() -> None:
    text = "x" * 64 * 3 + "tail"
    hs = text_block_hashes(text)
    assert len(hs) == 3
    assert text_block_hashes(text[:128]) == hs[:2]
    assert estimate_text_tokens(text) == -(-len(text) // 4)
    assert prompt_hashes(None, text) == hs
    assert prompt_hashes([120] * 48, None) != hs


def test_sampling_travels_only_when_set_so_an_older_reader_takes_the_request() -> None:
    from pydantic import create_model

    from sluice.schemas.models import Sampling

    # The wire before sampling: the same fields but that one, any other forbidden.
    fields: dict[str, Any] = {
        name: (info.annotation, info)
        for name, info in SubmitRequest.model_fields.items()
        if name != "sampling"
    }
    older = create_model("OlderSubmitRequest", __config__=SubmitRequest.model_config, **fields)
    assert "sampling" not in older.model_fields
    with pytest.raises(DecodeError):  # (it does forbid the field)
        decode(msgpack.packb({**msgpack.unpackb(encode(SubmitRequest(
            request_id="r", model="m", prompt_text="hi", submitted_unix_ms=1))),
            "sampling": None}), older)  # fmt: skip
    plain = SubmitRequest(request_id="r", model="m", prompt_text="hi", submitted_unix_ms=1)
    assert "sampling" not in msgpack.unpackb(encode(plain))
    assert decode(encode(plain), older).request_id == "r"
    # Nothing set is no sampling: an older reader takes it too.
    empty = plain.model_copy(update={"sampling": Sampling()})
    assert decode(encode(empty), older).request_id == "r"
    sampled = plain.model_copy(update={"sampling": Sampling(temperature=0.0, stop=("\n",))})
    # Only the fields set travel: an engine keeps its own defaults for the rest.
    assert msgpack.unpackb(encode(sampled))["sampling"] == {"temperature": 0.0, "stop": ["\n"]}
    assert decode(encode(sampled), SubmitRequest) == sampled
    for bad in ({"temperature": -1}, {"top_p": 0}, {"stop": [""]}, {"seed": 2**63},
                {"temperature": float("nan")}, {"stop": ["a"] * 17}, {"guess": 1}):  # fmt: skip
        with pytest.raises(DecodeError):
            decode(msgpack.packb({**msgpack.unpackb(encode(plain)), "sampling": bad}),
                   SubmitRequest)  # fmt: skip
