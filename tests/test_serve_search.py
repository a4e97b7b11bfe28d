"""A fresh install's server searches the web: without a Brave key (no account) buscar_web asks DuckDuckGo
alone and the server says at start that there is no fallback; a Brave key is checked at start. DuckDuckGo is
a real HTTP server on 127.0.0.1 answering with the recorded lite page (tests/fixtures/search); the model's
choices are scripted, the server, the agent loop and the search chain are the real ones."""

import os
import sys

import openai
import pytest
from conftest import ROOT, ScriptedModel, live_server, start_server
from test_search import DDG_PATH, TEN_TITLES, TEN_URLS, LocalServer, fixture

from agent import tools
from chat import template

QUESTION = [{"role": "user", "content": "¿Qué tiempo hace hoy en San Francisco?"}]
NO_COMPILE = 'serve.compile.cpu="off"'  # the start-up line is the point, not the compiled step


@pytest.fixture
def duckduckgo(monkeypatch):
    """DuckDuckGo lite on 127.0.0.1 with its recorded results page, and an environment with no Brave key
    and no .env: a fresh install."""
    local = LocalServer()
    local.route(DDG_PATH, 200, fixture("ddg_lite_results.html"))
    monkeypatch.setenv("ENLACE_DDG_URL", local.url(DDG_PATH))
    monkeypatch.setenv("ENLACE_ENV_FILE", os.devnull)
    monkeypatch.delenv("BRAVE_API_KEY", raising=False)
    monkeypatch.setattr(tools, "_chains", {})  # the chain of this environment, not of an earlier test
    yield local
    local.close()


def search_call(query):
    return template.tool_call_text({"function": {"name": "buscar_web", "arguments": {"consulta": query}}})


def test_a_server_without_a_brave_key_answers_a_question_that_needs_the_web(chat_model, tmp_path, duckduckgo):
    tokenizer = chat_model[1]
    end = tokenizer.special_ids["<|end|>"]
    model = ScriptedModel(
        tokenizer.encode("Lo busco.\n" + search_call("tiempo San Francisco")) + [end],
        tokenizer.encode("Según [1], hace sol.") + [end],
    )
    with live_server(chat_model, tmp_path, model=model, context=4096) as (url, server):
        key = server.store.add_member("ana", "adult")
        answer = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0).chat.completions.create(
            model="chat", messages=QUESTION
        )
    assert (
        answer.choices[0].message.content
        == f"Lo busco.\n\nSegún [1], hace sol.\n\nFuentes:\n[1] {TEN_URLS[0]}"
    )
    assert duckduckgo.hits(DDG_PATH) == 1
    shown_to_the_model = tokenizer.decode(model.prompts[1])
    assert f"[1] {TEN_TITLES[0]} — {TEN_URLS[0]}" in shown_to_the_model


def test_the_server_says_at_start_that_search_has_no_fallback_without_a_key(chat_run, tmp_path, duckduckgo):
    log = tmp_path / "serve.log"
    proc, url = start_server(chat_run, str(tmp_path / "db.sqlite"), NO_COMPILE, log_path=log)
    proc.kill()
    proc.wait()
    said = [line for line in log.read_text().splitlines() if "buscar_web" in line]
    assert len(said) == 1 and said[0].startswith(
        "serve: buscar_web searches with ddg alone, no fallback when it fails (no BRAVE_API_KEY; "
    ), log.read_text()


def test_a_brave_key_that_cannot_be_sent_is_named_at_start_not_at_the_first_search(
    chat_run, tmp_path, duckduckgo, monkeypatch
):
    monkeypatch.setenv("BRAVE_API_KEY", "pegada con espacios")
    log = tmp_path / "serve.log"
    proc, url = start_server(chat_run, str(tmp_path / "db.sqlite"), NO_COMPILE, log_path=log)
    proc.kill()
    proc.wait()
    assert "serve: buscar_web will fail every call: BRAVE_API_KEY holds a space" in log.read_text()
    assert duckduckgo.requests == []


def test_with_a_brave_key_the_chain_is_duckduckgo_then_brave_and_built_before_any_search(
    duckduckgo, monkeypatch
):
    monkeypatch.setenv("BRAVE_API_KEY", "BSA0123456789abcdef")
    said = tools.readiness(tools.load_settings())
    assert said == ["buscar_web searches with ddg then brave"]
    assert list(tools._chains) == ["auto"] and duckduckgo.requests == []


def test_a_time_zone_this_machine_lacks_is_named_at_start(duckduckgo):
    settings = {**tools.load_settings(), "timezone": "Europe/Atlantida"}
    said = tools.readiness(settings, names=["calculadora", "fecha_hora"])
    assert said == [
        "fecha_hora will fail without a zone: agent.timezone 'Europe/Atlantida' is not in this machine's time "
        "zone database (pip install tzdata)"
    ]


def test_the_hint_for_a_first_member_names_the_interpreter_that_serves(chat_run, tmp_path, duckduckgo):
    # a bare `python` in a fresh shell is not .venv's: the hint names the one that can import the server
    log = tmp_path / "serve.log"
    proc, url = start_server(chat_run, str(tmp_path / "db.sqlite"), NO_COMPILE, log_path=log)
    proc.kill()
    proc.wait()
    here = os.path.relpath(sys.executable, ROOT)
    python = here if not here.startswith("..") else sys.executable
    assert f"serve: no members yet: {python} -m serve member add NAME --role admin" in log.read_text()
