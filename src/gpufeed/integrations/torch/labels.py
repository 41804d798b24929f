"""Labels from paths, so a dataset needs no subclass to pair each sample with its class."""

from __future__ import annotations

import posixpath
from collections.abc import Iterable

from gpufeed.errors import InvalidArgument
from gpufeed.paths import normalize


class FolderLabels:
    """ImageFolder's rule: a file's class is the directory it lies under, one level below the
    dataset's root (`train/n01/images/1.JPEG` is class `n01`, as in Tiny-ImageNet); classes are
    sorted by name and numbered from 0 (`classes`, `class_to_idx`, as torchvision names them).
    The root is the dataset's directory, or the directory a list of paths has in common. A file
    directly under the root is in no class: refused, never given a class of its own. A plain
    object, so it pickles to spawned DataLoader workers."""

    def __init__(self, paths: Iterable[str], roots: list[str]) -> None:
        self.root = posixpath.commonpath([normalize(root) for root in roots])
        self.classes = sorted({self._folder(path) for path in paths})
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    def __call__(self, path: str) -> int:
        return self.class_to_idx[self._folder(path)]

    def _folder(self, path: str) -> str:
        prefix = self.root.rstrip("/") + "/"
        below = path[len(prefix) :] if path.startswith(prefix) else ""
        folder, slash, _ = below.partition("/")
        if not slash:
            raise InvalidArgument(
                f"{path}: not inside a class folder under {self.root}; target='folder' labels ROOT/CLASS/... files"
            )
        return folder

