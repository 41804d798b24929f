"""Checks of what callers pass to the public read API, so a mistake is named where it was made
(`read(): offset must be an int, not str`) instead of failing deep inside."""

from __future__ import annotations

import os


def path(value: object, caller: str) -> str:
    """A namespace path from a str or os.PathLike; anything else is the caller's mistake, named."""
    if type(value) is str:
        return value
    if isinstance(value, os.PathLike):
        text = os.fspath(value)
        if isinstance(text, str):
            return text
    raise TypeError(f"{caller}(): path must be a str or os.PathLike[str], not {type(value).__name__}")


def integer(value: object, name: str, caller: str) -> int:
    """An int, or anything that is one (numpy integers: `operator.index`), else a TypeError naming `name`."""
    if type(value) is int:
        return value
    import operator

    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{caller}(): {name} must be an int, not {type(value).__name__}") from None


def mode(value: object, caller: str) -> str:
    """'rb' or 'wb' (letters in any order): gpufeed files are binary, read whole or written whole."""
    if not isinstance(value, str):
        raise TypeError(f"{caller}(): mode must be a str, not {type(value).__name__}")
    if sorted(value) == ["b", "r"]:
        return "rb"
    if sorted(value) == ["b", "w"]:
        return "wb"
    raise ValueError(f"{caller}(): mode {value!r} is not supported: gpufeed files are binary, use 'rb' or 'wb'")
