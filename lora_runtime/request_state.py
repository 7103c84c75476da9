"""What the engine keeps for each request beside the scheduler's `Request`: sampling state, text,
token details, stop criteria and timings; it builds the `RequestOutput` snapshots."""
from __future__ import annotations

import time

from lora_runtime.core import PrefillToken, Request, RequestOutput, RequestTimes, TokenInfo, TopToken
from lora_runtime.detokenizer import IncrementalDetokenizer
from lora_runtime.sampling.sampler import SamplingState, TokenizerInfo, TopPairs
from lora_runtime.sampling.stop import StopCriteria
from lora_runtime.sampling.tool_grammar import special_marker_ids
from lora_runtime.sampling.tools import TOOL_CALL_FORMATS


class RequestState:
    def __init__(self, request: Request, prompt: str | None, info: TokenizerInfo, candidate_index: int = 0) -> None:
        self.request = request
        self.prompt = prompt
        self.tokenizer_info = info
        self.sampling = SamplingState(request.params, request.prompt_token_ids, info, candidate_index)
        self.candidate_index = candidate_index
        self.tool_call_format = _tool_call_format(request)
        self.detokenizer = IncrementalDetokenizer(info.tokenizer, request.prompt_token_ids,
                                                  _kept_special_ids(info, self.tool_call_format), info.token_texts)
        self.stop = StopCriteria(request.params, info.eos_token_ids)
        self.tokens: list[TokenInfo] = []
        self.prompt_logprobs: list[float | None] = [None] * request.num_prompt_tokens
        self.prompt_top: list[tuple[TopToken, ...]] = [()] * request.num_prompt_tokens
        self.finish_reason = None
        self.error: Exception | None = None
        self.times = RequestTimes(arrival=time.monotonic())

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def record_prompt_logprobs(
        self, first_position: int, logprobs: list[float], top: list[TopPairs] | None = None
    ) -> None:
        """Logprobs (and most likely tokens, when asked) of prompt tokens first_position + 1 ...
        (recomputation after preemption rewrites the same values)."""
        for offset, value in enumerate(logprobs):
            self.prompt_logprobs[first_position + 1 + offset] = value
        for offset, pairs in enumerate(top or ()):
            self.prompt_top[first_position + 1 + offset] = self._top_tokens(pairs)

    def append_token(self, token_id: int, logprob: float, top: TopPairs = ()) -> None:
        """Add a generated token: detokenize it, check the stop criteria, update sampling state."""
        now = time.monotonic()
        if self.times.first_token is None:
            self.times.first_token = now
        self.request.output_token_ids.append(token_id)
        self.sampling.accept(token_id)
        piece = self.detokenizer.add_token(token_id)
        special = self.detokenizer.is_special(token_id)
        text = self.detokenizer.token_text(token_id)
        self.tokens.append(TokenInfo(token_id, text, logprob, special, self._top_tokens(top)))
        self.finish_reason = self.stop.check(token_id, piece)
        if self.finish_reason is not None:
            self.detokenizer.flush()
            self.times.finished = now

    def _top_tokens(self, pairs: TopPairs) -> tuple[TopToken, ...]:
        """(id, logprob) pairs with each token's own text, as a generated token's text is made."""
        detokenizer = self.detokenizer
        return tuple(TopToken(i, detokenizer.token_text(i), value, detokenizer.is_special(i)) for i, value in pairs)

    def fail(self, error: Exception) -> None:
        self.error = error
        self.times.finished = time.monotonic()

    def snapshot(self) -> RequestOutput:
        request = self.request
        token_texts = self.tokenizer_info.token_texts
        prefill = []
        if request.params.decoder_input_details:
            prefill = [
                PrefillToken(token_id, token_texts[token_id], logprob, top)
                for token_id, logprob, top in zip(request.prompt_token_ids, self.prompt_logprobs, self.prompt_top)
            ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            token_ids=list(request.output_token_ids),
            text=self.detokenizer.text,
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            tokens=list(self.tokens),
            prefill=prefill,
            seed=self.sampling.seed,
            times=self.times,
            error=self.error,
            num_cached_tokens=request.num_cached_tokens,
            tool_call_format=self.tool_call_format,
        )


def _tool_call_format(request: Request) -> str | None:
    """The format the reply's calls are written in, when it may hold calls (resolved by the engine)."""
    calling = request.params.tool_calling
    return calling.call_format if calling is not None and calling.reads_calls else None


def _kept_special_ids(info: TokenizerInfo, call_format: str | None) -> tuple[int, ...]:
    """The special tokens that are the request's call markers: kept in its text, which the calls
    are read back from."""
    if call_format is None:
        return ()
    return tuple(special_marker_ids(info.tokenizer, TOOL_CALL_FORMATS[call_format]).values())
