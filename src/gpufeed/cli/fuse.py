"""`gpufeed fuse MOUNTPOINT [NSPATH]`, `gpufeed fuse stop MOUNTPOINT`, `gpufeed fuse ls`.

As with `warmup status`, the first word selects `stop` or `ls` (a click sub-command would be
swallowed by the group's MOUNTPOINT argument); a directory called `stop` or `ls` is `./stop`.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from gpufeed.cli.console import out
from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument, NotADirectory
from gpufeed.integrations import fuse_mounts


def fuse(
    words: list[str] = typer.Argument(
        ..., metavar="MOUNTPOINT [NSPATH]", help="MOUNTPOINT [NSPATH], or 'stop MOUNTPOINT', or 'ls'.", show_default=False
    ),
    foreground: bool = typer.Option(False, "--foreground", "-f", help="Serve in this process until unmounted or signalled."),
    warmup: bool = typer.Option(True, "--warmup/--no-warmup", help="Load the mounted path into the cache in the background."),
    read_ahead: bool = typer.Option(
        True, "--read-ahead/--no-read-ahead", help="Fetch the next blocks of a big file while a reader goes through it in order."
    ),
    as_json: bool = typer.Option(False, "--json", help="'ls': print the mounts as JSON."),
) -> None:
    """Mount NSPATH (default /) read-only at MOUNTPOINT: unchanged scripts read through the cache.

    Runs in the background unless --foreground; SIGTERM or SIGINT unmounts. A dead mount at
    MOUNTPOINT (its daemon was killed) is cleaned first. 'gpufeed fuse stop MOUNTPOINT'
    unmounts; 'gpufeed fuse ls' lists the mounts with their daemons' pid, file opens and
    warmup progress. --no-warmup and --no-read-ahead turn off, for this mount, the background
    load of NSPATH and the fetch of the blocks after a sequential reader's."""
    settings = Settings.from_env()
    if words[0] == "ls":
        if len(words) > 1:
            raise InvalidArgument("'fuse ls' takes no arguments")
        _list(settings, as_json)
        return
    if words[0] == "stop":
        if len(words) != 2:
            raise InvalidArgument("usage: gpufeed fuse stop MOUNTPOINT")
        fuse_mounts.stop(settings, Path(words[1]))
        out.print(f"unmounted {Path(words[1]).absolute()}", highlight=False, soft_wrap=True)
        return
    if len(words) > 2:
        raise InvalidArgument("usage: gpufeed fuse MOUNTPOINT [NSPATH]")
    nspath = words[1] if len(words) == 2 else "/"
    from gpufeed.client import Client

    with fuse_mounts.Claim(Path(words[0])) as claim:
        there = fuse_mounts.canonical(Path(words[0]))
        if fuse_mounts.mounted().get(there) == nspath and not fuse_mounts.is_dead(there):
            found = fuse_mounts.state(settings, there) or {}
            daemon = f" (pid {found['pid']})" if "pid" in found else ""
            out.print(f"{nspath} is mounted at {there} already{daemon}", highlight=False, soft_wrap=True)
            return
        mountpoint = fuse_mounts.check(settings, Path(words[0]))
        client = Client(settings)
        if not client.stat(nspath).is_dir:
            raise NotADirectory(f"{nspath}: is a file; mount a directory of the namespace")
        if foreground:
            from gpufeed.integrations.fuse import serve  # loads libfuse

            fuse_mounts.release_when_mounted(claim, mountpoint)
            serve(mountpoint, nspath, warmup=warmup, read_ahead=read_ahead, client=client)
            return
        client.close()
        pid = fuse_mounts.start(settings, mountpoint, nspath, warmup=warmup, read_ahead=read_ahead)
    warming = ", warming it up in the background" if warmup else ""
    warming += "" if read_ahead else ", no read-ahead"
    out.print(
        f"mounted {nspath} at {mountpoint} (pid {pid}{warming}); stop: gpufeed fuse stop {mountpoint}",
        highlight=False,
        soft_wrap=True,
    )


def _list(settings: Settings, as_json: bool) -> None:
    mounts = fuse_mounts.live(settings)
    if as_json:
        rows = [{"mountpoint": str(m.mountpoint), "nspath": m.nspath, "alive": m.alive, **(m.state or {})} for m in mounts]
        out.print_json(json.dumps(rows))
        return
    if not mounts:
        out.print("no gpufeed mounts", highlight=False)
        return
    for m in mounts:
        if m.state is None and m.alive:  # the kernel's table is the host's: another home's daemon serves it
            out.print(f"{m.mountpoint}  {m.nspath}  alive  no state in this GPUFEED_HOME (another home's mount, or starting)",
                      highlight=False, soft_wrap=True)
            continue
        st = m.state or {}
        calls = st.get("calls") or {}
        assert isinstance(calls, dict)
        opens = calls.get("open", 0)
        warm = "off"
        if st.get("warmup"):
            warm = "done" if st.get("warm_done") else f"{st.get('warm_files', 0)}/{st.get('warm_total', 0)} files"
            warm += f" ({st['warm_note']})" if st.get("warm_note") else ""
        status = "alive" if m.alive else "dead (the next 'gpufeed fuse' there cleans it)"
        if st.get("zero_open"):  # the kernel opens files itself: the daemon counts no opens but the first
            per_file = f"reads {calls.get('read', 0)}  opens cost no callback (immutable)"
        else:
            per_file = f"opens {opens}  callbacks per open {sum(calls.values()) / opens if opens else 0:.2f}"
        out.print(
            f"{m.mountpoint}  {m.nspath}  pid {st.get('pid', '?')}  {status}  {per_file}  warmup {warm}"
            f"{'' if st.get('read_ahead', True) else '  read-ahead off'}",
            highlight=False,
            soft_wrap=True,
        )
