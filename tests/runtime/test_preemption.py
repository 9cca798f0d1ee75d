"""runtime.preemption: signals noted while the context is open, the earlier handlers back after it,
and a signal the launcher ignores left ignored."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from runtime.preemption import Preemption


def test_a_signal_is_noted_inside_and_the_old_handlers_return_after():
    before = signal.getsignal(signal.SIGTERM)
    with Preemption() as p:
        os.kill(os.getpid(), signal.SIGTERM)
        assert p.requested() and p.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_an_ignored_signal_stays_ignored():
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with Preemption() as p:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            assert not p.requested()
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the other one is noted
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_context_opened_inside_takes_over_a_signal_the_outer_one_noted():
    with Preemption() as outer:
        os.kill(os.getpid(), signal.SIGTERM)  # while the stage imports
        with Preemption() as inner:  # the run's own
            assert inner.requested() and inner.signum == signal.SIGTERM
        assert outer.requested()
    with Preemption(), Preemption() as quiet:
        assert not quiet.requested()


def test_workers_follow_the_outer_context_once_the_inner_one_is_closed():
    with Preemption() as outer:
        with Preemption() as inner:
            assert inner.stopping is outer.stopping and not inner.stopping.value
        os.kill(os.getpid(), signal.SIGINT)  # after the run: the command is closing, its workers must not die
        assert outer.requested() and inner.stopping.value == 1
    with Preemption() as alone:
        os.kill(os.getpid(), signal.SIGTERM)
        assert alone.stopping.value == 1
    assert alone.stopping.value == 0  # closed with no outer one: a later signal ends the workers as usual


def test_a_signalled_worker_outlives_the_longest_wait_of_its_main_process_and_then_goes_on():
    # the main process notes a group signal only when its main thread next runs Python: where the
    # signal lands on another of its threads while it waits on the DataLoader's queue, that is the
    # queue's poll interval later. A worker signalled with it must still be alive then.
    import multiprocessing
    import time

    from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL

    def worker(p: Preemption, done) -> None:
        p.worker_init(0)
        os.kill(os.getpid(), signal.SIGTERM)  # returns once the main process marks `stopping`
        done.value = 1

    fork = multiprocessing.get_context("fork")
    with Preemption() as p:
        done = fork.Value("b", 0, lock=False)
        child = fork.Process(target=worker, args=(p, done))
        child.start()
        time.sleep(MP_STATUS_CHECK_INTERVAL + 0.5)  # the main process, late
        p.stopping.value = 1
        child.join(timeout=30)
    assert child.exitcode == 0 and done.value == 1


def _worker_signalled_before_its_init(p: Preemption, done) -> None:
    import torch

    torch._C._set_worker_signal_handlers()  # what torch's worker loop installs before worker_init
    os.kill(os.getpid(), signal.SIGTERM)  # the group's signal, before the worker's init
    p.worker_init(0)
    # let through and taken by worker_init's handler (which returned once `stopping` was marked)
    taken = signal.SIGTERM not in signal.sigpending() | signal.pthread_sigmask(signal.SIG_BLOCK, [])
    done.value = 1 if taken else 2


@pytest.mark.parametrize("held_back", [True, False])
def test_a_worker_signalled_before_its_init_outlives_it_where_the_fork_held_signals_back(held_back):
    # torch's worker loop installs its own SIGTERM handler (death unless its parent sent it) before
    # worker_init: a group SIGTERM in that window killed the worker during a graceful stop.
    # Forked under `forking`, the signal waits for worker_init's handlers; forked without, the
    # worker dies of it (the window is real)
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    with Preemption() as p:
        done = fork.Value("b", 0, lock=False)
        child = fork.Process(target=_worker_signalled_before_its_init, args=(p, done))
        with p.forking() if held_back else contextlib.nullcontext():
            child.start()
        assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # restored here
        p.stopping.value = 1  # the main process noted the signal
        child.join(timeout=30)
    assert (child.exitcode, done.value) == ((0, 1) if held_back else (-signal.SIGTERM, 0))
