"""One converted-target cache for the whole session (cache_format.converted): the suite loads the
packaged GGUF in several tests and processes; the first float32 load converts it, the rest read
the conversion. Kept out of the user's own ~/.cache."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _converted_target_cache(tmp_path_factory):
    old = os.environ.get("DRAFTCACHE_TARGET_CACHE")
    os.environ["DRAFTCACHE_TARGET_CACHE"] = str(tmp_path_factory.mktemp("converted-targets"))
    yield
    if old is None:
        os.environ.pop("DRAFTCACHE_TARGET_CACHE", None)
    else:
        os.environ["DRAFTCACHE_TARGET_CACHE"] = old


@pytest.fixture(scope="session")
def packaged_hf_dir(tmp_path_factory, _converted_target_cache) -> str:
    """The packaged SmolLM2 as a plain HF directory (float32, from the session's conversion): what a
    server or a user's AutoModel loads in a second instead of de-quantizing the GGUF again."""
    from cache_format.target import save_hf_dir

    return save_hf_dir("", tmp_path_factory.mktemp("packaged-hf") / "smol")
