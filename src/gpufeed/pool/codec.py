"""How arguments and results cross to a hosted callable (`remote`) and back."""

from __future__ import annotations

import sys
from typing import Any


class CpuTensor:
    """A CPU torch tensor crossing to or from a hosted callable as its numpy array: Ray moves
    numpy arrays without pickling them (zero-copy from its object store when large), while a
    tensor goes through torch's pickling, about twice the cost of a small call on loopback."""

    def __init__(self, array: Any) -> None:
        self.array = array

    def tensor(self) -> Any:
        import torch

        array = self.array if self.array.flags.writeable else self.array.copy()  # the store's buffers are read-only
        return torch.from_numpy(array)


def pack(value: Any) -> Any:
    """`value` ready to send: a CPU tensor (alone or in a tuple or list) as a `CpuTensor`."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.requires_grad:
        return CpuTensor(value.numpy())
    if isinstance(value, tuple | list):
        return type(value)(pack(v) for v in value)
    return value


def unpack(value: Any) -> Any:
    if isinstance(value, CpuTensor):
        return value.tensor()
    if isinstance(value, tuple | list):
        return type(value)(unpack(v) for v in value)
    return value
