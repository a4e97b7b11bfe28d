"""serve/app.py: the OpenAI-compatible API (driven by the official openai client), accounts, stored
conversations, and the server's behaviour under load and when killed. Every test talks HTTP to a real
server on 127.0.0.1: uvicorn in a thread of this process (sharing one tiny model), or serve/app.py in
a subprocess where a test needs the process itself (CLI, SIGKILL, memory)."""

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from conftest import ROOT, ScriptedModel, live_server, serve_member, start_server, tiny_config

import config
from chat import template
from family import accounts
from serve import app

NO_TOOLS = "serve.tools=false"  # prompts of exactly the request's messages, without the server's tools


def member(server, name, role="adult", password=None):
    key = server.store.add_member(name, role)
    if password:
        server.store.set_password(name, accounts.hash_password(password, server.settings["scrypt"]))
    return key


def client(url, key):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def ask(url, key, **body):
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})


USER = [{"role": "user", "content": "Hola, ¿qué tal?"}]
JSON = {"Content-Type": "application/json"}


# -----------------------------------------------------------------------------
# The API with the openai client


def test_models_lists_the_run_and_every_route_needs_a_valid_key(chat_model, tmp_path):
    with live_server(chat_model, tmp_path) as (url, server):
        key = member(server, "ana")
        assert [m.id for m in client(url, key).models.list()] == ["chat"]
        with pytest.raises(openai.AuthenticationError, match="invalid API key"):
            client(url, "enl-not-a-key").models.list()
        for path in ("/v1/models", "/api/conversations", "/api/me"):
            answer = httpx.get(url + path)
            assert answer.status_code == 401 and answer.json()["error"]["type"] == "authentication_error"


def test_a_plain_completion_reports_its_usage_and_respects_max_tokens(chat_model, tmp_path):
    with live_server(chat_model, tmp_path, NO_TOOLS) as (url, server):
        answer = client(url, member(server, "ana")).chat.completions.create(
            model="chat", messages=USER, max_completion_tokens=5, seed=3
        )
    choice = answer.choices[0]
    assert answer.object == "chat.completion" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    # The prompt is chat.render of the server's system prompt and the user's message.
    tokenizer = chat_model[1]
    system = app.load_settings(app.DEFAULT_CONFIG, [])["system_prompt"]
    ids, _ = template.render({"messages": [{"role": "system", "content": system}, *USER]}, tokenizer, True)
    assert answer.usage.prompt_tokens == len(ids)
    assert 1 <= answer.usage.completion_tokens <= 5
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_text_parts_system_developer_tool_roles_and_unknown_fields_are_accepted(chat_model, tmp_path):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Eres breve."}]},
        {"role": "developer", "content": "Responde en español."},
        {"role": "user", "content": [{"type": "text", "text": "¿Enciendes "}, {"type": "text", "text": "la luz?"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "luz", "arguments": "{\"on\": true}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "hecho"},
    ]  # fmt: skip
    with live_server(chat_model, tmp_path, NO_TOOLS) as (url, server):
        answer = client(url, member(server, "ana")).chat.completions.create(
            model="chat", messages=messages, max_tokens=3, temperature=0.5, top_p=0.9,
            extra_body={"a_field_from_the_future": {"x": 1}, "logit_bias": {}},
        )  # fmt: skip
    assert answer.choices[0].finish_reason in ("stop", "length")
    conversation = {"messages": [
        {"role": "system", "content": "Eres breve.\n\nResponde en español."},
        {"role": "user", "content": "¿Enciendes la luz?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "luz", "arguments": {"on": True}}}]},
        {"role": "tool", "content": "hecho"},
    ]}  # fmt: skip
    assert answer.usage.prompt_tokens == len(template.render(conversation, chat_model[1], True)[0])


def test_a_streamed_answer_is_the_plain_answer_in_order(chat_model, tmp_path):
    with live_server(chat_model, tmp_path) as (url, server):
        key = member(server, "ana")
        plain = client(url, key).chat.completions.create(model="chat", messages=USER, max_tokens=40, seed=11)
        stream = client(url, key).chat.completions.create(
            model="chat",
            messages=USER,
            max_tokens=40,
            seed=11,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        with httpx.stream("POST", url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                          json={"model": "chat", "messages": USER, "max_tokens": 2, "stream": True}) as raw:  # fmt: skip
            lines = [line for line in raw.iter_lines() if line]
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == plain.choices[0].finish_reason and not any(finishes[:-1])
    # Same seed, same answer: the stream carries exactly the plain answer's text, in order (characters
    # split across byte tokens: test_a_character_split_across_byte_tokens_is_streamed_only_once_whole).
    assert "".join(deltas) == plain.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert "usage" not in json.loads(lines[-2][6:])  # not asked for: no usage field


def test_a_stop_string_ends_the_answer_before_it(chat_model, tmp_path):
    with live_server(chat_model, tmp_path) as (url, server):
        openai_client = client(url, member(server, "ana"))
        full = openai_client.chat.completions.create(model="chat", messages=USER, max_tokens=30, seed=5)
        text = full.choices[0].message.content
        stop = text[6:9]
        cut = openai_client.chat.completions.create(
            model="chat", messages=USER, max_tokens=30, seed=5, stop=[stop]
        )
        streamed = openai_client.chat.completions.create(
            model="chat", messages=USER, max_tokens=30, seed=5, stop=stop, stream=True
        )
        pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert len(text) > 9
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert "".join(pieces) == text[: text.index(stop)]


def test_client_tools_are_rendered_and_the_models_calls_come_back_as_tool_calls(chat_model, tmp_path):
    tokenizer = chat_model[1]
    call = '<tool_call>\n{"name": "encender_luz", "arguments": {"sala": "cocina"}}\n</tool_call>'
    ids = tokenizer.encode("Vale.\n" + call) + [tokenizer.special_ids["<|end|>"]]
    tools = [{"type": "function", "function": {"name": "encender_luz", "description": "Enciende una luz",
                                               "parameters": {"type": "object"}}}]  # fmt: skip
    with live_server(chat_model, tmp_path, NO_TOOLS, model=ScriptedModel(ids)) as (url, server):
        openai_client = client(url, member(server, "ana"))
        answer = openai_client.chat.completions.create(model="chat", messages=USER, tools=tools)
        chunks = list(
            openai_client.chat.completions.create(model="chat", messages=USER, tools=tools, stream=True)
        )
        without_tools = openai_client.chat.completions.create(model="chat", messages=USER)
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls"
    assert message.content == "Vale."
    [tool_call] = message.tool_calls
    assert tool_call.type == "function" and tool_call.function.name == "encender_luz"
    assert json.loads(tool_call.function.arguments) == {"sala": "cocina"}
    rendered = {"messages": [{"role": "system", "content": app.load_settings(app.DEFAULT_CONFIG, [])["system_prompt"]},
                             *USER], "tools": tools}  # fmt: skip
    assert answer.usage.prompt_tokens == len(template.render(rendered, tokenizer, True)[0])
    streamed_calls = [
        c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls
    ]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == "Vale."
    assert streamed_calls[0][0].function.name == "encender_luz" and streamed_calls[0][0].index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Without client tools the same text is no call, and never shown (chat/visible.py).
    assert (
        without_tools.choices[0].finish_reason == "stop"
        and without_tools.choices[0].message.content == "Vale."
    )


def test_tool_calls_are_constrained_to_the_clients_and_to_the_servers_own_tools(
    chat_model, tmp_path, monkeypatch
):
    import jsonschema
    from test_agent_grammar import CLIENT_TOOLS, MALFORMED, NoisyModel, noisy_forward_passes

    from agent import dataset, grammar, tools

    monkeypatch.setattr(tools, "searcher_from_env", lambda provider: dataset.CannedSearch([]))
    tokenizer = chat_model[1]
    model = NoisyModel(tokenizer, ends=True).eval()  # opens a call at once, then noise; ends where it may
    schemas = {spec["function"]["name"]: spec["function"]["parameters"] for spec in CLIENT_TOOLS}
    with (
        noisy_forward_passes(model),
        live_server(chat_model, tmp_path, model=model, context=4096) as (url, server),
    ):
        openai_client = client(url, member(server, "ana"))
        for seed in range(4):
            answer = openai_client.chat.completions.create(
                model="chat", messages=USER, tools=CLIENT_TOOLS, max_tokens=500, temperature=1.0, seed=seed
            )
            assert answer.choices[0].finish_reason == "tool_calls"
            for call in answer.choices[0].message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        model.prompts.clear()
        seen, build = [], grammar.constraint_for
        monkeypatch.setattr(
            grammar, "constraint_for", lambda *a, **k: seen.append(a + tuple(k.values())) or build(*a, **k)
        )
        own = openai_client.chat.completions.create(model="chat", messages=USER, max_tokens=500, seed=5)
        bad = ask(url, member(server, "eva"), model="chat", messages=USER, tools=[{"type": "function", "function": {
            "name": "rara", "parameters": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3,
                                                                              "maximum": 1}}}}}])  # fmt: skip
    assert own.choices[0].finish_reason in ("stop", "length")
    results = [tokenizer.decode(prompt).split("<tool_response>\n")[-1] for prompt in model.prompts[1:]]
    assert len(results) == server.agent_settings["max_calls_per_turn"]  # a call per generation, all run
    assert not [
        text for text in results if any(word in text.split("\n</tool_response>")[0] for word in MALFORMED)
    ]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"
    assert "tool 'rara'" in bad.json()["error"]["message"]
    # the server's own turn grounds its calls in the conversation (agent.grounding.mode constrained)
    assert seen and all(
        len(arguments) == 5 and arguments[4][-1]["role"] in ("user", "tool") for arguments in seen[:-1]
    )


def test_without_client_tools_the_servers_tools_run_between_generations(chat_model, tmp_path):
    tokenizer = chat_model[1]
    end = tokenizer.special_ids["<|end|>"]
    call = '<tool_call>\n{"name": "calculadora", "arguments": {"expresion": "4*10+2"}}\n</tool_call>'
    model = ScriptedModel(tokenizer.encode("Calculo.\n" + call) + [end], tokenizer.encode("Son 42.") + [end])
    with live_server(chat_model, tmp_path, model=model, context=4096) as (url, server):
        openai_client = client(url, member(server, "ana"))
        answer = openai_client.chat.completions.create(model="chat", messages=USER)
        chunks = list(openai_client.chat.completions.create(model="chat", messages=USER, stream=True))
        offered = openai_client.chat.completions.create(
            model="chat", messages=USER, tools=[{"type": "function", "function": {"name": "luz"}}]
        )
    # The client sees the text around the call, never the call; the model read the tool's result.
    assert (
        answer.choices[0].message.content == "Calculo.\n\nSon 42."
        and answer.choices[0].finish_reason == "stop"
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Calculo.\n\nSon 42."
    second_prompt = tokenizer.decode(model.prompts[1])
    assert (
        "<tools>" in tokenizer.decode(model.prompts[0])
        and "<tool_response>\n42\n</tool_response>" in second_prompt
    )
    assert answer.usage.prompt_tokens == len(model.prompts[0]) + len(model.prompts[1])
    # A request with its own tools gets them, not the server's: the call (to a tool it did not offer) is no
    # call, and never shown (chat/visible.py).
    message = offered.choices[0].message
    assert (
        offered.choices[0].finish_reason == "stop"
        and message.content == "Calculo."
        and not message.tool_calls
    )


BAD_REQUESTS = [
    ("not JSON", b'{"model": "chat", "messages": [', 400, "invalid_json"),
    ("a list, not an object", b"[]", 400, "invalid_type"),
    ("no model", {"messages": USER}, 400, "invalid_type"),
    ("unknown model", {"model": "gpt-4o", "messages": USER}, 404, "model_not_found"),
    ("empty messages", {"model": "chat", "messages": []}, 400, "empty_messages"),
    ("messages as text", {"model": "chat", "messages": "hola"}, 400, "invalid_type"),
    ("a bad role", {"model": "chat", "messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_value"),
    ("an image part", {"model": "chat", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "unsupported_content"),
    ("content as a number", {"model": "chat", "messages": [{"role": "user", "content": 7}]}, 400, "invalid_type"),
    ("temperature as text", {"model": "chat", "messages": USER, "temperature": "hot"}, 400, "invalid_type"),
    ("temperature too high", {"model": "chat", "messages": USER, "temperature": 9}, 400, "invalid_value"),
    ("max_tokens 0", {"model": "chat", "messages": USER, "max_tokens": 0}, 400, "invalid_value"),
    ("max_tokens a float", {"model": "chat", "messages": USER, "max_tokens": 2.5}, 400, "invalid_type"),
    ("stream as text", {"model": "chat", "messages": USER, "stream": "yes"}, 400, "invalid_type"),
    ("seed as a bool", {"model": "chat", "messages": USER, "seed": True}, 400, "invalid_type"),
    ("five stops", {"model": "chat", "messages": USER, "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value"),
    ("tools not a list", {"model": "chat", "messages": USER, "tools": {"x": 1}}, 400, "invalid_type"),
    ("a tool message without a call", {"model": "chat", "messages": [*USER, {"role": "tool", "content": "x"}]},
     400, "invalid_conversation"),
    ("too many messages", {"model": "chat", "messages": USER * 201}, 400, "too_many_messages"),
    ("a prompt longer than the context", {"model": "chat", "messages": [{"role": "user", "content": "hola " * 400}]},
     400, "context_length_exceeded"),
    ("ten megabytes", b'{"model": "chat", "messages": "' + b"x" * 10_000_000 + b'"}', 413, "request_too_large"),
]  # fmt: skip


def test_bad_requests_get_the_right_4xx_with_a_clear_message_and_never_a_traceback(chat_model, tmp_path):
    with live_server(chat_model, tmp_path) as (url, server):
        headers = {"Authorization": f"Bearer {member(server, 'ana')}", "Content-Type": "application/json"}
        for label, body, status, code in BAD_REQUESTS:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            answer = httpx.post(url + "/v1/chat/completions", content=content, headers=headers, timeout=60)
            error = answer.json()["error"]
            assert (answer.status_code, error["code"]) == (status, code), (label, answer.text[:300])
            assert set(error) == {"message", "type", "param", "code"}, label
            assert (
                error["type"]
                == {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error"}[
                    status
                ]
            )
            assert error["message"] and "Traceback" not in answer.text, label
        missing = httpx.get(url + "/v1/nothing", headers=headers)
        wrong_method = httpx.delete(url + "/v1/models", headers=headers)
        with pytest.raises(openai.NotFoundError, match="gpt-4o"):
            client(url, headers["Authorization"][7:]).chat.completions.create(model="gpt-4o", messages=USER)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"


class BrokenModel(ScriptedModel):
    """Stands in for a model whose first `failures` generations fail (out of memory, a bad kernel)."""

    def __init__(self, failures, *scripts):
        super().__init__(*scripts)
        self.failures = failures

    def script_for(self, prompt, constraint=None):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("CUDA out of memory at /secret/path/model.py:123")
        return super().script_for(prompt, constraint)


def test_a_failed_generation_is_a_500_in_openais_shape_and_the_worker_lives_on(chat_model, tmp_path):
    tokenizer = chat_model[1]
    model = BrokenModel(2, tokenizer.encode("Bien.") + [tokenizer.special_ids["<|end|>"]])
    with live_server(chat_model, tmp_path, NO_TOOLS, model=model) as (url, server):
        key = member(server, "ana")
        plain = ask(url, key, model="chat", messages=USER)
        with httpx.stream("POST", url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                          json={"model": "chat", "messages": USER, "stream": True}) as raw:  # fmt: skip
            lines = [line for line in raw.iter_lines() if line]
        after = client(url, key).chat.completions.create(model="chat", messages=USER)
    assert plain.status_code == 500
    assert plain.json() == {"error": {"message": "generation failed on the server", "type": "server_error",
                                      "param": None, "code": "generation_failed"}}  # fmt: skip
    # A stream has already said 200: the error comes as its last event, before [DONE].
    assert json.loads(lines[-2][6:])["error"]["code"] == "generation_failed" and lines[-1] == "data: [DONE]"
    assert not any("secret" in text or "Traceback" in text for text in (plain.text, *lines))
    assert after.choices[0].message.content == "Bien."


def concurrent_answers(url, keys, max_tokens=8):
    """One request per key, started 20 ms apart, all in flight together."""
    answers = []
    threads = [
        threading.Thread(
            target=lambda k: answers.append(ask(url, k, model="chat", messages=USER, max_tokens=max_tokens)),
            args=(key,),
        )
        for key in keys
    ]
    for thread in threads:
        thread.start()
        time.sleep(0.02)
    for thread in threads:
        thread.join()
    return answers


def test_a_full_queue_answers_503_and_a_busy_member_429_both_with_retry_after(chat_model, tmp_path):
    slow = ScriptedModel([100], delay=0.05)  # 8 tokens: 0.4 s per answer
    sequential = ("serve.queue_size=1", "serve.max_batch=1")
    with live_server(chat_model, tmp_path, *sequential, model=slow) as (url, server):
        everyone = concurrent_answers(url, [member(server, f"m{i}") for i in range(4)])
    with live_server(chat_model, tmp_path, "serve.max_pending_per_member=2", model=slow) as (url, server):
        one_member = concurrent_answers(url, [member(server, "ana")] * 4)
    # 100 tokens at 5 ms a step: two answers decode together for 0.5 s, one waits, two more are refused.
    batched, quick = ("serve.queue_size=1", "serve.max_batch=2"), ScriptedModel([100], delay=0.005)
    with live_server(chat_model, tmp_path, *batched, model=quick) as (url, server):
        two_slots = concurrent_answers(url, [member(server, f"m{i}") for i in range(5)], max_tokens=100)
        peak = server.worker.status()["peak_active"]
    # One running and one queued are answered; the rest are refused, never failed.
    assert sorted(a.status_code for a in everyone) == [200, 200, 503, 503]
    assert sorted(a.status_code for a in one_member) == [200, 200, 429, 429]
    assert sorted(a.status_code for a in two_slots) == [200, 200, 200, 503, 503] and peak == 2
    for answer in everyone + one_member + two_slots:
        if answer.status_code != 200:
            assert int(answer.headers["Retry-After"]) >= 1
            assert answer.json()["error"]["code"] in ("server_busy", "too_many_requests")


def test_a_client_that_disconnects_stops_its_generation(chat_model, tmp_path):
    slow = ScriptedModel([100], delay=0.01)
    with live_server(chat_model, tmp_path, "serve.max_tokens=400", model=slow) as (url, server):
        key = member(server, "ana", "admin")
        body = {"model": "chat", "messages": USER, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {key}"}) as answer:  # fmt: skip
            for _ in zip(range(3), answer.iter_lines(), strict=False):
                pass  # three lines in, the client goes away
        deadline = time.monotonic() + 10
        while server.worker.stats["cancelled"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = httpx.get(url + "/api/server", headers={"Authorization": f"Bearer {key}"}).json()
    assert stats["cancelled"] == 1 and stats["answered"] == 0
    assert stats["generated_tokens"] < 200  # 400 asked for, 4 s of generation; it stopped within ~1 s


def sse_deltas(url, key, body):
    """The content deltas of a streamed completion, read straight off the wire (no client library)."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True},
                      headers={"Authorization": f"Bearer {key}"}) as answer:  # fmt: skip
        chunks = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]
    return [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]


def test_a_character_split_across_byte_tokens_is_streamed_only_once_whole(chat_model, tmp_path):
    tokenizer = chat_model[1]
    text = "Mira: 🦙 y ꙮ."
    for character in ("🦙", "ꙮ"):  # sentencepiece's byte fallback: one piece per UTF-8 byte
        pieces = tokenizer.encode(character)
        assert len(pieces) == len(character.encode()) and all(map(tokenizer.processor.is_byte, pieces))
    model = ScriptedModel(tokenizer.encode(text) + [tokenizer.special_ids["<|end|>"]], delay=0.002)
    with live_server(chat_model, tmp_path, NO_TOOLS, model=model) as (url, server):
        deltas = sse_deltas(url, member(server, "ana"), {"model": "chat", "messages": USER})
    assert "".join(deltas) == text
    assert "🦙" in deltas and "ꙮ" in deltas and not any("\ufffd" in delta for delta in deltas), deltas


def test_temperature_and_top_p_of_the_request_reach_the_sampler(chat_model, tmp_path):
    body = {"model": "chat", "messages": USER, "max_tokens": 24}
    with live_server(chat_model, tmp_path, NO_TOOLS) as (url, server):
        key = member(server, "ana")
        texts = {}
        for label, fields in [("greedy", {"temperature": 0}), ("top_p tiny", {"top_p": 1e-9, "temperature": 1}),
                              ("hot", {"temperature": 2})]:  # fmt: skip
            texts[label] = [
                "".join(sse_deltas(url, key, body | fields | {"seed": seed})) for seed in (1, 2, 3)
            ]
    # temperature 0, or a nucleus of one token, is the argmax whatever the seed; at temperature 2 the
    # seeds of the gibberish model disagree.
    assert len(set(texts["greedy"])) == 1 and texts["top_p tiny"] == texts["greedy"]
    assert len(set(texts["hot"])) == 3


def test_the_configured_caps_bound_max_tokens_for_everyone(chat_model, tmp_path):
    endless = ScriptedModel([100])  # never ends its answer on its own
    with live_server(chat_model, tmp_path, NO_TOOLS, "serve.max_tokens=5", "serve.default_max_tokens=3",
                     model=endless) as (url, server):  # fmt: skip
        openai_client = client(url, member(server, "ana"))
        asked = [openai_client.chat.completions.create(model="chat", messages=USER, **fields)
                 for fields in ({"max_tokens": 50}, {"max_completion_tokens": 50}, {"max_tokens": 2}, {})]  # fmt: skip
    assert [a.usage.completion_tokens for a in asked] == [5, 5, 2, 3]
    assert {a.choices[0].finish_reason for a in asked} == {"length"}


def test_a_client_that_gives_up_on_a_plain_completion_stops_its_generation(chat_model, tmp_path):
    slow = ScriptedModel([100], delay=0.01)
    with live_server(chat_model, tmp_path, "serve.max_tokens=400", model=slow) as (url, server):
        key = member(server, "ana")
        body = {"model": "chat", "messages": USER, "max_tokens": 400}
        with pytest.raises(httpx.ReadTimeout):  # the client stops waiting half a second in
            httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                       timeout=0.5)  # fmt: skip
        deadline = time.monotonic() + 10
        while server.worker.stats["cancelled"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        stats = dict(server.worker.stats)
    assert stats["cancelled"] == 1 and stats["answered"] == 0
    assert stats["generated_tokens"] < 300  # 400 asked for, 4 s; stopped about a second after the client left


# -----------------------------------------------------------------------------
# Family accounts


def login(url, name, password):
    session = httpx.Client(base_url=url)
    answer = session.post("/api/login", json={"name": name, "password": password})
    if answer.status_code == 200:  # the page's half of the session, which it keeps in localStorage
        session.headers["X-Session-Key"] = answer.json()["session_key"]
    return session, answer


def test_members_never_reach_each_others_conversations_and_admins_cannot_read_them(chat_model, tmp_path):
    with live_server(chat_model, tmp_path) as (url, server):
        keys = {name: member(server, name, role, "clave-" + name) for name, role in
                [("ana", "adult"), ("beto", "adult"), ("carla", "admin"), ("dani", "child")]}  # fmt: skip
        owner = {"Authorization": f"Bearer {keys['ana']}"}
        made = httpx.post(url + "/api/conversations", headers=owner)
        assert made.status_code == 201
        cid = made.json()["id"]
        reply = httpx.post(
            f"{url}/api/conversations/{cid}/messages",
            headers=owner,
            json={"content": "secreto", "max_tokens": 3},
        )
        assert reply.status_code == 200
        own = httpx.get(f"{url}/api/conversations/{cid}", headers=owner).json()
        assert [m["role"] for m in own["messages"]] == ["user", "assistant"] and own["title"] == "secreto"
        for name in ("beto", "carla", "dani"):
            for by_key in (True, False):
                if by_key:
                    other = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {keys[name]}"})
                else:
                    other, answer = login(url, name, "clave-" + name)
                    assert answer.status_code == 200
                assert other.get("/api/conversations").json()["data"] == []
                attempts = [other.get(f"/api/conversations/{cid}"), other.delete(f"/api/conversations/{cid}"),
                            other.post(f"/api/conversations/{cid}/messages", json={"content": "hola"})]  # fmt: skip
                for attempt in attempts:
                    assert attempt.status_code == 404, (name, attempt.request.method, attempt.text)
                    assert "secreto" not in attempt.text
                other.close()
        # Nor by taking over the account: an admin replacing ana's key would hold a key that reads her.
        admin = {"Authorization": f"Bearer {keys['carla']}"}
        takeover = httpx.post(f"{url}/api/members/ana/key", headers=admin)
        assert (
            takeover.status_code == 403
            and "python -m serve member new-key ana" in takeover.json()["error"]["message"]
        )
        assert httpx.get(f"{url}/api/conversations/{cid}", headers=owner).json() == own  # untouched
        assert httpx.delete(f"{url}/api/conversations/{cid}", headers=owner).status_code == 200
        assert httpx.get(f"{url}/api/conversations/{cid}", headers=owner).status_code == 404


def test_the_conversation_routes_refuse_bad_input_with_a_clear_4xx(chat_model, tmp_path):
    with live_server(chat_model, tmp_path) as (url, server):
        http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {member(server, 'ana')}"})
        cid = http.post("/api/conversations", json={"title": "mía"}).json()["id"]
        cases = [
            (http.post("/api/conversations", json={"title": 7}), 400, "invalid_type"),
            (http.post(f"/api/conversations/{cid}/messages", json={"content": "   "}), 400, "empty_message"),
            (http.post(f"/api/conversations/{cid}/messages", json={"text": "hola"}), 400, "invalid_type"),
            (http.post(f"/api/conversations/{cid}/messages", content=b"{nope", headers=JSON), 400, "invalid_json"),
            (http.post(f"/api/conversations/{cid}/messages", content=b"x" * 2_000_000, headers=JSON), 413,
             "request_too_large"),
            (http.post(f"/api/conversations/{cid}/messages", content=b"{}"), 415, "unsupported_media_type"),
            (http.post("/api/conversations/no-such-id/messages", json={"content": "hola"}), 404, "conversation_not_found"),
            (http.post("/api/login", json={"name": "ana"}), 400, "invalid_type"),
        ]  # fmt: skip
        for answer, status, code in cases:
            assert (answer.status_code, answer.json()["error"]["code"]) == (status, code), answer.request.url
        assert http.get(f"/api/conversations/{cid}").json()["messages"] == []  # nothing half-stored
        http.close()


def test_a_conversation_goes_on_after_an_answer_the_model_ended_at_once(chat_model, tmp_path):
    """An empty answer is the model's own right to end at once; the conversation that holds it (stored by
    the page, or sent back by an OpenAI client) must still be answered, not refused as invalid."""
    with live_server(chat_model, tmp_path, NO_TOOLS) as (url, server):
        key = member(server, "ana")
        ana = server.store.member("ana")["id"]
        http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"})
        cid = http.post("/api/conversations").json()["id"]
        for role, content in (("user", "hola"), ("assistant", "")):  # what the page stored for that answer
            assert server.store.add_message(ana, cid, role, content)
        reply = http.post(f"/api/conversations/{cid}/messages", json={"content": "¿sigues?", "max_tokens": 3})
        assert reply.status_code == 200, reply.text
        stored = http.get(f"/api/conversations/{cid}").json()["messages"]
        assert [(m["role"], m["content"]) for m in stored[:3]] == [
            ("user", "hola"),
            ("assistant", ""),
            ("user", "¿sigues?"),
        ]
        assert [m["role"] for m in stored] == ["user", "assistant"] * 2
        http.close()
        history = [*USER, {"role": "assistant", "content": ""}, {"role": "user", "content": "¿Y bien?"}]
        answer = client(url, key).chat.completions.create(model="chat", messages=history, max_tokens=3)
        assert answer.choices[0].finish_reason in ("stop", "length")


def test_the_small_form_routes_take_bodies_up_to_serve_max_form_bytes(chat_model, tmp_path):
    with live_server(chat_model, tmp_path, "serve.max_form_bytes=300") as (url, server):
        admin = httpx.Client(
            base_url=url,
            headers={"Authorization": f"Bearer {member(server, 'carla', 'admin', 'clave-carla')}"},
        )
        padding = "x" * 200  # unknown fields are ignored: only the size differs between the two requests
        forms = [("/api/login", {"name": "carla", "password": "clave-carla"}),
                 ("/api/me/password", {"current": "clave-carla", "new": "clave-carla-2"}),
                 ("/api/conversations", {"title": "mía"}),
                 ("/api/members", {"name": "eva", "role": "adult", "password": "de-carla"})]  # fmt: skip
        for path, body in forms:
            big = admin.post(path, json=body | {"padding": padding * 2})
            assert (big.status_code, big.json()["error"]["code"]) == (413, "request_too_large"), path
            assert "at most 300" in big.json()["error"]["message"]
            assert admin.post(path, json=body | {"padding": padding}).status_code in (200, 201), path
        admin.close()


def test_only_an_admin_manages_accounts_and_keys_are_stored_only_as_hashes(chat_model, tmp_path):
    with live_server(chat_model, tmp_path) as (url, server):
        admin = {"Authorization": f"Bearer {member(server, 'carla', 'admin')}"}
        adult = {"Authorization": f"Bearer {member(server, 'ana')}"}
        for method, path in [("GET", "/api/members"), ("POST", "/api/members"), ("DELETE", "/api/members/carla"),
                             ("POST", "/api/members/carla/key"), ("GET", "/api/server")]:  # fmt: skip
            answer = httpx.request(method, url + path, headers=adult, json={"name": "x", "role": "admin"})
            assert answer.status_code == 403 and answer.json()["error"]["code"] == "admin_only", path
        no_password = httpx.post(url + "/api/members", headers=admin, json={"name": "dani", "role": "child"})
        assert no_password.status_code == 400 and no_password.json()["error"]["param"] == "password"
        made = httpx.post(
            url + "/api/members", headers=admin, json={"name": "dani", "role": "child", "password": "1234"}
        )
        assert made.status_code == 201 and made.json()["must_change_password"] is True
        first_key = made.json()["api_key"]
        names = [m["name"] for m in httpx.get(url + "/api/members", headers=admin).json()["data"]]
        assert names == ["ana", "carla", "dani"]
        dani = {"Authorization": f"Bearer {first_key}"}
        assert httpx.get(url + "/api/me", headers=dani).json()["role"] == "child"
        # dani's own password (the admin's "1234" is provisional) brings dani's own key.
        new_key = httpx.post(url + "/api/me/password", headers=dani, json={"current": "1234", "new": "8642"})
        new_key = new_key.json()["api_key"]
        # Every member replaces their own key (a leaked one stops working); another's, only the CLI does.
        replaced = httpx.post(url + "/api/members/dani/key", headers={"Authorization": f"Bearer {new_key}"})
        replaced = replaced.json()["api_key"]
        assert httpx.get(url + "/api/me", headers={"Authorization": f"Bearer {new_key}"}).status_code == 401
        assert httpx.get(url + "/api/me", headers={"Authorization": f"Bearer {replaced}"}).status_code == 200
        own_admin_key = httpx.post(url + "/api/members/carla/key", headers=admin).json()["api_key"]
        assert httpx.get(url + "/api/me", headers=admin).status_code == 401
        admin = {"Authorization": f"Bearer {own_admin_key}"}
        assert (
            httpx.post(url + "/api/members/dani/key", headers=admin).json()["error"]["code"] == "not_your_key"
        )
        assert httpx.delete(url + "/api/members/dani", headers=admin).status_code == 200
        assert httpx.get(url + "/api/me", headers={"Authorization": f"Bearer {replaced}"}).status_code == 401
        database = server.settings["database"]
    with open(database, "rb") as f:
        raw = f.read()
    with contextlib.suppress(FileNotFoundError), open(database + "-wal", "rb") as f:
        raw += f.read()
    assert new_key.encode() not in raw and replaced.encode() not in raw
    assert b"1234" not in raw and b"8642" not in raw
    hashes = sqlite3.connect(database).execute(
        "SELECT password_hash FROM members WHERE password_hash IS NOT NULL"
    )
    assert all(row[0].startswith("scrypt$") for row in hashes)


def test_web_login_sets_a_strict_httponly_cookie_and_locks_out_guessing(chat_model, tmp_path):
    with live_server(chat_model, tmp_path, "serve.login_max_failures=3") as (url, server):
        member(server, "ana", "adult", "1357")
        session, answer = login(url, "ana", "1357")
        cookie = answer.headers["set-cookie"].lower()
        assert answer.status_code == 200 and "httponly" in cookie and "samesite=strict" in cookie
        assert session.get("/api/me").json() == {
            "name": "ana",
            "role": "adult",
            "must_change_password": False,
        }
        assert session.post("/api/logout").status_code == 200
        assert session.get("/api/me").status_code == 401
        wrong = [login(url, "ana", pin)[1] for pin in ("0000", "1111", "2222", "1357")]
        assert [a.status_code for a in wrong] == [401, 401, 401, 429]  # locked even for the right PIN
        assert int(wrong[-1].headers["Retry-After"]) > 0
        assert login(url, "nadie", "1357")[1].status_code == 401


def test_the_credentials_an_admin_sets_read_nothing_and_stop_working_once_the_member_changes_them(
    chat_model, tmp_path
):
    with live_server(chat_model, tmp_path, NO_TOOLS) as (url, server):
        admin = {"Authorization": f"Bearer {member(server, 'carla', 'admin')}"}
        made = httpx.post(
            url + "/api/members", headers=admin, json={"name": "eva", "role": "adult", "password": "de-carla"}
        )
        admins_key = made.json()["api_key"]
        # What the admin knows (the first password, the key) reaches only /api/me and the password change.
        by_key = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admins_key}"})
        admins_session, answer = login(url, "eva", "de-carla")
        assert answer.status_code == 200 and answer.json()["must_change_password"] is True
        for http in (by_key, admins_session):
            assert http.get("/api/me").json() == {
                "name": "eva",
                "role": "adult",
                "must_change_password": True,
            }
            refused = [http.get("/api/conversations"), http.post("/api/conversations", json={}),
                       http.get("/api/memories"), http.post("/api/memories", json={"text": "algo"}),
                       http.get("/v1/models"), http.post("/api/members/eva/key"),
                       http.post("/v1/chat/completions", json={"model": "chat", "messages": USER, "max_tokens": 2})]  # fmt: skip
            for attempt in refused:
                assert attempt.status_code == 403, (attempt.request.method, attempt.request.url, attempt.text)
                error = attempt.json()["error"]
                assert (error["type"], error["code"]) == ("permission_error", "password_change_required")
        with pytest.raises(openai.PermissionDeniedError, match="change it first"):
            client(url, admins_key).chat.completions.create(model="chat", messages=USER, max_tokens=2)
        with pytest.raises(openai.PermissionDeniedError):
            client(url, admins_key).models.list()
        assert server.store.conversations(server.store.member("eva")["id"]) == []  # nothing was created

        # eva logs in on her own phone and changes it: a wrong current password, a weak or unchanged new
        # one are refused and change nothing.
        own, _ = login(url, "eva", "de-carla")
        change = lambda current, new: own.post("/api/me/password", json={"current": current, "new": new})  # noqa: E731
        cases = [(change("no-es-esta", "solo-de-eva"), 403, "wrong_password"),
                 (change("de-carla", "123"), 400, "weak_password"),
                 (change("de-carla", "de-carla"), 400, "same_password"),
                 (own.post("/api/me/password", json={"current": "de-carla"}), 400, "invalid_type")]  # fmt: skip
        for answer, status, code in cases:
            assert (answer.status_code, answer.json()["error"]["code"]) == (status, code), answer.text
        assert "new: at least 8" in cases[1][0].json()["error"]["message"]
        assert by_key.get("/api/me").status_code == 200  # still provisional, the old key still works
        changed = change("de-carla", "solo-de-eva")
        assert changed.status_code == 200 and changed.json()["must_change_password"] is False
        evas_key = changed.json()["api_key"]
        assert evas_key != admins_key

        # What the admin knew stops working: the key, the session opened with it, the first password.
        assert by_key.get("/api/me").status_code == 401
        assert admins_session.get("/api/me").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client(url, admins_key).models.list()
        assert login(url, "eva", "de-carla")[1].status_code == 401
        # eva's own credentials read and write: this session, a new login, her new key.
        assert own.get("/api/me").json() == {"name": "eva", "role": "adult", "must_change_password": False}
        assert own.post("/api/conversations", json={"title": "mía"}).status_code == 201
        again, answer = login(url, "eva", "solo-de-eva")
        assert (
            answer.json()["must_change_password"] is False
            and len(again.get("/api/conversations").json()["data"]) == 1
        )
        answer = client(url, evas_key).chat.completions.create(model="chat", messages=USER, max_tokens=2)
        assert answer.choices[0].finish_reason in ("stop", "length")
        # A later change (no longer provisional) keeps the key, ends the other sessions, keeps this one.
        later = again.post("/api/me/password", json={"current": "solo-de-eva", "new": "otra-de-eva"})
        assert later.status_code == 200 and "api_key" not in later.json()
        assert own.get("/api/me").status_code == 401 and again.get("/api/me").status_code == 200
        assert httpx.get(url + "/api/me", headers={"Authorization": f"Bearer {evas_key}"}).status_code == 200
        # By API key, every session ends.
        by_evas_key = httpx.post(url + "/api/me/password", headers={"Authorization": f"Bearer {evas_key}"},
                                 json={"current": "otra-de-eva", "new": "y-otra-mas"})  # fmt: skip
        assert by_evas_key.status_code == 200 and again.get("/api/me").status_code == 401
        for http in (by_key, admins_session, own, again):
            http.close()


def test_a_password_change_needs_a_current_password_and_wrong_ones_count_towards_the_lockout(
    chat_model, tmp_path
):
    with live_server(chat_model, tmp_path, "serve.login_max_failures=2") as (url, server):
        key = member(server, "ana", "adult", "1357")
        ana = {"Authorization": f"Bearer {key}"}
        guesses = [httpx.post(url + "/api/me/password", headers=ana, json={"current": pin, "new": "2468"})
                   for pin in ("0000", "1111", "1357")]  # fmt: skip
        assert [g.status_code for g in guesses] == [403, 403, 429]  # locked even for the right one
        assert login(url, "ana", "1357")[1].status_code == 429  # and so is the login
        assert login(url, "ana", "2468")[1].status_code == 429
        # A member made on the server without a web password sets the first one there, not with the key alone.
        beto = {"Authorization": f"Bearer {member(server, 'beto')}"}
        first = httpx.post(url + "/api/me/password", headers=beto, json={"current": "", "new": "2468"})
        assert first.status_code == 400 and first.json()["error"]["code"] == "no_password"
        assert "python -m serve member password beto" in first.json()["error"]["message"]


def test_an_old_database_gains_the_provisional_column_and_its_members_stay_as_they_were(tmp_path):
    database = str(tmp_path / "old.sqlite")
    old = sqlite3.connect(database)
    old.executescript(
        "CREATE TABLE members (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE COLLATE NOCASE, role TEXT NOT NULL,"
        " key_hash TEXT NOT NULL UNIQUE, password_hash TEXT, created REAL NOT NULL);"
        f"INSERT INTO members (name, role, key_hash, created) VALUES ('ana', 'adult', '{accounts.sha256('enl-x')}', 0);"
    )  # fmt: skip
    old.close()
    store = accounts.Store(database)
    assert store.member_by_key("enl-x")["provisional"] == 0
    accounts.Store(database)  # a second opening finds the column there
    assert [m["name"] for m in store.members()] == ["ana"]


def test_children_get_their_instruction_cap_and_hours(chat_model, tmp_path):
    now = time.localtime().tm_hour
    closed = [(now + 1) % 24, (now + 2) % 24]  # a window that excludes this hour
    with live_server(
        chat_model, tmp_path, "serve.child.max_tokens=3", f"serve.child.allowed_hours={closed}"
    ) as (
        url,
        server,
    ):
        child, adult = member(server, "dani", "child"), member(server, "ana")
        with pytest.raises(openai.PermissionDeniedError, match="children may chat"):
            client(url, child).chat.completions.create(model="chat", messages=USER)
        assert client(url, adult).chat.completions.create(model="chat", messages=USER, max_tokens=2).choices
    with live_server(chat_model, tmp_path, "serve.child.max_tokens=3", "serve.temperature=0", NO_TOOLS) as (
        url,
        server,
    ):
        child, adult = member(server, "dani", "child"), member(server, "ana")
        kid = client(url, child).chat.completions.create(model="chat", messages=USER, max_tokens=50)
        grown = client(url, adult).chat.completions.create(model="chat", messages=USER, max_tokens=50)
    settings = app.load_settings(app.DEFAULT_CONFIG, [])
    system = settings["system_prompt"] + "\n\n" + settings["child"]["system_prompt"]  # the child's rules last
    ids, _ = template.render(
        {"messages": [{"role": "system", "content": system}, *USER]}, chat_model[1], True
    )
    assert kid.usage.prompt_tokens == len(ids) > grown.usage.prompt_tokens
    assert kid.usage.completion_tokens <= 3 < grown.usage.completion_tokens


def test_allowed_hours_also_bound_the_web_chat_and_may_wrap_past_midnight(chat_model, tmp_path):
    now = time.localtime().tm_hour
    windows = {"open": [(now + 2) % 24, (now + 1) % 24], "closed": [(now + 1) % 24, now]}  # 23 h each
    outcomes = {}
    for label, window in windows.items():
        with live_server(chat_model, tmp_path, f"serve.child.allowed_hours={window}") as (url, server):
            http = httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {member(server, 'dani', 'child')}"}
            )
            cid = http.post("/api/conversations").json()["id"]
            answer = http.post(
                f"/api/conversations/{cid}/messages", json={"content": "hola", "stream": False}
            )
            stored = http.get(f"/api/conversations/{cid}").json()["messages"]
            outcomes[label] = answer.status_code, answer.json().get("error", {}).get("code"), len(stored)
            http.close()
    # One of the two windows wraps past midnight (from hour 23, or up to hour 0) whatever the hour now.
    assert any(first > end for first, end in windows.values()), windows
    assert outcomes == {"open": (200, None, 2), "closed": (403, "outside_allowed_hours", 0)}


# -----------------------------------------------------------------------------
# The real process: CLI, load, SIGKILL


def test_the_member_cli_prints_a_key_once_and_stores_its_hash(tmp_path):
    database = str(tmp_path / "family.sqlite")
    key = serve_member(database, "ana", "admin", password="una clave")
    listing = subprocess.run([sys.executable, "-m", "serve", "member", "list", f"serve.database={database}"],
                             cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    assert key.startswith("enl-") and key not in listing.stdout and "ana" in listing.stdout
    again = subprocess.run([sys.executable, "-m", "serve", "member", "add", "ana", "--role", "child",
                            f"serve.database={database}"], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr
    row = sqlite3.connect(database).execute("SELECT key_hash, password_hash FROM members").fetchone()
    assert row[0] == accounts.sha256(key) and row[1].startswith("scrypt$")
    bad = subprocess.run([sys.executable, "-m", "serve", "member", "list", "serve.queue_sise=3"], cwd=ROOT,
                         capture_output=True, text=True)  # fmt: skip
    assert (
        bad.returncode == 2 and "serve.queue_sise: unknown key; did you mean serve.queue_size?" in bad.stderr
    )


def test_member_new_key_and_remove_from_the_command_line(tmp_path):
    database = str(tmp_path / "family.sqlite")
    old = serve_member(database, "ana", "adult")
    store = accounts.Store(database)
    cid = store.new_conversation(store.member("ana")["id"], "mía")
    store.add_message(store.member("ana")["id"], cid, "user", "hola")

    def member_cli(*args):
        command = [sys.executable, "-m", "serve", "member", *args, f"serve.database={database}"]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True)

    renewed = member_cli("new-key", "ana")
    new = renewed.stdout.strip().splitlines()[-1]
    assert renewed.returncode == 0 and new.startswith("enl-") and new != old
    assert store.member_by_key(old) is None and store.member_by_key(new)["name"] == "ana"
    assert store.member("ana")["key_hash"] == accounts.sha256(new)
    removed = member_cli("remove", "ana")
    assert removed.returncode == 0 and "ana" not in member_cli("list").stdout
    assert store.member_by_key(new) is None and store.query("SELECT * FROM messages") == []
    for args in (("remove", "ana"), ("new-key", "nadie")):
        missing = member_cli(*args)
        assert missing.returncode == 2 and "no member" in missing.stderr and "Traceback" not in missing.stderr
    journal = sqlite3.connect(database).execute("PRAGMA journal_mode").fetchone()[0]
    assert journal == "wal"  # a mode of the file itself: readers never wait for the writer


def listening_address(port):
    """The local address of the TCP socket listening on port (Linux's /proc/net/tcp{,6})."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:
                    return address
    return None


def test_the_server_listens_on_loopback_unless_host_says_otherwise_and_then_warns(chat_run, tmp_path):
    database = str(tmp_path / "host.sqlite")
    started = {}
    for label, args in (("default", ()), ("lan", ("--host", "0.0.0.0"))):
        log = tmp_path / f"{label}.log"
        proc, url = start_server(chat_run, database, *args, log_path=log)
        try:
            port = int(url.rsplit(":", 1)[1])
            started[label] = (
                listening_address(port),
                httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code,
            )
        finally:
            proc.kill()
            proc.wait()
        started[label] += ("WARNING" in log.read_text(),)
    assert started["default"] == ("0100007F", 401, False)  # 127.0.0.1, little-endian hex
    assert started["lan"] == ("00000000", 401, True)  # every interface, with the warning


def test_a_byte_level_run_is_refused_with_the_run_to_use_instead(tmp_path, byte_data_dir):
    import train

    train.train(
        tiny_config(tmp_path, "bytes", byte_data_dir, "run_name=bytes", "train.max_steps=2"),
        log=lambda *a: None,
    )
    database = f"serve.database={tmp_path / 'x.sqlite'}"
    started = subprocess.run([sys.executable, "-m", "serve", str(tmp_path / "bytes"), "--port", "0", database],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert started.returncode == 2 and "Traceback" not in started.stderr
    assert (
        "no chat control tokens" in started.stderr
        and "make serve RUN=runs/smoke-corpus-cpu" in started.stderr
    )


def test_the_shipped_serve_configs_are_valid_and_a_typo_names_its_file(tmp_path):
    folder = os.path.join(ROOT, "configs", "serve")
    for name in os.listdir(folder):
        config.load_layer("serve", os.path.join(folder, name))
    (tmp_path / "serve").mkdir()
    bad = tmp_path / "serve" / "bad.yaml"
    bad.write_text("include: serve/default.yaml\nserve:\n  queue_size: 0\n")
    (tmp_path / "serve" / "default.yaml").write_text(open(os.path.join(folder, "default.yaml")).read())
    with pytest.raises(
        config.ConfigError, match=r"bad.yaml: serve.queue_size: 0 is out of range; expected >= 1"
    ):
        config.load_layer("serve", str(bad))


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def converse(url, key, label, turns, results):
    """One client: its own conversation, `turns` streamed messages, each answer checked to be its own."""
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
        cid = http.post("/api/conversations").json()["id"]
        sent, answers, busy = [], [], 0
        while len(sent) < turns:
            text = f"{label} mensaje {len(sent)}"
            with http.stream(
                "POST", f"/api/conversations/{cid}/messages", json={"content": text, "max_tokens": 4}
            ) as r:
                if r.status_code == 503:
                    busy += 1
                    r.read()
                    time.sleep(0.05)
                    continue
                assert r.status_code == 200, r.read()
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            assert {c["conversation_id"] for c in chunks} == {cid}
            sent.append(text)
            answers.append(
                "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
            )
        stored = http.get(f"/api/conversations/{cid}").json()["messages"]
    results.append((label, sent, answers, stored, busy))


def load_round(url, keys, turns):
    results = []
    threads = [
        threading.Thread(target=converse, args=(url, key, f"c{i}", turns, results))
        for i, key in enumerate(keys)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_twenty_clients_get_their_own_answers_and_the_server_memory_stays_flat(chat_run, tmp_path):
    database = str(tmp_path / "load.sqlite")
    store = accounts.Store(database)  # `member add` itself has its own test; here it would cost 20 starts
    keys = [store.add_member(f"c{i}", "adult") for i in range(20)]
    proc, url = start_server(chat_run, database, "serve.queue_size=8", log_path=tmp_path / "server.log")
    try:
        rounds = []
        for _ in range(2):
            results = load_round(url, keys, 10)
            rounds.append((results, rss_kib(proc.pid)))
    finally:
        proc.kill()
        proc.wait()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log and "failed" not in log
    # Every answer a client saw is the one stored in its own conversation, in order, beside its own
    # messages: nothing lost, nothing from another client.
    for results, _ in rounds:
        assert len(results) == 20
        for _label, sent, answers, stored, _busy in results:
            assert [m["role"] for m in stored] == ["user", "assistant"] * 10
            assert [m["content"] for m in stored[0::2]] == sent
            assert [m["content"] for m in stored[1::2]] == answers
    growth = rounds[1][1] - rounds[0][1]
    assert growth < 20 * 1024, f"server RSS grew {growth} KiB over a second round of 200 requests"


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one core: there is no team of threads to keep apart")
def test_the_servers_decode_thread_runs_torch_on_every_thread_while_the_event_loop_keeps_one(
    chat_run, tmp_path
):
    # serve/app.py one_thread_here: the event loop's thread loads the model on one thread, so that the
    # decode thread's team is the process's only one; the decode thread still gets the machine's count.
    database = str(tmp_path / "threads.sqlite")
    key = accounts.Store(database).add_member("papa", "admin")
    proc, url = start_server(chat_run, database, log_path=tmp_path / "server.log")
    try:
        status = httpx.get(url + "/api/server", headers={"Authorization": f"Bearer {key}"}).json()
    finally:
        proc.kill()
        proc.wait()
    assert status["threads"] == torch.get_num_threads()


def test_the_server_thread_keeps_one_torch_thread_and_hands_the_machines_count_to_the_decode_thread():
    seen = {}

    def server_thread():  # a fresh thread, as the server's own: the test process keeps its threads
        before = torch.get_num_threads()
        seen["handed"], seen["kept"] = app.one_thread_here(), torch.get_num_threads()
        torch.set_num_threads(before)
        seen["before"] = before

    thread = threading.Thread(target=server_thread)
    thread.start()
    thread.join()
    assert seen["handed"] == seen["before"] and seen["kept"] == 1


def test_sigkill_mid_answer_loses_no_acknowledged_turn(chat_run, tmp_path):
    database = str(tmp_path / "kill.sqlite")
    key = accounts.Store(database).add_member("ana", "adult")
    headers = {"Authorization": f"Bearer {key}"}
    proc, url = start_server(chat_run, database, log_path=tmp_path / "server.log")
    try:
        cid = httpx.post(url + "/api/conversations", headers=headers).json()["id"]
        first = httpx.post(f"{url}/api/conversations/{cid}/messages", headers=headers,
                           json={"content": "primera", "stream": False, "max_tokens": 6}).json()  # fmt: skip
        with httpx.stream("POST", f"{url}/api/conversations/{cid}/messages", headers=headers,
                          json={"content": "segunda", "max_tokens": 200}) as answer:  # fmt: skip
            next(answer.iter_lines())
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    finally:
        proc.kill()
    proc, url = start_server(chat_run, database)
    try:
        stored = httpx.get(f"{url}/api/conversations/{cid}", headers=headers).json()["messages"]
    finally:
        proc.kill()
        proc.wait()
    assert stored[0] == stored[0] | {"role": "user", "content": "primera"}
    assert stored[1] == stored[1] | {"role": "assistant", "content": first["message"]["content"]}
    # The second answer is stored only once it has ended, in one write. A tiny model can reach its end of
    # turn before the kill lands (the race CI lost once): then the turn is there whole; otherwise at most
    # its question is. Never an assistant without its question, never a second copy.
    assert [m["role"] for m in stored[2:]] in ([], ["user"], ["user", "assistant"])
    assert all(m["content"] for m in stored[2:]) and stored[2:3] in ([], [stored[2] | {"content": "segunda"}])


def test_the_default_ahead_of_time_step_on_a_machine_without_a_compiler_says_why_and_serves_eager(
    chat_run, tmp_path
):
    # serve.compile.cpu=aot is the CPU's default: a machine that cannot build it must still serve.
    env = os.environ | {"CXX": str(tmp_path / "no-such-g++"), "XDG_CACHE_HOME": str(tmp_path / "cache"),
                        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # fmt: skip
    server = subprocess.Popen([sys.executable, "-m", "serve", chat_run, "--port", "0",
                               f"serve.database={tmp_path / 'x.sqlite'}"], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        line = server.stdout.readline()  # the "model ... at http://" line once it listens
    finally:
        server.terminate()
        _, errors = server.communicate(timeout=60)
    assert " at http://127.0.0.1:" in line, errors
    assert "serve.compile.cpu=aot: the decode step did not compile" in errors and "decoding eager" in errors
    assert "Traceback" not in errors
