"""conversations/: the seed set written for this project (one file per topic) and its held-out set."""

import glob
import json
import os
import re

import pytest

from chat import template

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED_DIR = os.path.join(ROOT, "conversations", "seed")
HELDOUT = os.path.join(ROOT, "conversations", "heldout.jsonl")
TOPICS = (
    "organizacion",
    "cocina",
    "deberes",
    "abuelos",
    "salud",
    "legal",
    "cuentos",
    "escritura",
    "tecnologia",
    "enlace",
)
MIN_TRAIN, MIN_HELDOUT = 300, 50
MAX_WORDS = 700  # keeps a conversation inside a 1024-token context
MAX_USER_TURNS = 4  # the issue asks for conversations of 1 to 4 turns
# A simple lexical test of register: usted-style (usted, le/se + verb forms of usted) against tú-style.
USTED = re.compile(r"\b(usted|ustedes|dígame|cuénteme|consulte|pregunte)\b", re.IGNORECASE)
TU = re.compile(r"\b(tú|tienes|puedes|quieres|dime|cuéntame|consulta con tu|pregúntale)\b", re.IGNORECASE)
# Words only one side of the Atlantic uses for the same thing (or its emergency number): both must appear.
SPAIN = re.compile(r"\b(ordenador|móvil|zumo|coche|nevera|vosotros|112)\b", re.IGNORECASE)
AMERICA = re.compile(
    r"\b(computadora|celular|jugo|carro|heladera|jitomate|frijoles|arepas?|911)\b", re.IGNORECASE
)


def train_files():
    return sorted(glob.glob(os.path.join(SEED_DIR, "*.jsonl")))


def problems_in(path):
    """(conversations, ["file:line: reason", ...]) for one JSONL file of conversations."""
    name = os.path.relpath(path, ROOT)
    conversations, problems = [], []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as e:
        return [], [f"{name}: not UTF-8 ({e})"]
    if lines and lines[-1] == "":
        lines.pop()
    for number, line in enumerate(lines, 1):
        where = f"{name}:{number}"
        try:
            conversation = json.loads(line)
        except ValueError as e:
            problems.append(f"{where}: not JSON ({e})")
            continue
        found = (
            template.training_problems(conversation) if isinstance(conversation, dict) else ["not an object"]
        )
        if not found:
            roles = [m["role"] for m in conversation["messages"] if m["role"] != "system"]
            if not roles or roles[0] != "user" or roles[-1] != "assistant":
                found.append(f"must start with a user turn and end with an assistant turn, got {roles}")
            elif any(a == b for a, b in zip(roles, roles[1:], strict=False)):
                found.append(f"user and assistant turns must alternate, got {roles}")
            elif not 1 <= roles.count("user") <= MAX_USER_TURNS:
                found.append(f"{roles.count('user')} user turns, want 1 to {MAX_USER_TURNS}")
            if conversation.get("source") != "enlace-seed":
                found.append(f"source must be 'enlace-seed', got {conversation.get('source')!r}")
            words = sum(len(m["content"].split()) for m in conversation["messages"])
            if words > MAX_WORDS:
                found.append(f"{words} words, more than {MAX_WORDS}")
        problems += [f"{where}: {reason}" for reason in found]
        if not found:
            conversations.append(conversation)
    return conversations, problems


def first_user_message(conversation):
    return next(m["content"] for m in conversation["messages"] if m["role"] == "user")


@pytest.fixture(scope="module")
def train():
    return [c for path in train_files() for c in problems_in(path)[0]]


@pytest.fixture(scope="module")
def heldout():
    return problems_in(HELDOUT)[0]


def test_every_topic_has_its_file():
    present = {os.path.splitext(os.path.basename(p))[0] for p in train_files()}
    assert set(TOPICS) <= present, f"missing topic files: {sorted(set(TOPICS) - present)}"


@pytest.mark.parametrize("path", [*train_files(), HELDOUT], ids=os.path.basename)
def test_every_line_is_a_valid_conversation_that_ends_with_the_assistant(path):
    _, problems = problems_in(path)
    assert not problems, "\n".join(problems)


def test_the_checker_names_file_and_line_of_a_bad_conversation(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "Hola"}, {"role": "assistant", "content": "¡Hola!"}]}
    rows = [
        {**good, "source": "enlace-seed"},
        {"messages": [{"role": "user", "content": "Hola"}], "source": "enlace-seed"},
        {"messages": [{"role": "robot", "content": "Hola"}], "source": "enlace-seed"},
        good,
    ]
    path.write_text(
        "\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n{oops\n", encoding="utf-8"
    )
    conversations, problems = problems_in(str(path))
    assert len(conversations) == 1
    assert [p.split(": ")[0].rsplit(":", 1)[1] for p in problems] == ["2", "3", "4", "5"]
    assert "end with an assistant turn" in problems[0] and "robot" in problems[1]
    assert "source" in problems[2] and "not JSON" in problems[3]

    five_turns = [{"role": r, "content": "Hola"} for _ in range(5) for r in ("user", "assistant")]
    path.write_text(json.dumps({"messages": five_turns, "source": "enlace-seed"}) + "\n", encoding="utf-8")
    (problem,) = problems_in(str(path))[1]
    assert problem.endswith("bad.jsonl:1: 5 user turns, want 1 to 4")


def test_there_are_enough_training_and_held_out_conversations(train, heldout):
    assert len(train) >= MIN_TRAIN, f"{len(train)} training conversations, want at least {MIN_TRAIN}"
    assert len(heldout) >= MIN_HELDOUT, f"{len(heldout)} held-out conversations, want at least {MIN_HELDOUT}"


def test_no_held_out_prompt_appears_in_the_training_files(train, heldout):
    trained = {first_user_message(c).strip().lower() for c in train}
    leaked = [first_user_message(c) for c in heldout if first_user_message(c).strip().lower() in trained]
    assert not leaked, f"held-out prompts also in training: {leaked}"


def test_both_tu_and_usted_registers_are_present(train, heldout):
    def text(c):
        return " ".join(m["content"] for m in c["messages"])

    for name, conversations in (("training", train), ("held-out", heldout)):
        usted = sum(bool(USTED.search(text(c))) for c in conversations)
        tu = sum(bool(TU.search(text(c))) for c in conversations)
        assert usted >= 5 and tu >= 5, f"{name}: {usted} usted-style and {tu} tú-style conversations"


def test_spain_and_latin_american_spanish_are_both_present(train):
    def text(c):
        return " ".join(m["content"] for m in c["messages"])

    spain = sum(bool(SPAIN.search(text(c))) for c in train)
    america = sum(bool(AMERICA.search(text(c))) for c in train)
    assert spain >= 10 and america >= 10, (
        f"{spain} Spain-style and {america} Latin-American-style conversations"
    )


# Health and legal answers are given with care and send the person on: to a doctor, pharmacist or the
# emergency number; to a lawyer, notary, consumer office or the official source.
REFERRALS = {
    "salud": re.compile(
        r"médic|pediatra|farmac|enfermer|urgencias|\b(112|911|061|024)\b|centro de salud|especialista"
        r"|profesional|dentista|fisioterapeuta|psicólog|toxicol",
        re.IGNORECASE,
    ),
    "legal": re.compile(
        r"abogad|notari|oficina|consumo|ayuntamiento|sede electrónica|asesor|gestor|profesional|sindicato"
        r"|registro|juzgado|SEPE|Seguridad Social|Agencia Tributaria|policía|comisaría|inspección|oficial",
        re.IGNORECASE,
    ),
}


@pytest.mark.parametrize("topic", sorted(REFERRALS))
def test_every_health_and_legal_conversation_refers_to_a_professional(topic):
    conversations, _ = problems_in(os.path.join(SEED_DIR, f"{topic}.jsonl"))
    without = [
        first_user_message(c)
        for c in conversations
        if not REFERRALS[topic].search(
            " ".join(m["content"] for m in c["messages"] if m["role"] == "assistant")
        )
    ]
    assert conversations and not without, f"{topic}: no referral in the answers to {without}"
