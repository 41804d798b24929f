"""A WebDataset tar shard set read in place: its members are files, their bytes ranges of the tars."""

from __future__ import annotations

import io
import random
import tarfile

import pytest

import gpufeed
from gpufeed.client.connection import AgentClient
from gpufeed.config import Settings
from gpufeed.errors import PackError
from gpufeed.namespace import Namespace
from tests.conftest import Bucket


def shard(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_webdataset_members_read_in_place(bucket: Bucket) -> None:
    rng = random.Random(0)
    samples: dict[str, bytes] = {}
    for number in range(3):
        members = {}
        for n in range(number * 40, number * 40 + 40):
            members[f"{n:06d}.jpg"] = rng.randbytes(rng.randint(1, 30_000))
            members[f"{n:06d}.cls"] = str(n % 10).encode()
        if number == 2:  # a name longer than ustar holds: a pax header carries it
            members["deep/" + "x" * 150 + ".json"] = b'{"long": true}'
            members["big.bin"] = rng.randbytes(5_000_000)  # spans blocks; its data is skipped while indexing
        samples.update(members)
        bucket.put(f"wds/shard-{number:06d}.tar", shard(members))
    Namespace().add_mount("/wds", f"{bucket.url}/wds", {"endpoint": bucket.endpoint, "format": "webdataset"})
    listed = {f.path.removeprefix("/wds/"): f.size for f in gpufeed.walk("/wds")}
    assert listed == {name: len(data) for name, data in samples.items()}
    assert sorted(f.path for f in gpufeed.ls("/wds"))[:2] == ["/wds/000000.cls", "/wds/000000.jpg"]
    for name, data in samples.items():
        assert gpufeed.read(f"/wds/{name}") == data, name
    assert gpufeed.read("/wds/big.bin", 4_000_000, 100) == samples["big.bin"][4_000_000:4_000_100]
    blocks = AgentClient(Settings.from_env()).stats().blocks
    assert blocks <= 3 + 2, f"{blocks} blocks: the tars' blocks, not one per member"


def test_links_in_a_tar_read_as_the_file_they_name(bucket: Bucket, caplog: pytest.LogCaptureFixture) -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo("img/000001.jpg")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"jpeg!"))
        for name, kind, target in [("img/copy.jpg", tarfile.LNKTYPE, "img/000001.jpg"),  # as tar -h/hard links write
                                   ("latest.jpg", tarfile.SYMTYPE, "img/copy.jpg"),  # relative, through a link
                                   ("gone.jpg", tarfile.SYMTYPE, "nowhere.jpg")]:
            link = tarfile.TarInfo(name)
            link.type, link.linkname = kind, target
            tar.addfile(link)
        first = tarfile.TarInfo("replaced.jpg")  # a link, then a file of that name: the file, as tar extracts it
        first.type, first.linkname = tarfile.SYMTYPE, "img/000001.jpg"
        tar.addfile(first)
        again = tarfile.TarInfo("replaced.jpg")
        again.size = 3
        tar.addfile(again, io.BytesIO(b"new"))
    bucket.put("links/shard.tar", out.getvalue())
    Namespace().add_mount("/links", f"{bucket.url}/links", {"endpoint": bucket.endpoint, "format": "webdataset"})
    listed = {f.path: f.size for f in gpufeed.walk("/links")}
    assert listed == {"/links/img/000001.jpg": 5, "/links/img/copy.jpg": 5, "/links/latest.jpg": 5, "/links/replaced.jpg": 3}
    assert gpufeed.read("/links/img/copy.jpg") == gpufeed.read("/links/latest.jpg") == b"jpeg!"
    assert gpufeed.read("/links/replaced.jpg") == b"new"
    assert f"{bucket.url}/links: 1 link(s) to no regular file of their tar left out (shard.tar/gone.jpg)" in caplog.text


def test_tars_in_folders_keep_their_folder(bucket: Bucket) -> None:
    """WebDataset sets are often split as train/ and val/ with the same member names."""
    for split in ("train", "val"):
        bucket.put(f"splits/{split}/shard-000000.tar", shard({"000000.jpg": split.encode(), "000000.cls": b"1"}))
    bucket.put("splits/top.tar", shard({"readme.txt": b"top"}))
    Namespace().add_mount("/splits", f"{bucket.url}/splits", {"endpoint": bucket.endpoint, "format": "webdataset"})
    listed = sorted(f.path for f in gpufeed.walk("/splits"))
    assert listed == ["/splits/readme.txt", "/splits/train/000000.cls", "/splits/train/000000.jpg",
                      "/splits/val/000000.cls", "/splits/val/000000.jpg"]
    assert (gpufeed.read("/splits/train/000000.jpg"), gpufeed.read("/splits/val/000000.jpg")) == (b"train", b"val")


def test_a_tar_with_a_damaged_header_part_way_is_refused_not_cut_short(bucket: Bucket) -> None:
    """tarfile takes a damaged header after the first for the end of the archive: the tar mounted
    with the members before it, and the rest were silently gone from training."""
    members = {f"{n:06d}.jpg": bytes([n]) * 700 for n in range(40)}
    whole = shard(members)
    damaged = bytearray(whole)
    header = whole.index(b"000020.jpg")  # its header starts with its name
    damaged[header + 148 : header + 156] = b"0000000\0"  # its checksum, now wrong
    bucket.put("damaged/shard.tar", bytes(damaged))
    bucket.put("whole/shard.tar", whole + bytes(1 << 20))  # a big record's padding (tar -b 2048): fine
    Namespace().add_mount("/whole", f"{bucket.url}/whole", {"endpoint": bucket.endpoint, "format": "webdataset"})
    assert len(list(gpufeed.walk("/whole"))) == 40
    with pytest.raises(PackError, match=r"damaged/shard.tar: not a readable tar \(a damaged header at byte [\d,]+ of"):
        Namespace().add_mount("/damaged", f"{bucket.url}/damaged", {"endpoint": bucket.endpoint, "format": "webdataset"})
