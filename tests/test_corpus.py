"""The corpus pipeline (corpus/pipeline.py): reading, cleaning, dedup, split, tokenizer training, encoding."""

import bz2
import contextlib
import copy
import glob
import gzip
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT, data_layer, quiet, read_docs, shard_hashes, text_source

import config
import corpus.pipeline
import data
from corpus import docs, filters, sources

sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures", "corpus"))
import write_fixtures  # noqa: E402

import fileio

NOVELAS = os.path.join(ROOT, "..", "shared", "corpus", "novelas-cligs.jsonl.gz")


# -----------------------------------------------------------------------------
# Corpus pipeline


def test_cleaning_normalizes_to_nfc_and_tidies_controls_and_whitespace():
    raw = "\n\t\n  \n  Cafe\u0301 \u00a0con\u200bleche\x07\r\nsegunda   \t\n\n\n\n\ufefftercera\u2028cuarta \n\n"
    assert corpus.pipeline.clean_text(raw) == "  Café  con\u200bleche\nsegunda\n\ntercera\ncuarta"
    assert corpus.pipeline.clean_text("a\tb") == "a\tb"  # tabs inside lines stay


def write_gz(path, text_or_bytes):
    raw = text_or_bytes.encode("utf-8") if isinstance(text_or_bytes, str) else text_or_bytes
    with gzip.open(path, "wb") as f:
        f.write(raw)


def corpus_cfg(tmp_path, sources, near_dedup=False, **corpus):
    """The corpus-smoke data layer on `sources`, one process, MinHash off unless asked (documents that
    differ by a number are near-duplicates)."""
    settings = {"sources": sources, "min_chars": 10, "val_fraction": 0.5, "max_documents_per_file": None}
    settings.update(corpus)
    settings.setdefault("near_dedup", {})["enabled"] = near_dedup
    return data_layer("corpus-smoke", dir=str(tmp_path / "out"), processes=1, corpus=settings)


def drops(stats, source):
    return {reason: count for reason, count in stats["sources"][source]["drops"].items() if count}


def test_corpus_step_dedups_filters_counts_and_splits_by_hash(tmp_path):
    documents = [f"Documento número {i}: había una vez una historia." for i in range(40)]
    (tmp_path / "a.txt").write_text("\n\n".join(documents[:30] + [documents[3], "corto"]) + "\n")
    write_gz(tmp_path / "b.txt.gz", b"Texto con un byte \xff roto y otro \xc3 mas, largo\n")
    escaped = json.dumps({"body": "Un escape \ud83d suelto en JSON, largo"})  # a lone surrogate
    lines = [json.dumps({"body": d}) for d in documents[30:]] + [
        "{not json",
        json.dumps({"title": "x"}),
        escaped,
    ]
    write_gz(tmp_path / "c.jsonl.gz", "\n".join(lines + [json.dumps({"body": documents[0]})]) + "\n")
    (tmp_path / "whole").mkdir()
    (tmp_path / "whole" / "d.txt").write_text("Un documento\n\ncon una línea en blanco dentro.\n")
    sources = [
        text_source("texts", str(tmp_path / "*.txt*")),
        text_source("json", str(tmp_path / "c.jsonl.gz"), kind="jsonl", text_field="body", documents=None),
        text_source("whole", str(tmp_path / "whole" / "d.txt"), documents="file"),
    ]
    del sources[1]["documents"]
    cfg = corpus_cfg(tmp_path, sources)
    stats = corpus.pipeline.build_corpus(cfg, log=quiet)
    assert drops(stats, "texts") == {"too_short": 1, "exact_duplicate": 1}
    assert drops(stats, "json") == {"bad_json": 1, "missing_text_field": 1, "exact_duplicate": 1}
    assert drops(stats, "whole") == {}
    assert stats["undecodable"] == 3
    assert stats["documents_in"] == 32 + 1 + 12 + 1 and stats["documents_out"] == 40 + 3
    assert stats["sources"]["json"]["licence"] == "test data"
    train, val = read_docs(cfg, "train"), read_docs(cfg, "val")
    assert 5 < len(val) < 38 and len(train) + len(val) == 43
    broken = [
        "Texto con un byte \ufffd roto y otro \ufffd mas, largo",
        "Un escape \ufffd suelto en JSON, largo",
    ]
    assert sorted(train + val) == sorted(
        documents + broken + ["Un documento\n\ncon una línea en blanco dentro."]
    )
    assert [t for t in train if t in documents] == [d for d in documents if d in train]  # input order kept
    records = [json.loads(line) for split in data.SPLITS for line in open(docs.docs_path(cfg, split))]
    assert {r["source"] for r in records} == {
        "texts",
        "json",
        "whole",
    }  # the source travels with each document
    manifest = json.load(open(data.manifest_path(cfg)))
    assert manifest["corpus"]["stats"] == json.loads(json.dumps(stats))

    again = corpus_cfg(tmp_path, sources)
    again["dir"] = str(tmp_path / "again")
    corpus.pipeline.build_corpus(again, log=quiet)
    assert read_docs(again, "val") == val  # the split depends on the text only


def test_corpus_step_does_nothing_when_inputs_are_unchanged_and_rebuilds_when_they_change(tmp_path):
    (tmp_path / "a.txt").write_text("\n\n".join(f"Documento largo número {i}." for i in range(30)))
    cfg = corpus_cfg(tmp_path, [text_source("a", str(tmp_path / "a.txt"))])
    corpus.pipeline.build_corpus(cfg, log=quiet)
    before = os.stat(docs.docs_path(cfg, "train")).st_mtime_ns
    said = []
    corpus.pipeline.build_corpus(cfg, log=said.append)
    assert said == [f"corpus: up to date ({cfg['dir']}/docs_*.jsonl)"]
    assert os.stat(docs.docs_path(cfg, "train")).st_mtime_ns == before
    (tmp_path / "a.txt").write_text("\n\n".join(f"Otro documento largo número {i}." for i in range(30)))
    corpus.pipeline.build_corpus(cfg, log=said.append)
    assert "up to date" not in said[-1]
    assert all(d.startswith("Otro") for d in read_docs(cfg, "train") + read_docs(cfg, "val"))


def test_corpus_errors_name_the_missing_glob_the_unreadable_file_and_the_empty_corpus(tmp_path):
    missing = corpus_cfg(tmp_path, [text_source("nada", str(tmp_path / "nada" / "*.txt"))])
    with pytest.raises(data.DataError, match=r"sources\[0\] \(nada\).path: no file matches .*nada/\*\.txt"):
        corpus.pipeline.build_corpus(missing, log=quiet)
    (tmp_path / "bad.txt.gz").write_bytes(gzip.compress(b"Un texto largo para leer.\n" * 100)[:60])
    unreadable = corpus_cfg(tmp_path, [text_source("bad", str(tmp_path / "bad.txt.gz"))])
    with pytest.raises(data.DataError, match=r"bad.txt.gz: cannot read \(.*\) \[data.corpus.sources\[0\]\]"):
        corpus.pipeline.build_corpus(unreadable, log=quiet)
    (tmp_path / "short.txt").write_text("hola\n\nadiós\n")
    empty = corpus_cfg(tmp_path, [text_source("short", str(tmp_path / "short.txt"))])
    with pytest.raises(data.DataError, match="no document survived .*too_short.: 2"):
        corpus.pipeline.build_corpus(empty, log=quiet)
    assert not os.path.exists(docs.docs_path(empty, "train"))  # nothing half-written left behind


def test_the_tokenizer_info_records_settings_and_the_corpus_hash(pipeline):
    info = json.load(open(os.path.join(pipeline["dir"], "tokenizer_info.json")))
    corpus = json.load(open(data.manifest_path(pipeline)))["corpus"]
    assert info["corpus_sha256"] == corpus["outputs"]["train"]["sha256"]
    assert info["sha256"] == fileio.sha256_of_file(data.tokenizer_path(pipeline))
    settings = info["settings"]
    assert (
        settings["byte_fallback"]
        and settings["split_digits"]
        and settings["normalization_rule_name"] == "identity"
    )
    assert settings["remove_extra_whitespaces"] is False and settings["vocab_size"] == 512


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
        fileio.write_json(data.manifest_path(cfg), manifest)
        corpus.pipeline.encode(cfg, log=quiet)
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
    fileio.write_json(data.manifest_path(cfg), manifest)
    finished = [os.stat(os.path.join(cfg["dir"], s["name"])) for s in kept]
    with open(os.path.join(cfg["dir"], data.shard_name("train", 2)), "r+b") as f:
        f.truncate(1500)  # the shard being written when the run died

    said = []
    corpus.pipeline.encode(cfg, log=said.append)
    assert (
        said[0]
        == "encode: train resuming after 2 finished shards, at document " + f"{kept[-1]['next_document']:,}"
    )
    assert shard_hashes(cfg, "train") == shard_hashes(pipeline, "train")
    for shard, before in zip(kept, finished, strict=True):
        after = os.stat(os.path.join(cfg["dir"], shard["name"]))
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rewritten
    corpus.pipeline.encode(cfg, log=said.append)
    assert said[-2:] == [
        f"encode: train up to date ({len(shard_hashes(pipeline, 'train'))} shard(s) in {cfg['dir']}/)",
        f"encode: val up to date ({len(shard_hashes(pipeline, 'val'))} shard(s) in {cfg['dir']}/)",
    ]


@pytest.mark.skipif(not os.path.exists(NOVELAS), reason="../shared/corpus/novelas-cligs.jsonl.gz not present")
def test_the_stage1_example_reads_its_three_shared_sources_with_their_licences(tmp_path):
    settings = {"max_documents_per_file": 3, "val_fraction": 0.5, "near_dedup": {"enabled": False}}
    cfg = data_layer("corpus", dir=str(tmp_path), processes=1, corpus=settings)
    for source in cfg["corpus"]["sources"]:
        assert source["path"].startswith("../shared/corpus/") and source["licence"]
        source["path"] = os.path.join(ROOT, source["path"])
        source["filters"] = False  # reading is under test here, not the filters
    stats = corpus.pipeline.build_corpus(cfg, log=quiet)
    for source in cfg["corpus"]["sources"]:
        assert stats["sources"][source["name"]]["documents_in"] == 3
        assert stats["sources"][source["name"]]["licence"] == source["licence"]
    assert stats["undecodable"] == 0


# -----------------------------------------------------------------------------
# Command line and scripts (a run file composed by config.py)


SMOKE_RUN = os.path.join(ROOT, "configs", "smoke-cpu.yaml")  # make data-smoke / make smoke
CORPUS_SMOKE_RUN = os.path.join(ROOT, "configs", "smoke-corpus-cpu.yaml")  # make corpus-smoke


def run_corpus_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "corpus", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


def test_make_corpus_smoke_path_builds_shards_a_loader_can_train_on(tmp_path):
    out = tmp_path / "corpus-smoke"
    overrides = [f"data.dir={out}", "data.corpus.max_documents_per_file=20", "data.tokenizer.vocab_size=400"]
    result = run_corpus_cli("all", CORPUS_SMOKE_RUN, *overrides, "model.vocab_size=400")
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
    result = run_corpus_cli("encode", CORPUS_SMOKE_RUN, f"data.dir={tmp_path / 'empty'}")
    assert result.returncode == 2
    assert (
        result.stderr.startswith("error: ") and "run `python -m corpus corpus CONFIG` first" in result.stderr
    )
    assert "Traceback" not in result.stderr
    result = run_corpus_cli("all", SMOKE_RUN, "data.format=shards")
    assert result.returncode == 2 and "data.tokenizer: required key missing" in result.stderr
    assert "Traceback" not in result.stderr


def test_prepare_smoke_data_builds_once_then_does_nothing(tmp_path):
    script = os.path.join(ROOT, "scripts", "prepare_smoke_data.sh")
    out = tmp_path / "smoke"
    first = subprocess.run([script, f"data.dir={out}"], capture_output=True, text=True, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    train, val = (out / "train.bin").read_bytes(), (out / "val.bin").read_bytes()
    assert len(train) + len(val) > 4_300_000 and 0.02 < len(val) / len(train) < 0.1
    assert train.decode("utf-8") and val.decode("utf-8")
    both = (train + val).decode("utf-8")
    assert "Donde hay concordia siempre hay victoria.\n\t\t-- Publio Siro." in both
    assert "Capítulo 1\nEN el principio crió Dios" in both
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    second = subprocess.run([script, f"data.dir={out}"], capture_output=True, text=True, cwd=ROOT)
    assert second.returncode == 0, second.stderr
    assert "up to date" in second.stdout and "encode: train up to date" in second.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps


# -----------------------------------------------------------------------------
# Sources: each reader on the fixtures the project writes itself (tests/fixtures/corpus/write_fixtures.py)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return write_fixtures.write_all(str(tmp_path_factory.mktemp("fixtures")))


def source(name, kind, path, **settings):
    return {
        "name": name,
        "kind": kind,
        "path": path,
        "licence": "test data",
        "filters": False,
        "epochs": 1,
    } | settings


def read_source(src):
    stats = corpus.pipeline.new_source_stats()
    return list(sources.READERS[src["kind"]](src["path"], src, stats)), stats


def test_parquet_is_read_by_row_group_with_fineweb2_metadata(fixtures):
    docs, stats = read_source(source("web", "parquet", f"{fixtures}/fineweb2.parquet", text_field="text"))
    assert [text for text, _ in docs] == write_fixtures.WEB_TEXTS
    assert docs[3][1] == {
        "id": "<urn:uuid:00000003>",
        "url": "https://ejemplo.es/pagina/3",
        "language_score": pytest.approx(0.96),
        "minhash_cluster_size": 12,
    }
    assert stats["bytes_in"] > 0


def test_a_mediawiki_dump_gives_main_namespace_articles_as_plain_text(fixtures):
    docs, stats = read_source(source("wiki", "mediawiki", f"{fixtures}/eswiki.xml.bz2"))
    assert len(docs) == 1 and stats["drops"]["wiki_not_article"] == 3  # redirect, user page, template page
    text, meta = docs[0]
    assert meta == {"id": "Tortilla de patatas"}
    lines = text.split("\n")
    assert lines[0] == "Tortilla de patatas" and "Historia" in lines and "Variantes" in lines  # headings kept
    assert "La tortilla de patatas es una tortilla hecha con huevos y patatas" in text
    for gone in (
        "Ficha",
        "wikitable",
        "Cocina española",
        "Archivo",
        "miniaturadeimagen",
        "Categoría",
        "Sin cebolla",
    ):
        assert gone not in text  # template, table, reference, file and category dropped


def test_zstd_jsonl_is_read(fixtures):
    docs, _ = read_source(source("notas", "jsonl", f"{fixtures}/notas.jsonl.zst", text_field="texto"))
    assert [text for text, _ in docs] == write_fixtures.PII_NOTES and docs[0][1] == {"id": 0}


def test_corrupt_or_wrong_inputs_are_refused_naming_the_file_and_the_problem(tmp_path, fixtures):
    bad_parquet = tmp_path / "rota.parquet"
    bad_parquet.write_bytes(open(f"{fixtures}/fineweb2.parquet", "rb").read()[:300])
    not_wiki = tmp_path / "pagina.xml.bz2"
    not_wiki.write_bytes(bz2.compress(b"<html><body>hola</body></html>"))
    broken_xml = tmp_path / "cortado.xml.bz2"
    broken_xml.write_bytes(bz2.compress(b'<mediawiki xmlns="x"><page><title>A</ti'))
    bad_zst = tmp_path / "rota.jsonl.zst"
    bad_zst.write_bytes(open(f"{fixtures}/notas.jsonl.zst", "rb").read()[:200])  # cut inside the frame
    cases = [
        (
            source("p", "parquet", str(bad_parquet), text_field="text"),
            r"rota.parquet: not a readable parquet file",
        ),
        (
            source("p", "parquet", f"{fixtures}/fineweb2.parquet", text_field="contenido"),
            r"fineweb2.parquet: no column 'contenido' \(text_field of source p\); the file has text, id",
        ),
        (
            source("w", "mediawiki", str(not_wiki)),
            r"pagina.xml.bz2: not a MediaWiki XML dump \(root element <html>\)",
        ),
        (source("w", "mediawiki", str(broken_xml)), r"cortado.xml.bz2: not well-formed MediaWiki XML"),
        (
            source("z", "jsonl", str(bad_zst), text_field="t"),
            r"rota.jsonl.zst: cannot read .*\[data.corpus.sources\[0\]\]",
        ),
    ]
    for src, message in cases:
        cfg = corpus_cfg(tmp_path, [src])
        cfg["dir"] = str(tmp_path / f"out-{src['name']}-{cases.index((src, message))}")
        with pytest.raises(data.DataError, match=message):
            corpus.pipeline.build_corpus(cfg, log=quiet)
        assert not os.path.exists(docs.docs_path(cfg, "train"))


def damaged_sources(folder, fixtures):
    """A file of each kind the corpus step reads, damaged as files get: cut short, or garbage inside."""
    text = "\n\n".join(f"Documento {i}: " + " ".join(str(i * j) for j in range(60)) for i in range(300))
    (folder / "cortado.txt.gz").write_bytes(gzip.compress(text.encode())[:2000])
    (folder / "cortado.txt.bz2").write_bytes(bz2.compress(text.encode())[:2000])
    (folder / "cortado.jsonl.zst").write_bytes(open(f"{fixtures}/notas.jsonl.zst", "rb").read()[:200])
    (folder / "basura.jsonl.zst").write_bytes(
        b"\x28\xb5\x2f\xfd" + bytes(range(256)) * 2
    )  # frame header, garbage
    (folder / "rota.parquet").write_bytes(open(f"{fixtures}/fineweb2.parquet", "rb").read()[:300])
    (folder / "cortado.xml.bz2").write_bytes(bz2.compress(b'<mediawiki xmlns="x"><page><title>A</ti'))
    return [
        source("gz", "text", str(folder / "cortado.txt.gz"), documents="blank_line"),
        source("bz2", "text", str(folder / "cortado.txt.bz2"), documents="blank_line"),
        source("zst", "jsonl", str(folder / "cortado.jsonl.zst"), text_field="texto"),
        source("basura", "jsonl", str(folder / "basura.jsonl.zst"), text_field="texto"),
        source("parquet", "parquet", str(folder / "rota.parquet"), text_field="text"),
        source("xml", "mediawiki", str(folder / "cortado.xml.bz2")),
    ]


def test_an_unreadable_source_of_any_kind_is_one_line_naming_it_and_its_traceback_stays_in_the_log(
    tmp_path, fixtures, capfd
):
    for src in damaged_sources(tmp_path, fixtures):
        cfg = corpus_cfg(tmp_path, [src])
        cfg["dir"] = str(tmp_path / f"out-{src['name']}")
        with pytest.raises(data.DataError) as error:
            corpus.pipeline.build_corpus(cfg, log=print)
        assert str(error.value).startswith(src["path"] + ": "), str(error.value)
        terminal = capfd.readouterr()
        assert "Traceback" not in terminal.err + terminal.out and "datatrove" not in terminal.err, terminal
        workdir = glob.glob(os.path.join(cfg["dir"], "work", "*"))[0]
        task_log = open(os.path.join(workdir, "logs", "logs", "task_00000.log"), encoding="utf-8").read()
        assert "Traceback" in task_log and os.path.basename(src["path"]) in task_log
        assert not os.path.exists(docs.docs_path(cfg, "train"))


def test_the_command_line_names_a_damaged_zstd_file_in_one_line_whatever_the_number_of_tasks(
    tmp_path, fixtures
):
    broken = damaged_sources(tmp_path, fixtures)[3]  # zstandard's own error, which is no OSError
    cfg = corpus_cfg(tmp_path, [broken])
    overrides = [
        f"data.dir={tmp_path / 'out'}",
        "data.processes=2",
        f"data.corpus={json.dumps(cfg['corpus'])}",
    ]
    result = run_corpus_cli("corpus", CORPUS_SMOKE_RUN, *overrides)
    assert result.returncode == 2
    lines = [
        line for line in result.stderr.splitlines() if line.strip() and not line.startswith("filter task")
    ]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: {broken['path']}: cannot read (zstd decompressor error: ")
    assert lines[0].endswith(") [data.corpus.sources[0]]")
    assert "Traceback" not in result.stdout + result.stderr


def test_files_a_killed_task_was_writing_are_removed_by_the_next_run(tmp_path):
    cfg = corpus_cfg(tmp_path, [text_source("t", sample_text(tmp_path))])
    workdir = os.path.join(cfg["dir"], "work", corpus.pipeline.filter_fingerprint(cfg)[:16])
    os.makedirs(workdir)
    left = [
        os.path.join(workdir, name) for name in (".kept_00000.jsonl.4242.tmp", ".keys_00000.npy.4242.tmp")
    ]
    for path in left:
        open(path, "wb").write(b'{"i": 0, "text": "a medio escribir')
    corpus.pipeline.build_corpus(cfg, log=quiet)
    assert not glob.glob(os.path.join(workdir, ".*.tmp")) and os.listdir(workdir)


def sample_text(tmp_path):
    (tmp_path / "t.txt").write_text("\n\n".join(f"Un documento de prueba, el número {i}." for i in range(40)))
    return str(tmp_path / "t.txt")


def test_a_source_without_a_licence_and_a_missing_eval_file_are_refused(tmp_path):
    run = os.path.join(ROOT, "configs", "smoke-corpus-cpu.yaml")
    with pytest.raises(config.ConfigError, match=r"data.corpus.sources.0.*licence"):
        config.load(
            run,
            [
                "data.corpus.sources=[{name: x, kind: text, path: a.txt, documents: file, filters: false, epochs: 1}]"
            ],
        )
    cfg = corpus_cfg(tmp_path, [text_source("a", str(tmp_path / "a.txt"))])
    (tmp_path / "a.txt").write_text("Un documento cualquiera de prueba.")
    cfg["corpus"]["decontamination"]["eval_files"] = [str(tmp_path / "no-existe.txt")]
    with pytest.raises(
        data.DataError, match=r"decontamination.eval_files\[0\]: .*no-existe.txt: file not found"
    ):
        corpus.pipeline.build_corpus(cfg, log=quiet)


# -----------------------------------------------------------------------------
# Filters: keep and drop on hand-made documents


SPANISH = (
    "La biblioteca del barrio abre sus puertas todos los días a las nueve de la mañana. En la sala principal hay "
    "mesas largas para estudiar, un rincón con cuentos para los más pequeños y una hemeroteca con la prensa del "
    "día. Los vecinos pueden llevarse a casa hasta cinco libros durante dos semanas, y las bibliotecarias "
    "organizan cada jueves un club de lectura en el que se comentan novelas de autores de la región."
)
OTHER_LANGUAGES = {
    "pt": "A biblioteca do bairro abre as suas portas todos os dias às nove da manhã. Na sala principal há mesas "
    "compridas para estudar, um canto com contos para os mais pequenos e uma hemeroteca com a imprensa do dia.",
    "ca": "La biblioteca del barri obre les seves portes cada dia a les nou del matí. A la sala principal hi ha "
    "taules llargues per estudiar, un racó amb contes per als més petits i una hemeroteca amb la premsa del dia.",
    "it": "La biblioteca del quartiere apre le sue porte tutti i giorni alle nove del mattino. Nella sala "
    "principale ci sono tavoli lunghi per studiare, un angolo con fiabe per i più piccoli e un'emeroteca.",
}


def stage_cfg():
    return data_layer("corpus-smoke")["corpus"]


def test_language_id_keeps_spanish_and_drops_portuguese_catalan_and_italian():
    stage = filters.LanguageStage(stage_cfg()["filters"]["language"])
    doc = filters.document(SPANISH)
    assert stage(doc) == (True, None) and doc.metadata["language_score"] > 0.9
    for language, text in OTHER_LANGUAGES.items():
        assert stage(filters.document(text)) == (False, f"language_{language}")


def test_fineweb2_quality_filters_keep_prose_and_drop_repetition_lists_and_foreign_words():
    stages = {stage.name: stage for stage in filters.quality_stages(stage_cfg()["filters"])}
    assert list(stages) == ["gopher_repetition", "fineweb_quality", "gopher_quality"]
    for stage in stages.values():
        assert stage(filters.document(SPANISH)) == (True, None), stage.name
    repeated = "\n".join(["¡Oferta especial en zapatillas de deporte!"] * 6 + [SPANISH])
    assert stages["gopher_repetition"](filters.document(repeated)) == (
        False,
        "gopher_repetition:dup_line_frac",
    )
    menu = "\n".join(f"Inicio de la sección número {i} del menú principal" for i in range(30))
    assert stages["fineweb_quality"](filters.document(menu)) == (
        False,
        "fineweb_quality:line_punct_ratio",
    )
    english = (
        "Our neighbourhood library opens its doors every day at nine in the morning. The main room has long "
        "tables for studying, a corner with stories for children and a newspaper library with daily papers. "
    ) * 2
    assert stages["gopher_quality"](filters.document(english)) == (
        False,
        "gopher_quality:gopher_enough_stop_words",
    )


def test_the_default_filters_give_fineweb2s_verdict_on_every_document_of_the_mixed_sample():
    from bench import data as bench_data

    embedded = [
        source for source in bench_data.SAMPLE_SOURCES if os.path.dirname(source[1]) == f"{ROOT}/corpus"
    ]
    cfg = data_layer("corpus")["corpus"]  # the stage-1 example, with the shipped defaults
    sample = bench_data.fidelity_sample(16, cfg["min_chars"], embedded)
    assert {name for name, _ in sample} == {"rv1909", "fortunes-es", "técnico", "diálogo"} and len(
        sample
    ) > 50
    reference = bench_data.fineweb2_reference()  # FineWeb-2's own filters, built as its pipeline builds them
    agreement, kept, kept_by_fineweb2, _ = bench_data.filter_agreement(
        sample, filters.quality_stages(cfg["filters"]), reference
    )
    assert all(same == count for same, count in agreement.values()), agreement
    assert 0 < kept == kept_by_fineweb2 < len(sample)  # the sample has documents of both verdicts


def test_the_regex_word_split_is_an_option_that_splits_technical_text_finer_than_fineweb2s():
    assert data_layer("corpus")["corpus"]["filters"]["word_tokenizer"] == "spacy"
    regex = filters.RegexWords()
    from datatrove.utils.word_tokenizers import load_word_tokenizer

    fineweb2 = load_word_tokenizer(filters.word_splitter("spacy"))
    text = "Véase less(1), p. ej. en /etc."
    assert len(regex.word_tokenize(text)) > len(fineweb2.word_tokenize(text))


def test_pii_is_replaced_only_where_the_check_digits_hold(fixtures):
    scrub = filters.PiiScrubber(stage_cfg()["pii"])
    first, found = scrub(write_fixtures.PII_NOTES[0])
    assert found == {"email": 1, "phone": 1, "ip": 1}
    assert (
        "correo@ejemplo.com" in first and "192.168.1.1" in first and "8.8.8.8" not in first
    )  # private IP stays
    second, found = scrub(write_fixtures.PII_NOTES[1])
    assert found == {"dni": 1, "nie": 1, "iban": 1}
    assert "12345678A" in second and "ES91 2100 0418 4502 0005 1333" in second  # wrong check letter / digits
    assert "12345678Z" not in second and "X1234567L" not in second and "1332 " not in second
    third, found = scrub(write_fixtures.PII_NOTES[2])
    assert found == {"phone": 1} and "123 456 789" in third  # not a Spanish number


def genesis_chapters(count):
    bible = gzip.open(os.path.join(ROOT, "corpus", "rv1909.txt.gz")).read().decode("utf-8")
    books = [block for block in bible.split("\n\n") if block.startswith("Capítulo")]
    chapters = [
        c if c.startswith("Capítulo") else "Capítulo " + c for b in books for c in b.split("\nCapítulo ")
    ]
    return chapters[:count]


def test_near_duplicates_are_removed_and_counted_unrelated_documents_kept(tmp_path):
    chapters = genesis_chapters(12)
    edited = chapters[2].replace("Dios", "el Señor", 2).replace(".", ";", 3) + " Y así fué."
    (tmp_path / "a.txt").write_text("\n\n".join(chapters + [edited]))
    cfg = corpus_cfg(
        tmp_path, [text_source("biblia", str(tmp_path / "a.txt"))], near_dedup=True, val_fraction=0.2
    )
    stats = corpus.pipeline.build_corpus(cfg, log=quiet)
    assert stats["sources"]["biblia"]["drops"]["near_duplicate"] == 1
    stage = stats["sources"]["biblia"]["stages"]["near_dedup"]
    assert (stage["documents_in"], stage["documents_out"]) == (13, 12)
    assert stats["cluster_sizes"] == {"1": 11, "2": 1}
    assert edited not in read_docs(cfg, "train") + read_docs(cfg, "val")


def proverb_documents(count):
    """Documents of 6 proverbs each: Spanish, distinct, sharing few 13-grams."""
    fortunes = (
        gzip.open(os.path.join(ROOT, "corpus", "fortunes-es.txt.gz")).read().decode("utf-8").split("\n\n")
    )
    return [" ".join(fortunes[i : i + 6]) for i in range(0, 6 * count, 6)]


def in_train(text, val_fraction):
    """The text, with a suffix if needed so that it lands in the train split."""
    suffix = 0
    while corpus.pipeline.split_of(f"{text} ({suffix})", val_fraction) != "train":
        suffix += 1
    return f"{text} ({suffix})"


def test_train_documents_sharing_a_13_gram_with_an_eval_file_or_copying_val_are_dropped(tmp_path):
    chapters = proverb_documents(40)
    cfg = corpus_cfg(tmp_path, [text_source("refranes", str(tmp_path / "a.txt"))], val_fraction=0.2)
    val_chapter = next(c for c in chapters if corpus.pipeline.split_of(c, 0.2) == "val")
    train_chapters = [c for c in chapters if corpus.pipeline.split_of(c, 0.2) == "train"]
    words = re.findall(r"\w+", train_chapters[0])
    (tmp_path / "eval.txt").write_text(f"Pregunta: ¿quién dijo «{' '.join(words[10:23])}»?\n")  # 13 words
    near_miss = in_train("Otro texto distinto. " + " ".join(words[10:22]) + " y nada más que decir.", 0.2)
    val_words = re.findall(r"\w+", val_chapter)
    copied = in_train("Refranes de la abuela: " + " ".join(val_words[8:]), 0.2)  # val minus its first 8 words
    borrowed = in_train(train_chapters[1] + " " + " ".join(val_words[5:18]), 0.2)  # one 13-gram of val
    (tmp_path / "a.txt").write_text("\n\n".join(chapters + [near_miss, copied, borrowed]))
    cfg["corpus"]["decontamination"]["eval_files"] = [str(tmp_path / "eval.txt")]
    stats = corpus.pipeline.build_corpus(cfg, log=quiet)
    train = read_docs(cfg, "train")
    assert train_chapters[0] not in train and near_miss in train  # any 13-gram of an eval file; 12 are fine
    assert copied not in train and borrowed in train  # a near-copy of val goes; one shared phrase does not
    assert stats["decontamination"] == {str(tmp_path / "eval.txt"): 1, "val": 1}
    assert drops(stats, "refranes") == {"contaminated": 2}


# -----------------------------------------------------------------------------
# Mixture, executor tasks, resume


def test_encode_realises_the_source_weights_within_one_percent_of_the_tokens(tmp_path):
    fortunes = (
        gzip.open(os.path.join(ROOT, "corpus", "fortunes-es.txt.gz")).read().decode("utf-8").split("\n\n")
    )
    (tmp_path / "f.txt").write_text("\n\n".join(fortunes[:1500]))
    (tmp_path / "b.txt").write_text("\n\n".join(genesis_chapters(50)))
    sources = [
        text_source("refranes", str(tmp_path / "f.txt"), weight=0.7, epochs=None),
        text_source("biblia", str(tmp_path / "b.txt"), weight=0.3, epochs=None),
    ]
    for s in sources:
        del s["epochs"]
    cfg = corpus_cfg(tmp_path, sources, val_fraction=0.05)
    cfg["tokenizer"]["vocab_size"] = 512
    cfg["encode"]["tokens_per_shard"] = 20_000
    corpus.pipeline.build_corpus(cfg, log=quiet)
    corpus.pipeline.train_tokenizer(cfg, log=quiet)
    corpus.pipeline.encode(cfg, log=quiet)
    mixture = json.load(open(data.manifest_path(cfg)))["encode"]["train"]["mixture"]
    total = sum(m["tokens"] for m in mixture.values())
    assert abs(mixture["refranes"]["tokens"] / total - 0.7) < 0.01
    assert abs(mixture["biblia"]["tokens"] / total - 0.3) < 0.01
    assert mixture["refranes"]["epochs"] > 1 > mixture["biblia"]["epochs"]  # upsampled / subsampled
    assert len(mixture["refranes"]["tokens_per_epoch"]) == 2
    assert data.load_split_tokens(cfg, "train").size == total  # the shards hold exactly the plan
    cfg["corpus"]["mixture"]["max_epochs"] = 1.2
    with pytest.raises(
        data.DataError, match=r"sources\[0\] \(refranes\): the mixture needs 1.\d+ epochs .* max_epochs 1.2"
    ):
        corpus.pipeline.encode(cfg, log=quiet)


def bible_cfg(tmp_path, name, **executor):
    (tmp_path / "b.txt").write_text("\n\n".join(genesis_chapters(40)))
    cfg = corpus_cfg(
        tmp_path, [text_source("biblia", str(tmp_path / "b.txt"), filters=True)], near_dedup=True
    )
    cfg["dir"] = str(tmp_path / name)
    cfg["corpus"]["executor"].update(executor)
    return cfg


def test_several_executor_tasks_give_the_same_corpus_as_one(tmp_path):
    one = bible_cfg(tmp_path, "one", tasks=1)
    three = bible_cfg(tmp_path, "three", tasks=3)
    three["processes"] = 2  # datatrove's local executor runs the 3 tasks on 2 worker processes
    first, second = (
        corpus.pipeline.build_corpus(one, log=quiet),
        corpus.pipeline.build_corpus(three, log=quiet),
    )
    for split in data.SPLITS:
        assert (
            open(docs.docs_path(one, split), "rb").read() == open(docs.docs_path(three, split), "rb").read()
        )
    assert first["sources"] == second["sources"] and first["documents_out"] > 10


def test_a_killed_corpus_step_resumes_with_its_finished_tasks(tmp_path):
    reference = bible_cfg(tmp_path, "reference", tasks=1)
    corpus.pipeline.build_corpus(reference, log=quiet)
    run = os.path.join(ROOT, "configs", "smoke-corpus-cpu.yaml")
    cfg = bible_cfg(tmp_path, "killed", tasks=4)
    overrides = [f"data.dir={cfg['dir']}", "data.processes=1", f"data.corpus={json.dumps(cfg['corpus'])}"]
    command = [sys.executable, "-m", "corpus", "corpus", run, *overrides]
    proc = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.DEVNULL, start_new_session=True)
    workdirs = os.path.join(cfg["dir"], "work")
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if glob.glob(os.path.join(workdirs, "*", "stats_00001.json")):
                break
            time.sleep(0.02)
    finally:  # SIGKILL to the whole process group (datatrove's manager too) after two of four tasks
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not os.path.exists(docs.docs_path(cfg, "train"))  # nothing a later step would trust
    said = []
    corpus.pipeline.build_corpus(cfg, log=said.append)
    resumed = re.search(r"4 filter task\(s\) on the local executor, (\d) already finished", said[0])
    assert resumed and int(resumed.group(1)) >= 2  # the finished tasks are not redone
    for split in data.SPLITS:
        assert read_docs(cfg, split) == read_docs(reference, split)
    cfg["corpus"]["decontamination"]["val_max_overlap"] = 0.5  # merging again needs no filtering again
    corpus.pipeline.build_corpus(cfg, log=said.append)
    assert "4 filter task(s) on the local executor, 4 already finished" in said[-2]


def test_a_resume_with_another_number_of_tasks_filters_again_instead_of_reusing_another_partition(tmp_path):
    reference = bible_cfg(tmp_path, "reference", tasks=1)
    corpus.pipeline.build_corpus(reference, log=quiet)
    cfg = bible_cfg(tmp_path, "resumed", tasks=4)
    corpus.pipeline.build_corpus(cfg, log=quiet)
    os.remove(docs.docs_path(cfg, "train"))  # as if killed after the filter tasks, before the merge
    cfg["corpus"]["executor"]["tasks"] = 2
    said = []
    corpus.pipeline.build_corpus(cfg, log=said.append)
    assert "2 filter task(s) on the local executor, 0 already finished" in said[0]
    for split in data.SPLITS:
        assert read_docs(cfg, split) == read_docs(reference, split)


def test_the_report_shows_sources_drops_and_plots_of_a_built_corpus(pipeline, tmp_path):
    cfg = copy.deepcopy(pipeline) | {"dir": str(tmp_path / "report")}
    shutil.copytree(pipeline["dir"], cfg["dir"])
    path = corpus.pipeline.report(cfg, log=quiet)
    text = open(path, encoding="utf-8").read()
    for heading in ("## Sources", "## Drop reasons", "## Personal data replaced", "## Decontamination"):
        assert heading in text
    assert "| sample | text | test data |" in text  # the source with its licence
    assert re.search(r"\| all \| [\d,]+ \| [\d,]+ \| \d\.\d\d \|", text)  # characters per token on val
    for png in ("funnel", "drops", "lengths", "clusters", "language"):
        assert open(os.path.join(cfg["dir"], "report", f"{png}.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_source_runs_only_the_filter_stages_it_lists(tmp_path):
    repeated = "\n".join(["¡Oferta especial en zapatillas de deporte!"] * 6 + [SPANISH])
    (tmp_path / "a.txt").write_text("\n\n".join([*proverb_documents(20), repeated, OTHER_LANGUAGES["pt"]]))
    only_language = text_source("a", str(tmp_path / "a.txt"), filters=["language"])
    cfg = corpus_cfg(tmp_path, [only_language], val_fraction=0.2)
    stats = corpus.pipeline.build_corpus(cfg, log=quiet)
    assert drops(stats, "a") == {"language_pt": 1}  # the repetition filter did not run
    assert set(stats["sources"]["a"]["stages"]) == {
        "min_chars",
        "language",
        "exact_dedup",
        "near_dedup",
        "decontamination",
    }


def test_the_slurm_example_builds_datatrove_slurm_executor_with_its_settings(tmp_path):
    cfg = data_layer("corpus-slurm", dir=str(tmp_path))  # schema-checked
    executor, tasks = corpus.pipeline.executor_for(
        corpus.pipeline.FilterTask(cfg, str(tmp_path)), cfg, str(tmp_path)
    )
    assert type(executor).__name__ == "SlurmPipelineExecutor" and tasks == executor.world_size == 64
    assert (executor.partition, executor.time, executor.mem_per_cpu_gb) == ("cpu", "02:00:00", 4)


def test_the_ray_example_builds_datatrove_ray_executor_with_its_settings(tmp_path):
    cfg = data_layer("corpus-ray", dir=str(tmp_path))  # schema-checked
    executor, tasks = corpus.pipeline.executor_for(
        corpus.pipeline.FilterTask(cfg, str(tmp_path)), cfg, str(tmp_path)
    )
    assert type(executor).__name__ == "RayPipelineExecutor" and tasks == executor.world_size == 64
    assert (executor.cpus_per_task, executor.mem_per_cpu_gb, executor.time) == (1, 4, 7200)


needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="ray is not installed (requirements-dev.txt pins it)"
)


def smoke_cfg(tmp_path, name, **executor):
    """The embedded smoke corpus and fixtures, its first documents only (the Ray instance takes seconds)."""
    return data_layer(
        "corpus-smoke",
        dir=str(tmp_path / name),
        processes=2,
        corpus={"max_documents_per_file": 1500, "executor": executor},
    )


@needs_ray
def test_the_ray_executor_on_a_local_instance_gives_the_same_corpus_as_the_local_executor(tmp_path):
    import ray

    local = smoke_cfg(tmp_path, "local", kind="local", tasks=2)
    on_ray = smoke_cfg(tmp_path, "ray", kind="ray", tasks=2)
    said = []
    first, second = (
        corpus.pipeline.build_corpus(local, log=quiet),
        corpus.pipeline.build_corpus(on_ray, log=said.append),
    )
    assert not ray.is_initialized()  # the local instance was stopped
    assert "2 filter task(s) on the ray executor, 0 already finished" in said[0]
    for split in data.SPLITS:
        assert read_docs(on_ray, split) == read_docs(local, split)
    assert second["sources"] == first["sources"] and len(second["sources"]) == 5
    assert sum(s["documents_in"] for s in second["sources"].values()) == first["documents_in"] > 1000
    assert second == first
    assert corpus.pipeline.build_corpus(on_ray, log=said.append) == first and "up to date" in said[-1]


@needs_ray
def test_ray_errors_name_the_unreachable_address_the_failing_file_and_the_oversized_task(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = smoke_cfg(tmp_path, "out", kind="ray", tasks=2)
    cfg["corpus"]["executor"]["ray"]["address"] = f"127.0.0.1:{port}"
    with pytest.raises(data.DataError, match=rf"data.corpus.executor.ray.address: 127.0.0.1:{port}: no Ray"):
        corpus.pipeline.build_corpus(cfg, log=quiet)
    (tmp_path / "bad.txt.gz").write_bytes(gzip.compress(b"Un texto largo para leer.\n" * 100)[:60])
    cfg["corpus"]["sources"] = [text_source("bad", str(tmp_path / "bad.txt.gz"))]
    cfg["corpus"]["executor"]["ray"]["address"] = None
    with pytest.raises(data.DataError, match=r"bad.txt.gz: cannot read \(.*\) \[data.corpus.sources\[0\]\]"):
        corpus.pipeline.build_corpus(cfg, log=quiet)  # a task's error, not "submitted, run again"
    assert not os.path.exists(docs.docs_path(cfg, "train"))
    cfg["corpus"]["executor"]["ray"]["mem_per_cpu_gb"] = 10**6  # no node holds it: it would wait forever
    with pytest.raises(data.DataError, match=r"data.corpus.executor.ray: a task needs .* = 1e\+06 GB"):
        corpus.pipeline.build_corpus(cfg, log=quiet)


def test_chars_per_token_counts_every_character_of_every_line_against_the_tokens_of_the_run(
    pipeline, tmp_path, capsys
):
    lines = ["El año 1492 llegó la noticia.", "", "Hubo 31.416 asistentes según la organización."]
    text_file = tmp_path / "flores.txt"
    text_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokenizer = data.load_tokenizer(pipeline)
    tokens = sum(len(tokenizer.encode(line)) for line in lines if line)
    assert corpus.pipeline.main(["chars-per-token", data.tokenizer_path(pipeline), str(text_file)]) == 0
    out = capsys.readouterr().out
    chars = sum(len(line) for line in lines)
    assert f"{chars:,} chars, {tokens:,} tokens, {chars / tokens:.3f} chars/token" in out
    assert tokens >= len("1492") + len("31416")  # split_digits: true in the smoke layer, one token per digit
    assert (
        corpus.pipeline.main(["chars-per-token", data.tokenizer_path(pipeline), str(tmp_path / "nada.txt")])
        == 2
    )
    assert "nada.txt: cannot read (No such file or directory)" in capsys.readouterr().err
