"""agent/tools.py: the tools, the strict call parser and the bounded loop.

The searches go through the real search.py to a real HTTP server on 127.0.0.1 serving the captured
pages (test_search's LocalServer). A scripted policy stands in for the model's choices: it returns the
replies a model might write and records every conversation it was shown.
"""

import copy
import datetime
import json
import os
import shutil

import pytest
from test_search import BRAVE_PATH, DDG_PATH, FAST, JSON, TEN_TITLES, TEN_URLS, LocalServer, env_for, fixture

import config
import search
from agent import tools
from chat import template

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MONDAY = datetime.datetime(2026, 11, 30, 11, 0, tzinfo=datetime.UTC)  # 12:00 in Madrid


@pytest.fixture
def settings():
    return tools.load_settings()


@pytest.fixture
def server():
    local = LocalServer()
    yield local
    local.close()


def searcher(server, provider="ddg"):
    return search.SearchChain.from_env(provider, env=env_for(server), limits=FAST)


class Script:
    """The model's replies in order (a string, or a function of the conversation it is shown)."""

    def __init__(self, *replies):
        self.replies = list(replies)
        self.seen = []

    def __call__(self, conversation):
        template.check_conversation(conversation)  # every prompt the loop builds is a valid conversation
        self.seen.append(copy.deepcopy(conversation))
        reply = self.replies.pop(0)
        return reply(conversation) if callable(reply) else reply


def call_text(name, arguments):
    return template.tool_call_text({"function": {"name": name, "arguments": arguments}})


def run(settings, script, question="Hola", **options):
    events = []
    options.setdefault("clock", lambda: MONDAY)
    helper = tools.Agent(settings, on_event=lambda kind, data: events.append((kind, data)), **options)
    new = helper.run_turn([{"role": "user", "content": question}], script)
    template.check_conversation({"messages": [{"role": "user", "content": question}, *new]})
    return new, events


def tool_texts(new):
    return [m["content"] for m in new if m["role"] == "tool"]


# --- search -------------------------------------------------------------------------------------------


def test_search_results_reach_the_model_numbered_and_the_answer_lists_the_cited_urls(settings, server):
    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"))
    settings["search"]["max_tokens"] = 4000  # the default count is bytes, an upper bound of tokens
    script = Script(call_text("buscar_web", {"consulta": "tiempo en San Francisco"}), "Según [2], hará sol.")
    new, events = run(settings, script, searcher=searcher(server))

    (result,) = tool_texts(new)
    blocks = result.split("\n\n")
    assert len(blocks) == settings["search"]["results"]
    for number, block in enumerate(blocks, start=1):
        head, snippet = block.split("\n")
        assert head == f"[{number}] {TEN_TITLES[number - 1]} — {TEN_URLS[number - 1]}"
        assert 0 < len(snippet) <= settings["search"]["snippet_chars"]
    assert new[-1]["content"] == f"Según [2], hará sol.\n\nFuentes:\n[2] {TEN_URLS[1]}"
    assert [kind for kind, _ in events] == ["call", "result", "answer"]
    assert parse_form(server)["q"] == ["tiempo en San Francisco"]


def parse_form(server):
    from urllib.parse import parse_qs

    (request,) = server.requests
    return parse_qs(request.body.decode())


def test_max_resultados_asks_for_fewer_results_and_uncited_answers_list_every_source(settings, server):
    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"))
    settings["search"]["max_tokens"] = 4000
    script = Script(call_text("buscar_web", {"consulta": "tiempo", "max_resultados": 2}), "Hará sol.")
    new, _ = run(settings, script, searcher=searcher(server))
    assert tool_texts(new)[0].count(" — https://") == 2
    assert new[-1]["content"].endswith(f"Fuentes:\n[1] {TEN_URLS[0]}\n[2] {TEN_URLS[1]}")


def test_a_fuentes_list_written_by_the_model_is_replaced_by_the_real_urls(settings, server):
    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"))
    invented = "Dice [1] que llueve.\n\nFuentes:\n[1] https://inventada.example/"
    script = Script(call_text("buscar_web", {"consulta": "tiempo"}), invented)
    new, _ = run(settings, script, searcher=searcher(server))
    assert new[-1]["content"] == f"Dice [1] que llueve.\n\nFuentes:\n[1] {TEN_URLS[0]}"


def test_zero_results_is_the_text_sin_resultados(settings, server):
    server.route(DDG_PATH, 200, fixture("ddg_lite_empty.html"))
    script = Script(call_text("buscar_web", {"consulta": "xqzv kfjrw"}), "No he encontrado nada.")
    new, _ = run(settings, script, searcher=searcher(server))
    assert tool_texts(new) == ["Sin resultados"]
    assert new[-1]["content"] == "No he encontrado nada."  # no sources to list


def test_every_provider_failing_is_an_error_result_naming_them(settings, server):
    server.route(DDG_PATH, 403, fixture("ddg_lite_blocked_403.html"))
    server.route(BRAVE_PATH, 429, fixture("brave_error_429.json"), JSON)
    script = Script(call_text("buscar_web", {"consulta": "tiempo"}), "La búsqueda ha fallado.")
    new, events = run(settings, script, searcher=searcher(server, "auto"))
    (result,) = tool_texts(new)
    assert result.startswith(
        "Error: la búsqueda ha fallado en todos los proveedores (ddg: Blocked; brave: RateLimited)."
    )
    assert tools.RETRY_HINT in result
    assert events[1][1]["ok"] is False


def test_a_result_block_over_the_token_budget_keeps_whole_results_that_fit(settings, server):
    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"))
    settings["search"]["max_tokens"] = 500  # bytes, with the default count; one result is ~250-350
    script = Script(call_text("buscar_web", {"consulta": "tiempo"}), "Vale.")
    new, _ = run(settings, script, searcher=searcher(server))
    (result,) = tool_texts(new)
    assert len(result.encode()) <= 500
    assert result.startswith(f"[1] {TEN_TITLES[0]}")
    blocks = result.split("\n\n")
    assert 1 <= len(blocks) < settings["search"]["results"] and not result.endswith("…")


def test_a_first_result_alone_over_the_budget_is_cut_to_fit(settings, server):
    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"))
    settings["search"]["max_tokens"] = 40
    script = Script(call_text("buscar_web", {"consulta": "tiempo"}), "Vale [1].")
    new, _ = run(settings, script, searcher=searcher(server), count_tokens=lambda text: len(text.encode()))
    (result,) = tool_texts(new)
    assert result.endswith("…") and len(result.encode()) <= 40
    assert result.startswith("[1] 10 Day Weather")
    assert new[-1]["content"].endswith(f"Fuentes:\n[1] {TEN_URLS[0]}")


def test_arguments_are_checked_before_anything_runs(settings, server):
    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"))
    script = Script(
        call_text("buscar_web", {"consulta": 42}),
        call_text("buscar_web", {"query": "tiempo"}),
        call_text("buscar_web", {"consulta": "tiempo", "max_resultados": 9}),
        "No puedo buscar.",
    )
    new, _ = run(settings, script, searcher=searcher(server))
    first, second, third = tool_texts(new)
    assert first.startswith("Error: el argumento 'consulta' debe ser de tipo string, no 42.")
    assert second.startswith("Error: falta el argumento obligatorio 'consulta'.")
    assert third.startswith(
        "Error: el argumento 'max_resultados' no es válido: 9 is greater than the maximum"
    )
    assert server.requests == []


# --- the loop's edge cases -------------------------------------------------------------------------------


def test_malformed_json_goes_back_as_an_error_and_the_model_can_retry(settings):
    bad = '<tool_call>\n{"name": "calculadora", "arguments": {"expresion": "2+2"}\n</tool_call>'
    script = Script(bad, call_text("calculadora", {"expresion": "2+2"}), "Son 4.")
    new, events = run(settings, script)
    first, second = tool_texts(new)
    assert first.startswith("Error: llamada mal formada: no es JSON válido (Expecting ',' delimiter")
    assert tools.RETRY_HINT in first
    assert second == "4"
    assert new[-1]["content"] == "Son 4."
    assert events[0][1]["raw"].strip() == bad.split("\n", 1)[1].rsplit("\n", 1)[0]
    assert "<tool_response>\nError: llamada mal formada" in template.render_text(script.seen[1])


def test_an_unknown_tool_is_an_error_naming_the_tools_there_are(settings):
    script = Script(call_text("tiempo", {"ciudad": "Madrid"}), "No lo sé.")
    new, _ = run(settings, script)
    assert tool_texts(new) == [
        "Error: no existe la herramienta 'tiempo'; hay buscar_web, calculadora, fecha_hora. "
        + tools.RETRY_HINT
    ]


def deep_call(levels):
    return (
        '<tool_call>\n{"name": "calculadora", "arguments": {"expresion": '
        + "[" * levels
        + "]" * levels
        + "}}\n</tool_call>"
    )


@pytest.mark.parametrize("levels", [20, 990, 1000, 100_000])
def test_a_call_nested_deeper_than_max_call_depth_is_an_error_result_not_a_recursion_error(settings, levels):
    new, events = run(settings, Script(deep_call(levels), "Vaya."))
    (result,) = tool_texts(new)
    assert result.startswith("Error: llamada mal formada: ") and tools.RETRY_HINT in result
    assert "16 niveles" in result or "demasiados niveles" in result
    assert new[0]["tool_calls"][0]["function"]["arguments"] == {}  # never rendered back at that depth
    assert events[0][1]["arguments"] == {}


def test_an_integer_past_pythons_digit_limit_is_an_error_result_not_an_attribute_error(settings):
    huge = '<tool_call>\n{"name": "fecha_hora", "arguments": {"dias": ' + "9" * 5000 + "}}\n</tool_call>"
    new, _ = run(settings, Script(huge, "Vaya."))
    assert tool_texts(new) == [
        "Error: llamada mal formada: un número del JSON tiene demasiadas cifras. " + tools.RETRY_HINT
    ]


def test_model_text_quoted_back_in_an_error_is_cut_to_max_echo_chars(settings):
    limit = settings["max_echo_chars"]
    long_name, long_zone, long_key = "x" * 20_000, "Europe/" + "y" * 20_000, "z" * 20_000
    script = Script(
        call_text(long_name, {}),
        call_text("fecha_hora", {"zona": long_zone}),
        call_text("calculadora", {"expresion": "1", long_key: 1}),
        call_text("calculadora", {"expresion": ["w" * 20_000]}),
        "Vaya.",
    )
    new, _ = run(settings, script)
    texts = tool_texts(new)
    assert len(texts) == 4
    for text in texts:
        assert text.startswith("Error: ") and len(text) < 2 * limit + 200, text[:300]
    assert texts[0].startswith("Error: no existe la herramienta 'xxxx") and "…" in texts[0]
    assert new[1]["name"] == new[0]["tool_calls"][0]["function"]["name"] and len(new[1]["name"]) <= limit


def test_after_the_maximum_of_calls_the_model_answers_once_with_tools_left_out(settings):
    settings["max_calls_per_turn"] = 3
    again = call_text("calculadora", {"expresion": "1+1"})
    script = Script(again, again, again, again + "\nY más.", "ignored")
    new, events = run(settings, script)
    assert tool_texts(new) == ["2", "2", "2"]
    assert ["tools" in c for c in script.seen] == [True, True, True, False]
    assert len(script.replies) == 1  # no fifth generation
    assert new[-1]["content"] == tools.NO_ANSWER  # the final reply was only a call: dropped
    assert ("dropped", {"text": again + "\nY más.", "reason": "tools are off for the final answer"}) in events


def test_calls_past_the_maximum_in_one_reply_get_an_error_each(settings):
    settings["max_calls_per_turn"] = 2
    three = "\n".join(call_text("calculadora", {"expresion": f"{n}*10"}) for n in (1, 2, 3))
    script = Script("Calculo.\n" + three, "Son 10, 20 y no sé.")
    new, _ = run(settings, script)
    assert new[0]["content"] == "Calculo." and len(new[0]["tool_calls"]) == 3
    results = tool_texts(new)
    assert results[:2] == ["10", "20"]
    assert results[2].startswith("Error: se alcanzó el máximo de 2 llamadas en esta respuesta.")
    assert "tools" not in script.seen[-1]


def test_a_tool_that_runs_past_its_timeout_is_an_error_result(settings, server):
    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"), delay_s=5)
    settings["timeouts_s"]["buscar_web"] = 0.2
    script = Script(call_text("buscar_web", {"consulta": "tiempo"}), "No responde.")
    new, _ = run(settings, script, searcher=searcher(server))
    assert tool_texts(new) == ["Error: la herramienta no respondió en 0.2 s. " + tools.RETRY_HINT]


def test_a_tool_that_crashes_is_an_error_result_not_a_crash(settings):
    @tools.tool("rompe", "Siempre falla.", {})
    def rompe(arguments, context):
        raise RuntimeError("boom")

    try:
        new, _ = run(settings, Script(call_text("rompe", {}), "Vaya."))
    finally:
        del tools.TOOLS["rompe"]
    assert tool_texts(new) == ["Error: fallo interno de la herramienta (RuntimeError). " + tools.RETRY_HINT]


def test_adding_a_tool_is_one_entry_and_it_is_offered_checked_and_run(settings):
    @tools.tool("eco", "Repite un texto.", {"texto": {"type": "string"}}, required=("texto",))
    def eco(arguments, context):
        return arguments["texto"].upper()

    try:
        script = Script(call_text("eco", {"texto": "hola"}), call_text("eco", {}), "HOLA")
        new, _ = run(settings, script)
    finally:
        del tools.TOOLS["eco"]
    assert tool_texts(new)[0] == "HOLA"
    assert tool_texts(new)[1].startswith("Error: falta el argumento obligatorio 'texto'.")
    names = [spec["function"]["name"] for spec in script.seen[0]["tools"]]
    assert names == ["buscar_web", "calculadora", "fecha_hora", "eco"]


def test_no_tools_means_no_schemas_in_the_prompt_and_no_calls_run(settings):
    script = Script(call_text("calculadora", {"expresion": "2+2"}))
    new, events = run(settings, script, tools_enabled=False)
    assert "tools" not in script.seen[0]
    assert new == [{"role": "assistant", "content": tools.NO_ANSWER}]
    assert [kind for kind, _ in events] == ["dropped", "answer"]


def test_the_system_turn_states_the_date_and_lists_the_tools(settings):
    script = Script("Hola.")
    run(settings, script)
    text = template.render_text(script.seen[0])
    expected_tools = "\n".join(json.dumps(spec, ensure_ascii=False) for spec in tools.tool_specs(settings))
    assert text.startswith(
        f"<|bos|><|system|>{settings['system_prompt']}\nHoy es lunes, 30 de noviembre de 2026.\n\n"
        f"<tools>\n{expected_tools}\n</tools><|end|><|user|>Hola<|end|>"
    )
    kept = tools.Agent(settings, clock=lambda: MONDAY).conversation(
        [{"role": "system", "content": "Sé breve."}]
    )
    assert kept["messages"] == [
        {"role": "system", "content": "Sé breve.\nHoy es lunes, 30 de noviembre de 2026."}
    ]


# --- the parser -----------------------------------------------------------------------------------------


def test_the_parser_reads_text_and_calls_laid_out_as_chat_renders_them():
    message = {
        "role": "assistant",
        "content": "Miro dos cosas.",
        "tool_calls": [
            {"function": {"name": "calculadora", "arguments": {"expresion": "3*4"}}},
            {"function": {"name": "fecha_hora", "arguments": {}}},
        ],
    }
    reply = tools.parse_reply(template.assistant_text(message))
    assert reply.content == "Miro dos cosas."
    assert [(c.name, c.arguments, c.error) for c in reply.calls] == [
        ("calculadora", {"expresion": "3*4"}, None),
        ("fecha_hora", {}, None),
    ]
    assert tools.parse_reply("Solo texto.") == tools.Reply("Solo texto.", [])


@pytest.mark.parametrize(
    "text, error",
    [
        ('<tool_call>\n{"name": "calculadora", "arguments": {}}\n', "falta </tool_call>"),
        ('<tool_call>\n{"name": "calculadora", "arguments": {}}\n</tool_call>\nY luego.', "texto después de"),
        (
            '<tool_call>\n{"name": "calculadora", "arguments": {}, "id": 1}\n</tool_call>',
            'con "name" y "arguments"',
        ),
        (
            '<tool_call>\n{"name": "calculadora", "arguments": "2+2"}\n</tool_call>',
            '"arguments" debe ser un objeto',
        ),
        ('<tool_call>\n["calculadora"]\n</tool_call>', 'con "name" y "arguments", llegó list'),
        ('<tool_call>\n{"name": "calculadora"}\n</tool_call>', 'falta "arguments"'),
        ('<tool_call>\n{"arguments": {}, "a": 1, "b": 2}\n</tool_call>', 'falta "name" y sobran 2 claves'),
        ('<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>', '"name" debe ser'),
        ("Hola </tool_call>", "</tool_call> sin <tool_call>"),
    ],
)
def test_the_parser_turns_every_broken_call_into_an_error(text, error):
    reply = tools.parse_reply(text)
    assert any(call.error and error in call.error for call in reply.calls), reply


# --- calculadora ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, value",
    [
        ("2+3*4", "14"),
        ("7/2", "3,5"),
        ("2,5*2", "5"),
        ("(1+2)**3", "27"),
        ("-3**2", "-9"),
        ("10 // 3", "3"),
        ("10 % 3", "1"),
        ("15% * 80", "12"),
        ("3 × 4 ÷ 2", "6"),
        ("2^10", "1024"),
        ("1/3", "0,3333333333"),
        ("0,1+0,2", "0,3"),
    ],
)
def test_the_calculator_computes_arithmetic(settings, expression, value):
    result = tools.Agent(settings).call(tools.Call("calculadora", {"expresion": expression}))
    assert (result.ok, result.text) == (True, value)


@pytest.mark.parametrize(
    "expression, value",
    [
        ("1.000*3", "3000"),  # a thousand times three
        ("1.000.000/4", "250000"),
        ("1.250,5+1", "1251,5"),
        ("2,35*2", "4,7"),
        ("12.50*2", "25"),  # a point before two digits is a decimal point
        ("1,234.5+0,5", "1235"),
        ("100 - 10%", "90"),  # a share of what precedes it
        ("100 + 21%", "121"),
        ("100*(1-10%)", "90"),
        ("64-64*30%", "44,8"),
        ("10% de 250", "25"),
        ("3 x 4", "12"),
        ("3x4", "12"),
        ("10 : 2", "5"),
        ("raíz(16)", "4"),
        ("raiz cuadrada de 2", "1,414213562"),
        ("sqrt(2,25)", "1,5"),
        ("abs(3-10)", "7"),
        ("redondear(7,5)", "8"),
    ],
)
def test_the_calculator_reads_spanish_numbers_and_operators(settings, expression, value):
    result = tools.Agent(settings).call(tools.Call("calculadora", {"expresion": expression}))
    assert (result.ok, result.text) == (True, value)


def test_a_question_about_money_gets_its_result_in_cents(settings):
    share = call_text("calculadora", {"expresion": "186/7"})
    new, _ = run(
        settings, Script(share, "Ya."), "Somos 7 para pagar una cena de 186 euros, ¿cuánto pone cada uno?"
    )
    assert new[1]["content"] == "26,57"
    new, _ = run(settings, Script(share, "Ya."), "¿Cuánto es 186 entre 7?")
    assert new[1]["content"] == "26,57142857"
    new, _ = run(settings, Script(call_text("calculadora", {"expresion": "2,5*3"}), "Ya."), "3 kilos a 2,5 €")
    assert new[1]["content"] == "7,50"


@pytest.mark.parametrize(
    "expression, error",
    [
        ("__import__('os').system('echo pwned')", "el carácter «_» no cabe en una cuenta (posición 1)"),
        ("().__class__.__bases__", "el carácter «.» no cabe en una cuenta (posición 3)"),
        ("y + 1", "no conozco «y»"),
        ("'a' * 10", "el carácter «'» no cabe"),
        ("[1] * 10", "el carácter «[» no cabe"),
        ("lambda: 1", "no conozco «lambda»"),
        ("9**9**9", "el exponente 387420489 supera el máximo de 1000"),
        ("10**100000", "el exponente 100000 supera el máximo de 1000"),
        ("2**1000", "el resultado tendría unas 301 cifras"),
        ("99999**20 * 99999**20", "supera las 100 cifras"),
        ("10.0**400", "el resultado tendría unas 400 cifras"),
        ("(-8)**0.5", "no es un número real"),
        ("1/0", "no se puede dividir entre cero"),
        ("0**-1", "no se puede dividir entre cero"),
        ("5 // (3-3)", "no se puede dividir entre cero"),
        ("(1+" * 40 + "1" + ")" * 40, "anida más de 30"),
        ("(" * 99 + "1" + ")" * 100, "anida más de 30"),  # 200 characters
        ("-" * 150 + "1", "anida más de 30"),
        ("((((2)", "falta cerrar el paréntesis abierto en la posición 3"),
        ("(2))", "sobra un «)» en la posición 4"),
        ("1+" * 150 + "1", "tiene 301 caracteres; el máximo es 200"),
        ("2 +", "falta un número al final, después de «+»"),
        ("3 4", "falta un operador antes de la posición 3"),
        ("", "la expresión está vacía"),
        ("1.2.3", "el número 1.2.3 no se entiende"),
        ("5 de 3", "«de» solo va detrás de un porcentaje"),
        ("raíz(-4)", "no hay raíz cuadrada de un número negativo (-4)"),
    ],
)
def test_the_calculator_refuses_hostile_input_with_one_spanish_line(settings, expression, error):
    result = tools.Agent(settings).call(tools.Call("calculadora", {"expresion": expression}))
    assert not result.ok
    assert result.text.startswith("Error: ") and error in result.text, result.text
    assert "\n" not in result.text and "invalid syntax" not in result.text and "Constant" not in result.text


# --- fecha_hora -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments, text",
    [
        ({}, "lunes, 30 de noviembre de 2026, 12:00 (Europe/Madrid)"),
        ({"zona": "America/Mexico_City"}, "lunes, 30 de noviembre de 2026, 05:00 (America/Mexico_City)"),
        (
            {"dias": 45},
            "hoy es lunes, 30 de noviembre de 2026; dentro de 45 días: jueves, 14 de enero de 2027",
        ),
        (
            {"dias": -30},
            "hoy es lunes, 30 de noviembre de 2026; hace 30 días: sábado, 31 de octubre de 2026",
        ),
    ],
)
def test_the_date_tool_gives_the_family_zone_by_default_and_does_date_arithmetic(settings, arguments, text):
    result = tools.Agent(settings, clock=lambda: MONDAY).call(tools.Call("fecha_hora", arguments))
    assert (result.ok, result.text) == (True, text)


def test_the_date_tool_refuses_an_unknown_zone_and_huge_offsets(settings):
    helper = tools.Agent(settings, clock=lambda: MONDAY)
    assert (
        "no conozco la zona horaria 'Marte/Olimpo'"
        in helper.call(tools.Call("fecha_hora", {"zona": "Marte/Olimpo"})).text
    )
    assert "supera el máximo de 36500 días" in helper.call(tools.Call("fecha_hora", {"dias": 10**9})).text


@pytest.mark.parametrize("zone", ["Europe", "America/Argentina", "../../etc/passwd", "/etc/localtime", ""])
def test_a_folder_of_tzdata_or_a_path_is_an_unknown_zone_not_an_internal_failure(settings, zone):
    result = tools.Agent(settings, clock=lambda: MONDAY).call(tools.Call("fecha_hora", {"zona": zone}))
    assert not result.ok and result.text.startswith(f"Error: no conozco la zona horaria {zone!r}")


# --- the config layer ------------------------------------------------------------------------------------


def test_the_agent_layer_file_is_checked_by_its_schema(tmp_path):
    folder = tmp_path / "agent"
    folder.mkdir()
    bad = folder / "bad.yaml"
    bad.write_text("include: agent/default.yaml\nagent:\n  max_calls_per_turns: 2\n")
    (folder / "default.yaml").write_text(open(tools.DEFAULT_SETTINGS, encoding="utf-8").read())
    with pytest.raises(config.ConfigError) as raised:
        config.load_layer("agent", str(bad))
    assert (
        str(raised.value)
        == f"{bad}: agent.max_calls_per_turns: unknown key; did you mean agent.max_calls_per_turn?"
    )
    (folder / "ok.yaml").write_text("include: agent/default.yaml\nagent:\n  max_calls_per_turn: 2\n")
    assert config.load_layer("agent", str(folder / "ok.yaml"))["max_calls_per_turn"] == 2


def test_a_run_file_may_include_the_agent_layer(tmp_path):
    shutil.copytree(os.path.join(ROOT, "configs"), tmp_path / "configs")
    run_file = tmp_path / "configs" / "smoke-cpu.yaml"
    plain = config.load(str(run_file))
    text = run_file.read_text().replace("include:\n", "include:\n  agent: agent/default.yaml\n")
    run_file.write_text(text + "agent:\n  timezone: America/Bogota\n")
    resolved = config.load(str(run_file))
    assert resolved["agent"]["timezone"] == "America/Bogota"
    assert tools.load_settings(resolved["agent"])["max_calls_per_turn"] == 4
    assert "agent" not in plain  # optional: other runs do not name it


@pytest.mark.parametrize(
    "partial, shown",
    [
        ("Lo miro", "Lo miro"),
        ("Lo miro.\n<tool", "Lo miro."),
        ("Lo miro.\n<", "Lo miro."),
        ("Lo miro.\n<tool_call>\n{", "Lo miro."),
        ("2 < 3", "2 < 3"),
    ],
)
def test_a_reply_being_streamed_never_shows_its_calls(partial, shown):
    assert tools.visible_text(partial) == shown


# --- sample.py --chat ----------------------------------------------------------------------------------


def chat_session(shard_data_dir, lines, policy, seq_len=2048, **agent_overrides):
    import io
    from types import SimpleNamespace

    import data
    import sample
    from model import Transformer

    tokenizer = data.SentencePieceTokenizer(f"{shard_data_dir}/tokenizer.model")
    model_cfg = config.load_layer("model", os.path.join(ROOT, "configs", "model", "smoke.yaml"))
    model_cfg.update(vocab_size=tokenizer.vocab_size, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2)
    model_cfg.update(ffn_hidden=64, seq_len=seq_len)
    settings = tools.load_settings()
    for key, value in agent_overrides.items():
        settings[key].update(value)
    args = SimpleNamespace(
        run="tiny",
        max_new_tokens=8,
        temperature=1.0,
        top_k=None,
        top_p=None,
        seed=0,
        system="",
        no_tools=False,
    )
    out = io.StringIO()
    cfg = {"model": model_cfg, "agent": settings}
    sample.run_chat(Transformer(model_cfg), tokenizer, cfg, args, io.StringIO(lines), out, policy=policy)
    return out.getvalue()


def test_the_chat_repl_shows_each_call_and_result_then_the_answer(shard_data_dir):
    script = Script(call_text("calculadora", {"expresion": "6*7"}), "Son 42.")
    shown = chat_session(shard_data_dir, "¿Cuánto es 6 por 7?\n/exit\n", script)
    assert '  [tool call] calculadora {"expresion": "6*7"}\n  [tool result] 42\nSon 42.\n> ' in shown
    assert "tools" in script.seen[0] and script.seen[1]["messages"][-1] == {
        "role": "tool",
        "content": "42",
        "tool_call_id": "call_0_0",
        "name": "calculadora",
    }


def test_the_chat_repl_lists_the_sources_of_a_search(shard_data_dir, server, monkeypatch):
    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"))
    monkeypatch.setenv("ENLACE_DDG_URL", server.url(DDG_PATH))
    monkeypatch.setenv("ENLACE_ENV_FILE", os.devnull)
    monkeypatch.setattr(tools, "_chains", {})
    script = Script(call_text("buscar_web", {"consulta": "tiempo"}), "Según [1], hace sol.")
    shown = chat_session(shard_data_dir, "¿Qué tiempo hace?\n/exit\n", script, search={"provider": "ddg"})
    assert f"  [tool result] [1] {TEN_TITLES[0]} — {TEN_URLS[0]}\n    " in shown
    assert f"Según [1], hace sol.\nFuentes:\n[1] {TEN_URLS[0]}\n> " in shown


def test_the_chat_repl_turns_tools_off_when_their_schemas_do_not_fit_the_context(shard_data_dir):
    shown = chat_session(shard_data_dir, "hola\n/exit\n", Script(), seq_len=64)
    assert "(tools off: their schemas need " in shown and "of the 56 tokens this context leaves)" in shown
    assert "[tool" not in shown


# --- grounding: the numbers of a calculation come from the conversation -----------------------------------


def test_a_calculation_with_a_number_nobody_said_gets_a_hint_once_and_is_counted(settings):
    # the model copies a memorised expression instead of the question's numbers, then does it again
    events = []
    helper = tools.Agent(
        settings, clock=lambda: MONDAY, on_event=lambda kind, data: events.append((kind, data))
    )
    script = Script(
        call_text("calculadora", {"expresion": "110*30/100"}),
        call_text("calculadora", {"expresion": "110*870"}),
        call_text("calculadora", {"expresion": "870*10%"}),
        "Es 87.",
    )
    question = [{"role": "user", "content": "¿Cuánto es el 10 % de 870?"}]
    new = helper.run_turn(question, script)
    results = tool_texts(new)
    assert (
        results[0]
        == "33 (Aviso: el número 110 no aparece en la pregunta; usa los números que ha dicho la persona.)"
    )
    assert results[1:] == ["95700", "87"]  # once a turn: the second call gets no hint
    assert helper.ungrounded == 1
    assert ("ungrounded", {"name": "calculadora", "numbers": ["110"]}) in events
    assert "el número 110 no aparece" in script.seen[1]["messages"][-1]["content"]  # the model reads it


def test_numbers_said_anywhere_in_the_conversation_or_known_get_no_hint(settings):
    memories = "Eres ENLACE.\n\nRecuerdos:\n- [4] El alquiler es de 1.250,50 euros"
    conversation = [
        {"role": "system", "content": memories},
        {"role": "user", "content": "¿Cuánto pago en 2 años si subo el alquiler 3,5 por ciento?"},
    ]
    script = Script(call_text("calculadora", {"expresion": "1250.5*(1+3.50/100)*12*2"}), "Unos 31.000 euros.")
    helper = tools.Agent(settings, clock=lambda: MONDAY)
    new = helper.run_turn(conversation, script)
    assert tool_texts(new) == ["31062,42"] and helper.ungrounded == 0


@pytest.mark.parametrize(
    ("question", "arguments", "hinted"),
    [
        ("¿Qué día será dentro de 45 días?", {"dias": 45}, None),
        ("¿Qué día será dentro de 45 días?", {"dias": 54}, "el número 54 no aparece"),
        ("¿Qué día fue hace 13 días?", {"dias": -13}, None),
        ("¿Qué día es mañana?", {"dias": 1}, None),
        ("¿Qué hora es en Tokio?", {"zona": "Asia/Tokyo"}, None),
    ],
)
def test_a_date_offset_is_checked_like_a_calculation(settings, question, arguments, hinted):
    new, events = run(settings, Script(call_text("fecha_hora", arguments), "Listo."), question)
    text = tool_texts(new)[0]
    assert (
        (hinted in text)
        if hinted
        else ("Aviso" not in text and not any(k == "ungrounded" for k, _ in events))
    )


def test_two_unsaid_numbers_are_named_together_and_grounding_can_be_off(settings):
    new, _ = run(
        settings, Script(call_text("calculadora", {"expresion": "347*28"}), "Ya."), "¿Cuánto es 34 por 82?"
    )
    assert "los números 347 ni 28 no aparecen en la pregunta" in tool_texts(new)[0]
    settings["grounding"]["mode"] = "off"
    new, _ = run(
        settings, Script(call_text("calculadora", {"expresion": "347*28"}), "Ya."), "¿Cuánto es 34 por 82?"
    )
    assert tool_texts(new) == ["9716"]


def test_a_failed_call_gets_its_error_and_no_grounding_hint(settings):
    new, _ = run(
        settings, Script(call_text("calculadora", {"expresion": "77/0"}), "No se puede."), "Divide 5 entre 0"
    )
    assert (
        tool_texts(new)[0].startswith("Error: no se puede dividir entre cero")
        and "Aviso" not in tool_texts(new)[0]
    )


def test_a_whole_float_where_an_integer_is_due_is_read_as_the_integer(settings):
    # JSON Schema takes 1.0 as an integer; the date must not read "dentro de 1.0 días"
    new, events = run(settings, Script(call_text("fecha_hora", {"dias": 1.0}), "Mañana."), "¿Y mañana?")
    text = tool_texts(new)[0]
    assert "1.0" not in text and "dentro de 1 día:" in text
    assert new[0]["tool_calls"][0]["function"]["arguments"] == {"dias": 1}
    new, _ = run(settings, Script(call_text("calculadora", {"expresion": "  2+2 "}), "4."), "¿2 y 2?")
    assert new[0]["tool_calls"][0]["function"]["arguments"] == {"expresion": "2+2"}


def test_a_number_said_in_words_gets_no_hint(settings):
    question = "¿Cuánto cuestan media docena de huevos a treinta y cinco céntimos?"
    new, events = run(settings, Script(call_text("calculadora", {"expresion": "6*0.35"}), "2,1."), question)
    assert ("ungrounded", {"name": "calculadora", "numbers": ["0.35"]}) in events  # 6 and 35 are said
    new, events = run(settings, Script(call_text("calculadora", {"expresion": "6*35/100"}), "2,1."), question)
    assert tool_texts(new) == ["2,10"] and not any(kind == "ungrounded" for kind, _ in events)  # in cents
