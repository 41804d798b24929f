"""fsspec protocol `gpufeed://`: pandas and pyarrow read through the cache."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pandas as pd
import pyarrow.parquet as pq
import pytest

from gpufeed.client.connection import AgentClient
from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument
from gpufeed.namespace import Namespace


@pytest.fixture
def table(tmp_path: Path) -> pd.DataFrame:
    frame = pd.DataFrame({"label": range(1000), "path": [f"img/{i}.jpg" for i in range(1000)]})
    (tmp_path / "src" / "tables").mkdir(parents=True)
    frame.to_parquet(tmp_path / "src" / "tables" / "index.parquet")
    (tmp_path / "src" / "notes.txt").write_bytes(b"0123456789")
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    return frame


def test_pandas_and_pyarrow_read_through_the_cache(table: pd.DataFrame) -> None:
    assert pd.read_parquet("gpufeed:///data/tables/index.parquet").equals(table)
    fs = fsspec.filesystem("gpufeed")
    assert pq.read_table("/data/tables/index.parquet", filesystem=fs).to_pandas().equals(table)
    info = AgentClient(Settings.from_env()).stats()
    assert info.blocks == 1 and info.misses == 1, "one fetch; every later read a hit"


def test_listing_info_and_ranges(table: pd.DataFrame) -> None:
    fs = fsspec.filesystem("gpufeed")
    assert fs.ls("gpufeed:///data", detail=False) == ["/data/notes.txt", "/data/tables"]
    assert fs.info("/data/notes.txt")["size"] == 10
    assert fs.info("/data/tables")["type"] == "directory"
    assert fs.cat_file("gpufeed:///data/notes.txt", 2, 5) == b"234"
    assert fs.cat_file("/data/notes.txt", -3) == b"789"
    with fsspec.open("gpufeed:///data/notes.txt") as f:
        f.seek(4)
        assert f.read(2) == b"45"
    assert fs.find("/data") == ["/data/notes.txt", "/data/tables/index.parquet"]


def test_the_namespace_is_read_only(table: pd.DataFrame) -> None:
    with pytest.raises(InvalidArgument, match="read-only"):
        fsspec.filesystem("gpufeed").open("/data/new.txt", "wb")
