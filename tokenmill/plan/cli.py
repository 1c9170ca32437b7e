"""``tokenmill plan``: argument parsing and the top-level flow; the work is elsewhere."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from tokenmill.environment import PathError, writable_file

from .catalog import THIS_MACHINE, get_hardware
from .dtypes import KV_DTYPES, WEIGHT_DTYPES
from .errors import PlanError
from .measured import Measured, efficiencies, load_measured
from .model_specs import load_model
from .price import FLAG_HELP as PRICE_HELP
from .price import price_per_hour_arg
from .report import (
    hardware_table,
    models_table,
    plan_json,
    print_plan,
    print_study,
    study_json,
    study_markdown,
    write_json,
)
from .roofline import PlanConfig, make_plan
from .study import IMPLIED_HARDWARE, check_study, load_study

DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN = 2048, 512
EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT = 1, 2


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers like 1,8,32,64, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", help="preset name, config.json, folder, or .gguf "
        "(default: the embedded SmolLM2-135M GGUF)")
    add("--hardware", help=f"catalog name or {THIS_MACHINE} (measured now; the default). "
        "With --study: the GPU type to check against")
    add("--num-devices", type=int, default=1, help="devices in total (default 1)")
    add("--tp", type=int, help="tensor-parallel size; num-devices/tp data-parallel replicas "
        "(default: num-devices)")
    add("--weight-dtype", choices=WEIGHT_DTYPES,
        help="default: the checkpoint's own (bf16; fp8 for DeepSeek-V3; native for GGUF)")
    add("--kv-dtype", choices=KV_DTYPES, default="bf16", help="KV-cache dtype (default bf16)")
    add("--input-len", type=int, help=f"prompt tokens per request (default {DEFAULT_INPUT_LEN})")
    add("--output-len", type=int,
        help=f"generated tokens per request (default {DEFAULT_OUTPUT_LEN})")
    add("--batch-sizes", type=_batch_sizes, default=(1, 8, 32, 64),
        help="comma-separated concurrent requests (default 1,8,32,64)")
    add("--price-per-hour", type=price_per_hour_arg, help=f"per device (default: the --hardware's catalog price; "
        f"0 for {THIS_MACHINE}): {PRICE_HELP}")
    add("--reserve-fraction", type=float, default=0.10,
        help="memory kept free for activations and runtime (default 0.10)")
    add("--measured", metavar="FILE", help="bench JSON: report measured / ceiling")
    add("--json", metavar="OUT", help="write the plan (or study check) as JSON")
    add("--plot", metavar="OUT.png", help="write a roofline + throughput PNG")
    add("--list-models", action="store_true", help="list model presets")
    add("--list-hardware", action="store_true", help="list the hardware catalog")
    add("--study", action="store_true", help="check the published batch study")
    add("--markdown", action="store_true", help="with --study: print Markdown (for the docs)")
    add("--study-file", metavar="PATH",
        help="the study Markdown (default: the copy shipped with tokenmill)")


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        _check_paths(args)
        if args.list_models or args.list_hardware:
            if args.list_models:
                console.print(models_table())
            if args.list_hardware:
                console.print(hardware_table())
            return 0
        return _run_study(args, console) if args.study else _run_plan(args, console)
    except (PlanError, PathError) as exc:
        print(f"tokenmill plan: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _check_paths(args: argparse.Namespace) -> None:
    """The files plan writes, before any work (environment.PathError); the files it reads
    (--measured, --study-file) say what is wrong with them where they are read."""
    for flag, given in (("--json", args.json), ("--plot", args.plot)):
        if given:
            writable_file(Path(given), flag)


def _run_study(args: argparse.Namespace, console: Console) -> int:
    hardware: tuple[str, ...] = IMPLIED_HARDWARE
    if args.hardware:
        if args.hardware.lower() == THIS_MACHINE:
            raise PlanError("hardware", "the study check needs catalog hardware")
        get_hardware(args.hardware)  # validates the name
        hardware = (args.hardware.lower(),)
    check = check_study(load_study(args.study_file), hardware)
    if args.markdown:
        print(study_markdown(check), end="")
    else:
        print_study(check, console)
    if args.json:
        write_json(study_json(check), args.json)
    return 0


def _config(args: argparse.Namespace, measured: Measured | None) -> PlanConfig:
    """CLI values, else the measured file's workload, else the defaults."""
    input_len = args.input_len or (measured and measured.input_len) or DEFAULT_INPUT_LEN
    output_len = args.output_len or (measured and measured.output_len) or DEFAULT_OUTPUT_LEN
    sizes = set(args.batch_sizes) | {p.batch_size for p in measured.points} if measured \
        else set(args.batch_sizes)
    return PlanConfig(num_devices=args.num_devices, tp=args.tp, weight_dtype=args.weight_dtype,
                      kv_dtype=args.kv_dtype, input_len=input_len, output_len=output_len,
                      batch_sizes=tuple(sorted(sizes)), price_per_hour=args.price_per_hour,
                      reserve_fraction=args.reserve_fraction)


def _run_plan(args: argparse.Namespace, console: Console) -> int:
    model = load_model(args.model)
    measured = load_measured(args.measured) if args.measured else None
    config = _config(args, measured)
    name = args.hardware or THIS_MACHINE
    if name.lower() == THIS_MACHINE:
        console.print(f"[dim]measuring {THIS_MACHINE} (GEMM and copy bandwidth)...[/]")
    plan = make_plan(model, get_hardware(name), config)
    eff = efficiencies(plan, measured) if measured else None
    print_plan(plan, eff, console)
    if args.json:
        write_json(plan_json(plan, eff), args.json)
    if args.plot:
        from .plot import save_plot

        save_plot(plan, args.plot, measured)
    # the report is complete either way; 1 lets a script tell "does not fit" from bad input (2)
    return 0 if plan.fits else EXIT_DOES_NOT_FIT
