"""Log-probabilities in the shapes OpenAI's clients read (runtime/decoding/logprobs.py says what they are),
and the tokens of /tokenize and /detokenize in the shapes llama.cpp's server gives them.

Chat: `choice.logprobs.content`, one object per token (token, logprob, bytes, top_logprobs). Completions
(the legacy shape lm-evaluation-harness's `local-completions` scores with): `tokens`, `token_logprobs`,
`top_logprobs` (one {token: logprob} object per token) and `text_offset`; with `echo`, the prompt's tokens
lead, the first with null (nothing comes before it).
"""
from __future__ import annotations

from edgespec.openai_api import APIError
from edgespec.runtime.decoding.logprobs import TokenLogprob
from edgespec.runtime.decoding.text import checked_text


def chat_logprobs(entries: list[TokenLogprob], token_text) -> dict:
    """`token_text(id) -> str`: one token's text."""
    def one(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def completion_logprobs(entries: list[TokenLogprob], token_text, prompt: list[int] | None = None,
                        prompt_entries: list[TokenLogprob] | None = None, offset: int = 0) -> dict:
    """`prompt` and `prompt_entries` (echo): the prompt's tokens and the logprobs of its second token on;
    `offset`: where the first token's text starts in the choice's text."""
    tokens, logprobs, tops = [], [], []
    if prompt:
        tokens.append(prompt[0])
        logprobs.append(None)
        tops.append(None)
        for e in prompt_entries or ():
            tokens.append(e.token)
            logprobs.append(e.logprob)
            tops.append({token_text(t): lp for t, lp in e.top})
    for e in entries:
        tokens.append(e.token)
        logprobs.append(e.logprob)
        tops.append({token_text(t): lp for t, lp in e.top})
    texts = [token_text(t) for t in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def tokenized(codec, body) -> tuple[list[int], list[str] | None]:
    """/tokenize: {"content": text, "add_special": false, "with_pieces": false} -> the ids (and each one's text)."""
    if not isinstance(body, dict) or not isinstance(body.get("content"), str):
        raise APIError("'content' must be a string", "content")
    for name in ("add_special", "with_pieces"):
        if not isinstance(body.get(name, False), bool):
            raise APIError(f"'{name}' must be a boolean", name)
    unknown = set(body) - {"content", "add_special", "with_pieces"}
    if unknown:
        raise APIError(f"'{sorted(unknown)[0]}' is not supported by /tokenize", sorted(unknown)[0],
                       "unsupported_parameter")
    text = body["content"]
    try:
        ids = codec.encode(text) if body.get("add_special") else \
            codec.tokenizer.encode(checked_text(text, "'content'"), add_special_tokens=False).ids
    except ValueError as err:
        raise APIError(str(err), "content") from err
    pieces = [codec.tokenizer.decode([t], skip_special_tokens=False) for t in ids] if body.get("with_pieces") else None
    return ids, pieces


def detokenized(codec, body, vocab_size: int) -> str:
    """/detokenize: {"tokens": [ids]} -> their text."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise APIError("'tokens' must be a list of token ids", "tokens")
    outside = [t for t in tokens if not 0 <= t < vocab_size]
    if outside:
        raise APIError(f"'tokens': {outside[0]} is not a token id of this model (0..{vocab_size - 1})", "tokens")
    return codec.tokenizer.decode(tokens, skip_special_tokens=False)
