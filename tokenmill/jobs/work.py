"""What a run has to do: the input stream less what earlier runs finished, as the backend pulls it.

`JobWork.requests()` reads the input as the backend asks for requests (lines done in an earlier
run are skipped by the done-index without being parsed), writes each bad line to the errors
file as it is reached, and counts what the summary reports. `--strict` and length buckets need
the whole file first; `checked_first` and `ordered` do that pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rich.console import Console

from tokenmill.jobs.errors import JobError
from tokenmill.jobs.input.reader import DoneLines, InputStream, read_input
from tokenmill.jobs.input.request import BatchRequest, Entry, InputError
from tokenmill.jobs.journal.rows import input_error_row
from tokenmill.jobs.journal.state import OutputState
from tokenmill.jobs.journal.writers import RowWriter
from tokenmill.jobs.progress import say

MAX_LISTED_ERRORS = 20


@dataclass
class InputCounts:
    """The input as far as this run read it (all of it, unless the run was stopped)."""

    records: int = 0  # requests read: good lines and bad, done ones too
    invalid: int = 0  # bad lines
    structured: int = 0  # good lines read (not skipped as done) asking for a structured output
    max_tokens_defaulted: int = 0  # … giving no max_tokens
    failed_before: int = 0  # good lines with a final error from an earlier run
    done_unindexed: int = 0  # good lines done in rows the done-index does not describe (OutputState.unindexed)
    structured_cut_unindexed: int = 0  # … asking for a structured output that max_tokens ended
    read_to_end: bool = False


class JobWork:
    def __init__(
        self, stream: InputStream, state: OutputState, errors: RowWriter, console: Console,
        advance: Callable[[], None] = lambda: None,
    ) -> None:
        self.stream, self.state, self.errors, self.console = stream, state, errors, console
        self.counts = InputCounts()
        self.advance = advance  # the progress bar, for a bad line newly recorded
        stream.seen.seed(state.seen_keys, state.seen_lines)  # done lines are not read, but their ids are taken

    def requests(self) -> Iterator[BatchRequest]:
        """The requests to run, in input order, as the backend pulls them."""
        done = DoneLines(self.state.done_lines) if self.state.done_lines.any() else None
        for item in self.stream.read(done):
            if isinstance(item, InputError):
                self.bad_line(item)
            elif self.to_run(item[1]):
                yield item[1]
        self.counts.records, self.counts.read_to_end = self.stream.records, True

    def ordered(self, order: Callable[[list[Entry]], list[Entry]]) -> Iterator[BatchRequest]:
        """The requests to run in the order `order` puts their entries (a whole pass first)."""
        spec = read_input(self.stream.path, self.stream.options, self.stream.format, self.stream.check)
        for error in spec.errors:
            self.bad_line(error)
        self.counts.records, self.counts.read_to_end = spec.num_lines, True
        todo = []
        for entry in spec.entries:
            if self.state.finished(entry.line):
                continue  # done in the index: counted by the state; a final error: counted below
            self.counts.structured += entry.structured
            self.counts.max_tokens_defaulted += entry.max_tokens_defaulted
            if entry.line in self.state.failed_lines:
                self.counts.failed_before += 1
            elif (ended := self.state.unindexed.get(entry.custom_id)) is not None:
                self.counts.done_unindexed += 1
                self.counts.structured_cut_unindexed += ended and entry.structured
            else:
                todo.append(entry)
        return spec.requests(order(todo))

    def to_run(self, request: BatchRequest) -> bool:
        self.counts.structured += request.structured
        self.counts.max_tokens_defaulted += request.max_tokens_defaulted
        if request.line in self.state.failed_lines:
            self.counts.failed_before += 1
            return False
        ended = self.state.unindexed.get(request.custom_id)
        if ended is None:
            return True
        self.counts.done_unindexed += 1
        self.counts.structured_cut_unindexed += ended and request.structured
        return False

    def bad_line(self, error: InputError) -> None:
        self.counts.invalid += 1
        if error.line in self.state.invalid_lines:
            return  # recorded by an earlier run
        self.errors.write(input_error_row(error))
        self.advance()
        if self.counts.invalid <= MAX_LISTED_ERRORS:
            say(self.console, f"bad line → errors file: {error.message}")
        elif self.counts.invalid == MAX_LISTED_ERRORS + 1:
            say(self.console, "more bad lines: see the errors file")


def check_every_line(stream: InputStream) -> None:
    """`--strict`: read the whole input first, and refuse the job (touching no output) if any line
    is bad."""
    errors = [item for item in InputStream(stream.path, stream.options, stream.format, stream.check).read()
              if isinstance(item, InputError)]
    if errors:
        listed = "\n".join(f"  {e.message}" for e in errors[:MAX_LISTED_ERRORS])
        more = len(errors) - MAX_LISTED_ERRORS
        raise JobError(
            f"{stream.path}: {len(errors)} bad line(s), nothing was run (--strict):\n{listed}"
            + (f"\n  … and {more} more" if more > 0 else "")
        )

