"""
The family's assistant as a server: an OpenAI-compatible API, one account per family member, and the web
chat page in web/.

    python -m serve runs/NAME [--config configs/serve/default.yaml] [--host 127.0.0.1] [--port 8000]
                              [serve.key=value ...]
    python -m serve member add NAME --role admin|adult|child    # prints the member's API key, once
    python -m serve member password NAME                        # sets the web password or PIN
    python -m serve member list | remove NAME | new-key NAME

One process: uvicorn runs the Starlette app on the event loop, and one model worker thread (serve/worker.py)
decodes up to serve.max_batch answers at once (continuous batching), taking requests from a bounded queue
(a full queue answers 503 with Retry-After). The KV cache of the batch's slots is computed, printed and
checked against the device's free memory (and serve.max_kv_cache_mib) at start.
The server binds 127.0.0.1 unless --host says otherwise: --host 0.0.0.0 opens it to every device on the
network, over plain HTTP (see the README before doing that).

Routes (routes() below; the handlers of sessions, stored conversations, accounts and memories are
serve/web.py's; other features add theirs with build_app(..., extra_routes)):
    GET  /v1/models                        the run, as the one model id
    POST /v1/chat/completions              OpenAI chat completions, plain or streamed (SSE); stateless
    POST /api/login, /api/logout; GET /api/me            web sessions (HttpOnly, SameSite=Strict cookie)
    POST /api/me/password                  the member's own password change (a provisional account's way out)
    GET|POST /api/conversations; GET|DELETE /api/conversations/{id}
    POST /api/conversations/{id}/messages  a turn of a stored conversation, streamed like the API
    GET|POST /api/members; DELETE /api/members/{name}                         admin only (a member made
                                           here is provisional until they change the password the admin set)
    POST /api/members/{name}/key           a new API key: the caller's own only
    GET  /api/server                       worker counters: slots in use, queued jobs, tokens/s, and a write
                                           the disk refused (storage); admin only
    GET|POST|DELETE /api/memories; GET /api/memories/export; PATCH|DELETE /api/memories/{id}
    POST /api/memories/{id}/restore        a memory the member forgot, back while memory.forget_undo_s lasts
                                           the member's memories (family/memories.py), never the admin's business
    POST|DELETE /api/conversations/{id}/messages/{n}/feedback   the member's 👍/👎 of answer n (counted
                                           from 0 in the conversation's messages) and the answer they wanted
    GET|DELETE /api/feedback; GET /api/feedback/export; DELETE /api/feedback/{id}   their own feedback
    GET|PUT /api/consent; PUT /api/members/{name}/consent   "usar mis valoraciones para entrenar": their
                                           own (adults), a child's (set by an adult), family/feedback.py
Every request is authenticated by `Authorization: Bearer <API key>` or the session cookie. A member only
ever reaches their own conversations and feedback (anything else is 404, whoever asks, admins included).
Members, sessions and conversations are family/accounts.py's (SQLite).

A full (or read-only) disk under the database is a 507 in OpenAI's shape with Retry-After for the writes
only: reading conversations and chatting through the API go on. The server logs it once with the path,
GET /api/server and the admin's web page show it, and the first write that goes through again clears it.

A request that brings its own `tools` gets them rendered by chat.render and the model's calls back as
OpenAI tool_calls; any other request runs agent/tools.py's loop with the server's tools (search, calculator,
date) in the worker, when their schemas fit the model's context and serve.tools is on.
"""

import argparse
import asyncio
import contextlib
import hashlib
import ipaddress
import json
import math
import os
import secrets
import shlex
import socket
import sqlite3
import sys
import threading
import time
import urllib.parse
import uuid

import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from uvicorn.protocols.http.h11_impl import H11Protocol

import config
import fileio
from agent import call_bias, grammar, tools
from chat import template
from decode import load
from family import accounts, memories, store
from serve import member_command, web, worker
from serve.openai_api import ApiError, Reply, check_tools, conversation_of, expect, sampling_of, tool_messages
from serve.web import owned, read_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEB_DIR = os.path.join(ROOT, "web")
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "serve", "default.yaml")
SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"content-security-policy", b"default-src 'self'; frame-ancestors 'none'"),
]


class ServeError(Exception):
    """A problem the person starting the server can fix; printed without a traceback, exit status 2."""


# -----------------------------------------------------------------------------
# The application


class Server:
    """Everything a request handler needs: settings, database, model worker, tokenizer, model id."""

    def __init__(self, settings, store, worker, model_id, context, agent_settings=None, memory_cfg=None):
        self.settings, self.store, self.worker = settings, store, worker
        self.agent_settings = agent_settings or tools.load_settings()
        self.model_id, self.context = model_id, context
        self.created = int(time.time())
        self.dummy_hash = accounts.hash_password(secrets.token_hex(8), settings["scrypt"])
        self.pending = {}  # member id -> requests queued or running
        self.throttle = accounts.LoginThrottle(settings)
        self.memory_cfg = memory_cfg or memories.load_config()
        # Forgotten memories erased when their undo time ends (memory.forget_undo_s).
        self.eraser = memories.Eraser(
            store.db, store.lock, lambda line: print(f"serve: {line}", file=sys.stderr)
        )
        self.storage_logged = None  # the storage problem already in the log (one line per episode)

    # --- who is asking
    def member_of(self, request, provisional_ok=False):
        """The member whose API key or session cookie came with the request. A provisional account (made
        through the admin API: the admin knows its password and key) reaches only the routes that pass
        provisional_ok (GET /api/me, the password change); anything else is a 403 until the member has
        chosen their own password."""
        member = self.credentials_of(request)
        if member["provisional"] and not provisional_ok:
            raise ApiError(403, "this account's password was set by an admin: change it first (POST "
                           "/api/me/password) and use the new API key that answer gives",
                           code="password_change_required")  # fmt: skip
        return member

    def credentials_of(self, request):
        header = request.headers.get("authorization")
        if header is not None:
            scheme, _, key = header.partition(" ")
            if scheme.lower() != "bearer" or not key.strip():
                raise ApiError(401, "Authorization: expected 'Bearer <API key>'", code="invalid_api_key")
            member = self.store.member_by_key(key.strip())
            if member is None:
                raise ApiError(401, "invalid API key", code="invalid_api_key")
            return member
        token = web.session_token(request)
        member = self.store.member_by_session(token) if token else None
        if member is None:
            raise ApiError(401, "not logged in: send 'Authorization: Bearer <API key>', or log in and send "
                           "the session cookie with the X-Session-Key the login answered",
                           code="missing_credentials")  # fmt: skip
        return member

    def admin_of(self, request):
        member = self.member_of(request)
        if member["role"] != "admin":
            raise ApiError(403, "only an admin manages accounts", code="admin_only")
        return member

    # --- guessing passwords: logins and password changes, counted by family/accounts.py's LoginThrottle
    def client_address(self, request):
        """The client's address: the peer's, or the X-Forwarded-For a trusted proxy (serve.trusted_proxies,
        e.g. Caddy on this machine) set, last entry first (the one the proxy itself saw)."""
        peer = request.client.host if request.client else ""
        forwarded = request.headers.get("x-forwarded-for")
        if forwarded and peer in self.settings["trusted_proxies"]:
            return forwarded.split(",")[-1].strip()
        return peer

    def behind_https(self, request):
        """Whether the member reached this server over HTTPS (serve.https, or a trusted proxy's
        X-Forwarded-Proto): then the session cookie is Secure, never sent over plain HTTP."""
        peer = request.client.host if request.client else ""
        forwarded = request.headers.get("x-forwarded-proto", "").lower() == "https"
        return self.settings["https"] or (forwarded and peer in self.settings["trusted_proxies"])

    async def password_checks(self, request, name, password, stored):
        """Whether the password matches the stored hash (None: no password; an equal amount of work on a
        dummy hash, so unknown names and members without a password answer in the same time). The attempt
        is counted before the hash is computed; a refused one is a 429 with Retry-After, unheard."""
        wait, ticket = self.throttle.begin(name, self.client_address(request))
        if ticket is None:
            wait = math.ceil(wait)
            raise ApiError(429, f"too many failed password attempts for {name!r} from this device; try again "
                           f"in {wait} s", code="login_locked", retry_after=wait)  # fmt: skip
        matches = await asyncio.to_thread(accounts.password_matches, password, stored or self.dummy_hash)
        right = bool(stored and matches)
        self.throttle.finish(ticket, right)
        return right

    def check_child_turns(self, request, member, system, turns, tools):
        """A child's API request brings the conversation's user turns and only the answers this server gave
        them (family/accounts.py keeps their digests): no system or developer text, no tools, no tool
        results; a forged turn is a 400 naming it, and one line in the log."""
        if member["role"] != "child":
            return
        problem = None
        if system:
            problem = "messages: a child's request carries no system or developer message; the family's rules are the server's"
        elif tools:
            problem = "tools: a child's request brings no tools of its own"
        for index, turn in enumerate(turns):
            if problem:
                break
            if turn["role"] == "tool" or turn.get("tool_calls"):
                problem = f"messages.{index}: a child's request carries no tool calls or tool results"
            elif turn["role"] == "assistant" and not self.store.gave_answer(member["id"], turn["content"]):
                problem = (f"messages.{index}: this assistant turn is not an answer this server gave "
                           f"{member['name']}; send the answers back as they came")  # fmt: skip
        if problem:
            print(f"serve: {request.method} {request.url.path}: refused: {problem}", file=sys.stderr)
            raise ApiError(400, problem, param="messages", code="forged_turn")

    def check_hours(self, member):
        hours = self.settings["child"]["allowed_hours"]
        if member["role"] == "child" and hours is not None:
            now = time.localtime().tm_hour
            first, end = hours
            inside = first <= now < end if first <= end else (now >= first or now < end)
            if not inside:
                raise ApiError(
                    403, f"children may chat from {first}:00 to {end}:00", code="outside_allowed_hours"
                )

    # --- prompts
    def agent_for(self, member, client_tools, tool_choice):
        """An agent.Agent running the server's tools for this request, or None: when the client brings its
        own tools, asks for none (tool_choice "none"), or serve.tools is off."""
        if client_tools or tool_choice == "none" or not self.settings["tools"]:
            return None
        count_tokens = lambda text: len(self.worker.tokenizer.encode(text))  # noqa: E731
        return tools.Agent(
            self.agent_settings,
            count_tokens=count_tokens,
            member=self.memory_caller(member) if member["role"] != "admin" else None,
        )

    def prompt_of(self, member, system, turns, tools, max_tokens, trim, helper=None):
        """(token ids of the conversation with the <|assistant|> opener, tokens left to generate, its
        messages, the helper). The system turn is the request's system text or the configured prompt, the
        member's memories, and for a child the child instruction last, after anything a member wrote; an agent turn (helper) adds the date and the server's tools,
        unless they do not fit the context (a small model): then the helper is dropped. trim drops what
        does not fit (web conversations): the oldest answers' tool calls and results first (before the
        helper), then the oldest turns; otherwise a prompt too long is a 400 as in OpenAI's API."""
        parts = [*(system or [self.settings["system_prompt"]]), self.memory_context(member, turns)]
        parts += [self.settings["child"]["system_prompt"]] if member["role"] == "child" else []
        head = [{"role": "system", "content": "\n\n".join(p for p in parts if p)}]
        while True:
            if helper:
                conversation = helper.conversation(head + turns)
            else:
                conversation = {"messages": head + turns} | ({"tools": tools} if tools else {})
            try:
                ids, _ = template.render(conversation, self.worker.tokenizer, for_generation=True)
            except template.ChatError as e:
                raise ApiError(400, f"messages: {e}", param="messages", code="invalid_conversation") from None
            room = self.context - len(ids)
            short = room < min(max_tokens, 16)
            if short and trim and any(turn["role"] == "tool" for turn in turns):  # old tool work goes first
                turns = without_oldest_tool_work(turns)
                continue
            if helper and short:
                helper = None
                continue
            if not short or not trim or len(turns) <= 1:
                break
            turns = turns[1:]
            while len(turns) > 1 and turns[0]["role"] != "user":
                turns = turns[1:]
        if room < 1:
            raise ApiError(400, f"the prompt is {len(ids)} tokens; this model reads at most {self.context - 1} "
                           "plus the answer", param="messages", code="context_length_exceeded")  # fmt: skip
        return ids, min(max_tokens, room), head + turns, helper

    async def client_tools_constraint(self, tools, max_tokens):
        """agent/grammar.py's constraint for a client's own tools (None when agent.constrained is off); a schema
        it cannot enforce is a 400 naming the tool. The grammar compiles off the event loop, once per tool
        set."""
        try:
            return await asyncio.to_thread(
                grammar.constraint_for, self.worker.tokenizer, tools, self.agent_settings, max_tokens
            )
        except grammar.GrammarError as e:
            raise ApiError(400, f"tools: {e}", param="tools", code="invalid_value") from None

    # --- a full or read-only disk
    def storage_full(self, problem):
        """The 507 answer to a write the disk refused (a fileio.StorageError). The problem is logged once,
        with its path, and shown in GET /api/server until a write of the database goes through again."""
        if self.store.storage_problem is None:  # a file other than the database (the store keeps its own)
            self.store.storage_problem = problem
        if self.storage_logged is not self.store.storage_problem:
            self.storage_logged = self.store.storage_problem
            print(f"serve: storage: {problem}", file=sys.stderr, flush=True)
        read_only = problem.reason == "read-only"
        return ApiError(507, f"the server's storage is {'read-only' if read_only else 'full'}: this could not "
                        "be saved; reading and chatting without saving still work, and the admin can see "
                        "the problem (GET /api/server)", code="storage_read_only" if read_only else "storage_full",
                        retry_after=self.settings["retry_after_s"])  # fmt: skip

    def storage_status(self):
        problem = self.store.storage_problem
        if problem is None:
            return None
        return {"message": str(problem), "path": problem.path, "reason": problem.reason,
                "free_bytes": problem.free}  # fmt: skip

    # --- memories (family/memories.py decides who reads and changes what; this only binds the caller)
    def memories(self, member, function, *args, **kwargs):
        """function(connection, name, role, *args, **kwargs) of family/memories.py, as this member."""
        with self.store.lock:
            changes = self.store.db.total_changes
            result = function(self.store.db, member["name"], member["role"], *args, **kwargs)
            if self.store.db.total_changes != changes:  # a write went through: the disk has room again
                self.store.storage_problem = None
        if function is memories.forget_later:
            self.eraser.wake()
        return result

    def memory_context(self, member, turns):
        """The member's pinned memories and those matching their last message, for the system turn."""
        last = next((turn["content"] for turn in reversed(turns) if turn["role"] == "user"), "")
        # The words searched, picked before the database's lock is taken: the lock is every member's.
        last = " ".join(memories.query_terms(last, self.memory_cfg))
        count_tokens = lambda text: len(self.worker.tokenizer.encode(text))  # noqa: E731
        return self.memories(
            member, memories.context_for_turn, last, self.memory_cfg, count_tokens, self.context
        )

    def memory_caller(self, member):
        """The member as agent/tools.py's memory tools take them: agent.Agent(..., member=this)."""
        return memories.Caller(
            member["name"], member["role"], self.store.db, self.store.lock, self.memory_cfg, self.eraser.wake
        )

    # --- generation
    def start(
        self, request, member, prompt_ids, max_tokens, temperature, top_p, seed, turn=None, constraint=None,
        calls_allowed=False,
    ):  # fmt: skip
        count = self.pending.get(member["id"], 0)
        if count >= self.settings["max_pending_per_member"]:
            raise ApiError(429, f"{count} requests of yours are already waiting; wait for them to finish",
                           code="too_many_requests", retry_after=self.settings["retry_after_s"])  # fmt: skip
        loop = asyncio.get_running_loop()
        job = worker.Job(
            loop, prompt_ids, max_tokens, temperature, top_p, self.settings["top_k"], seed, turn, constraint
        )
        job.scope, job.public_ids = member["id"], self.public_prefix(member, turn)
        job.calls_allowed = calls_allowed  # the client's tools: a plain answer may call them
        job.whole_turn = member["role"] == "child"  # a child's max_tokens counts the tool rounds too
        try:
            self.worker.submit(job)
        except worker.Busy:
            raise ApiError(503, "the model is busy with other requests; retry shortly", code="server_busy",
                           retry_after=self.settings["retry_after_s"]) from None  # fmt: skip
        self.pending[member["id"]] = count + 1
        return job

    def public_prefix(self, member, turn):
        """The token ids that start the prompts of every member: the server's own system text
        and, for an agent turn, the date and its tools. The prefix cache shares the blocks a prompt has in
        common with them; the rest (memories, the request's own text) stays the member's."""
        head = [{"role": "system", "content": self.settings["system_prompt"]}]  # a child's rules come last
        conversation = turn[0].conversation(head) if turn else {"messages": head}
        return template.render(conversation, self.worker.tokenizer)[0]

    def finished(self, member, job):
        job.cancel()
        left = self.pending.get(member["id"], 1) - 1
        if left:
            self.pending[member["id"]] = left
        else:
            self.pending.pop(member["id"], None)


class ClientGone(Exception):
    """The client closed the connection while waiting for an answer."""


async def job_events(request, job, poll_s=1.0):
    """The job's events as they come. Every poll_s seconds, whether events come or not, it asks whether
    the client is still connected, and raises ClientGone when it is not: a plain completion writes nothing
    before its end, so only asking tells that its client has given up."""
    checked = time.monotonic()
    while True:
        event, left = None, checked + poll_s - time.monotonic()
        if left > 0:
            with contextlib.suppress(TimeoutError):
                event = await asyncio.wait_for(job.events.get(), left)
        if event is not None:
            yield event
            continue
        if await request.is_disconnected():
            raise ClientGone
        checked = time.monotonic()


async def answer_events(request, job, reply):
    """("delta", text) as the answer grows, then ("end", finish_reason, completion tokens, tool calls,
    prompt tokens)."""
    async with contextlib.aclosing(job_events(request, job)) as events:
        async for event in events:
            if event[0] == "text":
                delta = reply.add(event[1])
                if delta:
                    yield "delta", delta
                if reply.stopped:
                    job.cancel()  # the worker stops at its next token and still reports its count
            elif event[0] == "tools":
                reply.tool_messages = tool_messages(event[1])
                yield "tools", reply.tool_messages
            elif event[0] == "error":
                raise ApiError(500, event[1], code="generation_failed")
            else:
                _, finish, tokens, prompt_tokens = event
                rest, calls = reply.finish()
                if rest:
                    yield "delta", rest
                finish = "tool_calls" if calls else "stop" if reply.stopped else finish
                yield "end", finish, tokens, calls, prompt_tokens
                return


def sse(value):
    return f"data: {json.dumps(value, ensure_ascii=False)}\n\n"


def store_answer(server, on_end, text):
    """on_end(text) (storing the answer); a full disk is returned as its 507 ApiError for the stream to say."""
    try:
        on_end(text)
    except fileio.StorageError as e:
        return server.storage_full(e)
    except sqlite3.OperationalError as e:
        problem = server.store.storage_error(e)
        if problem is None:
            raise
        return server.storage_full(problem)
    return None


def usage_of(prompt_tokens, completion_tokens):
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


async def stream_answer(request, server, member, job, reply, base, include_usage, on_end=None):
    """SSE of one answer: role chunk, content deltas, tool calls, the finish_reason chunk, usage when asked,
    then [DONE]. on_end(text) runs (storing the answer) before the client hears that it is complete."""
    usage_field = {"usage": None} if include_usage else {}

    def chunk(delta, finish=None):
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return sse(base | {"choices": [choice]} | usage_field)

    text = ""
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for event in answer_events(request, job, reply):
            if event[0] == "delta":
                text += event[1]
                yield chunk({"content": event[1]})
                continue
            if event[0] == "tools":  # what the server's tools did, as OpenAI tool messages
                yield sse(base | {"choices": [], "tool_messages": event[1]} | usage_field)
                continue
            _, finish, tokens, calls, prompt_tokens = event
            if on_end:
                unsaved, on_end = store_answer(server, on_end, text), None
                if unsaved:
                    raise unsaved
            if calls:
                yield chunk({"tool_calls": [call | {"index": i} for i, call in enumerate(calls)]})
            yield chunk({}, finish)
            if include_usage:
                yield sse(base | {"choices": [], "usage": usage_of(prompt_tokens, tokens)})
        yield "data: [DONE]\n\n"
    except ApiError as e:
        yield sse(e.body())
        yield "data: [DONE]\n\n"
    except ClientGone:
        pass
    finally:
        server.finished(member, job)
        if on_end and text:  # stopped or disconnected: keep what the member saw
            store_answer(server, on_end, text)


async def complete(request, server, member, job, reply):
    """(text, finish_reason, completion tokens, tool calls, prompt tokens) of a non-streamed answer."""
    text = ""
    try:
        async for event in answer_events(request, job, reply):
            if event[0] == "delta":
                text += event[1]
            elif event[0] == "end":
                return (text, *event[1:])
    finally:
        server.finished(member, job)


def streaming_response(generator):
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(generator, media_type="text/event-stream", headers=headers)


async def list_models(request):
    server = request.app.state.server
    server.member_of(request)
    model = {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "enlace"}
    return JSONResponse({"object": "list", "data": [model]})


async def chat_completions(request):
    server = request.app.state.server
    settings = server.settings
    member = server.member_of(request)
    body = await read_json(request, settings["max_body_bytes"])
    model = expect(body.get("model"), str, "model", "the model id (GET /v1/models)")
    if model != server.model_id:
        raise ApiError(404, f"model {model!r} does not exist; this server has {server.model_id!r}",
                       param="model", code="model_not_found")  # fmt: skip
    system, turns = conversation_of(body.get("messages"), settings)
    tools = check_tools(body)
    stream = expect(body.get("stream", False), bool, "stream", "true or false")
    options = expect(body.get("stream_options") or {}, dict, "stream_options", "an object")
    include_usage = expect(
        options.get("include_usage", False), bool, "stream_options.include_usage", "true or false"
    )
    max_tokens, temperature, top_p, seed, stop = sampling_of(body, settings, member)
    server.check_hours(member)
    server.check_child_turns(request, member, system, turns, tools)
    helper = server.agent_for(member, tools, body.get("tool_choice"))
    # Tokenizing and the memory search off the event loop: a long request does not hold up the others.
    prompt_ids, max_tokens, messages, helper = await asyncio.to_thread(
        server.prompt_of, member, system, turns, tools, max_tokens, False, helper
    )
    turn = (helper, messages) if helper else None
    constraint = await server.client_tools_constraint(tools, max_tokens) if tools else None
    job = server.start(
        request, member, prompt_ids, max_tokens, temperature, top_p, seed, turn, constraint, bool(tools)
    )
    reply = Reply(stop, tools)
    base = {"id": "chatcmpl-" + uuid.uuid4().hex, "created": int(time.time()), "model": server.model_id,
            "system_fingerprint": None}  # fmt: skip
    # A child's answers are remembered (as digests), to know them when they come back in a later request.
    days = settings["session_days"]
    gave = (
        (lambda text: server.store.add_answer(member["id"], text, days))
        if member["role"] == "child"
        else None
    )
    if stream:
        chunks = stream_answer(request, server, member, job, reply, base | {"object": "chat.completion.chunk"},
                               include_usage, gave)  # fmt: skip
        return streaming_response(chunks)
    try:
        text, finish, tokens, calls, prompt_tokens = await complete(request, server, member, job, reply)
    except ClientGone:
        return Response(status_code=499)
    if gave:
        gave(text)
    message = {"role": "assistant", "content": text if text or not calls else None, "refusal": None}
    if calls:
        message["tool_calls"] = calls
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    usage = usage_of(prompt_tokens, tokens)
    done = {"tool_messages": reply.tool_messages} if reply.tool_messages else {}  # the server's tools' work
    return JSONResponse(base | {"object": "chat.completion", "choices": [choice], "usage": usage} | done)


def history_of(stored):
    """A stored conversation's messages as turns of the next prompt: each answer preceded by the calls and
    results of its tools (so "¿y para 9 personas?" can use them)."""
    turns = []
    for message in stored:
        for work in message.get("tool_messages", ()):
            turns.append({key: work[key] for key in ("role", "tool_calls", "tool_call_id", "name") if key in work}
                         | {"content": work.get("content") or ""})  # fmt: skip
        turns.append({"role": message["role"], "content": message["content"]})
    return turns


def without_oldest_tool_work(turns):
    """turns without the tool calls and results of the oldest answer that has any (its text stays), said
    in the log."""
    first = next(i for i, turn in enumerate(turns) if turn["role"] == "tool" or turn.get("tool_calls"))
    end = first
    while turns[end]["role"] == "tool" or turns[end].get("tool_calls"):
        end += 1
    print(f"serve: a conversation's oldest tool results ({end - first} messages) left out of the prompt to fit "
          "the model's context", file=sys.stderr)  # fmt: skip
    return turns[:first] + turns[end:]


async def post_message(request):
    """A turn of a stored conversation: the member's message is stored once the model has taken the
    request, the answer once it is complete (or stopped), before the client is told it is done."""
    server = request.app.state.server
    settings = server.settings
    member = server.member_of(request)
    conversation = owned(server, member, request.path_params["id"])
    body = await read_json(request, settings["max_body_bytes"])
    content = expect(body.get("content"), str, "content", "the message text")
    if not content.strip():
        raise ApiError(400, "content: the message is empty", param="content", code="empty_message")
    stream = expect(body.get("stream", True), bool, "stream", "true or false")
    max_tokens, temperature, top_p, seed, stop = sampling_of(body, settings, member)
    server.check_hours(member)
    turns = history_of(conversation["messages"][-settings["max_messages"] :]) + [
        {"role": "user", "content": content}
    ]
    helper = server.agent_for(member, None, None)
    prompt_ids, max_tokens, messages, helper = await asyncio.to_thread(
        server.prompt_of, member, [], turns, None, max_tokens, True, helper
    )
    turn = (helper, messages) if helper else None
    job = server.start(request, member, prompt_ids, max_tokens, temperature, top_p, seed, turn)
    store, conversation_id = server.store, conversation["id"]
    title = " ".join(content.split())[:60] if not conversation["messages"] else None
    store.add_message(member["id"], conversation_id, "user", content, title)

    def on_end(text):  # with what its tools did, for the next turns to read
        store.add_message(member["id"], conversation_id, "assistant", text, tool_messages=reply.tool_messages)

    reply = Reply(stop, None)
    # message_index: where the answer is stored (after the member's message), for rating it.
    base = {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": server.model_id, "conversation_id": conversation_id,
            "message_index": len(conversation["messages"]) + 1}  # fmt: skip
    if stream:
        return streaming_response(stream_answer(request, server, member, job, reply, base, True, on_end))
    try:
        text, finish, tokens, _, prompt_tokens = await complete(request, server, member, job, reply)
    except ClientGone:
        return Response(status_code=499)
    on_end(text)
    message = {"role": "assistant", "content": text}
    return JSONResponse({"conversation_id": conversation_id, "message_index": base["message_index"],
                         "message": message, "finish_reason": finish, "tool_messages": reply.tool_messages,
                         "usage": usage_of(prompt_tokens, tokens)})  # fmt: skip


async def index(request):
    return FileResponse(os.path.join(WEB_DIR, "index.html"), headers={"Cache-Control": "no-cache"})


# --- errors and headers


async def api_error(request, error):
    headers = {"Retry-After": str(error.retry_after)} if error.retry_after else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def http_error(request, error):
    """Starlette's own 404/405 in OpenAI's shape."""
    if error.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    else:
        message = f"{request.method} is not allowed on {request.url.path}"
    code = "not_found" if error.status_code == 404 else "method_not_allowed"
    return await api_error(request, ApiError(error.status_code, message, code=code))


async def storage_error(request, error):
    return await api_error(request, request.app.state.server.storage_full(error))


async def database_error(request, error):
    """Another process (the memory command line, a snapshot) holding the database's write lock past
    serve.busy_timeout_ms is a 503 with Retry-After, as a full queue is; a full or read-only disk is
    storage_error's 507; any other database error a 500."""
    problem = request.app.state.server.store.storage_error(error)
    if problem is not None:
        return await storage_error(request, problem)
    if error.sqlite_errorcode & 0xFF not in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return await internal_error(request, error)
    print(f"serve: {request.method} {request.url.path}: database busy ({error})", file=sys.stderr)
    busy = ApiError(503, "the database is busy with another program; retry shortly", code="database_busy",
                    retry_after=request.app.state.server.settings["retry_after_s"])  # fmt: skip
    return await api_error(request, busy)


async def internal_error(request, error):
    print(
        f"serve: {request.method} {request.url.path} failed: {type(error).__name__}: {error}", file=sys.stderr
    )
    return JSONResponse(ApiError(500, "internal server error").body(), status_code=500)


def host_problem(host, allowed):
    """Why a Host header is not this server's (None when it is): localhost, an address (DNS rebinding,
    a page of rebind.attacker.example whose name now points here, always brings a name) or a name of
    serve.allowed_hosts."""
    if not host:
        return "no Host header"
    name = host[1 : host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
    name = name.lower().rstrip(".")
    try:
        ipaddress.ip_address(name)
        return None
    except ValueError:
        pass
    if name == "localhost" or name in {n.lower() for n in allowed}:
        return None
    return f"Host {host!r} is not this server's; a name the family uses goes in serve.allowed_hosts"


def origin_problem(method, headers):
    """Why a state-changing request comes from another origin's page (None when it does not): a
    browser sends Origin with every POST, PUT, PATCH and DELETE; API clients send none."""
    origin = headers.get("origin")
    if method in ("GET", "HEAD", "OPTIONS") or origin is None:
        return None
    if origin == "null" or urllib.parse.urlsplit(origin).netloc.lower() != headers.get("host", "").lower():
        return f"Origin {origin!r}: a page of another site or port cannot change anything here"
    return None


class RequestGuard:
    """Refuses, before any route: a Host that is not this server's (421) and a state-changing request
    sent by a page of another origin (403), each with one line in the log."""

    def __init__(self, app, settings):
        self.app, self.settings = app, settings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        problem = host_problem(headers.get("host"), self.settings["allowed_hosts"])
        refused = ApiError(421, problem, code="invalid_host") if problem else None
        problem = None if refused else origin_problem(scope["method"], headers)
        refused = ApiError(403, problem, code="cross_origin") if problem else refused
        if refused is None:
            return await self.app(scope, receive, send)
        print(f"serve: {scope['method']} {scope['path']}: refused: {refused.message}", file=sys.stderr)
        await JSONResponse(refused.body(), status_code=refused.status)(scope, receive, send)


class SecurityHeaders:
    """Adds SECURITY_HEADERS to every response (pure ASGI, so streaming and disconnects pass through)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + SECURITY_HEADERS
            await send(message)

        return await self.app(scope, receive, send_with_headers)


def uvicorn_config(asgi_app, settings, **options):
    """uvicorn's settings for the app: serve.timeouts.idle_s between requests on a connection, and a
    connection whose next request's headers are not complete within serve.timeouts.headers_s closed
    (uvicorn alone waits for them forever: a client sending half a request held a connection for good)."""
    headers_s = settings["timeouts"]["headers_s"]

    class Protocol(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self.await_headers()

        def on_response_complete(self):
            super().on_response_complete()
            self.await_headers()

        def await_headers(self):
            """Close the connection unless a new request's headers are complete within headers_s (data
            received does not reset this timer, as it does uvicorn's keep-alive one)."""
            waiting = self.cycle

            def late():
                idle = self.cycle is waiting and (waiting is None or waiting.response_complete)
                if idle and not self.transport.is_closing():
                    self.transport.close()

            self.loop.call_later(headers_s, late)

    return uvicorn.Config(
        asgi_app, http=Protocol, timeout_keep_alive=settings["timeouts"]["idle_s"], **options
    )


def routes():
    return [
        Route("/", index),
        Route("/v1/models", list_models),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/api/login", web.login, methods=["POST"]),
        Route("/api/logout", web.logout, methods=["POST"]),
        Route("/api/me", web.whoami),
        Route("/api/me/password", web.change_password, methods=["POST"]),
        Route("/api/conversations", web.list_conversations),
        Route("/api/conversations", web.new_conversation, methods=["POST"]),
        Route("/api/conversations/{id}", web.get_conversation),
        Route("/api/conversations/{id}", web.delete_conversation, methods=["DELETE"]),
        Route("/api/conversations/{id}/messages", post_message, methods=["POST"]),
        Route("/api/members", web.list_members),
        Route("/api/members", web.add_member, methods=["POST"]),
        Route("/api/members/{name}", web.remove_member, methods=["DELETE"]),
        Route("/api/members/{name}/key", web.new_member_key, methods=["POST"]),
        Route("/api/server", web.server_status),
        Route("/api/memories", web.list_memories),
        Route("/api/memories", web.add_memory, methods=["POST"]),
        Route("/api/memories", web.delete_all_memories, methods=["DELETE"]),
        Route("/api/memories/export", web.export_memories),
        Route("/api/memories/{id:int}", web.edit_memory, methods=["PATCH"]),
        Route("/api/memories/{id:int}", web.delete_memory, methods=["DELETE"]),
        Route("/api/memories/{id:int}/restore", web.restore_memory, methods=["POST"]),
        Route("/api/conversations/{id}/messages/{n:int}/feedback", web.rate_answer, methods=["POST"]),
        Route("/api/conversations/{id}/messages/{n:int}/feedback", web.unrate_answer, methods=["DELETE"]),
        Route("/api/feedback", web.list_feedback),
        Route("/api/feedback", web.delete_all_feedback, methods=["DELETE"]),
        Route("/api/feedback/export", web.export_feedback),
        Route("/api/feedback/{id:int}", web.delete_feedback, methods=["DELETE"]),
        Route("/api/consent", web.get_consent),
        Route("/api/consent", web.set_own_consent, methods=["PUT"]),
        Route("/api/members/{name}/consent", web.set_member_consent, methods=["PUT"]),
        Mount("/web", StaticFiles(directory=WEB_DIR)),
    ]


def build_app(server, extra_routes=()):
    """The Starlette app; extra_routes (other features' endpoints) go before the static files."""
    table = routes()
    app = Starlette(
        routes=table[:-1] + list(extra_routes) + table[-1:],
        middleware=[Middleware(SecurityHeaders), Middleware(RequestGuard, settings=server.settings)],
        exception_handlers={
            ApiError: api_error,
            HTTPException: http_error,
            sqlite3.OperationalError: database_error,
            fileio.StorageError: storage_error,
            Exception: internal_error,
        },
    )
    app.state.server = server
    return app


# -----------------------------------------------------------------------------
# Command line


def serving_info(run, model, tokenizer, settings, memory_cfg):
    """What this server uses, for the snapshots of its database (memory.hold_lock writes it)."""
    processor = getattr(tokenizer, "processor", None)  # sentencepiece, possibly from inside the checkpoint
    proto = processor.serialized_model_proto() if processor is not None else None
    return {
        "run": os.path.abspath(run),
        "checkpoint": os.path.abspath(model.checkpoint_path),
        "checkpoint_sha256": fileio.sha256_of_file(model.checkpoint_path),
        "tokenizer": getattr(tokenizer, "path", tokenizer.name),
        "tokenizer_sha256": proto and hashlib.sha256(proto).hexdigest(),
        "config": {"serve": settings, "memory": memory_cfg},
        "code_version": fileio.code_version(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def load_settings(path, overrides):
    try:
        return config.load_layer("serve", path, overrides)
    except config.ConfigError as e:
        raise ServeError(f"{path}: config problems:\n  " + "\n  ".join(e.problems)) from None


def one_thread_here():
    """Run torch on one thread on this thread (the event loop's, which loads the model and does little
    torch work after) and return the thread count the decode thread is to use instead. Why: torch's
    OpenMP (libgomp) keeps a team of threads per thread that runs parallel work; with two teams it counts
    more threads than cores, stops spinning between parallel regions, and each of the decode step's regions
    then waits for a sleeping thread to wake. Measured on 2 cores (docs/rendimiento.md): the step on the
    decode thread took 2.0 ms with a team on this thread too, 0.44 ms without."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads


def agent_settings_for(run):
    """(the agent settings a run is served with: configs/agent/default.yaml with the run's chosen call bias,
    RUN/call_bias.json, where it has one; the log line that says which bias serves)."""
    agent_settings = tools.load_settings()
    try:
        chosen = call_bias.chosen(run)
    except (ValueError, OSError) as e:
        raise ServeError(str(e)) from None
    if chosen is None:
        value = agent_settings["call_bias"]["value"]
        return agent_settings, f"call bias {value:g} (agent.call_bias.value: the run has no {call_bias.FILE})"
    line = (
        f"call bias {chosen['value']:g}, chosen for this run on {chosen.get('chosen_on')} ({call_bias.FILE})"
    )
    return call_bias.with_value(agent_settings, chosen["value"]), line


def serve_main(argv):
    parser = argparse.ArgumentParser(
        description="Serve a run: OpenAI-compatible API and the family's web page."
    )
    parser.add_argument("run", help="run directory (newest checkpoint) or a checkpoint file")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="serve layer file (configs/serve/*.yaml)")
    parser.add_argument(
        "--host", help="address to bind (default serve.host, 127.0.0.1); 0.0.0.0 = the whole LAN"
    )
    parser.add_argument("--port", type=int, help="TCP port (default serve.port); 0 = any free port")
    parser.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda or auto: the device the run trained on, where this machine has it",
    )
    parser.epilog = (
        "Settings of the serve layer can follow as serve.key=value (e.g. serve.queue_size=4), and of the "
        "memory layer (configs/memory/default.yaml) as memory.key=value (e.g. memory.snapshots.every_hours=6)."
    )
    overrides = [a for a in argv if config.is_override(a, "serve")]
    memory_overrides = [a for a in argv if config.is_override(a, "memory")]
    args = parser.parse_args([a for a in argv if a not in overrides and a not in memory_overrides])
    settings = load_settings(args.config, overrides)
    try:
        memory_cfg = memories.load_config(overrides=memory_overrides)
    except config.ConfigError as e:
        raise ServeError(
            f"{memories.DEFAULT_CONFIG}: config problems:\n  " + "\n  ".join(e.problems)
        ) from None
    host = args.host or settings["host"]
    port = settings["port"] if args.port is None else args.port
    store.make_private(settings["database"], memory_cfg["snapshots"]["dir"],
                       lambda message: print(f"serve: {message}", file=sys.stderr))  # fmt: skip
    accounts_store = accounts.Store(settings["database"], settings["busy_timeout_ms"])
    threads = one_thread_here()
    import checkpoint  # as load.load_model does

    args.device = checkpoint.device_for(args.run, args.device)
    model, tokenizer, model_id, context = load.load_model(args.run, args.device)
    model = load.prepare_weights(model, settings, args.device)
    load.check_kv_cache(model, settings, args.device)
    decoding = load.decoding_options(settings, args.device)
    try:
        model_worker = worker.Worker(
            model, tokenizer, settings["queue_size"], settings["max_batch"], threads, **decoding
        )
    except worker.CompileFailed as e:
        if "compile_with" not in decoding:
            raise ServeError(load.compile_failure(e.__cause__, settings, args.device)) from None
        # aot, the CPU's default: a machine that cannot build it (no C++ compiler) still serves, eager.
        print(
            f"serve: {load.compile_failure(e.__cause__, settings, args.device)}; decoding eager",
            file=sys.stderr,
        )
        decoding = {key: value for key, value in decoding.items() if key != "compile_with"}
        model_worker = worker.Worker(
            model, tokenizer, settings["queue_size"], settings["max_batch"], threads, **decoding
        )
    if "compile_s" in model_worker.stats:
        how = settings["compile"]["cuda" if args.device.startswith("cuda") else "cpu"]
        print(f"serve: decode step compiled ({how}) in {model_worker.stats['compile_s']} s", file=sys.stderr)
    agent_settings, bias_line = agent_settings_for(args.run)
    server = Server(settings, accounts_store, model_worker, model_id, context, agent_settings, memory_cfg)
    # family/store.py: the database's lock, held until this process ends (restore refuses to run meanwhile, and
    # so does a second server on the same file), and the snapshot schedule on a daemon thread.
    try:
        store.hold_lock(
            settings["database"], serving_info(args.run, model, tokenizer, settings, server.memory_cfg)
        )
    except store.SnapshotError as e:
        raise ServeError(str(e)) from None
    log = lambda message: print(f"serve: {message}", file=sys.stderr)  # noqa: E731
    log(bias_line)
    if settings["tools"]:  # each tool works, or the log says now why not
        for line in tools.readiness(server.agent_settings):
            log(line)
    store.snapshot_every(settings["database"], server.memory_cfg, threading.Event(), log)
    app = build_app(server)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        raise ServeError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port") from None
    sock.listen(2048)  # connections wait in the backlog until uvicorn accepts them
    port = sock.getsockname()[1]
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"serve: WARNING: listening on {host}: every device on the network can reach this server, over "
              "plain HTTP (passwords and chats cross the network unencrypted)", file=sys.stderr)  # fmt: skip
    if not accounts_store.members():
        print(
            f"serve: no members yet: {this_python()} -m serve member add NAME --role admin", file=sys.stderr
        )
    print(f"serve: model {model_id!r} at http://{host}:{port}/ (database {settings['database']})", flush=True)
    served = uvicorn_config(app, settings, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
    uvicorn.Server(served).run(sockets=[sock])
    return 0


def this_python():
    """The interpreter serving, as a person would type it here: a bare `python` in a fresh shell is not
    .venv's (make serve runs .venv/bin/python), so a hint that says `python` would fail to import."""
    here = os.path.relpath(sys.executable)
    return shlex.quote(here if not here.startswith("..") else sys.executable)


@fileio.reports_storage_errors
@fileio.takes_text_arguments()
def main(argv):
    os.umask(store.PRIVATE_UMASK)  # the database, its WAL, snapshots: this user's alone
    try:
        if argv and argv[0] == "member":
            return member_command.main(argv[1:], load_settings, DEFAULT_CONFIG)
        return serve_main(argv)
    except (ServeError, load.LoadError, accounts.AccountError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
