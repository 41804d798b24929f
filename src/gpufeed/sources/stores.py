"""Build obstore stores for file://, s3://, gs:// and az:// URLs from a mount's options.

Options a user gives with `--opt key=value` are checked here. The common ones have short
names (`endpoint`, `region`, `anonymous`, `profile`); any other key is passed to obstore as a
store configuration key, which obstore validates, so every store setting stays reachable.
"""

from __future__ import annotations

import difflib
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import SplitResult, urlsplit, urlunsplit

import obstore
from obstore import exceptions as obx
from obstore.store import AzureStore, GCSStore, S3Store

from gpufeed.config import Settings
from gpufeed.errors import GpufeedError, InvalidArgument
from gpufeed.sources import open_source
from gpufeed.sources.base import parse_bool
from gpufeed.sources.local import LocalSource, local_path
from gpufeed.sources.objstore import ObstoreSource

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig


def client_options(settings: Settings, endpoint: str | None = None) -> ClientConfig:
    options: ClientConfig = {
        "connect_timeout": timedelta(seconds=settings.connect_timeout),
        "timeout": timedelta(seconds=settings.request_timeout),
    }
    if endpoint and endpoint.startswith("http://"):
        options["allow_http"] = True
    return options


def retry_config(settings: Settings) -> RetryConfig:
    return {"max_retries": 3, "retry_timeout": timedelta(seconds=settings.retry_timeout)}


def _bucket_and_prefix(parts: SplitResult, url: str) -> tuple[str, str | None]:
    if not parts.netloc:
        raise InvalidArgument(f"{url}: missing bucket name (expected {parts.scheme}://BUCKET/PREFIX)")
    prefix = parts.path.strip("/")
    return parts.netloc, prefix or None


def checked_endpoint(url: str, endpoint: str | None) -> str | None:
    """An endpoint obstore can use, or InvalidArgument naming it: obstore panics on some
    malformed ones (no scheme) instead of raising."""
    if not endpoint:
        return endpoint
    if not endpoint.lower().startswith(("http://", "https://")):
        raise InvalidArgument(f"{url}: endpoint {endpoint!r}: endpoint must start with http:// or https://")
    try:
        parts = urlsplit(endpoint)
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError as exc:
        raise InvalidArgument(f"{url}: endpoint {endpoint!r}: {exc}") from None
    if not parts.hostname:
        raise InvalidArgument(f"{url}: endpoint {endpoint!r}: missing host")
    return endpoint


def _no_options(url: str, options: dict[str, str]) -> None:
    if options:
        raise InvalidArgument(f"{url}: unknown option(s) {', '.join(sorted(options))} for this source kind")


def _construct(
    display_url: str,
    shown_endpoint: str | None,
    canonical: dict[str, str],
    settings: Settings,
    kind: str,
    factory: Any,
    **kwargs: Any,
) -> ObstoreSource:
    display_url = display_url.rstrip("/")
    try:
        store = factory(**kwargs)
    except (obx.UnknownConfigurationKeyError, obx.GenericError, ValueError, TypeError) as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidArgument(f"{display_url}: invalid store configuration ({message})") from exc
    return ObstoreSource(display_url, store, shown_endpoint, canonical, kind=kind, settings=settings)


def local_source(url: str, parts: SplitResult, options: dict[str, str], settings: Settings) -> ObstoreSource:
    if parts.netloc not in ("", "localhost"):
        raise InvalidArgument(f"{url}: file URLs take an absolute path, file:///abs/dir")
    _no_options(url, options)
    root = local_path(parts.path)
    if not root.is_absolute():
        raise InvalidArgument(f"{url}: file URLs take an absolute path, file:///abs/dir")
    if root.is_file():
        raise InvalidArgument(f"{url}: is a file; a mount's source is a directory (file://{root.parent})")
    return LocalSource(f"file://{root}", parts.path, settings=settings)


def s3_source(url: str, parts: SplitResult, options: dict[str, str], settings: Settings) -> ObstoreSource:
    bucket, prefix = _bucket_and_prefix(parts, url)
    config = dict(options)
    endpoint = config.pop("endpoint", None) or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    endpoint = checked_endpoint(url, endpoint)
    kwargs: dict[str, Any] = {"bucket": bucket, "prefix": prefix}
    if endpoint:
        kwargs["endpoint"] = endpoint
    if "region" in config:
        kwargs["region"] = config.pop("region")
    if parse_bool("anonymous", config.pop("anonymous", "false")):
        kwargs["skip_signature"] = True
    profile = config.pop("profile", None) or (
        os.environ.get("AWS_PROFILE") if not os.environ.get("AWS_ACCESS_KEY_ID") else None
    )
    if profile and not kwargs.get("skip_signature"):
        kwargs["credential_provider"] = _profile_credentials(url, profile)
    canonical = dict(options)
    canonical.update({k: v for k, v in (("endpoint", endpoint), ("profile", profile)) if v})
    return _construct(
        f"s3://{bucket}/{prefix or ''}",
        endpoint,
        canonical,
        settings,
        "s3",
        S3Store,
        config=config or None,
        client_options=client_options(settings, endpoint),
        retry_config=retry_config(settings),
        **kwargs,
    )


def _profile_credentials(url: str, profile: str) -> Any:
    try:
        import boto3  # type: ignore[import-untyped]
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        raise InvalidArgument(f"{url}: AWS profile {profile!r} needs boto3: pip install 'gpufeed[aws]'") from None
    try:
        return Boto3CredentialProvider(boto3.Session(profile_name=profile))
    except Exception as exc:  # botocore raises ProfileNotFound and friends, all with clear text
        raise InvalidArgument(f"{url}: AWS profile {profile!r}: {exc}") from exc


def gcs_source(url: str, parts: SplitResult, options: dict[str, str], settings: Settings) -> ObstoreSource:
    bucket, prefix = _bucket_and_prefix(parts, url)
    config = dict(options)
    endpoint = checked_endpoint(url, config.pop("endpoint", None))
    if endpoint:
        config["base_url"] = endpoint
    kwargs: dict[str, Any] = {"bucket": bucket, "prefix": prefix}
    if parse_bool("anonymous", config.pop("anonymous", "false")):
        kwargs["skip_signature"] = True
    return _construct(
        f"gs://{bucket}/{prefix or ''}",
        endpoint,
        dict(options),
        settings,
        "gcs",
        GCSStore,
        config=config or None,
        client_options=client_options(settings, endpoint),
        retry_config=retry_config(settings),
        **kwargs,
    )


def azure_source(url: str, parts: SplitResult, options: dict[str, str], settings: Settings) -> ObstoreSource:
    container, prefix = _bucket_and_prefix(parts, url)
    config = dict(options)
    endpoint = checked_endpoint(url, config.get("endpoint"))
    if "account" in config:
        config["account_name"] = config.pop("account")
    anonymous = parse_bool("anonymous", config.pop("anonymous", "false"))
    store_config: dict[str, str | bool] = {**config, "skip_signature": True} if anonymous else dict(config)
    return _construct(
        f"az://{container}/{prefix or ''}",
        endpoint,
        dict(options),
        settings,
        "azure",
        AzureStore,
        container_name=container,
        prefix=prefix,
        config=store_config or None,
        client_options=client_options(settings, endpoint),
        retry_config=retry_config(settings),
    )


def nearest_prefix(url: str, options: dict[str, str], settings: Settings) -> str | None:
    """The sibling prefix of `url` whose name is closest to its last component, found with
    one delimiter LIST of the parent; None when there is none or the parent cannot be listed."""
    parts = urlsplit(url)
    if parts.scheme.lower() in ("http", "https"):
        return None  # HTTP has no delimiter listing
    parent_path, _, name = parts.path.rstrip("/").rpartition("/")
    if not name:
        return None
    parent_url = urlunsplit(parts._replace(path=parent_path or ("/" if parts.scheme == "file" else "")))
    try:
        store = getattr(open_source(parent_url, options, settings), "store", None)
        if store is None:
            return None
        listing = obstore.list_with_delimiter(store)
    except (GpufeedError, obx.BaseError, OSError):  # a hint only: any failure means no hint
        return None
    names = [prefix.rstrip("/").rpartition("/")[2] for prefix in listing["common_prefixes"]]
    names = [n for n in names if n != name]
    match = difflib.get_close_matches(name, names, n=1)
    return f"{parent_url.rstrip('/')}/{match[0]}" if match else None
