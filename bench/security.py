"""
`make bench ARGS=security`: what a hostile request costs the rest of the family (issue 65). The memory
search's words of a 1 MiB message (family/memories.py query_terms, one pass that stops at max_query_terms),
and, on serve/app.py in a subprocess, how long another member's GET /api/me waits while a child sends 1 MiB
logins, 1 MiB messages and messages at serve.max_text_chars that are tokenized and searched; the goal is
at most 50 ms. Rounds and their spread, as every bench here. The run served is serve_bench_run's, or
the one ENLACE_BENCH_RUN names (any run with a sentencepiece tokenizer: the figures are the event loop's,
not the model's).
"""

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from bench.common import ROOT, percentile, spread
from bench.decoding import serve_bench_run
from family import accounts, memories

MIB = 2**20


def distinct_words(size):
    """About `size` bytes of words that are all different: the worst case of the memory search's words."""
    words, total, i = [], 0, 0
    while total < size:
        word = f"palabra{i}"
        words.append(word)
        total, i = total + len(word) + 1, i + 1
    return " ".join(words)[:size]


def bench_query_terms(rounds=5):
    """query_terms of 1 MiB: distinct words (it stops at max_query_terms) and words it skips (short words
    and stopwords: the whole text is read, once)."""
    cfg = memories.load_config()
    skipped = ("de la que el en y a los se del las un por con no una su para es al lo como " * 30000)[:MIB]
    for label, text in (("distinct words", distinct_words(MIB)), ("skipped words", skipped)):
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            memories.query_terms(text, cfg)
            times.append((time.perf_counter() - start) * 1000)
        print(
            f"memory search words of 1 MiB of {label} (query_terms): {spread(times, ',.2f')} ms, {rounds} rounds"
        )


def start_server(run, database, folder):
    command = [sys.executable, "-m", "serve", run, "--port", "0", f"serve.database={database}",
               "serve.tools=false", "serve.compile.cpu='off'", "serve.child.allowed_hours=null",
               "serve.login_throttle.free_failures=1000000", "serve.login_throttle.name_free_failures=1000000",
               "serve.login_max_failures=1000000", f"memory.snapshots.dir={folder}/snapshots"]  # fmt: skip
    log = open(os.path.join(folder, "server.log"), "w")  # noqa: SIM115 (the child's)
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    line = proc.stdout.readline()
    if " at http://" not in line:
        proc.kill()
        proc.wait()
        with open(log.name, encoding="utf-8") as f:
            raise RuntimeError(f"serve/app.py did not start: {line!r}\n{f.read()[-3000:]}")
    return proc, line.split(" at ")[1].split()[0].rstrip("/")


def hostile_requests(url, child, kind, stop, counts):
    """A child's requests of one kind, back to back, until `stop` is set."""
    big = distinct_words(MIB - 4096)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {child}"}, timeout=120) as http:
        while not stop.is_set():
            if kind == "1 MiB login":
                http.post("/api/login", json={"name": "ana", "password": big})
            elif kind == "1 MiB message":
                http.post(
                    "/v1/chat/completions",
                    json={"model": "x", "messages": [{"role": "user", "content": big}]},
                )
            else:  # a message at the text limit: read, tokenized, its memories searched, one token generated
                text = big[: counts["max_text_chars"]]
                http.post("/v1/chat/completions", json={"model": counts["model"], "max_tokens": 1,
                                                        "messages": [{"role": "user", "content": text}]})  # fmt: skip
            counts[kind] = counts.get(kind, 0) + 1


def other_member_waits(url, adult, seconds):
    """Milliseconds of each GET /api/me of another member during `seconds`."""
    waits = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {adult}"}) as http:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.perf_counter()
            assert http.get("/api/me").status_code == 200
            waits.append((time.perf_counter() - start) * 1000)
            time.sleep(0.01)
    return waits


def bench_security(rounds=3, seconds=5.0):
    bench_query_terms()
    kinds = ("idle", "1 MiB login", "1 MiB message", "message at max_text_chars")
    with tempfile.TemporaryDirectory(prefix="bench-security-") as folder:
        run = os.environ.get("ENLACE_BENCH_RUN") or serve_bench_run(folder)
        database = os.path.join(folder, "familia.sqlite")
        family = accounts.Store(database)
        adult, child = family.add_member("ana", "adult"), family.add_member("leo", "child")
        family.set_password("ana", accounts.hash_password("clave-de-ana", {"n": 16384, "r": 8, "p": 1}))
        proc, url = start_server(run, database, folder)
        try:
            model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {adult}"}).json()
            counts = {"model": model["data"][0]["id"], "max_text_chars": 32768}
            p50s, maxes = {k: [] for k in kinds}, {k: [] for k in kinds}
            for _ in range(rounds):
                for kind in kinds:
                    stop = threading.Event()
                    hostile = None
                    if kind != "idle":
                        hostile = threading.Thread(
                            target=hostile_requests, args=(url, child, kind, stop, counts)
                        )
                        hostile.start()
                        time.sleep(0.5)
                    waits = other_member_waits(url, adult, seconds)
                    stop.set()
                    if hostile:
                        hostile.join()
                    p50s[kind].append(statistics.median(waits))
                    maxes[kind].append(percentile(waits, 0.99))
        finally:
            proc.kill()
            proc.wait()
    print(f"another member's GET /api/me while a child sends requests back to back, {rounds} rounds of "
          f"{seconds:.0f} s: median (min-max over rounds) in ms; goal: p99 <= 50 ms")  # fmt: skip
    print(f"{'hostile requests':28s} {'p50 ms':>22s} {'p99 ms':>22s} {'hostile sent':>12s}")
    for kind in kinds:
        sent = counts.get(kind, 0)
        print(f"{kind:28s} {spread(p50s[kind], ',.1f'):>22s} {spread(maxes[kind], ',.1f'):>22s} {sent:>12}")
