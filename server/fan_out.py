"""Several engine requests answered as one: an OpenAI completion with a list of prompts, or `n`
choices streamed (each choice its own request, so that each streams as it is drawn).

`FanOutStream` is an `EngineStream` whose outputs carry every request's choices, flattened in
order, as the first choice with the others in `best_of_sequences` (where an answer reads a
request's `n` choices), finished once all are; a failure of any request is the whole one's.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

from lora_runtime.api import EngineStream, RequestOutput, SamplingParams, ValidationError


class FanOutStream:
    def __init__(self, streams: Sequence[EngineStream], choices_per_request: int) -> None:
        self.streams = list(streams)
        self.choices_per_request = choices_per_request
        self.request_id = self.streams[0].request_id
        self.replica_id = self.streams[0].replica_id
        self._outputs = self._merged()

    @property
    def num_generated_tokens(self) -> int:
        return sum(stream.num_generated_tokens for stream in self.streams)

    async def abort(self) -> bool:
        aborted = [await stream.abort() for stream in self.streams]
        return any(aborted)

    def __aiter__(self) -> FanOutStream:
        return self

    async def __anext__(self) -> RequestOutput:
        return await self._outputs.__anext__()

    async def _merged(self) -> AsyncIterator[RequestOutput]:
        """One combined output whenever a request has news, once every request has begun."""
        latest: list[RequestOutput | None] = [None] * len(self.streams)
        iterators = [stream.__aiter__() for stream in self.streams]
        pending = {asyncio.ensure_future(it.__anext__()): index for index, it in enumerate(iterators)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    index = pending.pop(future)
                    if isinstance(future.exception(), StopAsyncIteration):
                        continue
                    latest[index] = future.result()  # raises the request's failure
                    if not latest[index].finished:
                        pending[asyncio.ensure_future(iterators[index].__anext__())] = index
                if all(output is not None for output in latest):
                    yield self._combined(latest)
        finally:
            for future in pending:
                future.cancel()

    def _combined(self, outputs: list[RequestOutput]) -> RequestOutput:
        choices = [choice for output in outputs
                   for choice in [output, *output.best_of_sequences][: self.choices_per_request]]
        error = next((output.error for output in outputs if output.error is not None), None)
        return dataclasses.replace(choices[0], best_of_sequences=choices[1:],
                                   finished=all(output.finished for output in outputs), error=error)


MAX_FANNED_OUT_REQUESTS = 64


def fan_out_requests(prompts: Sequence[str | list[int]], params: SamplingParams, n: int,
                     is_stream: bool) -> tuple[tuple[tuple[str | list[int], SamplingParams], ...], int]:
    """(the engine requests of a call, the choices each contributes); no requests when the call is
    one request. Several prompts: one request each, for its `n` choices (best of `best_of`).
    Streaming `n` choices: one request per choice, choice j drawing with seed + j as the engine's
    candidate j would, so that each streams as it is drawn."""
    if len(prompts) == 1 and not (is_stream and n > 1):
        return (), n
    if is_stream and n > 1:
        per_choice = [dataclasses.replace(params, best_of=1, seed=None if params.seed is None else params.seed + j)
                      for j in range(n)]
        requests = tuple((prompt, choice) for prompt in prompts for choice in per_choice)
        choices_per_request = 1
    else:
        requests, choices_per_request = tuple((prompt, params) for prompt in prompts), n
    if len(requests) > MAX_FANNED_OUT_REQUESTS:
        raise ValidationError("prompt" if len(prompts) > 1 else "n",
                              f"{len(prompts)} prompt(s) x n={n} is {len(requests)} engine requests; "
                              f"at most {MAX_FANNED_OUT_REQUESTS}")
    return requests, choices_per_request
