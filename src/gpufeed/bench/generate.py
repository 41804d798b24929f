"""Write a dataset of a workload's shape to a local dir or an object store.

Bytes are random so no layer can compress or deduplicate them; npz and JPEG files are valid
for their format (numpy loads the npz; the JPEG is a real 8x8 image whose comment segments
carry the padding), so tools that check formats accept them.
"""

from __future__ import annotations

import io
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import obstore

from gpufeed.bench.workloads import Workload
from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument
from gpufeed.sources import open_source
from gpufeed.sources.objstore import ObstoreSource

EXTENSIONS = {"tfrecord": "tfrecord", "npz": "npz", "jpeg": "jpg"}
MEMORY_IN_FLIGHT = 256 << 20
MAX_WRITERS = 8

# An 8x8 grey baseline JPEG; COM segments holding random bytes go after its APP0 header.
_JPEG = bytes.fromhex(
    "ffd8ffe000104a46494600010100000100010000ffdb004300100b0c0e0c0a100e0d0e1211101318281a181616183123251d28"
    "3a333d3c3933383740485c4e404457453738506d51575f626768673e4d71797064785c656763ffc0000b0800080008010111"
    "00ffc4001f0000010501010101010100000000000000000102030405060708090a0bffc400b5100002010303020403050504"
    "040000017d01020300041105122131410613516107227114328191a1082342b1c11552d1f02433627282090a161718191a25"
    "262728292a3435363738393a434445464748494a535455565758595a636465666768696a737475767778797a838485868788"
    "898a92939495969798999aa2a3a4a5a6a7a8a9aab2b3b4b5b6b7b8b9bac2c3c4c5c6c7c8c9cad2d3d4d5d6d7d8d9dae1e2e3"
    "e4e5e6e7e8e9eaf1f2f3f4f5f6f7f8f9faffda0008010100003f002bffd9"
)
_JPEG_HEADER = 20  # SOI + APP0
_COM_MAX = 65533  # payload bytes one COM segment can hold


@dataclass(frozen=True)
class Generated:
    url: str
    files: int
    bytes: int
    seconds: float


def _random(rng: np.random.Generator, size: int) -> np.ndarray:
    return rng.integers(0, 256, size, dtype=np.uint8)


def _raw(rng: np.random.Generator, size: int) -> memoryview:
    return _random(rng, size).data


def _npz(rng: np.random.Generator, size: int) -> memoryview:
    overhead = len(_savez(np.empty(0, np.uint8)))
    return memoryview(_savez(_random(rng, max(0, size - overhead))))


def _savez(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, x=array)
    return buffer.getvalue()


def _jpeg(rng: np.random.Generator, size: int) -> memoryview:
    padding = max(0, size - len(_JPEG))
    segments = math.ceil(padding / (_COM_MAX + 4))
    payload = max(0, padding - 4 * segments)
    out = bytearray(_JPEG[:_JPEG_HEADER])
    noise = _random(rng, payload).tobytes()
    for start in range(0, payload, _COM_MAX):
        chunk = noise[start : start + _COM_MAX]
        out += b"\xff\xfe" + (len(chunk) + 2).to_bytes(2, "big") + chunk
    out += _JPEG[_JPEG_HEADER:]
    return memoryview(out)


WRITERS: dict[str, Callable[[np.random.Generator, int], memoryview]] = {"tfrecord": _raw, "npz": _npz, "jpeg": _jpeg}


def file_sizes(work: Workload, seed: int) -> list[int]:
    """Bytes of each file: `samples_per_file` records of the mean size, or, for one-sample
    files with a spread (unet3d, cosmoflow), a normal draw clipped to at least 1/4 of the mean."""
    file_bytes = work.samples_per_file * work.record_size
    if work.record_sd == 0 or work.samples_per_file > 1:
        return [file_bytes] * work.files
    draws = np.random.default_rng(seed).normal(work.record_size, work.record_sd, work.files)
    return [int(x) for x in np.maximum(draws, work.record_size // 4)]


def key(work: Workload, index: int) -> str:
    return f"train/part-{index:06d}-of-{work.files:06d}.{EXTENSIONS[work.format]}"


def _destination(url: str, options: dict[str, str], settings: Settings) -> ObstoreSource:
    parts = urlsplit(url)
    if parts.scheme in ("http", "https"):
        raise InvalidArgument(f"{url}: cannot write to an http source; generate into a local dir and serve it")
    if parts.scheme == "file" and parts.path.startswith("/"):
        Path(parts.path).mkdir(parents=True, exist_ok=True)
    source = open_source(url, options, settings)
    if not isinstance(source, ObstoreSource):
        raise InvalidArgument(f"{url}: this source kind cannot be written to")
    return source


def generate(
    work: Workload,
    url: str,
    options: dict[str, str] | None = None,
    *,
    seed: int = 0,
    settings: Settings | None = None,
    written: Callable[[int, int], None] | None = None,
) -> Generated:
    """Write every file of `work` under `url`; files are written in parallel with bounded
    memory (at most MEMORY_IN_FLIGHT of payload at once). `written` hears (files, bytes)
    written so far after each file."""
    settings = settings or Settings.from_env()
    source = _destination(url, dict(options or {}), settings)
    sizes = file_sizes(work, seed)
    write = WRITERS[work.format]
    writers = max(1, min(MAX_WRITERS, MEMORY_IN_FLIGHT // max(sizes)))

    def put(index: int) -> int:
        payload = write(np.random.default_rng((seed, index)), sizes[index])
        try:
            obstore.put(source.store, key(work, index), payload)
        except Exception as exc:  # obstore and OS errors alike get the source's message
            raise source.translate(exc, key(work, index)) from exc
        with lock:
            done[0] += 1
            done[1] += len(payload)
            if written is not None:
                written(done[0], done[1])
        return len(payload)

    lock, done = threading.Lock(), [0, 0]
    started = time.perf_counter()
    with ThreadPoolExecutor(writers) as pool:
        total = sum(pool.map(put, range(work.files)))
    return Generated(source.url, work.files, total, time.perf_counter() - started)
