"""Where a training run is: the one place the loop's progress and its reason to stop live."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from runtime.world import any_rank

__all__ = ["HeldOut", "ScheduleClock", "TrainState", "any_rank_past"]

STOPS = ("", "steps", "time limit", "patience", "signal")


@dataclass
class TrainState:
    """Steps done, the position to go on from, and why the run stops ("" while it goes on).

    A checkpoint saves (epoch, in_epoch): a resumed run starts that epoch at that step. The stop
    reason is set by the loop (its last step, --time-limit, --patience, SIGTERM or SIGINT) and read
    by `fit`'s summary; the learning-rate schedule's length never changes with it (with
    --schedule-seconds the planned steps do: ScheduleClock).
    """

    step: int = 0
    epoch: int = 0
    """The epoch to go on in (the one of the step just done, or the next one after its last
    step)."""
    in_epoch: int = 0
    """Steps of `epoch` already done: a resume skips them."""
    planned: int = 0
    """--schedule-seconds: the steps the run had planned at its checkpoint (0: none). A resumed run
    follows that plan until it has measured its own step rate, not the --max-steps cap."""
    pause_s: float = 0.0
    """The longest held-out pass + checkpoint of the run so far (its checkpoint's): the room kept
    before --time-limit and for the closing pass, known to a resumed process before its own first
    pass (0: none yet)."""
    pass_s: float = 0.0
    """The latest held-out pass + checkpoint (its checkpoint's): what --schedule-seconds plans for
    each pass to come. Not the longest: a run's first pass pays one-time costs the steady ones do
    not, and planning every pass at it shrinks the plan, which then creeps back pass by pass."""
    stop: str = ""

    def paused(self, seconds: float, held_out: bool) -> None:
        """A held-out pass and/or checkpoint took `seconds`: the longest so far, the latest pass."""
        self.pause_s = max(self.pause_s, seconds)
        if held_out:
            self.pass_s = seconds

    def stopping(self, reason: str) -> None:
        if reason not in STOPS[1:]:
            raise ValueError(f"unknown stop reason {reason!r}")
        self.stop = self.stop or reason  # the first reason is the one reported


@dataclass
class HeldOut:
    """The held-out set a rank evaluates (`ds` None: none) and the best score so far by the figure
    `by` (train.start.best_by); `stale` counts the evaluations since it (--patience)."""

    ds: Any
    groups: dict[str, torch.Tensor]
    by: str
    best: float = float("-inf")
    stale: int = 0

    def note(self, score: float) -> bool:
        """Count one evaluation of `score`; whether it is a new best."""
        self.stale += 1
        if score > self.best:
            self.best, self.stale = score, 0
            return True
        return False


@dataclass
class ScheduleClock:
    """--schedule-seconds: the step rate a run's steps are planned from. `cap`: the steps by
    --max-steps or the epochs; `mark`: (time, step, paused seconds) at the first metrics row, whose
    steps held the compilation; `paused`: the held-out passes' and checkpoints' seconds so far."""

    cap: int
    mark: tuple[float, int, float] | None = None
    paused: float = 0.0

    def step_seconds(self, now: float, step: int) -> float | None:
        """Seconds a training step has taken since the mark, pauses left out; None at the first
        row (which sets the mark) and until a step after it."""
        if self.mark is None:
            self.mark = (now, step, self.paused)
            return None
        t0, s0, p0 = self.mark
        return (now - t0 - (self.paused - p0)) / (step - s0) if step > s0 else None


def any_rank_past(deadline: float, device: torch.device, world: int) -> bool:
    """Whether any rank is past `deadline` (time.time()): every rank must stop at the same step."""
    return any_rank(time.time() > deadline, device, world)
