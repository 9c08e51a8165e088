"""A GGUF's tokenizer as Hugging Face tokenizer files, rebuilt from the file's own metadata.

llama.cpp stores the vocabulary, merges, token types and special ids as metadata. This module
builds the tokenizer llama.cpp runs from them with the `tokenizers` library alone (transformers'
GGUF reader needs torch, which converting must not):
- "llama" (SentencePiece BPE): pieces spelled with U+2581; a leading one is prepended and spaces
  are replaced by it (llama.cpp's add_space_prefix); characters no piece covers fall back to the
  `<0xXX>` byte pieces; merges come from the file or, as SentencePiece ranks them, from the
  scores of the pieces they make.
- "gpt2" (byte-level BPE): the text is split by the regex llama.cpp uses for the file's
  `tokenizer.ggml.pre`, then merged by the file's merge ranks.
Control tokens (type 3) become special tokens and user-defined ones (type 4) added tokens: both
are matched whole before the model sees the text, as llama.cpp does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers as pre
from tokenizers.processors import TemplateProcessing

from .header import read_metadata

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types
_SPACE = "\u2581"
_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")

# llama.cpp's split regexes (llama-vocab.cpp, llm_tokenizer_bpe), by `tokenizer.ggml.pre`.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("gpt2", "mpt", "olmo"), (_GPT2,)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "stablelm2"), (_QWEN2,)),
    # Digits one by one, then GPT-2's rule.
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell"), (r"\p{N}", _GPT2)),
}
# Llama 3 style vocabularies take a whole split piece that is a token as is, merges or not.
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe"}


@dataclass(frozen=True)
class GGUFTokenizer:
    """A GGUF's tokenizer, built and ready to be written."""

    wrapper: Any  # transformers.PreTrainedTokenizerFast
    chat_template: str | None
    generation: dict[str, Any]  # generation_config.json: the BOS and EOS ids

    def save(self, out_dir: str | Path) -> None:
        """HF tokenizer files (`tokenizer.json`, `tokenizer_config.json` with the chat
        template) plus `generation_config.json`."""
        out_dir = Path(out_dir)
        try:
            self.wrapper.save_pretrained(out_dir)
        except Exception as e:  # tokenizers reports I/O errors (a full disk, ...) as Exception
            raise OSError(f"cannot write the tokenizer into {out_dir}: {e}") from e
        config_path = out_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        if self.chat_template is not None:
            # transformers 5 saves the template only to chat_template.jinja; older loaders
            # read it here.
            config.setdefault("chat_template", self.chat_template)
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        text = json.dumps(self.generation, indent=2) + "\n"
        (out_dir / "generation_config.json").write_text(text)


def read_gguf_tokenizer(path: str | Path) -> GGUFTokenizer:
    """The GGUF's tokenizer; an unsupported one is a ValueError naming what is supported."""
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    metadata = read_metadata(path, _ARRAYS + ("tokenizer.ggml.merges",))
    tokenizer, add_bos = build_tokenizer(metadata, path)
    tokens = metadata["tokenizer.ggml.tokens"]

    def special(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    template = metadata.get("tokenizer.chat_template")
    wrapper = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=special("bos"),
        eos_token=special("eos"),
        unk_token=special("unknown"),
        pad_token=special("padding"),
        add_bos_token=add_bos,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        chat_template=template,
    )
    generation = {
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
    }
    return GGUFTokenizer(wrapper, template, generation)


def write_gguf_tokenizer(path: str | Path, out_dir: str | Path) -> None:
    """Writes the GGUF's tokenizer into `out_dir` (see GGUFTokenizer.save)."""
    read_gguf_tokenizer(path).save(out_dir)


def build_tokenizer(metadata: dict[str, Any], path: Path) -> tuple[Tokenizer, bool]:
    """The tokenizer the metadata describes, and whether it adds BOS to a text."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"{path}: GGUF metadata holds no tokenizer vocabulary")
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "llama":
        tokenizer = _sentencepiece(metadata, tokens, types)
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", True)
    elif kind == "gpt2":
        tokenizer = _byte_level(metadata, tokens, path)
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", False)
    else:
        raise ValueError(
            f"{path}: GGUF tokenizer model {kind!r} is not supported (supported: 'llama', 'gpt2')"
        )
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _USER_DEFINED
        ]
    )
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    if add_bos and bos is not None:
        tokenizer.post_processor = TemplateProcessing(
            single=f"{tokens[bos]} $A",
            pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)],
        )
    return tokenizer, bool(add_bos)


def _sentencepiece(metadata: dict[str, Any], tokens: list[str], types: list[int]) -> Tokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = _file_merges(metadata) or _merges_by_score(
        tokens, types, metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    )
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab,
            merges,
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [normalizers.Replace(" ", _SPACE)]
    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend(_SPACE))
    tokenizer.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        decode.append(decoders.Strip(" ", 1, 0))  # the prepended space
    tokenizer.decoder = decoders.Sequence(decode)
    return tokenizer


def _byte_level(metadata: dict[str, Any], tokens: list[str], path: Path) -> Tokenizer:
    name = metadata.get("tokenizer.ggml.pre", "gpt2")
    if name not in _SPLITS:
        raise ValueError(
            f"{path}: GGUF pre-tokenizer {name!r} is not supported "
            f"(supported: {', '.join(sorted(_SPLITS))})"
        )
    merges = _file_merges(metadata)
    if merges is None:
        raise ValueError(f"{path}: a byte-level BPE GGUF needs 'tokenizer.ggml.merges'")
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=name in _IGNORE_MERGES))
    splits = [pre.Split(Regex(regex), behavior="isolated") for regex in _SPLITS[name]]
    tokenizer.pre_tokenizer = pre.Sequence(
        [*splits, pre.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _file_merges(metadata: dict[str, Any]) -> list[tuple[str, str]] | None:
    merges = metadata.get("tokenizer.ggml.merges")
    if not merges:
        return None
    return [tuple(merge.split(" ", 1)) for merge in merges]


def _merges_by_score(
    tokens: list[str], types: list[int], scores: list[float]
) -> list[tuple[str, str]]:
    """SentencePiece's BPE merges the adjacent pair whose union is the best-scored piece: every
    split of a normal piece into two pieces is a merge, ranked by that piece's score."""
    vocab = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind != 1:  # only normal pieces are made by merging
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
