"""``--data text:FILE --seq-len N``: a text cut into language-model windows.

Tokens are the file's bytes (a vocabulary of 256) unless ``--tokenizer DIR`` names a local Hugging Face
tokenizer folder (``AutoTokenizer.from_pretrained(DIR, local_files_only=True)``; needs transformers).
Window ``i`` reads ``tokens[i*N : i*N+N]`` and predicts ``tokens[i*N+1 : i*N+N+1]``: consecutive,
non-overlapping windows, so an epoch reads the text once.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

from runtime.errors import RunError

__all__ = [
    "BYTE_VOCAB",
    "MASK_RATE",
    "MaskedWindows",
    "TokenWindows",
    "load_tokens",
    "mask_tokens",
]

BYTE_VOCAB = 256
"""Token ids of the default byte tokenizer: 0..255."""


def _tokenizer(folder: str) -> object:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise RunError(
            "--tokenizer needs transformers; pip install 'pipeplan[hf]', or drop --tokenizer for bytes"
        ) from exc
    if not Path(folder).is_dir():
        raise RunError(f"--tokenizer {folder}: no such folder (a local tokenizer saved by save_pretrained)")
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise RunError(f"--tokenizer {folder}: not a tokenizer: {type(exc).__name__}: {first}") from exc


def load_tokens(path: str | Path, tokenizer: str | None = None) -> torch.Tensor:
    """The token ids of a text file, as a 1-D tensor (uint8 for bytes, int32 for a tokenizer).

    Raises:
        RunError: no such file, an unreadable tokenizer, or a text that is not UTF-8 (tokenizer only).
    """
    file = Path(path)
    if not file.is_file():
        raise RunError(f"--data text:{path}: no such file")
    raw = file.read_bytes()
    if tokenizer is None:
        return (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
        )
    encode = _tokenizer(tokenizer)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RunError(f"--data text:{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    ids = encode(text, add_special_tokens=False, verbose=False)["input_ids"]  # type: ignore[operator]
    return torch.tensor(ids, dtype=torch.int32)


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples ``(tokens[s : s+N], tokens[s+1 : s+N+1])`` with ``s = i * N``, as int64.

    Example:
        >>> data = TokenWindows(torch.arange(10), seq_len=4)
        >>> len(data), data[1][0].tolist(), data[1][1].tolist()
        (2, [4, 5, 6, 7], [5, 6, 7, 8])
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if seq_len < 1:
            raise RunError(f"--seq-len must be at least 1, got {seq_len}")
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return max(0, (self.tokens.numel() - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]


MASK_RATE = 0.15
"""The share of a window's positions a masked-lm package hides and scores (BERT's pre-training)."""


def mask_tokens(
    tokens: torch.Tensor, mask_token: int, generator: torch.Generator, rate: float = MASK_RATE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked tokens, targets): ``rate`` of the positions of each row (at least one) hidden behind
    ``mask_token`` and scored against the token they hid; every other position ignored (-100).

    Example:
        >>> masked, targets = mask_tokens(torch.arange(1, 9)[None], 0, torch.Generator().manual_seed(0))
        >>> bool(((masked == 0) == (targets != -100)).all())
        True
    """
    rows = tokens.reshape(len(tokens), -1)
    noise = torch.rand(rows.shape, generator=generator)
    chosen = noise < rate
    chosen[torch.arange(len(rows)), noise.argmin(1)] = True
    chosen = chosen.reshape(tokens.shape)
    return tokens.masked_fill(chosen, mask_token), torch.where(chosen, tokens, torch.full_like(tokens, -100))


class MaskedWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A masked-lm task on text windows: sample ``i``'s window masked by a generator seeded with ``i``
    (the same on every rank), scored on what the mask hid."""

    def __init__(self, windows: TokenWindows, mask_token: int) -> None:
        self.windows, self.mask_token = windows, mask_token

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.windows[index][0]
        masked, targets = mask_tokens(tokens[None], self.mask_token, torch.Generator().manual_seed(index))
        return masked[0], targets[0]
