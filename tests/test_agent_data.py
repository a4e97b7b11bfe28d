"""agent/dataset.py: the seeded tool-use conversations — every kind, real tool results, values a model can
copy from the question, wide enough that arguments rarely repeat — and the hand-written set they never
repeat."""

import collections
import json
import re
from decimal import Decimal

import pytest

from agent import dataset, expression, grounding, phrases, tools
from chat import template
from evaluation import tool_use
from family import memories


@pytest.fixture(scope="module")
def small():
    settings = tools.load_settings()
    settings["synthetic"]["conversations"] = 900
    settings["synthetic"]["eval_fraction"] = 0.2
    return settings


@pytest.fixture(scope="module")
def generated(small):
    return dataset.generate(small)


@pytest.fixture(scope="module")
def shipped_training_data():
    """The training conversations of the shipped agent layer: what make sft-agent trains on."""
    return dataset.generate(tools.load_settings())[0]


def kind_of(conversation):
    return conversation["source"].split()[1]


def the_call(conversation):
    return next(m["tool_calls"][0]["function"] for m in conversation["messages"] if "tool_calls" in m)


def test_the_same_seed_writes_the_same_conversations_and_another_seed_others(small, generated):
    assert dataset.generate(small) == generated
    other = json.loads(json.dumps(small))
    other["synthetic"]["seed"] += 1
    assert dataset.generate(other)[0] != generated[0]


def test_every_kind_of_the_mix_is_there_and_every_conversation_renders(generated, small):
    train, held_out = generated
    kinds = collections.Counter(kind_of(c) for c in train + held_out)
    assert set(kinds) == set(small["synthetic"]["mix"])
    member_tools = tools.tool_specs(small, tools.default_tools(member="someone"))
    offered = collections.Counter()
    for conversation in train + held_out:
        template.check_conversation(conversation)
        assert conversation["tools"] in (tools.tool_specs(small), member_tools)
        assert conversation["messages"][0]["content"].startswith(small["system_prompt"])
        offered[len(conversation["tools"])] += 1
        if kind_of(conversation) in dataset.MEMORY_KINDS:
            assert conversation["tools"] == member_tools
    assert offered[3] > 50 and offered[6] > 300  # both the REPL's tools and the server's member tools


def test_no_tool_and_values_are_both_trained_on_and_held_out(generated):
    train, held_out = generated
    trained = {dataset.call_key(c) for c in train} - {None}
    held = [dataset.call_key(c) for c in held_out if dataset.call_key(c)]
    assert len(held) > 50 and not trained & set(held)
    assert dataset.unseen_share(train, held_out)[1] > 0.95  # what repeats is a call without values: {}


def test_numbers_and_day_counts_are_said_in_words_too(generated):
    train, held_out = generated
    asked = [c for c in train + held_out if kind_of(c) in ("calculadora", "fecha_hora")]
    in_words = [c for c in asked if re.search(r"\d", the_call(c)["arguments"].get("expresion", "")
                                              + str(the_call(c)["arguments"].get("dias", "")))
                and not re.search(r"\d", dataset.user_question(c))]  # fmt: skip
    assert len(in_words) > 0.1 * len(asked)
    assert any("semanas" in dataset.user_question(c) for c in asked)


def test_no_question_is_both_trained_on_and_held_out(generated):
    train, held_out = generated
    asked = [dataset.user_question(c) for c in held_out]
    assert len(asked) == len(set(asked)) > 10
    assert not set(asked) & {dataset.user_question(c) for c in train}


def test_tool_results_are_the_real_tools_and_answers_state_them(generated, small):
    train, held_out = generated
    seen = collections.Counter()
    for conversation in train + held_out:
        messages = conversation["messages"]
        called = [i for i, m in enumerate(messages) if "tool_calls" in m]
        if not called:
            assert kind_of(conversation) == "sin_herramienta" and messages[-2]["role"] == "user"
            continue
        call, result, answer = (
            the_call(conversation),
            messages[called[0] + 1]["content"],
            messages[-1]["content"],
        )
        kind = kind_of(conversation)
        if call["name"] == "calculadora":
            value = tools.calculate(call["arguments"]["expresion"], small["calculator"])
            money = tools.speaks_of_money(
                dataset.user_question(conversation), small["calculator"]["money_words"]
            )
            assert result == expression.render(value, money=money)
        if kind == "sin_resultados":
            assert result == "Sin resultados"
        if kind == "error_busqueda":
            assert result.startswith("Error: la búsqueda ha fallado en todos los proveedores")
        if kind == "buscar_web":
            assert result.startswith("[1] ") and answer.startswith("Según [1]")
            assert answer.endswith("\n\nFuentes:\n[1] " + result.split(" — ")[1].split("\n")[0])
        if kind == "recordar":
            assert re.fullmatch(
                r"Recuerdo \d+ guardado \((privado|de la familia)\)\.", result
            ) or result.startswith("Error: solo una persona adulta puede guardar recuerdos de la familia")
        if kind == "olvidar":
            number = call["arguments"]["id"]
            assert result.startswith(f"Recuerdo {number} borrado: «")
            # the number is in the question, or in the memories the system turn lists
            assert str(number) in messages[-4]["content"] or f"[{number}]" in messages[0]["content"]
        if kind == "buscar_recuerdos":
            assert result == "Sin recuerdos que coincidan." or result.startswith("- [")
        fact = tool_use.result_fact(call["name"], result, answer.lower())
        assert fact and tool_use.states(answer, fact), (result, answer)
        seen[kind] += 1
    assert min(seen.values()) > 0 and len(seen) == 8


def test_memory_conversations_list_the_members_memories_as_the_server_does(generated):
    train, _ = generated
    header = memories.load_config()["header"]
    listed = [c for c in train if header in c["messages"][0]["content"]]
    assert len(listed) > 100
    for conversation in listed:
        system = conversation["messages"][0]["content"]
        assert re.search(r"^- \[\d+\] ", system, re.M)
        assert system.rstrip().splitlines()[-1].startswith("Hoy es ")


def copyable(conversation):
    """Whether the call's values can be copied from what the model reads (question or system turn)."""
    call, kind = the_call(conversation), kind_of(conversation)
    question = dataset.user_question(conversation)
    arguments = call["arguments"]
    if kind in (
        "calculadora",
        "fecha_hora",
    ):  # what the grounded grammar allows: said in any form, or a constant
        messages = conversation["messages"]
        before = messages[: next(i for i, m in enumerate(messages) if "tool_calls" in m)]
        found = grounding.candidates(before, tools.load_settings())
        if kind == "calculadora":
            numbers = re.findall(r"\d+(?:[.,]\d+)?", arguments["expresion"])
            return all(grounding.number_text(grounding.digit_values(n)[0]) in found.numbers for n in numbers)
        in_days = abs(arguments.get("dias", 0)) in {0, *found.days}
        return in_days and ("zona" not in arguments or arguments["zona"] in found.zones)
    if kind == "recordar":
        return tool_use.plain(arguments["texto"][1:]) in tool_use.plain(question)
    if kind == "olvidar":
        number = str(arguments["id"])
        return number in question or f"[{number}]" in conversation["messages"][0]["content"]
    return True


def test_a_calls_values_come_from_the_question_or_the_listed_memories(generated):
    train, held_out = generated
    calls = [c for c in train + held_out if kind_of(c) != "sin_herramienta"]
    assert all(copyable(c) for c in calls), [dataset.user_question(c) for c in calls if not copyable(c)][:5]


def test_a_search_is_the_questions_own_words_as_typed(generated):
    train, held_out = generated
    searches = [
        c for c in train + held_out if kind_of(c) in ("buscar_web", "sin_resultados", "error_busqueda")
    ]
    assert len(searches) > 50
    for conversation in searches:
        query, question = (
            the_call(conversation)["arguments"]["consulta"],
            dataset.user_question(conversation),
        )
        assert query and all(word in question for word in query.split()), (question, query)


def test_a_percentage_is_written_as_the_question_writes_it():
    # "el 15% de 2400" -> 2400*15%: the calculator reads %, so no constant the question lacks is needed
    settings = tools.load_settings()
    assert tools.calculate("2400*15%", settings["calculator"]) == 360
    assert tools.calculate("64-64*30%", settings["calculator"]) == pytest.approx(44.8)
    assert not any("/100" in case["expression"] for case in phrases.CALCULATIONS)


def far_value(conversation):
    """A value of the call that the question holds: a number, a memory's words, a search's first word."""
    arguments, kind = the_call(conversation)["arguments"], kind_of(conversation)
    if kind == "calculadora":
        return re.findall(r"\d+(?:[.,]\d+)?", arguments["expresion"])[0]
    if kind == "fecha_hora":
        return str(abs(arguments["dias"])) if "dias" in arguments else None
    if kind == "olvidar":
        return str(arguments["id"])
    if kind == "recordar":
        return arguments["texto"][1:]
    words = list(arguments.values())[0].split()
    return words[0] if kind in ("buscar_web", "sin_resultados", "error_busqueda") else words[-1]


def test_every_tool_is_taught_a_case_whose_value_sits_far_from_the_request(generated):
    train, _ = generated
    far = collections.Counter()
    for conversation in (c for c in train if kind_of(c) != "sin_herramienta"):
        value, question = far_value(conversation), dataset.user_question(conversation)
        if value and value in question:  # then at least 6 words before the request ends the question
            far[the_call(conversation)["name"]] += len(question.split(value, 1)[1].split()) >= 6
    assert set(far) == set(tools.TOOLS) and min(far.values()) >= 3, far


def test_the_copy_share_counts_numbers_and_words_of_the_prompt_in_the_tools_form():
    assert dataset.copied("3*2.35", "Si compro 3 kilos a 2,35 €")
    assert dataset.copied(-12, "¿Qué día fue hace 12 días?")
    assert dataset.copied("Cumpleanos de Lucia", "recuerda el cumpleaños de Lucía")
    assert not dataset.copied("110*30/100", "¿Cuánto es el 10 % de 870?")
    assert not dataset.copied("America/Bogota", "¿Qué hora es en Bogotá?")


def test_arguments_are_drawn_wide_enough_that_few_repeat(generated):
    train, held_out = generated
    arguments = collections.Counter(dataset.call_arguments(c) for c in train) - collections.Counter(
        {None: 10**9}
    )
    per_kind = collections.defaultdict(set)
    for conversation in train:
        if kind_of(conversation) in ("calculadora", "recordar", "olvidar", "buscar_web"):
            per_kind[kind_of(conversation)].add(dataset.call_arguments(conversation))
    counts = collections.Counter(kind_of(c) for c in train)
    for kind, distinct in per_kind.items():  # nearly every calculation, memory and search is new
        assert len(distinct) > 0.8 * counts[kind], kind
    (most, times), *_ = arguments.most_common(1)
    assert most == "{}" and times < 0.1 * sum(arguments.values())  # "what day is it?" repeats, rightly
    calls, unseen = dataset.unseen_share(train, held_out)
    assert calls > 80 and unseen > 0.5
    questions = [dataset.user_question(c) for c in train]
    assert len(set(questions)) > 0.9 * len(questions)


def test_generate_writes_both_files_and_reports_the_unseen_share(tmp_path, capsys):
    settings_file = tmp_path / "agent" / "tiny.yaml"
    settings_file.parent.mkdir()
    (tmp_path / "agent" / "default.yaml").write_text(open(tools.DEFAULT_SETTINGS, encoding="utf-8").read())
    settings_file.write_text("include: agent/default.yaml\nagent:\n  synthetic:\n    conversations: 60\n")
    assert dataset.main(["generate", str(tmp_path / "out"), "--settings", str(settings_file)]) == 0
    train = dataset.read_jsonl(tmp_path / "out" / "train.jsonl")
    held_out = dataset.read_jsonl(tmp_path / "out" / "eval.jsonl")
    assert 0 < len(held_out) < len(train) and len(train) + len(held_out) <= 60
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["eval.jsonl", "train.jsonl"]
    out = capsys.readouterr().out
    assert "held-out calls appear in no training call" in out and "are spans of their prompt (" in out


# --- the hand-written set ------------------------------------------------------------------------------


def handwritten():
    return dataset.read_jsonl(tool_use.HANDWRITTEN)


def test_the_handwritten_set_has_every_tool_and_no_tool_in_equal_shares():
    entries = handwritten()
    shares = collections.Counter(entry["tool"] for entry in entries)
    assert len(entries) >= 80 and set(shares) == {*tools.TOOLS, None}
    assert len(set(shares.values())) == 1
    assert (
        len({entry["id"] for entry in entries}) == len({entry["prompt"] for entry in entries}) == len(entries)
    )


def test_every_handwritten_reference_call_is_valid_and_holds_its_key_values():
    settings = tools.load_settings()
    for entry in handwritten():
        if entry["tool"] is None:
            assert set(entry) <= {"id", "prompt", "tool", "before"}
            continue
        assert tools.argument_problem(tools.TOOLS[entry["tool"]], entry["call"], settings) is None, entry[
            "id"
        ]
        assert tool_use.key_values_hold(entry["call"], entry["keys"]), entry["id"]
        told = " ".join(
            [entry["prompt"], *(m["content"] for m in entry.get("before", []) if m["role"] == "user")]
        )
        said = {grounding.number_text(value) for value in grounding.spoken_numbers(told)}
        for wanted in entry[
            "keys"
        ].values():  # a key value is said: in the question or an earlier turn, or in words
            if isinstance(wanted, list):
                for word in wanted:
                    number = word.replace(",", ".")
                    in_words = (
                        number.replace(".", "", 1).isdigit()
                        and grounding.number_text(Decimal(number)) in said
                    )
                    assert tool_use.plain(word) in tool_use.plain(told) or in_words, (entry["id"], word)


def test_no_handwritten_prompt_is_in_the_training_data(shipped_training_data):
    trained = {tool_use.plain(dataset.user_question(c)).strip(" ?¿!¡.") for c in shipped_training_data}
    for entry in handwritten():
        assert tool_use.plain(entry["prompt"]).strip(" ?¿!¡.") not in trained, entry["id"]


def test_handwritten_prompts_whose_values_are_said_only_in_words_or_in_an_earlier_turn():
    entries = handwritten()
    earlier = [entry for entry in entries if entry.get("before")]
    in_words = [entry for entry in entries if entry["tool"] in ("calculadora", "fecha_hora")
                and not re.search(r"\d", entry["prompt"]) and not entry.get("before")]  # fmt: skip
    assert len(earlier) + len(in_words) >= 20
    for entry in earlier:
        assert [m["role"] for m in entry["before"]][::2] == ["user"] * len(entry["before"][::2]), entry["id"]
