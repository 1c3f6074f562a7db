"""The request checks that cost more than reading the request's shape, run once the request is authenticated and
its rate charged (serve/http/exchange.py `Turns.begin`), on a worker thread: never on the ingress's event loop,
where one tenant's schema bomb stalled every other request, `/healthz` included, for 12 s.

Today these are the JSON Schemas a request carries (tool `parameters`, `response_format`'s schema): their limits
and the capped metaschema check are schemas/schema_checks.py's. The router's own costly steps (images, the chat
template) run there, after the same charge. docs/SECURITY.md ("Cost") lists each limit.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from schemas.api import AnswerRequest
from schemas.errors import InvalidRequestError
from schemas.sampling import Sampling
from schemas.schema_checks import SchemaCheckError, SchemaField, check_schemas

# A response's log-probability entries at most: n choices × max_tokens tokens × (the token + its top_logprobs
# alternatives). Each entry is ~80 bytes of JSON (token, logprob, bytes), so ~5 MiB of response: 1 choice of 4,096
# tokens with 15 alternatives fits, 8 choices of 4,096 with 20 (688,128 entries, ~55 MiB) do not
MAX_LOGPROB_ENTRIES = 65_536

# A few threads: each check stops itself at SCHEMA_CHECK_S, so a queue behind a bomb drains in bounded time
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="qvpic-checks")


def schema_fields(request: AnswerRequest, tools_path: str = "tools.tools") -> list[SchemaField]:
    """The schemas of `request`, each with its path as the client spelled it: `tools_path` is where the tools list
    is (the native request nests it in `tools`; OpenAI's chat request has it at the top), or a tool's path with `{i}`
    for its index (`tools[{i}]`: the Responses API's function tools hold `parameters` themselves)."""
    fields = []
    if request.tools is not None:
        where = tools_path if "{i}" in tools_path else tools_path + "[{i}].function"  # flat tools: Responses'
        fields += [SchemaField(where.format(i=i) + ".parameters", t.function.parameters, metaschema=True)
                   for i, t in enumerate(request.tools.tools) if t.function.parameters is not None]
    response_format = request.response_format
    if response_format is not None and response_format.json_schema is not None:
        # llguidance judges this one when it compiles it (a 400 naming response_format); the limits bound that work
        fields.append(SchemaField("response_format.json_schema.schema", response_format.json_schema.schema_,
                                  metaschema=False))
    return fields


def carries_grammar(request: AnswerRequest) -> bool:
    """Whether `request`'s decoding is constrained by something it sent (tools, a response_format, a grammar)."""
    return request.tools is not None or request.response_format is not None or request.structured_outputs is not None


async def sampling_of(request: AnswerRequest) -> Sampling:
    """`Sampling.of(request)`, on a worker when the request carries a grammar: its grammar text is JSON dumped,
    parsed and dumped again from the client's schemas (a 3,000-subschema response_format: over half of the event
    loop's time under that probe alone, `/healthz` at seconds; issue 60 item 5). Without one, here: it is cheap."""
    if not carries_grammar(request):
        return Sampling.of(request)
    return await asyncio.get_running_loop().run_in_executor(_POOL, Sampling.of, request)


async def check_request(request: AnswerRequest, tools_path: str = "tools.tools") -> None:
    """InvalidRequestError (400, `param` the field's path) for a schema past a limit or not a JSON Schema."""
    fields = schema_fields(request, tools_path)
    if not fields:
        return
    try:
        await asyncio.get_running_loop().run_in_executor(_POOL, check_schemas, fields)
    except SchemaCheckError as error:
        invalid = InvalidRequestError(str(error))
        invalid.param = error.param
        raise invalid from None


def check_response_size(sampling: Sampling, param: str) -> None:
    """InvalidRequestError (400 naming `param`, the route's logprobs field) when the response's log-probability
    entries could exceed MAX_LOGPROB_ENTRIES: checked before any work, from the request alone."""
    if sampling.logprobs is None:
        return
    entries = sampling.n * sampling.max_new_tokens * (1 + sampling.logprobs)
    if entries > MAX_LOGPROB_ENTRIES:
        error = InvalidRequestError(
            f"n × max_tokens × (1 + {param}) = {sampling.n} × {sampling.max_new_tokens} × {1 + sampling.logprobs} = "
            f"{entries} log-probability entries; a response holds at most {MAX_LOGPROB_ENTRIES}: ask for fewer "
            f"alternatives, tokens or choices")
        error.param = param
        raise error
