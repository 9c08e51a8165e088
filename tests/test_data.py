"""tests/data is what its SHA256SUMS lists: every file with its sha256, nothing unlisted. A
changed fixture would silently change what the real-model tests prove."""

from __future__ import annotations

import hashlib

from .helpers import DATA, MODELS

UNLISTED = {"README.md", "SHA256SUMS"}


def test_every_file_matches_its_sha256():
    listed = dict(
        reversed(line.split("  ", 1)) for line in (DATA / "SHA256SUMS").read_text().splitlines()
    )
    found = {p.relative_to(DATA).as_posix() for p in DATA.rglob("*") if p.is_file()}
    assert found - UNLISTED == set(listed)
    for name, digest in listed.items():
        assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == digest, name


def test_every_model_folder_states_its_provenance():
    folders = [p for p in MODELS.iterdir() if p.is_dir()]
    assert len(folders) == 4
    assert all((p / "PROVENANCE.txt").is_file() for p in folders)
