"""The gateway's parts that need no broker: the key table, bands, the chat template, request
parsing, the retry-after header, and settings that never echo a key."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from sluice.common.chat import ChatError, render_chat
from sluice.common.chattemplate import chat_prompt
from sluice.common.settings import ConfigError
from sluice.common.tokenizer import PromptTokenizer
from sluice.gateway.chat import chat_job, completion_job, session_of
from sluice.gateway.errors import (
    BadRequest,
    Forbidden,
    Unauthorized,
    retry_after_s_header,
)
from sluice.gateway.keys import KeyTable
from sluice.gateway.settings import ApiKey, GatewaySettings, is_loopback
from sluice.testing import engineserver

SECRET = "sk-test-8b1f5c0e-never-print-me"


def _settings(**kw: object) -> GatewaySettings:
    return GatewaySettings(**kw)  # type: ignore[arg-type]


def test_keys_plain_and_digested_authenticate_and_others_do_not() -> None:
    other = "sk-other-key"
    table = KeyTable.from_settings(
        _settings(
            keys=[
                ApiKey(key=SECRET, tenant="acme", bands=["standard"], default_band="standard"),
                ApiKey(key_sha256=hashlib.sha256(other.encode()).hexdigest(), tenant="beta"),
            ]
        )
    )
    assert not table.open and len(table) == 2
    assert table.authenticate(f"Bearer {SECRET}").tenant == "acme"
    assert table.authenticate(f"bearer  {other} ").tenant == "beta"
    for bad in (None, "", "Bearer", "Basic abc", f"Bearer {SECRET}x", "Bearer " + SECRET[:-1]):
        with pytest.raises(Unauthorized) as info:
            table.authenticate(bad)
        assert SECRET not in str(info.value) and info.value.status == 401


def test_the_same_key_twice_is_a_config_error_that_does_not_name_it() -> None:
    digest = hashlib.sha256(SECRET.encode()).hexdigest()
    settings = _settings(
        keys=[
            ApiKey(name="first", key=SECRET, tenant="a"),
            ApiKey(key_sha256=digest.upper(), tenant="b"),
        ]
    )
    with pytest.raises(ConfigError, match="same key as 'first'") as info:
        KeyTable.from_settings(settings)
    assert SECRET not in str(info.value) and digest not in str(info.value).lower()


def test_a_key_may_use_its_bands_and_its_default_and_nothing_else() -> None:
    table = KeyTable.from_settings(
        _settings(keys=[ApiKey(key=SECRET, tenant="acme", bands=["batch"])])
    )
    who = table.authenticate(f"Bearer {SECRET}")
    assert who.band(None) == "interactive"  # the gateway's default_band
    assert who.band("batch") == "batch" and who.band("interactive") == "interactive"
    with pytest.raises(Forbidden) as info:
        who.band("standard")
    assert info.value.status == 403 and info.value.param == "x-sluice-priority"
    with pytest.raises(BadRequest):
        who.band(" ")


def test_an_open_gateway_is_one_tenant_with_any_band() -> None:
    table = KeyTable.from_settings(_settings(open_tenant="lab", default_band="standard"))
    who = table.authenticate(None)
    assert table.open and who.tenant == "lab" and who.band(None) == "standard"
    assert who.band("anything") == "anything"  # the fleet's bands are checked elsewhere


def test_open_on_a_network_address_is_refused_unless_allowed() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")
    with pytest.raises(ConfigError, match="allow_open_non_loopback"):
        GatewaySettings.load(host="0.0.0.0")
    assert GatewaySettings.load(host="0.0.0.0", allow_open_non_loopback=True).host == "0.0.0.0"
    keyed = GatewaySettings.load(host="0.0.0.0", keys=[{"key": SECRET, "tenant": "a"}])
    assert SECRET not in repr(keyed) and SECRET not in str(keyed.model_dump())


def test_invalid_key_settings_never_echo_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: ``redact_inputs = False`` on GatewaySettings prints the misspelt entry's
    value, the key."""
    bad = [
        f'[{{"key": "{SECRET}", "tenant": ""}}]',  # a field error
        f'[{{"key": "{SECRET}", "key_sha256": "{"a" * 64}", "tenant": "t"}}]',  # the entry's
        f'[{{"kye": "{SECRET}", "tenant": "t"}}]',  # a misspelt field: pydantic shows its value
    ]
    for value in bad:
        monkeypatch.setenv("SLUICE_GATEWAY_KEYS", value)
        with pytest.raises(ConfigError) as info:
            GatewaySettings.load()
        assert "keys" in str(info.value) and SECRET not in str(info.value), str(info.value)


def test_a_conversation_keeps_its_prefix_turn_after_turn(tmp_path: Path) -> None:
    """The template is deterministic and a turn's text is a prefix of the next turn's; with a
    tokenizer, so are its token ids (mutation: a per-call salt in render_chat)."""
    turns = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "alpha beta"}],
    ]
    turns.append([*turns[0], {"role": "assistant", "content": " gamma"}])
    turns[1].append({"role": "user", "content": [{"type": "text", "text": "beta alpha"}]})
    first, second = render_chat(turns[0]), render_chat(turns[1])
    assert render_chat(turns[0]) == first and second.startswith(first)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["alpha beta gamma Be brief . < | > system user assistant"],
        trainers.WordLevelTrainer(special_tokens=["[UNK]"]),
    )
    tok.save(str(tmp_path / "t.json"))
    ids = PromptTokenizer.from_file(tmp_path / "t.json")
    a, b = ids.encode(first), ids.encode(second)
    assert ids.encode(first) == a and b[: len(a)] == a and len(b) > len(a)
    # The gateway's prompt is the template's; sluice engine renders with the same function.
    assert chat_job({"model": "m", "messages": turns[1]}, 16).prompt == second
    assert engineserver.chat_prompt is chat_prompt


@pytest.mark.parametrize(
    "messages",
    [[], "hi", [{"content": "x"}], [{"role": "user", "content": [{"type": "image_url"}]}]],
)
def test_messages_that_cannot_be_rendered(messages: object) -> None:
    with pytest.raises(ChatError):
        render_chat(messages)


_CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({**_CHAT, "n": 17}, "n"),
        ({**_CHAT, "n": True}, "n"),
        ({**_CHAT, "best_of": True}, "best_of"),
        ({**_CHAT, "best_of": 2}, "best_of"),
        ({**_CHAT, "stop": [""]}, "stop"),
        ({**_CHAT, "stop": 3}, "stop"),
        ({**_CHAT, "top_logprobs": 2}, "top_logprobs"),  # (needs logprobs: true)
        ({**_CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**_CHAT, "logprobs": 1}, "logprobs"),
        ({**_CHAT, "echo": True}, "echo"),
        (
            {**_CHAT, "logit_bias": {"1": 2}},
            None,
        ),
        ({**_CHAT, "top_p": 0}, "top_p"),
        ({**_CHAT, "temperature": -1}, None),
        ({**_CHAT, "seed": True}, "seed"),
        ({**_CHAT, "seed": 2**64}, "seed"),
        ({**_CHAT, "top_p": "0.5"}, "top_p"),
        ({**_CHAT, "ignore_eos": 1}, None),
        (
            {**_CHAT, "repetition_penalty": 3},
            None,
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "stop_token_ids": [True],
            },
            None,
        ),
        (
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "include_stop_str_in_output": True,
            },
            None,
        ),
        ({**_CHAT, "regex": "a+"}, "regex"),
        ({**_CHAT, "max_tokens": 0}, None),
        ({**_CHAT, "stream": "yes"}, None),
        ({"model": "m", "messages": "x"}, "messages"),
    ],
)
def test_chat_fields_that_are_refused(body: dict[str, object], param: str | None) -> None:
    with pytest.raises(BadRequest) as info:
        chat_job(body, 16)
    assert info.value.status == 400
    if param is not None:
        assert info.value.param == param


def test_completion_prompts_and_defaults() -> None:
    job = completion_job({"model": "m", "prompt": "hi"}, 16)
    assert job.prompt == "hi" and job.max_tokens == 16 and not job.stream
    assert job.sampling is None  # the engine's own defaults
    assert completion_job({"model": "m", "prompt": [[1, 2]]}, 16).prompt == [1, 2]
    chat = chat_job(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5},
        16,
    )
    assert chat.max_tokens == 5
    for bad in ([], [1, -1], ["a", "b"], 3, [True]):
        with pytest.raises(BadRequest):
            completion_job({"model": "m", "prompt": bad}, 16)


def test_the_session_is_the_header_else_the_user_field() -> None:
    job = completion_job({"model": "m", "prompt": "hi", "user": "u-1"}, 16)
    assert session_of(None, job) == "u-1" and session_of("s-9", job) == "s-9"
    assert session_of(" ", job) == "u-1"
    with pytest.raises(BadRequest):
        session_of("x" * 129, job)
    # ASGI servers hand headers over decoded as Latin-1: a UTF-8 id is read as it was sent,
    # and its length counted in its own characters (100 of "é", not 200).
    sent = "café-" + "é" * 100
    assert session_of(sent.encode().decode("latin-1"), job) == sent
    assert session_of("caf\xe9", job) == "caf\xe9"  # not UTF-8: kept as read


def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one() -> None:
    assert [retry_after_s_header(s) for s in (0.0, 0.2, 1.0, 1.01, 2.5)] == [1, 1, 1, 2, 3]
    assert retry_after_s_header(None) == 1 and retry_after_s_header(float("inf")) == 1


def test_the_example_config_has_a_gateway_table() -> None:
    example = Path(__file__).parent.parent / "deploy" / "sluice.example.toml"
    try:
        settings = GatewaySettings.load(example)
    finally:
        GatewaySettings.load(None)  # later settings in this process read no file
    assert settings.port == 8080 and settings.keys == [] and settings.host == "127.0.0.1"


def test_sampling_fields_are_relayed_as_the_engine_names_them() -> None:
    body = {
        "model": "m",
        "prompt": "hi",
        "temperature": 0,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 7,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "repetition_penalty": 1.1,
        "stop": "\n\n",
        "stop_token_ids": [2],
        "store": True,  # a field the gateway does not know: no effect
    }
    job = completion_job(body, 16)
    assert job.sampling is not None
    fields = job.sampling.engine_fields()
    assert fields == {k: v for k, v in body.items() if k not in ("model", "prompt", "store")} | {
        "stop": ["\n\n"]
    }
    # Null and empty values are no request; a list of stops stays a list.
    job = chat_job(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a", "b"],
         "temperature": None, "logprobs": False},
        16,
    )  # fmt: skip
    assert job.sampling is not None and job.sampling.engine_fields() == {"stop": ["a", "b"]}
    assert completion_job({"model": "m", "prompt": "hi", "stop": None}, 16).sampling is None


def test_the_client_takes_sampling_as_a_mapping_and_names_a_bad_field() -> None:
    from sluice.client import Client, InvalidRequest, Sampling

    c = Client("nats://127.0.0.1:1")  # not connected: building a request needs no broker
    built = c._build("m", "hi", 8, None, None, None, None, None, {"temperature": 0.5})
    assert built.sampling == Sampling(temperature=0.5)
    assert c._build("m", "hi", 8, None, None, None, None, None, {}).sampling is None
    with pytest.raises(InvalidRequest) as info:
        c._build("m", "hi", 8, None, None, None, None, None, {"top_p": 2})
    assert info.value.param == "top_p" and "top_p" in str(info.value)
    # One stop string, as OpenAI's API takes it; a Sampling with nothing set is none.
    one = c._build("m", "hi", 8, None, None, None, None, None, {"stop": "END"})
    assert one.sampling == Sampling(stop=("END",))
    assert c._build("m", "hi", 8, None, None, None, None, None, Sampling()).sampling is None
    with pytest.raises(InvalidRequest):
        c._build("m", "hi", 8, None, None, None, None, None, {"temperature": True})
    with pytest.raises(InvalidRequest):
        c._build("m", "hi", 8, None, None, None, None, None, ["temperature"])  # type: ignore[arg-type]


def test_logprobs_are_read_by_the_endpoints_meaning_and_false_or_empty_fields_are_not() -> None:
    """A completion's ``logprobs`` is a count (0: the chosen tokens' own); a chat's is a flag,
    with ``top_logprobs`` as the count."""
    asked = completion_job({"model": "m", "prompt": "hi", "logprobs": 0}, 16).sampling
    assert asked is not None and asked.engine_fields() == {"logprobs": 0}
    asked = completion_job({"model": "m", "prompt": "hi", "logprobs": 5}, 16).sampling
    assert asked is not None and asked.engine_fields() == {"logprobs": 5}
    with pytest.raises(BadRequest) as info:
        completion_job({"model": "m", "prompt": "hi", "logprobs": 21}, 16)
    assert info.value.param == "logprobs"
    asked = chat_job({**_CHAT, "logprobs": True}, 16).sampling
    assert asked is not None and asked.engine_fields() == {"logprobs": 0}
    asked = chat_job({**_CHAT, "logprobs": True, "top_logprobs": 3}, 16).sampling
    assert asked is not None and asked.engine_fields() == {"logprobs": 3}
    assert chat_job({**_CHAT, "logprobs": False, "top_logprobs": None}, 16).sampling is None
    quiet = {"logprobs": None, "echo": False, "tools": [], "logit_bias": {}, "suffix": ""}
    assert completion_job({"model": "m", "prompt": "hi", **quiet}, 16).sampling is None
    job = completion_job(
        {"model": "m", "prompt": "hi", "top_k": 0, "min_tokens": 3, "ignore_eos": True}, 16
    )
    assert job.sampling is not None  # top_k 0 goes as -1, which SGLang takes too
    assert job.sampling.engine_fields() == {"top_k": -1, "min_tokens": 3, "ignore_eos": True}


def test_each_choice_samples_with_its_own_seed() -> None:
    from sluice.client import Sampling
    from sluice.gateway.chat import choice_sampling

    seeded = Sampling(seed=7, temperature=0.5)
    assert choice_sampling(seeded, 0) is seeded
    assert choice_sampling(seeded, 2) == Sampling(seed=9, temperature=0.5)
    assert choice_sampling(Sampling(seed=2**63 - 1), 1) == Sampling(seed=-(2**63))  # int64
    assert choice_sampling(None, 3) is None
    unseeded = Sampling(temperature=0.5)
    assert choice_sampling(unseeded, 3) is unseeded
    job = completion_job({"model": "m", "prompt": "hi", "n": 4}, 16)
    assert job.n == 4 and completion_job({"model": "m", "prompt": "hi"}, 16).n == 1
    for bad in (0, 17, True, 2.0, "2"):
        with pytest.raises(BadRequest):
            completion_job({"model": "m", "prompt": "hi", "n": bad}, 16)
    assert completion_job({"model": "m", "prompt": "hi", "n": 20}, 16, max_choices=32).n == 20


def test_a_response_format_travels_to_the_engine_and_a_bad_one_is_a_400() -> None:
    """``json_object`` and ``json_schema`` become ``Sampling.response_format`` (the engine
    enforces them); ``text`` is no request; a format of another type or shape, or one over
    ``MAX_SCHEMA_CHARS``, is a 400 naming ``response_format`` (it was refused whole)."""
    from sluice.schemas.models import MAX_SCHEMA_CHARS

    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "a_1", "schema": schema, "strict": True}}
    job = chat_job({**_CHAT, "response_format": fmt}, 16)
    assert job.sampling is not None and job.sampling.engine_fields() == {"response_format": fmt}
    job = completion_job(
        {"model": "m", "prompt": "x", "response_format": {"type": "json_object"}}, 16
    )
    assert job.sampling is not None
    assert job.sampling.engine_fields() == {"response_format": {"type": "json_object"}}
    assert chat_job({**_CHAT, "response_format": {"type": "text"}}, 16).sampling is None
    # strict and description may be null, as in OpenAI's API; the request keeps its own copy.
    spec = {"name": "a", "schema": {"type": "object"}, "strict": None, "description": None}
    mine = {"type": "json_schema", "json_schema": spec}
    job = chat_job({**_CHAT, "response_format": mine}, 16)
    spec["schema"]["type"] = "array"
    assert job.sampling is not None
    assert job.sampling.engine_fields()["response_format"]["json_schema"]["schema"] == {
        "type": "object"
    }
    huge = {"description": "x" * MAX_SCHEMA_CHARS}
    big = {"type": "json_schema", "json_schema": {"name": "a", "schema": huge}}
    for bad in (
        {"type": "xml"},
        {"type": "json_object", "schema": {}},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": []}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "extra": 1}},
        "json",
        big,
        {"type": "json_schema", "json_schema": {"name": "a\n", "schema": {}}},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": {"x": float("nan")}}},
        {"type": "text", "json_schema": {}},
    ):
        with pytest.raises(BadRequest) as info:
            chat_job({**_CHAT, "response_format": bad}, 16)
        assert info.value.param == "response_format", bad
