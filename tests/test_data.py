"""data.py: tokenizers, the shard format, loaders with exact state, and the corpus -> shards pipeline."""

import copy
import gzip
import io
import json
import os
import shutil
import subprocess
import sys

import jsonschema
import numpy as np
import pytest
import torch
import yaml

import config
import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOVELAS = os.path.join(ROOT, "..", "shared", "corpus", "novelas-cligs.jsonl.gz")


def data_layer(name, **changes):
    """The `data:` section of a shipped configs/data/<name>.yaml, deep-updated and schema-checked."""
    with open(os.path.join(ROOT, "configs", "data", f"{name}.yaml"), encoding="utf-8") as f:
        section = yaml.safe_load(f)["data"]

    def update(node, new):
        for key, value in new.items():
            if isinstance(value, dict) and isinstance(node.get(key), dict):
                update(node[key], value)
            else:
                node[key] = value

    update(section, copy.deepcopy(changes))
    jsonschema.validate(section, config.load_schema("data"))
    return section


def sample_corpus(path):
    """About 130 KB of the embedded corpus: 400 fortunes and the first chapters of Genesis."""
    fortunes = gzip.open(os.path.join(ROOT, "corpus", "fortunes-es.txt.gz")).read().decode("utf-8")
    bible = gzip.open(os.path.join(ROOT, "corpus", "rv1909.txt.gz")).read().decode("utf-8")
    path.write_text("\n\n".join(fortunes.split("\n\n")[:400] + bible[:80_000].split("\n")), encoding="utf-8")
    return str(path)


def quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """One small corpus -> tokenizer -> shards run shared by the tests that only read its results."""
    directory = tmp_path_factory.mktemp("corpus-smoke")
    cfg = data_layer(
        "corpus-smoke",
        dir=str(directory),
        processes=1,
        corpus={"inputs": [{"path": sample_corpus(directory / "sample.txt"), "documents": "blank_line"}]},
        tokenizer={"vocab_size": 512},
        encode={"tokens_per_shard": 5_000},
    )
    data.build_corpus(cfg, log=quiet)
    data.train_tokenizer(cfg, log=quiet)
    data.encode(cfg, log=quiet)
    return cfg


def read_docs(cfg, split):
    return list(data.iter_documents(data.docs_path(cfg, split)))


def shard_hashes(cfg, split):
    return [data.sha256_of_file(p) for p in data.shard_paths(cfg, split)]


# -----------------------------------------------------------------------------
# Loaders


def byte_cfg(directory, train_bytes, val_bytes=b"abcdefghij" * 10):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "train.bin").write_bytes(train_bytes)
    (directory / "val.bin").write_bytes(val_bytes)
    return data_layer("smoke", dir=str(directory))


def positional_shards(directory, sizes, vocab_size=65536):
    """Shards whose tokens are their global positions: every window says where it came from."""
    directory.mkdir(parents=True, exist_ok=True)
    start = 0
    for index, size in enumerate(sizes):
        data.write_shard(
            str(directory / data.shard_name("train", index)), np.arange(start, start + size), vocab_size
        )
        start += size
    data.write_shard(str(directory / data.shard_name("val", 0)), np.arange(500), vocab_size)
    return data_layer("corpus-smoke", dir=str(directory), tokenizer={"vocab_size": vocab_size})


def batches(loader, count):
    return [loader.next_batch() for _ in range(count)]


def assert_same_batches(first, second):
    assert len(first) == len(second)
    for (x1, y1), (x2, y2) in zip(first, second, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def through_checkpoint(state):
    """What the trainer does with a loader state: torch.save, then torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu", weights_only=True)


def test_byte_loader_restored_from_its_state_continues_with_the_same_batches(tmp_path):
    cfg = byte_cfg(tmp_path, bytes(range(256)) * 40)
    loader = data.build_loader(cfg, "train", 4, 16, seed=7)
    batches(loader, 5)
    state = through_checkpoint(loader.state_dict())
    expected = batches(loader, 6)
    restored = data.build_loader(cfg, "train", 4, 16, seed=7)
    restored.load_state_dict(state)
    assert_same_batches(batches(restored, 6), expected)


def test_byte_batches_are_int64_windows_with_targets_shifted_by_one(tmp_path):
    text = bytes(range(256)) * 4
    cfg = byte_cfg(tmp_path, text)
    x, y = data.build_loader(cfg, "train", 3, 8, seed=1).next_batch()
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, 8)
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        start = text.index(bytes(row_x))  # bytes(range(256)) makes every window unique
        assert bytes(row_y) == text[start + 1 : start + 9]


def test_byte_loader_ranks_draw_from_disjoint_slices(tmp_path):
    cfg = byte_cfg(tmp_path, np.repeat(np.arange(4, dtype=np.uint8), 1000).tobytes())
    for rank in range(4):
        loader = data.build_loader(cfg, "train", 8, 32, seed=3, rank=rank, world_size=4)
        seen = torch.cat([torch.cat([x, y]) for x, y in batches(loader, 20)]).unique().tolist()
        assert seen == [rank]


def test_a_fresh_val_loader_with_the_same_seed_repeats_its_batches(tmp_path):
    cfg = byte_cfg(tmp_path, b"x" * 1000, val_bytes=bytes(range(256)) * 4)
    first = batches(data.build_loader(cfg, "val", 2, 8, seed=5), 3)
    assert_same_batches(batches(data.build_loader(cfg, "val", 2, 8, seed=5), 3), first)


def test_shard_loader_restored_from_its_state_continues_across_shards_and_epochs(tmp_path):
    cfg = positional_shards(tmp_path, [300, 170, 90])
    loader = data.build_loader(cfg, "train", 4, 10, seed=11)
    batches(loader, 9)  # 55 windows per epoch: the next batches cross shards and the epoch boundary
    state = through_checkpoint(loader.state_dict())
    expected = batches(loader, 12)
    restored = data.build_loader(cfg, "train", 4, 10, seed=11)
    restored.load_state_dict(state)
    assert_same_batches(batches(restored, 12), expected)


def test_shard_loader_reads_every_window_once_per_epoch_in_a_seeded_order(tmp_path):
    cfg = positional_shards(tmp_path, [301, 171, 91])  # 30 + 17 + 9 windows of 10 (+1) tokens
    loader = data.build_loader(cfg, "train", 8, 10, seed=2)
    starts = torch.cat([x[:, 0] for x, _ in batches(loader, 7)]).tolist()  # exactly one epoch
    expected = sorted(
        shard_start + 10 * w for shard_start, n in ((0, 30), (301, 17), (472, 9)) for w in range(n)
    )
    assert sorted(starts) == expected
    other_seed = data.build_loader(cfg, "train", 8, 10, seed=3)
    assert torch.cat([x[:, 0] for x, _ in batches(other_seed, 7)]).tolist() != starts


def test_shard_loader_ranks_read_disjoint_windows(tmp_path):
    cfg = positional_shards(tmp_path, [301, 181])  # 30 + 18 windows: 10 + 6 for each of 3 ranks
    per_rank = []
    for rank in range(3):
        loader = data.build_loader(cfg, "train", 4, 10, seed=4, rank=rank, world_size=3)
        per_rank.append(set(torch.cat([x for x, _ in batches(loader, 4)]).flatten().tolist()))  # one epoch
    assert not per_rank[0] & per_rank[1] and not per_rank[0] & per_rank[2] and not per_rank[1] & per_rank[2]
    assert sum(map(len, per_rank)) == 3 * 16 * 10


def test_a_loader_state_from_another_world_size_or_shape_is_refused(tmp_path):
    cfg = positional_shards(tmp_path, [300])
    state = data.build_loader(cfg, "train", 4, 10, seed=1, rank=0, world_size=2).state_dict()
    with pytest.raises(data.DataError, match="world_size: state has 2, this loader has 1"):
        data.build_loader(cfg, "train", 4, 10, seed=1).load_state_dict(state)
    byte_state = data.build_loader(byte_cfg(tmp_path / "b", b"z" * 500), "train", 4, 10, seed=1).state_dict()
    with pytest.raises(data.DataError, match="seq_len: state has 10, this loader has 12"):
        data.build_loader(byte_cfg(tmp_path / "b", b"z" * 500), "train", 4, 12, seed=1).load_state_dict(
            byte_state
        )


def test_loaders_explain_missing_or_too_small_data(tmp_path):
    with pytest.raises(data.DataError, match="train.bin: not found; build it with `make data-smoke`"):
        data.build_loader(data_layer("smoke", dir=str(tmp_path / "none")), "train", 2, 8, seed=0)
    with pytest.raises(data.DataError, match="fewer than one window"):
        data.build_loader(byte_cfg(tmp_path / "small", b"abc"), "train", 2, 8, seed=0)
    empty_dir = data_layer("corpus-smoke", dir=str(tmp_path / "no-shards"))
    with pytest.raises(data.DataError, match=r"train_\*\.bin: no shards"):
        data.build_loader(empty_dir, "train", 2, 8, seed=0)
    with pytest.raises(data.DataError, match="unknown split 'test'"):
        data.build_loader(empty_dir, "test", 2, 8, seed=0)


# -----------------------------------------------------------------------------
# Shard format


def test_a_shard_round_trips_its_tokens_and_header(tmp_path):
    path = str(tmp_path / "train_000000.bin")
    tokens = np.array([0, 1, 65535, 300, 7], dtype=np.uint16)
    sha256 = data.write_shard(path, tokens, 65536)
    assert sha256 == data.sha256_of_file(path)
    assert data.read_shard_header(path) == (5, 65536)
    assert np.array_equal(data.read_shard(path), tokens)
    header = np.fromfile(path, dtype="<i4", count=4)
    assert header.tolist() == [20240520, 1, 5, 65536]
    assert os.path.getsize(path) == 1024 + 2 * 5


def broken_shard(tmp_path, index, value=None, cut=0):
    path = str(tmp_path / f"bad_{index}.bin")
    data.write_shard(path, np.arange(50), 1000)
    raw = bytearray(open(path, "rb").read())
    if value is not None:
        raw[index * 4 : index * 4 + 4] = np.array([value], dtype="<i4").tobytes()
    with open(path, "wb") as f:
        f.write(raw[: len(raw) - cut])
    return path


@pytest.mark.parametrize(
    "index, value, cut, message",
    [
        (0, 12345, 0, "not a token shard: magic number 12345, expected 20240520"),
        (1, 2, 0, "shard version 2, this data.py reads version 1"),
        (2, 50, 10, r"truncated or corrupt shard: 1114 bytes, but the header says 50 tokens \(1124 bytes\)"),
        (2, 60, 0, "truncated or corrupt shard: 1124 bytes, but the header says 60 tokens"),
        (3, 0, 0, "header vocab size 0"),
        (4, None, 1000, "truncated shard: 124 bytes, shorter than the 1024-byte header"),
    ],
)
def test_a_broken_shard_is_refused_with_the_file_and_the_problem(tmp_path, index, value, cut, message):
    path = broken_shard(tmp_path, index, value, cut)
    with pytest.raises(data.DataError, match=message) as excinfo:
        data.read_shard(path)
    assert str(excinfo.value).startswith(path + ":")


def test_shards_of_another_vocabulary_are_refused_by_the_loader(tmp_path):
    cfg = positional_shards(tmp_path, [300], vocab_size=65000)
    cfg["tokenizer"]["vocab_size"] = 4096
    with pytest.raises(data.DataError, match="train_000000.bin: encoded with a 65000-token vocabulary"):
        data.build_loader(cfg, "train", 2, 8, seed=0)


# -----------------------------------------------------------------------------
# Corpus pipeline


def test_cleaning_normalizes_to_nfc_and_tidies_controls_and_whitespace():
    raw = "\n\t\n  \n  Cafe\u0301 \u00a0con\u200bleche\x07\r\nsegunda   \t\n\n\n\n\ufefftercera\u2028cuarta \n\n"
    assert data.clean_text(raw) == "  Café  con\u200bleche\nsegunda\n\ntercera\ncuarta"
    assert data.clean_text("a\tb") == "a\tb"  # tabs inside lines stay


def write_gz(path, text_or_bytes):
    raw = text_or_bytes.encode("utf-8") if isinstance(text_or_bytes, str) else text_or_bytes
    with gzip.open(path, "wb") as f:
        f.write(raw)


def corpus_cfg(tmp_path, inputs, **corpus):
    settings = {"inputs": inputs, "min_chars": 10, "val_fraction": 0.5, "max_documents_per_file": None}
    settings.update(corpus)
    return data_layer("corpus-smoke", dir=str(tmp_path / "out"), processes=1, corpus=settings)


def test_corpus_step_dedups_filters_counts_and_splits_by_hash(tmp_path):
    docs = [f"Documento número {i}: había una vez una historia." for i in range(40)]
    (tmp_path / "a.txt").write_text("\n\n".join(docs[:30] + [docs[3], "corto"]) + "\n")
    write_gz(tmp_path / "b.txt.gz", b"Texto con un byte \xff roto y otro \xc3 mas, largo\n")
    escaped = json.dumps({"body": "Un escape \ud83d suelto en JSON, largo"})  # a lone surrogate
    lines = [json.dumps({"body": d}) for d in docs[30:]] + ["{not json", json.dumps({"title": "x"}), escaped]
    write_gz(tmp_path / "c.jsonl.gz", "\n".join(lines + [json.dumps({"body": docs[0]})]) + "\n")
    (tmp_path / "whole").mkdir()
    (tmp_path / "whole" / "d.txt").write_text("Un documento\n\ncon una línea en blanco dentro.\n")
    inputs = [
        {"path": str(tmp_path / "*.txt*"), "documents": "blank_line"},
        {"path": str(tmp_path / "c.jsonl.gz"), "documents": "jsonl", "text_field": "body"},
        {"path": str(tmp_path / "whole" / "d.txt"), "documents": "file"},
    ]
    cfg = corpus_cfg(tmp_path, inputs)
    stats = data.build_corpus(cfg, log=quiet)
    assert stats["rejects"] == {"bad_json": 1, "missing_text_field": 1, "empty": 0, "too_short": 1}
    assert stats["duplicates"] == 2 and stats["undecodable"] == 3
    assert stats["documents_in"] == 32 + 1 + 14 + 1 and stats["documents_out"] == 40 + 3
    train, val = read_docs(cfg, "train"), read_docs(cfg, "val")
    assert 5 < len(val) < 38 and len(train) + len(val) == 43
    broken = [
        "Texto con un byte \ufffd roto y otro \ufffd mas, largo",
        "Un escape \ufffd suelto en JSON, largo",
    ]
    assert sorted(train + val) == sorted(docs + broken + ["Un documento\n\ncon una línea en blanco dentro."])
    assert [t for t in train if t in docs] == [d for d in docs if d in train]  # input order kept
    manifest = json.load(open(data.manifest_path(cfg)))
    assert manifest["corpus"]["stats"] == stats

    again = corpus_cfg(tmp_path, inputs)
    again["dir"] = str(tmp_path / "again")
    data.build_corpus(again, log=quiet)
    assert read_docs(again, "val") == val  # the split depends on the text only


def test_corpus_step_does_nothing_when_inputs_are_unchanged_and_rebuilds_when_they_change(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n".join(f"Documento largo número {i}." for i in range(30)))
    cfg = corpus_cfg(tmp_path, [{"path": str(tmp_path / "a.txt"), "documents": "blank_line"}])
    data.build_corpus(cfg, log=quiet)
    before = os.stat(data.docs_path(cfg, "train")).st_mtime_ns
    said = []
    data.build_corpus(cfg, log=said.append)
    assert said == [f"corpus: up to date ({cfg['dir']}/docs_*.jsonl)"]
    assert os.stat(data.docs_path(cfg, "train")).st_mtime_ns == before
    (tmp_path / "a.txt").write_text("\n\n".join(f"Otro documento largo número {i}." for i in range(30)))
    data.build_corpus(cfg, log=said.append)
    assert "up to date" not in said[-1]
    assert all(d.startswith("Otro") for d in read_docs(cfg, "train") + read_docs(cfg, "val"))


def test_corpus_errors_name_the_missing_glob_the_unreadable_file_and_the_empty_corpus(tmp_path):
    missing = corpus_cfg(tmp_path, [{"path": str(tmp_path / "nada" / "*.txt"), "documents": "blank_line"}])
    with pytest.raises(data.DataError, match=r"data.corpus.inputs\[0\].path: no file matches .*nada/\*\.txt"):
        data.build_corpus(missing, log=quiet)
    (tmp_path / "bad.txt.gz").write_bytes(gzip.compress(b"Un texto largo para leer.\n" * 100)[:60])
    unreadable = corpus_cfg(tmp_path, [{"path": str(tmp_path / "bad.txt.gz"), "documents": "blank_line"}])
    with pytest.raises(data.DataError, match=r"bad.txt.gz: cannot read \(.*\) \[data.corpus.inputs\[0\]\]"):
        data.build_corpus(unreadable, log=quiet)
    (tmp_path / "short.txt").write_text("hola\n\nadiós\n")
    empty = corpus_cfg(tmp_path, [{"path": str(tmp_path / "short.txt"), "documents": "blank_line"}])
    with pytest.raises(data.DataError, match="no document survived .*too_short.: 2"):
        data.build_corpus(empty, log=quiet)
    assert not os.path.exists(data.docs_path(empty, "train"))  # nothing half-written left behind


# -----------------------------------------------------------------------------
# Tokenizer


def test_the_tokenizer_round_trips_the_val_split_exactly(pipeline):
    tokenizer = data.load_tokenizer(pipeline)
    assert tokenizer.name == "sentencepiece" and tokenizer.vocab_size == 512
    val = read_docs(pipeline, "val")
    assert len(val) > 10
    for text in val:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    tricky = "  dos espacios\tun tab\n\n\nlíneas  vacías \n 2024 ¿Qué? 日本 🙂 fin "
    assert tokenizer.decode(tokenizer.encode(tricky)) == tricky


def test_line_by_line_encoding_equals_sentencepiece_on_the_whole_text(pipeline):
    tokenizer = data.load_tokenizer(pipeline)
    for text in read_docs(pipeline, "val")[:50]:
        assert tokenizer.encode(text) == tokenizer.processor.encode(text)


def test_control_tokens_have_reserved_ids_and_never_come_from_plain_text(pipeline):
    tokenizer = data.load_tokenizer(pipeline)
    assert tokenizer.special_ids == {
        "<|bos|>": 1,
        "<|eos|>": 2,
        "<|system|>": 3,
        "<|user|>": 4,
        "<|assistant|>": 5,
        "<|end|>": 6,
        "<|tool|>": 7,
        **{f"<|reserved_{i}|>": 8 + i for i in range(8)},
    }
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.newline_id) == (1, 2, 16)
    text = "<|bos|><|user|> hola <|assistant|> adiós <|end|><|eos|><|system|><|tool|><|reserved_3|>"
    ids = tokenizer.encode(text)
    assert not set(ids) & set(tokenizer.special_ids.values())
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([1, *tokenizer.encode("hola"), 4, 2]) == "hola"


def test_tool_tags_are_single_pieces_at_fixed_ids(pipeline):
    tokenizer = data.load_tokenizer(pipeline)
    assert tokenizer.tag_ids == {
        "<tool_call>": 17,
        "</tool_call>": 18,
        "<tool_response>": 19,
        "</tool_response>": 20,
        "<tools>": 21,
        "</tools>": 22,
    }
    for tag, tag_id in tokenizer.tag_ids.items():
        ids = tokenizer.encode(f"antes{tag}después")
        assert tag_id in ids and tokenizer.decode(ids) == f"antes{tag}después"


def test_a_tokenizer_without_the_token_table_is_refused(pipeline, tmp_path):
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(read_docs(pipeline, "train")[:200]),
        model_writer=model,
        model_type="bpe",
        vocab_size=300,
        minloglevel=2,
    )
    path = tmp_path / "tokenizer.model"
    path.write_bytes(model.getvalue())
    with pytest.raises(data.DataError, match=r"tokenizer\.model: its reserved ids do not hold"):
        data.SentencePieceTokenizer(str(path))


def test_token_bytes_add_up_to_the_utf8_length_of_the_text(pipeline):
    tokenizer = data.load_tokenizer(pipeline)
    for text in read_docs(pipeline, "val")[:20] + ["año 🙂 日本\n\tfin"]:
        ids = [tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id]
        assert sum(tokenizer.token_bytes[i] for i in ids) == len(text.encode("utf-8"))


def test_the_tokenizer_info_records_settings_and_the_corpus_hash(pipeline):
    info = json.load(open(os.path.join(pipeline["dir"], "tokenizer_info.json")))
    corpus = json.load(open(data.manifest_path(pipeline)))["corpus"]
    assert info["corpus_sha256"] == corpus["outputs"]["train"]["sha256"]
    assert info["sha256"] == data.sha256_of_file(data.tokenizer_path(pipeline))
    settings = info["settings"]
    assert (
        settings["byte_fallback"]
        and settings["split_digits"]
        and settings["normalization_rule_name"] == "identity"
    )
    assert settings["remove_extra_whitespaces"] is False and settings["vocab_size"] == 512


def test_the_byte_tokenizer_is_utf8_with_replacement():
    tokenizer = data.load_tokenizer(data_layer("smoke"))
    assert (tokenizer.name, tokenizer.vocab_size, tokenizer.eos_id, tokenizer.special_ids) == (
        "bytes",
        256,
        None,
        {},
    )
    assert tokenizer.encode("ñ") == [0xC3, 0xB1] and tokenizer.decode([0xC3, 0xB1, 0xFF]) == "ñ\ufffd"


def test_a_tokenizer_that_does_not_match_the_config_is_refused(pipeline):
    cfg = copy.deepcopy(pipeline)
    cfg["tokenizer"]["vocab_size"] = 1024
    with pytest.raises(data.DataError, match="has 512 tokens but data.tokenizer.vocab_size is 1024"):
        data.load_tokenizer(cfg)


# -----------------------------------------------------------------------------
# Encoding


def test_shards_hold_every_document_as_bos_ids_eos_in_order(pipeline):
    tokenizer = data.load_tokenizer(pipeline)
    for split in data.SPLITS:
        paths = data.shard_paths(pipeline, split)
        assert all(data.read_shard_header(p)[1] == 512 for p in paths)
        tokens = data.load_split_tokens(pipeline, split).tolist()
        expected = []
        for text in read_docs(pipeline, split):
            expected += [1, *tokenizer.encode(text), 2]
        assert tokens == expected
    assert len(data.shard_paths(pipeline, "train")) > 3  # 5,000-token shards
    manifest = json.load(open(data.manifest_path(pipeline)))["encode"]["train"]
    assert manifest["complete"] and manifest["tokens"] == sum(s["tokens"] for s in manifest["shards"])
    assert [s["sha256"] for s in manifest["shards"]] == shard_hashes(pipeline, "train")


def test_encoding_is_identical_whatever_the_number_of_processes(pipeline, tmp_path):
    for processes in (2, 3):
        cfg = copy.deepcopy(pipeline) | {"dir": str(tmp_path / str(processes)), "processes": processes}
        shutil.copytree(pipeline["dir"], cfg["dir"], ignore=shutil.ignore_patterns("*_0*.bin"))
        manifest = json.load(open(data.manifest_path(cfg)))
        del manifest["encode"]
        data.write_json(data.manifest_path(cfg), manifest)
        data.encode(cfg, log=quiet)
        for split in data.SPLITS:
            assert shard_hashes(cfg, split) == shard_hashes(pipeline, split)


def test_an_interrupted_encode_resumes_after_its_finished_shards(pipeline, tmp_path):
    cfg = copy.deepcopy(pipeline) | {"dir": str(tmp_path / "resume")}
    shutil.copytree(pipeline["dir"], cfg["dir"])
    manifest = json.load(open(data.manifest_path(cfg)))
    train = manifest["encode"]["train"]
    kept = train["shards"][:2]
    assert kept[-1]["next_token"] > 0  # the third shard starts inside a document: the harder resume
    train["shards"], train["complete"] = kept, False  # as if killed while writing the third shard
    data.write_json(data.manifest_path(cfg), manifest)
    finished = [os.stat(os.path.join(cfg["dir"], s["name"])) for s in kept]
    with open(os.path.join(cfg["dir"], data.shard_name("train", 2)), "r+b") as f:
        f.truncate(1500)  # the shard being written when the run died

    said = []
    data.encode(cfg, log=said.append)
    assert (
        said[0]
        == "encode: train resuming after 2 finished shards, at document " + f"{kept[-1]['next_document']:,}"
    )
    assert shard_hashes(cfg, "train") == shard_hashes(pipeline, "train")
    for shard, before in zip(kept, finished, strict=True):
        after = os.stat(os.path.join(cfg["dir"], shard["name"]))
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rewritten
    data.encode(cfg, log=said.append)
    assert said[-2:] == [
        f"encode: train up to date ({len(shard_hashes(pipeline, 'train'))} shard(s) in {cfg['dir']}/)",
        f"encode: val up to date ({len(shard_hashes(pipeline, 'val'))} shard(s) in {cfg['dir']}/)",
    ]


def test_the_shard_loader_reads_the_encoded_corpus(pipeline):
    x, y = data.build_loader(pipeline, "train", 4, 32, seed=0).next_batch()
    assert x.shape == (4, 32) and int(x.max()) < 512 and torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.skipif(not os.path.exists(NOVELAS), reason="../shared/corpus/novelas-cligs.jsonl.gz not present")
def test_the_stage1_corpus_reads_novelas_jsonl_gz(tmp_path):
    cfg = data_layer(
        "corpus", dir=str(tmp_path), processes=1, corpus={"max_documents_per_file": 12, "val_fraction": 0.5}
    )
    assert os.path.normpath(cfg["corpus"]["inputs"][0]["path"]) == os.path.relpath(NOVELAS, ROOT)
    cfg["corpus"]["inputs"][0]["path"] = NOVELAS
    stats = data.build_corpus(cfg, log=quiet)
    assert stats["documents_out"] == 12 and stats["undecodable"] == 0


# -----------------------------------------------------------------------------
# Command line and scripts (a run file composed by config.py)


SMOKE_RUN = os.path.join(ROOT, "configs", "smoke-cpu.yaml")  # make data-smoke / make smoke
CORPUS_SMOKE_RUN = os.path.join(ROOT, "configs", "smoke-corpus-cpu.yaml")  # make corpus-smoke


def run_data_cli(*args):
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "data.py"), *args], capture_output=True, text=True, cwd=ROOT
    )


def test_make_corpus_smoke_path_builds_shards_a_loader_can_train_on(tmp_path):
    out = tmp_path / "corpus-smoke"
    overrides = [f"data.dir={out}", "data.corpus.max_documents_per_file=200", "data.tokenizer.vocab_size=400"]
    result = run_data_cli("all", CORPUS_SMOKE_RUN, *overrides, "model.vocab_size=400")
    assert result.returncode == 0, result.stderr
    assert "tokenizer: 400 tokens" in result.stdout
    for name in (
        "tokenizer.model",
        "tokenizer_info.json",
        "manifest.json",
        "train_000000.bin",
        "val_000000.bin",
    ):
        assert (out / name).exists(), name
    cfg = config.load(CORPUS_SMOKE_RUN, overrides + ["model.vocab_size=400"])["data"]
    assert data.load_tokenizer(cfg).vocab_size == 400
    x, _ = data.build_loader(cfg, "val", 2, 16, seed=0).next_batch()
    assert x.shape == (2, 16)


def test_the_command_line_reports_errors_without_a_traceback(tmp_path):
    result = run_data_cli("encode", CORPUS_SMOKE_RUN, f"data.dir={tmp_path / 'empty'}")
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "run `python data.py corpus CONFIG` first" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_data_cli("all", SMOKE_RUN, "data.format=shards")
    assert result.returncode == 2 and "data.tokenizer: required key missing" in result.stderr
    assert "Traceback" not in result.stderr


def test_prepare_smoke_data_builds_once_then_does_nothing(tmp_path):
    script = os.path.join(ROOT, "scripts", "prepare_smoke_data.sh")
    out = tmp_path / "smoke"
    first = subprocess.run([script, f"data.dir={out}"], capture_output=True, text=True, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    train, val = (out / "train.bin").read_bytes(), (out / "val.bin").read_bytes()
    assert len(train) + len(val) > 4_500_000 and 0.02 < len(val) / len(train) < 0.1
    assert train.decode("utf-8") and val.decode("utf-8")
    both = (train + val).decode("utf-8")
    assert "Donde hay concordia siempre hay victoria.\n\t\t-- Publio Siro." in both
    assert "Capítulo 1\nEN el principio crió Dios" in both
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    second = subprocess.run([script, f"data.dir={out}"], capture_output=True, text=True, cwd=ROOT)
    assert second.returncode == 0, second.stderr
    assert "up to date" in second.stdout and "encode: train up to date" in second.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
