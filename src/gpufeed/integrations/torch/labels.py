"""Labels from paths, so a dataset needs no subclass to pair each sample with its class."""

from __future__ import annotations

import posixpath
from collections.abc import Iterable

from gpufeed.errors import InvalidArgument
from gpufeed.paths import normalize


class FolderLabels:
    """ImageFolder's rule: a file's class is its class folder; classes are sorted by name and
    numbered from 0 (`classes`, `class_to_idx`, as torchvision names them). A plain object, so
    it pickles to spawned DataLoader workers.

    Given the dataset's directory (`root`), the class folder is the one a file lies under one
    level below it (`train/n01/images/1.JPEG` is class `n01`, as in Tiny-ImageNet); a file
    directly under the root is in no class and refused. Given a list of files and directories
    (`listed`), a listed directory is a class folder, and a listed file's class is the
    directory it is in. With neither, every file's class is the directory it is in."""

    def __init__(self, paths: Iterable[str], root: str | None = None, listed: Iterable[str] = ()) -> None:
        self.root = None if root is None else normalize(root)
        self.listed = frozenset(normalize(path) for path in listed)
        self.classes = sorted({self._folder(path) for path in paths})
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    def __call__(self, path: str) -> int:
        return self.class_to_idx[self._folder(path)]

    def _folder(self, path: str) -> str:
        parent = posixpath.dirname(path)
        if self.root is not None and path != self.root:
            prefix = self.root.rstrip("/") + "/"
            folder, slash, _ = path[len(prefix) :].partition("/") if path.startswith(prefix) else ("", "", "")
            if not slash:
                raise InvalidArgument(
                    f"{path}: not inside a class folder under {self.root}; target='folder' labels ROOT/CLASS/... files"
                )
            return folder
        directory = parent
        while self.listed and directory not in ("/", ""):
            if directory in self.listed:
                return posixpath.basename(directory)
            directory = posixpath.dirname(directory)
        return posixpath.basename(parent)
