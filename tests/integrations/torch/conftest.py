"""Every PyTorch test starts as a single process: no RANK or WORLD_SIZE from the environment."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def single_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
