"""
The corpus step's outputs as the later steps read them: where the documents of each split live, the
separator of the byte format, the manifest's record of a finished step, how many processes a step uses, and
the histogram bins the step's statistics and its report share.

Below corpus/pipeline.py (the corpus step and the command line) and beside corpus/encode.py and corpus/report.py,
which read these without importing the command line that imports them.
"""

import json
import os

import numpy as np

from data import DataError, read_manifest

DOCUMENT_SEPARATOR = "\n\n"  # between documents in the byte format
LENGTH_BINS = np.logspace(1, 7, 25)  # document characters, 10 .. 10M, for the report's histograms
SCORE_BINS = np.linspace(0, 1, 21)


def cpu_count():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def processes_of(data_cfg):
    return data_cfg["processes"] or cpu_count()


def docs_path(data_cfg, split):
    return os.path.join(data_cfg["dir"], f"docs_{split}.jsonl")


def outputs_intact(records):
    """True when every recorded output file exists with its recorded size."""
    return all(os.path.exists(r["path"]) and os.path.getsize(r["path"]) == r["size"] for r in records)


def corpus_record(data_cfg):
    """The manifest's record of a finished corpus step, or an error saying to run it."""
    done = read_manifest(data_cfg).get("corpus")
    if not done or not outputs_intact(done["outputs"].values()):
        raise DataError(
            f"{data_cfg['dir']}/docs_*.jsonl: missing; run `python -m corpus corpus CONFIG` first"
        )
    return done


def iter_documents(path):
    with open(path, "rb") as f:
        for line in f:
            yield json.loads(line)["text"]
