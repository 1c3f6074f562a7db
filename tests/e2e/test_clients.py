"""The clients users already have, against a live `qvpic serve` (the CLI's own defaults, no --config): the openai
SDK, LangChain's `ChatOpenAI` and `OpenAIEmbeddings`, LlamaIndex's `OpenAILike`, LiteLLM and Open WebUI's call
sequence —
with system prompts, history, an image, the standard RAG chain, streaming and batches. Each test asserts on what
came back (status, text, token counts, the prefix cache's share of a follow-up), not only that nothing raised."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path
from typing import Literal

import openai
import pytest
from PIL import Image

from tests.e2e.test_serve_lifecycle import START_TIMEOUT_S, serve_process, wait_for
from tests.support.ray_fixtures import free_port
from tests.support.store_factory import serving_store  # noqa: F401  (fixture)

pytestmark = pytest.mark.e2e
SYSTEM = "You are a parts clerk. Answer from the documents only, in one line."
BLOCK_TOKENS = 16  # the prefix cache's default block (schemas.config.PrefixCacheSpec)


@pytest.fixture(scope="module")
def base_url(serving_store, tmp_path_factory) -> str:
    logs = tmp_path_factory.mktemp("qvpic-serve")
    port = free_port()
    server = serve_process(serving_store.uri, port, logs)
    try:
        wait_for(lambda: "qvpic: serving" in (logs / "stdout").read_text() or server.poll() is not None or None,
                 START_TIMEOUT_S, "qvpic serve")
        assert server.poll() is None, (logs / "stderr").read_text()[-3000:]
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.terminate()
        server.wait(timeout=120)


def photo() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (96, 64), "navy").save(buffer, "JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def api(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=START_TIMEOUT_S)


def test_openai_system_history_and_an_image(api):
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Which part ships on 12 March?"},
                {"role": "assistant", "content": "Part XK-4471-B."},
                {"role": "user", "content": [{"type": "text", "text": "Is this the box it ships in?"},
                                             {"type": "image_url", "image_url": {"url": photo()}}]}]
    completion = api.chat.completions.create(model="qvpic", messages=messages, max_tokens=8, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason in ("stop", "length") and completion.usage.completion_tokens >= 1
    assert completion.usage.prompt_tokens > 100  # system, history, the image's tokens and the chunks
    fresh = {"Cache-Control": "no-cache"}  # computed again, not the response cache's copy
    stream = api.chat.completions.create(model="qvpic", messages=messages, max_tokens=8, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_headers=fresh)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content and chunks[-1].usage.prompt_tokens == completion.usage.prompt_tokens
    # the same request again: all of it from the prefix cache, and the logits after its last token
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == completion.usage.prompt_tokens
    replayed = api.chat.completions.create(model="qvpic", messages=messages, max_tokens=8, temperature=0)
    assert replayed.choices[0].message.content == choice.message.content  # the response cache: nothing computed
    assert replayed.usage.prompt_tokens_details.cached_tokens == replayed.usage.prompt_tokens


def test_openai_follow_up_reads_the_earlier_turn_from_the_cache(api):
    plain = {"qvpic": {"retrieval": "none"}}  # no store chunks: every cached token is the prefix cache's
    first_messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name one part number."}]
    first = api.chat.completions.create(model="qvpic", messages=first_messages, max_tokens=12, temperature=0,
                                        extra_body=plain)
    follow_up = first_messages + [{"role": "assistant", "content": first.choices[0].message.content},
                                  {"role": "user", "content": "When does it ship?"}]
    second = api.chat.completions.create(model="qvpic", messages=follow_up, max_tokens=4, temperature=0,
                                         extra_body=plain)
    # The earlier prompt is found, but for its last partial block. (Its answer too only where the answer's text
    # tokenises back to the tokens decoded — random weights' answers rarely do; vLLM's cache has the same rule.)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - BLOCK_TOKENS < cached <= second.usage.prompt_tokens - 1


def test_openai_errors_are_openai_errors(api):
    with pytest.raises(openai.BadRequestError) as error:
        api.chat.completions.create(model="qvpic", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/page.png"}}]}])
    assert error.value.param == "messages[0].content[0].image_url" and "data: URL" in error.value.message  # off: a 400
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


@pytest.fixture(scope="module")
def chat_model(base_url):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="qvpic", base_url=base_url, api_key="unused", max_retries=0,
                                       temperature=0, max_tokens=8, timeout=START_TIMEOUT_S, stream_usage=True)


def test_langchain_system_message_stream_and_batch(chat_model):
    from langchain_core.messages import HumanMessage, SystemMessage

    reply = chat_model.invoke([SystemMessage(SYSTEM), HumanMessage("Which part ships on 12 March?")])
    assert isinstance(reply.content, str) and reply.usage_metadata["output_tokens"] >= 1
    assert reply.response_metadata["finish_reason"] in ("stop", "length")
    streamed = list(chat_model.stream([SystemMessage(SYSTEM), HumanMessage("Which part ships on 12 March?")]))
    assert "".join(c.content for c in streamed) == reply.content
    batch = chat_model.batch(["When does part XK-4471-B ship?", "What does the warranty cover?"])
    assert len(batch) == 2 and all(m.usage_metadata["input_tokens"] > 0 for m in batch)


def test_langchain_rag_chain_gets_exactly_its_own_prompt(chat_model):
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate

    prompt = ChatPromptTemplate.from_messages([("system", "Answer using only this context: {context}"),
                                               ("human", "{question}")])
    own = chat_model.bind(extra_body={"qvpic": {"retrieval": "none"}})  # the chain did its own retrieval
    context = "Invoice 4471 lists part XK-4471-B, shipped on 12 March to Oslo. " * 4
    short = (prompt | own).invoke({"context": "-", "question": "When did it ship?"})
    long = (prompt | own).invoke({"context": context, "question": "When did it ship?"})
    # the context the chain put in its system message is in the prompt, whole (nothing cut, nothing added)
    assert long.usage_metadata["input_tokens"] - short.usage_metadata["input_tokens"] >= len(context) // 8
    text = (prompt | chat_model | StrOutputParser()).invoke({"context": context, "question": "When did it ship?"})
    assert isinstance(text, str)


def test_langchain_stop_and_the_openai_clients_decoding_controls(chat_model, api, serving_store):
    """`invoke(..., stop=[...])` (issue 36: a 422 before), and the penalties and logit_bias of the openai client.
    The expected text is the same request's answer without `stop`, cut at the stop string."""
    question = "When does part XK-4471-B ship?"
    full = chat_model.invoke(question).content
    assert len(full) >= 6, full
    stop = full[len(full) // 2:len(full) // 2 + 2]
    stopped = chat_model.invoke(question, stop=[stop])
    assert stopped.content == full[:full.find(stop)] and stopped.response_metadata["finish_reason"] == "stop"
    controlled = api.chat.completions.create(model="qvpic", messages=[{"role": "user", "content": question}],
                                             max_tokens=4, temperature=0, presence_penalty=0.5,
                                             frequency_penalty=0.5, logit_bias={"15": 100}, user="end-user-7",
                                             metadata={"trace": "t1"}, store=False)
    from transformers import AutoTokenizer

    from pipeline.runtime import resolve_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_path(serving_store.model), local_files_only=True)
    assert controlled.choices[0].message.content == tokenizer.decode([15] * 4)  # forced by its +100
    several = api.chat.completions.create(model="qvpic", messages=[{"role": "user", "content": question}], n=3,
                                          max_tokens=6, temperature=1.0, seed=9)
    assert [c.index for c in several.choices] == [0, 1, 2]
    third = api.chat.completions.create(model="qvpic", messages=[{"role": "user", "content": question}],
                                        max_tokens=6, temperature=1.0, seed=11)  # choice 2 is seed 9 + 2 alone
    assert several.choices[2].message.content == third.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model="qvpic", messages=[{"role": "user", "content": question}], n=9)
    assert refused.value.param == "n"


def test_langchain_structured_output_and_logprobs(chat_model):
    """`with_structured_output(Model)` by json_schema and by function calling: the reply parses into the model
    (constrained decoding, whatever the weights); logprobs come back."""
    from pydantic import BaseModel, Field

    class Part(BaseModel):
        part: str = Field(max_length=12)
        ships: bool

    roomy = chat_model.model_copy(update={"max_tokens": 64})  # room for the whole object
    structured = roomy.with_structured_output(Part, method="json_schema")
    parsed = structured.invoke("When does part XK-4471-B ship?")
    assert isinstance(parsed, Part)
    by_tool = roomy.with_structured_output(Part, method="function_calling")  # a forced call of a `Part` tool
    assert isinstance(by_tool.invoke("When does part XK-4471-B ship?"), Part)
    reply = chat_model.bind(logprobs=True, top_logprobs=2).invoke("Which part?")
    content = reply.response_metadata["logprobs"]["content"]
    assert len(content) == reply.usage_metadata["output_tokens"] and all(e["logprob"] <= 0 for e in content)


def test_langchain_bind_tools_round_trip(chat_model):
    """`bind_tools([fn], tool_choice=…)`: the forced call's arguments validate against the function's own schema
    (LangChain's, from the signature); its result goes back as a ToolMessage and the model answers."""
    import jsonschema
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_core.utils.function_calling import convert_to_openai_tool

    @tool
    def ship_date(part: Literal["XK-4471-B", "QP-1"], express: bool) -> str:  # bounded: random weights end it
        """When a part ships."""
        return "12 March"

    roomy = chat_model.model_copy(update={"max_tokens": 96})
    question = [HumanMessage("When does part XK-4471-B ship?")]
    called = roomy.bind_tools([ship_date], tool_choice="ship_date", parallel_tool_calls=False).invoke(question)
    assert called.response_metadata["finish_reason"] == "tool_calls", called
    assert len(called.tool_calls) == 1
    call = called.tool_calls[0]
    assert call["name"] == "ship_date"
    jsonschema.validate(call["args"], convert_to_openai_tool(ship_date)["function"]["parameters"])
    result = ToolMessage(ship_date.invoke(call["args"]), tool_call_id=call["id"])
    answer = roomy.bind_tools([ship_date]).invoke([*question, called, result])
    assert answer.content and not answer.tool_calls  # tool_choice auto: random weights answer in text
    assert answer.usage_metadata["input_tokens"] > called.usage_metadata["input_tokens"]


def test_llamaindex_openailike_chat_with_a_system_message(base_url):
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model="qvpic", api_base=base_url, api_key="unused", is_chat_model=True, max_tokens=8,
                     temperature=0.0, max_retries=0, timeout=START_TIMEOUT_S, context_window=4096)
    response = llm.chat([ChatMessage(role="system", content=SYSTEM),
                         ChatMessage(role="user", content="Which part ships on 12 March?")])
    assert isinstance(response.message.content, str)
    usage = response.raw.usage
    assert usage.prompt_tokens > 20 and usage.completion_tokens >= 1


def test_open_webuis_call_sequence(base_url):
    """What Open WebUI sends, in order: the model list, then a streamed chat with `include_usage`, a system prompt
    and a base64 image. The stream's content chunks, then one usage chunk with no choices, then [DONE]."""
    import json

    import httpx

    with httpx.Client(base_url=base_url, headers={"Authorization": "Bearer unused"}, timeout=START_TIMEOUT_S) as http:
        models = http.get("/models").json()
        assert "qvpic" in [m["id"] for m in models["data"]]
        body = {"model": "qvpic", "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
                "max_tokens": 6, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": photo()}}]}]}
        with http.stream("POST", "/chat/completions", json=body) as response:
            assert response.status_code == 200
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *content, usage = chunks
    assert all(len(c["choices"]) == 1 and c.get("usage") is None for c in content)
    assert content[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    assert usage["usage"]["prompt_tokens"] > 20  # the system prompt and the image's tokens


def test_langchain_openai_embeddings(base_url, api):
    """LangChain's `OpenAIEmbeddings` with `check_embedding_ctx_length=False` sends text: the store's embedder's
    vectors, as /v1/embeddings gives them. Its default tokenises with tiktoken and sends token ids, which the
    server refuses with a 400 naming that flag (README, docs/OPENAI.md): sent here as it would send them."""
    from langchain_openai import OpenAIEmbeddings

    embedder = OpenAIEmbeddings(model="qvpic", base_url=base_url, api_key="unused", max_retries=0,
                                check_embedding_ctx_length=False, timeout=START_TIMEOUT_S)
    texts = ["When does part XK-4471-B ship?", "What does the warranty cover?"]
    vectors = embedder.embed_documents(texts)
    direct = [d.embedding for d in api.embeddings.create(model="qvpic", input=texts).data]
    assert len(vectors) == 2 and all(abs(a - b) < 1e-6 for v, d in zip(vectors, direct) for a, b in zip(v, d))
    assert embedder.embed_query(texts[0]) == pytest.approx(vectors[0], abs=1e-6)
    with pytest.raises(openai.BadRequestError) as error:
        api.embeddings.create(model="qvpic", input=[[1923, 374, 1778]])  # what its default sends
    assert "check_embedding_ctx_length=False" in error.value.message


@pytest.mark.parametrize("stream", [False, True])
def test_litellm_vllm_provider_with_sampling_extras(base_url, stream):
    """LiteLLM's vLLM provider (`hosted_vllm/`, OpenAI-compatible) sends vLLM's sampling extras as body fields:
    top_k 1 at temperature 1.5 is greedy, as temperature 0 is."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list from GitHub
    import litellm

    common = dict(model="hosted_vllm/qvpic", api_base=base_url, api_key="unused", max_tokens=6, num_retries=0,
                  messages=[{"role": "user", "content": "Which part ships on 12 March?"}], timeout=START_TIMEOUT_S)
    greedy = litellm.completion(**common, temperature=0)
    extras = litellm.completion(**common, temperature=1.5, top_k=1, repetition_penalty=1.0, min_tokens=1,
                                stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}))
    assert greedy.choices[0].finish_reason in ("stop", "length") and greedy.usage.completion_tokens >= 1
    if stream:
        chunks = list(extras)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = extras.choices[0].message.content
    assert text == greedy.choices[0].message.content  # top_k 1 at temperature 1.5: greedy


def test_the_server_logs_nothing_alarming(base_url, tmp_path_factory):
    del base_url  # the server of this module: its stderr so far
    logs = sorted(Path(tmp_path_factory.getbasetemp()).glob("qvpic-serve*/stderr"))
    assert logs and "Traceback" not in logs[-1].read_text()
