"""What a job is asked to do: its input, output and the choices that are not the backend's."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.jobs.spec import DocumentOptions

ORDERS = ("input", "length-buckets")


@dataclass
class JobConfig:
    input: Path
    output: Path
    options: DocumentOptions = field(default_factory=DocumentOptions)
    errors: Path | None = None
    input_format: str = "auto"
    strict: bool = False
    overwrite: bool = False
    order: str = "input"
    price_per_hour: float | None = None
    progress: bool = True
    fsync_interval: float = 1.0

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"--order must be one of {ORDERS}, got {self.order!r}")
        if self.price_per_hour is not None and self.price_per_hour < 0:
            raise ValueError(f"--price-per-hour must be >= 0, got {self.price_per_hour}")
