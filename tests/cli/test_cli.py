"""The `gpufeed` command as a user runs it: a real process, its output and exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import Bucket, free_port


def gpufeed(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpufeed", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {}), "COLUMNS": "200"},
        timeout=120,
    )


def ok(*args: str, env: dict[str, str] | None = None) -> str:
    result = gpufeed(*args, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def fails(code: int, *args: str, env: dict[str, str] | None = None) -> str:
    """Run a failing command; return its one stderr line after checking the contract."""
    result = gpufeed(*args, env=env)
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpufeed: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_file_mount_session(dataset: Path) -> None:
    assert "mounted file://" in ok("mount", "add", "/data", f"file://{dataset}")
    assert "/data" in ok("mount", "ls")
    assert ok("ls", "/").split() == ["data/"]
    assert ok("ls", "/data").split() == ["README", "empty.bin", "train/"]
    long = ok("ls", "-l", "/data/train/cats").splitlines()
    assert [line.split()[0] for line in long] == ["1000", "1001", "1002"]
    assert long[0].endswith("0.jpg")
    stat = ok("stat", "/data/train/dogs/1.jpg")
    assert "size:     2001" in stat and "type:     file" in stat
    assert ok("cat", "/data/README") == "readme\n"
    assert ok("cat", "/data/README", "/data/empty.bin", "/data/README") == "readme\nreadme\n", "as cat joins files"
    partly = gpufeed("cat", "/data/README", "/data/nope", "/data/train", "/data/README")
    assert (partly.returncode, partly.stdout) == (1, "readme\nreadme\n"), "as POSIX cat: the others are still written"
    assert [line.split(":")[2] for line in partly.stderr.splitlines()] == [" /data/nope", " /data/train"], partly.stderr
    assert ok("du", "/data/train").split("\t")[0] == str(3003 + 6003)
    assert json.loads(ok("du", "/data/train", "--json")) == {"path": "/data/train", "bytes": 3003 + 6003, "files": 6}
    listed = json.loads(ok("ls", "--json", "/data"))
    assert [(e["path"], e["type"], e.get("size")) for e in listed] == [
        ("/data/README", "file", 7),
        ("/data/empty.bin", "file", 0),
        ("/data/train", "directory", None),
    ]
    one = json.loads(ok("stat", "--json", "/data/train/dogs/1.jpg"))
    assert one["size"] == 2001 and one["version"]
    assert abs(one["mtime"] - (dataset / "train/dogs/1.jpg").stat().st_mtime) < 1e-5, "to the microsecond"
    assert "/data/README/: not a directory" in fails(1, "stat", "/data/README/")
    (dataset / "README").write_bytes(b"changed")
    assert "0 added, 1 changed, 0 removed" in ok("mount", "refresh", "/data")
    assert ok("cat", "/data/README") == "changed"
    assert "removed mount /data" in ok("mount", "rm", "/data")
    assert "no mounts" in ok("mount", "ls")


def test_s3_mount_session(bucket: Bucket) -> None:
    for i in range(3):
        bucket.put(f"train/{i}.bin", bytes([i]) * (10 + i))
    bucket.put("labels.csv", b"a,b\n")
    assert "4 files" in ok("mount", "add", "/s3", bucket.url, "--opt", f"endpoint={bucket.endpoint}", "--immutable")
    assert "immutable" in ok("mount", "ls")
    assert ok("ls", "/s3/train").split() == ["0.bin", "1.bin", "2.bin"]
    assert ok("cat", "/s3/labels.csv") == "a,b\n"
    assert ok("du", "/s3").split("\t")[2] == "4 files"


def test_redis_engine_from_environment(dataset: Path, redis_url: str) -> None:
    env = {"GPUFEED_META": f"{redis_url}?prefix=cli{os.getpid()}"}
    ok("mount", "add", "/r", f"file://{dataset}", env=env)
    assert ok("ls", "/r/train", env=env).split() == ["cats/", "dogs/"]
    assert "no mounts" in ok("mount", "ls"), "the SQLite default is a different engine"
    ok("mount", "rm", "/r", env=env)


def test_metadata_server_down_is_one_line() -> None:
    typo = fails(2, "mount", "ls", env={"GPUFEED_META": f"redis://127.0.0.1:{free_port()}/l"})
    assert "GPUFEED_META" in typo and "database 'l' is not a number" in typo, "not database 0, another namespace's"
    line = fails(1, "mount", "ls", env={"GPUFEED_META": f"redis://127.0.0.1:{free_port()}/0"})
    assert "metadata server redis://127.0.0.1" in line


def test_errors_are_one_line_with_exit_codes(dataset: Path, bucket: Bucket, moto_auth_endpoint: str) -> None:
    bucket.put("gone.bin", b"x")
    ok("mount", "add", "/data", f"file://{dataset}")
    ok("mount", "add", "/s3", bucket.url, "-o", f"endpoint={bucket.endpoint}")
    bucket.delete("gone.bin")
    assert "/data/nope: no such file or directory in mount /data" in fails(1, "stat", "/data/nope")
    assert "/elsewhere/x: no mount contains" in fails(1, "cat", "/elsewhere/x")
    assert "/etc/passwd: no mount contains" in fails(1, "cat", "/data/../../etc/passwd")
    assert "/data/\\xff: not valid UTF-8" in fails(2, "ls", "/data/\udcff")  # the byte 0xff, as a shell passes it
    assert "/\\xff: not valid UTF-8" in fails(2, "mount", "add", "/\udcff", f"file://{dataset}")
    gone = fails(1, "cat", "/s3/gone.bin")
    assert "/s3/gone.bin: deleted at the source since mount /s3 was listed (s3://" in gone
    assert "not found" not in gone, "said once"
    assert "unsupported URL scheme 'ftp'" in fails(2, "mount", "add", "/f", "ftp://host/x")
    assert "--opt 'endpoint': expected key=value" in fails(2, "mount", "add", "/b", "s3://b", "--opt", "endpoint")
    assert "overlaps the mount /data" in fails(1, "mount", "add", "/data/sub", f"file://{dataset}")
    assert "/data is already a mount (file://" in fails(1, "mount", "add", "/data", f"file://{dataset}")
    assert "unsupported URL scheme 'fille'" in fails(2, "mount", "add", "/data", f"fille://{dataset}"), "the typo, not the mount"
    # -q: retrying an unreachable store takes longer than a progress interval, and a progress line is not an error;
    # how long the retries last is not what is checked here, so this command gets a short retry budget
    unreachable = fails(
        1, "mount", "add", "/u", "s3://b", "-o", f"endpoint=http://127.0.0.1:{free_port()}", "-q",
        env={"GPUFEED_RETRY_TIMEOUT": "0.5"},
    )
    assert "cannot reach the store" in unreachable and "s3://b (endpoint http://127.0.0.1:" in unreachable
    port = free_port()
    unreachable = fails(1, "mount", "add", "/w", f"http://127.0.0.1:{port}/d", "-q", env={"GPUFEED_RETRY_TIMEOUT": "0.5"})
    assert unreachable.endswith(f"http://127.0.0.1:{port}/d/: cannot reach the server (Connection refused)"), unreachable
    assert "InvalidAccessKeyId" in fails(1, "mount", "add", "/a", "s3://b", "-o", f"endpoint={moto_auth_endpoint}")
    assert "/nope: no such mount" in fails(1, "mount", "rm", "/nope")
    assert "is a directory" in fails(1, "cat", "/data/train")
    assert "No such command" in fails(2, "frobnicate")
    assert "Missing argument" in fails(2, "mount", "add", "/x")
    home_file = dataset / "train" / "cats" / "0.jpg"
    not_a_dir = f"GPUFEED_HOME={home_file}: is not a directory"
    assert not_a_dir in fails(2, "mount", "ls", env={"GPUFEED_HOME": str(home_file)})
    assert [m["path"] for m in json.loads(ok("mount", "ls", "--json"))] == ["/data", "/s3"], "nothing stored was lost"


def test_debug_shows_the_traceback() -> None:
    for args in (("--debug", "cat", "/nowhere/x"), ("cat", "/nowhere/x", "--debug")):
        result = gpufeed(*args)
        assert result.returncode == 1, args
        assert "Traceback" in result.stderr and "PathNotFound" in result.stderr, args
        assert result.stderr.strip().splitlines()[-1].startswith("gpufeed: error: /nowhere/x"), args
    assert "No such option: --bogus" in fails(2, "--debug", "cat", "/nowhere/x", "--bogus"), "a usage error: no traceback"


def test_output_that_cannot_be_written_is_one_line(dataset: Path) -> None:
    """A full disk or a closed descriptor 1, for every command that prints: cat's bytes, ls's
    names, a rich table, JSON."""
    ok("mount", "add", "/data", f"file://{dataset}")
    commands = [("cat", "/data/train/cats/0.jpg"), ("ls", "/data"), ("ls", "-l", "/data"), ("stat", "/data/README"),
                ("mount", "ls"), ("mount", "ls", "--json"), ("du", "/data")]
    for command in commands:
        for stdout, why in (("/dev/full", "No space left on device"), (None, "it is closed")):
            with open(stdout or os.devnull, "w") as sink:
                result = subprocess.run(
                    [sys.executable, "-m", "gpufeed", *command], stdout=sink if stdout else None, stderr=subprocess.PIPE,
                    text=True, env={**os.environ, "COLUMNS": "200"}, timeout=120,
                    preexec_fn=None if stdout else lambda: os.close(1),
                )
            assert result.returncode == 1, (command, stdout, result.stderr)
            assert result.stderr.strip() == f"gpufeed: error: cannot write to standard output: {why}", (command, stdout)


def test_a_path_with_brackets_is_printed_as_it_is_on_one_line(tmp_path: Path) -> None:
    """Output is plain text: `[/x]` is no closing tag to fail on, `[bold]` no style to drop, and
    a line read by a script (no terminal, no COLUMNS) is not broken at 80 columns."""
    data = tmp_path / f"data[/x] and [bold]{'d' * 80}"  # a dir `data[` holding `x] and [bold]ddd…`
    data.mkdir(parents=True)
    (data / "f.txt").write_bytes(b"hi")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    command = [sys.executable, "-m", "gpufeed", "mount"]
    added = subprocess.run([*command, "add", "/brackets", str(data)], capture_output=True, text=True, env=env, timeout=120)
    assert added.returncode == 0, added.stderr
    assert added.stdout == f"mounted file://{data} at /brackets: 1 file, 2 B\n"
    removed = subprocess.run([*command, "rm", "/brackets"], capture_output=True, text=True, env=env, timeout=120)
    assert removed.returncode == 0 and removed.stdout == f"removed mount /brackets (file://{data})\n", removed.stderr


def test_secrets_never_reach_the_screen() -> None:
    shown = fails(1, "mount", "ls", env={"GPUFEED_META": f"redis://user:s3cretpw@127.0.0.1:{free_port()}/0"})
    assert "s3cretpw" not in shown and "redis://127.0.0.1:" in shown
    from gpufeed.cli.mount import _secret

    assert all(_secret(k) for k in ("account_key", "sas_key", "secret_access_key", "token", "password"))
    assert not any(_secret(k) for k in ("endpoint", "region", "anonymous", "list", "block_size"))


def test_bad_numbers_are_refused(dataset: Path) -> None:
    assert "--max-age nan" in fails(2, "mount", "add", "/d", f"file://{dataset}", "--max-age", "nan")
    assert "cache dir /proc" in fails(1, "agent", "--cache-dir", "/proc/gpufeed-test-no-such-dir")
    assert "--cache-size '0': a cache quota must be above 0" in fails(2, "agent", "start", "--cache-size", "0")
    refusals = (("GPUFEED_PROGRESS_INTERVAL", "0"), ("GPUFEED_PROGRESS_INTERVAL", "-3"), ("GPUFEED_CONNECT_TIMEOUT", "nan"))
    for name, value in refusals:
        refused = fails(2, "mount", "ls", env={name: value})
        assert f"{name}='{value}' must be a number of seconds above 0" in refused
    for ratio in ("1", "2", "-0.1"):
        refused = fails(2, "mount", "ls", env={"GPUFEED_CACHE_FREE_RATIO": ratio})
        assert f"GPUFEED_CACHE_FREE_RATIO='{ratio}' must be a fraction in [0, 1)" in refused, "it would cache nothing, unsaid"


def test_sync_of_a_path_no_mount_holds_is_refused() -> None:
    assert "/nope: no mount contains this path" in fails(1, "sync", "/nope")
    assert ok("sync").startswith("synced /: 0 uploads waited for")
