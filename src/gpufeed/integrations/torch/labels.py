"""Labels from paths, so a dataset needs no subclass to pair each sample with its class."""

from __future__ import annotations

import posixpath
from collections.abc import Iterable


class FolderLabels:
    """ImageFolder's rule: a file's class is the name of the directory it is in; classes are
    sorted by name and numbered from 0 (`classes`, `class_to_idx`, as torchvision names them).
    A plain object, so it pickles to spawned DataLoader workers."""

    def __init__(self, paths: Iterable[str]) -> None:
        self.classes = sorted({_folder(path) for path in paths})
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    def __call__(self, path: str) -> int:
        return self.class_to_idx[_folder(path)]


def _folder(path: str) -> str:
    return posixpath.basename(posixpath.dirname(path))
