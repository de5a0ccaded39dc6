"""A model's own chat template (``sluice.common.chattemplate``): rendered as transformers and
vLLM render it, its leading BOS left to the engine, its refusals a ``ChatError``, and a file
that holds none a ``ConfigError``. The gateway, batch lines and ``sluice engine`` use it."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from sluice.client.batchfile import parse_lines
from sluice.common import chattemplate
from sluice.common.chat import ChatError
from sluice.common.chattemplate import ChatOptions, ChatTemplate, chat_prompt
from sluice.common.errors import ConfigError
from sluice.common.tokenizer import PromptTokenizer

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
    text = t.prompt(first)
    assert t.render(first) == BOS + text
    assert text == (
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # The next turn starts with this one's whole text: its prefix is cached where it ran.
    second = [*first, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "?"}]
    assert t.prompt(second).startswith(text)
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
    assert t.prompt(ok) == "[INST] a [/INST]b</s>[INST] c [/INST]"
    with pytest.raises(ChatError, match="roles must alternate"):
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    for bad in ([], "hi", [{"content": "x"}], [{"role": "user", "content": None}]):
        with pytest.raises(ChatError):
            t.render(bad)
    # Sandboxed: a template (or content) cannot reach Python's internals.
    with pytest.raises(ChatError):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render(ok)
    with pytest.raises(ChatError, match="rendered nothing"):
        ChatTemplate("{{ bos_token }}", {"bos_token": "<s>"}).prompt(ok)
    with pytest.raises(ChatError, match="rendered nothing"):
        ChatTemplate("{% if false %}x{% endif %}").render(ok)
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
    assert t.prompt(chat) == "[INST] a [/INST]b</s>"
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


# Multi-line, as templates are written: the whitespace control (trim_blocks, lstrip_blocks)
# decides the text, and a loop control and strftime_now are in it.
ZEPHYR_LIKE = """{% for message in messages %}
    {% if message['role'] == 'system' and not loop.first %}
        {% break %}
    {% endif %}
    {% if message['role'] == 'user' %}
{{ '<|user|>\\n' + message['content'] + eos_token }}
    {% elif message['role'] == 'system' %}
{{ '<|system|>\\n' + message['content'] + eos_token }}
    {% else %}
{{ '<|assistant|>\\n'  + message['content'] + eos_token }}
    {% endif %}
    {% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
    {% endif %}
{% endfor %}"""


def test_whitespace_control_and_loop_controls_render_as_transformers_renders() -> None:
    t = ChatTemplate(ZEPHYR_LIKE, {"eos_token": "</s>"})
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    # (transformers' own rendering of this template and chat)
    assert t.render(chat) == "<|system|>\nS</s>\n<|user|>\nU</s>\n<|assistant|>\n"
    # {% break %}: a second system message ends the loop.
    assert (
        t.render([*chat, {"role": "system", "content": "late"}])
        == "<|system|>\nS</s>\n<|user|>\nU</s>\n"
    )
    dated = ChatTemplate("{{ strftime_now('%Y') }}:{{ messages[0].content }}")
    assert dated.render([{"role": "user", "content": "x"}]).endswith(":x")
    with pytest.raises(ChatError):  # immutable: a template cannot change the chat
        ChatTemplate("{{ messages.append({}) }}").render([{"role": "user", "content": "x"}])


def test_the_environment_has_what_real_templates_use() -> None:
    chat = [{"role": "user", "content": "x"}]
    # tojson with separators (Kimi's), the {% generation %} block (training masks), tools and
    # documents defined as None, every special token.
    t = ChatTemplate(
        "{{ {'a': [1, 2]} | tojson(separators=(',', ':')) }}"
        "{% generation %}[{{ messages[0].content }}]{% endgeneration %}"
        "{{ 'T' if tools is none else 'F' }}{{ 'D' if documents is none else '' }}"
        "{{ mask_token }}{{ additional_special_tokens | join(',') }}",
        {"mask_token": "<mask>", "additional_special_tokens": ["<a>", "<b>"]},
    )
    assert t.render(chat) == '{"a":[1,2]}[x]TD<mask><a>,<b>'


def test_content_goes_in_as_parts_to_a_template_that_loops_over_them() -> None:
    parts = [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]
    looping = ChatTemplate(
        "{% for m in messages %}{% for p in m['content'] | selectattr('type', 'equalto', 'text')"
        " %}{{ p['text'] }}|{% endfor %}{% endfor %}"
    )
    assert looping.content_parts
    assert looping.render([{"role": "user", "content": parts}]) == "H|i|"
    assert looping.render([{"role": "user", "content": "Hi"}]) == "Hi|"  # a string: one part
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not plain.content_parts and plain.render([{"role": "user", "content": parts}]) == "Hi"
    # An assistant's tool call without content reaches the template as None.
    calls = ChatTemplate(
        "{% for m in messages %}{{ m.content if m.content is not none else 'CALL' }};{% endfor %}"
    )
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
            "tool_calls": [{"id": "1"}]}]  # fmt: skip
    assert calls.render(chat) == "q;CALL;"


def test_a_requests_own_options_render_as_vllm_has_them() -> None:
    t = ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    )
    chat = [{"role": "user", "content": "q"}]
    assert t.render(chat) == "<user>q</user><assistant>"
    assert t.render(chat, ChatOptions(add_generation_prompt=False)) == "<user>q</user>"
    thinking = ChatOptions(kwargs={"enable_thinking": False})
    assert t.render(chat, thinking).endswith("<assistant><no-think>")
    # The answer so far, to go on with: cut where its text ends, its closing tag gone.
    going = [*chat, {"role": "assistant", "content": "The answer is"}]
    options = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    assert t.render(going, options) == "<user>q</user><assistant>The answer is"
    with pytest.raises(ChatError, match="cannot both"):
        t.render(going, ChatOptions(continue_final_message=True))
    body = {"add_generation_prompt": False, "chat_template_kwargs": {"enable_thinking": False}}
    assert ChatOptions.from_body(body) == ChatOptions(False, False, {"enable_thinking": False})
    kwargs = "chat_template_kwargs"
    for bad, param in (({"add_generation_prompt": "no"}, "add_generation_prompt"),
                       ({kwargs: []}, kwargs), ({kwargs: {"bos_token": "x"}}, kwargs)):  # fmt: skip
        with pytest.raises(ChatError) as info:
            ChatOptions.from_body(bad)
        assert info.value.param == param
    # Sluice's neutral template has no such options: said, not ignored.
    with pytest.raises(ChatError) as info:
        chat_prompt(chat, thinking)
    assert info.value.param == "chat_template_kwargs"


def _bos_tokenizer(tmp_path: Path, adds_bos: bool) -> PromptTokenizer:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "[UNK]": 1, "a": 2, "b": 3, "|": 4, "<|u|>": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "<|u|>"])
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 0)]
        )
    path = tmp_path / f"tok-{adds_bos}.json"
    tok.save(str(path))
    return PromptTokenizer.from_file(path)


def test_with_the_engines_tokenizer_a_chat_is_tokenized_as_vllms_chat_endpoint_does(
    tmp_path: Path,
) -> None:
    """vLLM tokenizes a rendered chat without adding special tokens: the BOS is the
    template's to write. (Taking the BOS text off and letting the tokenizer add it gave one
    too many with a template that writes none, and one too few with a tokenizer that adds
    none.)"""
    chat = [{"role": "user", "content": "a b"}]
    with_bos = ChatTemplate("{{ bos_token }}<|u|> {{ messages[0].content }}", {"bos_token": "<s>"})
    without = ChatTemplate("<|u|> {{ messages[0].content }}", {"bos_token": "<s>"})
    adds, adds_none = _bos_tokenizer(tmp_path, True), _bos_tokenizer(tmp_path, False)
    assert with_bos.prompt(chat, tokenizer=adds) == [0, 5, 2, 3]
    assert with_bos.prompt(chat, tokenizer=adds_none) == [0, 5, 2, 3]
    assert without.prompt(chat, tokenizer=adds) == [5, 2, 3]  # no BOS, as vLLM's chat
    # Without a tokenizer, text for the engine's completions endpoint, which adds the BOS.
    assert with_bos.prompt(chat) == "<|u|> a b"


def test_errors_of_the_templates_own_are_chat_or_config_errors(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    chat = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatError, match="ZeroDivisionError"):
        ChatTemplate("{{ 1 / 0 }}").render(chat)
    with pytest.raises(ChatError):
        ChatTemplate("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").render(
            chat
        )  # RecursionError
    monkeypatch.setattr(chattemplate, "MAX_RENDERED_CHARS", 1000)
    with pytest.raises(ChatError, match="longer than 1000"):
        ChatTemplate("{% for i in range(100) %}{{ 'x' * 50 }}{% endfor %}").render(chat)
    bad = tmp_path / "huge.jinja"
    bad.write_text("{{ 10 ** 100000 }}")
    with contextlib.suppress(ConfigError, ChatError):  # (never another error)
        ChatTemplate.from_file(bad).render(chat)


def test_a_repos_side_file_template_and_a_jinja_files_special_tokens(tmp_path: Path) -> None:
    """transformers 4.47 on keeps the template in chat_template.jinja beside the config (it
    wins over one inside it); a .jinja file given alone takes the config's special tokens."""
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"eos_token": "</s>", "chat_template": "STALE"}))
    side = tmp_path / "chat_template.jinja"
    side.write_text(ALTERNATING)
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert ChatTemplate.from_file(config).render(chat) == "[INST] a [/INST]b</s>"
    assert ChatTemplate.from_file(side).render(chat) == "[INST] a [/INST]b</s>"
    side.unlink()
    config.write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ConfigError, match=r"chat_template\.jinja"):
        ChatTemplate.from_file(config)
