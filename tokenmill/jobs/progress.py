"""The live progress bar: requests done / total, output tokens/s, ETA."""

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


class JobProgress:
    """`completed` counts the whole job (earlier runs included) so a resumed bar starts part-full."""

    def __init__(self, total: int, done_before: int, console: Console, enabled: bool = True) -> None:
        columns = (
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[speed]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        )
        self._bar = Progress(*columns, console=console, disable=not enabled, transient=False)
        self._task = self._bar.add_task("run", total=total, completed=done_before, speed="")
        self._start = time.monotonic()
        self._completion_tokens = 0

    def __enter__(self) -> JobProgress:
        self._start = time.monotonic()
        self._bar.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._bar.stop()

    def advance(self, completion_tokens: int = 0) -> None:
        self._completion_tokens += completion_tokens
        elapsed = max(time.monotonic() - self._start, 1e-9)
        self._bar.update(self._task, advance=1, speed=f"{self._completion_tokens / elapsed:,.1f} out tok/s")
