"""Shared fixtures: tiny runs built from the shipped run files plus overrides (a config is data)."""

import contextlib
import copy
import gzip
import json
import os
import socket
import subprocess
import sys
import threading
import time

import jsonschema
import pytest
from skip_summary import pytest_terminal_summary  # noqa: F401  (the skip reasons at the end)

import config
import corpus.pipeline
import data
import fileio
from corpus import docs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    # No test downloads a model or a dataset: the Hugging Face libraries (lm-eval's datasets too) read only
    # their local cache, in this process and in every process a test starts.
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"


# A model and schedule small enough that a run of a few steps takes well under a second on the CPU.
TINY = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_hidden=64",
    "model.seq_len=16",
    "train.micro_batch_size=4",
    "train.grad_accum_steps=2",
    "train.max_steps=8",
    "train.warmup_steps=2",
    "train.decay_fraction=0.25",
    "train.eval_interval=4",
    "train.eval_batches=2",
    "train.log_interval=1",
    "train.ckpt_interval=2",
    "train.keep_last=2",
    "train.sample_tokens=0",
    "hardware.peak_tflops=1.0",  # skips the ~1 s start-up matmul that measures the MFU reference
    "hardware.loss_chunk_size=24",  # the LM head + loss in several chunks, the last one short (64 = 24+24+16)
]


def spanish_text(max_chars):
    with gzip.open(os.path.join(ROOT, "corpus", "fortunes-es.txt.gz"), "rt", encoding="utf-8") as f:
        return f.read(max_chars)


@pytest.fixture(scope="session")
def byte_data_dir(tmp_path_factory):
    """train.bin / val.bin of real Spanish text, as scripts/prepare_smoke_data.sh lays them out."""
    folder = tmp_path_factory.mktemp("bytes")
    text = spanish_text(60_000).encode("utf-8")
    (folder / "train.bin").write_bytes(text[:50_000])
    (folder / "val.bin").write_bytes(text[50_000:])
    return str(folder)


@pytest.fixture(scope="session")
def shard_data_dir(tmp_path_factory):
    """The stage-1 pipeline (corpus -> tokenizer -> shards) run small on the embedded corpus."""
    folder = tmp_path_factory.mktemp("shards")
    cfg = config.load(os.path.join(ROOT, "configs", "smoke-corpus-cpu.yaml"), shard_overrides(str(folder)))
    data_cfg = cfg["data"]
    corpus.pipeline.build_corpus(data_cfg, log=lambda *a: None)
    corpus.pipeline.train_tokenizer(data_cfg, log=lambda *a: None)
    corpus.pipeline.encode(data_cfg, log=lambda *a: None)
    return str(folder)


def data_layer(name, **changes):
    """The `data:` section of a shipped configs/data/<name>.yaml (with the base it includes), deep-updated
    and schema-checked."""
    section = config.load_layer("data", os.path.join(ROOT, "configs", "data", f"{name}.yaml"))

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


def text_source(name, path, **settings):
    """A blank-line text source without the language and quality filters, read once."""
    source = {"name": name, "kind": "text", "path": path, "documents": "blank_line", "licence": "test data"}
    return source | {"filters": False, "epochs": 1} | settings


def quiet(*args, **kwargs):
    pass


@pytest.fixture(scope="session")
def pipeline(tmp_path_factory):
    """One small corpus -> tokenizer -> shards run shared by the tests that only read its results."""
    directory = tmp_path_factory.mktemp("corpus-smoke")
    cfg = data_layer(
        "corpus-smoke",
        dir=str(directory),
        processes=1,
        corpus={"sources": [text_source("sample", sample_corpus(directory / "sample.txt"))]},
        tokenizer={"vocab_size": 512},
        encode={"tokens_per_shard": 5_000},
    )
    corpus.pipeline.build_corpus(cfg, log=quiet)
    corpus.pipeline.train_tokenizer(cfg, log=quiet)
    corpus.pipeline.encode(cfg, log=quiet)
    return cfg


def read_docs(cfg, split):
    return list(docs.iter_documents(docs.docs_path(cfg, split)))


def shard_hashes(cfg, split):
    return [fileio.sha256_of_file(p) for p in data.shard_paths(cfg, split)]


def shard_overrides(folder):
    return [
        f"data.dir={folder}",
        "data.corpus.max_documents_per_file=400",
        "data.tokenizer.vocab_size=512",
        "data.tokenizer.character_coverage=0.995",
        "model.vocab_size=512",
        "data.encode.tokens_per_shard=8000",
        "data.processes=1",
    ]


# Rows of packed test conversations are 64 + 1 tokens (the 16 of TINY would hold none of them).
CHAT_SEQ_LEN = 64


def example_conversations(count, start=0):
    """Short conversations written for the tests (not the seed set): sums, a system turn, a second turn."""
    conversations = []
    for n in range(start, start + count):
        a, b = n % 17, n % 5 + 1
        messages = [{"role": "user", "content": f"¿Cuánto es {a} más {b}?"}]
        messages.append({"role": "assistant", "content": f"{a} más {b} son {a + b}."})
        if n % 3 == 0:
            messages.insert(0, {"role": "system", "content": "Eres ENLACE, breve."})
        if n % 4 == 0:
            messages += [{"role": "user", "content": "Gracias"}, {"role": "assistant", "content": "De nada."}]
        conversations.append({"messages": messages})
    return conversations


def write_jsonl(path, records):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    return str(path)


def chat_overrides(folder, shard_dir):
    """Overrides that point configs/sft-smoke-cpu.yaml at test conversations in folder/ and at the
    tokenizer of the shard test data."""
    return [
        f"data.dir={folder}/packed",
        f"data.chat.tokenizer={shard_dir}/tokenizer.model",
        f"data.chat.train=[{folder}/train.jsonl]",
        f"data.chat.val=[{folder}/val.jsonl]",
        "data.chat.rows_per_shard=8",
        "model.vocab_size=512",
        f"model.seq_len={CHAT_SEQ_LEN}",
        "train.init_from=null",
    ]


@pytest.fixture(scope="session")
def chat_data_dir(tmp_path_factory, shard_data_dir):
    """Test conversations packed by chat/prepare.py (rows of CHAT_SEQ_LEN + 1) with the shard tokenizer."""
    from chat import prepare

    folder = tmp_path_factory.mktemp("chat")
    write_jsonl(folder / "train.jsonl", example_conversations(60))
    write_jsonl(folder / "val.jsonl", example_conversations(12, start=100))
    overrides = [*TINY, *chat_overrides(str(folder), shard_data_dir)]
    (folder / "shard_dir.txt").write_text(shard_data_dir, encoding="utf-8")
    prepare.prepare(
        config.load(os.path.join(ROOT, "configs", "sft-smoke-cpu.yaml"), overrides), log=lambda *a: None
    )
    return str(folder)


def tiny_args(runs_dir, data_kind, data_dir, *overrides):
    """train.py arguments of a tiny run over the byte, shard or chat test data, writing runs under
    runs_dir. The chat data's folder holds the shard tokenizer's path in shard_dir.txt."""
    if data_kind == "bytes":
        run_file, data_overrides = "configs/smoke-cpu.yaml", [f"data.dir={data_dir}"]
    elif data_kind == "chat":
        with open(os.path.join(data_dir, "shard_dir.txt"), encoding="utf-8") as f:
            shard_dir = f.read()
        run_file, data_overrides = "configs/sft-smoke-cpu.yaml", chat_overrides(data_dir, shard_dir)
    else:
        run_file, data_overrides = "configs/smoke-corpus-cpu.yaml", shard_overrides(data_dir)
    return [run_file, *TINY, *data_overrides, f"train.runs_dir={runs_dir}", *overrides]


def tiny_config(runs_dir, data_kind, data_dir, *overrides):
    """The resolved config of tiny_args(...)."""
    run_file, *rest = tiny_args(runs_dir, data_kind, data_dir, *overrides)
    return config.load(os.path.join(ROOT, run_file), rest)


def start_training(args):
    """train.py in a subprocess, its output captured: for tests that signal a real training process."""
    command = [sys.executable, "train.py", *args]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_step(metrics_path, step, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"training ended before step {step}: {proc.communicate()}"
        if os.path.exists(metrics_path):
            with open(metrics_path) as f:
                if any(json.loads(line).get("step", 0) >= step for line in f if line.strip()):
                    return
        time.sleep(0.01)
    raise AssertionError(f"no step {step} in {metrics_path} after {timeout}s")


@pytest.fixture(scope="session")
def chat_run(tmp_path_factory, shard_data_dir):
    """A tiny run with the sentencepiece tokenizer (chat control tokens) and room for a chat prompt; it
    writes gibberish, which is all the server tests need."""
    import train

    runs = tmp_path_factory.mktemp("runs")
    overrides = ["run_name=chat", "model.seq_len=256", "train.max_steps=2", "train.eval_interval=0"]
    train.train(tiny_config(runs, "shards", shard_data_dir, *overrides), log=lambda *a, **k: None)
    return str(runs / "chat")


def start_server(run, database, *overrides, log_path=None):
    """serve/app.py in a subprocess on a free port of 127.0.0.1: (process, base URL). Its stderr goes to
    log_path (or is dropped)."""
    command = [
        sys.executable,
        "-m",
        "serve",
        run,
        "--port",
        "0",
        f"serve.database={database}",
        ANY_HOUR,
        *overrides,
    ]
    stderr = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 (owned by the child)
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
    line = proc.stdout.readline()
    if " at http://" not in line:
        proc.kill()
        log = open(log_path).read() if log_path else ""
        raise AssertionError(f"serve/app.py did not start: {line!r}\n{log}")
    return proc, line.split(" at ")[1].split()[0].rstrip("/")


def serve_member(database, name, role, password=None):
    """`python -m serve member add` (and `member password`): the member's API key."""
    db = f"serve.database={database}"
    added = subprocess.run([sys.executable, "-m", "serve", "member", "add", name, "--role", role, db],
                           cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    key = added.stdout.strip().splitlines()[-1]
    if password is not None:
        subprocess.run([sys.executable, "-m", "serve", "member", "password", name, db], cwd=ROOT, input=password + "\n",
                       capture_output=True, text=True, check=True)  # fmt: skip
    return key


FAST_SCRYPT = "serve.scrypt.n=1024"  # the test passwords need no production cost
ANY_HOUR = (
    "serve.child.allowed_hours=null"  # children chat whenever the tests run (the shipped config: 8 to 21)
)


@pytest.fixture(scope="session")
def chat_model(chat_run):
    """decode.load.load_model of chat_run: (model, tokenizer, model id, context), shared by in-process servers."""
    from decode import load

    return load.load_model(chat_run, "cpu")


class ScriptedModel:
    """Stands in for the model's choices: its generations (rows of its decoder) yield the scripts in turn
    (round robin), each repeating its last id; every decoding step of the batch takes `delay` s. It keeps
    the prompts it got."""

    def __init__(self, *scripts, delay=0.0):
        self.scripts, self.delay, self.prompts, self.constraints = scripts, delay, [], []

    def script_for(self, prompt, constraint=None):
        ids = self.scripts[len(self.prompts) % len(self.scripts)]
        self.prompts.append(list(prompt))
        self.constraints.append(constraint)  # scripted choices are never masked
        return ids

    def decoder(self, slots, allocate=False):
        return ScriptedDecoder(self)


class ScriptedRow:
    def __init__(self, script):
        self.script, self.step = script, 0


class ScriptedDecoder:
    """engine.Decoder's interface over a ScriptedModel."""

    def __init__(self, model):
        self.model = model

    def add(self, prompt, temperature=1.0, top_k=None, top_p=None, generator=None, constraint=None):
        return ScriptedRow(self.model.script_for(prompt, constraint))

    def sample(self, row):
        return row.script[min(row.step, len(row.script) - 1)]

    def sample_rows(self, rows):
        return {row: self.sample(row) for row in rows}

    def advance(self, tokens):
        time.sleep(self.model.delay)
        for row in tokens:
            row.step += 1

    def remove(self, row):
        pass


@contextlib.contextmanager
def live_server(chat_model, tmp_path, *overrides, model=None, context=None):
    """uvicorn serving build_app() on a free port of 127.0.0.1 in a thread; yields (url, Server). A scripted
    model may claim a longer context than the tiny run's. Overrides are serve.key=value, or memory.key=value
    for the memory layer."""
    import uvicorn

    from decode import load
    from family import accounts, memories
    from serve import app, worker

    database = str(tmp_path / f"serve-{time.monotonic_ns()}.sqlite")
    memory_overrides = [item for item in overrides if item.startswith("memory.")]
    overrides = [item for item in overrides if item not in memory_overrides]
    settings = app.load_settings(
        app.DEFAULT_CONFIG, [f"serve.database={database}", FAST_SCRYPT, ANY_HOUR, *overrides]
    )
    real_model, tokenizer, model_id, run_context = chat_model
    context = context or run_context
    decoding = load.decoding_options(settings, "cpu") if model is None else {}
    model = model or load.prepare_weights(real_model, settings, "cpu")  # as serve_main prepares it
    model_worker = worker.Worker(model, tokenizer, settings["queue_size"], settings["max_batch"], **decoding)
    store = accounts.Store(database, settings["busy_timeout_ms"])
    server = app.Server(settings, store, model_worker, model_id, context,
                        memory_cfg=memories.load_config(overrides=memory_overrides))  # fmt: skip
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(app.uvicorn_config(app.build_app(server), settings, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        uv.should_exit = True
        thread.join()
        model_worker.close()
