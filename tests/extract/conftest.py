"""Fixtures of the stage-one tests: a tiny random llama target and 40 chats."""

from __future__ import annotations

import pytest

from tests.helpers import tiny_target_dir, write_chats


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_target_dir(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    return write_chats(tmp_path_factory.mktemp("data") / "chats.jsonl", 40)

