"""Text to token ids and back: a checkpoint folder's ``tokenizer.json`` (the Hugging Face
``tokenizers`` package reads it), or UTF-8 bytes (ids 0-255) for a model whose vocabulary
is bytes (gpt-tiny) and for training text on a checkpoint without a ``tokenizer.json``.
A checkpoint's own ids are not bytes, so a folder without one has no tokenizer to
generate with (``load_tokenizer`` gives ``None``): its new ids are shown as ids.

``decode`` of a growing id list is what streaming uses: ``TextStream`` prints only the
new, complete characters (a token can end in the middle of a multi-byte character).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..errors import MeganeuraError

TOKENIZER_FILE = "tokenizer.json"


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, after ``prefix`` ids (gpt-tiny starts with its BOS)."""

    kind = "bytes"

    def __init__(self, prefix: Sequence[int] = (), note: str | None = None):
        self.prefix, self.note = list(prefix), note

    def encode(self, text: str) -> list[int]:
        return [*self.prefix, *text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``. The prefix ids (special tokens such as gpt-tiny's BOS) give
        no text; any other id outside 0-255 is an error, since dropping it would show less
        than the model generated."""
        kept = [int(i) for i in ids if int(i) not in self.prefix]
        bad = next((i for i in kept if not 0 <= i < 256), None)
        if bad is not None:
            raise MeganeuraError(f"token id {bad} is not a byte (0-255), so the byte tokenizer cannot decode it; "
                                 f"show the ids instead, or give the model its tokenizer.json")
        return bytes(kept).decode("utf-8", errors="replace")


def byte_tokenizer_json() -> str:
    """A ``tokenizer.json`` whose ids 0-255 are the UTF-8 bytes, as ``ByteTokenizer``'s
    (byte-level BPE without merges): a run that trained a checkpoint without one on text
    read as bytes leaves it in its checkpoints, so they generate text, where the folder it
    started from has no tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    char = _byte_chars()
    tokenizer = Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str()


def _byte_chars() -> dict[int, str]:
    """Byte-level BPE's printable character for each byte (GPT-2's table): printable
    Latin-1 bytes stand for themselves, the others for code points from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


class FileTokenizer:
    """A ``tokenizer.json`` read with the ``tokenizers`` package."""

    kind = "tokenizer.json"
    note = None

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # a broken install: the package is a dependency
            raise MeganeuraError(f"reading {path} needs the 'tokenizers' package: pip install tokenizers") from exc
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises plain Exceptions for bad files
            raise MeganeuraError(f"{path} is not a tokenizer file the 'tokenizers' package can read: {exc}") from None
        self.path = path

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; an id the file has no token for (a model's vocabulary is
        often padded past its tokenizer's) shows as ``<id N>``, where the library would
        drop it without a trace."""
        size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        pieces, run = [], []
        for i in map(int, ids):
            if 0 <= i < size:
                run.append(i)
                continue
            pieces += [self.tokenizer.decode(run, skip_special_tokens=False), f"<id {i}>"]
            run = []
        return "".join(pieces) + self.tokenizer.decode(run, skip_special_tokens=False)


def load_tokenizer(folder: str | Path | None):
    """The tokenizer of a checkpoint folder, or ``None`` where it has no ``tokenizer.json``."""
    if folder is None:
        return None
    path = Path(folder) / TOKENIZER_FILE
    return FileTokenizer(path) if path.is_file() else None


class TextStream:
    """The text of a growing list of ids, handed out piece by piece: ``push(id)`` returns
    the characters that became final (a trailing replacement character, an incomplete
    multi-byte sequence, is held back until the next id completes it or ``flush``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = 0

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids)
        end = len(text.rstrip("\ufffd"))
        piece, self.shown = text[self.shown:end], max(self.shown, end)
        return piece

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        piece, self.shown = text[self.shown:], len(text)
        return piece
