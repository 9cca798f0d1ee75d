"""One converted-target cache for the whole session (target.converted): the suite loads the
packaged GGUF in several tests and processes; the first float32 load converts it, the rest read
the conversion. Kept out of the user's own ~/.cache; shared by the workers of `pytest -n 2` (its
lock lets one of them convert while the others wait)."""

from __future__ import annotations

import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on a two-core machine: one intra-op thread each (and for the
    # processes the tests start), or their thread pools oversubscribe the cores and spin-wait
    # (measured: 396 s instead of 548 s for the suite on 2 cores)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session", autouse=True)
def _converted_target_cache(tmp_path_factory):
    old = os.environ.get("DRAFTCACHE_TARGET_CACHE")
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest-xdist: each worker's base is inside the run's own
        base = base.parent
    root = base / "converted-targets"
    root.mkdir(exist_ok=True)
    os.environ["DRAFTCACHE_TARGET_CACHE"] = str(root)
    yield
    if old is None:
        os.environ.pop("DRAFTCACHE_TARGET_CACHE", None)
    else:
        os.environ["DRAFTCACHE_TARGET_CACHE"] = old


@pytest.fixture(scope="session")
def packaged_hf_dir(tmp_path_factory, _converted_target_cache) -> str:
    """The packaged SmolLM2 as a plain HF directory (float32, from the session's conversion): what a
    server or a user's AutoModel loads in a second instead of de-quantizing the GGUF again."""
    from target.loader import save_hf_dir

    return save_hf_dir("", tmp_path_factory.mktemp("packaged-hf") / "smol")


@pytest.fixture(scope="session")
def object_server():
    """A real S3-compatible server (moto's server mode, a process of its own on a free port) and the
    environment that points obstore at it; yields a function that makes a fresh bucket URL."""
    from bench.common import new_bucket, start_moto

    keys = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ALLOW_HTTP")
    old = {k: os.environ.get(k) for k in keys}
    proc, endpoint = start_moto()

    def bucket_url(prefix: str = "store") -> str:
        return f"s3://{new_bucket(endpoint)}/{prefix}"

    yield bucket_url
    proc.terminate()
    proc.wait(timeout=10)
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
