"""`gpufeed mount add|ls|rm|refresh`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from gpufeed.cli.console import command_group, counted, echo, out, print_json, when
from gpufeed.cli.progress import Meter
from gpufeed.config import human_bytes

if TYPE_CHECKING:  # the namespace and its engines are imported by the command that runs
    from gpufeed.config import Settings
    from gpufeed.meta import Mount
    from gpufeed.meta.manifest import ManifestStats

app = command_group(help="Mount stores into the namespace and manage their manifests.", no_args_is_help=True)


def _summary(stats: ManifestStats) -> str:
    text = f"{counted(stats.files, 'file')}, {human_bytes(stats.bytes)}"
    if stats.skipped:
        text += f"; skipped {counted(stats.skipped, 'key')} no path can name ('.', '..' or empty components)"
    if stats.unhashed is not None:
        unlisted = counted(stats.unlisted or 0, "hash", "hashes")
        text += f"; {counted(stats.unhashed, 'listed file')} without a hash, {unlisted} naming no listed object"
    if stats.kept_hashes:
        text += f"; kept {counted(stats.kept_hashes, 'content hash', 'content hashes')} of unchanged objects"
    return text


def _secret(option: str) -> bool:
    """Options whose values are credentials (account_key, sas_key, secret_access_key, token…)."""
    return any(word in option.lower() for word in ("key", "secret", "token", "password", "credential"))


@app.command("add")
def add(
    nspath: str = typer.Argument(..., help="Namespace path to mount at, e.g. /data."),
    url: str = typer.Argument(..., help="A local dir (or file:///dir), s3://bucket/prefix, gs://…, az://…, http(s)://host/prefix"),
    opt: list[str] = typer.Option([], "--opt", "-o", help="Source option key=value (repeatable)."),
    immutable: bool = typer.Option(
        False,
        "--immutable",
        help="Promise that objects never change, so reads skip version checks: if one does change, its uncached "
        "blocks come back with the new bytes (beside cached old ones); a short read still fails. Without this or "
        "--max-age (strict), reads return only the listed version: its cached blocks are served, and a block "
        "the store must send fails until 'gpufeed mount refresh'.",
    ),
    max_age: float | None = typer.Option(
        None,
        "--max-age",
        help="Trust the listing this many seconds; after that every open checks the object with one HEAD and "
        "reads its current version. An open file keeps the version it opened with, as in strict mode.",
    ),
    listing: str | None = typer.Option(
        None, "--list", help="http(s) only: file listing 'KEY [SIZE]' per line (KEY, a tab, SIZE for a key with spaces)."
    ),
    checksums: str | None = typer.Option(
        None,
        "--checksums",
        help="sha256sum/md5sum output (a line per file: its hex digest, two spaces, its path relative to the source root): "
        "content hashes.",
    ),
    allow_empty: bool = typer.Option(False, "--allow-empty", help="Mount even when the listing finds no objects."),
    writable: bool = typer.Option(
        False, "--writable", help="Allow writes through gpufeed (staged on this node, uploaded in the background); "
        "file, s3, gs and az sources."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr; errors still print."),
    as_json: bool = typer.Option(False, "--json", help="Print the mount and its counts as one JSON object."),
) -> None:
    """List a source once into a manifest and mount it."""
    from gpufeed.mount_options import parse_options
    from gpufeed.namespace import Namespace

    options = parse_options(opt)
    if listing is not None:
        options["list"] = listing
    with Meter("mount add: listed", quiet=quiet, unit="objects", listing=True) as meter:
        mount, stats = Namespace().add_mount(
            nspath,
            url,
            options,
            immutable=immutable,
            max_age=max_age,
            checksums=checksums,
            allow_empty=allow_empty,
            writable=writable,
            listed=lambda s: meter.update(s.files, s.bytes),
        )
    if as_json:
        counts = {"files": stats.files, "bytes": stats.bytes, "skipped": stats.skipped, "shadowed": stats.shadowed}
        if stats.unhashed is not None:  # with --checksums: listed files it has no hash for, its hashes naming no file
            counts |= {"unhashed": stats.unhashed, "unlisted": stats.unlisted or 0}
        print_json({**_record(mount), **counts})
        return
    out.print(f"mounted {mount.url} at {mount.path}: {_summary(stats)}", highlight=False)


def _record(m: Mount) -> dict[str, Any]:
    """A mount as `mount ls` shows it: credentials masked, every other value in full."""
    return {
        "path": m.path,
        "source": m.url,
        "policy": "immutable" if m.immutable else (f"max-age {m.max_age:g}s" if m.max_age is not None else "strict"),
        "options": {k: "***" if _secret(k) else v for k, v in sorted(m.options.items())},
        "listed_at": m.listed_at,
        "generation": m.generation,
    }


@app.command("ls")
def ls(as_json: bool = typer.Option(False, "--json", help="One JSON array of mount records.")) -> None:
    """Show every mount, every value in full (one field per line, never cut to the terminal)."""
    from gpufeed.namespace import Namespace

    records = [_record(m) for m in Namespace().mounts()]
    if as_json:
        print_json(records, indent=2)
        return
    if not records:
        out.print("no mounts (add one with 'gpufeed mount add /data URL')")
        return
    blocks = []
    for r in records:
        lines = [r["path"], f"  source:   {r['source']}", f"  policy:   {r['policy']}"]
        lines += [f"  option:   {k}={v}" for k, v in r["options"].items()]
        lines.append(f"  listed:   {when(r['listed_at'])} (manifest generation {r['generation']})")
        blocks.append("\n".join(lines))
    echo("\n\n".join(blocks))


@app.command("rm")
def rm(
    nspath: str = typer.Argument(..., help="Mount path to remove."),
    force: bool = typer.Option(False, "--force", help="Remove it even while a gpufeed fuse view of it is served."),
) -> None:
    """Unmount a path and drop its manifest (the source is untouched). Refused while this home's
    `gpufeed fuse` serves a view of it, whose files would vanish under its readers."""
    from gpufeed.namespace import Namespace

    namespace = Namespace()
    mount = namespace.mount(nspath)
    if not force:
        _refuse_if_served(namespace.settings, mount.path)
    mount = namespace.remove_mount(mount.path)
    out.print(f"removed mount {mount.path} ({mount.url})", highlight=False)


def _refuse_if_served(settings: Settings, path: str) -> None:
    from gpufeed.errors import GpufeedError, MountConflict
    from gpufeed.integrations.fuse_mounts import live
    from gpufeed.paths import normalize
    from gpufeed.processes import alive

    for view in live(settings):
        try:
            nspath = normalize(view.nspath)
        except GpufeedError:
            continue
        inside = f"{path}/".startswith(f"{nspath.rstrip('/')}/") or nspath.startswith(f"{path}/")
        pid = view.state.get("pid") if view.state is not None else None  # a state file here: this home's daemon
        ours = isinstance(pid, int) and pid > 0 and alive(pid) and view.alive
        if inside and ours:
            raise MountConflict(
                f"{path}: gpufeed fuse serves it at {view.mountpoint}; stop that first "
                f"('gpufeed fuse stop {view.mountpoint}'), or remove the mount anyway with --force"
            )


@app.command("refresh")
def refresh(
    nspath: str = typer.Argument(..., help="Mount path to re-list."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr; errors still print."),
    allow_empty: bool = typer.Option(False, "--allow-empty", help="Empty the mount when the listing finds no objects."),
) -> None:
    """Re-list the source and switch to the new manifest atomically."""
    from gpufeed.namespace import Namespace

    with Meter("mount refresh: listed", quiet=quiet, unit="objects", listing=True) as meter:
        mount, stats = Namespace().refresh(nspath, lambda s: meter.update(s.files, s.bytes), allow_empty=allow_empty)
    out.print(
        f"refreshed {mount.path}: {stats.added} added, {stats.changed} changed, {stats.removed} removed ({_summary(stats)})",
        highlight=False,
    )
