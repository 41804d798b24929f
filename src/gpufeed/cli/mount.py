"""`gpufeed mount add|ls|rm|refresh`."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from gpufeed.cli.console import human_bytes, out, when
from gpufeed.meta.manifest import ManifestStats
from gpufeed.namespace import Namespace, parse_options

app = typer.Typer(help="Mount stores into the namespace and manage their manifests.", no_args_is_help=True)


def _summary(stats: ManifestStats) -> str:
    text = f"{stats.files} files, {human_bytes(stats.bytes)}"
    if stats.skipped:
        text += f"; skipped {stats.skipped} keys no path can name ('.', '..' or empty components)"
    return text


def _secret(option: str) -> bool:
    """Options whose values are credentials (account_key, sas_key, secret_access_key, token…)."""
    return any(word in option.lower() for word in ("key", "secret", "token", "password", "credential"))


@app.command("add")
def add(
    nspath: str = typer.Argument(..., help="Namespace path to mount at, e.g. /data."),
    url: str = typer.Argument(..., help="file:///dir, s3://bucket/prefix, gs://…, az://…, http(s)://host/prefix"),
    opt: list[str] = typer.Option([], "--opt", "-o", help="Source option key=value (repeatable)."),
    immutable: bool = typer.Option(
        False,
        "--immutable",
        help="Promise that objects never change, so reads skip version checks: if one does change, its uncached "
        "blocks come back with the new bytes (beside cached old ones); a short read still fails. Without this or "
        "--max-age (strict), reads return only the listed version: its cached blocks are served, and a block "
        "the store must send fails until 'gpufeed mount refresh'.",
    ),
    max_age: Optional[float] = typer.Option(
        None,
        "--max-age",
        help="Trust the listing this many seconds; after that every open checks the object with one HEAD and "
        "reads its current version. An open file keeps the version it opened with, as in strict mode.",
    ),
    listing: Optional[str] = typer.Option(None, "--list", help="http(s) only: file listing 'KEY [SIZE]' per line."),
) -> None:
    """List a source once into a manifest and mount it."""
    options = parse_options(opt)
    if listing is not None:
        options["list"] = listing
    mount, stats = Namespace().add_mount(nspath, url, options, immutable=immutable, max_age=max_age)
    out.print(f"mounted {mount.url} at {mount.path}: {_summary(stats)}", highlight=False)


@app.command("ls")
def ls() -> None:
    """Show every mount."""
    mounts = Namespace().mounts()
    if not mounts:
        out.print("no mounts (add one with 'gpufeed mount add /data URL')")
        return
    table = Table("path", "source", "policy", "options", "listed", box=None)
    for m in mounts:
        policy = "immutable" if m.immutable else (f"max-age {m.max_age:g}s" if m.max_age is not None else "strict")
        options = " ".join(f"{k}={'***' if _secret(k) else v}" for k, v in sorted(m.options.items())) or "-"
        table.add_row(m.path, m.url, policy, options, when(m.listed_at))
    out.print(table)


@app.command("rm")
def rm(nspath: str = typer.Argument(..., help="Mount path to remove.")) -> None:
    """Unmount a path and drop its manifest (the source is untouched)."""
    mount = Namespace().remove_mount(nspath)
    out.print(f"removed mount {mount.path} ({mount.url})", highlight=False)


@app.command("refresh")
def refresh(nspath: str = typer.Argument(..., help="Mount path to re-list.")) -> None:
    """Re-list the source and switch to the new manifest atomically."""
    mount, stats = Namespace().refresh(nspath)
    out.print(
        f"refreshed {mount.path}: {stats.added} added, {stats.changed} changed, {stats.removed} removed "
        f"({_summary(stats)})",
        highlight=False,
    )
