"""
`make bench ARGS=search`, `ARGS=serve` and `ARGS=memory`: the search providers, the server under load,
memory retrieval against a model turn.
"""

import gzip
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import yaml

import config
import data
import model
import search
from bench.common import ROOT, layer, per_call_seconds, percentile
from bench.decoding import bench_decoding, serve_bench_run
from bench.llama_cpp import bench_llama
from decode import engine

# -----------------------------------------------------------------------------
# search: parse time per page, and what the provider chain costs when the primary answers


def serve_fixture(body, content_type):
    """A keep-alive HTTP server on 127.0.0.1 answering every GET and POST with one body; returns it."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the PoolManager would get from the real services
        disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms delayed-ACK stall

        def answer(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = answer

        def log_message(self, format, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def bench_search():
    fixtures = os.path.join(ROOT, "tests", "fixtures", "search")
    with open(os.path.join(fixtures, "ddg_lite_results.html"), "rb") as f:
        lite_page = f.read()
    with open(os.path.join(fixtures, "brave_web_results.json"), "rb") as f:
        brave_body = f.read()
    lite_text = lite_page.decode("utf-8")

    lite_s = per_call_seconds(lambda: search.parse_ddg_lite(lite_text), 300)
    brave_s = per_call_seconds(lambda: search.parse_brave(brave_body), 300)
    print(
        f"search: parse DuckDuckGo lite page ({len(lite_page) / 1024:.1f} KiB, 10 results) "
        f"{1e3 * lite_s:.2f} ms/page | Brave JSON ({len(brave_body) / 1024:.1f} KiB, 19 results) "
        f"{1e3 * brave_s:.2f} ms/answer (median of 300)"
    )

    # The chain is the auto chain (DuckDuckGo, then Brave); DuckDuckGo answers, so Brave is never asked.
    # Both paths share one pool and one server, and alternate, so drift on a busy machine hits both alike.
    server = serve_fixture(lite_page, "text/html; charset=UTF-8")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/lite/"
        env = {"ENLACE_DDG_URL": url, "ENLACE_BRAVE_URL": url, "BRAVE_API_KEY": "bench-not-a-key"}
        chain = search.SearchChain.from_env("auto", env=env)
        ddg = chain.providers[0]
        region = search.parse_region("es-es")
        via_chain = lambda: chain.search("weather san francisco", 10, "es-es")  # noqa: E731
        direct = lambda: ddg.search("weather san francisco", 10, region)  # noqa: E731
        chain_times, direct_times = [], []
        for _ in range(5):
            chain_times.append(per_call_seconds(via_chain, 40))
            direct_times.append(per_call_seconds(direct, 40))
        chain_s, direct_s = statistics.median(chain_times), statistics.median(direct_times)
        answer = via_chain()
    finally:
        server.shutdown()
        server.server_close()
    print(
        f"search: query against a local server: via the chain {1e3 * chain_s:.2f} ms, DuckDuckGo provider "
        f"directly {1e3 * direct_s:.2f} ms -> chain/direct {chain_s / direct_s:.3f} "
        f"({1e6 * (chain_s - direct_s):+.0f} us; answered by {answer.provider}, {len(answer.results)} results, "
        f"{len(answer.attempts)} failed attempts)"
    )


# -----------------------------------------------------------------------------
# serve: the server under 20 concurrent clients, against the same generations done directly


def bench_serve(clients=20, requests_per_client=10, max_tokens=8, new_tokens=64, repeats=3):
    """Continuous batching, side by side in one run: aggregate decode rates at 1, 2, 4 and 8 streams for the
    served smoke run and the tiny-50m shape; the `clients` x `requests_per_client` load test through
    serve/app.py with max_batch 1 (one answer at a time) and the default max_batch; 8 members over HTTP at
    once against one at a time; then the bandwidth section and decoding against llama.cpp (bench/llama_cpp.py)."""
    import checkpoint

    print(f"serve: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs, torch with "
          f"{torch.get_num_threads()} threads", flush=True)  # fmt: skip
    batch = config.load_layer("serve", os.path.join(ROOT, "configs", "serve", "default.yaml"))["max_batch"]
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as folder:
        run = serve_bench_run(folder)
        smoke = checkpoint.load_run(run, log=lambda message: None)[0]
        torch.manual_seed(0)
        tiny_cfg = layer("model", "tiny-50m")
        tiny = model.Transformer(tiny_cfg).eval()  # random weights: the rates do not depend on them
        name = os.path.basename(run)
        for label, net in ((name, smoke), ("tiny-50m (random weights)", tiny)):
            scaling_table(label, net, served_decoders(net, (1, batch)), new_tokens, repeats)
        # The load test of before batching (short answers: each request's own prefill weighs), then the same
        # with answers of new_tokens, where the rows have more decoding to share.
        for answer_tokens in (max_tokens, new_tokens):
            sequential = load_test(run, folder, clients, requests_per_client, answer_tokens, 1)
            batched = load_test(run, folder, clients, requests_per_client, answer_tokens, batch)
            print(
                f"serve: {clients} clients x {requests_per_client} requests (up to {answer_tokens} greedy tokens): "
                f"latency p95 {1e3 * batched['p95']:.0f} ms with max_batch={batch} vs "
                f"{1e3 * sequential['p95']:.0f} ms with max_batch=1 -> {batched['p95'] / sequential['p95']:.2f} "
                f"(target <= 0.33); requests/s {batched['rps'] / sequential['rps']:.2f}x",
                flush=True,
            )
        http_streams(serve_bench_run(folder, shipped=False), folder)  # answers that run to max_tokens
    print(f"serve: load average {os.getloadavg()[0]:.1f} at the end", flush=True)
    bench_decoding(new_tokens, repeats)
    bench_llama()


def served_decoders(net, slot_counts):
    """{slots: an empty, compiled engine.Decoder} of net as the server decodes it on this CPU: the weights
    (decode/load.py prepare_weights) and decode step (decoding_options) of configs/serve/default.yaml."""
    from decode import load

    settings = config.load_layer("serve", os.path.join(ROOT, "configs", "serve", "default.yaml"))
    served = load.prepare_weights(net, settings, "cpu")
    decoding = load.decoding_options(settings, "cpu")
    decoders = {}
    for slots in slot_counts:
        decoders[slots] = engine.Decoder(served, slots, allocate=True, **decoding)
        if decoders[slots].compiled_step is not None:
            decoders[slots].compile()
    return decoders


def stream_rate(decoder, streams, new_tokens):
    """Generated tokens per second of `streams` answers of new_tokens each (after 32-token prompts,
    prefills included, sampled at 0.8 with their own seeds, no stop token) decoded by `decoder` (an empty
    engine.Decoder): what the server's worker does, without HTTP."""
    import sample

    vocab = decoder.model.cfg["vocab_size"]
    prompts = [torch.randint(0, vocab, (32,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(streams)]  # fmt: skip

    def seeded(index):
        return {"temperature": 0.8, "top_k": 50, "generator": torch.Generator().manual_seed(index)}

    start = time.perf_counter()
    answers = sample.generate_batch(
        decoder.model, prompts, new_tokens, decoder.slots, seeded, decoder=decoder
    )
    return sum(map(len, answers)) / (time.perf_counter() - start)


def scaling_table(label, net, decoders, new_tokens, repeats):
    """The aggregate rate at 1, 2, 4 and 8 streams with the largest of `decoders` ({slots: Decoder}, as
    served_decoders), against one stream with one slot (the server at max_batch 1); the configurations
    interleave, medians of repeats."""
    batch = max(decoders)
    cases = [(1, 1)] + [(streams, batch) for streams in (1, 2, 4, 8) if streams <= batch]
    stream_rate(decoders[batch], 2, 4)  # warm-up
    rates = {case: [] for case in cases}
    for _ in range(repeats):
        for streams, slots in cases:
            rates[(streams, slots)].append(stream_rate(decoders[slots], streams, new_tokens))
    rates = {case: statistics.median(values) for case, values in rates.items()}
    print(f"serve: decode scaling, {label} ({net.num_params() / 1e6:.1f}M parameters) as served "
          f"(configs/serve/default.yaml), answers of {new_tokens} tokens, median of {repeats}:")  # fmt: skip
    print("serve:   streams | max_batch | tokens/s | x one stream at max_batch=1")
    for (streams, slots), rate in rates.items():
        print(f"serve:   {streams:7d} | {slots:9d} | {rate:8.1f} | {rate / rates[(1, 1)]:.2f}")


def start_server(run, database, queue_size, max_batch):
    """(process, base URL) of `python -m serve RUN` on a free port of 127.0.0.1, once it listens."""
    command = [sys.executable, "-m", "serve", run, "--port", "0", f"serve.database={database}",
               f"serve.queue_size={queue_size}", f"serve.max_batch={max_batch}"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return proc, proc.stdout.readline().split(" at ")[1].split()[0].rstrip("/")


def http_streams(run, folder, members=8, answer_tokens=48, rounds=3):
    """End to end as a family sees it: `members` members of one server (max_batch = members), each asking
    over HTTP for a greedy answer of up to answer_tokens tokens to its own question (`run`: one whose
    answers seldom end sooner, such as serve_bench_run's 2-step stand-in). One stream: the questions one
    after another; then all members at once. Generated tokens per second of wall time (the usage the
    server reports), medians of `rounds`; and whether each answer at once is its answer alone."""
    import httpx

    from family import accounts

    database = os.path.join(folder, f"bench-http-{members}.sqlite")
    store = accounts.Store(database)
    keys = [store.add_member(f"m{i}", "adult") for i in range(members)]
    proc, url = start_server(run, database, members, members)
    model_id = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {keys[0]}"}).json()["data"][
        0
    ]["id"]

    def ask(index, answers):
        question = f"Hola, soy {index + 1}. ¿Me cuentas algo de la ciudad número {index + 1}?"
        body = {"model": model_id, "messages": [{"role": "user", "content": question}],
                "max_tokens": answer_tokens, "temperature": 0}  # fmt: skip
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=600,
                           headers={"Authorization": f"Bearer {keys[index]}"}).json()  # fmt: skip
        answers[index] = (reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"])

    try:
        ask(0, {})  # warm-up
        alone, together, solo, batched = [], [], {}, {}
        for _ in range(rounds):
            start = time.perf_counter()
            for index in range(members):
                ask(index, solo)
            alone.append(sum(tokens for _, tokens in solo.values()) / (time.perf_counter() - start))
            threads = [threading.Thread(target=ask, args=(index, batched)) for index in range(members)]
            start = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            together.append(sum(tokens for _, tokens in batched.values()) / (time.perf_counter() - start))
    finally:
        proc.kill()
        proc.wait()
    mean_tokens = statistics.mean(tokens for _, tokens in batched.values())
    same = sum(solo[index][0] == batched[index][0] for index in range(members))
    ratios = [many / one for many, one in zip(together, alone, strict=True)]
    print(f"serve: over HTTP, {members} members of one server (max_batch={members}), greedy answers of "
          f"{mean_tokens:.0f} tokens on average (up to {answer_tokens}): one at a time "
          f"{statistics.median(alone):.0f} tok/s, all at once {statistics.median(together):.0f} tok/s -> "
          f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}, {rounds} rounds; target >= 4); "
          f"{same}/{members} answers identical to the answer alone", flush=True)  # fmt: skip


def load_test(run, folder, clients, requests_per_client, max_tokens, max_batch):
    """requests/s and latency of serve/app.py (a real process on 127.0.0.1) with `clients` threads, one member
    each, sending `requests_per_client` greedy chat completions; and the server's wall seconds per answer
    over the seconds its worker spent generating (the same answers without HTTP, queue or JSON)."""
    import httpx

    from family import accounts

    database = os.path.join(folder, f"bench-{max_batch}-{max_tokens}.sqlite")
    store = accounts.Store(database)
    admin = store.add_member("admin", "admin")
    keys = [store.add_member(f"c{i}", "adult") for i in range(clients)]
    proc, url = start_server(run, database, clients, max_batch)
    try:
        admin_headers = {"Authorization": f"Bearer {admin}"}
        model_id = httpx.get(url + "/v1/models", headers=admin_headers).json()["data"][0]["id"]
        messages = [{"role": "user", "content": "Hola, ¿me cuentas un cuento corto?"}]
        body = {"model": model_id, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        latencies, statuses, lock = [], [], threading.Lock()

        def client(key, count):
            with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=300) as http:
                for _ in range(count):
                    start = time.perf_counter()
                    status = http.post(url + "/v1/chat/completions", json=body).status_code
                    with lock:
                        latencies.append(time.perf_counter() - start)
                        statuses.append(status)

        client(admin, 3)  # warm-up, not counted
        latencies.clear()
        statuses.clear()
        before = httpx.get(url + "/api/server", headers=admin_headers).json()
        rss_before = serve_rss_kib(proc.pid)
        threads = [threading.Thread(target=client, args=(key, requests_per_client)) for key in keys]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
        after = httpx.get(url + "/api/server", headers=admin_headers).json()
        rss_after = serve_rss_kib(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    answered = statuses.count(200)
    served_s = wall / max(answered, 1)
    generate_s = (after["generate_s"] - before["generate_s"]) / max(after["answered"] - before["answered"], 1)
    others = len(statuses) - answered - statuses.count(503)
    result = {"p50": percentile(latencies, 0.5), "p95": percentile(latencies, 0.95), "rps": answered / wall}
    tokens = after["generated_tokens"] - before["generated_tokens"]
    print(
        f"serve: max_batch={max_batch}, up to {max_tokens} tokens: {answered}/{len(statuses)} answered "
        f"({statuses.count(503)} refused 503, {others} other) | {result['rps']:.1f} requests/s, "
        f"{tokens / wall:.0f} tokens/s | latency p50 {1e3 * result['p50']:.0f} ms, p95 {1e3 * result['p95']:.0f} ms "
        f"| {after['peak_active']} rows at most in a step | server RSS {rss_before / 1024:.0f} -> "
        f"{rss_after / 1024:.0f} MiB | {1e3 * served_s:.1f} ms of wall time per answer, {1e3 * generate_s:.1f} ms "
        "of worker time",
        flush=True,
    )
    return result


def serve_rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


# memory: retrieval for a turn among 100k memories, against the time of the turn itself


def bench_memory(count=100_000, members=6, queries=300, new_tokens=64):
    """Retrieval latency (memory.context_for_turn: pinned + top-k bm25 within the token budget) over
    `count` memories of `members` members, queries being other sentences of the embedded corpus; and its
    share of a whole turn with the smoke model's shape (vocab 4096 as make smoke-corpus trains it): a
    prompt filling the window but `new_tokens`, then `new_tokens` generated with the KV cache."""
    import random

    from family import memories

    with gzip.open(os.path.join(ROOT, "corpus", "fortunes-es.txt.gz"), "rt", encoding="utf-8") as f:
        sentences = [s.strip() for s in f.read().replace("\n", " ").split(".") if 20 < len(s.strip()) < 300]
    rng = random.Random(0)
    names = [f"miembro{i}" for i in range(members)]
    cfg = memories.load_config()
    count_tokens = lambda text: len(data.ByteTokenizer().encode(text))  # noqa: E731 - >= a BPE's count
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as folder:
        conn = memories.connect(os.path.join(folder, "familia.db"), cfg)
        stamp = memories.now_text()
        rows = [
            (
                rng.choice(names),
                "family" if rng.random() < 0.2 else "private",
                rng.choice(sentences),
                int(rng.random() < 3e-4),
                "manual",
                stamp,
                stamp,
            )
            for _ in range(count)
        ]
        with conn:
            conn.executemany(
                "INSERT INTO memories (member, scope, text, pinned, source, created, updated) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
        times, lengths = [], []
        for _ in range(queries):
            question = rng.choice(sentences)
            start = time.perf_counter()
            context = memories.context_for_turn(conn, rng.choice(names), "adult", question, cfg, count_tokens)
            times.append(time.perf_counter() - start)
            lengths.append(context.count("\n- ["))
        conn.close()
    times.sort()
    p50, p95 = times[len(times) // 2], times[int(0.95 * len(times))]

    with open(os.path.join(ROOT, "configs", "model", "smoke.yaml"), encoding="utf-8") as f:
        model_cfg = dict(yaml.safe_load(f)["model"], vocab_size=4096)
    torch.manual_seed(0)
    net = model.Transformer(model_cfg).eval()
    prompt = torch.randint(0, model_cfg["vocab_size"], (model_cfg["seq_len"] - new_tokens,))

    def turn():
        with torch.no_grad():
            for _ in engine.generate(net, prompt, new_tokens, temperature=1.0, top_k=50):
                pass

    # One thread, like the retrieval: a loaded machine stretches a multi-threaded turn far more, which
    # would flatter the share.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        turn_s = per_call_seconds(turn, repeats=5)
    finally:
        torch.set_num_threads(threads)
    print(
        f"memory: {count:,} memories of {members} members, {queries} queries: retrieval p50 "
        f"{1000 * p50:.1f} ms, p95 {1000 * p95:.1f} ms ({statistics.mean(lengths):.1f} memories per turn)"
    )
    print(
        f"memory: a smoke-model turn ({len(prompt)}-token prompt + {new_tokens} tokens, 1 thread) takes "
        f"{1000 * turn_s:.0f} ms; retrieval p95 is {100 * p95 / (p95 + turn_s):.1f}% of the turn (target < 5%)"
    )


# -----------------------------------------------------------------------------
