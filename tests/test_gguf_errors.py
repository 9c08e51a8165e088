"""Bad GGUF input: one line on stderr, exit 2, nothing written (convert's CLI), for a truncated
file, an unknown or unsupported tensor type, an unsupported tokenizer and metadata that
contradicts the tensors."""

from __future__ import annotations

import struct
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest

from mlx_speculate.convert import main
from mlx_speculate.gguf import tokenizer as gguf_tokenizer

from .test_gguf import HEADS, hf_state_dict, write_gguf

Q = gguf.GGMLQuantizationType


@pytest.fixture
def no_tokenizer_needed(monkeypatch) -> None:
    """The tiny files carry no vocabulary: stand in for the tokenizer where it is not tested."""
    stand_in = SimpleNamespace(save=lambda out: None)
    monkeypatch.setattr(gguf_tokenizer, "read_gguf_tokenizer", lambda src: stand_in)


def convert_fails(tmp_path: Path, src: Path, capsys, message: str) -> str:
    dst = tmp_path / "out" / "model"
    assert main(["--hf-path", str(src), "--mlx-path", str(dst), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not dst.exists()
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
    return err


def test_truncated_file(tmp_path, capsys, no_tokenizer_needed) -> None:
    write_gguf(tmp_path / "m.gguf", hf_state_dict(tied=True), quant=Q.Q4_0)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) * 3 // 4])
    convert_fails(tmp_path, tmp_path / "cut.gguf", capsys, "past the end of the file")


@pytest.mark.parametrize("where", ["after the header", "inside the header"])
def test_a_file_cut_at_its_header_is_one_plain_sentence(tmp_path, capsys, where) -> None:
    """A download stopped at the end of the header (or within it) says so, with no struct or
    offset arithmetic in the message."""
    from mlx_speculate.gguf.header import read_header

    write_gguf(tmp_path / "m.gguf", hf_state_dict(tied=True))
    data = (tmp_path / "m.gguf").read_bytes()
    end = min(t.offset for t in read_header(tmp_path / "m.gguf").tensors)  # the data section
    cut = end if where == "after the header" else 30
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    expected = {
        "after the header": f"cut.gguf is truncated: it ends after its header, at byte {cut}, "
        "with none of its",
        "inside the header": f"cut.gguf is truncated: the file ends at byte {cut}, inside its "
        "header",
    }[where]
    err = convert_fails(tmp_path, tmp_path / "cut.gguf", capsys, expected)
    assert "unpack" not in err and "buffer" not in err


def set_tensor_type(path: Path, name: str, kind: int) -> None:
    """Overwrite the type id of tensor `name` in the header (name, n_dims, dims, type)."""
    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, kind)
    path.write_bytes(bytes(data))


def test_unknown_tensor_type(tmp_path, capsys, no_tokenizer_needed) -> None:
    write_gguf(tmp_path / "m.gguf", hf_state_dict(tied=True))
    set_tensor_type(tmp_path / "m.gguf", "blk.0.attn_q.weight", 99)
    convert_fails(
        tmp_path,
        tmp_path / "m.gguf",
        capsys,
        "'blk.0.attn_q.weight' has unknown GGUF tensor type 99",
    )


def test_tensor_type_nothing_dequantizes(tmp_path, capsys, no_tokenizer_needed) -> None:
    write_gguf(tmp_path / "m.gguf", hf_state_dict(tied=True))
    set_tensor_type(tmp_path / "m.gguf", "output_norm.weight", int(Q.I32))  # same size as F32
    convert_fails(
        tmp_path, tmp_path / "m.gguf", capsys,
        "tensor 'output_norm.weight' has GGUF type I32, which is not supported (supported: F32,",
    )  # fmt: skip


def test_unsupported_tokenizer(tmp_path, capsys) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(
        path, hf_state_dict(tied=True),
        metadata={"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a", "b"]},
    )  # fmt: skip
    convert_fails(
        tmp_path, path, capsys, "GGUF tokenizer model 'bert' is not supported (supported: 'llama'"
    )


@pytest.mark.parametrize(
    "metadata, message",
    [
        ({"llama.attention.head_count": HEADS * 2}, "rotary dimension 16 differs from head"),
        (
            {"llama.attention.head_count": HEADS * 2, "llama.attention.key_length": 16},
            "'blk.0.attn_q.weight' has shape (64, 64), but the metadata implies (128, 64)",
        ),
        (
            {"llama.embedding_length": 32, "llama.attention.key_length": 16},
            "the metadata contradicts the tensors",
        ),
        ({"llama.feed_forward_length": 64}, "the metadata contradicts the tensors"),
        ({"llama.block_count": 3}, "the metadata states 3 layers, the tensors hold 2"),
        ({"llama.block_count": 1}, "is past the 1 layers the metadata states"),
    ],
    ids=["rotary", "heads", "hidden", "ffn", "more-layers", "fewer-layers"],
)
def test_metadata_contradicting_tensors(
    tmp_path, capsys, no_tokenizer_needed, metadata, message
) -> None:
    write_gguf(tmp_path / "m.gguf", hf_state_dict(tied=True), metadata=metadata)
    convert_fails(tmp_path, tmp_path / "m.gguf", capsys, message)


def test_a_valid_tiny_file_converts(tmp_path, no_tokenizer_needed) -> None:
    # Guards the tests above: the same files, unbroken, convert.
    write_gguf(tmp_path / "m.gguf", hf_state_dict(tied=True), quant=Q.Q4_0)
    assert main(["--hf-path", str(tmp_path / "m.gguf"), "--mlx-path", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "model.safetensors").is_file()
