"""The openai engine against a real OpenAI-compatible server (`transformers serve`, packaged SmolLM2,
CPU) started on 127.0.0.1 by the test: same text as the in-process engine, a server lost mid-run
is retried, a server that stays down leaves an errors file and a nonzero exit, and a rerun completes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from extract.regenerate.answers import regenerate
from extract.regenerate.local_server import LocalServer, free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(tmp_path_factory, packaged_hf_dir):
    d = tmp_path_factory.mktemp("served")
    server = LocalServer(packaged_hf_dir, log=str(d / "server.log")).start()
    yield server
    server.stop()


class Relay:
    """A TCP relay on its own port in front of the server that the test can cut: every open
    connection ends mid-request and the port refuses new ones until it is mended, which is what a
    client sees of a server killed with -9 and restarted (without the server's ~17-s restart)."""

    def __init__(self, upstream_port: int):
        self.upstream, self.port = upstream_port, free_port()
        self.listener: socket.socket | None = None
        self.open: list[socket.socket] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def mend(self) -> Relay:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(64)
        self.listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()
        return self

    def cut(self) -> None:
        for s in [self.listener, *self.open]:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the threads blocked in accept/recv on it
            except OSError:
                pass
            s.close()
        self.listener, self.open = None, []

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:  # cut
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            self.open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _records(path):
    with open(path, encoding="utf-8") as f:
        return {(r["prompt_index"], r["sample"]): r["messages"][-1]["content"] for r in map(json.loads, f)}


def _cli(out, server, *extra):
    return subprocess.Popen([sys.executable, "-m", "extract.regenerate", "--engine", "openai", "--base-url", server.url,
                             "--model", server.model_dir, "--out", str(out), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_server_replies_equal_the_in_process_engine(served, tmp_path):
    kw = dict(limit=4, max_new_tokens=16, temperature=0.0)
    res = regenerate(out=str(tmp_path / "api.jsonl"), engine="openai", base_url=(served.url,), model=served.model_dir,
                     concurrency=2, **kw)
    assert (res.written, res.failed) == (4, 0) and res.new_tokens > 0
    regenerate(out=str(tmp_path / "local.jsonl"), engine="static", **kw)  # float32 on the CPU, as the server
    api, local = _records(tmp_path / "api.jsonl"), _records(tmp_path / "local.jsonl")
    assert api == local and len(api) == 4


def test_multi_turn_conversations_through_the_server_equal_the_in_process_engine(served, tmp_path):
    # each second turn is answered after the server's own first answer, as in-process
    convs = [[{"role": "user", "content": "Name a prime number."}, {"role": "assistant", "content": "old"},
              {"role": "user", "content": "And one more?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
              {"role": "assistant", "content": "old"}, {"role": "user", "content": "Times two?"}]]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    kw = dict(prompts=str(prompts), max_new_tokens=8, temperature=0.0)
    res = regenerate(out=str(tmp_path / "api.jsonl"), engine="openai", base_url=(served.url,), model=served.model_dir,
                     concurrency=2, **kw)
    assert (res.written, res.failed) == (2, 0)
    regenerate(out=str(tmp_path / "local.jsonl"), engine="static", **kw)

    def full(path):
        return {r["prompt_index"]: r["messages"] for r in map(json.loads, open(path, encoding="utf-8"))}

    api, local = full(tmp_path / "api.jsonl"), full(tmp_path / "local.jsonl")
    assert api == local and [m["role"] for m in api[1]] == ["system", "user", "assistant", "user", "assistant"]
    assert "old" not in {m["content"] for m in api[0]}


def test_a_server_lost_mid_run_is_retried(served, tmp_path):
    out = tmp_path / "x.jsonl"
    relay = Relay(served.port).mend()
    p = _cli(out, SimpleNamespace(url=relay.url, model_dir=served.model_dir),
             "--limit", "8", "--max-new-tokens", "8", "--concurrency", "2", "--retries", "8")
    end = time.monotonic() + 120
    while (not out.exists() or len(out.read_text().splitlines()) < 2) and time.monotonic() < end:
        time.sleep(0.2)
    relay.cut()  # requests in flight lose their connection, new ones are refused
    time.sleep(1.0)
    relay.mend()
    log = p.communicate(timeout=300)[0]
    relay.cut()
    assert p.returncode == 0, log
    assert len(_records(out)) == 8 and "8 written, 0 failed" in log and "needed retries" in log, log
    assert not (tmp_path / "x.jsonl.errors.jsonl").exists()  # no failure: no errors file


def test_failures_are_recorded_then_completed_by_a_rerun(served, tmp_path):
    out = tmp_path / "y.jsonl"
    # a server that is down: a port just freed, where nothing listens (no restart of the real one)
    down = SimpleNamespace(url=f"http://127.0.0.1:{free_port()}/v1", model_dir=served.model_dir)
    p = _cli(out, down, "--limit", "5", "--max-new-tokens", "8", "--retries", "1")
    log = p.communicate(timeout=120)[0]
    assert p.returncode == 3 and "5 requests failed" in log, log
    errors = [json.loads(x) for x in (tmp_path / "y.jsonl.errors.jsonl").read_text().splitlines()]
    assert sorted(e["prompt_index"] for e in errors) == [0, 1, 2, 3, 4]
    assert all(e["attempts"] == 2 and "127.0.0.1" in e["error"] for e in errors)
    p = _cli(out, served, "--limit", "5", "--max-new-tokens", "8", "--retries", "1")
    log = p.communicate(timeout=300)[0]
    assert p.returncode == 0, log
    assert sorted(_records(out)) == [(i, 0) for i in range(5)]
    assert not (tmp_path / "y.jsonl.errors.jsonl").exists()  # the rerun's list: nothing failed this time


def test_invent_through_the_completions_endpoint(served, tmp_path):
    """--invent with a server: the chat template's text before a user turn goes to /completions."""
    res = regenerate(out=str(tmp_path / "inv.jsonl"), engine="openai", base_url=(served.url,), model=served.model_dir,
                     invent=2, invent_prefix="Write a Python function", temperature=1.0, max_new_tokens=12)
    assert res.failed == 0 and 0 < res.written <= 2
    with open(tmp_path / "inv.jsonl", encoding="utf-8") as f:
        recs = [json.loads(x) for x in f]
    assert all([m["role"] for m in r["messages"]] == ["user"] for r in recs)
    assert all(r["messages"][0]["content"].startswith("Write a Python function") for r in recs)
