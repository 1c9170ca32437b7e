"""The live progress bar: requests done / total, output tokens/s (input tokens/s where nothing is
generated: an embedding job), ETA."""

from __future__ import annotations

import time
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

UPDATE_EVERY_S = 0.05


class JobProgress:
    """`completed` counts the whole job (earlier runs included) so a resumed bar starts part-full."""

    def __init__(self, total: int | None, done_before: int, console: Console, enabled: bool = True) -> None:
        """`total` None: not known yet (the input is counted on the side; `set_total`)."""
        columns = (
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[speed]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        )
        self._bar = Progress(*columns, console=console, disable=not enabled, transient=False)
        self._task = self._bar.add_task("run", total=total, completed=done_before, speed="")
        self._start = self._updated = time.monotonic()
        self._completion_tokens = self._prompt_tokens = self._pending = 0

    def __enter__(self) -> JobProgress:
        self._start = time.monotonic()
        self._bar.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._update(time.monotonic())
        self._bar.stop()

    def set_total(self, total: int) -> None:
        self._bar.update(self._task, total=total)

    def advance(self, completion_tokens: int = 0, prompt_tokens: int = 0) -> None:
        """One request finished. The bar itself is updated at most every `UPDATE_EVERY_S`: at
        thousands of requests a second, drawing each would cost more than sending it."""
        self._completion_tokens += completion_tokens
        self._prompt_tokens += prompt_tokens
        self._pending += 1
        now = time.monotonic()
        if now - self._updated >= UPDATE_EVERY_S:
            self._update(now)

    def _update(self, now: float) -> None:
        elapsed = max(now - self._start, 1e-9)
        if self._completion_tokens or not self._prompt_tokens:
            speed = f"{self._completion_tokens / elapsed:,.1f} out tok/s"
        else:
            speed = f"{self._prompt_tokens / elapsed:,.1f} in tok/s"
        self._bar.update(self._task, advance=self._pending, speed=speed)
        self._pending, self._updated = 0, now


def say(console: Console, text: str) -> None:
    """A line for the user, printed as written (no rich markup: paths and ids hold brackets)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)
