"""Hub sources (corpus/hub.py) against a stand-in for the Hugging Face Hub on 127.0.0.1 (tests/hub_standin.py):
what is fetched and checked, a kill and a resume, corrupt files, the disk-space check, errors, the token, and
the whole path from the Hub to a few training steps."""

import copy
import glob
import gzip
import io
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import ROOT, TINY
from hub_standin import COMMIT, FakeHub
from users_shell import users_env

import config
import corpus.hub
from corpus import pipeline, sources

FINEWEB = "HuggingFaceFW/fineweb-2"
WIKI = "wikimedia/wikipedia"
WIKISOURCE = "wikimedia/wikisource"
TOKEN = "hf_standin_secret_token_123"


def bible_documents():
    text = gzip.open(os.path.join(ROOT, "corpus", "rv1909.txt.gz")).read().decode("utf-8")
    return [doc[:3000] for doc in text.split("\n\n") if len(doc) > 1500]


def parquet_bytes(rows):
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink, row_group_size=8)
    return sink.getvalue()


def fineweb2_file(texts, shard):
    """FineWeb-2's columns, as in data/spa_Latn/train/*.parquet."""
    return parquet_bytes(
        [
            {
                "text": text,
                "id": f"<urn:uuid:{shard:04d}-{i:08d}>",
                "dump": "CC-MAIN-2024-10",
                "url": f"https://ejemplo.es/{shard}/{i}",
                "date": "2024-02-20T12:00:00Z",
                "file_path": "s3://commoncrawl/crawl-data/CC-MAIN-2024-10/segments/x/warc/y.warc.gz",
                "language": "spa",
                "language_score": 0.98,
                "language_script": "Latn",
                "minhash_cluster_size": 1,
                "top_langs": '{"spa_Latn_score": 0.98}',
            }
            for i, text in enumerate(texts)
        ]
    )


def wikipedia_file(texts):
    """wikimedia/wikipedia's columns (id, url, title, text), as in 20231101.es/train-*.parquet."""
    return parquet_bytes(
        [
            {
                "id": str(i),
                "url": f"https://es.wikipedia.org/wiki?curid={i}",
                "title": text.split("\n")[0],
                "text": text,
            }
            for i, text in enumerate(texts)
        ]
    )


@pytest.fixture(scope="module")
def datasets():
    docs = bible_documents()
    fineweb = {
        f"data/spa_Latn/train/000_{n:05d}.parquet": fineweb2_file(docs[n * 12 : n * 12 + 12], n)
        for n in range(3)
    }
    fineweb["data/spa_Latn/test/000_00000.parquet"] = fineweb2_file(docs[40:42], 9)
    fineweb["README.md"] = b"# FineWeb2\n"
    wiki = {
        "20231101.es/train-00000-of-00002.parquet": wikipedia_file(docs[50:62]),
        "20231101.es/train-00001-of-00002.parquet": wikipedia_file(docs[62:74]),
        "20231101.eu/train-00000-of-00001.parquet": wikipedia_file(docs[80:82]),
    }
    wikisource = {"20231201.es/train-00000-of-00001.parquet": wikipedia_file(docs[90:96])}  # same columns
    return {FINEWEB: fineweb, WIKI: wiki, WIKISOURCE: wikisource}


@pytest.fixture
def hub(datasets):
    fake = FakeHub()
    fake.add(FINEWEB, datasets[FINEWEB], licence="odc-by")
    fake.add(WIKI, datasets[WIKI], licence="cc-by-sa-3.0")
    fake.add(WIKISOURCE, datasets[WIKISOURCE], licence="cc-by-sa-3.0")
    fake.url = fake.start()
    yield fake
    fake.stop()


def hub_source(name, repo, files, local_dir, **hub):
    return {
        "name": name,
        "kind": "parquet",
        "path": os.path.join(local_dir, files),
        "text_field": "text",
        "licence": "test licence of " + name,
        "filters": False,
        "weight": 1.0,
        "hub": {"repo": repo, "revision": "main", "files": files, "local_dir": str(local_dir)} | hub,
    }


def run_file(tmp_path, sources, **data):
    """A resolved run file (every layer written out): the smoke-corpus run on these sources."""
    cfg = config.load(
        os.path.join(ROOT, "configs", "smoke-corpus-cpu.yaml"),
        [*TINY, "model.vocab_size=400", "data.tokenizer.vocab_size=400"],
    )
    cfg["data"] = copy.deepcopy(cfg["data"]) | data
    cfg["data"]["corpus"]["sources"] = sources
    cfg["data"]["tokenizer"]["vocab_size"] = 400
    cfg["data"]["processes"] = 1
    cfg["train"]["runs_dir"] = str(tmp_path / "runs")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, allow_unicode=True, sort_keys=False), encoding="utf-8")
    return str(path)


def hub_env(hub, tmp_path, **extra):
    env = os.environ | {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf-home")}
    env.pop("HF_TOKEN", None)
    return env | {"HF_HUB_DISABLE_TELEMETRY": "1"} | extra


@pytest.fixture
def online(hub, monkeypatch):
    """This process talks to the stand-in (conftest keeps the Hugging Face libraries offline elsewhere)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return hub


def corpus_command(step, run, capsys):
    """`python -m corpus STEP RUN` in this process: (exit status, stdout, last line of stderr)."""
    status = pipeline.main([step, run])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return status, out, (err.strip().splitlines() or [""])[-1]


def recorded(local_dir):
    with open(os.path.join(local_dir, "hub_files.json"), encoding="utf-8") as f:
        return json.load(f)


def finished_files(local_dir):
    try:
        return recorded(local_dir)["files"]
    except (OSError, ValueError, KeyError):
        return []


def train_files(datasets):
    return sorted(p for p in datasets[FINEWEB] if p.startswith("data/spa_Latn/train/"))


def test_download_takes_the_glob_in_name_order_up_to_max_bytes_and_records_commit_and_licences(
    online, datasets, tmp_path, capsys
):
    train = train_files(datasets)
    two_files = len(datasets[FINEWEB][train[0]]) + len(datasets[FINEWEB][train[1]])
    local = tmp_path / "hub" / "fineweb-2"
    sources = [
        hub_source("fineweb2", FINEWEB, "data/spa_Latn/train/*.parquet", local, max_bytes=two_files + 10),
        hub_source("wiki", WIKI, "20231101.es/*.parquet", tmp_path / "hub" / "wikipedia", max_files=1),
    ]
    status, out, err = corpus_command("download", run_file(tmp_path, sources), capsys)
    assert status == 0, err
    for path in train[:2]:
        assert (local / path).read_bytes() == datasets[FINEWEB][path]
    assert not (local / train[2]).exists()  # past max_bytes
    assert not (local / "data/spa_Latn/test").exists()  # not in the glob
    assert not (local / "README.md").exists()
    assert (tmp_path / "hub/wikipedia/20231101.es/train-00000-of-00002.parquet").exists()
    assert not (tmp_path / "hub/wikipedia/20231101.es/train-00001-of-00002.parquet").exists()  # max_files
    record = recorded(local)
    assert record["sources"]["fineweb2"]["commit"] == COMMIT
    assert record["sources"]["fineweb2"]["licence"] == "test licence of fineweb2"
    assert record["sources"]["fineweb2"]["licence_on_hub"] == "odc-by"
    assert sorted(record["files"]) == train[:2]
    assert "fineweb2: HuggingFaceFW/fineweb-2@0123456789ab, 2 file(s)" in out

    status, out, err = corpus_command("download", run_file(tmp_path, sources), capsys)
    assert status == 0, err
    assert "up to date" in out
    assert all(online.lfs_gets(path) == 1 for path in train[:2])


def test_a_download_killed_half_way_resumes_without_fetching_the_finished_files_again(
    online, datasets, tmp_path, capsys
):
    train = train_files(datasets)
    local = tmp_path / "hub"
    run = run_file(tmp_path, [hub_source("fineweb2", FINEWEB, "data/spa_Latn/train/*.parquet", local)])
    run_cfg = yaml.safe_load(open(run))
    run_cfg["data"]["corpus"]["download"]["workers"] = 1  # in name order: the first file finishes first
    open(run, "w").write(yaml.safe_dump(run_cfg, allow_unicode=True))
    online.hang = train[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "corpus", "download", run], cwd=ROOT, env=hub_env(online, tmp_path),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert online.hanging.wait(120), "the second file was never asked for"
        # The first file is recorded once written, which on a busy CPU can come after the second is asked for.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not finished_files(local):
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    online.release.set()
    assert sorted(recorded(local)["files"]) == train[:1]
    assert not (local / train[1]).exists()  # half a file never takes the file's name

    online.hang = None
    status, _, err = corpus_command("download", run, capsys)
    assert status == 0, err
    assert online.lfs_gets(train[0]) == 1  # finished before the kill: not fetched again
    assert online.lfs_gets(train[2]) == 1
    for path in train:
        assert (local / path).read_bytes() == datasets[FINEWEB][path]


def test_a_corrupt_download_is_fetched_again_and_a_file_corrupt_twice_is_named(
    online, datasets, tmp_path, capsys
):
    train = train_files(datasets)
    local = tmp_path / "hub"
    run = run_file(
        tmp_path, [hub_source("fineweb2", FINEWEB, "data/spa_Latn/train/*.parquet", local, max_files=2)]
    )
    online.corrupt[train[0]] = 1
    status, _, err = corpus_command("download", run, capsys)
    assert status == 0, err
    assert online.lfs_gets(train[0]) == 2
    assert (local / train[0]).read_bytes() == datasets[FINEWEB][train[0]]

    online.corrupt[train[1]] = 2
    (local / train[1]).write_bytes(b"damaged on disk")  # a verified file changed after its download
    status, _, err = corpus_command("download", run, capsys)
    assert status == 2
    assert err.startswith(f"error: {local / train[1]}: corrupt after two downloads"), err
    assert not (local / train[1]).exists()
    assert online.lfs_gets(train[0]) == 2  # the good file is not fetched again


def test_too_little_free_space_is_refused_before_the_first_byte(online, tmp_path, capsys):
    huge = "data/spa_Latn/train/999_99999.parquet"
    online.repos[FINEWEB]["files"][huge] = b"x" * 100
    online.claimed_sizes = {huge: 10**18}  # a file bigger than any disk: the listing says so
    run = run_file(
        tmp_path, [hub_source("fineweb2", FINEWEB, "data/spa_Latn/train/*.parquet", tmp_path / "hub")]
    )
    status, _, err = corpus_command("download", run, capsys)
    assert status == 2
    assert "1000.00 PB to download but" in err and "free on that disk" in err, err
    assert "data.corpus.sources[0] (fineweb2).hub.max_bytes" in err
    assert not any(path.startswith("/lfs/") for _, path in online.requests)


def test_missing_datasets_files_and_gated_access_are_one_line_errors_and_the_token_is_never_written(
    online, tmp_path, capsys, monkeypatch
):
    local = tmp_path / "hub"

    def error_of(source):
        status, _, err = corpus_command("download", run_file(tmp_path, [source]), capsys)
        assert status == 2
        return err

    assert "no such dataset on the Hub" in error_of(hub_source("x", "nadie/nada", "*.parquet", local))
    assert "no file on the Hub matches files 'data/cat_Latn/*.parquet'" in error_of(
        hub_source("x", FINEWEB, "data/cat_Latn/*.parquet", local)
    )
    train = sorted(p for p in online.repos[FINEWEB]["files"] if p.startswith("data/spa_Latn/train/"))
    online.unresolvable = {train[0]}
    assert error_of(hub_source("x", FINEWEB, "data/spa_Latn/train/*.parquet", local, max_files=1)) == (
        f"error: data.corpus.sources[0] (x): {FINEWEB}@{COMMIT[:12]}:{train[0]}: missing on the Hub; "
        "run the command again: finished files are kept"
    )
    online.unresolvable = set()
    wrong_path = hub_source("x", FINEWEB, "data/spa_Latn/train/*.parquet", local) | {
        "path": "elsewhere/*.parquet"
    }
    assert "sources[0] (x).path: 'elsewhere/*.parquet' does not match" in error_of(wrong_path)

    online.repos[FINEWEB]["token"] = TOKEN
    gated = hub_source("fineweb2", FINEWEB, "data/spa_Latn/train/*.parquet", local, max_files=1)
    assert "access refused (a gated dataset" in error_of(gated)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    status, _, err = corpus_command("download", run_file(tmp_path, [gated]), capsys)
    assert status == 0, err
    for root, _, files in os.walk(tmp_path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                assert TOKEN.encode() not in f.read(), os.path.join(root, name)


def test_the_whole_path_from_the_hub_to_a_few_training_steps(online, tmp_path, capsys):
    sources = [
        hub_source("fineweb2", FINEWEB, "data/spa_Latn/train/*.parquet", tmp_path / "hub/fineweb-2"),
        hub_source("wiki", WIKI, "20231101.es/*.parquet", tmp_path / "hub/wikipedia")
        | {"filters": ["language"]},
    ]
    run = run_file(tmp_path, sources, dir=str(tmp_path / "corpus"))
    run_cfg = yaml.safe_load(open(run))
    run_cfg["data"]["corpus"]["val_fraction"] = 0.25  # a val split from 52 documents
    run_cfg["data"]["corpus"]["filters"]["word_tokenizer"] = "regex"  # spaCy loads slower than this runs
    open(run, "w").write(yaml.safe_dump(run_cfg, allow_unicode=True))
    status, _, err = corpus_command("corpus", run, capsys)
    assert status == 2 and "fetch it with `python -m corpus download CONFIG`" in err, err
    for step in ("download", "all", "report"):
        status, _, err = corpus_command(step, run, capsys)
        assert status == 0, err
    report = (tmp_path / "corpus" / "report.md").read_text(encoding="utf-8")
    assert (
        f"- fineweb2: {FINEWEB}@{COMMIT}, 3 file(s); licence: test licence of fineweb2 (on the Hub: odc-by)"
        in report
    )
    manifest = json.load(open(tmp_path / "corpus" / "manifest.json"))
    assert set(manifest["mixture"]) == {"fineweb2", "wiki"}
    assert manifest["mixture"]["fineweb2"]["licence"] == "test licence of fineweb2"
    train = subprocess.run([sys.executable, "train.py", run], cwd=ROOT, capture_output=True, text=True)
    assert train.returncode == 0, train.stderr[-2000:]
    assert os.path.exists(tmp_path / "runs" / "smoke-corpus-cpu" / "ckpt_0000008.pt")


def shipped_run_files():
    return sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def test_every_corpus_source_of_every_shipped_run_file_is_on_the_hub_or_in_the_repository():
    for run in shipped_run_files():
        for index, source in enumerate(config.load(run)["data"].get("corpus", {}).get("sources", [])):
            where = f"{os.path.basename(run)}: data.corpus.sources[{index}] ({source['name']})"
            if "hub" in source:  # the files the download fetches are the files `path` reads
                fetched = os.path.join(source["hub"]["local_dir"], source["hub"]["files"].replace("*", "x"))
                assert corpus.hub.glob_matches(source["path"], fetched), where
            else:  # a clone has it: a path inside the repository, never ../shared or an absolute one
                assert os.path.realpath(os.path.join(ROOT, source["path"])).startswith(ROOT + os.sep), where


def test_the_2060_runs_sources_all_come_from_the_hub_into_the_paths_the_corpus_step_reads(
    online, tmp_path, capsys
):
    layer = config.load(os.path.join(ROOT, "configs", "pretrain-2060.yaml"))["data"]["corpus"]["sources"]
    shipped = copy.deepcopy(layer)
    assert [s["hub"]["repo"] for s in shipped] == [FINEWEB, WIKI, WIKISOURCE]
    for source in shipped:  # the layer's folders, under tmp_path
        source["path"] = str(tmp_path / source["path"])
        source["hub"]["local_dir"] = str(tmp_path / source["hub"]["local_dir"])
    status, out, err = corpus_command("download", run_file(tmp_path, shipped), capsys)
    assert status == 0, err
    found = sources.expand_sources({"sources": shipped})
    assert sorted({index for index, _ in found}) == [0, 1, 2]  # each source reads what its download fetched
    assert (tmp_path / "data/hub/wikisource/20231201.es/train-00000-of-00001.parquet").exists()
    assert "wikisource-es: wikimedia/wikisource@0123456789ab, 1 file(s)" in out


@pytest.mark.parametrize(
    "knob, cause",
    [
        ("refused", "access refused (a gated dataset"),
        ("cut", "Server disconnected without sending a response"),
    ],
)
def test_a_refusal_or_a_lost_connection_on_a_forced_fetch_is_named_not_the_clients_wrapper(
    online, datasets, tmp_path, capsys, knob, cause
):
    train = train_files(datasets)
    local = tmp_path / "hub"
    (local / train[0]).parent.mkdir(parents=True)
    (local / train[0]).write_bytes(b"an unverified copy: fetched again with force_download")
    getattr(online, knob).add(train[0])
    run = run_file(
        tmp_path, [hub_source("fineweb2", FINEWEB, "data/spa_Latn/train/*.parquet", local, max_files=1)]
    )
    status, _, err = corpus_command("download", run, capsys)
    assert status == 2
    assert f"{FINEWEB}@{COMMIT[:12]}:{train[0]}: " in err and cause in err, err
    assert "Force download failed" not in err


def test_sizes_print_in_a_unit_that_fits(online, tmp_path, capsys, monkeypatch):
    from corpus import hub

    assert [hub.size_text(n) for n in (0, 999, 1_500, 999_999, 1_220_000, 5 * 10**9)] == [
        "0 bytes", "999 bytes", "1.50 kB", "1.00 MB", "1.22 MB", "5.00 GB"
    ]  # fmt: skip
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda folder: shutil_usage(free=500))
    run = run_file(
        tmp_path,
        [hub_source("fineweb2", FINEWEB, "data/spa_Latn/train/*.parquet", tmp_path / "hub", max_files=1)],
    )
    status, _, err = corpus_command("download", run, capsys)
    assert status == 2
    size = hub.size_text(online.repos[FINEWEB]["files"][train_files_of(online)[0]].__len__())
    assert f": {size} to download but 500 bytes free on that disk" in err, err


def shutil_usage(free):
    import shutil

    return shutil._ntuple_diskusage(total=10**6, used=10**6 - free, free=free)


def train_files_of(hub):
    return sorted(p for p in hub.repos[FINEWEB]["files"] if p.startswith("data/spa_Latn/train/"))


def test_the_progress_bar_ends_at_the_bytes_to_fetch_when_a_corrupt_file_is_fetched_again(
    online, datasets, tmp_path, capsys, monkeypatch
):
    from corpus import hub

    bars = []

    class Recorded(hub.tqdm):
        def close(self):
            bars.append((self.n, self.total))
            super().close()

    monkeypatch.setattr(hub, "tqdm", Recorded)
    train = train_files(datasets)
    online.corrupt[train[0]] = 1
    run = run_file(
        tmp_path,
        [hub_source("fineweb2", FINEWEB, "data/spa_Latn/train/*.parquet", tmp_path / "hub", max_files=2)],
    )
    status, _, err = corpus_command("download", run, capsys)
    assert status == 0, err
    assert online.lfs_gets(train[0]) == 2
    size = len(datasets[FINEWEB][train[0]]) + len(datasets[FINEWEB][train[1]])
    assert bars[-1] == (size, size)


def test_offline_a_download_checks_the_recorded_files_and_asks_no_server(
    online, datasets, tmp_path, capsys, monkeypatch
):
    """HF_HUB_OFFLINE (make run OFFLINE=1): files fetched on another machine and copied here (new mtimes) are
    checked against the checksums their download recorded; the Hub stand-in gets no request at all."""
    from huggingface_hub import constants

    train = train_files(datasets)
    local = tmp_path / "hub"
    sources = [
        hub_source("fineweb2", FINEWEB, "data/spa_Latn/train/*.parquet", local, max_files=2),
        hub_source("wiki", WIKI, "20231101.es/*.parquet", tmp_path / "hub-wiki", max_files=1),
    ]
    run = run_file(tmp_path, sources)
    status, _, err = corpus_command("download", run, capsys)
    assert status == 0, err
    for path in glob.glob(str(tmp_path / "hub*" / "**" / "*.parquet"), recursive=True):
        os.utime(path, ns=(1, 1))  # copied from the machine that downloaded them: other mtimes
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    online.requests.clear()

    status, out, err = corpus_command("download", run, capsys)
    assert status == 0, err
    assert "offline (HF_HUB_OFFLINE)" in out and "3 by their checksum; no server asked" in out, out
    assert online.requests == []
    assert recorded(local)["files"][train[0]]["mtime_ns"] == 1  # re-verified: the next check reads nothing
    status, out, err = corpus_command("download", run, capsys)
    assert status == 0 and "0 by their checksum" in out, out + err
    assert online.requests == []


def test_offline_a_missing_or_changed_file_is_one_line_naming_it_and_nothing_is_written(
    online, datasets, tmp_path, capsys, monkeypatch
):
    from huggingface_hub import constants

    train = train_files(datasets)
    local = tmp_path / "hub"
    run = run_file(
        tmp_path, [hub_source("fineweb2", FINEWEB, "data/spa_Latn/train/*.parquet", local, max_files=2)]
    )
    assert corpus_command("download", run, capsys)[0] == 0
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    online.requests.clear()
    record_before = (local / "hub_files.json").read_bytes()

    damaged = local / train[1]
    damaged.write_bytes(b"X" + datasets[FINEWEB][train[1]][1:])  # same size, another mtime
    status, _, err = corpus_command("download", run, capsys)
    assert status == 2
    assert (
        err.startswith(f"error: {damaged}: checksum ")
        and "differs from" in err
        and "copy the file again" in err
    )
    assert (local / "hub_files.json").read_bytes() == record_before

    damaged.unlink()
    status, _, err = corpus_command("download", run, capsys)
    assert status == 2
    assert (
        err
        == f"error: {damaged}: missing (offline: HF_HUB_OFFLINE); copy it from the machine that downloaded it"
    )

    never = run_file(tmp_path, [hub_source("wiki", WIKI, "20231101.es/*.parquet", tmp_path / "nowhere")])
    status, _, err = corpus_command("download", never, capsys)
    assert status == 2
    assert "wikimedia/wikipedia@main: offline (HF_HUB_OFFLINE)" in err and "records no download of it" in err
    assert not (tmp_path / "nowhere").exists()
    assert online.requests == []


def test_make_run_offline_runs_the_download_stage_on_the_recorded_files_without_a_request(
    online, datasets, tmp_path, capsys
):
    """`make run ... OFFLINE=1`: the chain's download stage, a process of its own, asks the Hub nothing (the
    stand-in is reachable and HF_HUB_OFFLINE is 0 in the environment: only the flag makes it offline)."""
    local = tmp_path / "hub"
    run = run_file(
        tmp_path, [hub_source("fineweb2", FINEWEB, "data/spa_Latn/train/*.parquet", local, max_files=2)]
    )
    assert corpus_command("download", run, capsys)[0] == 0
    assume = config.load_layer("chain", os.path.join(ROOT, "configs", "chain", "cpu.yaml"))["assume"]
    chain = {"board": "offline", "folder": str(tmp_path / "run"), "hardware": "hardware/cpu.yaml", "assume": assume,
             "stages": [{"name": "download", "command": "corpus-download", "config": run}]}  # fmt: skip
    chain_file = tmp_path / "offline.yaml"
    chain_file.write_text(yaml.safe_dump({"chain": chain}), encoding="utf-8")
    online.requests.clear()
    env = users_env(hub_env(online, tmp_path))
    done = subprocess.run(
        ["make", "-o", ".venv/.requirements.stamp", "run", f"BOARD={chain_file}", "OFFLINE=1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "download: offline (HF_HUB_OFFLINE)" in done.stdout
    assert online.requests == []
