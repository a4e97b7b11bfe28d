"""The SFT mixture (chat/sources.py, chat/mixture.py, chat/report.py) from a stand-in of the Hugging Face Hub
(tests/hub_standin.py) serving small OASST2- and Aya-shaped files written here: reading trees and rows, the
turn filters, dedup across sources, the held-out split, decontamination, the shares and epochs, the report,
and bad input as counts or one-line errors."""

import copy
import gzip
import io
import itertools
import json
import os

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, TINY, chat_overrides, data_layer
from hub_standin import COMMIT, FakeHub

import config
import data
from chat import prepare, sources

OASST = "OpenAssistant/oasst2"
AYA = "CohereForAI/aya_dataset"
TREES = "2023-11-05_oasst2_ready.trees.jsonl.gz"
AYA_FILE = "data/train-00000-of-00001.parquet"
AGENT_PROMPT = "Somos siete para pagar una cena de ciento ochenta y seis euros"
ENGLISH = (
    "The weather in London has been unusually warm this autumn, and many people are spending their "
    "afternoons in the parks before the rain comes back next week."
)


def seed(name):
    with open(os.path.join(ROOT, "conversations", "seed", f"{name}.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


def pairs(name):
    """(user, assistant) of the first exchange of each seed conversation of a topic."""
    return [(m[0]["content"], m[1]["content"]) for m in seed(name) if m[0]["role"] == "user"]


MESSAGE_IDS = itertools.count()


def message(role, text, rank=None, replies=(), lang="es", **extra):
    return {
        "message_id": f"m{next(MESSAGE_IDS)}", "parent_id": None, "role": role, "text": text, "lang": lang,
        "rank": rank, "deleted": False, "review_result": True, "replies": list(replies),
    } | extra  # fmt: skip


def tree(user, answers, lang="es", **root):
    """A message tree: the prompt and ranked answers (rank 0 best), each answer with a follow-up question."""
    replies = [message("assistant", text, rank=rank) for rank, text in enumerate(answers)]
    return {"message_tree_id": f"t{id(replies)}", "tree_state": "ready_for_export",
            "prompt": message("prompter", user, replies=replies, lang=lang) | root}  # fmt: skip


def oasst_file():
    cooking, homework = pairs("cocina"), pairs("deberes")
    lines = [tree(user, [answer, homework[i][1]]) for i, (user, answer) in enumerate(cooking[:12])]
    lines.append(tree(homework[0][0], [f"Escribe a <|end|>{homework[0][1]}"]))  # a forged control token
    lines.append(tree(homework[1][0], [ENGLISH]))  # an answer in another language
    lines.append(tree(ENGLISH, [ENGLISH], lang="en"))
    lines.append(tree(homework[2][0], ["   "]))  # an empty turn
    lines.append(tree(homework[3][0], [homework[3][1]]) | {"prompt": message("moderator", "hola")})
    lines.append(tree(AGENT_PROMPT, [homework[4][1]]))  # an evaluation prompt
    lines.append(tree(homework[5][0] + " Escríbeme a ana.garcia@ejemplo.es", [homework[5][1]]))
    lines.append(tree(*seed_first_exchange()))  # the family seed set has it already
    text = "\n".join(json.dumps(line, ensure_ascii=False) for line in lines) + "\n{not json\n"
    # a lone surrogate, written as JSON escapes it ("\\ud800"): no tokenizer encodes it
    text += json.dumps(tree(homework[6][0], ["Hola \ud800 mundo"])) + "\n"
    return gzip.compress(text.encode("utf-8"))


def seed_first_exchange():
    user, answer = pairs("abuelos")[0]
    return user, [answer]


def aya_file():
    rows = [
        {"inputs": user, "targets": answer, "language": "Spanish", "language_code": "spa",
         "annotation_type": "original-annotations", "user_id": f"u{i}"}
        for i, (user, answer) in enumerate(pairs("salud")[:10])
    ]  # fmt: skip
    rows.append(rows[0] | {"inputs": ENGLISH, "language": "English", "language_code": "eng"})
    rows.append(rows[1] | {"targets": None})
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue()


def tool_conversations():
    call = {"type": "function", "function": {"name": "calculadora", "arguments": {"expresion": "2+3"}}}
    return [
        {"messages": [
            {"role": "user", "content": f"¿Cuánto es 2 más 3? Pregunta número {i}."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "5"},
            {"role": "assistant", "content": "Son 5."},
        ]}
        for i in range(6)
    ]  # fmt: skip


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.fixture
def hub(monkeypatch):
    from huggingface_hub import constants

    fake = FakeHub()
    fake.add(OASST, {TREES: oasst_file(), "README.md": b"# oasst2\n"}, licence="apache-2.0")
    fake.add(AYA, {AYA_FILE: aya_file()}, licence="apache-2.0")
    fake.url = fake.start()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield fake
    fake.stop()


def mixture_config(tmp_path, shard_dir, **changes):
    """configs/sft-smoke-cpu.yaml made tiny, with a mixture of the four kinds of source."""
    folder = tmp_path / "mixture"
    cfg = config.load(
        os.path.join(ROOT, "configs", "sft-smoke-cpu.yaml"),
        [*TINY, *chat_overrides(str(folder), shard_dir), "model.seq_len=2048", "train.max_steps=2"],
    )
    evals = tmp_path / "eval"
    evals.mkdir(exist_ok=True)
    prompts = write_jsonl(evals / "handwritten.jsonl", [{"id": "calc", "prompt": AGENT_PROMPT, "tool": "x"}])
    heldout = os.path.join(ROOT, "conversations", "heldout.jsonl")
    hub_dir = tmp_path / "hub"
    mixture = {
        "dir": str(folder), "seed": 0, "conversations": None, "max_epochs": 4,
        "download": {"workers": 2},
        "sources": [
            {"name": "seed", "kind": "conversations", "licence": "written for ENLACE",
             "path": write_jsonl(tmp_path / "seed.jsonl", [{"messages": m} for m in seed("abuelos")[:8]]),
             "share": 0.2, "filters": False, "max_epochs": 8},
            {"name": "oasst2-es", "kind": "oasst_trees", "licence": "Apache-2.0, OpenAssistant/oasst2",
             "hub": {"repo": OASST, "revision": "main", "files": TREES, "local_dir": str(hub_dir / "oasst2")},
             "lang": "es", "branches": "best", "roles": {"prompter": "user", "assistant": "assistant"},
             "text_field": "text", "share": 0.4, "filters": True, "val_fraction": 0.2},
            {"name": "aya-es", "kind": "single_turn", "licence": "Apache-2.0, CohereForAI/aya_dataset",
             "hub": {"repo": AYA, "revision": "main", "files": "data/train-*.parquet",
                     "local_dir": str(hub_dir / "aya")},
             "fields": {"user": "inputs", "assistant": "targets"}, "select": {"language": "Spanish"},
             "share": 0.2, "filters": True},
            {"name": "tools", "kind": "conversations", "licence": "generated by agent/dataset.py",
             "path": write_jsonl(tmp_path / "tools.jsonl", tool_conversations()), "share": 0.2, "filters": False},
        ],
        "filters": {
            "language": {"languages": ["es"], "min_score": 0.5, "min_chars": 40, "max_chars": 1000},
            "turn_chars": {"min": 2, "max": 6000},
            "pii": {"enabled": True, "placeholders": {"email": "<EMAIL>", "phone": "<TELÉFONO>"}},
            "near_dedup": {"enabled": True, "ngram": 5, "buckets": 14, "hashes_per_bucket": 8, "seed": 1},
            "decontamination": {"ngram": 13, "min_words": 3, "val_max_overlap": 0.5,
                                "eval_files": [prompts, heldout], "eval_files_if_present": [str(evals / "lm-eval-*.jsonl")]},
        },
    }  # fmt: skip
    cfg["data"]["chat"]["mixture"] = mixture
    cfg["data"]["chat"]["val"] = [str(folder / "val.jsonl")]
    for key, value in changes.items():
        section, name = key.split("__")
        cfg[section][name] = value
    jsonschema.validate(cfg["data"], config.load_schema("data"))
    return cfg


def sources_of(cfg):
    return cfg["data"]["chat"]["mixture"]["sources"]


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def build(cfg):
    lines = []
    prepare.download(cfg, log=lines.append)
    prepare.prepare(cfg, log=lines.append)
    return lines


def test_the_mixture_is_built_from_the_hub_filtered_decontaminated_and_reported(
    hub, tmp_path, shard_data_dir
):
    cfg = mixture_config(tmp_path, shard_data_dir)
    log = build(cfg)
    folder = cfg["data"]["chat"]["mixture"]["dir"]
    train = read_jsonl(os.path.join(folder, "train.jsonl"))
    val = read_jsonl(os.path.join(folder, "val.jsonl"))
    texts = [m["content"] for c in train + val for m in c["messages"]]
    assert not any("<|end|>" in text for text in texts)  # a forged control token is never rendered
    assert ENGLISH not in texts
    assert not any(AGENT_PROMPT in text for text in texts)  # the evaluation prompt
    assert not any("ana.garcia@ejemplo.es" in text for text in texts)
    assert any("<EMAIL>" in text for text in texts)
    seed_user = seed_first_exchange()[0]
    assert [c["source"] for c in train if c["messages"][0]["content"] == seed_user][:1] == ["seed"]
    assert all(c["source"] == "oasst2-es" for c in val) and val  # held out by hash, never in train
    assert not {json.dumps(c["messages"]) for c in val} & {json.dumps(c["messages"]) for c in train}

    manifest = json.load(open(os.path.join(folder, "manifest.json")))
    oasst, aya = manifest["sources"]["oasst2-es"], manifest["sources"]["aya-es"]
    assert oasst["bad_rows"] == {
        "not_json": 1, "other_language": 1, "empty_turn": 1, "unknown_role": 1, "not_unicode": 1
    }  # fmt: skip
    assert aya["bad_rows"] == {"not_selected": 1, "missing_field": 1}
    assert oasst["dropped_turns"] == {"control_token": 2, "language_en": 2}  # the answer and its question
    assert oasst["pii"] == {"email": 1}
    assert sum(oasst["decontamination"].values()) == 1
    stages = [stage["stage"] for stage in oasst["stages"]]
    assert stages == ["read", "turns", "exact_dedup", "near_dedup", "val", "decontamination"]
    assert oasst["stages"][2]["conversations"] == oasst["stages"][1]["conversations"] - 1  # the seed's copy
    counts = {name: sum(c["source"] == name for c in train) for name in manifest["sources"]}
    shares = {s["name"]: s["share"] for s in sources_of(cfg)}
    assert max(counts[n] / len(train) - shares[n] for n in counts) < 0.03  # the shares, to rounding
    assert min(s["mixture"]["epochs"] for s in manifest["sources"].values()) <= 1.0
    assert oasst["mixture"]["epochs"] == pytest.approx(
        counts["oasst2-es"] / oasst["stages"][-1]["conversations"]
    )

    report = open(os.path.join(folder, "report.md"), encoding="utf-8").read()
    for source in sources_of(cfg):
        assert source["licence"] in report
    assert f"- oasst2-es: {OASST}@{COMMIT}, 1 file(s); licence: Apache-2.0, OpenAssistant/oasst2" in report
    assert "control_token 2" in report and "not_json 1" in report
    assert os.path.getsize(os.path.join(folder, "report", "funnel.png")) > 1000
    assert any(
        line.startswith("data: the run reads 16 rows") and "epochs per source: seed" in line for line in log
    )

    assert "mixture: up to date (" + folder + "/)" in build(cfg)


def test_every_ranked_branch_gives_more_conversations_than_the_best_one(tmp_path):
    best = {"name": "o", "kind": "oasst_trees", "lang": "es", "branches": "best", "max_rank": 0,
            "roles": {"prompter": "user", "assistant": "assistant"}, "text_field": "text"}  # fmt: skip
    path = tmp_path / "trees.jsonl.gz"
    path.write_bytes(oasst_file())
    found_best = sources.read_oasst_trees(str(path), best, sources.BadRows())
    found_ranked = sources.read_oasst_trees(
        str(path), best | {"branches": "ranked", "max_rank": 1}, sources.BadRows()
    )
    assert len(found_ranked) == len(found_best) + 12  # each cooking tree's second-ranked answer too
    first = found_best[0][1]["messages"]
    assert [m["role"] for m in first] == ["user", "assistant"] and first[1]["content"] == pairs("cocina")[0][
        1
    ]


def test_a_run_past_a_sources_epoch_limit_is_refused_naming_the_steps_that_fit(hub, tmp_path, shard_data_dir):
    cfg = mixture_config(tmp_path, shard_data_dir, train__max_steps=400)
    with pytest.raises(prepare.ChatError, match=r"data.chat.mixture.max_epochs: the run would read \S+ [\d.]+ times, "
                       r"past [\d.]+; lower train.max_steps to \d+ or below"):  # fmt: skip
        build(cfg)


def test_bad_input_is_one_line_naming_the_source_and_no_output_is_half_written(hub, tmp_path, shard_data_dir):
    cfg = mixture_config(tmp_path, shard_data_dir)
    folder = cfg["data"]["chat"]["mixture"]["dir"]
    with pytest.raises(prepare.ChatError, match=r"sources\[1\] \(oasst2-es\): OpenAssistant/oasst2 is not "
                       r"downloaded into .*; fetch it with `python -m chat download CONFIG`"):  # fmt: skip
        prepare.prepare(cfg, log=lambda *a: None)
    assert not os.path.exists(os.path.join(folder, "train.jsonl"))

    gone = copy.deepcopy(cfg)
    sources_of(gone)[2]["hub"]["revision"] = "v9-deleted"
    with pytest.raises(data.DataError, match=r"sources\[2\] \(aya-es\).hub: .*@v9-deleted: no such revision"):
        prepare.download(gone, log=lambda *a: None)

    prepare.download(cfg, log=lambda *a: None)
    trees = os.path.join(sources_of(cfg)[1]["hub"]["local_dir"], TREES)
    with open(trees, "ab") as f:
        f.write(b"tampered")
    with pytest.raises(prepare.ChatError, match=f"{trees} is missing or changed since its download"):
        prepare.prepare(cfg, log=lambda *a: None)

    prepare.download(cfg, log=lambda *a: None)  # fetched again: its checksum no longer matched
    other_files = copy.deepcopy(cfg)
    sources_of(other_files)[2]["hub"]["files"] = "data/test-*.parquet"
    with pytest.raises(
        prepare.ChatError, match=r"\(aya-es\): .* not what hub.revision and hub.files ask for now"
    ):
        prepare.prepare(other_files, log=lambda *a: None)
    empty = copy.deepcopy(cfg)
    sources_of(empty)[2]["select"] = {"language": "Klingon"}
    with pytest.raises(prepare.ChatError, match=r"sources \(aya-es\): no train conversation left"):
        prepare.prepare(empty, log=lambda *a: None)
    assert not os.path.exists(os.path.join(folder, "train.jsonl"))


def test_the_command_line_downloads_and_prepares_without_a_traceback(hub, tmp_path, shard_data_dir, capsys):
    import yaml

    cfg = mixture_config(tmp_path, shard_data_dir)
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(cfg, allow_unicode=True, sort_keys=False), encoding="utf-8")
    assert prepare.main(["prepare", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data.chat.mixture.sources[1] (oasst2-es)") and "Traceback" not in err
    assert prepare.main(["download", str(run)]) == 0
    assert prepare.main(["prepare", str(run)]) == 0
    out = capsys.readouterr().out
    assert "mixture: oasst2-es:" in out and "epochs per source" in out


def test_the_shipped_sft_mixture_names_its_sources_with_licences_and_protects_the_evaluation_sets():
    chat_cfg = data_layer("sft")["chat"]
    mixture = chat_cfg["mixture"]
    assert [s["name"] for s in mixture["sources"]] == ["seed", "oasst2-es", "aya-es", "tools"]
    assert {s["hub"]["repo"] for s in mixture["sources"] if "hub" in s} == {OASST, AYA}
    assert {"conversations/heldout.jsonl", "conversations/agent/handwritten.jsonl"} <= set(
        mixture["filters"]["decontamination"]["eval_files"]
    )
    prepare.check_mixture_named(chat_cfg)  # train and val read what the mixture writes
    for run_file in ("sft-2060.yaml", "sft-5090.yaml"):
        assert config.load(os.path.join(ROOT, "configs", run_file))["data"]["chat"]["mixture"] == mixture


def test_both_arms_of_make_sft_bpb_train_the_same_steps_and_are_measured_on_the_same_held_out_files():
    mix, seed_only = (
        config.load(os.path.join(ROOT, "configs", f"sft-{arm}-cpu.yaml")) for arm in ("mix", "seed-only")
    )
    assert mix["data"]["chat"]["val"] == seed_only["data"]["chat"]["val"]
    assert mix["train"] == seed_only["train"]
    assert (
        mix["model"] == seed_only["model"]
        and mix["data"]["chat"]["tokenizer"] == seed_only["data"]["chat"]["tokenizer"]
    )
    held_out = set(mix["data"]["chat"]["val"])
    assert not held_out & set(mix["data"]["chat"]["train"]) and not held_out & set(
        seed_only["data"]["chat"]["train"]
    )
    prepare.check_mixture_named(mix["data"]["chat"])
    assert "mixture" not in seed_only["data"]["chat"]  # the seed set alone, as sft-smoke trains it


def test_a_shared_system_prompt_is_not_contamination_but_a_shared_turn_is(tmp_path):
    from chat import mixture

    system = {
        "role": "system",
        "content": "Eres ENLACE, el asistente de la familia Vidal. Hoy es viernes 19 de marzo.",
    }
    held_out = {"messages": [system, {"role": "user", "content": "¿Qué tiempo hará mañana en Madrid?"},
                             {"role": "assistant", "content": "No tengo el parte, mira la web de AEMET."}]}  # fmt: skip
    path = write_jsonl(tmp_path / "heldout.jsonl", [held_out])
    decon = {
        "ngram": 13,
        "min_words": 3,
        "val_max_overlap": 0.5,
        "eval_files": [path],
        "eval_files_if_present": [],
    }
    guard, short = mixture.protector(decon, [])
    other = {"messages": [system, {"role": "user", "content": "Dame una receta de lentejas."},
                          {"role": "assistant", "content": "Lentejas con chorizo: sofríe cebolla y pimiento."}]}  # fmt: skip
    assert mixture.contamination(other, guard, short) is None
    same_question = {
        "messages": [{"role": "user", "content": "qué tiempo hará MAÑANA en Madrid"}] + other["messages"][2:]
    }
    assert mixture.contamination(same_question, guard, short) == path


def test_two_sources_of_one_name_are_refused_before_anything_is_read(tmp_path):
    from chat import mixture

    cfg = mixture_config(tmp_path, str(tmp_path))
    sources_of(cfg)[3]["name"] = "seed"
    with pytest.raises(prepare.ChatError, match="data.chat.mixture.sources: the name 'seed' is used twice"):
        mixture.build(cfg["data"], tokenizer=None, tokenizer_sha="x")


def test_lm_eval_task_texts_in_the_datasets_cache_are_protected_when_present(tmp_path, monkeypatch):
    from chat import mixture

    question = "¿Cuál de estos animales pone huevos y vive en los ríos de Australia oriental y Tasmania?"
    cache = tmp_path / ".cache" / "huggingface" / "datasets" / "openbookqa_es" / "default" / "0.0.0"
    cache.mkdir(parents=True)
    table = pa.table({"question_stem": [question], "answerKey": ["A"], "id": [7]})
    with (
        pa.OSFile(str(cache / "openbookqa_es-test.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as w,
    ):
        w.write_table(table)  # the Arrow stream format the datasets library caches tasks in
    monkeypatch.setenv("HOME", str(tmp_path))
    decon = {"ngram": 13, "min_words": 3, "val_max_overlap": 0.5, "eval_files": [],
             "eval_files_if_present": ["~/.cache/huggingface/datasets/**/*.arrow", "~/nowhere/*.jsonl"]}  # fmt: skip
    guard, short = mixture.protector(decon, [])
    asked = {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": "El ornitorrinco."},
        ]
    }
    assert mixture.contamination(asked, guard, short) == str(cache / "openbookqa_es-test.arrow")


def test_offline_the_chat_download_checks_its_recorded_files_and_asks_no_server(
    hub, tmp_path, shard_data_dir, monkeypatch
):
    """HF_HUB_OFFLINE (make run OFFLINE=1's chat-download stage): the conversations fetched before, their
    mtimes changed as by a copy to another machine, are checked by checksum; the stand-in gets no request."""
    from huggingface_hub import constants

    cfg = mixture_config(tmp_path, shard_data_dir)
    prepare.download(cfg, log=lambda *a: None)
    trees = os.path.join(sources_of(cfg)[1]["hub"]["local_dir"], TREES)
    os.utime(trees, ns=(1, 1))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub.requests.clear()
    lines = []
    prepare.download(cfg, log=lines.append)
    assert hub.requests == []
    assert lines[-1].startswith("download: offline (HF_HUB_OFFLINE)") and "1 by their checksum" in lines[-1]
    prepare.prepare(cfg, log=lines.append)  # the mixture reads the files the offline check accepted
    assert os.path.exists(os.path.join(cfg["data"]["chat"]["mixture"]["dir"], "train.jsonl"))
    with open(trees, "ab") as f:
        f.write(b"tampered")
    with pytest.raises(data.DataError, match=f"{trees}: checksum .* differs from"):
        prepare.download(cfg, log=lambda *a: None)
    assert hub.requests == []
