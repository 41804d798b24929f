"""The public API at its edges: modes, path types, argument types, and what `import gpufeed` costs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path, PurePosixPath

import numpy as np
import pytest

import gpufeed
from gpufeed.errors import ReadOnlyMount
from gpufeed.namespace import Namespace

HEAVY = {"torch", "matplotlib", "obstore", "aiohttp", "numpy", "redis", "typer", "rich", "click", "msgspec", "gpufeed.cli"}


@pytest.fixture
def mounted(dataset: Path) -> Path:
    Namespace().add_mount("/data", f"file://{dataset}", {})
    return dataset


def test_open_accepts_rb_refuses_other_modes_and_writes_to_read_only_mounts(mounted: Path) -> None:
    with gpufeed.open("/data/README", "rb") as f:
        assert f.read() == b"readme\n"
    with gpufeed.open("/data/README", mode="rb") as f:
        assert f.read(3) == b"rea"
    for mode in ("r", "w", "ab", "rb+", "rt", ""):
        with pytest.raises(ValueError, match=re.escape(f"open(): mode {mode!r} is not supported")):
            gpufeed.open("/data/README", mode)  # type: ignore[call-overload]
    with pytest.raises(ReadOnlyMount, match="mount /data .* is read-only"):
        gpufeed.open("/data/README", "wb")
    with pytest.raises(TypeError, match="open\\(\\): mode must be a str, not int"):
        gpufeed.open("/data/README", 0)  # type: ignore[arg-type]


def test_path_like_arguments(mounted: Path) -> None:
    path = PurePosixPath("/data/train/cats/1.jpg")
    assert gpufeed.read(path) == bytes([1]) * 1001
    assert gpufeed.stat(Path("/data/README")).size == 7
    with gpufeed.open(Path("/data/README")) as f:
        assert f.read() == b"readme\n"
    assert [item.path for item in gpufeed.ls(Path("/data/train"))] == ["/data/train/cats", "/data/train/dogs"]
    assert len(list(gpufeed.walk(Path("/data/train")))) == 6


def test_wrong_argument_types_name_the_argument(mounted: Path) -> None:
    with pytest.raises(TypeError, match=r"^read\(\): offset must be an int, not str$"):
        gpufeed.read("/data/README", "0", 10)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^read\(\): length must be an int, not float$"):
        gpufeed.read("/data/README", 0, 2.5)  # type: ignore[arg-type]
    for call, name in ((gpufeed.read, "read"), (gpufeed.open, "open"), (gpufeed.stat, "stat"), (gpufeed.ls, "ls")):
        with pytest.raises(TypeError, match=rf"^{name}\(\): path must be a str or os.PathLike\[str\], not int$"):
            call(7)
    with pytest.raises(TypeError, match=r"walk\(\): path must be a str or os.PathLike\[str\], not bytes"):
        gpufeed.walk(b"/data")  # type: ignore[arg-type]
    assert gpufeed.read("/data/README", np.int64(2), np.uint8(3)) == b"adm", "numpy integers are integers"


def test_mount_options_from_python_may_be_numbers_and_bools(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"a")
    given = {"block_size": np.int64(65536), "cache": False, "writable": True, "verify": True}
    mount, _ = Namespace().add_mount("/typed", str(tmp_path), given)
    assert [mount.options[k] for k in given] == ["65536", "off", "true", "always"]
    assert gpufeed.read("/typed/a.bin") == b"a"
    with pytest.raises(TypeError, match=r"^option block_size=\[4\]: expected a string \(or a number or bool\), got list$"):
        Namespace().add_mount("/typed2", str(tmp_path), {"block_size": [4]})


def test_client_function_survives_importing_the_client_module() -> None:
    code = "import gpufeed, gpufeed.client; from gpufeed.client import Client; print(type(gpufeed.client()).__name__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "Client"


def test_import_is_lazy() -> None:
    """No heavy dependency (and not the CLI) is loaded until something is used."""
    code = (
        "import gpufeed, gpufeed.errors, sys\n"
        f"heavy = {sorted(HEAVY)!r}\n"
        "print(sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.') for h in heavy)))\n"
        "gpufeed.Client, gpufeed.FeedFile, gpufeed.FileStat, gpufeed.GpufeedError\n"
        "print('gpufeed.client.reader' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ)
    assert result.returncode == 0, result.stderr
    loaded, client_loaded = result.stdout.split("\n")[:2]
    assert loaded == "[]"
    assert client_loaded == "True", "the lazy names still resolve to the real classes"


def test_the_cli_and_the_agent_load_only_what_a_command_needs() -> None:
    """Building every command's help and the agent's service loads no store client, numpy or
    redis: each is imported by the command, the URL scheme or the cluster that uses it."""
    store_heavy = ["aiohttp", "numpy", "obstore", "prometheus_client.parser", "redis"]
    code = (
        "import sys, typer\n"
        "from gpufeed.cli.main import app\n"
        "typer.main.get_command(app)\n"
        "import gpufeed.agent.__main__, gpufeed.agent.service\n"
        f"heavy = {store_heavy!r}\n"
        "print(sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.') for h in heavy)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Clinet'"):
        gpufeed.Clinet  # type: ignore[attr-defined]  # noqa: B018
    assert {"Client", "open", "read"} <= set(dir(gpufeed))


def test_an_error_code_names_the_class_that_defines_it_not_a_subclass_that_inherits_it() -> None:
    from gpufeed import errors
    from gpufeed.integrations.torch.index import IndexOutOfRange  # an InvalidArgument with its code

    assert issubclass(IndexOutOfRange, errors.InvalidArgument)
    assert type(errors.from_code("invalid_argument", "bad")) is errors.InvalidArgument
    assert type(errors.from_code("object_missing", "gone")) is errors.ObjectMissing
    assert type(errors.from_code("a code from a newer release", "?")) is errors.SourceError
