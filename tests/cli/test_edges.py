"""The command line at its edges, as a new user meets them: each bad input is one line and a
non-zero exit, and leaves what ran before as it was."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufeed.config import Settings
from gpufeed.warmup import Progress
from tests.cli.test_cli import fails, gpufeed, ok

NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; from gpufeed.cli.main import run; run()"


def test_version() -> None:
    from importlib.metadata import version

    assert ok("--version") == f"gpufeed {version('gpufeed')}\n"
    assert ok("-V") == ok("--version")


def test_ctrl_c_while_the_command_line_loads_is_one_line_and_exit_130() -> None:
    """The interrupt lands in the ~0.3 s of imports (made certain here by an import hook)."""
    code = (
        "import sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'gpufeed.cli.main':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupt())\n"
        "import runpy; runpy.run_module('gpufeed', run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", code, "ls", "/"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "gpufeed: error: interrupted\n")


def test_every_help_page_is_plain() -> None:
    for command in ("", "mount", "agent", "agent start", "cache", "warmup", "bench", "demo", "ls", "cat"):
        result = gpufeed(*command.split(), "--help")
        assert result.returncode == 0, (command, result.stderr)
        assert "Usage: gpufeed" in result.stdout and not result.stderr


def test_help_text_is_prose_not_markup() -> None:
    """A docstring's line breaks are not the terminal's, and `[env: X]` is text, not a style tag."""
    listing = ok("--help")
    assert "or the algorithm of a hash the manifest has" in listing, listing
    assert "[env: GPUFEED_CLUSTER]" in ok("cluster", "status", "--help")
    assert "[env: GPUFEED_PEER_ADDR]" in ok("agent", "--help")
    assert "two spaces, its path relative to the source root" in ok("mount", "add", "--help")


def test_agent_start_with_other_settings_fails_and_keeps_the_running_agent() -> None:
    assert ok("agent", "start", "--cache-size", "1GiB").endswith("with a 1.0 GiB quota\n")
    again = ok("agent", "start")
    assert "an agent already serves" in again and "quota 1.0 GiB" in again and "gpufeed agent stop" in again
    assert "already serves" in ok("agent", "start", "--cache-size", "1024MiB"), "the same quota, written otherwise"
    line = fails(1, "agent", "start", "--cache-size", "2GiB")
    assert "quota 1.0 GiB" in line and "not --cache-size 2.0 GiB" in line and "'gpufeed agent stop'" in line
    line = fails(1, "agent", "--cache-size", "2GiB", "start")
    assert "not --cache-size 2.0 GiB" in line, "the option before the subcommand counts too"
    status = ok("agent", "status")
    assert "with a 1.0 GiB quota" in status and "of 1.0 GiB" in status, "the running agent was left as it was"
    assert "stopped agent" in ok("agent", "stop")
    assert "with a 3.0 GiB quota" in ok("agent", "start", "--cache-size", "3GiB"), "after a stop the new quota applies"


def test_agent_start_with_other_dirs_fails(tmp_path: Path) -> None:
    primary = Settings.from_env().cache_dirs[0]
    ok("agent", "start")
    line = fails(1, "agent", "start", "--cache-dir", str(primary), "--cache-dir", str(tmp_path / "second"))
    assert f"already serves {primary}" in line and f"not --cache-dir {primary} {tmp_path / 'second'}" in line
    fails(2, "agent", "start", "--cache-size", "lots")


@pytest.fixture
def running_warmup() -> Iterator[Progress]:
    """A warmup's published progress, for a live process (what `warmup` writes while it runs)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    progress = Progress(["/data/train", "/other/x.bin"], 10, 1000, done_files=4, done_bytes=400, pid=process.pid)
    folder = Settings.from_env().cache_dirs[0] / "warmups"
    folder.mkdir(parents=True)
    (folder / f"{process.pid}.json").write_text(json.dumps(dataclasses.asdict(progress)))
    yield progress
    process.kill()
    process.wait()


def test_warmup_status_filters_by_path(running_warmup: Progress) -> None:
    assert f"pid {running_warmup.pid}: /data/train /other/x.bin: 4/10 files" in ok("warmup", "status")
    for path in ("/data", "/data/train/cats", "/other/x.bin", "/"):
        assert f"pid {running_warmup.pid}:" in ok("warmup", "status", path), path
    for path in ("/dat", "/other/x", "/elsewhere"):
        assert ok("warmup", "status", path) == f"no warmup running under {path}\n", path


def test_warmup_status_bad_input() -> None:
    assert ok("warmup", "status") == "no warmup running\n"
    assert "namespace paths start with '/'" in fails(2, "warmup", "status", "data")
    assert "not --list or --dry-run" in fails(2, "warmup", "status", "--dry-run")
    assert "give one or more namespace paths" in fails(2, "warmup")


def test_usage_errors_name_the_command_and_its_help() -> None:
    assert fails(2, "cat") == "gpufeed: error: cat: Missing argument 'path' (see 'gpufeed cat --help')"
    assert fails(2, "mount", "add", "/x").endswith("mount add: Missing argument 'url' (see 'gpufeed mount add --help')")
    assert fails(2, "agent", "bogus").endswith("agent: No such command 'bogus' (see 'gpufeed agent --help')")
    assert fails(2, "--bogus") == "gpufeed: error: No such option: --bogus (see 'gpufeed --help')"


def test_a_group_alone_prints_its_help_and_no_empty_error() -> None:
    for command in ([], ["cache"], ["mount"]):
        result = gpufeed(*command)
        assert result.returncode == 2
        assert "Usage: gpufeed" in result.stdout and result.stderr == "", (command, result.stderr)


@pytest.mark.parametrize("command", [["demo"], ["bench", "--source", "file:///nowhere"], ["bench", "generate", "file:///x"]])
def test_bench_without_its_extra_says_how_to_get_it(command: list[str], tmp_path: Path) -> None:
    argv = [sys.executable, "-c", NO_MATPLOTLIB, *command]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    name = command[0]
    assert result.stderr == f"gpufeed: error: gpufeed {name} needs the bench extra: pip install 'gpufeed[bench]'\n"
    assert list(tmp_path.iterdir()) == [], "nothing was written"


def test_demo_refuses_an_output_it_could_not_write_before_running(tmp_path: Path) -> None:
    (tmp_path / "demo.png").mkdir()
    line = fails(2, "demo", "--out", str(tmp_path))
    assert line == f"gpufeed: error: {tmp_path / 'demo.png'}: is a directory; give a file name"
    (tmp_path / "file").write_text("")
    assert "cannot make the output directory: Not a directory" in fails(2, "demo", "--out", str(tmp_path / "file" / "d"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.png", "file"]
