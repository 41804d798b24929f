"""Real servers for the suite: moto's S3 server, redis-server and nginx, each on a free
loopback port, started once per session. A missing server binary fails the run (the README's
test command installs them); nothing here is skipped silently."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpufeed.bench.children import free_port, helper
from gpufeed.client.connection import stop_agent
from gpufeed.config import Settings
from gpufeed.namespace import Namespace

# A suite started in the background by a shell inherits Ctrl-C ignored, and so would every
# process it starts (an ignored signal stays ignored across exec): the tests of what Ctrl-C does
# send it to processes that must take it as a user's terminal would.
signal.signal(signal.SIGINT, signal.default_int_handler)


def need_binary(name: str) -> str:
    """A server binary from PATH, the running interpreter's bin dir (moto_server in a venv) or sbin."""
    search = os.pathsep.join([os.environ.get("PATH", ""), os.path.dirname(sys.executable), "/usr/sbin", "/sbin"])
    path = shutil.which(name, path=search)
    if path is None:
        pytest.fail(f"{name} is not installed; run the README's test command (scripts/test)")
    return path


@pytest.fixture(scope="session")
def server_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("servers")


AWS_TEST_ENV = {
    "AWS_METADATA_ENDPOINT": "http://127.0.0.1:9",  # never the cloud's instance-metadata address
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def moto_endpoint(server_dir: Path) -> Iterator[str]:
    """moto's S3-compatible server; credentials are the usual AWS_* variables."""
    os.environ.update(AWS_TEST_ENV)
    os.environ.pop("AWS_PROFILE", None)
    port = free_port()
    argv = [need_binary("moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    with helper(argv, "moto_server", server_dir / "moto.log", port=port):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def moto_auth_endpoint(server_dir: Path) -> Iterator[str]:
    """A second moto server that checks credentials from the first request (no IAM users exist)."""
    port = free_port()
    argv = [need_binary("moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    env = {**AWS_TEST_ENV, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    with helper(argv, "moto_server (auth)", server_dir / "moto-auth.log", port=port, env=env):
        yield f"http://127.0.0.1:{port}"


@dataclass
class Bucket:
    name: str
    endpoint: str
    client: object

    @property
    def url(self) -> str:
        return f"s3://{self.name}"

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.name, Key=key, Body=data)  # type: ignore[attr-defined]

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.name, Key=key)  # type: ignore[attr-defined]


@pytest.fixture
def bucket(moto_endpoint: str) -> Bucket:
    import boto3

    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    name = f"b-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return Bucket(name, moto_endpoint, client)


@pytest.fixture(scope="session")
def redis_url(server_dir: Path) -> Iterator[str]:
    port = free_port()
    argv = [need_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    with helper(argv, "redis-server", server_dir / "redis.log", port=port):
        yield f"redis://127.0.0.1:{port}/0"


@dataclass
class HttpServer:
    root: Path
    url: str
    access_log: Path


@pytest.fixture(scope="session")
def nginx(server_dir: Path) -> Iterator[HttpServer]:
    """nginx serving a directory with a JSON autoindex and byte ranges, logging every request."""
    from gpufeed.bench.server import find_nginx, serving

    if find_nginx() is None:
        need_binary("nginx")
    root = server_dir / "www"
    root.mkdir()
    log = server_dir / "nginx" / "access.log"
    with serving(root, server_dir / "nginx", access_log=log) as url:
        yield HttpServer(root, url, log)


@pytest.fixture(autouse=True)
def gpufeed_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test gets its own GPUFEED_HOME (and so its own cache and agent) and the SQLite
    engine unless it asks otherwise; the agent a test started is stopped after it."""
    home = tmp_path / "gpufeed-home"
    monkeypatch.setenv("GPUFEED_AGENT_IDLE_TIMEOUT", "30")
    monkeypatch.setenv("GPUFEED_HOME", str(home))
    monkeypatch.delenv("GPUFEED_META", raising=False)
    monkeypatch.setenv("GPUFEED_CONNECT_TIMEOUT", "2")
    monkeypatch.setenv("GPUFEED_RETRY_TIMEOUT", "3")
    for name, value in AWS_TEST_ENV.items():  # never fall back to the cloud's instance-metadata endpoint
        monkeypatch.setenv(name, value)
    import gpufeed

    gpufeed._default = None
    yield home
    gpufeed._default = None
    stop_agent(Settings.from_env())


@pytest.fixture(params=["sqlite", "redis"])
def meta_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The metadata engine URL for each engine; Redis runs get a key prefix of their own."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'meta.db'}"
    base = request.getfixturevalue("redis_url")
    return f"{base}?prefix=t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def namespace(meta_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Namespace]:
    monkeypatch.setenv("GPUFEED_META", meta_url)
    ns = Namespace(Settings.from_env())
    yield ns
    ns.close()


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """A small tree: 2 top files, a nested dir, an empty file."""
    root = tmp_path / "dataset"
    (root / "train" / "cats").mkdir(parents=True)
    (root / "train" / "dogs").mkdir(parents=True)
    (root / "README").write_bytes(b"readme\n")
    (root / "empty.bin").write_bytes(b"")
    for i in range(3):
        (root / "train" / "cats" / f"{i}.jpg").write_bytes(bytes([i]) * (1000 + i))
        (root / "train" / "dogs" / f"{i}.jpg").write_bytes(bytes([100 + i]) * (2000 + i))
    return root
