"""runtime.preemption: signals noted while the context is open, the earlier handlers back after it,
and a signal the launcher ignores left ignored."""

from __future__ import annotations

import os
import signal

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
