"""Every file a load opens lies inside the directory it was given.

A checkpoint or Hugging Face directory received from elsewhere names its own files: DCP's ``.metadata`` names the
shard file of every stored entry, ``model.safetensors.index.json`` the file of every tensor. Joined to the directory
unchecked, an absolute name, a ``..`` or a symlink would make a load read a file anywhere on the machine.
:func:`inside` resolves such a name (symlinks included) and refuses it unless it stays inside the directory.

Hugging Face's hub cache keeps a model's files as symlinks from ``<repo>/snapshots/<revision>/`` into
``<repo>/blobs/``: for such a snapshot directory, :func:`hf_roots` admits that ``blobs`` directory too.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path, PurePosixPath


def inside(directory: Path, name: str, what: str, roots: Sequence[Path] | None = None) -> Path:
    """``directory / name``, after checking that ``name`` (named by ``what``, e.g. "the storage entry of
    decoder.weight in .metadata") is a relative path without ``..`` that, every symlink resolved, lies inside
    ``directory`` (or one of ``roots``, which default to ``directory``). Raises ``ValueError`` naming the entry."""
    pure = PurePosixPath(name)
    if not name or pure.is_absolute() or Path(name).is_absolute() or ".." in pure.parts or "\\" in name:
        raise ValueError(
            f"{what} names the file {name!r}, which is not a relative name inside {directory}: a checkpoint or model "
            "directory names only its own files (relative names with '/' and without '..'). Refusing to read it; is "
            "the directory from an untrusted source?"
        )
    path = directory / name
    resolved = path.resolve()
    allowed = [root.resolve() for root in (roots or [directory])]
    if not any(resolved.is_relative_to(root) for root in allowed):
        raise ValueError(
            f"{what} names {path}, a symlink that leads to {resolved}, outside {directory}: a checkpoint or model "
            "directory may only link to its own files. Refusing to read it; is the directory from an untrusted source?"
        )
    return path


def hf_roots(directory: Path) -> list[Path]:
    """Where the files of a Hugging Face model directory may lie: the directory, and for a hub-cache snapshot
    (``<repo>/snapshots/<revision>``) the repository's ``blobs`` directory, which its symlinks point into."""
    resolved = directory.resolve()
    blobs = resolved.parent.parent / "blobs"
    if resolved.parent.name == "snapshots" and blobs.is_dir():
        return [resolved, blobs]
    return [resolved]
