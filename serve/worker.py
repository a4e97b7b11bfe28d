"""
serve/app.py's model worker: continuous batching. One decode thread keeps up to serve.max_batch answers going
at once as the rows of an engine.Decoder. Each step samples every row's next token (with the row's own
temperature, top_p, top_k, seeded generator and constraint), streams it to the request as whole characters
(data.StreamDecoder), and feeds the rows that go on their tokens in one batched forward pass. A new job
joins at the next step (its prompt prefilled on its own into a free slot); a finished, cancelled or failed
one leaves at once and frees its slot. Jobs wait for a slot in a bounded queue (a full queue raises Busy,
which the server answers with 503 and Retry-After). A row's tokens do not depend on the other rows
(decode/engine.decode_step), so an answer is the one the request gets alone. With max_batch 1 the
worker answers one request at a time, as it did before batching.

An agent turn runs agent/tools.py's loop on a thread of its own: each of its generations joins the batch as a
row, and while the server's tools run (on that thread) it holds no slot and the other rows go on decoding.
Knows nothing of HTTP: serve/app.py (with serve/openai_api.py) checks requests, renders prompts and shapes the
answers.
"""

import asyncio
import collections
import sys
import threading
import time

import data
from agent import grammar, tools
from chat import template, visible


class Job:
    """One answer: the worker sends ("text", piece) events, then ("done", finish_reason, completion tokens,
    prompt tokens) or ("error", message), to the request's event loop. cancel() makes the worker stop at
    the next token (its "done" then has finish_reason None). With `turn` = (agent.Agent, messages) the
    answer is an agent turn: the server's tools run between generations (prompt_ids is then only the first
    prompt, already checked against the context). `constraint` (None, or an object with mask(logits) ->
    logits and accept(token), see engine.Decoder.sample) steers every token of the job's generations, in
    order: serve/app.py gives one to a plain answer offered client tools. An agent turn without one gets
    agent/grammar.py's for the tools each of its generations offers."""

    def __init__(
        self, loop, prompt_ids, max_tokens, temperature, top_p, top_k, seed, turn=None, constraint=None
    ):
        self.loop, self.events = loop, asyncio.Queue()
        self.prompt_ids, self.max_tokens, self.turn = prompt_ids, max_tokens, turn
        self.temperature, self.top_p, self.top_k, self.seed = temperature, top_p, top_k, seed
        self.constraint = constraint
        self.calls_allowed = False  # a plain answer offered the client's tools may open a call
        self.whole_turn = False  # max_tokens bounds the agent turn's generations together (a child's)
        # The prefix cache's: whose request this is, and the prompt start every member shares (see
        # serve/app.py Server.public_prefix).
        self.scope, self.public_ids = None, ()
        self.cancelled = threading.Event()
        self.reserved = False  # an agent turn holding a slot for its first generation (the worker's)

    def send(self, *event):
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self):
        self.cancelled.set()


class Generation:
    """One generation of a job as a row of the batch: from prompt_ids, its text to write(piece). When it
    ends, finish is "stop", "length" or None (cancelled), or failed is True; count is its tokens; then
    on_end(generation) runs on the decode thread."""

    def __init__(self, job, prompt_ids, write, on_end, constraint=None, limit=None):
        self.job, self.prompt_ids, self.write, self.on_end = job, prompt_ids, write, on_end
        self.constraint, self.limit = constraint, job.max_tokens if limit is None else limit
        self.finish, self.failed, self.count = None, False, 0
        self.row = self.text = None


class Cancelled(Exception):
    """The job was cancelled while the agent loop was generating."""


class GenerationFailed(Exception):
    """A generation of an agent turn failed in the decode thread (already logged there)."""


class Busy(Exception):
    """The worker's queue is full; the request may be retried shortly."""


class CompileFailed(Exception):
    """The compiled decode step could not be built (the cause is chained): the server does not start."""


def new_decoder(model, slots, decoding):
    """An engine.Decoder of the model with every slot's KV cache allocated, or the decoder a stand-in model
    brings (the tests' scripted models)."""
    from decode import engine

    if hasattr(model, "decoder"):
        return model.decoder(slots, allocate=True, **decoding)
    return engine.Decoder(model, slots, allocate=True, **decoding)


class Worker:
    """decoding: engine.Decoder's options beyond the slots (compile_mode, serve.compile's torch.compile
    mode, or compile_with); a compiled step is built on the decode thread before the constructor
    returns. threads: torch's threads on the decode thread (None: as many as the calling thread's)."""

    def __init__(self, model, tokenizer, queue_size, max_batch=1, threads=None, **decoding):
        import torch

        self.threads = threads or torch.get_num_threads()
        self.model, self.tokenizer = model, tokenizer
        self.queue_size, self.max_batch, self.decoding = queue_size, max_batch, decoding
        self.stop_ids = {tokenizer.special_ids["<|end|>"], tokenizer.eos_id}
        self.decoder = new_decoder(model, max_batch, decoding)  # the KV cache of every slot, now
        self.decoder_of = model
        self.lock = threading.Condition()
        self.waiting = collections.deque()  # jobs not started yet, at most queue_size
        self.resumed = collections.deque()  # agent turns' next generations: they take a slot first
        self.reserved = 0  # slots held for agent turns started but not yet generating
        self.turns = 0  # agent turn threads running
        self.active = []  # the batch: generations holding a slot
        self.closing = False
        self.stats = {
            "answered": 0,
            "cancelled": 0,
            "refused_busy": 0,
            "generated_tokens": 0,
            "tool_calls": 0,
            "steps": 0,
            "peak_active": 0,
        }
        # Seconds with at least one row in the batch (prefills and steps): what the same answers cost
        # without HTTP. generated_tokens / generate_s is the worker's rate while busy.
        self.stats["generate_s"] = 0.0
        self.compiled, self.compile_error = threading.Event(), None
        self.thread = threading.Thread(target=self.loop, name="model-worker", daemon=True)
        self.thread.start()
        self.compiled.wait()  # the compile runs on the thread that steps (CUDA graphs are per thread)
        if self.compile_error is not None:
            raise CompileFailed(self.compile_error) from self.compile_error

    # --- what serve/app.py calls, from the event loop

    def submit(self, job):
        """Queue the job, or raise Busy when the queue is full."""
        with self.lock:
            if len(self.waiting) >= self.queue_size:
                self.stats["refused_busy"] += 1
                raise Busy
            self.waiting.append(job)
            self.lock.notify()

    def status(self):
        """The counters, with the slots in use and the jobs waiting (GET /api/server)."""
        with self.lock:
            stats = dict(self.stats) | {"slots": self.max_batch, "active": len(self.active),
                                        "queued": len(self.waiting)}  # fmt: skip
        stats["tokens_per_s"] = (
            round(stats["generated_tokens"] / stats["generate_s"], 1) if stats["generate_s"] else 0.0
        )
        return stats

    def close(self):
        """Let the worker finish the jobs it has (running, queued, agent turns) and end."""
        with self.lock:
            self.closing = True
            self.lock.notify()
        self.thread.join()

    # --- the decode thread

    def loop(self):
        import torch

        torch.set_num_threads(self.threads)  # this thread's team (see serve/app.py one_thread_here)
        self.stats["threads"] = torch.get_num_threads()
        try:
            if getattr(self.decoder, "compiled_step", None) is not None:
                started = time.perf_counter()
                self.decoder.compile()
                self.stats["compile_s"] = round(time.perf_counter() - started, 1)
        except Exception as e:  # raised by the constructor: the server does not start
            self.compile_error = e
            return
        finally:
            self.compiled.set()
        while True:
            with self.lock:
                while not self.ready():
                    if self.closing and not self.waiting and not self.turns:
                        return
                    self.lock.wait()
                starting = self.take()
                self.stats["peak_active"] = max(self.stats["peak_active"], len(self.active) + len(starting))
            started = time.perf_counter()
            for generation in starting:
                self.prefill(generation)
            if self.active:
                self.step()
            self.stats["generate_s"] += time.perf_counter() - started

    def free_slots(self):
        return self.max_batch - len(self.active) - self.reserved

    def ready(self):
        """Whether there is a batch to step or something that may start now (held by the lock)."""
        free = self.free_slots()
        resumable = any(free > 0 or generation.job.reserved for generation in self.resumed)
        return bool(self.active) or resumable or (bool(self.waiting) and free > 0)

    def take(self):
        """Generations to start now, as many as there are free slots (held by the lock): agent turns'
        next generations first, then new jobs in order. An agent job starts its thread and holds a slot
        (reserved) until its first generation takes it."""
        free, starting = self.free_slots(), []
        for generation in list(self.resumed):
            if generation.job.reserved:
                generation.job.reserved = False
                self.reserved -= 1
            elif free > 0:
                free -= 1
            else:
                continue
            self.resumed.remove(generation)
            starting.append(generation)
        while self.waiting and free > 0:
            job = self.waiting.popleft()
            free -= 1
            if job.turn is None:  # the client's own request: its tools' constraint, if any, under the ban
                banned = visible.ProtocolBan(data.TOKEN_TABLE, job.constraint, job.calls_allowed)
                starting.append(Generation(job, job.prompt_ids, lambda piece, job=job: job.send("text", piece),
                                           self.answer_ended, banned))  # fmt: skip
            elif job.cancelled.is_set():
                free += 1
                self.stats["cancelled"] += 1
                job.send("done", None, 0, len(job.prompt_ids))
            else:
                job.reserved = True
                self.reserved += 1
                self.turns += 1
                threading.Thread(target=self.agent_turn, args=(job,), name="agent-turn", daemon=True).start()
        return starting

    def prefill(self, generation):
        import torch

        job = generation.job
        if job.cancelled.is_set():
            return self.end(generation, None)
        top_p = job.top_p if job.top_p < 1 else None
        try:
            if self.decoder_of is not self.model and not self.active:  # the model was swapped (tests)
                self.decoder = new_decoder(self.model, self.max_batch, self.decoding)
                self.decoder_of = self.model
            generation.row = self.decoder.add(
                generation.prompt_ids, job.temperature, job.top_k, top_p,
                torch.Generator().manual_seed(job.seed), generation.constraint,
                **self.scoping(job, generation.prompt_ids),
            )  # fmt: skip
        except Exception as e:
            return self.fail([generation], e)
        generation.text = data.StreamDecoder(self.tokenizer)
        self.active.append(generation)

    def scoping(self, job, prompt_ids):
        """Decoder.add's scope and shared for a generation (none for a decoder without a prefix cache)."""
        if getattr(self.decoder, "prefix_cache", None) is None:
            return {}
        shared = 0
        for token, public in zip(prompt_ids, job.public_ids, strict=False):
            if token != public:
                break
            shared += 1
        return {"scope": job.scope, "shared": shared}

    def step(self):
        """Each row's next token, then one forward pass for the rows that go on."""
        live = []
        for generation in list(self.active):
            if generation.job.cancelled.is_set():
                self.end(generation, None)
            else:
                live.append(generation)
        going_on = {}
        for generation, token in self.sample(live):
            generation.count += 1
            self.stats["generated_tokens"] += 1
            if token in self.stop_ids:
                self.end(generation, "stop")
                continue
            piece = generation.text.push(token)
            if piece:
                generation.write(piece)
            if generation.count >= generation.limit:
                self.end(generation, "length")
            else:
                going_on[generation.row] = token
        if going_on:
            try:
                self.decoder.advance(going_on)
            except Exception as e:  # one forward pass for them all: every row in it failed
                self.fail([g for g in self.active if g.row in going_on], e)
            self.stats["steps"] += 1

    def sample(self, generations):
        """(generation, token) for each generation that drew its token: the unconstrained rows in one
        Decoder.sample_rows call (if it fails, they all fail), a constrained row on its own (its
        constraint can reject the model's text: that row alone fails)."""
        plain = [g for g in generations if g.constraint is None]
        drawn = []
        if plain:
            try:
                tokens = self.decoder.sample_rows([g.row for g in plain])
                drawn += [(g, tokens[g.row]) for g in plain]
            except Exception as e:
                self.fail(plain, e)
        for generation in generations:
            if generation.constraint is not None:
                try:
                    drawn.append((generation, self.decoder.sample(generation.row)))
                except Exception as e:
                    self.fail([generation], e)
        return drawn

    def leave(self, generation):
        if generation.row is not None:
            self.decoder.remove(generation.row)
        if generation in self.active:
            self.active.remove(generation)

    def end(self, generation, finish):
        self.leave(generation)
        generation.finish = finish
        if finish is not None:
            tail = generation.text.flush()
            if tail:
                generation.write(tail)
        generation.on_end(generation)

    def fail(self, generations, error):
        """A failed generation answers its own request; the worker and the other rows live on."""
        print(f"serve: generation failed: {type(error).__name__}: {error}", file=sys.stderr)
        for generation in generations:
            self.leave(generation)
            generation.failed = True
            generation.on_end(generation)

    def answer_ended(self, generation):
        job = generation.job
        if generation.failed:
            job.send("error", "generation failed on the server")
            return
        self.stats["answered" if generation.finish else "cancelled"] += 1
        job.send("done", generation.finish, generation.count, len(job.prompt_ids))

    # --- agent turns, each on its own thread

    def agent_turn(self, job):
        ended = None
        try:
            finish, count, prompt_tokens = self.run_turn(job)
            ended = ("done", finish, count, prompt_tokens)
        except GenerationFailed:
            pass
        except Exception as e:  # the loop or a tool broke: this request fails, the worker lives on
            print(f"serve: agent turn failed: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            with self.lock:
                if ended:
                    self.stats["answered" if ended[1] else "cancelled"] += 1
                self.turns -= 1
                if job.reserved:
                    job.reserved = False
                    self.reserved -= 1
                self.lock.notify()
            job.send(*(ended or ("error", "generation failed on the server")))

    def generate(self, job, prompt_ids, write, constraint=None, limit=None):
        """One generation of an agent turn, as a row of the batch, of at most limit tokens (None: the job's
        max_tokens): waits for it and returns (finish_reason, tokens generated); raises GenerationFailed
        when it failed."""
        ended = threading.Event()
        generation = Generation(job, prompt_ids, write, lambda _: ended.set(), constraint, limit)
        with self.lock:
            self.resumed.append(generation)
            self.lock.notify()
        ended.wait()
        if generation.failed:
            raise GenerationFailed
        return generation.finish, generation.count

    def run_turn(self, job):
        """agent/tools.py's loop with this model: each generation streams its text up to its first <tool_call>;
        the tools run here, between generations. Returns (finish_reason, completion tokens, prompt tokens)."""
        agent_of_turn, messages = job.turn
        totals = {"prompt": 0, "completion": 0, "finish": "stop", "shown": "", "any": False}

        def show(new, shown):
            """Send new text; a blank line separates the texts of successive generations."""
            job.send("text", ("\n\n" if totals["any"] and not shown else "") + new)
            totals["any"] = True

        def generate(conversation):
            left = job.max_tokens - totals["completion"] if job.whole_turn else job.max_tokens
            if left <= 0:  # a whole-turn budget spent by the tool rounds: no more text
                totals["finish"] = "length"
                return ""
            ids, _ = template.render(conversation, self.tokenizer, for_generation=True)
            pieces, shown = [], ""

            def write(piece):
                nonlocal shown
                pieces.append(piece)
                seen = visible.shown("".join(pieces), final=False)
                if len(seen) > len(shown):
                    show(seen[len(shown) :], shown)
                    shown = seen

            constraint = job.constraint or grammar.constraint_for(
                self.tokenizer,
                conversation.get("tools"),
                agent_of_turn.settings,
                left,
                conversation["messages"],
            )
            constraint = visible.ProtocolBan(data.TOKEN_TABLE, constraint, bool(conversation.get("tools")))
            finish, count = self.generate(job, ids, write, constraint, left)
            totals["prompt"] += len(ids)
            totals["completion"] += count
            if finish is None:
                raise Cancelled
            text = "".join(pieces)
            seen = visible.shown(text)
            if tools.CALL_OPEN not in text and len(seen) > len(shown):
                show(seen[len(shown) :], shown)
                shown = seen
            if tools.CALL_OPEN in text:
                self.stats["tool_calls"] += text.count(tools.CALL_OPEN)
            totals["finish"], totals["shown"] = finish, shown
            return text

        try:
            new = agent_of_turn.run_turn(messages, generate)
        except Cancelled:
            return None, totals["completion"], totals["prompt"]
        if len(new) > 1:  # the turn's calls and results, for the person to see what was done
            job.send("tools", new[:-1])
        answer = new[-1]["content"]
        shown = totals["shown"].strip()  # the final answer is the last reply, stripped, plus any sources
        rest = answer[len(shown) :] if answer.startswith(shown) else ("\n\n" if shown else "") + answer
        if rest:
            show(rest, shown)
        return totals["finish"], totals["completion"], totals["prompt"]
