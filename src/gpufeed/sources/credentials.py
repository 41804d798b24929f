"""The store credentials a reader sends the agent, read from its own environment.

Kept apart from the store builders so a reader finds them without loading obstore.
"""

from __future__ import annotations

import os

from gpufeed.sources.base import parse_bool

_CALLER_CREDENTIALS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("s3://", "s3a://"): ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"),
    ("gs://", "gcs://"): ("GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_KEY", "GOOGLE_APPLICATION_CREDENTIALS"),
    ("az://", "azure://", "abfs://"): (
        "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_SAS_KEY",
        "AZURE_STORAGE_TOKEN",
        "AZURE_CLIENT_ID",
        "AZURE_CLIENT_SECRET",
        "AZURE_TENANT_ID",
    ),
}
"""Per store kind, the environment variables that carry a reader's own credentials. Each is
also the store's config key in lower case (the names obstore reads from the environment)."""


def caller_credentials(url: str, options: dict[str, str]) -> dict[str, str]:
    """The store credentials in this process's environment, as store options. A client sends
    them with each request to the node agent (same user only), so the agent reads with the
    reader's identity instead of whatever its own environment held when it started; they are
    never written to the metadata engine. S3 keys go only as a pair with their key id, and
    none go for a mount whose options hold credentials of their own."""
    if parse_bool("anonymous", options.get("anonymous", "false")):
        return {}
    names = next((names for schemes, names in _CALLER_CREDENTIALS.items() if url.startswith(schemes)), ())
    if {_bare(key) for key in options} & {_bare(name) for name in names}:
        return {}  # the mount names its own credentials: the caller's are not mixed in
    found = {name.lower(): os.environ[name] for name in names if os.environ.get(name)}
    if url.startswith(("s3://", "s3a://")) and "aws_access_key_id" not in found:
        return {}
    return found


def _bare(key: str) -> str:
    """A credential's name without its cloud's prefix: `access_key_id` and `AWS_ACCESS_KEY_ID`
    are one setting to obstore, which refuses to be given both."""
    key = key.lower()
    for prefix in ("aws_", "google_", "azure_storage_", "azure_"):
        key = key.removeprefix(prefix)
    return key
