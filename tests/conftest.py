"""One converted-target cache for the whole session (cache_format.converted): the suite loads the
packaged GGUF in several tests and processes; the first float32 load converts it, the rest read
the conversion. Kept out of the user's own ~/.cache; shared by the workers of `pytest -n 2` (its
lock lets one of them convert while the others wait)."""

from __future__ import annotations

import os
from pathlib import Path

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
    from cache_format.target import save_hf_dir

    return save_hf_dir("", tmp_path_factory.mktemp("packaged-hf") / "smol")


@pytest.fixture(scope="session")
def object_server(tmp_path_factory):
    """A real S3-compatible server (moto's server mode, a process of its own on a free port) and the
    environment that points obstore at it; yields a function that makes a fresh bucket URL."""
    import shutil
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    import uuid

    exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path_factory.mktemp("moto") / "server.log", "wb")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except OSError:
            time.sleep(0.05)
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)

    def bucket_url(prefix: str = "store") -> str:
        name = f"b{uuid.uuid4().hex[:12]}"
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{name}", method="PUT"), timeout=10)
        return f"s3://{name}/{prefix}"

    bucket_url.endpoint = endpoint
    yield bucket_url
    proc.terminate()
    proc.wait(timeout=10)
    log.close()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
