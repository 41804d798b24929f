"""Fault proxies in front of the suite's real servers. One proxy process per server for the
whole session (starting one costs a Python start-up); each test gets it with no faults set and
its counts at zero, and sets the faults it wants with `configure`."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpufeed.bench.faults import FaultControl, injecting
from tests.conftest import HttpServer


@pytest.fixture(scope="session")
def _nginx_proxy(nginx: HttpServer, server_dir: Path) -> Iterator[FaultControl]:
    with injecting(nginx.url, server_dir / "faults-nginx.log") as proxy:
        yield proxy


@pytest.fixture(scope="session")
def _moto_proxy(moto_endpoint: str, server_dir: Path) -> Iterator[FaultControl]:
    with injecting(moto_endpoint, server_dir / "faults-moto.log") as proxy:
        yield proxy


@pytest.fixture
def nginx_faults(_nginx_proxy: FaultControl) -> FaultControl:
    """The fault proxy in front of nginx, passing everything until configured."""
    _nginx_proxy.configure(seed=0, rates={}, path_filter=None)
    return _nginx_proxy


@pytest.fixture
def moto_faults(_moto_proxy: FaultControl) -> FaultControl:
    """The fault proxy in front of moto's S3 server, passing everything until configured."""
    _moto_proxy.configure(seed=0, rates={}, path_filter=None)
    return _moto_proxy


@dataclass
class Site:
    """A directory of its own under nginx's root: files written here are served at `prefix`."""

    root: Path
    prefix: str


@pytest.fixture
def site(nginx: HttpServer) -> Site:
    name = f"t-{uuid.uuid4().hex[:12]}"
    root = nginx.root / name
    root.mkdir()
    return Site(root, f"/{name}")
