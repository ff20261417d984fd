"""The accumulation window: the calls of ParallelTrainer.step whose gradients add up before one
optimizer step (accumulation_steps calls; one without accumulation)."""
from __future__ import annotations

from typing import Any, Dict

__all__ = ["AccumulationWindow"]


class AccumulationWindow:
    """calls, samples: what the open window gathered so far (0 between windows).

    clean: every gradient set but the master's is zero. The merge kernel leaves them so; a call that
    fails before its merge leaves them dirty, and the next window then starts by zeroing them all,
    so a caught error leaks nothing into the next step.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.calls = self.samples = 0
        self.clean = True

    @property
    def open(self) -> bool:
        return self.calls > 0

    def begin_call(self) -> None:
        self.clean = False

    def add(self, samples: int) -> bool:
        """A call finished its forward and backward: True when it fills the window."""
        self.calls += 1
        self.samples += samples
        return self.calls == self.size

    def merged(self) -> None:
        """The window's gradients were merged (and the other sets zeroed): the next call opens a new one."""
        self.calls = self.samples = 0
        self.clean = True

    def drop(self) -> int:
        """Forget the open window (a failed call, or compute_gradients); returns the calls it had."""
        calls, self.calls, self.samples = self.calls, 0, 0
        return calls

    def state_dict(self) -> Dict[str, Any]:
        return {"micro_step": self.calls, "window_samples": self.samples}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        calls = int(state.get("micro_step", 0))
        if calls >= self.size:
            raise ValueError(f"load_state_dict: the state is {calls} call(s) into an accumulation window, but this "
                             f"trainer steps every {self.size}")
        self.calls, self.samples = calls, int(state.get("window_samples", 0))
