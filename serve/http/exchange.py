"""The governed request turn every answering route runs: govern → answer → record.

`Turns.begin` opens a request's governance turn (serve/governance/turn.py) within its lifetime
(serve/http/lifetime.py: a deadline, and cancellation when the client goes away). The `Exchange` it
returns routes, answers — from the response cache, or through the backend's generator — and hands each
result to the turn, for the native `/v1/answer` and the OpenAI `/v1/chat/completions` and `/v1/completions`
alike: only their wire formats differ. `Turns.embed` is `/v1/embeddings`' turn: governed, no plan.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request, Response

from schemas.api import AnswerRequest
from schemas.config import ImageUrlsSpec
from schemas.errors import ContextLengthError
from schemas.sampling import Sampling
from serve.governance import Governor, Route, Turn, replay
from serve.http.backend import Backend, error_cause, error_status
from serve.http.checks import check_request, check_response_size, sampling_of
from serve.http.image_urls import ImageFetcher
from serve.http.lifetime import ClientClosedError, Lifetime, request_timeout_s
from serve.plan import Answer, Embedded, Plan

# Each route's name for the answer's length and for its log-probability alternatives: a 400 names the client's field
MAX_TOKENS_PARAM = {Route.ANSWER: "max_new_tokens", Route.ESTIMATE: "max_new_tokens", Route.CHAT: "max_tokens",
                    Route.COMPLETIONS: "max_tokens", Route.RESPONSES: "max_output_tokens"}
# /v1/responses asks for log-probabilities through `include` (its top_logprobs is refused)
LOGPROBS_PARAM = {Route.ANSWER: "top_logprobs", Route.ESTIMATE: "top_logprobs", Route.CHAT: "top_logprobs",
                  Route.COMPLETIONS: "logprobs", Route.RESPONSES: "include"}


def tenant_salt(tenant: str) -> bytes:
    """The prefix-cache salt of `tenant`: blocks cached for one tenant never match another's requests."""
    return hashlib.sha256(b"qvpic-tenant\x00" + tenant.encode()).digest()


@dataclass
class Turns:
    backend: Backend
    governor: Governor
    timeout_s: float  # the deadline of a request that sets none
    images: ImageFetcher = field(default_factory=lambda: ImageFetcher(ImageUrlsSpec()))  # image URLs (off)

    async def begin(self, http: Request, request: AnswerRequest, route: Route, n: int = 1,
                    tools_path: str = "tools.tools") -> Exchange:
        """Authenticated and rate-checked (401, 400, 429 before any work), then its schemas checked on a worker
        (400 naming the field: serve/http/checks.py; `tools_path` is where the client put its tools), with its
        deadline set, and its image URLs fetched within it (serve/http/image_urls.py: a 400 where they are not
        fetched); `n` choices."""
        turn = await self.governor.begin(http, request, route, n)
        sampling = dataclasses.replace(await sampling_of(request), n=n)  # a grammar's text: on a worker
        turn.reserve(sampling, MAX_TOKENS_PARAM[route])  # n × max_tokens within the token budget, or a 400
        check_response_size(sampling, LOGPROBS_PARAM[route])
        await check_request(request, tools_path)
        life = Lifetime(http, request_timeout_s(http, request.timeout_s, self.timeout_s))
        await life.run(self.images.fetch_into(request))
        return Exchange(self.backend, turn, life, sampling)

    async def embed(self, http: Request, response: Response, texts: list[str], user: str | None) -> Embedded:
        """`texts` embedded by the router's embedder, as one governed turn (401, 429 before any work) within the
        request's lifetime (header X-Request-Timeout, else the server's default); `response` carries its headers."""
        turn = await self.governor.begin_embeddings(http, user, texts)
        response.headers.update(turn.headers)
        life = Lifetime(http, request_timeout_s(http, None, self.timeout_s))
        embedded = await life.run(self.backend.embed(texts))
        turn.embedded(embedded.prompt_tokens)
        return embedded


@dataclass
class Exchange:
    backend: Backend
    turn: Turn
    life: Lifetime
    sampling: Sampling

    @property
    def headers(self) -> dict[str, str]:
        return self.turn.headers

    async def route(self) -> Plan:
        """Routed and priced, within the request's lifetime (all `/v1/estimate` does)."""
        return await self.life.run(self._route())

    async def admit(self) -> None:
        """Routed, then prepared: the budget checked, the response cache asked, the token rate charged."""
        await self.life.run(self._admit())

    async def answer(self, response: Response) -> Answer:
        """The whole answer; `response` carries the turn's headers."""
        response.headers.update(self.headers)
        return await self.life.run(self._answer(self.life.remaining_s()))

    def stream(self) -> AsyncIterator[str | Answer]:
        """Text deltas, then the answer, within the request's lifetime."""
        return self.life.stream(self._stream(self.life.remaining_s()))

    async def _route(self) -> Plan:
        # Only the chunks of the collections granted to the tenant the server authenticated exist for it; the prefix
        # cache and the router's query vectors key everything under that tenant, never one the client chose.
        salt = tenant_salt(self.turn.record.tenant)
        await self.turn.routing()  # 429 while the tenant's token rate is in debt
        try:
            plan = await self.backend.route(self.turn.request, self.turn.prompt_budget_tokens, self.turn.collections,
                                            salt)
        except Exception as error:
            if isinstance(cause := error_cause(error), ContextLengthError):
                await self.turn.refused_too_long(cause.counted_tokens)  # what the router read, charged: still a 400
            raise
        return self.turn.priced(dataclasses.replace(plan, cache_salt=salt))

    async def _admit(self) -> None:
        await self._route()
        await self.turn.prepare(self.sampling)

    async def _answer(self, timeout_s: float) -> Answer:
        turn = self.turn
        answer = turn.hit if turn.hit is not None else await self.backend.generate(turn.plan, self.sampling, timeout_s)
        return await turn.answered(answer)

    async def _stream(self, timeout_s: float) -> AsyncIterator[str | Answer]:
        turn = self.turn
        try:
            events = (replay(turn.hit) if turn.hit is not None
                      else self.backend.stream(turn.plan, self.sampling, timeout_s))
            async for event in events:
                if isinstance(event, str):
                    turn.first_token()
                else:
                    event = await turn.answered(event)
                yield event
        except Exception as error:
            turn.finish(error_status(error))
            raise
        finally:
            turn.finish(ClientClosedError.status_code)  # only if nothing above finished it: the client stopped reading
