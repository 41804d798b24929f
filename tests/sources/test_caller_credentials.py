"""A reader's own store credentials travel to the node agent as store options, for every
cloud kind, and the store accepts them (the S3 path is also tested end to end in
tests/agent/test_agent.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

import gpufeed
from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument
from gpufeed.namespace import Namespace
from gpufeed.sources import open_source
from gpufeed.sources.credentials import caller_credentials
from tests.conftest import Bucket


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No cloud credentials but those a test sets (the metadata endpoint stays on loopback)."""
    for name in list(os.environ):
        if name.startswith(("AWS_", "GOOGLE_", "AZURE_")) and name != "AWS_METADATA_ENDPOINT":
            monkeypatch.delenv(name)
    return monkeypatch


def service_account_key() -> str:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return json.dumps(
        {
            "type": "service_account",
            "private_key": pem.decode(),
            "private_key_id": "1",
            "client_email": "reader@project.iam.gserviceaccount.com",
            "token_uri": "http://127.0.0.1:9/token",
        }
    )


def test_a_gcs_readers_service_account_goes_with_the_request(env: pytest.MonkeyPatch) -> None:
    account = service_account_key()
    env.setenv("GOOGLE_SERVICE_ACCOUNT_KEY", account)
    env.setenv("AWS_ACCESS_KEY_ID", "not-for-gcs")
    sent = caller_credentials("gs://bucket/p", {})
    assert sent == {"google_service_account_key": account}
    assert open_source("gs://bucket/p", sent, Settings.from_env()).url == "gs://bucket/p"


def test_an_azure_readers_key_sas_and_service_principal_go_with_the_request(env: pytest.MonkeyPatch) -> None:
    env.setenv("AZURE_STORAGE_ACCOUNT_KEY", "a2V5")
    env.setenv("AZURE_STORAGE_SAS_KEY", "sv=2024-01-01&sig=x")
    env.setenv("AZURE_CLIENT_ID", "id")
    env.setenv("AZURE_CLIENT_SECRET", "secret")
    env.setenv("AZURE_TENANT_ID", "tenant")
    options = {"account": "acct"}
    sent = caller_credentials("az://container/p", options)
    assert sent == {
        "azure_storage_account_key": "a2V5",
        "azure_storage_sas_key": "sv=2024-01-01&sig=x",
        "azure_client_id": "id",
        "azure_client_secret": "secret",
        "azure_tenant_id": "tenant",
    }
    assert caller_credentials("abfs://container/p", options) == sent
    assert open_source("az://container/p", {**options, **sent}, Settings.from_env()).url == "az://container/p"


def test_a_broken_gcs_credential_is_one_error_naming_the_store_and_the_file(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    env.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(missing))
    sent = caller_credentials("gs://bucket/p", {})
    with pytest.raises(InvalidArgument) as failure:
        open_source("gs://bucket/p", sent, Settings.from_env())
    message = str(failure.value)
    assert message.startswith("gs://bucket/p:") and str(missing) in message and "\n" not in message


def test_s3_keys_go_only_with_their_key_id_and_anonymous_mounts_send_nothing(env: pytest.MonkeyPatch) -> None:
    env.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    assert caller_credentials("s3://bucket/p", {}) == {}
    env.setenv("AWS_ACCESS_KEY_ID", "id")
    assert caller_credentials("s3://bucket/p", {}) == {"aws_access_key_id": "id", "aws_secret_access_key": "secret"}
    assert caller_credentials("s3://bucket/p", {"anonymous": "true"}) == {}
    env.setenv("AZURE_STORAGE_TOKEN", "token")
    assert caller_credentials("gs://bucket/p", {"anonymous": "true"}) == {}
    assert caller_credentials("file:///data", {}) == {}
    assert caller_credentials("https://host/data", {}) == {}


def test_a_mount_with_its_own_keys_reads_while_the_caller_has_others(
    bucket: Bucket, env: pytest.MonkeyPatch, gpufeed_home: Path
) -> None:
    """obstore refuses `access_key_id` beside `aws_access_key_id`: the mount's keys win, and the
    reader's are not sent at all (no mixing of one identity's key with another's token)."""
    env.setenv("AWS_ACCESS_KEY_ID", "caller-id")
    env.setenv("AWS_SECRET_ACCESS_KEY", "caller-secret")
    env.setenv("AWS_SESSION_TOKEN", "caller-token")
    options = {"endpoint": bucket.endpoint, "access_key_id": "mount-id", "secret_access_key": "mount-secret"}
    assert caller_credentials(bucket.url, options) == {}
    bucket.put("own.bin", b"own keys" * 100)
    Namespace().add_mount("/own", bucket.url, options)
    assert gpufeed.read("/own/own.bin") == b"own keys" * 100
