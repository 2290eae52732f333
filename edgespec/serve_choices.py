"""A request's choices (edgespec/serve.py): `n` for each of its prompts (a list of them on /v1/completions),
each one generation of its own through the server's queue, as a separate request's would be, so each
choice's text is the one plain decoding gives it. Choice `index` = prompt_index * n + j, as OpenAI numbers
them.

Under a `seed`, choice j draws under seed + j (vLLM's rule): each choice is reproducible and choice 0 is
the answer the same request with n = 1 gets; without one, each choice draws from its own random stream;
greedy choices are all the same text.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
from dataclasses import dataclass

from edgespec.openai_api import Completion, choice
from edgespec.openai_logprobs import chat_logprobs, completion_logprobs
from edgespec.runtime.decoding.engine import GenerationConfig, Result
from edgespec.runtime.decoding.logprobs import Scores
from edgespec.tool_calls import read_call


@dataclass
class Choice:
    index: int  # in the response: prompt_index * n + j
    completion: Completion  # the request for its prompt alone
    ids: list[int]  # its prompt's token ids
    config: GenerationConfig  # with the choice's own seed
    scores: Scores | None  # where its log-probabilities go, when asked
    task: asyncio.Future | None = None  # its generation, once started


def choice_config(config: GenerationConfig, j: int) -> GenerationConfig:
    """The config of the prompt's choice j: a seeded one draws under seed + j."""
    seed = config.sampling.seed
    if j == 0 or seed is None:
        return config
    return dataclasses.replace(config, sampling=dataclasses.replace(config.sampling, seed=seed + j))


async def prepared_choices(generations, completion: Completion) -> list[Choice]:
    """Every choice of `completion`, its prompt checked and tokenised once for its n choices (all before any
    starts: a prompt refused refuses the request before a token is generated)."""
    choices = []
    for p, one in enumerate(completion.per_prompt()):
        config, ids = await generations.prepare(one)
        choices += [Choice(p * completion.n + j, one, ids, choice_config(config, j), one.scores())
                    for j in range(completion.n)]
    return choices


def start_choices(generations, choices: list[Choice], client: str | None, cancel: threading.Event,
                  pieces: asyncio.Queue | None) -> None:
    """Starts each choice's generation in the queue (each has its place already). `pieces`: a streamed request's
    (index, text, logprobs shown with it) as they are decoded, then (index, None, None) when it ends."""
    loop = asyncio.get_running_loop()

    def on_text_of(one: Choice):
        if pieces is None:
            return None
        return lambda text: loop.call_soon_threadsafe(
            pieces.put_nowait, (one.index, text, one.scores.take_shown() if one.scores is not None else None))

    for started, one in enumerate(choices):
        try:
            one.task = generations.start(one.ids, one.config, client, on_text_of(one), cancel, one.scores)
        except BaseException:
            generations.release(len(choices) - started)  # the places of those that never started
            raise
        if pieces is not None:
            one.task.add_done_callback(lambda _, index=one.index: pieces.put_nowait((index, None, None)))


def answered(choices: list[Choice], results: list[Result], chat: bool, token_text) -> list[dict]:
    """The response's choices: each one's text (or tool calls) and logprobs; a completion's `echo` leads each with
    its own prompt and that prompt's tokens."""
    shaped = []
    for one, result in zip(choices, results):
        completion = one.completion
        calls = read_call(result.text) if completion.tool_choice else None
        echoed = completion.prompt if completion.echo else ""
        logprobs = None if result.logprobs is None else chat_logprobs(result.logprobs, token_text) if chat else \
            completion_logprobs(result.logprobs, token_text, one.ids if completion.echo else None,
                                result.prompt_logprobs, len(echoed))
        shaped.append(choice(one.index, chat, result, calls, logprobs, echoed))
    return shaped
