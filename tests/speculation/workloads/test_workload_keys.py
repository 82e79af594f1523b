"""Workload keys: the header, then metadata.workload, then user, then the prompt's automatic category."""

from __future__ import annotations

import pytest

from speculation.workloads.keys import MAX_LEN, BadWorkload, resolve

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Translate German to English: Guten Morgen ."}]}
COMPLETION = {"model": "m", "prompt": "def fibonacci(n):"}


def test_the_header_wins_over_every_field():
    body = {**CHAT, "metadata": {"workload": "from-metadata"}, "user": "from-user"}
    found = resolve(header="from-header", body=body, kind="chat")
    assert (found.key, found.source) == ("from-header", "header")


def test_metadata_workload_comes_before_user():
    body = {**CHAT, "metadata": {"workload": "search/rag"}, "user": "alice@example.com"}
    assert resolve(header=None, body=body, kind="chat").key == "search/rag"
    assert resolve(header=None, body={**CHAT, "user": "alice@example.com"}, kind="chat").key == "alice@example.com"


def test_without_a_key_the_prompt_is_classified():
    chat = resolve(header=None, body=CHAT, kind="chat")
    assert (chat.key, chat.source) == ("translation", "auto")
    assert resolve(header=None, body=COMPLETION, kind="completion").key == "code"
    assert resolve(header=None, body={**COMPLETION, "prompt": [1, 2, 3]}, kind="completion").key == "other"


@pytest.mark.parametrize(
    ("header", "body", "param"),
    [
        ("x" * 10_000, CHAT, "X-ACE-Workload header"),
        ("code\r\nX-Evil: 1", CHAT, "X-ACE-Workload header"),
        ("", CHAT, "X-ACE-Workload header"),
        (None, {**CHAT, "metadata": {"workload": "tab\there"}}, "metadata.workload"),
        (None, {**CHAT, "metadata": {"workload": 5}}, "metadata.workload"),
        (None, {**CHAT, "user": "é" * 3}, "user"),
        (None, {**CHAT, "user": "u" * (MAX_LEN + 1)}, "user"),
    ],
    ids=["10kB-header", "control-chars", "empty-header", "tab", "not-a-string", "non-ascii-user", "long-user"],
)
def test_a_bad_key_is_refused_naming_where_it_came_from_without_echoing_it(header, body, param):
    with pytest.raises(BadWorkload) as raised:
        resolve(header=header, body=body, kind="chat")
    assert raised.value.param == param
    assert param in raised.value.message
    assert "xxxxxxxx" not in raised.value.message and "Evil" not in raised.value.message


def test_a_key_of_max_length_from_the_allowed_characters_passes():
    key = ("team-a/search:v2 x@y.z+1=" * 3)[:MAX_LEN].strip()
    assert resolve(header=key, body=CHAT, kind="chat").key == key
