"""The PNG: a classic roofline of the decode steps, and tokens/s ceilings against batch size.

matplotlib is imported here only, so planning without ``--plot`` does not need it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import PlanError
from .measured import Measured
from .roofline import Plan, decode_step, make_setup, plan_point, prefill

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def _batch_grid(plan: Plan) -> list[int]:
    top = max(max(plan.config.batch_sizes), plan.memory.max_batch, 2) * 2
    grid, b = [], 1.0
    while b <= top:
        grid.append(int(b))
        b *= 1.25
    return sorted(set(grid))


def save_plot(plan: Plan, path: str | Path, measured: Measured | None = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlanError("plot", "needs matplotlib (pip install matplotlib)") from None
    s = make_setup(plan.model, plan.hardware, plan.config)
    fig, (roof, tps) = plt.subplots(1, 2, figsize=(13, 5.2))
    _roofline_panel(roof, plan)
    grid = _batch_grid(plan)
    points = [plan_point(s, b, plan.memory.max_batch) for b in grid]
    tps.plot(grid, [p.decode_tokens_per_s for p in points], label="decode ceiling")
    tps.plot(grid, [p.e2e_overlap_tokens_per_s for p in points], ":",
             label="e2e ceiling, prefill overlapped")
    tps.plot(grid, [p.e2e_tokens_per_s for p in points], "--",
             label="e2e ceiling, prefill then decode")
    if plan.memory.max_batch:
        tps.axvline(plan.memory.max_batch, color="red", lw=1,
                    label=f"largest batch that fits ({plan.memory.max_batch})")
    if measured:
        tps.plot([m.batch_size for m in measured.points],
                 [m.output_tokens_per_s for m in measured.points], "ko", label="measured output")
    tps.set(xscale="log", yscale="log", xlabel="batch size (concurrent requests)",
            ylabel="output tokens/s (all devices)", title="Throughput ceilings")
    tps.grid(True, which="both", alpha=0.3)
    tps.legend(fontsize=8)
    c = plan.config
    fig.suptitle(f"{plan.model.name} on {c.num_devices}x{plan.hardware.name} (TP {c.tp}), "
                 f"{c.weight_dtype} weights, {c.input_len}+{c.output_len} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _roofline_panel(ax: Axes, plan: Plan) -> None:
    """Attainable FLOP/s = min(peak, intensity x bandwidth) for one replica, with the decode
    step of every planned batch size and the prefill of the largest one placed on it."""
    s = make_setup(plan.model, plan.hardware, plan.config)
    ridge = s.peak_flops / s.bandwidth
    marks = [(f"decode B={b}", "o", decode_step(s, math.ceil(b / s.replicas)))
             for b in plan.config.batch_sizes]
    pre = prefill(s, math.ceil(max(plan.config.batch_sizes) / s.replicas))
    if pre.seconds:
        marks.append(("prefill (largest B)", "s", pre))
    lo = min([ridge, *(m.flops / m.bytes for _, _, m in marks)]) / 4
    hi = max([ridge, *(m.flops / m.bytes for _, _, m in marks)]) * 4
    xs = [lo * (hi / lo) ** (k / 64) for k in range(65)] + [ridge]
    xs.sort()
    ax.plot(xs, [min(s.peak_flops, x * s.bandwidth) for x in xs], "k-", label="roof")
    for label, marker, m in marks:
        ax.plot(m.flops / m.bytes, m.flops / m.seconds, marker, label=label)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)",
           ylabel="FLOP/s per replica", title=f"Roofline (ridge {ridge:.0f} FLOP/byte)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
