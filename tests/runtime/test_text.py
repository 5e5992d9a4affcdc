"""Text as language-model windows: bytes by default, a local Hugging Face tokenizer on request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.datasets.text_windows import MaskedWindows, TokenWindows, load_tokens
from runtime.errors import RunError


def test_windows_read_consecutive_tokens_and_predict_the_next() -> None:
    data = TokenWindows(torch.arange(11, dtype=torch.int32), seq_len=5)
    assert len(data) == 2  # 11 tokens: two windows of 5, each with its next token
    x, y = data[1]
    assert x.tolist() == [5, 6, 7, 8, 9] and y.tolist() == [6, 7, 8, 9, 10]
    assert x.dtype == y.dtype == torch.int64
    assert len(TokenWindows(torch.arange(10), seq_len=5)) == 1  # the last window lacks a next token


def test_bytes_are_the_default_tokens(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_bytes("héllo\n".encode())
    tokens = load_tokens(tmp_path / "t.txt")
    assert tokens.tolist() == list("héllo\n".encode()) and tokens.dtype == torch.uint8
    with pytest.raises(RunError, match="no such file"):
        load_tokens(tmp_path / "missing.txt")


def _save_tokenizer(folder: Path) -> object:
    """A byte-level BPE trained here, offline, and saved as a Hugging Face tokenizer folder."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["[UNK]"], initial_alphabet=alphabet
    )
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20, trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    return tok


def test_a_local_tokenizer_folder_gives_its_ids(tmp_path: Path) -> None:
    tok = _save_tokenizer(tmp_path / "tok")
    text = "def g(y):\n    return y + 1\n"
    (tmp_path / "t.txt").write_text(text)
    tokens = load_tokens(tmp_path / "t.txt", str(tmp_path / "tok"))
    assert tokens.tolist() == tok.encode(text).ids  # type: ignore[attr-defined]
    assert len(tokens) < len(text)  # merges learned: fewer tokens than bytes


def test_a_folder_that_is_no_tokenizer_is_one_error(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "t.txt").write_text("abc")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunError, match="--tokenizer"):
        load_tokens(tmp_path / "t.txt", str(tmp_path / "empty"))
    with pytest.raises(RunError, match="no such folder"):
        load_tokens(tmp_path / "t.txt", str(tmp_path / "nope"))


def test_masked_lm_windows_hide_what_they_score() -> None:
    """A masked-lm package reads text as its synthetic data: a mask over the scored tokens, never the
    next tokens (its bidirectional attention would copy them from the input)."""
    plain = TokenWindows(torch.arange(1, 4001) % 97 + 1, seq_len=40)
    windows = MaskedWindows(plain, mask_token=0)
    shares = []
    for i in range(len(windows)):
        masked, targets = windows[i]
        scored = targets != -100
        assert bool(scored.any()) and bool((masked[scored] == 0).all()) and bool((masked[~scored] != 0).all())
        assert torch.equal(targets[scored], plain[i][0][scored])
        shares.append(float(scored.float().mean()))
    assert torch.equal(windows[3][1], windows[3][1]) and not torch.equal(windows[3][1], windows[4][1])
    assert 0.05 < sum(shares) / len(shares) < 0.3  # about MASK_RATE (15%) of the positions
