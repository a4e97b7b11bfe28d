"""
serve/app.py's routes beside the chat itself: web sessions (login, logout, the member's own password
change), the member's stored conversations (listing, opening, deleting; their turns stream through
serve/app.py's post_message), accounts (admin only, and each member's own API key), the member's memories
(family/memories.py), and the member's ratings of answers and their consent to train on them (family/feedback.py). Each handler reads request.app.state.server (serve.Server) for the settings, the database
and who is asking; read_json is the one request-body reader, serve/app.py's too.
"""

import asyncio
import json
import sys

from starlette.responses import JSONResponse

from family import accounts, feedback, memories
from serve.openai_api import ApiError, check_text, expect, text_error

SESSION_COOKIE = "enlace_session"
SESSION_HEADER = "x-session-key"


def session_token(request):
    """A web session's token: the cookie's half and the page's (X-Session-Key, which the page keeps in
    its origin's localStorage). Cookies know no ports: a page on another port of this host receives the
    cookie, but never the page's half. None unless both came."""
    cookie, key = request.cookies.get(SESSION_COOKIE), request.headers.get(SESSION_HEADER)
    return f"{cookie}.{key}" if cookie and key else None


def row_id(request, what, code):
    """The {id:int} of the path as a database row id: one past SQLite's integers (2**63 - 1) is no row of
    anyone's, the same 404 as another member's."""
    value = request.path_params["id"]
    if not 0 < value < 2**63:
        raise ApiError(404, f"no {what} {value} of yours", code=code)
    return value


async def read_json(request, limit):
    """The JSON body as a dict: 415 unless it is sent as application/json (a form or text/plain body is
    what a page of another site can send without asking), 413 past `limit` bytes (refused at the limit:
    a declared Content-Length over it before a byte is read, a stream once it passes it; the server then
    closes the connection), 400 when it is not a JSON object, or when any of its text is not Unicode or too
    long (openai_api.check_text: every route that reads a body gets that check here)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(415, f"Content-Type: expected application/json, got {kind or 'none'}",
                       code="unsupported_media_type")  # fmt: skip
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {int(declared)} bytes; at most {limit} are accepted",
                       code="request_too_large")  # fmt: skip
    body, settings = bytearray(), request.app.state.server.settings
    try:
        async with asyncio.timeout(settings["timeouts"]["body_s"]):  # a body trickled in holds no one
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise ApiError(413, f"the request body is over {limit} bytes, the most accepted",
                                   code="request_too_large")  # fmt: skip
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {settings['timeouts']['body_s']} s "
                       "(serve.timeouts.body_s)", code="request_timeout") from None  # fmt: skip
    depth = settings["max_json_depth"]
    try:
        value = json.loads(bytes(body))
        check_text(value, depth, settings["max_text_chars"])
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    except (ApiError, RecursionError) as e:  # one line in the log; nothing was read or stored yet
        refused = e if isinstance(e, ApiError) else text_error("", f"nested deeper than {depth} levels")
        print(f"serve: {request.method} {request.url.path}: refused: {refused.message}", file=sys.stderr)
        raise refused from None
    return expect(value, dict, "body", "a JSON object")


def check_password(password, settings, role, param="password"):
    problem = accounts.password_problem(password, settings, role)
    if problem:
        raise ApiError(400, problem.replace("password:", f"{param}:", 1), param=param, code="weak_password")


# --- web sessions and stored conversations


def me(member):
    return {
        "name": member["name"],
        "role": member["role"],
        "must_change_password": bool(member["provisional"]),
    }


async def login(request):
    server = request.app.state.server
    body = await read_json(request, server.settings["max_form_bytes"])
    name = expect(body.get("name"), str, "name", "the member's name")
    password = expect(body.get("password"), str, "password", "the password or PIN")
    member = server.store.member(name)
    if not await server.password_checks(request, name, password, (member or {}).get("password_hash")):
        raise ApiError(401, "wrong name or password", code="invalid_login")
    days = server.settings["session_days"]
    cookie, key = server.store.new_session(member["id"], days).split(".")
    response = JSONResponse(me(member) | {"session_key": key})
    response.set_cookie(SESSION_COOKIE, cookie, max_age=int(days * 86400), path="/", httponly=True,
                        samesite="strict", secure=server.behind_https(request))  # fmt: skip
    return response


async def logout(request):
    token = session_token(request)
    if token:
        request.app.state.server.store.end_session(token)
    response = JSONResponse({"ok": True})
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    return response


async def whoami(request):
    return JSONResponse(me(request.app.state.server.member_of(request, provisional_ok=True)))


async def change_password(request):
    """The logged-in member's own password change, {"current", "new"}: the current password is checked
    (failures count towards the login lockout), every other session of theirs ends, and a provisional
    account gets its first API key of its own, in this answer only."""
    server = request.app.state.server
    member = server.member_of(request, provisional_ok=True)
    body = await read_json(request, server.settings["max_form_bytes"])
    current = expect(body.get("current"), str, "current", "the current password or PIN")
    new = expect(body.get("new"), str, "new", "the new password or PIN")
    if not member["password_hash"]:
        raise ApiError(400, f"{member['name']} has no web password yet; set the first one on the server: "
                       f"python -m serve member password {member['name']}", code="no_password")  # fmt: skip
    if not await server.password_checks(request, member["name"], current, member["password_hash"]):
        raise ApiError(403, "the current password is wrong", param="current", code="wrong_password")
    check_password(new, server.settings, member["role"], "new")
    if new == current:
        raise ApiError(400, "the new password must differ from the current one", param="new",
                       code="same_password")  # fmt: skip
    password_hash = await asyncio.to_thread(accounts.hash_password, new, server.settings["scrypt"])
    by_cookie = request.headers.get("authorization") is None
    key = server.store.change_password(
        member["id"], password_hash, session_token(request) if by_cookie else None
    )
    return JSONResponse(me(member | {"provisional": 0}) | ({"api_key": key} if key else {}))


async def list_conversations(request):
    server = request.app.state.server
    member = server.member_of(request)
    return JSONResponse({"data": server.store.conversations(member["id"])})


async def new_conversation(request):
    server = request.app.state.server
    member = server.member_of(request)
    has_body = int(request.headers.get("content-length") or 0)
    body = await read_json(request, server.settings["max_form_bytes"]) if has_body else {}
    title = expect(body.get("title", "Nueva conversación"), str, "title", "a string")[:100]
    conversation_id = server.store.new_conversation(member["id"], title)
    return JSONResponse(server.store.conversation(member["id"], conversation_id), status_code=201)


def owned(server, member, conversation_id):
    conversation = server.store.conversation(member["id"], conversation_id)
    if conversation is None:  # not theirs or not there: the same answer, so nothing leaks
        raise ApiError(404, f"no conversation {conversation_id!r} of yours", code="conversation_not_found")
    return conversation


async def get_conversation(request):
    """The conversation with the member's own rating on each answer they rated ("feedback")."""
    server = request.app.state.server
    member = server.member_of(request)
    conversation = owned(server, member, request.path_params["id"])
    messages = conversation["messages"]
    for item in feedback_call(server, feedback.list_feedback, member["id"], conversation["id"]):
        if item["message_index"] < len(messages):
            messages[item["message_index"]]["feedback"] = {k: item[k] for k in ("id", "rating", "better")}
    return JSONResponse(conversation)


async def delete_conversation(request):
    server = request.app.state.server
    member = server.member_of(request)
    if not server.store.delete_conversation(member["id"], request.path_params["id"]):
        owned(server, member, request.path_params["id"])  # raises the 404
    return JSONResponse({"deleted": request.path_params["id"]})


# --- accounts (admin)


async def list_members(request):
    server = request.app.state.server
    server.admin_of(request)
    return JSONResponse(
        {"data": [me(m) | {"has_password": bool(m["has_password"])} for m in server.store.members()]}
    )


async def add_member(request):
    server = request.app.state.server
    server.admin_of(request)
    body = await read_json(request, server.settings["max_form_bytes"])
    name = expect(body.get("name"), str, "name", "the member's name")
    role = expect(body.get("role"), str, "role", "admin, adult or child")
    password = expect(body.get("password"), str, "password", "the member's first password or PIN")
    if role not in accounts.ROLES:
        raise ApiError(400, f"role {role!r}: expected one of {', '.join(accounts.ROLES)}", param="role",
                       code="invalid_member")  # fmt: skip
    check_password(password, server.settings, role)
    password_hash = await asyncio.to_thread(accounts.hash_password, password, server.settings["scrypt"])
    try:
        key = server.store.add_member(name, role, password_hash, provisional=True)
    except accounts.AccountError as e:
        raise ApiError(400, str(e), code="invalid_member") from None
    return JSONResponse(
        me({"name": name, "role": role, "provisional": 1}) | {"api_key": key}, status_code=201
    )


async def remove_member(request):
    server = request.app.state.server
    admin = server.admin_of(request)
    name = request.path_params["name"]
    if name.lower() == admin["name"].lower():
        raise ApiError(400, "an admin cannot remove their own account", code="invalid_member")
    if not server.store.remove_member(name):
        raise ApiError(404, f"no member {name!r}", code="member_not_found")
    return JSONResponse({"deleted": name})


async def new_member_key(request):
    """A new API key for the caller's own account (the old one stops working). Another member's key is
    replaced only on the server's machine (`python -m serve member new-key`): whoever holds a member's key reads
    their conversations, and an admin must not."""
    server = request.app.state.server
    member, name = server.member_of(request), request.path_params["name"]
    if name.lower() != member["name"].lower():
        server.admin_of(request)
        if server.store.member(name) is None:
            raise ApiError(404, f"no member {name!r}", code="member_not_found")
        raise ApiError(403, f"only {name} replaces their own key here (it would read their conversations); "
                       f"on the server: python -m serve member new-key {name}", code="not_your_key")  # fmt: skip
    return JSONResponse({"name": member["name"], "api_key": server.store.new_key(member["name"])})


async def server_status(request):
    server = request.app.state.server
    server.admin_of(request)
    return JSONResponse(
        server.worker.status() | {"model": server.model_id, "storage": server.storage_status()}
    )


# --- memories: the logged-in member's own (family/memories.py); the admin has none


def memory_member(server, request):
    member = server.member_of(request)
    if member["role"] == "admin":
        raise ApiError(403, "the admin role manages accounts and does not read memories", code="admin_only")
    return member


def memory_call(server, member, function, *args, **kwargs):
    """family/memories.py's errors as 4xx; a database locked by another program is database_error's 503."""
    try:
        return server.memories(member, function, *args, **kwargs)
    except memories.MemoryNotFound as e:  # not there or not theirs: the same answer
        raise ApiError(404, str(e), code="memory_not_found") from None
    except memories.MemoryPermissionError as e:
        raise ApiError(403, str(e), code="memory_forbidden") from None
    except memories.MemoryStoreError as e:
        raise ApiError(400, str(e), code="invalid_memory") from None


async def memory_changes(request, server):
    body = await read_json(request, 4 * server.memory_cfg["max_text_chars"] + 1024)  # UTF-8: <= 4 bytes/char
    changes = {}
    if "text" in body:
        changes["text"] = expect(body["text"], str, "text", "the memory's text")
    if "scope" in body:
        changes["scope"] = expect(body["scope"], str, "scope", "'private' or 'family'")
    if "pinned" in body:
        changes["pinned"] = expect(body["pinned"], bool, "pinned", "true or false")
    return changes


async def list_memories(request):
    server = request.app.state.server
    member = memory_member(server, request)
    return JSONResponse({"data": memory_call(server, member, memories.list_memories)})


async def add_memory(request):
    server = request.app.state.server
    member = memory_member(server, request)
    changes = await memory_changes(request, server)
    if "text" not in changes:
        raise ApiError(400, "text: required", param="text", code="invalid_memory")
    text = changes.pop("text")
    memory_id = memory_call(server, member, memories.add, text, server.memory_cfg, **changes)
    return JSONResponse(memory_call(server, member, memories.get, memory_id), status_code=201)


async def edit_memory(request):
    server = request.app.state.server
    member = memory_member(server, request)
    changes = await memory_changes(request, server)
    edited = memory_call(
        server,
        member,
        memories.edit,
        row_id(request, "memory", "memory_not_found"),
        server.memory_cfg,
        **changes,
    )
    return JSONResponse(edited)


async def delete_memory(request):
    """Forget a memory: gone from every list and turn at once, back with restore_memory until erase_after
    (Unix seconds; null: erased already, memory.forget_undo_s 0)."""
    server = request.app.state.server
    member = memory_member(server, request)
    memory_id, undo_s = row_id(request, "memory", "memory_not_found"), server.memory_cfg["forget_undo_s"]
    forgotten = memory_call(server, member, memories.forget_later, memory_id, undo_s)
    return JSONResponse({"deleted": forgotten["id"], "erase_after": forgotten["erase_after"]})


async def restore_memory(request):
    server = request.app.state.server
    member = memory_member(server, request)
    restored = memory_call(server, member, memories.take_back, row_id(request, "memory", "memory_not_found"))
    return JSONResponse(restored)


async def delete_all_memories(request):
    server = request.app.state.server
    member = memory_member(server, request)
    return JSONResponse({"deleted": memory_call(server, member, memories.forget_all)})


async def export_memories(request):
    server = request.app.state.server
    member = memory_member(server, request)
    disposition = {"Content-Disposition": 'attachment; filename="recuerdos.json"'}
    return JSONResponse(memory_call(server, member, memories.export), headers=disposition)


# --- ratings of answers and consent to train on them (family/feedback.py): each member's own, the admin's too


def feedback_call(server, function, *args):
    """family/feedback.py's errors as 4xx; a member's feedback that is not there or not theirs is the same 404."""
    with server.store.lock:
        try:
            return function(server.store.db, *args)
        except feedback.FeedbackNotFound as e:
            raise ApiError(404, str(e), code="feedback_not_found") from None
        except feedback.ConsentForbidden as e:
            raise ApiError(403, str(e), code="consent_forbidden") from None
        except feedback.FeedbackError as e:
            raise ApiError(400, str(e), code="invalid_feedback") from None


def rated_answer(server, member, request):
    """(conversation id, message index, the messages) of an answer in the member's own conversation."""
    conversation = owned(server, member, request.path_params["id"])
    index, messages = request.path_params["n"], conversation["messages"]
    if not 0 <= index < len(messages) or messages[index]["role"] != "assistant":
        raise ApiError(404, f"message {index} of conversation {conversation['id']!r} is not an answer of the "
                       "assistant (messages count from 0)", code="message_not_found")  # fmt: skip
    return conversation["id"], index, messages


async def rate_answer(request):
    """{"rating": 1 | -1, "better": "the answer wanted"?}: the member's rating of one answer (a second one
    replaces the first)."""
    server = request.app.state.server
    member = server.member_of(request)
    conversation_id, index, messages = rated_answer(server, member, request)
    body = await read_json(request, server.settings["max_body_bytes"])
    rating = expect(body.get("rating"), int, "rating", "1 (👍) or -1 (👎)")
    better = body.get("better")
    if better is not None:
        expect(better, str, "better", "the text of the answer you wanted")
    prompt = [{"role": m["role"], "content": m["content"]} for m in messages[:index]]
    answer = messages[index]["content"]
    stored = feedback_call(
        server, feedback.rate, member["id"], conversation_id, index, prompt, answer, rating, better
    )
    return JSONResponse(stored)


async def unrate_answer(request):
    server = request.app.state.server
    member = server.member_of(request)
    conversation_id, index, _ = rated_answer(server, member, request)
    removed = feedback_call(server, feedback.remove_of_message, member["id"], conversation_id, index)
    return JSONResponse({"deleted": removed})


async def list_feedback(request):
    server = request.app.state.server
    member = server.member_of(request)
    return JSONResponse({"data": feedback_call(server, feedback.list_feedback, member["id"])})


async def delete_feedback(request):
    server = request.app.state.server
    member = server.member_of(request)
    removed = feedback_call(
        server, feedback.remove, member["id"], row_id(request, "feedback", "feedback_not_found")
    )
    return JSONResponse({"deleted": removed})


async def delete_all_feedback(request):
    server = request.app.state.server
    member = server.member_of(request)
    return JSONResponse({"deleted": feedback_call(server, feedback.remove_all, member["id"])})


async def export_feedback(request):
    server = request.app.state.server
    member = server.member_of(request)
    disposition = {"Content-Disposition": 'attachment; filename="valoraciones.json"'}
    return JSONResponse(feedback_call(server, feedback.export, member), headers=disposition)


def consent_view(server, member):
    """The member's consent, whether they may change it, and for an adult the family's children's."""
    view = feedback_call(server, feedback.consent, member["id"])
    view["may_change"] = feedback.may_set_consent(member, member) is None
    if member["role"] in feedback.ADULT_ROLES:
        children = [m for m in server.store.members() if m["role"] == "child"]
        view["children"] = [
            {"name": child["name"]} | feedback_call(server, feedback.consent, child["id"])
            for child in children
        ]
    return view


async def get_consent(request):
    server = request.app.state.server
    return JSONResponse(consent_view(server, server.member_of(request)))


async def consent_of_body(request, server):
    body = await read_json(request, server.settings["max_form_bytes"])
    return expect(body.get("granted"), bool, "granted", "true or false")


async def set_own_consent(request):
    """{"granted": true | false}: "usar mis valoraciones para entrenar" (adults; a child's is an adult's)."""
    server = request.app.state.server
    member = server.member_of(request)
    granted = await consent_of_body(request, server)
    feedback_call(server, feedback.set_consent, member, member, granted)
    return JSONResponse(consent_view(server, member))


async def set_member_consent(request):
    """An adult (or the admin) sets a child's consent; anyone else's is theirs to set."""
    server = request.app.state.server
    member = server.member_of(request)
    if member["role"] not in feedback.ADULT_ROLES:  # before the name is looked up: nothing to learn here
        raise ApiError(403, "a child's consent is set by an adult of the family", code="consent_forbidden")
    target = server.store.member(request.path_params["name"])
    if target is None:
        raise ApiError(404, f"no member {request.path_params['name']!r}", code="member_not_found")
    granted = await consent_of_body(request, server)
    changed = feedback_call(server, feedback.set_consent, member, target, granted)
    return JSONResponse({"name": target["name"]} | changed)
