"""Where a step's device time went: busy, idle waiting for the host, and how much of the
host's planning hid under device work. The executor records events around each step; these
turn them into numbers (`overlap bench` reports them as dev idle / plan ms / hidden)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class StepTiming:
    """Where one step's time went. `idle_in_step_s`: the device waited while the host read
    the produced ids and queued the catch-up; `idle_before_s`: it waited between this step's
    end and the next step's launch; `plan_s`: host time from this step's output to the next
    step's launch (scheduling, messaging, prepare), of which `hidden_s` ran while the device
    was still busy (this step's catch-up)."""

    step_id: int
    busy_s: float
    idle_in_step_s: float  # between the produced ids and the catch-up launch
    idle_before_s: float
    plan_s: float
    hidden_s: float


@dataclass
class TimingTotals:
    steps: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0
    plan_s: float = 0.0
    hidden_s: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=256))
    extra: dict = field(default_factory=dict)  # other counters (tensor-parallel traffic)

    def add(self, t: StepTiming) -> None:
        self.steps += 1
        self.busy_s += t.busy_s
        self.idle_s += t.idle_in_step_s + t.idle_before_s
        self.plan_s += t.plan_s
        self.hidden_s += t.hidden_s
        self.recent.append(t)

    def as_dict(self) -> dict:
        return {"timed_steps": self.steps, "device_busy_s": self.busy_s, "device_idle_s": self.idle_s,
                "plan_s": self.plan_s, "hidden_plan_s": self.hidden_s, **self.extra}
