"""This node's copies of gpufeed-pack member tables, under GPUFEED_HOME/packs/ and named by
their index's content hash: opened for a mount's generation, saved when a mount or refresh
lists a pack, removed when no mount names them any more."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from gpufeed.errors import MountError
from gpufeed.meta import MetaEngine, Mount
from gpufeed.meta.base import Entry
from gpufeed.pack.layout import INDEX_KEY, object_entry
from gpufeed.sources import Source
from gpufeed.sources.base import ObjectInfo

if TYPE_CHECKING:
    from gpufeed.pack.members import MemberTable


class MemberTables:
    def __init__(self, home: Path, engine: MetaEngine) -> None:
        self.dir = home / "packs"
        self.engine = engine
        self._open: dict[str, tuple[int, MemberTable]] = {}
        """Mount path → (generation, its table), as this process last opened it."""

    def of(self, mount: Mount, source: Callable[[Mount], Source]) -> MemberTable | None:
        """The member table of a gpufeed-pack mount's generation; None for any other mount (and
        for one listed before member tables existed: its members are rows). `source` opens the
        mount's store, for a node that has no copy of the table yet."""
        if mount.options.get("format") != "gpufeed-pack":
            return None
        known = self._open.get(mount.path)
        if known is not None and known[0] == mount.generation:
            return known[1]
        row = self._index_row(mount)
        if row is None:
            return None
        from gpufeed.pack import mounting

        table = mounting.member_table(source(mount), row.object_info(), self.dir)
        self._open[mount.path] = (mount.generation, table)
        return table

    def save(self, table: MemberTable, index_row: ObjectInfo) -> None:
        """Save a just-built member table where this node's processes look for it."""
        assert index_row.content_hash is not None
        where = self.dir / index_row.content_hash.removeprefix("sha256:")
        try:
            table.save(where)
        except OSError as exc:
            raise MountError(f"{where}: cannot save the pack's member table ({exc.strerror or exc})") from None

    def name(self, mount: Mount) -> str | None:
        """The name of the table a mount's generation reads; None for a mount without one."""
        row = self._index_row(mount)
        return None if row is None else (row.content_hash or "").removeprefix("sha256:")

    def drop(self, name: str | None, mounts: list[Mount]) -> None:
        """Remove this node's copy of a table none of `mounts` names any more (a process that
        has it open keeps its mapping; other nodes' copies go with their own removal)."""
        if name is None or any(self.name(other) == name for other in mounts):
            return
        shutil.rmtree(self.dir / name, ignore_errors=True)

    def check_hashes(self, mounts: list[Mount]) -> None:
        """Before `verify` reads members' sha256: each of `mounts`' saved tables with a damaged
        sha256 column is removed, and built again when next opened."""
        from gpufeed.pack.members import drop_if_hashes_damaged

        for mount in mounts:
            name = self.name(mount)
            if name is not None and drop_if_hashes_damaged(self.dir / name):
                self._open.pop(mount.path, None)

    def _index_row(self, mount: Mount) -> Entry | None:
        """The manifest row of a gpufeed-pack mount's index, whose content hash names its member table."""
        if mount.options.get("format") != "gpufeed-pack":
            return None
        row = self.engine.lookup(mount.generation, *object_entry(INDEX_KEY))
        return None if row is None or row.content_hash is None else row
