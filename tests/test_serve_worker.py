"""serve/worker.py's continuous batching with the real (tiny) model: answers decoded together are token for
token the answers each request gets alone; rows join, leave, are cancelled or fail without touching the
others; an agent turn's tools run while the other rows go on decoding; the KV cache's memory is checked at
start. The server's other behaviour (streaming, stop strings, caps, the queue) is tests/test_serve.py's."""

import asyncio
import contextlib
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from conftest import ROOT, live_server

from agent import tools
from decode import kvcache, load
from serve import app, worker

NO_TOOLS = "serve.tools=false"


def paced(worker, expected, per_step=2, wait=30):
    """The worker's batch steps only as fast as requests arrive: its k-th step waits until `per_step` * k of
    the `expected` requests have been submitted. With the tiny model's sub-millisecond steps, requests
    started a few milliseconds apart would otherwise overlap or not as the machine's speed decides (8 rows
    at once on one CPU, 7 on another); paced, rows still join a step or so apart, on any CPU."""
    advance, submit = worker.decoder.advance, worker.submit
    arrived, steps = threading.Condition(), [0, 0]  # submitted, stepped

    def counting_submit(job):
        submit(job)
        with arrived:
            steps[0] += 1
            arrived.notify_all()

    def paced_advance(tokens):
        steps[1] += 1
        with arrived:
            arrived.wait_for(lambda: steps[0] >= min(expected, per_step * steps[1]), timeout=wait)
        advance(tokens)

    worker.submit, worker.decoder.advance = counting_submit, paced_advance


def record_tokens(worker):
    """{prompt ids: the token ids sampled for the latest row with that prompt}, as the worker's decoder
    samples them."""
    tokens, add, sample_rows = {}, worker.decoder.add, worker.decoder.sample_rows

    def recording_add(prompt, *args, **kwargs):
        row = add(prompt, *args, **kwargs)
        row.prompt = tuple(prompt)
        tokens[row.prompt] = []
        return row

    def recording_sample_rows(rows):  # Decoder.sample draws through it too
        drawn = sample_rows(rows)
        for row, token in drawn.items():
            tokens[row.prompt].append(token)
        return drawn

    worker.decoder.add, worker.decoder.sample_rows = recording_add, recording_sample_rows
    return tokens


class Exploding:
    """A constraint that breaks at its `after`-th token: a generation that raises midway."""

    def __init__(self, after):
        self.after, self.count = after, 0

    def mask(self, logits):
        if self.count == self.after:
            raise RuntimeError("constraint state corrupted at /secret/path/grammar.py:9")
        return logits

    def accept(self, token):
        self.count += 1


def request(i, max_tokens, temperature, seed, **fields):
    words = " ".join(["hola"] * (1 + 3 * i))
    return {"model": "chat", "messages": [{"role": "user", "content": f"{words} {i}"}], "max_tokens": max_tokens,
            "temperature": temperature, "seed": seed} | fields  # fmt: skip


def post(url, key, body):
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=120)  # fmt: skip


def leave_midway(url, key, body):
    """Stream the answer and disconnect after a few chunks."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True},
                      headers={"Authorization": f"Bearer {key}"}) as answer:  # fmt: skip
        for _, _ in zip(range(20), answer.iter_lines(), strict=False):
            pass


BROKEN_SEED = 666


# Eager with one-pass prefills, and the step compiled ahead of time with the prefix cache (the shipped
# default) on.
DECODING = {"eager": ("serve.prefix_cache.mib=0",), "aot+prefix_cache": ("serve.compile.cpu=aot",)}


@pytest.mark.parametrize("decoding", DECODING.values(), ids=DECODING.keys())
def test_answers_decoded_together_are_token_for_token_their_solo_answers(
    chat_model, tmp_path, monkeypatch, decoding
):
    class JobWithBrokenConstraint(worker.Job):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.seed == BROKEN_SEED:
                self.constraint = Exploding(after=5)

    monkeypatch.setattr(worker, "Job", JobWithBrokenConstraint)
    # 8 requests of different prompt and answer lengths, greedy and seeded at 0.8; one more that the client
    # abandons midway and one whose generation raises: ten requests for eight slots.
    bodies = [request(i, 12 + 7 * i, 0.0 if i % 2 == 0 else 0.8, 100 + i) for i in range(8)]
    abandoned, broken = request(8, 300, 0.8, 8), request(9, 40, 0.8, BROKEN_SEED)
    settings = (NO_TOOLS, "serve.max_batch=8", "serve.max_pending_per_member=16", *decoding)
    with live_server(chat_model, tmp_path, *settings) as (url, server):
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # compiled at start, if at all
        builds = getattr(server.worker.decoder.compiled_step, "builds", None)  # decode/aot.py's
        key = server.store.add_member("ana", "adult")
        tokens = record_tokens(server.worker)
        alone = [post(url, key, body).json() for body in bodies]
        tokens_alone = dict(tokens)
        paced(server.worker, expected=len(bodies) + 2)
        together, failed = [None] * len(bodies), {}

        def ask(i):
            together[i] = post(url, key, bodies[i]).json()

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
        threads.insert(3, threading.Thread(target=leave_midway, args=(url, key, abandoned)))
        threads.insert(5, threading.Thread(target=lambda: failed.update(answer=post(url, key, broken))))
        for thread in threads:  # each joins the batch a few steps after the one before
            thread.start()
            time.sleep(0.015)
        for thread in threads:
            thread.join()
        deadline = time.monotonic() + 10
        while server.worker.stats["cancelled"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        admin = {"Authorization": f"Bearer {server.store.add_member('root', 'admin')}"}
        status = httpx.get(url + "/api/server", headers=admin).json()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # no request compiled anything
    assert getattr(server.worker.decoder.compiled_step, "builds", None) == builds
    assert [together[i] | {"id": None, "created": None} for i in range(8)] == [
        answer | {"id": None, "created": None} for answer in alone
    ]
    assert {prompt: tokens[prompt] for prompt in tokens_alone} == tokens_alone  # token for token
    seeded = [tokens_alone[prompt] for prompt in list(tokens_alone)[1::2]]
    assert all(len(set(answer)) > 5 for answer in seeded) and len({tuple(a) for a in seeded}) == 4
    assert (
        status["peak_active"] == 8
        and status["cancelled"] == 1
        and (status["active"], status["queued"]) == (0, 0)
    )
    assert status["slots"] == 8 and status["tokens_per_s"] > 0 and status["answered"] == 16
    counts = sorted(len(tokens[prompt]) for prompt in tokens if prompt not in tokens_alone)
    assert 5 in counts and max(counts) < 300  # one raised at its 6th token, the other stopped midway
    assert failed["answer"].status_code == 500
    assert failed["answer"].json() == {"error": {"message": "generation failed on the server", "type": "server_error",
                                                 "param": None, "code": "generation_failed"}}  # fmt: skip


def test_the_prefix_cache_shares_the_servers_prompt_between_members_and_nothing_a_member_wrote(
    chat_model, tmp_path
):
    body = request(5, 8, 0.0, 1)
    with live_server(chat_model, tmp_path, NO_TOOLS, "serve.prefix_cache.block_tokens=8") as (url, server):
        members = {name: server.store.add_member(name, "adult") for name in ("ana", "ben")}
        cache, add, added = server.worker.decoder.prefix_cache, server.worker.decoder.add, []

        def recording_add(prompt, *args, **kwargs):
            added.append((list(prompt), kwargs["scope"], kwargs["shared"], cache.stats["reused_tokens"]))
            return add(prompt, *args, **kwargs)

        server.worker.decoder.add = recording_add
        answers = [post(url, members[name], body).json()["choices"] for name in ("ana", "ben", "ana")]
        reused = [after - before for (*_, before), (*_, after) in zip(added, added[1:], strict=False)]
        reused.append(cache.stats["reused_tokens"] - added[-1][3])
        blocks = list(cache.blocks)
    assert answers[0] == answers[1] == answers[2]  # a restored block holds what its prefill computes
    (prompt, ana, shared, _), (_, ben, _, _) = added[:2]
    assert ana != ben and [scope for _, scope, _, _ in added] == [ana, ben, ana]
    assert 8 <= shared < len(prompt) - 8  # the system turn is everyone's; the user's message is ana's
    assert reused == [0, shared // 8 * 8, (len(prompt) - 1) // 8 * 8]  # ben: the system turn's blocks only
    assert {scope for scope, ids in blocks if len(ids) > shared} == {("member", ana), ("member", ben)}


def test_int8_weights_without_the_kernel_and_torch_compile_on_a_cpu_are_refused_naming_what_to_set(
    chat_model,
):
    # Both were retired (docs/rendimiento.md): the kernel's int8 and the step ahead of time measured faster.
    model = chat_model[0]
    settings = app.load_settings(
        app.DEFAULT_CONFIG, ["serve.weights.cpu=int8", "serve.matvec_kernel.cpu=false"]
    )
    with pytest.raises(load.LoadError, match=r"serve.weights.cpu=int8 runs through ENLACE's kernel: set "
                                             r"serve.matvec_kernel.cpu=true \(or serve.weights.cpu=float32\)"):  # fmt: skip
        load.prepare_weights(model, settings, "cpu")
    with pytest.raises(app.ServeError) as refused:
        app.load_settings(app.DEFAULT_CONFIG, ["serve.compile.cpu=inductor"])
    assert "serve.compile.cpu: 'inductor' is not allowed; allowed: 'off', 'aot'" in str(refused.value)


def test_without_the_kernel_float32_products_split_in_matvec_parts_blocks_and_one_block_is_the_model(
    chat_model,
):
    from decode.weights import SplitLinear

    model = chat_model[0]
    plain = app.load_settings(
        app.DEFAULT_CONFIG, ["serve.matvec_kernel.cpu=false", "serve.matvec_parts.cpu=1"]
    )
    assert load.prepare_weights(model, plain, "cpu") is model
    settings = app.load_settings(app.DEFAULT_CONFIG, ["serve.matvec_kernel.cpu=false"])
    split = load.prepare_weights(model, settings, "cpu")  # serve.matvec_parts.cpu: 2
    blocks = {m.parts for m in split.modules() if isinstance(m, SplitLinear)}
    assert blocks == {2} and split.checkpoint_path == model.checkpoint_path
    assert split.lm_head.weight is model.lm_head.weight  # the same weights, not a copy


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="the kernel needs AVX2"
)
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_by_default_a_cpu_decodes_through_the_kernel_compiled_or_not_and_answers_requests(
    chat_model, tmp_path, dtype
):
    from decode.weights import KernelLinear

    model = chat_model[0]
    settings = app.load_settings(app.DEFAULT_CONFIG, [f"serve.weights.cpu={dtype}"])
    served = load.prepare_weights(model, settings, "cpu")
    layers = [m for m in served.modules() if isinstance(m, KernelLinear)]
    assert layers and {str(layer.weight.dtype) for layer in layers} == {f"torch.{dtype}"}
    assert served.checkpoint_path == model.checkpoint_path
    with live_server(chat_model, tmp_path, NO_TOOLS, model=served) as (url, server):
        key = server.store.add_member("ana", "adult")
        answer = post(url, key, request(1, 6, 0.0, 1))
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1


# -----------------------------------------------------------------------------
# The worker itself, driven as serve/app.py drives it


@contextlib.contextmanager
def event_loop():
    """An asyncio loop on a thread of its own: the loop a request's Job sends its events to."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def events_of(job, timeout=60):
    """The job's events up to its "done" or "error"."""
    events = []
    while not events or events[-1][0] not in ("done", "error"):
        events.append(asyncio.run_coroutine_threadsafe(job.events.get(), job.loop).result(timeout))
    return events


def text_of(events):
    return "".join(event[1] for event in events if event[0] == "text")


class Forced:
    """A constraint that allows only the next token of `sequence`, then anything."""

    def __init__(self, sequence):
        self.sequence, self.count = sequence, 0

    def mask(self, logits):
        if self.count >= len(self.sequence):
            return logits
        allowed = logits.new_full(logits.shape, float("-inf"))
        allowed[self.sequence[self.count]] = 0.0
        return logits + allowed

    def accept(self, token):
        self.count += 1


def test_an_agent_turns_tool_runs_off_the_batch_while_the_other_rows_go_on(chat_model):
    model, tokenizer = chat_model[:2]
    end = tokenizer.special_ids["<|end|>"]
    call = '<tool_call>\n{"name": "calculadora", "arguments": {"expresion": "6*7"}}\n</tool_call>'
    results, calling, release = [], threading.Event(), threading.Event()
    helper = tools.Agent(tools.load_settings(), tool_names=["calculadora"],
                         on_event=lambda kind, info: results.append(info["text"]) if kind == "result" else None)  # fmt: skip
    run_tool = helper.call

    def slow_tool(parsed, context=None):  # the tool holds until the plain rows have finished
        calling.set()
        assert release.wait(60)
        return run_tool(parsed, context)

    helper.call = slow_tool
    plain = [[tokenizer.bos_id, *tokenizer.encode(text)] for text in ("Había una vez", "El gato", "Mañana")]
    pool = worker.Worker(model, tokenizer, queue_size=8, max_batch=4)
    try:
        with event_loop() as loop:

            def job(prompt, seed, turn=None, max_tokens=20):
                made = worker.Job(loop, prompt, max_tokens, 0.8, 1.0, 50, seed, turn)
                pool.submit(made)
                return made

            solos = [text_of(events_of(job(prompt, seed))) for seed, prompt in enumerate(plain)]
            messages = [{"role": "user", "content": "¿Cuánto es 6 por 7?"}]
            forced = tokenizer.encode(call) + [end]
            turn = job(plain[0], 9, (helper, messages), max_tokens=len(forced) + 20)
            turn.constraint = Forced(forced)  # the model "decides" to call the tool
            assert calling.wait(60)
            during = [job(prompt, seed) for seed, prompt in enumerate(plain)]
            batched = [text_of(events_of(each)) for each in during]  # they finish while the tool runs
            assert not release.is_set()
            release.set()
            turn_events = events_of(turn)
    finally:
        pool.close()
    assert batched == solos
    assert turn_events[-1][0] == "done" and results == ["42"] and pool.stats["tool_calls"] == 1
    assert "<tool_call>" not in text_of(turn_events) and pool.status()["active"] == 0


# -----------------------------------------------------------------------------
# The KV cache's memory, at start


def test_the_kv_cache_is_sized_at_start_and_a_max_batch_that_cannot_fit_is_refused(
    chat_model, chat_run, tmp_path, capsys
):
    model = chat_model[0]
    settings = app.load_settings(app.DEFAULT_CONFIG, ["serve.max_batch=64", "serve.max_kv_cache_mib=1"])
    # 2 layers x (keys, values) x 2 kv heads x 256 positions x 8 dims x 4 bytes = 64 KiB per slot
    assert kvcache.kv_cache_bytes(model, 1) == 64 * 1024
    with pytest.raises(load.LoadError) as refused:
        load.check_kv_cache(model, settings, "cpu")
    assert str(refused.value) == ("serve.max_batch=64: the KV cache needs 4.0 MiB (64 KiB per slot), more than "
                                  "serve.max_kv_cache_mib=1; set serve.max_batch to at most 16")  # fmt: skip
    load.check_kv_cache(model, settings | {"max_batch": 16}, "cpu")
    assert "KV cache 16 slots x 64 KiB = 1.0 MiB" in capsys.readouterr().err
    with pytest.raises(load.LoadError, match=r"more than the .* free on cpu; set serve.max_batch to at most"):
        load.check_kv_cache(model, settings | {"max_batch": 10**9, "max_kv_cache_mib": None}, "cpu")
    with pytest.raises(app.ServeError, match="max_batch"):
        app.load_settings(app.DEFAULT_CONFIG, ["serve.max_batch=0"])
    # serve/app.py itself: the refusal is a clear error and exit status 2, before it listens.
    database = f"serve.database={tmp_path / 'kv.sqlite'}"
    started = subprocess.run([sys.executable, "-m", "serve", chat_run, "--port", "0", database, "serve.max_batch=64",
                              "serve.max_kv_cache_mib=1"], cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert started.returncode == 2 and "Traceback" not in started.stderr
    assert "error: serve.max_batch=64: the KV cache needs 4.0 MiB" in started.stderr
