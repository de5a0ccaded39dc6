"""Text prompts through a real tokenizer (built offline here: nothing is downloaded), so that
the blocks Sluice hashes are the engine's token ids."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from sluice.client import Client, ClientSettings
from sluice.client.errors import InvalidRequest
from sluice.common.errors import ConfigError
from sluice.common.tokenizer import PromptTokenizer
from sluice.schemas.hashing import block_hashes
from sluice.testing.cluster import LocalCluster

from .conftest import cluster_kwargs

SYSTEM = "you are a helpful assistant who answers briefly and kindly " * 6


def _tokenizer(tmp_path: Path) -> Path:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    tok.train_from_iterator([SYSTEM, "what is a kv cache", "tell me about gpus"], trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_text_prompts_are_sent_as_token_ids_that_share_their_prefix(tmp_path: Path) -> None:
    c = Client(tokenizer=PromptTokenizer.from_file(_tokenizer(tmp_path)))
    a = c._build("m", SYSTEM + "what is a kv cache", 8, None, None, None, None)
    b = c._build("m", SYSTEM + "tell me about gpus", 8, None, None, None, None)
    assert a.prompt_text is None and a.prompt_tokens and b.prompt_tokens
    assert len(a.prompt_tokens) == 60 + 5  # one id per word: the engine's view of the prompt
    ha, hb = block_hashes(a.prompt_tokens, 16), block_hashes(b.prompt_tokens, 16)
    assert ha[:3] == hb[:3] and ha[3:] != hb[3:]  # the system prompt's 3 full blocks line up
    with pytest.raises(InvalidRequest, match="no tokens"):
        c._build("m", "   ", 8, None, None, None, None)
    plain = Client()._build("m", SYSTEM, 8, None, None, None, None)
    assert plain.prompt_text == SYSTEM and plain.prompt_tokens is None  # the byte fallback


def test_a_bad_tokenizer_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        Client.from_settings(ClientSettings(tokenizer=str(tmp_path / "missing.json")))
    bad = tmp_path / "bad.json"
    bad.write_text("{not a tokenizer")
    with pytest.raises(ConfigError, match=r"not a tokenizer\.json"):
        PromptTokenizer.from_file(bad)


async def test_a_tokenized_prompt_runs_end_to_end(nats_url: str, tmp_path: Path) -> None:
    settings = ClientSettings(nats_url=nats_url, tokenizer=str(_tokenizer(tmp_path)))
    async with LocalCluster(nats_url, **cluster_kwargs()), Client.from_settings(settings) as c:
        h = await c.submit("sim", SYSTEM + "what is a kv cache", max_tokens=4)
        result = await h.result(timeout_s=20)
    assert result.ok and result.prompt_tokens == 65


def test_the_command_line_answers_a_bad_tokenizer_with_exit_code_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    cfg = tmp_path / "sluice.toml"
    cfg.write_text(f'[client]\ntokenizer = "{tmp_path / "missing.json"}"\n')
    for args in (["stats"], ["submit", "--model", "m", "--prompt", "hi"], ["cancel", "r1"]):
        done = subprocess.run(
            [sys.executable, "-m", "sluice.cli", *args, "--config", str(cfg)],
            capture_output=True,
            timeout=60,
        )
        assert done.returncode == 2 and b"does not exist" in done.stderr, done.stderr


@pytest.mark.parametrize("tokens", [[1, -1], [2**32], [3, 1.5], ["7"], [None]])
def test_token_ids_out_of_range_or_not_integers_are_refused_by_the_client(
    tokens: list[object],
) -> None:
    with pytest.raises(InvalidRequest, match=r"token ids are integers in \[0, 2\*\*32\)"):
        Client()._build("m", tokens, 8, None, None, None, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("tokenized", [False, True])
def test_a_prompt_that_is_not_valid_unicode_is_an_invalid_request(
    tmp_path: Path, tokenized: bool
) -> None:
    """A lone surrogate (what a JSON "\\ud800" escape decodes to) failed the publish with a
    bare UnicodeEncodeError, or, with a tokenizer, the tokenizer library's TypeError."""
    tok = PromptTokenizer.from_file(_tokenizer(tmp_path)) if tokenized else None
    c = Client(tokenizer=tok)
    with pytest.raises(InvalidRequest, match="not valid Unicode"):
        c._build("m", "what is a \ud800 cache", 8, None, None, None, None)
    assert c._build("m", "what is a kv cache \u00e9", 8, None, None, None, None)
    if tok is not None:
        with pytest.raises(UnicodeEncodeError):
            tok.encode("a\ud800")
