"""Preference pairs (TRL's conversational preference format): the checks, how a pair renders with the one
template, packing for DPO and the pair loader, importing public sets, the pairs made from conversations
for the smoke run, and family/feedback.py's rules for turning ratings into pairs."""

import json
import os
import subprocess
import sys

import pytest
from conftest import CHAT_SEQ_LEN, ROOT, TINY, example_conversations, write_jsonl

import config
import data
from chat import convert, prepare, template
from family import feedback

quiet = lambda *a, **k: None  # noqa: E731

SYSTEM = {"role": "system", "content": "Eres ENLACE."}
PAIR = {
    "prompt": [
        SYSTEM,
        {"role": "user", "content": "Hola"},
        {"role": "assistant", "content": "¡Hola! ¿En qué te ayudo?"},
        {"role": "user", "content": "¿Cuánto es 2 más 2?"},
    ],
    "chosen": [{"role": "assistant", "content": "2 más 2 son 4."}],
    "rejected": [{"role": "assistant", "content": "Son 5."}],
}


@pytest.fixture(scope="module")
def tokenizer(shard_data_dir):
    return data.SentencePieceTokenizer(os.path.join(shard_data_dir, "tokenizer.model"))


def test_a_pair_renders_each_answer_after_its_prompt_and_trains_on_that_answer_only(tokenizer):
    (chosen_ids, chosen_mask), (rejected_ids, rejected_mask) = template.render_pair(PAIR, tokenizer)
    prompt_ids, _ = template.render({"messages": PAIR["prompt"]}, tokenizer, for_generation=True)
    for ids, mask, side in ((chosen_ids, chosen_mask, "chosen"), (rejected_ids, rejected_mask, "rejected")):
        full_ids, full_mask = template.render({"messages": PAIR["prompt"] + PAIR[side]}, tokenizer)
        assert ids == full_ids  # the one template, unchanged
        assert mask[: len(prompt_ids)] == [0] * len(prompt_ids)  # the prompt's own answer is context here
        assert 1 in full_mask[: len(prompt_ids)]  # (which SFT would have trained on)
        assert (
            mask[len(prompt_ids) :] == full_mask[len(prompt_ids) :] and mask[-1] == 1
        )  # the answer and <|end|>
        answer = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
        assert answer.startswith(PAIR[side][0]["content"])


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"prompt": PAIR["prompt"][:3]}, "prompt: must end with a user (or tool) message"),
        (
            {"chosen": [{"role": "user", "content": "x"}]},
            "chosen: must start and end with an assistant message",
        ),
        ({"rejected": []}, "rejected: [] should be non-empty"),
        (
            {"chosen": [{"role": "assistant", "content": 4}]},
            "chosen: messages.4.content: 4 is not of type 'string'",
        ),
        ({"rejected": None}, "rejected: None is not of type 'array'"),
        ({"extra": 1}, "Additional properties are not allowed"),
        ({"chosen": [{"role": "assistant", "content": " "}]}, "chosen.0: empty assistant content"),
    ],
)
def test_a_pair_that_is_not_valid_is_refused_with_the_reason(change, reason):
    problems = template.preference_problems({**PAIR, **change})
    assert any(reason in problem for problem in problems), problems
    assert template.preference_problems(PAIR) == []


def test_a_pair_may_reject_an_empty_answer_and_follow_one_in_its_prompt():
    """The model may end an answer at once: that answer is worth pushing away from, and a conversation
    rated later may hold it."""
    empty = {"role": "assistant", "content": ""}
    pair = {**PAIR, "prompt": [*PAIR["prompt"][:2], empty, PAIR["prompt"][3]], "rejected": [empty]}
    assert template.preference_problems(pair) == []


def pair_config(folder, shard_dir, *overrides):
    args = [
        *TINY,
        f"data.dir={folder}/packed",
        f"data.chat.tokenizer={shard_dir}/tokenizer.model",
        f"data.chat.train=[{folder}/train.jsonl]",
        f"data.chat.val=[{folder}/val.jsonl]",
        "data.chat.rows_per_shard=3",  # odd: a pair may straddle two shards
        "model.vocab_size=512",
        f"model.seq_len={CHAT_SEQ_LEN}",
        *overrides,
    ]
    return config.load(os.path.join(ROOT, "configs", "dpo-smoke-cpu.yaml"), args)


def long_prompt(turns):
    prompt = [SYSTEM]
    for n in range(turns):
        prompt += [{"role": "user", "content": f"Pregunta número {n} sobre el huerto"},
                   {"role": "assistant", "content": f"Respuesta número {n} sobre tomates y lechugas"}]  # fmt: skip
    return prompt + [{"role": "user", "content": "¿Y ahora qué planto?"}]


def test_prepare_lays_each_pair_out_as_two_rows_and_shortens_or_drops_what_does_not_fit(
    tmp_path, shard_data_dir, tokenizer
):
    long_answer = {"role": "assistant", "content": "tomate " * 200}
    pairs = [
        PAIR,
        {**PAIR, "prompt": long_prompt(6)},  # too long: its oldest turns go, the system message stays
        {**PAIR, "rejected": [long_answer]},  # too long whatever the prompt: dropped
        {**PAIR, "chosen": [{"role": "assistant", "content": "Cuatro."}]},
    ]
    write_jsonl(tmp_path / "train.jsonl", pairs)
    write_jsonl(tmp_path / "val.jsonl", [PAIR])
    logs = []
    cfg = pair_config(tmp_path, shard_data_dir)
    prepare.prepare(cfg, log=logs.append)
    record = data.read_manifest(cfg["data"])["prepare"]["train"]
    assert record["stats"] | {"fill": 0} == record["stats"] | {
        "pairs": 4, "packed": 3, "rows": 6, "dropped_too_long": 1, "truncated": 1, "fill": 0}  # fmt: skip
    assert any("dropping" in line and "train.jsonl:3" in line for line in logs)
    assert [s["rows"] for s in record["shards"]] == [3, 3]

    loader = data.build_loader(cfg["data"], "train", 2, CHAT_SEQ_LEN, 0)
    assert loader.pairs == 3
    x, y = loader.pair_rows([0, 1, 2])
    row_len = CHAT_SEQ_LEN + 1
    for pair_index, pair in enumerate([PAIR, None, pairs[3]]):
        for side_index in (0, 1):  # chosen, rejected
            row = x[pair_index + 3 * side_index].tolist() + [None]
            if pair is None:  # the shortened one: system, then its last user turn, then the answer
                pair = {**PAIR, "prompt": [SYSTEM, long_prompt(6)[-1]]}
            ids, mask = template.render_pair(pair, tokenizer)[side_index]
            assert row[: len(ids) - 1] == ids[:-1] and len(ids) <= row_len
            assert set(row[len(ids) : -1]) <= {tokenizer.eos_id}  # padding
            targets = y[pair_index + 3 * side_index].tolist()
            assert targets[: len(ids) - 1] == [t if m else -1 for t, m in zip(ids[1:], mask[1:], strict=True)]
            assert set(targets[len(ids) - 1 :]) <= {-1}


def test_the_pair_loader_gives_chosen_rows_then_rejected_restores_its_position_and_splits_pairs_by_rank(
    tmp_path, shard_data_dir
):
    conversations = [(f"c:{i}", c) for i, c in enumerate(example_conversations(20))]
    write_jsonl(tmp_path / "train.jsonl", convert.seed_pairs(conversations, seed=0))
    write_jsonl(tmp_path / "val.jsonl", [PAIR])
    cfg = pair_config(tmp_path, shard_data_dir)
    prepare.prepare(cfg, log=quiet)

    def loader(batch=3, rank=0, world=1):
        return data.build_loader(cfg["data"], "train", batch, CHAT_SEQ_LEN, 5, rank, world)

    first = loader()
    x, y, pairs = first.next_batch()
    assert x.shape == (6, CHAT_SEQ_LEN) and pairs.shape == (3,)
    again_x, again_y = first.pair_rows(pairs.tolist())
    assert (again_x == x).all() and (again_y == y).all()
    for i, pair in enumerate(pairs.tolist()):  # chosen rows first, then the rejected ones in the same order
        assert (x[i].numpy() == first.row(2 * pair)[0][:-1]).all()
        assert (x[3 + i].numpy() == first.row(2 * pair + 1)[0][:-1]).all()
    for _ in range(4):
        first.next_batch()
    state = first.state_dict()
    expected = [first.next_batch()[2].tolist() for _ in range(10)]
    resumed = loader()
    resumed.load_state_dict(state)
    assert [resumed.next_batch()[2].tolist() for _ in range(10)] == expected
    with pytest.raises(data.DataError, match="format: state has 'chat', this loader has 'preference'"):
        resumed.load_state_dict(state | {"format": "chat"})

    # An epoch visits every pair once; two ranks share them out.
    whole = loader(batch=1)
    seen = [int(whole.next_batch()[2]) for _ in range(whole.pairs)]
    assert sorted(seen) == list(range(whole.pairs))
    halves = [loader(batch=1, rank=r, world=2) for r in (0, 1)]
    split = [int(h.next_batch()[2]) for h in halves for _ in range(h.pairs_per_rank)]
    assert len(set(split)) == len(split) == 2 * (whole.pairs // 2)
    assert halves[0].rank_pairs() == list(range(0, whole.pairs, 2))  # evaluation: each pair once, on one rank
    assert halves[1].rank_pairs() == list(range(1, whole.pairs, 2))


def run_chat(*args):
    return subprocess.run(
        [sys.executable, "-m", "chat", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_import_from_preference_reads_trls_explicit_standard_and_implicit_formats(tmp_path):
    user = {"role": "user", "content": "¿Capital de Francia?"}
    good, bad = {"role": "assistant", "content": "París."}, {"role": "assistant", "content": "Roma."}
    records = [
        {"prompt": [user], "chosen": [good], "rejected": [bad]},  # explicit conversational
        {"prompt": "¿Capital de Francia?", "chosen": "París.", "rejected": "Roma."},  # standard
        {"chosen": [user, good], "rejected": [user, bad]},  # implicit prompt
        {
            "prompt": "¿Capital de Francia?",
            "chosen": [user, good],
            "rejected": [user, bad],
            "score": 9,
        },  # UltraFeedback
        {"prompt": [user], "chosen": [user, good], "rejected": [user, bad]},  # answers repeating the prompt
        {"chosen": [good], "rejected": [bad]},  # nothing shared: no prompt
        {"prompt": 3, "chosen": "París.", "rejected": "Roma."},
    ]
    source = write_jsonl(tmp_path / "prefs.jsonl", records)
    refused = run_chat("import", "--from", "preference", source, str(tmp_path / "out.jsonl"))
    assert refused.returncode == 2 and "prefs.jsonl:6: no 'prompt'" in refused.stderr
    assert not (tmp_path / "out.jsonl").exists()
    done = run_chat("import", "--from", "preference", source, str(tmp_path / "out.jsonl"), "--skip-bad")
    assert done.returncode == 0, done.stderr
    assert "import: 5 preference pairs" in done.stdout and "2 skipped" in done.stdout
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    for pair in out:
        assert (pair["prompt"], pair["chosen"], pair["rejected"]) == ([user], [good], [bad])
        assert pair["source"] == "preference:prefs.jsonl" and template.preference_problems(pair) == []


def test_seed_pairs_reject_a_truncated_answer_another_conversations_and_one_without_its_referral():
    health = {"messages": [{"role": "user", "content": "Me duele la cabeza desde ayer."},
                           {"role": "assistant", "content": "Descansa y bebe agua. Evita las pantallas un rato.\n\n"
                            "Si el dolor es muy fuerte o no se pasa, consulta con tu médico."}]}  # fmt: skip
    cooking = {"messages": [{"role": "user", "content": "¿Cómo cuezo un huevo?"},
                            {"role": "assistant", "content": "Ponlo en agua hirviendo. Déjalo diez minutos. "
                             "Después enfríalo en agua fría."}]}  # fmt: skip
    pairs = convert.seed_pairs([("salud:1", health), ("cocina:1", cooking)], seed=0)
    by_kind = {(p["source"].split(":")[1], p["source"].split(":")[2]): p for p in pairs}
    assert set(by_kind) == {("truncated", "salud"), ("other-answer", "salud"), ("referral-removed", "salud"),
                            ("truncated", "cocina"), ("other-answer", "cocina")}  # fmt: skip
    assert all(
        p["chosen"] == p["prompt"][:0] + [health["messages"][1]]
        for k, p in by_kind.items()
        if k[1] == "salud"
    )
    assert (
        by_kind["referral-removed", "salud"]["rejected"][0]["content"]
        == "Descansa y bebe agua. Evita las pantallas un rato."
    )
    assert (
        by_kind["truncated", "cocina"]["rejected"][0]["content"]
        == "Ponlo en agua hirviendo. Déjalo diez minutos."
    )
    assert by_kind["other-answer", "cocina"]["rejected"][0]["content"] == health["messages"][1]["content"]
    assert all(template.preference_problems(p) == [] for p in pairs)


def test_seed_pairs_from_the_command_line_count_each_kind(tmp_path):
    done = run_chat(
        "seed-pairs", str(tmp_path / "pairs.jsonl"), "conversations/seed/salud.jsonl", "--seed", "3"
    )
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "pairs.jsonl").read_text(encoding="utf-8").splitlines()
    assert f"seed-pairs: {len(lines)} pairs from 34 conversations" in done.stdout
    assert (
        "34 truncated" in done.stdout
        and "34 other-answer" in done.stdout
        and "referral-removed" in done.stdout
    )


def record(member_id, prompt, answer, rating, better=None):
    return {"member_id": member_id, "prompt": [{"role": "user", "content": prompt}], "answer": answer,
            "rating": rating, "better": better}  # fmt: skip


def test_feedback_makes_pairs_of_improved_answers_and_of_a_dislike_with_a_like_never_of_a_lone_dislike():
    records = [
        record(1, "¿Qué cenamos?", "Nada.", -1, "Una tortilla."),  # improved
        record(1, "¿2 más 2?", "4", 1),
        record(1, "¿2 más 2?", "5", -1),  # with ana's 👍 to the same prompt: a pair
        record(2, "¿2 más 2?", "22", -1),  # beto's: not paired with ana's 👍
        record(1, "¿Un chiste?", "No.", -1),  # lone
        record(1, "¿Un cuento?", "Había una vez…", 1, "Érase una vez…"),  # liked, but improved anyway
        record(1, "¿Y hoy?", "", -1, "Hoy es martes."),  # an empty answer (the model ended at once), improved
        record(1, "¿Una pista?", "", 1),  # an empty 👍 answer is nothing to push towards:
        record(1, "¿Una pista?", "Ninguna.", -1),  # so this 👎 stays lone
    ]
    pairs, counts = feedback.preference_pairs(records)
    assert [
        (p["prompt"][0]["content"], p["chosen"][0]["content"], p["rejected"][0]["content"]) for p in pairs
    ] == [
        ("¿Qué cenamos?", "Una tortilla.", "Nada."),
        ("¿2 más 2?", "4", "5"),
        ("¿Un cuento?", "Érase una vez…", "Había una vez…"),
        ("¿Y hoy?", "Hoy es martes.", ""),
    ]
    assert counts == {"improved": 3, "rated_pairs": 1, "lone_dislikes": 3, "likes": 3}
    assert all(template.preference_problems(p) == [] for p in pairs)
    assert not any("member" in json.dumps(p) for p in pairs)  # nothing says whose it was
