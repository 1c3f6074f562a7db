"""vLLM's sampling extras through the OpenAI routes (in-process roles behind the FastAPI app). Expected values come
from outside the code under test: a token forced with `logit_bias` (its count and text known in advance), the same
request greedy, the tokenizer's own decoding, `re.fullmatch` and the choice list; each with its control (the
extra left out changes the answer)."""

from __future__ import annotations

import re

import pytest

from tests.serve.http.test_api import app, call  # noqa: F401  (a fixture)
from tests.serve.http.test_openai_decoding import NO_CACHE, QUESTION, SELECTION, chat
from tests.support.store_factory import roles, serving_store  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def tokens(roles):
    tokenizer = roles.generator.vlm.tokenizer
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end in roles.generator.vlm.adapter.end_of_turn_ids
    return tokenizer, end, tokenizer.encode(" zebra", add_special_tokens=False)[0]


def answer(body: dict) -> tuple[str, str, int]:
    choice = body["choices"][0]
    return choice["message"]["content"] or "", choice["finish_reason"], body["usage"]["completion_tokens"]


def test_ignore_eos_decodes_past_the_end_of_turn(app, tokens):
    tokenizer, end, _ = tokens
    forced = {"logit_bias": {str(end): 100}, "max_tokens": 4}
    assert answer(chat(app, **forced)) == ("", "stop", 0)  # control: the end of turn ends it at once
    assert answer(chat(app, ignore_eos=True, **forced)) == ("", "length", 4)  # special: not in the text
    shown = tokenizer.decode([end] * 4, skip_special_tokens=False)
    assert shown == "<|im_end|>" * 4
    assert answer(chat(app, ignore_eos=True, skip_special_tokens=False, **forced)) == (shown, "length", 4)


def test_min_tokens_holds_the_end_of_turn_back(app, tokens):
    _, end, _ = tokens
    text, finish, count = answer(chat(app, logit_bias={str(end): 100}, max_tokens=6, min_tokens=3))
    assert (finish, count) == ("stop", 3)  # three tokens, then the forced end
    assert answer(chat(app, logit_bias={str(end): 100}, max_tokens=6, min_tokens=0))[2] == 0  # control


def test_stop_token_ids_end_the_answer_without_the_token(app, tokens):
    tokenizer, _, zebra = tokens
    forced = {"logit_bias": {str(zebra): 100}, "max_tokens": 5}
    assert answer(chat(app, **forced)) == (tokenizer.decode([zebra] * 5), "length", 5)  # control
    assert answer(chat(app, stop_token_ids=[zebra], **forced)) == ("", "stop", 0)
    # min_tokens masks the stop token too (vLLM's): two other tokens, then the forced one ends it
    text, finish, count = answer(chat(app, stop_token_ids=[zebra], min_tokens=2, **forced))
    assert (finish, count) == ("stop", 2) and zebra not in tokenizer.encode(text, add_special_tokens=False)


def test_repetition_penalty_stops_a_forced_token_repeating(app, tokens):
    """Forced by +100, " zebra" is decoded first; once seen its logit (100 + l) / 1e6 is about 1e-4, below the best
    unforced logit of a random model, so it never comes again (without the penalty it fills the answer)."""
    tokenizer, _, zebra = tokens
    body = chat(app, logit_bias={str(zebra): 100}, max_tokens=4, repetition_penalty=1e6,
                messages=[{"role": "user", "content": "Which animal?"}])
    ids = tokenizer.encode(answer(body)[0], add_special_tokens=False)
    assert ids[0] == zebra and zebra not in ids[1:], ids


def test_top_k_1_and_min_p_1_are_greedy_at_temperature_1_5(app):
    greedy = answer(chat(app, max_tokens=8))[0]
    sampled = dict(temperature=1.5, seed=11, max_tokens=8)
    assert answer(chat(app, top_k=1, **sampled))[0] == greedy
    assert answer(chat(app, min_p=1.0, **sampled))[0] == greedy
    assert answer(chat(app, **sampled))[0] != greedy  # control: the same draw without them is not greedy


def test_include_stop_str_in_output_keeps_the_stop_string(app):
    text = answer(chat(app))[0]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = text[:text.find(stop)]
    assert answer(chat(app, stop=[stop]))[0] == cut  # control
    assert answer(chat(app, stop=[stop], include_stop_str_in_output=True))[:2] == (cut + stop, "stop")


@pytest.mark.parametrize("spec, check", [
    ({"choice": ["yes", "no", "maybe later"]}, lambda t: t in ("yes", "no", "maybe later")),
    ({"regex": "[0-9]{3}-[a-z]{2}/x"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}/x", t)),
    ({"grammar": 'start: "part " NUM\nNUM: /[0-9]{2}/'}, lambda t: re.fullmatch("part [0-9]{2}", t)),
])
def test_structured_outputs_constrain_the_answer(app, spec, check):
    text, finish, _ = answer(chat(app, max_tokens=24, structured_outputs=spec))
    assert check(text) and finish == "stop", text
    assert not check(answer(chat(app, max_tokens=24))[0])  # control: the weights alone do not write it


def test_structured_outputs_on_legacy_completions(app):
    body = {"model": "qvpic", "prompt": "Ship?", "max_tokens": 8, "temperature": 0, **SELECTION,
            "structured_outputs": {"choice": ["yes", "no"]}, "top_k": 1}
    response = call(app, "POST", "/v1/completions", json=body, headers=NO_CACHE)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] in ("yes", "no"), response.text


@pytest.mark.parametrize("fields, param", [
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
    ({"stop_token_ids": [999999999]}, "stop_token_ids"),  # past the vocabulary: known only to the generator
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),  # ends with user
    ({"continue_final_message": True, "messages": QUESTION + [{"role": "assistant", "content": "It"}]},
     "continue_final_message"),  # vLLM's rule: not with add_generation_prompt (its default, true)
])
def test_bad_extras_are_400_naming_the_field(app, fields, param):
    body = {"model": "qvpic", "messages": QUESTION, "max_tokens": 2, **SELECTION, **fields}
    response = call(app, "POST", "/v1/chat/completions", json=body, headers=NO_CACHE)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_the_native_answer_takes_sampling_top_k(app):
    base = {"query": "When does part XK-4471-B ship?", "chunk_ids": ["manual#00000"], "max_new_tokens": 8}
    greedy = call(app, "POST", "/v1/answer", json=base, headers=NO_CACHE).json()
    sampled = call(app, "POST", "/v1/answer", json={**base, "temperature": 1.5, "seed": 11, "sampling_top_k": 1},
                   headers=NO_CACHE).json()
    assert sampled["answer"] == greedy["answer"]
    refused = call(app, "POST", "/v1/answer", json={**base, "sampling_top_k": -2})
    assert refused.status_code == 422 and "sampling_top_k" in refused.text


def test_continue_final_message_and_add_generation_prompt_render_as_the_tokenizers_template(app, tokens):
    """The prompt's size against transformers' own rendering of the same messages (the plain-chat model: no
    chunks): the continued assistant message open, and the prompt without its assistant header."""
    tokenizer = tokens[0]
    user, partial = QUESTION[0], {"role": "assistant", "content": "It ships on"}

    def hf(messages, **flags) -> int:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **flags)
        return len(tokenizer.encode(text, add_special_tokens=False))

    def served(messages, **flags) -> int:
        return chat(app, model="qvpic-chat", qvpic={}, messages=messages, max_tokens=2, **flags)["usage"][
            "prompt_tokens"]

    plain, plain_hf = served([user]), hf([user], add_generation_prompt=True)
    continued = served([user, partial], continue_final_message=True, add_generation_prompt=False)
    assert continued - plain == hf([user, partial], continue_final_message=True) - plain_hf
    assert continued > plain
    headless = served([user], add_generation_prompt=False)
    assert headless - plain == hf([user]) - plain_hf < 0
