"""A plain progress counter on stderr for the commands that run longer than a few seconds.

On a terminal one line is redrawn in place (``[12/789] name  last item  1m05s``); in a log
(stderr not a terminal) a line is printed every :data:`LOG_EVERY` steps and at the end, so
CI output shows progress without one line per step.
"""

from __future__ import annotations

import sys
import time

#: Steps between two progress lines when stderr is not a terminal.
LOG_EVERY = 25


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Progress:
    """Counts ``total`` steps of a job called ``label`` on ``stream`` (default stderr)."""

    def __init__(self, total: int, label: str, stream=None):
        self.total, self.label, self.done = total, label, 0
        self.stream = sys.stderr if stream is None else stream
        self.start = time.perf_counter()
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self._width = 0

    def step(self, item: str = "") -> None:
        """One more step done; ``item`` names it."""
        self.done += 1
        line = f"[{self.done}/{self.total}] {self.label}  {item}  {_clock(time.perf_counter() - self.start)}"
        if self.live:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = max(self._width, len(line))
        elif self.done % LOG_EVERY == 0 or self.done == self.total:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the redrawn line (on a terminal)."""
        if self.live and self.done:
            self.stream.write("\n")
            self.stream.flush()
