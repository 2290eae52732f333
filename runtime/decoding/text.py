"""Text in and out: the bundle's tokenizer.json, its chat template, and streaming detokenization."""
from __future__ import annotations

from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.meta
import jinja2.sandbox
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from ..contract.errors import BundleError, InputError
from ..contract.tokenizer import TokenizerSpec


def checked_text(text, what: str) -> str:
    """`text` if it is a string of valid Unicode (text read with surrogateescape from bytes that are not
    UTF-8 holds lone surrogates, which no tokenizer takes)."""
    if not isinstance(text, str):
        raise InputError(f"{what} must be text, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InputError(f"{what} is not valid UTF-8 (byte {err.start}): give text in UTF-8") from None
    return text


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


class TextCodec:
    def __init__(self, folder: Path, spec: TokenizerSpec):
        self.spec = spec
        try:
            self.tokenizer = Tokenizer.from_file(str(folder / spec.file))
        except Exception as err:  # the tokenizers library raises a bare Exception for a file it cannot parse
            raise BundleError(f"the bundle's tokenizer {spec.file} cannot be read ({err}): re-export the bundle") from err
        self._template = None
        self.takes_tools = False  # whether the chat template renders a `tools` list itself
        if spec.chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
            try:
                source = (folder / spec.chat_template).read_text(encoding="utf-8")
                self._template = env.from_string(source)
                self.takes_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
            except (OSError, UnicodeDecodeError, jinja2.TemplateError) as err:
                raise BundleError(f"the bundle's chat template {spec.chat_template} cannot be read ({err}): "
                                  "re-export the bundle") from err

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        """Plain text: the tokenizer's own special tokens are not added; a BOS only if the model wants one."""
        ids = self.tokenizer.encode(checked_text(text, "the prompt"), add_special_tokens=False).ids
        if self.spec.add_bos_token and self.spec.bos_token:
            ids = [self.tokenizer.token_to_id(self.spec.bos_token)] + ids
        return ids

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The chat template supplies every special token itself (no extra BOS). `tools`: OpenAI's tool
        objects, for a template that renders them (`takes_tools`)."""
        return self.tokenizer.encode(self.render_chat(messages, tools), add_special_tokens=False).ids

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The text `encode_chat` tokenises: rendering is cheap beside tokenising, so a server can measure a
        prompt by it first (edgespec/serve_limits.py)."""
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise InputError(f"chat message {i} needs a 'role' and a 'content'")
            checked_text(message.get("content"), f"chat message {i}'s content")
        if self._template is None:
            raise InputError("this bundle's tokenizer has no chat template; use a plain prompt")
        try:
            text = self._template.render(messages=messages, add_generation_prompt=True,
                                         bos_token=self.spec.bos_token or "", **({"tools": tools} if tools else {}))
        except jinja2.TemplateError as err:
            raise InputError(f"the model's chat template refused these messages: {err}") from err
        return text

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def stream(self) -> "TextStream":
        return TextStream(self.tokenizer)


class TextStream:
    """Turns token ids into text pieces as they arrive, never splitting a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._decoder = DecodeStream(skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        return self._decoder.step(self._tokenizer, int(token_id)) or ""
