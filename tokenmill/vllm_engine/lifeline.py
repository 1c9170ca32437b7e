"""vLLM's engine processes die with the tokenmill process that started them.

vLLM runs its engine in a child process (`EngineCore`, which may start `Worker`s of its own). It
stops them when tokenmill exits or is told to stop, but a `kill -9` of tokenmill alone (the OOM
killer, a scheduler's `kill PID`, a container runtime's process-level kill) runs none of that:
the engine is re-parented to PID 1 and holds its memory (GBs) and its cores until killed by hand.
vLLM's Workers already exit when their EngineCore dies (a pipe from it); nothing ties EngineCore
to its own parent. This module does, from inside the child:

- `tie_engine_processes_to_this_one()`, called in the parent before vLLM starts its engine, swaps
  EngineCore's entry point (`EngineCoreProc.run_engine_core`, the process target) for
  `run_engine_core_tied`. A spawned child unpickles that target by its module and name, so it runs
  ours; a forked one inherits the swap. Either way it first starts `watch_parent`, then vLLM's own.
- `watch_parent()`: a daemon thread that looks at the parent pid twice a second. Once it changes
  (the parent is gone: the process was re-parented), it SIGKILLs every process below this one and
  then this one. Nobody is left to read the engine's outputs, so nothing graceful is owed.

Polling the parent, rather than `PR_SET_PDEATHSIG`: the kernel sends that signal when the *thread*
that started the child exits, and tokenmill may load an engine from a thread that ends before the
process does (a Ray actor's call, a test); the parent pid changes only when the process is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PARENT_POLL_S = 0.5  # how soon an orphaned engine notices: well within the "few seconds" asked
_original_run_engine_core: Callable[..., Any] | None = None  # vLLM's, once swapped (a forked child sees it)


def tie_engine_processes_to_this_one() -> bool:
    """Make the engine processes vLLM starts from now on exit when this process dies. Idempotent;
    False when this vLLM has no `EngineCoreProc.run_engine_core` to wrap (its engine then lives as
    vLLM leaves it, and the caller may say so)."""
    global _original_run_engine_core
    try:
        from vllm.v1.engine.core import EngineCoreProc  # type: ignore[import-not-found]
    except ImportError:
        return False
    current = EngineCoreProc.__dict__.get("run_engine_core")
    if not isinstance(current, staticmethod):
        return False
    if current.__func__ is not run_engine_core_tied:
        _original_run_engine_core = current.__func__
        EngineCoreProc.run_engine_core = staticmethod(run_engine_core_tied)
    return True


def run_engine_core_tied(*args: Any, **kwargs: Any) -> Any:
    """EngineCore's process target: watch the parent, then run vLLM's own."""
    watch_parent()
    original = _original_run_engine_core
    if original is None:  # spawned: a fresh interpreter, where vLLM's class was never swapped
        from vllm.v1.engine.core import EngineCoreProc

        original = EngineCoreProc.run_engine_core
    return original(*args, **kwargs)


def watch_parent(poll_s: float = PARENT_POLL_S) -> threading.Thread:
    """Start the thread that ends this process, and every process below it, once its parent is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        kill_tree(os.getpid())

    thread = threading.Thread(target=watch, name="tokenmill-parent-watch", daemon=True)
    thread.start()
    return thread


def kill_tree(root: int) -> None:
    """SIGKILL every descendant of `root` (deepest first: none is re-parented out of reach), then `root`."""
    for pid in reversed(descendants(root)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    os.kill(root, signal.SIGKILL)


def descendants(root: int) -> list[int]:
    """The processes below `root`, parents before their children, read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid …": comm may hold spaces and parentheses, so split after the last ')'.
            text = stat.read_text()
        except OSError:  # ended since the listing
            continue
        fields = text[text.rindex(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop(0)
        below = children.get(pid, [])
        found.extend(below)
        frontier.extend(below)
    return found
