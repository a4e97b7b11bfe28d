"""
Stage 1: from declared sources to the shards data.py's loaders read.

    python -m corpus download CONFIG [...]                     the sources with `hub` -> their local_dir
                                                               (corpus/hub.py)
    python -m corpus corpus CONFIG [section.key=value ...]    sources -> filters -> PII -> dedup ->
                                                               decontamination -> DIR/docs_{train,val}.jsonl
    python -m corpus tokenizer CONFIG [...]                    sentencepiece BPE -> DIR/tokenizer.model
    python -m corpus encode CONFIG [...]                       mixture + tokens  -> DIR/{train,val}*.bin
    python -m corpus all CONFIG [...]                          the three in order
    python -m corpus report CONFIG [...]                       DIR/report.md + DIR/report/*.png
    python -m corpus chars-per-token MODEL FILE...             the tokenizer's chars/token on text files
                                                               (FLORES-200 spa_Latn dev + devtest)

CONFIG is a run file (config.py composes it); only its `data:` section is used (schema/data.schema.json).
DIR is `data.dir`. Every step records what it did in DIR/manifest.json and does nothing when its inputs
have not changed.

This file holds the corpus step: the filter tasks (run by a datatrove executor, each task writing its share
atomically into DIR/work/<fingerprint>/, reused after a kill) and the merge (exact and MinHash dedup,
decontamination, the split by document hash). Beside it: corpus/sources.py (reading each kind of source),
corpus/filters.py (the document stages), corpus/encode.py (tokenizer training, mixture, encoding) and
corpus/report.py (the report).

Files in DIR
    docs_train.jsonl, docs_val.jsonl   kept documents, one {"text", "source", "cluster_size", ...} per line
    manifest.json                      per-source statistics, fingerprints, mixture, shards with sha256
    format bytes:  train.bin, val.bin  the UTF-8 bytes of the documents, separated by a blank line
    format shards: tokenizer.model, tokenizer_info.json (its settings and the hash of the corpus it saw),
                   mixture_train.npz (the train document order), train_000000.bin ..., val_000000.bin ...
"""

import collections
import contextlib
import glob
import hashlib
import heapq
import json
import os
import re
import shutil
import socket
import sys
import unicodedata

import numpy as np
from tqdm import tqdm

from corpus import filters
from corpus.docs import LENGTH_BINS, SCORE_BINS, docs_path, outputs_intact, processes_of
from corpus.sources import expand_sources, raw_documents
from data import NEWLINE, PIPELINE_VERSION, SPLITS, DataError, manifest_path, read_manifest
from fileio import (
    check_space,
    fingerprint,
    reports_storage_errors,
    storage_error,
    write_atomic,
    write_json,
)

# -----------------------------------------------------------------------------
# Sources: text, jsonl, parquet and MediaWiki dumps, each document tagged with its source's name


SURROGATES = re.compile("[\ud800-\udfff]")
ODD_CHARACTERS = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
)
REPLACEMENTS = {chr(c): " " for c in (0xA0, 0x1680, 0x202F, 0x205F, 0x3000, *range(0x2000, 0x200B))}
REPLACEMENTS |= {"\u2028": NEWLINE, "\u2029": NEWLINE}  # other odd characters (controls, BOM) go
# Spelled with a literal prefix, not as "\n{3,}": the regex engine then scans for the prefix at memory speed,
# several times faster than "\n{3,}" or a loop of str.replace("\n\n\n", "\n\n").
BLANK_LINE_RUNS = re.compile("\n\n\n+")


def clean_text(text):
    """NFC; controls (but \\t, \\n) and BOMs dropped; unicode spaces -> ' '; \\r\\n -> \\n; trailing spaces
    of lines and runs of blank lines tidied; leading blank lines and trailing whitespace removed."""
    if "\r" in text:
        text = text.replace("\r\n", NEWLINE).replace("\r", NEWLINE)
    if not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    if ODD_CHARACTERS.search(text):
        text = ODD_CHARACTERS.sub(lambda m: REPLACEMENTS.get(m.group(), ""), text)
    text = NEWLINE.join([line.rstrip(" \t") for line in text.split(NEWLINE)])
    text = BLANK_LINE_RUNS.sub("\n\n", text)
    return text.lstrip(NEWLINE).rstrip()


def replace_undecodable(text):
    """Lone surrogates (from undecodable bytes or bad JSON escapes) -> U+FFFD; returns (text, count)."""
    count = len(SURROGATES.findall(text))
    return (SURROGATES.sub("\ufffd", text), count) if count else (text, 0)


# -----------------------------------------------------------------------------
# The corpus step, part 1: every document through the stages, as tasks of a datatrove executor
#
# Task r of T takes documents r, r + T, r + 2T, ... (all tasks read every file, only the stages are split)
# and writes, each file atomically, in the step's work folder (named by the fingerprint of config + inputs):
#   kept_0000r.jsonl   the documents it kept: {"i", "source", "split", "digest", "text", "meta"}
#   keys_0000r.npy     their MinHash bucket keys (uint64 [documents, buckets]; zeros: too short to sign)
#   stats_0000r.json   counts per source and stage, drop reasons with examples, histograms (written last:
#                      a task whose stats exist is finished and is skipped when the step runs again)

EXAMPLES = 3  # dropped documents kept per reason for the report
EXAMPLE_CHARS = 300


def new_source_stats():
    return {
        "documents_in": 0,
        "bytes_in": 0,
        "documents_out": 0,
        "chars_out": 0,
        "undecodable": 0,
        "drops": collections.Counter(),
        "stages": {},
        "pii": collections.Counter(),
        "length_in": [0] * (len(LENGTH_BINS) + 1),
        "length_out": [0] * (len(LENGTH_BINS) + 1),
        "language_score": [0] * len(SCORE_BINS),
    }


def runs(source, stage_name):
    """Whether a filter stage runs on a source (its `filters`: true, false or a list of stage names)."""
    chosen = source["filters"]
    return chosen if isinstance(chosen, bool) else stage_name in chosen


def split_of_digest(digest, val_fraction):
    return "val" if int.from_bytes(digest[:8], "little") < val_fraction * 2**64 else "train"


def split_of(text, val_fraction):
    """The split a cleaned document goes to: a hash of its text, so the same text always lands alike."""
    return split_of_digest(hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest(), val_fraction)


def count_stage(stats, stage, chars, kept):
    entry = stats["stages"].setdefault(
        stage, {"documents_in": 0, "chars_in": 0, "documents_out": 0, "chars_out": 0}
    )
    entry["documents_in"] += 1
    entry["chars_in"] += chars
    if kept:
        entry["documents_out"] += 1
        entry["chars_out"] += chars


def length_bin(chars):
    return int(np.searchsorted(LENGTH_BINS, chars))


class FilterTask:
    """A datatrove pipeline callable (data, rank, world_size): the stages of corpus/filters.py on this task's
    share of the documents. Models are built in the task, so the object pickles small."""

    def __init__(self, data_cfg, workdir):
        self.corpus_cfg, self.workdir = data_cfg["corpus"], workdir
        self.root = os.getcwd()  # the config's paths are relative to where the step was started

    def paths(self, rank):
        return {
            name: os.path.join(self.workdir, f"{name}_{rank:05d}.{ext}")
            for name, ext in (("kept", "jsonl"), ("keys", "npy"), ("stats", "json"), ("error", "txt"))
        }

    def __call__(self, data, rank=0, world_size=1):
        os.chdir(self.root)  # a Ray worker on another node starts where `ray start` ran
        paths = self.paths(rank)
        if os.path.exists(paths["stats"]):  # finished by an earlier run of the same config
            return
        # What an earlier attempt left: its error, and the file it was writing when it was killed.
        for path in paths.values():
            temps = glob.glob(os.path.join(self.workdir, f".{os.path.basename(path)}.*.tmp"))
            for leftover in [path, *temps]:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(leftover)
        try:
            self.filter(paths, rank, world_size)
        except DataError as e:  # a source that cannot be read: one line on the terminal (task_errors)
            from loguru import logger

            logger.opt(exception=e).debug(f"task {rank}: {e}")  # the traceback: the task's log file only
            message = str(e).encode("utf-8")
            write_atomic(paths["error"], lambda f: f.write(message))

    def filter(self, paths, rank, world_size):
        cfg = self.corpus_cfg
        filters_cfg = cfg["filters"]
        language = (
            filters.LanguageStage(filters_cfg["language"]) if filters_cfg["language"]["enabled"] else None
        )
        quality = filters.quality_stages(filters_cfg)
        scrub = filters.PiiScrubber(cfg["pii"]) if cfg["pii"]["enabled"] else None
        dedup_cfg = cfg["near_dedup"]
        hasher = None
        if dedup_cfg["enabled"]:
            words = filters.word_splitter(filters_cfg["word_tokenizer"])
            hasher = filters.MinHasher(dedup_cfg, words)
        width = dedup_cfg["buckets"] if hasher else 0
        names = [source["name"] for source in cfg["sources"]]
        stats = {name: new_source_stats() for name in names}
        examples = collections.defaultdict(list)
        keys = []

        def drop(source_stats, name, reason, text):
            source_stats["drops"][reason] += 1
            if len(examples[reason]) < EXAMPLES:
                examples[reason].append({"source": name, "text": text[:EXAMPLE_CHARS]})

        progress = tqdm(desc=f"filter task {rank}", unit=" docs", mininterval=2.0, file=sys.stderr)

        def kept_lines():
            # Reader counts (bytes in, bad lines) come from task 0 only: every task reads every file.
            scratch = new_source_stats()
            reader_stats = (lambda k: stats[names[k]]) if rank == 0 else (lambda k: scratch)
            for i, (index, raw, meta) in enumerate(raw_documents(cfg, reader_stats)):
                if i % world_size != rank:
                    continue
                name, source = names[index], cfg["sources"][index]
                s = stats[name]
                s["documents_in"] += 1
                progress.update()
                text = clean_text(raw)
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:  # lone surrogates: undecodable input bytes or bad JSON escapes
                    text, undecodable = replace_undecodable(text)
                    s["undecodable"] += undecodable
                s["length_in"][length_bin(len(text))] += 1
                ok = len(text) >= cfg["min_chars"]
                count_stage(s, "min_chars", len(text), ok)
                if not ok:
                    drop(s, name, "empty" if not text else "too_short", text)
                    continue
                doc = filters.document(text, name)
                stages = [
                    stage for stage in ([language] if language else []) + quality if runs(source, stage.name)
                ]
                for stage in stages:
                    ok, reason = stage(doc)
                    count_stage(s, stage.name, len(text), ok)
                    if stage is language:
                        s["language_score"][int(doc.metadata["language_score"] * (len(SCORE_BINS) - 1))] += 1
                    if not ok:
                        drop(s, name, reason, text)
                        break
                if not ok:
                    continue
                if scrub:
                    text, found = scrub(text)
                    s["pii"].update(found)
                encoded = text.encode("utf-8")
                digest = hashlib.blake2b(encoded, digest_size=16).digest()
                split = split_of_digest(digest, cfg["val_fraction"])
                signature = hasher.bucket_keys(text) if hasher else None
                keys.append(signature if signature is not None else np.zeros(width, np.uint64))
                if "language_score" in doc.metadata:
                    meta = meta | {"language_score": round(doc.metadata["language_score"], 4)}
                record = {
                    "i": i,
                    "source": name,
                    "split": split,
                    "digest": digest.hex(),
                    "text": text,
                    "meta": meta,
                }
                yield json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n"

        def write_kept(f):
            for line in kept_lines():
                f.write(line)

        try:
            write_atomic(paths["kept"], write_kept)
        finally:
            progress.close()  # its line ends before any error is printed
        array = np.array(keys, dtype=np.uint64).reshape(len(keys), width)
        write_atomic(paths["keys"], lambda f: np.save(f, array))
        write_json(paths["stats"], {"sources": stats, "examples": examples})


def quiet_local_executor(**settings):
    """datatrove's LocalPipelineExecutor, its logging kept in the step's log files: the terminal shows
    corpus/pipeline.py's own lines and the tasks' progress, and datatrove's only when something fails unexpectedly
    (ERROR, with its traceback; a source that cannot be read is one line of corpus/pipeline.py's instead)."""
    from datatrove.executor import LocalPipelineExecutor

    log_file = os.path.join(settings["logging_dir"], "executor.log")

    def to_file():
        from loguru import logger  # imported here: in a pool worker, the worker's own logger

        logger.remove()
        logger.add(log_file, level="DEBUG")
        logger.add(sys.stderr, level="ERROR")

    class QuietLocalExecutor(LocalPipelineExecutor):
        def run(self):
            from datatrove.utils.logging import setup_default_logger

            to_file()
            try:
                return super().run()
            finally:
                setup_default_logger()  # datatrove's own default, for the rest of this process

        def _run_for_rank(self, rank, local_rank=0, node_rank=-1):
            # datatrove copies a task's log to the terminal at INFO for local rank 0, at ERROR for the others
            try:
                return super()._run_for_rank(rank, 1, node_rank)
            finally:
                to_file()  # its task logger ended with the terminal at DEBUG again

    return QuietLocalExecutor(**settings)


def task_count(data_cfg):
    """How many filter tasks split the documents: data.corpus.executor.tasks, else one per process."""
    return data_cfg["corpus"]["executor"]["tasks"] or processes_of(data_cfg)


def executor_for(task, data_cfg, workdir):
    """(datatrove executor of the filter tasks as data.corpus.executor says, number of tasks)."""
    executor_cfg = data_cfg["corpus"]["executor"]
    tasks = task_count(data_cfg)
    # skip_completed=False: a finished task is known by its stats file (FilterTask), not datatrove's marker
    common = {"pipeline": [task], "tasks": tasks, "logging_dir": os.path.join(workdir, "logs"),
              "skip_completed": False}  # fmt: skip
    if executor_cfg["kind"] == "local":
        executor = quiet_local_executor(**common, workers=min(tasks, processes_of(data_cfg)))
    elif executor_cfg["kind"] == "slurm":
        from datatrove.executor import SlurmPipelineExecutor

        slurm = executor_cfg["slurm"]
        executor = SlurmPipelineExecutor(
            **common,
            job_name=slurm["job_name"],
            partition=slurm["partition"],
            time=slurm["time"],
            cpus_per_task=slurm["cpus_per_task"],
            mem_per_cpu_gb=slurm["mem_per_cpu_gb"],
            venv_path=slurm["venv_path"],
        )
    else:
        from datatrove.executor import RayPipelineExecutor  # imports ray only when it runs

        ray_cfg = executor_cfg["ray"]
        executor = RayPipelineExecutor(
            **common,
            cpus_per_task=ray_cfg["cpus_per_task"],
            mem_per_cpu_gb=ray_cfg["mem_per_cpu_gb"],
            time=ray_cfg["time_s"],
        )
    return executor, tasks


@contextlib.contextmanager
def ray_session(data_cfg):
    """Connect to the cluster at data.corpus.executor.ray.address, or start a local Ray instance, for the
    filter tasks (datatrove's RayPipelineExecutor expects Ray to be initialised); disconnect after."""
    ray_cfg = data_cfg["corpus"]["executor"]["ray"]
    address = ray_cfg["address"]
    try:
        import ray
    except ImportError:
        raise DataError(
            "data.corpus.executor.kind: ray needs Ray (pip install ray==2.60.0, the version tested) or kind: local"
        ) from None
    if address not in (None, "auto"):  # Ray retries an unreachable head for minutes before it gives up
        host, port = address.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=ray_cfg["connect_timeout_s"]).close()
        except OSError as e:
            raise DataError(
                f"data.corpus.executor.ray.address: {address}: no Ray head answers ({e}); start one there "
                "with `ray start --head`, or set address: null for a local instance"
            ) from None
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine
    try:
        if address is None:
            num_cpus = ray_cfg["num_cpus"] or processes_of(data_cfg)
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except ConnectionError as e:
        raise DataError(f"data.corpus.executor.ray.address: {address}: {e}") from None
    try:
        # A task no node can hold would wait for its resources forever.
        cpus, gb = ray_cfg["cpus_per_task"], ray_cfg["cpus_per_task"] * ray_cfg["mem_per_cpu_gb"]
        nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
        if not any(r.get("CPU", 0) >= cpus and r.get("memory", 0) >= gb * 2**30 for r in nodes):
            largest = max(nodes, key=lambda r: (r.get("CPU", 0), r.get("memory", 0)))
            more_cpus = address is None and largest.get("CPU", 0) < cpus
            raise DataError(
                f"data.corpus.executor.ray: a task needs cpus_per_task={cpus} CPU(s) and "
                f"cpus_per_task x mem_per_cpu_gb = {gb:g} GB, but the largest Ray node has "
                f"{largest.get('CPU', 0):g} CPU(s) and {largest.get('memory', 0) / 2**30:.1f} GB; lower them"
                + (" or raise num_cpus" if more_cpus else "")
            )
        yield
    finally:
        ray.shutdown()


def task_error(log_path):
    """The DataError a failed task logged (datatrove's Ray executor logs it instead of raising), or None."""
    if not os.path.exists(log_path):
        return None
    with open(log_path, encoding="utf-8", errors="replace") as f:
        errors = re.findall(r"^\S*DataError: (.+)$", f.read(), re.MULTILINE)
    return errors[-1] if errors else None


def task_errors(task, tasks, remove=False):
    """What the tasks that could not read a source said (FilterTask writes it instead of raising, so the
    terminal shows one line rather than a traceback per task; the traceback is in the task's log)."""
    errors = []
    for rank in range(tasks):
        path = task.paths(rank)["error"]
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                errors.append(f.read())
            if remove:
                os.remove(path)
    return errors


def run_tasks(task, data_cfg, workdir, log):
    """Run the filter tasks on the configured datatrove executor; the number of tasks when every one has
    finished here, None when they were only submitted (Slurm: run the step again once the jobs are done)."""
    executor, tasks = executor_for(task, data_cfg, workdir)
    executor_cfg = data_cfg["corpus"]["executor"]
    if executor_cfg["kind"] == "slurm":  # what the jobs of the last submission could not read
        errors = task_errors(task, tasks, remove=True)
        if errors:
            raise DataError(errors[0])
    logging_dir = os.path.join(workdir, "logs")
    finished = sum(os.path.exists(task.paths(rank)["stats"]) for rank in range(tasks))
    log(
        f"corpus: {tasks} filter task(s) on the {executor_cfg['kind']} executor, {finished} already finished "
        f"(logs in {logging_dir})"
    )
    session = ray_session(data_cfg) if executor_cfg["kind"] == "ray" else contextlib.nullcontext()
    try:
        with session:
            executor.run()
    except DataError:
        raise
    except Exception as e:  # a task's DataError may come back wrapped by the executor's pool
        cause = e
        while cause is not None and not isinstance(cause, DataError):
            cause = cause.__cause__ or cause.__context__
        raise (cause or e) from None
    errors = task_errors(task, tasks)
    if errors:
        raise DataError(errors[0])
    failed = [rank for rank in range(tasks) if not os.path.exists(task.paths(rank)["stats"])]
    if failed and executor_cfg["kind"] == "ray":  # Ray waited for every task: these failed
        logs = [os.path.join(logging_dir, "logs", f"task_{rank:05d}.log") for rank in failed]
        error = next(filter(None, map(task_error, logs)), None)
        raise DataError(
            error
            or f"corpus: filter task(s) {failed} of {tasks} did not finish on the ray executor (killed after "
            f"data.corpus.executor.ray.time_s, or lost); see {logs[0]}"
        )
    return None if failed else tasks


# -----------------------------------------------------------------------------
# The corpus step, part 2: exact and near dedup across all tasks, decontamination, the two splits


def merged_records(workdir, tasks):
    """The kept documents of every task, in input order."""
    files = [open(os.path.join(workdir, f"kept_{rank:05d}.jsonl"), "rb") for rank in range(tasks)]
    try:

        def tagged(f, rank):
            for line in f:
                yield json.loads(line), rank

        streams = [tagged(f, rank) for rank, f in enumerate(files)]
        yield from heapq.merge(*streams, key=lambda item: item[0]["i"])
    finally:
        for f in files:
            f.close()


def add_stats(total, part):
    """Sum nested counters (dicts of numbers and lists of bin counts)."""
    for key, value in part.items():
        if isinstance(value, dict):
            add_stats(total.setdefault(key, {}), value)
        elif isinstance(value, list):
            old = total.setdefault(key, [0] * len(value))
            total[key] = [a + b for a, b in zip(old, value, strict=True)]
        else:
            total[key] = total.get(key, 0) + value


def corpus_fingerprint(data_cfg):
    corpus_cfg = data_cfg["corpus"]
    files = [
        [path, os.path.getsize(path), os.stat(path).st_mtime_ns] for _, path in expand_sources(corpus_cfg)
    ]
    evals = [[p, os.path.getsize(p), os.stat(p).st_mtime_ns] for p in eval_files(corpus_cfg)]
    return fingerprint({"pipeline": PIPELINE_VERSION, "corpus": corpus_cfg, "files": files, "evals": evals})


def filter_fingerprint(data_cfg):
    """What the filter tasks' outputs depend on: the sources' files, the settings of the stages and the
    number of tasks (task r keeps documents r, r + T, ...: another T is another partition)."""
    corpus_cfg = data_cfg["corpus"]
    keys = ("sources", "min_chars", "val_fraction", "max_documents_per_file", "filters", "pii", "near_dedup")
    files = [
        [path, os.path.getsize(path), os.stat(path).st_mtime_ns] for _, path in expand_sources(corpus_cfg)
    ]
    return fingerprint(
        {
            "pipeline": PIPELINE_VERSION,
            "corpus": {k: corpus_cfg[k] for k in keys},
            "files": files,
            "tasks": task_count(data_cfg),
        }
    )


def eval_files(corpus_cfg):
    paths = corpus_cfg["decontamination"]["eval_files"]
    for index, path in enumerate(paths):
        if not os.path.isfile(path):
            raise DataError(f"data.corpus.decontamination.eval_files[{index}]: {path}: file not found")
    return paths


def build_corpus(data_cfg, log=print):
    """Sources -> filters -> PII -> dedup -> decontamination -> DIR/docs_{train,val}.jsonl; returns the
    statistics (also in the manifest, where `python -m corpus report` reads them)."""
    corpus_cfg = data_cfg["corpus"]
    key = corpus_fingerprint(data_cfg)
    done = read_manifest(data_cfg).get("corpus")
    if done and done["fingerprint"] == key and outputs_intact(done["outputs"].values()):
        log(f"corpus: up to date ({data_cfg['dir']}/docs_*.jsonl)")
        return done["stats"]
    workdir = filter_workdir(data_cfg)
    task = FilterTask(data_cfg, workdir)
    tasks = run_tasks(task, data_cfg, workdir, log)
    if tasks is None:
        log(f"corpus: filter tasks submitted; run this step again when they have finished ({workdir})")
        return None
    stats = filter_stats(task, tasks, corpus_cfg)
    rows, order = exact_dedup(workdir, tasks, stats)
    clusters, sizes = near_dedup(task, tasks, order, corpus_cfg["near_dedup"], stats)
    guard = decontaminator(corpus_cfg, workdir, tasks, rows, clusters, stats)
    outputs, hits = write_documents(data_cfg, workdir, tasks, (rows, clusters, sizes), guard, stats)
    save_corpus(data_cfg, key, stats, outputs, hits, log)
    return stats


def filter_workdir(data_cfg):
    """DIR/work/<filter fingerprint>: the filter tasks' outputs are kept, named by what they depend on, so
    changing decontamination, the mixture or the executor merges again without filtering again. The
    folders of other fingerprints are removed."""
    work = os.path.join(data_cfg["dir"], "work")
    workdir = os.path.join(work, filter_fingerprint(data_cfg)[:16])
    if os.path.isdir(work):
        for stale in set(os.listdir(work)) - {os.path.basename(workdir)}:
            shutil.rmtree(os.path.join(work, stale), ignore_errors=True)
    os.makedirs(workdir, exist_ok=True)
    return workdir


def filter_stats(task, tasks, corpus_cfg):
    """The statistics of every filter task summed per source (with its licence and kind), and the first
    EXAMPLES dropped documents per reason."""
    stats = {"sources": {}, "examples": {}}
    for rank in range(tasks):
        with open(task.paths(rank)["stats"], encoding="utf-8") as f:
            part = json.load(f)
        add_stats(stats["sources"], part["sources"])
        for reason, items in part["examples"].items():
            stats["examples"][reason] = (stats["examples"].get(reason, []) + items)[:EXAMPLES]
    for source in corpus_cfg["sources"]:
        stats["sources"][source["name"]]["licence"] = source["licence"]
        stats["sources"][source["name"]]["kind"] = source["kind"]
    return stats


def exact_dedup(workdir, tasks, stats):
    """Pass 1: exact duplicates (same text after cleaning and PII). Returns rows, one per kept document of
    the tasks in input order (None for a duplicate, else its index in order), and order, the (rank, row
    within the task's keys) of each unique document."""
    rows, order, seen = [], [], set()
    row_of_rank = [0] * tasks
    for record, rank in merged_records(workdir, tasks):
        row = row_of_rank[rank]
        row_of_rank[rank] += 1
        s = stats["sources"][record["source"]]
        unique = record["digest"] not in seen
        count_stage(s, "exact_dedup", len(record["text"]), unique)
        if not unique:
            s["drops"]["exact_duplicate"] = s["drops"].get("exact_duplicate", 0) + 1
            rows.append(None)
            continue
        seen.add(record["digest"])
        rows.append(len(order))
        order.append((rank, row))
    return rows, order


def near_dedup(task, tasks, order, dedup_cfg, stats):
    """MinHash clusters over the unique documents: (cluster of each, as the index of its first member;
    size of each cluster by that index). Without near_dedup every document is its own cluster."""
    if dedup_cfg["enabled"] and order:
        keys = [np.load(task.paths(rank)["keys"]) for rank in range(tasks)]
        matrix = np.stack([keys[rank][row] for rank, row in order])
        clusters = filters.near_duplicate_clusters(matrix)
    else:
        clusters = np.arange(len(order))
    sizes = np.bincount(clusters, minlength=len(order))
    stats["cluster_sizes"] = {
        str(size): int(count)
        for size, count in zip(*np.unique(sizes[sizes > 0], return_counts=True), strict=True)
    }
    return clusters, sizes


def decontaminator(corpus_cfg, workdir, tasks, rows, clusters, stats):
    """Pass 2: the n-grams no train document may share, from the evaluation files and the val documents
    (one per cluster); n-grams common in the language are left out."""
    decon_cfg = corpus_cfg["decontamination"]
    guard = filters.Decontaminator(decon_cfg["ngram"], decon_cfg["common_in"], decon_cfg["val_max_overlap"])
    for path in eval_files(corpus_cfg):
        with open(path, encoding="utf-8", errors="replace") as f:
            guard.protect(path, f.read())
    for (record, _), row in zip(merged_records(workdir, tasks), rows, strict=True):
        if row is not None and clusters[row] == row and record["split"] == "val":
            guard.protect("val", record["text"])
    stats["common_ngrams_ignored"] = guard.drop_common()
    return guard


def count_drop(stats, record, reason, example):
    """A document of record's source dropped for reason (an example kept while there are few)."""
    s, examples = stats["sources"][record["source"]], stats["examples"]
    s["drops"][reason] = s["drops"].get(reason, 0) + 1
    if len(examples.setdefault(reason, [])) < EXAMPLES:
        examples[reason].append({"source": record["source"], "text": example})


def survivor(record, row, dedup, guard, hits, stats):
    """The entry to write for a unique document, or None when it is not the first of its near-duplicate
    cluster or, in the train split, shares a protected n-gram (counted in hits by what it shares)."""
    _, clusters, sizes = dedup
    s, text = stats["sources"][record["source"]], record["text"]
    first = clusters[row] == row
    count_stage(s, "near_dedup", len(text), first)
    if not first:
        count_drop(stats, record, "near_duplicate", text[:EXAMPLE_CHARS])
        return None
    hit = guard.hit(text) if record["split"] == "train" else None
    count_stage(s, "decontamination", len(text), hit is None)
    if hit is not None:
        hits[hit] += 1
        count_drop(stats, record, "contaminated", f"[{hit}] {text[:EXAMPLE_CHARS]}")
        return None
    return {"text": text, "source": record["source"], "cluster_size": int(sizes[row]), **record["meta"]}


def check_splits(outputs, per_source):
    """Refuse a corpus with no document, or with an empty split, naming the settings to change."""
    documents_out = sum(o["documents"] for o in outputs.values())
    if documents_out == 0:
        documents_in = sum(s["documents_in"] for s in per_source.values())
        drops = {name: s["drops"] for name, s in per_source.items()}
        raise DataError(
            f"data.corpus.sources: no document survived ({documents_in} read; drops {drops}); "
            "check the sources and the filter thresholds (data.corpus.min_chars, data.corpus.filters)"
        )
    for split in SPLITS:
        if outputs[split]["documents"] == 0:
            raise DataError(
                f"data.corpus.val_fraction: the {split} split is empty ({documents_out} documents in all); "
                "add documents or change val_fraction"
            )


def write_documents(data_cfg, workdir, tasks, dedup, guard, stats):
    """Pass 3: the survivors written to DIR/docs_{train,val}.jsonl, each file replaced only when both are
    complete. dedup is (rows, clusters, sizes) of the two dedup passes. Returns (outputs, hits)."""
    outputs = {
        split: {"path": docs_path(data_cfg, split), "documents": 0, "text_bytes": 0} for split in SPLITS
    }
    hashes = {split: hashlib.sha256() for split in SPLITS}
    temps = {split: f"{outputs[split]['path']}.{os.getpid()}.tmp" for split in SPLITS}
    hits = collections.Counter()
    files = {}
    # The kept records of pass 1 are an upper bound of what pass 3 writes: check it fits before writing.
    kept_bytes = sum(
        os.path.getsize(os.path.join(workdir, f"kept_{rank:05d}.jsonl")) for rank in range(tasks)
    )
    check_space(outputs["train"]["path"], kept_bytes, what="the corpus's documents")
    try:
        files = {split: open(temps[split], "wb") for split in SPLITS}
        for (record, _), row in zip(merged_records(workdir, tasks), dedup[0], strict=True):
            entry = None if row is None else survivor(record, row, dedup, guard, hits, stats)
            if entry is None:
                continue
            split, s, text = record["split"], stats["sources"][record["source"]], record["text"]
            line = json.dumps(entry, ensure_ascii=False).encode("utf-8") + b"\n"
            files[split].write(line)
            hashes[split].update(line)
            outputs[split]["documents"] += 1
            outputs[split]["text_bytes"] += len(text.encode("utf-8"))
            s["documents_out"] += 1
            s["chars_out"] += len(text)
            s["length_out"][length_bin(len(text))] += 1
        check_splits(outputs, stats["sources"])
        for split in SPLITS:
            files[split].flush()
            os.fsync(files[split].fileno())
            files[split].close()
            os.replace(temps[split], outputs[split]["path"])
    except Exception as e:  # a full disk: one line, the temp files go and the old outputs stay
        problem = storage_error(e, outputs["train"]["path"], what="writing the corpus's documents")
        if problem is None or problem is e:
            raise
        raise problem from e
    finally:
        for split in SPLITS:
            if split in files:
                with contextlib.suppress(OSError):  # closing flushes: on a full disk that fails too
                    files[split].close()
            if os.path.exists(temps[split]):
                os.remove(temps[split])
    for split in SPLITS:
        outputs[split].update(size=os.path.getsize(outputs[split]["path"]), sha256=hashes[split].hexdigest())
    return outputs, hits


def save_corpus(data_cfg, key, stats, outputs, hits, log):
    """The totals into stats, the corpus's record into the manifest, and one line for the terminal."""
    per_source = stats["sources"]
    stats["decontamination"] = dict(hits)
    stats["documents_in"] = sum(s["documents_in"] for s in per_source.values())
    stats["documents_out"] = sum(o["documents"] for o in outputs.values())
    stats["bytes_in"] = sum(s["bytes_in"] for s in per_source.values())
    stats["bytes_out"] = sum(o["text_bytes"] for o in outputs.values())
    stats["undecodable"] = sum(s["undecodable"] for s in per_source.values())
    manifest = read_manifest(data_cfg)
    manifest["corpus"] = {"fingerprint": key, "stats": stats, "outputs": outputs}
    write_json(manifest_path(data_cfg), manifest)
    dropped = collections.Counter()
    for s in per_source.values():
        dropped.update(s["drops"])
    log(
        f"corpus: {stats['documents_in']:,} documents in -> {stats['documents_out']:,} out (train "
        f"{outputs['train']['documents']:,}, val {outputs['val']['documents']:,}); dropped: "
        + (", ".join(f"{reason} {count:,}" for reason, count in dropped.most_common()) or "none")
        + f"; {stats['undecodable']:,} undecodable bytes replaced; {stats['bytes_in'] / 1e6:.2f} MB in, "
        f"{stats['bytes_out'] / 1e6:.2f} MB out -> {data_cfg['dir']}/docs_*.jsonl"
    )


# -----------------------------------------------------------------------------
# Command line


def download(data_cfg, log=print):
    from corpus import hub  # huggingface_hub only when a download is asked for

    return hub.download(data_cfg, log)


def report(data_cfg, log=print):
    import corpus.report  # matplotlib only when a report is asked for

    return corpus.report.write_report(data_cfg, log)


def train_tokenizer(data_cfg, log=print):
    import corpus.encode

    return corpus.encode.train_tokenizer(data_cfg, log)


def encode(data_cfg, log=print):
    import corpus.encode

    return corpus.encode.encode(data_cfg, log)


STEPS = {
    "download": [download],
    "corpus": [build_corpus],
    "tokenizer": [train_tokenizer],
    "encode": [encode],
    "all": [build_corpus, train_tokenizer, encode],
    "report": [report],
}
USAGE = (
    "usage: python -m corpus {download,corpus,tokenizer,encode,all,report} CONFIG [section.key=value ...]\n"
    "       python -m corpus chars-per-token TOKENIZER_MODEL TEXT_FILE [TEXT_FILE ...]"
)


@reports_storage_errors
def main(argv):
    if argv[:1] == ["chars-per-token"]:  # a tokenizer file and text files, no config
        import argparse

        import corpus.encode

        parser = argparse.ArgumentParser(prog="python -m corpus chars-per-token")
        parser.add_argument("model", help="a tokenizer.model, e.g. data/corpus-2060/tokenizer.model")
        parser.add_argument("files", nargs="+", help="UTF-8 text files (FLORES-200: one sentence a line)")
        args = parser.parse_args(argv[1:])
        try:
            corpus.encode.chars_per_token(args.model, args.files)
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if len(argv) < 2 or argv[0] not in STEPS:
        print(USAGE, file=sys.stderr)
        return 2
    import config

    try:
        data_cfg = config.load(argv[1], argv[2:])["data"]
        for step in STEPS[argv[0]]:
            step(data_cfg)
    except config.ConfigError as e:
        print(f"{argv[1]}: config problems:\n  " + str(e).replace("\n", "\n  "), file=sys.stderr)
        return 2
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
