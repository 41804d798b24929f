"""Checksums files as datasets publish them (`sha256sum`/`md5sum`/`sha1sum` output) -> content hashes.

A line is `<hex>  <path>` (text mode) or `<hex> *<path>` (binary mode); a line that starts with
a backslash has `\\\\` and `\\n` escaped in its path, as GNU coreutils writes names with those
characters. The algorithm follows from the hex length. Paths are relative to the source root;
a leading `./` is dropped. Hashes are written `"<algorithm>:<hex>"`, lower case.
"""

from __future__ import annotations

import re
from pathlib import Path

from gpufeed.errors import InvalidArgument

ALGORITHMS = {32: "md5", 40: "sha1", 64: "sha256"}

_LINE = re.compile(r"(\\?)([0-9a-fA-F]+) [ *](.+)")


def _unescape(path: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), path)


def parse_checksums(file: str | Path) -> dict[str, str]:
    """key -> "sha256:<hex>" (or md5:, sha1:) for every line of `file`. A malformed line, an
    unknown hash length or one path given two different hashes fails naming FILE:LINE."""
    try:
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"--checksums {file}: cannot read it ({exc})") from exc
    hashes: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _LINE.fullmatch(line.rstrip("\r"))
        if match is None:
            raise InvalidArgument(f"{file}:{number}: expected '<hex>  <path>' as sha256sum/md5sum write it, got {line[:80]!r}")
        escaped, hexdigest, path = match.groups()
        algorithm = ALGORITHMS.get(len(hexdigest))
        if algorithm is None:
            raise InvalidArgument(
                f"{file}:{number}: a {len(hexdigest)}-digit hash is none of md5 (32), sha1 (40), sha256 (64)"
            )
        if escaped:
            path = _unescape(path)
        while path.startswith("./"):
            path = path[2:]
        value = f"{algorithm}:{hexdigest.lower()}"
        if hashes.setdefault(path, value) != value:
            raise InvalidArgument(f"{file}:{number}: {path} has two different hashes in this file")
    return hashes
