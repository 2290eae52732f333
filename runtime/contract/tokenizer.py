"""The manifest's tokenizer section: which file holds the vocabulary, the chat template, the special tokens."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError


@dataclass(frozen=True)
class TokenizerSpec:
    """The manifest's tokenizer section."""

    file: str
    chat_template: str | None
    bos_token: str | None
    eos_token_ids: tuple[int, ...]
    add_bos_token: bool

    @classmethod
    def from_dict(cls, data: dict) -> "TokenizerSpec":
        if not isinstance(data.get("file"), str) or not isinstance(data.get("chat_template") or "", str) \
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in data.get("eos_token_ids", ())):
            raise InputError("the tokenizer section needs a file name, an optional chat template file name and "
                             "integer eos ids")
        return cls(file=data["file"], chat_template=data.get("chat_template"), bos_token=data.get("bos_token"),
                   eos_token_ids=tuple(data.get("eos_token_ids", ())), add_bos_token=bool(data.get("add_bos_token")))

    def to_dict(self) -> dict:
        return {"file": self.file, "chat_template": self.chat_template, "bos_token": self.bos_token,
                "eos_token_ids": list(self.eos_token_ids), "add_bos_token": self.add_bos_token}
