"""A model's own chat template (``sluice.common.chattemplate``): rendered as transformers and
vLLM render it, its leading BOS left to the engine, its refusals a ``ChatError``, and a file
that holds none a ``ConfigError``. The gateway, batch lines and ``sluice engine`` use it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.client.batchfile import parse_lines
from sluice.common.chat import ChatError
from sluice.common.chattemplate import ChatTemplate
from sluice.common.errors import ConfigError

# Written after the shape of Llama 3's template (BOS, header ids, end-of-turn ids).
LLAMA_LIKE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
# After Mistral's: no system role, roles must alternate, the answer closed by EOS.
ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'"
    " + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BOS = "<|begin_of_text|>"


def test_a_chat_renders_as_the_model_reads_it_without_the_bos_the_engine_adds() -> None:
    t = ChatTemplate(LLAMA_LIKE, {"bos_token": BOS})
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}]
    text = t.render(first)
    assert text == (
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # The next turn starts with this one's whole text: its prefix is cached where it ran.
    second = [*first, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "?"}]
    assert t.render(second).startswith(text)
    # Text parts are joined, as Sluice's neutral template joins them.
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}
    ]
    assert "\n\nHi<|eot_id|>" in t.render(parts)
    assert ChatTemplate(CHATML).render([{"role": "user", "content": "é"}]) == (
        "<|im_start|>user\né<|im_end|>\n<|im_start|>assistant\n"
    )


def test_what_the_template_refuses_or_cannot_render_is_a_chat_error() -> None:
    t = ChatTemplate(ALTERNATING, {"bos_token": "<s>", "eos_token": "</s>"})
    ok = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert t.render(ok) == "[INST] a [/INST]b</s>[INST] c [/INST]"
    with pytest.raises(ChatError, match="roles must alternate"):
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    for bad in ([], "hi", [{"content": "x"}], [{"role": "user", "content": None}]):
        with pytest.raises(ChatError):
            t.render(bad)
    # Sandboxed: a template (or content) cannot reach Python's internals.
    with pytest.raises(ChatError):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render(ok)
    with pytest.raises(ChatError, match="rendered nothing"):
        ChatTemplate("{{ bos_token }}", {"bos_token": "<s>"}).render(ok)
    # tojson keeps non-ASCII text, as transformers' does.
    assert ChatTemplate("{{ messages[0] | tojson }}").render([{"role": "u", "content": "é"}]) == (
        '{"role": "u", "content": "é"}'
    )


def test_a_tokenizer_config_gives_its_template_and_special_tokens(tmp_path: Path) -> None:
    config = tmp_path / "tokenizer_config.json"
    config.write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>", "lstrip": False},  # an AddedToken
                "eos_token": "</s>",
                "chat_template": [
                    {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
                    {"name": "default", "template": ALTERNATING},
                ],
            }
        )
    )
    t = ChatTemplate.from_file(config)
    assert t.special_tokens["bos_token"] == "<s>" and t.special_tokens["eos_token"] == "</s>"
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert t.render(chat) == "[INST] a [/INST]b</s>"
    jinja = tmp_path / "chatml.jinja"
    jinja.write_text(CHATML)
    assert ChatTemplate.from_file(jinja).render(chat).startswith("<|im_start|>user\na")


@pytest.mark.parametrize(
    ("name", "content", "error"),
    [
        ("none.json", None, "cannot read"),
        ("c.json", "{not json", "is not JSON"),
        ("c.json", json.dumps({"bos_token": "<s>"}), "has no chat_template"),
        ("c.json", json.dumps({"chat_template": [{"name": "rag", "template": "x"}]}), "no chat"),
        ("c.jinja", "{% for %}", "does not compile"),
    ],
)
def test_a_file_without_a_usable_template_is_a_config_error(
    tmp_path: Path, name: str, content: str | None, error: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=error):
        ChatTemplate.from_file(path)


def test_a_batchs_chat_lines_are_rendered_with_the_template() -> None:
    t = ChatTemplate(CHATML)
    line = {
        "custom_id": "a",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "q"}]},
    }
    refused = {**line, "custom_id": "b", "body": {**line["body"], "messages": "q"}}  # type: ignore[dict-item]
    data = b"\n".join(json.dumps(x).encode() for x in (line, refused))
    good, bad = parse_lines(data, "batch_1", t.render)
    assert good[0].prompt == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
    assert [e.line for e in bad] == [2]
