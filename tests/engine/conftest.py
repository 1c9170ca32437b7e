"""Fixtures shared by the engine's tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.test_equivalence import _tiny_model
from tokenmill.models.loader import LoadedWeights, load_weights


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedWeights, torch.nn.Module]:
    """A tiny random Llama saved as a Hugging Face folder: its weights loaded, and the transformers model."""
    model = _tiny_model("llama")
    folder: Path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    return load_weights(str(folder)), model
