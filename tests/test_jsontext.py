"""Strict JSON at the boundaries (client.jsontext): what json.loads lets through or raises
past its ValueError is one JsonTextError."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.client.batchfile import parse_lines
from sluice.client.jsontext import JsonTextError, loads
from sluice.gateway.chat import parse_json
from sluice.gateway.errors import BadRequest


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b'{"prompt": "a\\ud800b"}', "lone UTF-16 surrogate"),
        (b'{"prompt": "\\uDFFF"}', "lone UTF-16 surrogate"),
        (b'{"\\ud800": 1}', "lone UTF-16 surrogate"),  # a key
        (b'{"m": [{"content": ["x", "\\udbff"]}]}', "lone UTF-16 surrogate"),
        (b'{"prompt": "\xed\xa0\x80"}', "lone UTF-16 surrogate"),  # its UTF-8 bytes
        ('{"p": "\ud800"}'.encode("utf-16", "surrogatepass"), "lone UTF-16 surrogate"),
        (b'{"t": ' + b"9" * 5000 + b"}", "4300 digits"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b"{not json", "not valid JSON"),
        (b'{"a": "\xff"}', "not valid JSON"),
    ],
)
def test_what_json_loads_lets_through_or_raises_is_one_typed_error(raw: bytes, why: str) -> None:
    with pytest.raises(JsonTextError, match=why) as err:
        loads(raw)
    assert "set_int_max_str_digits" not in str(err.value)
    with pytest.raises(BadRequest):
        parse_json(raw)


def test_surrogate_pairs_and_other_text_pass() -> None:
    assert loads(b'{"p": "\\ud83d\\ude00 \\u00e9 \xc3\xa9 \xed\x9e\xa3"}') == {
        "p": "\U0001f600 \u00e9 \u00e9 \ud7a3"
    }
    assert loads('{"p": "\U0001f600"}'.encode("utf-16")) == {"p": "\U0001f600"}


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
    )
)
def test_the_same_value_as_json_loads_for_valid_text(value: object) -> None:
    for raw in (json.dumps(value).encode(), json.dumps(value, ensure_ascii=False).encode()):
        assert loads(raw) == json.loads(raw)


def test_a_batch_line_with_such_text_is_a_line_error_not_a_failed_file() -> None:
    data = b"\n".join(
        [
            b'{"custom_id": "ok", "model": "m", "prompt": "hi"}',
            b'{"custom_id": "bad-prompt", "model": "m", "prompt": "\\ud800"}',
            b'{"custom_id": "\\udc00", "model": "m", "prompt": "hi"}',
            b'{"custom_id": "digits", "model": "m", "max_tokens": ' + b"1" * 5000 + b"}",
            b"[" * 100_000,
        ]
    )
    good, bad = parse_lines(data, "batch_x")
    assert [line.custom_id for line in good] == ["ok"]
    assert [(e.line, e.code) for e in bad] == [(n, "invalid_json") for n in (2, 3, 4, 5)]
