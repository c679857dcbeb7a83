"""Threads chosen again as the run trains (a single process on a CPU, the count not named).

At start-up the run keeps the thread count whose step was fastest then (training/sizing.py). The machine may
change after that: another program takes a core, and on a 2-core machine two threads then run several times
slower than one. So the run watches its steps. When the latest WATCHED run SLOWER times slower than the fastest
it has seen at this count, it takes its next steps at each count in turns, TRIAL_STEPS at each, and keeps the
fastest. The steps timed are the run's own: nothing is thrown away."""

import statistics
import time
from collections import deque
from collections.abc import Callable

import torch

SLOWER = 1.5  # steps this many times slower than the fastest seen at the count make the run time the counts again
WATCHED = 10  # the latest steps whose median is watched
TRIAL_STEPS = 3  # steps timed at each count in a trial; the median counts
step_timer = time.perf_counter  # what a step is timed with (a test's stand-in replaces it)


class ThreadChoice:
    """The thread count of a run's steps, chosen again when they slow down."""

    def __init__(self, threads: int, counts: list[int]):
        """threads: the count chosen at start-up; counts: every count worth timing here."""
        self.threads, self.counts = threads, counts
        self.latest = deque(maxlen=WATCHED)  # seconds of the latest steps at this count
        self.fastest = None  # the least median of WATCHED steps seen at this count
        self.trial = []  # the counts the next steps take, in turns, while the counts are timed
        self.timed = {}  # count -> seconds of its steps in the trial

    def take(self, step: Callable[[], None]) -> tuple[int, str | None]:
        """Run `step` at the count that is fastest now, timed: the count it ran at, and a line to print if the
        count changed after it, else None."""
        if self.trial:
            torch.set_num_threads(self.trial[0])
        threads, started = torch.get_num_threads(), step_timer()
        step()
        seconds = step_timer() - started
        if self.trial:
            self.timed.setdefault(self.trial.pop(0), []).append(seconds)
            return threads, None if self.trial else self.choose()
        self.latest.append(seconds)
        if len(self.latest) == WATCHED:
            median = statistics.median(self.latest)
            self.fastest = median if self.fastest is None else min(self.fastest, median)
            if median > SLOWER * self.fastest:
                self.trial = [n for _ in range(TRIAL_STEPS) for n in self.counts]
                self.timed = {}
        return threads, None

    def choose(self) -> str | None:
        """Keep the count whose steps were fastest in the trial."""
        seconds = {n: statistics.median(times) for n, times in self.timed.items()}
        before, slow = self.threads, statistics.median(self.latest)
        self.threads = min(seconds, key=seconds.get)
        torch.set_num_threads(self.threads)
        self.latest.clear()
        self.fastest = None  # the machine has changed: the next steps set the pace to watch
        if self.threads == before:
            return None
        return (f"threads: {self.threads} from now on, not {before}: steps at {before} slowed to {slow:.3g} s, over "
                f"{SLOWER:g}x their fastest, as when another program takes a core; timed again: {timings(seconds)}")


def timings(seconds: dict[int, float]) -> str:
    """Each thread count's seconds a step, in words."""
    return ", ".join(f"{n} thread{'s' * (n > 1)} took {s:.3g} s a step" for n, s in seconds.items())

