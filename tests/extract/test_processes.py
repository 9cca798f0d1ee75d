"""Stage one through its command line: two ranks under torchrun, a SIGKILL and its resume, a second
run on a store in use, and the one-line errors (in the test's process where no second is needed)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cache_format import StoreReader
from cache_format.audit import verify_store
from extract.run import run
from tests.helpers import assert_same_content, content, extract_cfg, write_chats

ROOT = Path(__file__).resolve().parents[2]


def _cli(args, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def _cli_here(args) -> tuple[int, str]:
    """`python -m extract ARGS` run in this process: (exit code, what it printed)."""
    from click.testing import CliRunner

    from extract.__main__ import main

    assert args[:2] == ["-m", "extract"]
    res = CliRunner().invoke(main, args[2:])
    return res.exit_code, res.output


def _cli_args(store, target, data, *extra):
    return ["-m", "extract", "--store", str(store), "--target", target, "--data", data, "--layers", "0,2,4",
            "--max-len", "256", "--min-supervised", "4", "--token-budget", "512", "--rows-per-shard", "64", *extra]


@pytest.mark.slow
def test_two_ranks_torchrun_equals_one_rank(tmp_path, llama, chats):
    one, two = tmp_path / "one.zarr", tmp_path / "two.zarr"
    run(extract_cfg(one, llama, chats))
    p = _cli(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              *_cli_args(two, llama, chats)])
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    logs = {p.stem for p in (two / "commits").glob("w*.jsonl")}
    assert logs == {f"w{i:05d}" for i in range(6)}  # three writers per rank (the default), all committed
    assert_same_content(content(one), content(two), exact=False)
    assert verify_store(two)["ok"]


@pytest.mark.slow
def test_sigkill_and_resume_equals_uninterrupted(tmp_path, llama):
    data = write_chats(tmp_path / "many.jsonl", 120, seed=1)
    store, ref = tmp_path / "s.zarr", tmp_path / "ref.zarr"
    p = _cli(_cli_args(store, llama, data, "--token-budget", "256"))
    log = store / "commits" / "w00000.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if log.exists() and log.read_text().count("\n") >= 3:
            p.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    p.wait()
    assert p.returncode == -signal.SIGKILL, "extraction finished before it could be killed"
    assert not StoreReader(store).finalized
    code, out = _cli_here(_cli_args(store, llama, data, "--json"))  # the resume
    assert code == 0, out
    summary = json.loads(out[out.index("{"):])
    assert summary["already_committed"] > 0 and summary["samples_in_store"] == 120 - sum(summary["skipped"].values())
    run(extract_cfg(ref, llama, data))
    assert_same_content(content(store), content(ref), exact=False)
    assert verify_store(store)["ok"] and verify_store(store)["duplicate_sample_ids"] == []


@pytest.mark.slow
def test_sigterm_to_the_process_group_commits_what_was_extracted_and_a_rerun_goes_on(tmp_path, llama):
    """A scheduler's SIGTERM to the whole job (the writer processes included): the run stops after the
    batch in hand with the shell's code for it (143), every sample handed to the writers is committed
    (the writers ignore the signal and are closed by the run), the store stays unfinalized and whole,
    and the same command again completes it equal to an uninterrupted run."""
    data = write_chats(tmp_path / "many.jsonl", 120, seed=2)
    store, ref = tmp_path / "s.zarr", tmp_path / "ref.zarr"
    p = _cli(_cli_args(store, llama, data, "--token-budget", "256"), start_new_session=True)
    log = store / "commits" / "w00000.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if log.exists() and log.read_text().count("\n") >= 2:
            os.killpg(p.pid, signal.SIGTERM)
            break
        time.sleep(0.01)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, out
    assert "stopped by SIGTERM" in out and "rerun the same command" in out
    assert not StoreReader(store).finalized
    report = verify_store(store)
    assert report["ok"], report
    kept = len(StoreReader(store).sample_ids)
    assert 0 < kept < 120
    code, text = _cli_here(_cli_args(store, llama, data, "--json"))  # the rerun
    assert code == 0, text
    summary = json.loads(text[text.index("{"):])
    assert summary["already_committed"] == kept
    run(extract_cfg(ref, llama, data))
    assert_same_content(content(store), content(ref), exact=False)


def _children(pid: int) -> set[int]:
    try:
        return {int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except OSError:
        return set()


@pytest.mark.slow
def test_writer_processes_die_with_a_killed_extraction(tmp_path, llama):
    data = write_chats(tmp_path / "many.jsonl", 120, seed=3)
    store = tmp_path / "s.zarr"
    p = _cli(_cli_args(store, llama, data, "--token-budget", "256", "--writer", "process", "--writers", "2"))
    log = store / "commits" / "w00000.jsonl"
    deadline, kids = time.time() + 120, set()
    while time.time() < deadline and p.poll() is None:
        kids |= _children(p.pid)
        if log.exists() and log.read_text().count("\n") >= 2 and len(kids) >= 2:
            p.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    p.wait()
    assert p.returncode == -signal.SIGKILL and len(kids) >= 2, "extraction finished before it could be killed"
    deadline = time.time() + 15
    while time.time() < deadline and any(Path(f"/proc/{k}").exists() and "Z" not in _state(k) for k in kids):
        time.sleep(0.1)
    assert not [k for k in kids if Path(f"/proc/{k}").exists() and "Z" not in _state(k)], "writers outlived their parent"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


@pytest.mark.slow
def test_a_second_run_on_a_store_in_use_is_refused_at_once(tmp_path, llama):
    """Two extractions of one store at once: the second (one rank, or two under torchrun) fails in
    one line naming the store and the first's pid; the first finishes a sound store."""
    data = write_chats(tmp_path / "many.jsonl", 40, seed=2)
    store = tmp_path / "s.zarr"
    first = _cli(_cli_args(store, llama, data, "--token-budget", "256"))
    lock = Path(str(store) + ".lock")
    deadline = time.time() + 120
    while time.time() < deadline and not (lock.exists() and str(first.pid) in lock.read_text()):
        time.sleep(0.02)
    os.kill(first.pid, signal.SIGSTOP)  # the first holds its lock, stopped, for as long as the refusals take
    try:
        t0 = time.time()
        code, out = _cli_here(_cli_args(store, llama, data))  # one rank
        second = _cli(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *_cli_args(store, llama, data)])
        out2, _ = second.communicate(timeout=120)
        assert code != 0 and second.returncode != 0 and time.time() - t0 < 60
        for text in (out, out2):
            line = next(x for x in text.splitlines() if x.startswith("error:"))
            assert str(store) in line and f"pid {first.pid}" in line, text
        assert first.poll() is None, "the first run ended before the second was tried"
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out
    v = verify_store(store)
    assert v["ok"] and v["duplicate_sample_ids"] == [] and StoreReader(store).finalized


def test_target_without_tokenizer_and_empty_data_are_one_line(tmp_path, llama, chats):
    target = tmp_path / "t"
    shutil.copytree(llama, target)
    for f in target.iterdir():
        if "token" in f.name or "chat" in f.name:
            f.unlink()
    code, out = _cli_here(_cli_args(tmp_path / "s.zarr", str(target), chats))
    errors = [x for x in out.splitlines() if x.startswith("error:")]
    assert code == 2 and len(errors) == 1 and str(target) in errors[0] and "tokenizer" in errors[0], out
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    code, out = _cli_here(_cli_args(tmp_path / "s2.zarr", llama, str(empty)))
    assert code == 2 and f"error: {empty}: the data file holds no records" in out, out
    assert not (tmp_path / "s2.zarr").exists()



@pytest.mark.slow
@pytest.mark.parametrize("resume_stage", ["stage2", "stage1"])
def test_a_store_on_object_storage_survives_sigkill_resumes_elsewhere_and_trains(tmp_path, llama, object_server,
                                                                                monkeypatch, resume_stage):
    """--store s3://...: killed with -9 once the server holds commits, resumed from an empty staging
    directory (another machine) or from the killed run's own, thinned by eviction (the same machine),
    equal to an uninterrupted local run; inspect, verify and training read it by URL."""
    import obstore

    from cache_format.remote import open_bucket
    from train.config import TrainConfig
    from train.trainer import train

    monkeypatch.setenv("DRAFTCACHE_STORE_CACHE", str(tmp_path / "cache"))
    url, ref = object_server(), tmp_path / "ref.zarr"
    data = write_chats(tmp_path / "many.jsonl", 120, seed=1)
    ttl = ["--lease-ttl", "3"]  # pushes every 0.5 s; a killed writer's lease is free 3 s later
    p = _cli(_cli_args(url, llama, data, "--token-budget", "256", "--stage-dir", str(tmp_path / "stage1"), *ttl))
    bucket, deadline = open_bucket(url), time.time() + 120
    while time.time() < deadline and p.poll() is None:
        try:
            log = bytes(obstore.get(bucket, "commits/w00000.jsonl").bytes())
        except Exception:  # noqa: BLE001 - not pushed yet
            log = b""
        if log.count(b"\n") >= 3:
            p.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    p.wait()
    assert p.returncode == -signal.SIGKILL, "extraction finished before it could be killed"
    code, out = _cli_here(_cli_args(url, llama, data, "--stage-dir", str(tmp_path / resume_stage), *ttl, "--json"))
    assert code == 0, out
    summary = json.loads(out[out.index("{"):])
    assert summary["store"] == url and summary["already_committed"] > 0
    run(extract_cfg(ref, llama, data))
    assert_same_content(content(url), content(ref), exact=False)
    assert verify_store(url)["ok"]
    from click.testing import CliRunner

    from cache_format.__main__ import cli

    res = CliRunner().invoke(cli, ["inspect", url, "--json"])
    info = json.loads(res.output)
    assert res.exit_code == 0 and info["path"] == url and info["finalized"] and info["disk_bytes"] > 0
    out = train(TrainConfig(store=url, out=str(tmp_path / "run"), max_steps=4, token_budget=512, log_every=2,
                            val_samples=0, workers=1, cache_dir=str(tmp_path / "train-cache")))
    assert out["steps"] == 4
    fetched = [p for p in (tmp_path / "train-cache").rglob("*") if p.is_file() and "/hidden/c/" in p.as_posix()]
    assert fetched  # --cache-dir: the run's copy and its fetched shards went there
