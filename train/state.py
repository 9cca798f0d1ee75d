"""Where a training run is: the one place the loop's progress and its reason to stop live."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Preemption", "TrainState", "any_rank", "any_rank_past"]

STOPS = ("", "steps", "time limit", "patience", "signal")


@dataclass
class TrainState:
    """Steps done, the position to go on from, and why the run stops ("" while it goes on).

    A checkpoint saves (epoch, in_epoch): a resumed run starts that epoch at that step. The stop
    reason is set by the loop (its last step, --time-limit, --patience, SIGTERM or SIGINT) and read by
    `fit`'s summary;
    the learning-rate schedule's length never changes with it.
    """

    step: int = 0
    epoch: int = 0
    """The epoch to go on in (the one of the step just done, or the next one after its last step)."""
    in_epoch: int = 0
    """Steps of `epoch` already done: a resume skips them."""
    stop: str = ""

    def stopping(self, reason: str) -> None:
        if reason not in STOPS[1:]:
            raise ValueError(f"unknown stop reason {reason!r}")
        self.stop = self.stop or reason  # the first reason is the one reported


def any_rank(flag: bool, device: torch.device, world: int) -> bool:
    """Whether `flag` holds on any rank (every rank calls this at the same step, so all stop alike)."""
    t = torch.tensor([float(flag)], device=device)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def any_rank_past(deadline: float, device: torch.device, world: int) -> bool:
    """Whether any rank is past `deadline` (time.time()): every rank must stop at the same step."""
    return any_rank(time.time() > deadline, device, world)


class Preemption:
    """SIGTERM and SIGINT noted instead of killing the process, while the context is open: the loop
    stops at its next log step and saves a checkpoint (schedulers preempt with SIGTERM). A second
    signal of either kind ends the process at once, as the default would.

    `stopping` is shared with the DataLoader workers forked meanwhile (their `worker_init`): a worker
    signalled with the process group stays alive while the main process is stopping at a step
    boundary (it shuts the workers down then), and dies as usual otherwise (when the main process
    ends its workers itself, or is gone)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.stopping = multiprocessing.Value("b", 0, lock=False)
        self._old: dict[int, object] = {}

    def _note(self, signum: int, _frame) -> None:
        if self.signum is not None:  # asked twice: go now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.signum = signum
        self.stopping.value = 1

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():  # elsewhere Python sends no signals
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._note)
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.value = 0  # workers still alive at exit may now be ended by a signal
        for s, old in self._old.items():
            signal.signal(s, old)

    def worker_init(self, _worker_id: int) -> None:
        """A DataLoader worker's init: SIGTERM and SIGINT follow `stopping` (class docstring)."""
        for s in self.SIGNALS:
            signal.signal(s, self._worker_signal)

    def _worker_signal(self, signum: int, _frame) -> None:
        time.sleep(0.2)  # the main process, signalled with the group, marks `stopping` first
        if not self.stopping.value:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
