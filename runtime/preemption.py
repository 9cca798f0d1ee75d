"""Preemption: SIGTERM and SIGINT noted instead of ending the process, so a loop stops at a point of
its choosing with its work saved (train at a log step, regeneration after a record). Shared by the
stages; schedulers preempt with SIGTERM."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import signal
import threading
import time

__all__ = ["Preemption", "from_the_start"]

# how long a signalled DataLoader worker waits for its main process to note the same signal. The
# main thread runs its handler only when it next runs Python: where the kernel gave the signal to
# another of its threads while it waits on the DataLoader's queue, that is when the queue's poll
# times out (5 s, torch's MP_STATUS_CHECK_INTERVAL), later still on a loaded machine
WORKER_GRACE_S = 20.0


class Preemption:
    """SIGTERM and SIGINT noted instead of killing the process, while the context is open: the loop
    stops at its next log step and saves a checkpoint (schedulers preempt with SIGTERM). A second
    signal of either kind ends the process at once, as the default would. Contexts nest: one opened
    inside another takes over a signal the outer one noted (a stage's command opens one before its
    imports, its run another around the work).

    `stopping` is shared with the DataLoader workers forked meanwhile (their `worker_init`): a
    worker signalled with the process group stays alive while the main process is stopping at a step
    boundary (it shuts the workers down then), and dies as usual otherwise (when the main process
    ends its workers itself, or is gone)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, enabled: bool = True) -> None:
        """enabled False: entering the context changes nothing (signals end the process as usual),
        so a caller that may or may not be preemptible opens the same context either way."""
        self.enabled = enabled
        self.signum: int | None = None
        self.stopping = multiprocessing.Value("b", 0, lock=False)
        self._old: dict[int, object] = {}
        self._outer: Preemption | None = None

    def _note(self, signum: int, _frame) -> None:
        if self.signum is not None:  # asked twice: go now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.signum = signum
        self.stopping.value = 1

    def requested(self) -> bool:
        """A signal was noted: the loop should stop at its next point of its choosing."""
        return self.signum is not None

    def __enter__(self) -> Preemption:
        # off the main thread Python sends no signals
        if self.enabled and threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                old = signal.getsignal(s)
                outer = getattr(old, "__self__", None)
                # one `stopping` for both: a worker forked now follows the
                if isinstance(outer, Preemption):
                    # outer one once this one is closed
                    self._outer, self.stopping = outer, outer.stopping
                    # noted while the stage started (its imports): stop at once
                    if outer.signum is not None:
                        self.signum, self.stopping.value = outer.signum, 1
                # a signal the launcher ignores stays ignored (a shell's background jobs ignore
                # SIGINT)
                if old is not signal.SIG_IGN:
                    self._old[s] = signal.signal(s, self._note)
        return self

    def __exit__(self, *exc) -> None:
        # workers still alive may now be ended by a signal, unless an outer context notes it instead
        self.stopping.value = int(self._outer is not None and self._outer.signum is not None)
        for s, old in self._old.items():
            signal.signal(s, old)

    @contextlib.contextmanager
    def forking(self):
        """Around the start of DataLoader workers (`iter(loader)`): SIGTERM and SIGINT held back in
        this thread, so a worker forked now starts with them held back too, until its
        `worker_init` has its handlers in place. torch's worker loop first installs a SIGTERM
        handler of its own (it dies at once unless its parent sent the signal), and a group signal
        that landed before `worker_init` killed the worker while the main process was stopping
        gracefully. A signal meanwhile waits, it is not lost."""
        if not self.enabled or threading.current_thread() is not threading.main_thread():
            yield
            return
        old = signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def worker_init(self, _worker_id: int) -> None:
        """A DataLoader worker's init: SIGTERM and SIGINT follow `stopping` (class docstring), then
        let through (held back since the fork, `forking`: one that came meanwhile arrives now)."""
        for s in self.SIGNALS:
            signal.signal(s, self._worker_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)

    def _worker_signal(self, signum: int, _frame) -> None:
        # the main process, signalled with the group, marks `stopping` when its main thread next
        # runs Python, which on a loaded machine may be seconds away: wait for it, then die if it
        # never came
        deadline = time.monotonic() + WORKER_GRACE_S
        while not self.stopping.value and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.stopping.value:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def from_the_start(fn):
    """A stage's command run inside a Preemption: a signal that comes while it imports and starts is
    noted, not a KeyboardInterrupt or a kill, and the run's own Preemption takes it over (the run
    stops at its first boundary and exits with the signal's code)."""

    @functools.wraps(fn)
    def noted(*args, **kwargs):
        with Preemption():
            return fn(*args, **kwargs)

    return noted
