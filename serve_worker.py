"""
serve.py's model worker: one thread generates one answer at a time, taking jobs from a bounded queue (a full
queue raises Busy, which the server answers with 503 and Retry-After). A job streams its text back to the
request's event loop as whole characters (sample.StreamDecoder); an agent turn runs agent.py's loop here,
the server's tools between generations. Knows nothing of HTTP: serve.py (with serve_openai.py) checks
requests, renders prompts and shapes the answers.
"""

import asyncio
import queue
import sys
import threading
import time

import agent
import agent_grammar
import chat


class Job:
    """One answer: the worker sends ("text", piece) events, then ("done", finish_reason, completion tokens,
    prompt tokens) or ("error", message), to the request's event loop. cancel() makes the worker stop at
    the next token (its "done" then has finish_reason None). With `turn` = (agent.Agent, messages) the
    answer is an agent turn: the server's tools run between generations (prompt_ids is then only the first
    prompt, already checked against the context). `constraint` (agent_grammar) masks the logits of a plain
    answer offered client tools; an agent turn's generations each get one for the tools they offer."""

    def __init__(
        self, loop, prompt_ids, max_tokens, temperature, top_p, top_k, seed, turn=None, constraint=None
    ):
        self.loop, self.events = loop, asyncio.Queue()
        self.prompt_ids, self.max_tokens, self.turn = prompt_ids, max_tokens, turn
        self.constraint = constraint
        self.temperature, self.top_p, self.top_k, self.seed = temperature, top_p, top_k, seed
        self.cancelled = threading.Event()

    def send(self, *event):
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self):
        self.cancelled.set()


class Cancelled(Exception):
    """The job was cancelled while the agent loop was generating."""


class Busy(Exception):
    """The worker's queue is full; the request may be retried shortly."""


class Worker:
    def __init__(self, model, tokenizer, queue_size):
        self.model, self.tokenizer = model, tokenizer
        self.jobs = queue.Queue(maxsize=queue_size)
        self.stop_ids = {tokenizer.special_ids["<|end|>"], tokenizer.eos_id}
        self.stats = {
            "answered": 0,
            "cancelled": 0,
            "refused_busy": 0,
            "generated_tokens": 0,
            "tool_calls": 0,
        }
        self.stats["generate_s"] = 0.0  # seconds spent generating (what the same answers cost without HTTP)
        self.thread = threading.Thread(target=self.loop, name="model-worker", daemon=True)
        self.thread.start()

    def submit(self, job):
        """Queue the job, or raise Busy when the queue is full."""
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            self.stats["refused_busy"] += 1
            raise Busy from None

    def close(self):
        """Let the worker finish its current answer and end (the queue's None)."""
        self.jobs.put(None)
        self.thread.join()

    def loop(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                self.run(job)
            except Exception as e:  # a failed generation answers its own request, the worker lives on
                print(f"serve: generation failed: {type(e).__name__}: {e}", file=sys.stderr)
                job.send("error", "generation failed on the server")

    def run(self, job):
        finish, count, prompt_tokens = None, 0, len(job.prompt_ids)
        if not job.cancelled.is_set():
            if job.turn is None:
                write = lambda piece: job.send("text", piece)  # noqa: E731
                finish, count = self.generate(job, job.prompt_ids, write, job.constraint)
            else:
                finish, count, prompt_tokens = self.agent_turn(job)
        self.stats["answered" if finish else "cancelled"] += 1
        job.send("done", finish, count, prompt_tokens)

    def generate(self, job, prompt_ids, write, constraint=None):
        """Sample from prompt_ids, handing whole-character text pieces to write. Returns (finish_reason,
        tokens generated), finish_reason None when the job was cancelled."""
        import torch

        from sample import StreamDecoder

        started = time.perf_counter()
        decoder = StreamDecoder(self.tokenizer)
        generator = torch.Generator().manual_seed(job.seed)
        count, finish = 0, "length"
        device = self.model.embed_tokens.weight.device
        with torch.inference_mode():
            prompt = torch.tensor(prompt_ids, device=device)
            top_p = job.top_p if job.top_p < 1 else None
            tokens = self.model.generate(prompt, job.max_tokens, job.temperature, job.top_k, top_p,
                                         generator=generator, constraint=constraint)  # fmt: skip
            for token in tokens:
                if job.cancelled.is_set():
                    finish = None
                    break
                count += 1
                if token in self.stop_ids:
                    finish = "stop"
                    break
                piece = decoder.push(token)
                if piece:
                    write(piece)
        self.stats["generated_tokens"] += count
        self.stats["generate_s"] += time.perf_counter() - started
        if finish is not None:
            tail = decoder.flush()
            if tail:
                write(tail)
        return finish, count

    def agent_turn(self, job):
        """agent.py's loop with this model: each generation streams its text up to its first <tool_call>;
        the tools run here, between generations. Returns (finish_reason, completion tokens, prompt tokens)."""
        agent_of_turn, messages = job.turn
        totals = {"prompt": 0, "completion": 0, "finish": "stop", "shown": "", "any": False}

        def show(new, shown):
            """Send new text; a blank line separates the texts of successive generations."""
            job.send("text", ("\n\n" if totals["any"] and not shown else "") + new)
            totals["any"] = True

        def generate(conversation):
            ids, _ = chat.render(conversation, self.tokenizer, for_generation=True)
            pieces, shown = [], ""

            def write(piece):
                nonlocal shown
                pieces.append(piece)
                visible = "".join(pieces).split(agent.CALL_OPEN)[0].removesuffix("\n")
                if len(visible) > len(shown):
                    show(visible[len(shown) :], shown)
                    shown = visible

            tools = conversation.get("tools")
            constraint = agent_grammar.constraint_for(
                self.tokenizer, tools, agent_of_turn.settings, job.max_tokens
            )
            finish, count = self.generate(job, ids, write, constraint)
            totals["prompt"] += len(ids)
            totals["completion"] += count
            if finish is None:
                raise Cancelled
            text = "".join(pieces)
            if agent.CALL_OPEN not in text and len(text) > len(shown):
                show(text[len(shown) :], shown)
                shown = text
            else:
                self.stats["tool_calls"] += text.count(agent.CALL_OPEN)
            totals["finish"], totals["shown"] = finish, shown
            return text

        try:
            answer = agent_of_turn.run_turn(messages, generate)[-1]["content"]
        except Cancelled:
            return None, totals["completion"], totals["prompt"]
        shown = totals["shown"].strip()  # the final answer is the last reply, stripped, plus any sources
        rest = answer[len(shown) :] if answer.startswith(shown) else ("\n\n" if shown else "") + answer
        if rest:
            show(rest, shown)
        return totals["finish"], totals["completion"], totals["prompt"]
