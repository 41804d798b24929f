"""The write tests' stores: moto (tests/conftest.py) and the fault proxy in front of it."""

from __future__ import annotations

from tests.faults.conftest import _moto_proxy, moto_faults

__all__ = ["_moto_proxy", "moto_faults"]
