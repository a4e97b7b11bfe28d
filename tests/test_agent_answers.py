"""agent/answers.py: after a tool result, the answer states only numbers the conversation or the tool
results hold, enforced while decoding through the real constraint (agent/grammar.py) and the real engine."""

import pytest
import torch
from test_agent_grammar import NoisyModel, noisy_forward_passes

import data
from agent import answers, expression, grammar, tools
from decode import engine
from evaluation import tool_use


@pytest.fixture(scope="module")
def tokenizer(shard_data_dir):
    return data.SentencePieceTokenizer(f"{shard_data_dir}/tokenizer.model")


@pytest.fixture
def settings():
    return tools.load_settings()


def after_result(question, result, call="calculadora"):
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": call, "arguments": {"expresion": "1234*56"}}}]},
        {"role": "tool", "content": result, "name": call},
    ]  # fmt: skip


def writes(tokenizer, settings, messages, text):
    """Whether the constraint of the answer to `messages` lets `text` be written and the answer end."""
    constraint = grammar.constraint_for(tokenizer, None, settings, None, messages)
    for token in [*tokenizer.encode(text), tokenizer.special_ids["<|end|>"]]:
        if constraint.mask(torch.zeros(tokenizer.vocab_size))[token] == float("-inf"):
            return False
        constraint.accept(token)
    return True


@pytest.mark.parametrize(
    ("text", "allowed"),
    [("Son 69104.", True), ("Son 69.104 en total.", True), ("1234 por 56 son 69104.", True),
     ("Son 15544.", False), ("Son 6910.", False), ("Son 691040.", False), ("Son 69104,5.", False),
     ("Lo he calculado: 2 veces.", True), ("Son 69104 y 7.", False)],
)  # fmt: skip
def test_after_a_result_the_answer_states_only_numbers_said_or_computed(tokenizer, settings, text, allowed):
    messages = after_result("¿Cuánto es 1234 por 56?", "69104")
    assert writes(tokenizer, settings, messages, text) is allowed


def test_an_answer_in_cents_and_the_dates_of_the_conversation_are_told(tokenizer, settings):
    messages = after_result("Somos 7 para pagar una cena de 186 euros, ¿cuánto pone cada uno?", "26,57")
    assert writes(tokenizer, settings, messages, "Cada uno pone 26,57 euros de los 186.")
    assert not writes(tokenizer, settings, messages, "Cada uno pone 31,50 euros.")
    messages = [{"role": "system", "content": "Hoy es sábado, 5 de diciembre de 2026."}, *messages]
    assert writes(tokenizer, settings, messages, "Hoy, 5 de diciembre de 2026, son 26,57 por persona.")


def test_a_failed_tool_lets_the_answer_state_no_computed_number(tokenizer, settings):
    messages = after_result(
        "¿Cuánto es 77 entre 0?", "Error: no se puede dividir entre cero. Corrige la llamada."
    )
    assert writes(tokenizer, settings, messages, "No se puede dividir 77 entre 0.")
    assert writes(tokenizer, settings, messages, "Son 77 euros.")  # 77 was said
    assert not writes(tokenizer, settings, messages, "Son 38.")


def test_off_and_a_turn_without_a_tool_result_leave_the_answer_free(tokenizer, settings):
    messages = after_result("¿Cuánto es 1234 por 56?", "69104")
    off = {**settings, "answers": {**settings["answers"], "grounding": "off"}}
    assert writes(tokenizer, off, messages, "Son 15544.")
    assert writes(tokenizer, settings, messages[:1], "Son 15544.")


def test_a_result_with_thousands_of_numbers_keeps_its_own_first_within_the_bound(tokenizer, settings):
    flood = " ".join(str(1000 + n) for n in range(5000))
    messages = after_result("Dame los números", flood)
    small = {**settings, "answers": {**settings["answers"], "max_candidates": 100}}
    assert writes(tokenizer, small, messages, "El primero es 1000 y luego 1099.")
    assert not writes(tokenizer, small, messages, "Y el 1100.")


class Vocab:
    """A vocabulary of whole Spanish words, as a larger tokenizer has them."""

    def __init__(self, pieces):
        self.bytes = [piece.encode() for piece in pieces]
        self.size = len(pieces)


def test_number_words_not_told_are_masked_but_articles_stay():
    vocab = Vocab([" Son", " quince", " doce", " una", " mil", " personas", "."])
    guard = answers.AnswerGuard(vocab, answers.told_numbers(
        after_result("¿Cuánto es doce por mil?", "12000"), tools.load_settings()))  # fmt: skip
    allowed = torch.isfinite(guard.mask(torch.zeros(vocab.size)))
    assert allowed.tolist() == [True, False, True, True, True, True, True]


@pytest.mark.parametrize(
    ("text", "allowed"),
    [("La media es 6.", True), ("Sale a medias: 6 cada uno.", True), ("La media es 7.", False)],
)
def test_the_guard_and_the_evaluation_agree_on_the_numbers_an_answer_states(
    tokenizer, settings, text, allowed
):
    # one rule (grounding.spoken_numbers): "media" alone is the average, not 0.5, for the mask and the count
    messages = after_result("¿Cuál es el promedio de 4 y 8?", "6")
    assert writes(tokenizer, settings, messages, text) is allowed
    assert (tool_use.unsaid_numbers(text, messages, settings) == []) is allowed


def test_noise_after_a_result_writes_no_number_nobody_said(tokenizer, settings):
    # uniform noise through the real engine at temperature 1: the digits it writes are only those told
    model, end = NoisyModel(tokenizer, ends=False).eval(), tokenizer.special_ids["<|end|>"]
    messages = after_result("¿Cuánto es 1234 por 56?", "69104")
    generator = torch.Generator().manual_seed(5)
    told = {"1234", "56", "69104", "69.104", "0", "1", "2"}
    for _ in range(3):
        constraint = grammar.constraint_for(tokenizer, None, settings, 200, messages)
        out = []
        with noisy_forward_passes(model):
            for token in engine.generate(model, torch.tensor([1]), 200, 1.0, stop_token=end, generator=generator,
                                         constraint=constraint):  # fmt: skip
                if token in (end, tokenizer.eos_id):
                    break
                out.append(token)
        text = tokenizer.decode(out).rstrip("0123456789.,")  # the budget may cut the last number
        written = set(expression.NUMBER.findall(text))
        assert {number.rstrip(".,") for number in written} <= told, text


@pytest.mark.parametrize(
    "run", ["", "6", "69", "691", "6910", "69104", "69104.", "69.", "69.1", "1234", "5", "56,"]
)
def test_the_masks_for_every_token_at_once_are_the_rule_token_by_token(tokenizer, settings, run):
    vocab = grammar.vocabulary(tokenizer)
    guard = answers.AnswerGuard(
        vocab, answers.told_numbers(after_result("¿Cuánto es 1234 por 56?", "69104"), settings)
    )
    guard.run = run
    kind, ids = guard.choice()
    texts = [raw.decode("utf-8", "replace") for raw in vocab.bytes]
    fits = {index for index, text in enumerate(texts) if text and guard.after(run, text) is not None}
    if run and not guard.whole(run):  # only the tokens that keep the number told
        assert kind == "only" and set(ids.tolist()) == fits
    else:
        writing = {
            index for index, text in enumerate(texts) if any(ch.isdigit() or ch in ".," for ch in text)
        }
        assert kind == "ban" and set(ids.tolist()) == (writing - fits) | set(guard.banned_words.tolist())
