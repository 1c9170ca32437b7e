"""Shared fixtures: the embedded model loaded once, tiny random models, and the reference (and
Gemma 3 270M, the second real model: its file and how transformers reads it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.environment import embedded_model_path, named_model_path
from tokenmill.models.loader import LoadedWeights, load_weights


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    try:
        return embedded_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm_weights(gguf_path: Path) -> LoadedWeights:
    return load_weights(str(gguf_path))


@pytest.fixture(scope="session")
def smollm_reference(gguf_path: Path) -> torch.nn.Module:
    """SmolLM2 as transformers itself reads the GGUF: an independent check of our loader."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def gemma3_gguf_path() -> Path:
    """Gemma 3 270M (Q4_K_M), joined from its PyPI chunk packages on first use."""
    try:
        return named_model_path("gemma3-270m")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def gemma3_reference(gemma3_gguf_path: Path) -> torch.nn.Module:
    """Gemma 3 270M as transformers itself reads the GGUF: an independent check of our reader."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gemma3_gguf_path.parent), gguf_file=gemma3_gguf_path.name, dtype=torch.float32
    )
    return model.eval()
