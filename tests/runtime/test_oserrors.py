"""runtime.oserrors: a failed write names its file and its cause, whatever library raised it."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple

import pytest
import torch

from runtime.oserrors import write_failure


@pytest.mark.parametrize("code,cause", [(errno.ENOSPC, "no space left on its device"),
                                        (errno.EFBIG, "file too large"), (errno.EDQUOT, "disk quota exceeded")])
def test_an_errno_anywhere_in_the_chain_names_the_cause_and_the_file(tmp_path, code, cause):
    try:
        try:
            raise OSError(code, "low level")
        except OSError as inner:
            raise RuntimeError("a library's own words") from inner
    except RuntimeError as e:
        got = write_failure(e, tmp_path / "out.jsonl")
    assert got.startswith(f"{tmp_path / 'out.jsonl'}: {cause}") and "\n" not in got


def test_an_errorless_failure_on_a_full_device_reads_as_no_space(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10, 10, 0))
    got = write_failure(RuntimeError("[enforce fail at inline_container.cc] unexpected pos 1234"), tmp_path / "x")
    assert got == f"{tmp_path / 'x'}: no space left on its device (0 MiB free)"
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10, 0, 2**40))
    assert write_failure(RuntimeError("something  else\nhappened"), tmp_path / "x") == f"{tmp_path / 'x'}: something else happened"


def test_a_checkpoint_on_a_full_disk_says_so_and_leaves_the_earlier_ones(tmp_path, monkeypatch):
    import train.checkpoint as ck

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    ck.save_checkpoint(tmp_path, 1, model=model, optimizer=opt, scheduler=sched, state={"step": 1}, keep=3)

    def full(*a, **k):  # torch's zip writer on a full disk: no errno, its own words
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4736 vs 4630")

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(ck.torch, "save", full)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10, 10, 1024))
    with pytest.raises(ValueError, match=r"step-2: no space left on its device .*earlier checkpoints are "
                                         r"untouched"):
        ck.save_checkpoint(tmp_path, 2, model=model, optimizer=opt, scheduler=sched, state={"step": 2}, keep=3)
    assert ck.latest_checkpoint(tmp_path).name == "step-1"
