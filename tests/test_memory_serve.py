"""Memories through the family's server: every path a member can take (the prompt of a turn, the agent's
tools bound by the server, the REST endpoints, the web page in a real browser) across two members and
the admin, and the server's hold on its database (snapshots record its model; restore waits for it).

Real servers on 127.0.0.1 (test_serve's in-process uvicorn, or serve/app.py in a subprocess); a scripted
model stands in for the model's choices where a test reads the prompt it was given."""

import json
import os
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest
from conftest import ROOT, ScriptedModel, live_server, start_server
from test_serve import login, member
from test_web import all_of, browser, by_id, log_in, screenshot, wait_for  # noqa: F401 - browser is a fixture

import checkpoint
import fileio
from family import accounts, memories, store

SECRET = "A Lucía no le gusta el pescado"  # ana's private memory
CHILD_SECRET = "Luis esconde las galletas en el armario"  # luis's private memory
SHARED = "El cumpleaños de la abuela es el 3 de mayo"  # a family memory, by ana


def wait_until(condition, seconds):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


def family_of(server):
    """ana (adult, also logged in on the web), luis (child) and root (admin): their API keys."""
    return {
        "ana": member(server, "ana", "adult", "clave-ana"),
        "luis": member(server, "luis", "child"),
        "root": member(server, "root", "admin"),
    }


def test_rest_reaches_only_the_logged_in_members_memories(chat_model, tmp_path):
    with live_server(chat_model, tmp_path) as (url, server):
        keys = family_of(server)
        ana, answer = login(url, "ana", "clave-ana")  # the web session, as the page uses it
        assert answer.status_code == 200
        luis = httpx.Client(base_url=url, headers=bearer(keys["luis"]))
        root = httpx.Client(base_url=url, headers=bearer(keys["root"]))

        private = ana.post("/api/memories", json={"text": SECRET, "pinned": True})
        shared = ana.post("/api/memories", json={"text": SHARED, "scope": "family"})
        assert private.status_code == shared.status_code == 201 and private.json()["pinned"] is True
        own = luis.post("/api/memories", json={"text": CHILD_SECRET})
        assert own.status_code == 201
        refused = luis.post("/api/memories", json={"text": "hoy no hay cole", "scope": "family"})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "memory_forbidden"
        ids = {"ana": private.json()["id"], "shared": shared.json()["id"], "luis": own.json()["id"]}

        assert [m["text"] for m in ana.get("/api/memories").json()["data"]] == [SHARED, SECRET]
        assert [(m["text"], m["editable"]) for m in luis.get("/api/memories").json()["data"]] == [
            (CHILD_SECRET, True),
            (SHARED, False),
        ]
        for attempt in (
            luis.patch(f"/api/memories/{ids['ana']}", json={"text": "cambiado"}),
            luis.delete(f"/api/memories/{ids['ana']}"),
            luis.patch(f"/api/memories/{ids['shared']}", json={"text": "cambiado"}),
            luis.delete(f"/api/memories/{ids['shared']}"),
            ana.patch(f"/api/memories/{ids['luis']}", json={"pinned": True}),
            ana.delete(f"/api/memories/{ids['luis']}"),
        ):
            assert attempt.status_code == 404, (attempt.request.url, attempt.text)
            assert "Lucía" not in attempt.text and "galletas" not in attempt.text
        for attempt in (
            root.get("/api/memories"),
            root.get("/api/memories/export"),
            root.post("/api/memories", json={"text": "nota"}),
            root.patch(f"/api/memories/{ids['shared']}", json={"text": "x"}),
            root.delete(f"/api/memories/{ids['ana']}"),
            root.delete("/api/memories"),
        ):
            assert attempt.status_code == 403 and attempt.json()["error"]["code"] == "admin_only"
            assert "Lucía" not in attempt.text and "abuela" not in attempt.text
        assert httpx.get(url + "/api/memories").status_code == 401

        exported = luis.get("/api/memories/export")
        assert "attachment" in exported.headers["content-disposition"]
        assert [m["text"] for m in exported.json()["memories"]] == [CHILD_SECRET]
        assert luis.delete("/api/memories").json() == {"deleted": 1}
        assert [m["text"] for m in ana.get("/api/memories").json()["data"]] == [SHARED, SECRET]

        edited = ana.patch(f"/api/memories/{ids['ana']}", json={"text": "A Lucía le encanta el pescado"})
        assert edited.status_code == 200 and edited.json()["text"] == "A Lucía le encanta el pescado"
        assert ana.patch(f"/api/memories/{ids['ana']}", json={"pinned": "sí"}).status_code == 400
        assert ana.post("/api/memories", json={"text": "x" * 501}).status_code == 400
        forgotten = ana.delete(f"/api/memories/{ids['ana']}").json()  # back with its undo for a while
        assert forgotten["deleted"] == ids["ana"] and forgotten["erase_after"] > time.time()
        assert [m["text"] for m in ana.get("/api/memories").json()["data"]] == [SHARED]
        for client in (ana, luis, root):
            client.close()


def prompt_text(model, tokenizer):
    return tokenizer.decode(model.prompts[-1])


def test_each_turn_carries_only_the_asking_members_memories(chat_model, tmp_path):
    tokenizer = chat_model[1]
    scripted = ScriptedModel([tokenizer.special_ids["<|end|>"]])
    with live_server(chat_model, tmp_path, "serve.tools=false", model=scripted, context=4096) as (
        url,
        server,
    ):
        keys = family_of(server)
        server.memories(server.store.member("ana"), memories.add, SECRET, server.memory_cfg)
        server.memories(server.store.member("ana"), memories.add, SHARED, server.memory_cfg, scope="family")
        server.memories(server.store.member("luis"), memories.add, CHILD_SECRET, server.memory_cfg)
        question = "¿Qué sabes de Lucía, del pescado, de las galletas y del cumpleaños de la abuela?"
        seen = {}
        for name in ("ana", "luis", "root"):
            body = {
                "model": server.model_id,
                "messages": [{"role": "user", "content": question}],
                "max_tokens": 4,
            }
            answer = httpx.post(url + "/v1/chat/completions", json=body, headers=bearer(keys[name]))
            assert answer.status_code == 200, answer.text
            seen[name] = prompt_text(scripted, tokenizer)
        system = {name: text.split(question)[0] for name, text in seen.items()}  # before the user's turn
        assert SECRET in system["ana"] and SHARED in system["ana"] and CHILD_SECRET not in system["ana"]
        assert CHILD_SECRET in system["luis"] and SHARED in system["luis"] and SECRET not in system["luis"]
        assert server.memory_cfg["header"] not in seen["root"] and "Lucía no" not in seen["root"]


def call_ids(tokenizer, name, arguments):
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return tokenizer.encode(f"<tool_call>\n{body}\n</tool_call>") + [tokenizer.special_ids["<|end|>"]]


def test_the_servers_tool_loop_runs_the_memory_tools_as_the_asking_member(chat_model, tmp_path):
    tokenizer = chat_model[1]
    end = tokenizer.special_ids["<|end|>"]
    done = tokenizer.encode("Vale.") + [end]
    with live_server(chat_model, tmp_path, model=ScriptedModel([end]), context=4096) as (url, server):
        keys = family_of(server)
        ana_id = server.memories(server.store.member("ana"), memories.add, SECRET, server.memory_cfg)

        def turn(name, *scripts, says="hola"):  # recordar and olvidar run only when the member asks
            server.worker.model = model = ScriptedModel(*scripts)
            body = {"model": server.model_id, "messages": [{"role": "user", "content": says}]}
            answer = httpx.post(url + "/v1/chat/completions", json=body, headers=bearer(keys[name]))
            assert answer.status_code == 200, answer.text
            return [tokenizer.decode(prompt) for prompt in model.prompts]

        prompts = turn(
            "luis", call_ids(tokenizer, "recordar", {"texto": CHILD_SECRET}), done, says="Recuerda esto"
        )
        assert '"recordar"' in prompts[0] and "guardado (privado)" in prompts[1]
        [stored] = httpx.get(url + "/api/memories", headers=bearer(keys["luis"])).json()["data"]
        assert (stored["text"], stored["member"], stored["source"]) == (CHILD_SECRET, "luis", "assistant")
        assert [
            m["text"] for m in httpx.get(url + "/api/memories", headers=bearer(keys["ana"])).json()["data"]
        ] == [SECRET]
        prompts = turn(
            "luis", call_ids(tokenizer, "buscar_recuerdos", {"consulta": "Lucía pescado galletas"}), done
        )
        assert "galletas" in prompts[1].split("<tool_response>")[-1] and "Lucía no" not in prompts[1]
        prompts = turn(
            "luis", call_ids(tokenizer, "olvidar", {"id": ana_id}), done, says="Olvida ese recuerdo"
        )
        assert f"Error: no hay ningún recuerdo {ana_id}" in prompts[1]
        prompts = turn(
            "luis", call_ids(tokenizer, "recordar", {"texto": "no hay cole", "ambito": "familia"}), done,
            says="Recuerda para todos que no hay cole",
        )  # fmt: skip
        assert "Error: solo una persona adulta" in prompts[1]
        prompts = turn("root", call_ids(tokenizer, "buscar_recuerdos", {"consulta": "Lucía"}), done)
        assert '"recordar"' not in prompts[0] and "no existe la herramienta 'buscar_recuerdos'" in prompts[1]
        assert [
            m["text"] for m in httpx.get(url + "/api/memories", headers=bearer(keys["ana"])).json()["data"]
        ] == [SECRET]


def test_a_forgotten_memory_comes_back_until_its_undo_time_ends_then_no_byte_of_it_is_left(
    chat_model, tmp_path
):
    tokenizer = chat_model[1]
    end = tokenizer.special_ids["<|end|>"]
    word = "zanahoriazul"
    with live_server(chat_model, tmp_path, "memory.forget_undo_s=3", model=ScriptedModel([end]),
                     context=4096) as (url, server):  # fmt: skip
        keys = family_of(server)
        ana = bearer(keys["ana"])

        def texts():
            return [m["text"] for m in httpx.get(url + "/api/memories", headers=ana).json()["data"]]

        def restore(memory_id, key=keys["ana"]):
            return httpx.post(url + f"/api/memories/{memory_id}/restore", headers=bearer(key))

        memory_id = httpx.post(url + "/api/memories", json={"text": f"la clave del wifi es {word}"},
                               headers=ana).json()["id"]  # fmt: skip
        # The olvidar tool, as the member asks: gone from every list at once, back with the page's undo.
        server.worker.model = ScriptedModel(call_ids(tokenizer, "olvidar", {"id": memory_id}),
                                            tokenizer.encode("Hecho.") + [end])  # fmt: skip
        body = {"model": server.model_id, "messages": [{"role": "user", "content": "Olvida lo del wifi"}]}
        assert httpx.post(url + "/v1/chat/completions", json=body, headers=ana).status_code == 200
        assert texts() == []
        assert restore(memory_id, keys["luis"]).status_code == 404  # only who forgot it brings it back
        assert restore(memory_id).json()["id"] == memory_id and texts() == [f"la clave del wifi es {word}"]
        # Forgotten again (the page's delete): once the 3 s are over it is erased, files and index.
        forgotten = httpx.delete(url + f"/api/memories/{memory_id}", headers=ana).json()
        assert forgotten["deleted"] == memory_id and forgotten["erase_after"] > time.time() + 1
        assert (
            texts() == [] and server.store.query("SELECT count(*) AS n FROM forgotten_memories")[0]["n"] == 1
        )
        wait_until(
            lambda: server.store.query("SELECT count(*) AS n FROM forgotten_memories")[0]["n"] == 0, 15
        )
        assert restore(memory_id).status_code == 404 and texts() == []
        [hits] = server.store.query(
            "SELECT count(*) AS n FROM memories_fts WHERE memories_fts MATCH ?", (word,)
        )
        assert hits["n"] == 0
        database = server.store.path
    for path in (database, database + "-wal"):
        if os.path.exists(path):
            with open(path, "rb") as f:
                assert word.encode() not in f.read(), path


def test_removing_a_member_removes_their_memories(chat_model, tmp_path):
    with live_server(chat_model, tmp_path) as (url, server):
        keys = family_of(server)
        assert (
            httpx.post(
                url + "/api/memories", json={"text": CHILD_SECRET}, headers=bearer(keys["luis"])
            ).status_code
            == 201
        )
        assert httpx.delete(url + "/api/members/luis", headers=bearer(keys["root"])).status_code == 200
        newcomer = member(server, "Luis", "child")  # a new account with the same name starts with nothing
        assert httpx.get(url + "/api/memories", headers=bearer(newcomer)).json()["data"] == []
        count = server.store.query("SELECT count(*) AS n FROM memories")[0]["n"]
        assert count == 0


def test_a_database_another_program_keeps_locked_is_a_503_with_retry_after_until_it_lets_go(
    chat_model, tmp_path
):
    with live_server(chat_model, tmp_path, "serve.busy_timeout_ms=200", "serve.retry_after_s=3") as (
        url,
        server,
    ):
        ana = httpx.Client(base_url=url, headers=bearer(member(server, "ana", "adult")))
        assert ana.post("/api/memories", json={"text": SHARED}).status_code == 201
        # Another program (the memory command line, say) takes the write lock and keeps it.
        other = sqlite3.connect(server.settings["database"], isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            for answer in (ana.post("/api/memories", json={"text": SECRET}), ana.post("/api/conversations")):
                assert answer.status_code == 503, answer.text
                assert answer.headers["Retry-After"] == "3"
                error = answer.json()["error"]
                assert (error["code"], error["type"]) == ("database_busy", "server_overloaded")
                assert "busy" in error["message"] and "Traceback" not in answer.text
            assert [m["text"] for m in ana.get("/api/memories").json()["data"]] == [
                SHARED
            ]  # reads go on (WAL)
        finally:
            other.execute("ROLLBACK")
            other.close()
        # Once it lets go, the same request succeeds and nothing was half-written meanwhile.
        assert ana.post("/api/memories", json={"text": SECRET}).status_code == 201
        assert sorted(m["text"] for m in ana.get("/api/memories").json()["data"]) == sorted([SHARED, SECRET])
        assert ana.get("/api/conversations").json()["data"] == []
        assert ana.post("/api/conversations").status_code == 201
        ana.close()


def test_the_command_line_takes_the_role_of_the_account(tmp_path):
    database = str(tmp_path / "familia.sqlite")
    store = accounts.Store(database)
    store.add_member("luis", "child")
    store.db.close()

    def cli(*args):
        command = [sys.executable, "-m", "family", "--db", database, *args]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)

    refused = cli("add", "--member", "luis", "--family", "hoy no hay cole")
    assert refused.returncode == 2 and "a child may keep only private memories" in refused.stderr
    assert cli("add", "--member", "luis", "mi color es el verde").returncode == 0
    assert "verde" in cli("list", "--member", "luis").stdout


# -----------------------------------------------------------------------------
# serve/app.py in a subprocess: the lock, and what snapshots record


def test_the_running_server_holds_its_database_and_snapshots_record_its_model(chat_run, tmp_path):
    database = str(tmp_path / "familia.sqlite")
    accounts_store = accounts.Store(database)
    accounts_store.add_member("ana", "adult")
    with accounts_store.lock:
        memories.add(accounts_store.db, "ana", "adult", SECRET, memories.load_config())
    accounts_store.db.close()
    cfg = memories.load_config()
    cfg["snapshots"]["dir"] = str(tmp_path / "snapshots")
    scheduled = tmp_path / "scheduled"  # the server's own schedule, every ~0.4 s for the test
    schedule = ("memory.snapshots.every_hours=0.0001", f"memory.snapshots.dir={scheduled}")
    proc, _ = start_server(chat_run, database, *schedule, log_path=tmp_path / "server.log")
    try:
        wait_until(lambda: store.list_snapshots(str(scheduled)), 120)
        first = store.verify(store.list_snapshots(str(scheduled))[0])
        assert first["server"]["pid"] == proc.pid and first["server"]["config"]["memory"]["snapshots"] == {
            "dir": str(scheduled),
            "keep_last": cfg["snapshots"]["keep_last"],
            "every_hours": 0.0001,
        }
        path = store.snapshot(database, cfg, log=lambda _: None)
        server = store.verify(path)["server"]
        ckpt = server["checkpoint"]
        assert server["pid"] == proc.pid and os.path.dirname(ckpt) == os.path.abspath(chat_run)
        assert server["checkpoint_sha256"] == fileio.sha256_of_file(ckpt)
        assert server["tokenizer_sha256"] == checkpoint.stored_tokenizer_sha256(
            checkpoint.load_checkpoint(ckpt)
        )
        assert server["config"]["serve"]["database"] == database and server["code_version"]
        with pytest.raises(store.SnapshotError, match=f"server is running \\(pid {proc.pid}"):
            store.restore(path, database, log=lambda _: None)
        second = subprocess.run(
            [sys.executable, "-m", "serve", chat_run, "--port", "0", f"serve.database={database}"],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert second.returncode == 2 and "the server is running" in second.stderr
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    bad = subprocess.run(
        [sys.executable, "-m", "serve", chat_run, f"serve.database={database}", "memory.snapshots.every_hours=-1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2 and "memory.snapshots.every_hours: -1 is out of range" in bad.stderr
    restored = subprocess.run(
        [sys.executable, "-m", "family", "--db", database, "restore", path],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert restored.returncode == 0, restored.stderr
    assert ckpt in restored.stdout and server["checkpoint_sha256"] in restored.stdout


# -----------------------------------------------------------------------------
# The "Mis recuerdos" panel in a real browser


@pytest.fixture(scope="module")
def web_family(chat_run, tmp_path_factory):
    """serve/app.py with ana (adult) and luis (child), both with web passwords; yields the URL and the store."""
    folder = tmp_path_factory.mktemp("web-memories")
    database = str(folder / "familia.sqlite")
    store = accounts.Store(database)
    for name, role in (("ana", "adult"), ("luis", "child")):
        store.add_member(name, role)
        store.set_password(name, accounts.hash_password("clave-" + name, {"n": 1024, "r": 8, "p": 1}))
    proc, url = start_server(chat_run, database, log_path=folder / "server.log")
    yield url
    proc.kill()
    proc.wait()
    proc.stdout.close()


def shown_memories(driver):
    """The texts in the panel, read in one script (the list is rebuilt after every change)."""
    return driver.execute_script(
        "return [...document.querySelectorAll('#memories .memory-text')].map((e) => e.textContent)"
    )


def open_panel(driver):
    if not driver.execute_script("return document.getElementById('memories-panel').open"):
        if by_id(driver, "menu").is_displayed():  # on a phone the sidebar slides in
            by_id(driver, "menu").click()
        wait_for(driver, lambda d: all_of(d, "#memories-panel summary")[0].is_displayed())
        all_of(driver, "#memories-panel summary")[0].click()
    wait_for(driver, lambda d: by_id(d, "memory-text").is_displayed())


def add_in_page(driver, text, family=False):
    by_id(driver, "memory-text").send_keys(text)
    if family:
        by_id(driver, "memory-family").click()
    by_id(driver, "memory-save").click()
    wait_for(driver, lambda d: text in shown_memories(d) or by_id(d, "memories-error").text)


def test_the_panel_shows_a_member_only_their_memories_and_the_familys(browser, web_family):  # noqa: F811
    url = web_family
    log_in(browser, url, "ana", "clave-ana")
    open_panel(browser)
    add_in_page(browser, SECRET)
    add_in_page(browser, SHARED, family=True)
    add_in_page(browser, "Comprar pan el viernes")
    assert shown_memories(browser) == ["Comprar pan el viernes", SHARED, SECRET]
    screenshot(browser, "memories-1-ana.png")

    [bread] = [row for row in all_of(browser, "#memories .memory") if "pan" in row.text]
    bread.find_element("css selector", ".memory-edit").click()
    field = wait_for(browser, lambda d: all_of(d, "#memories .memory-input"))[0]
    field.clear()
    field.send_keys("Comprar pan el sábado")
    all_of(browser, "#memories .memory-update")[0].click()
    wait_for(browser, lambda d: "Comprar pan el sábado" in shown_memories(d))
    [bread] = [row for row in all_of(browser, "#memories .memory") if "pan" in row.text]
    bread.find_element("css selector", ".memory-forget").click()
    wait_for(browser, lambda d: shown_memories(d) == [SHARED, SECRET])
    ids = browser.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#memories .memory')]"
        ".map((row) => [row.querySelector('.memory-text').textContent, row.dataset.id]))"
    )

    if by_id(browser, "menu").is_displayed() and not by_id(browser, "logout").is_displayed():
        by_id(browser, "menu").click()
    wait_for(browser, lambda d: by_id(d, "logout").is_displayed())
    by_id(browser, "logout").click()
    wait_for(browser, lambda d: by_id(d, "login").is_displayed())
    assert shown_memories(browser) == []  # nothing of ana's stays in the page
    log_in(browser, url, "luis", "clave-luis")
    open_panel(browser)
    wait_for(browser, lambda d: shown_memories(d) == [SHARED])
    add_in_page(browser, "Mi color favorito es el verde", family=True)
    assert (
        by_id(browser, "memories-error").text == "Solo las personas adultas guardan recuerdos de la familia."
    )
    assert shown_memories(browser) == [SHARED]
    assert all_of(browser, "#memories .memory-edit") == []  # a child cannot change the family's
    statuses = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        f"Promise.all([fetch('/api/memories/{ids[SECRET]}', {{method: 'DELETE', headers: sessionHeaders()}}),"
        f" fetch('/api/memories/{ids[SHARED]}', {{method: 'PATCH',"
        " headers: {...sessionHeaders(), 'Content-Type': 'application/json'},"
        ' body: \'{"text": "x"}\'})]).then((rs) => done(rs.map((r) => r.status)));'
    )
    assert statuses == [404, 404]

    by_id(browser, "memory-text").clear()  # the refused text stays in the form, family still ticked
    by_id(browser, "memory-family").click()
    by_id(browser, "memory-pinned").click()
    add_in_page(browser, "Mi color favorito es el verde")
    [green] = [row for row in all_of(browser, "#memories .memory") if "verde" in row.text]
    assert "privado · siempre presente" in green.text
    screenshot(browser, "memories-2-luis.png")
    exported = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch(document.getElementById('memories-export').href, {headers: sessionHeaders()})"
        ".then((r) => r.json()).then(done);"
    )
    assert [(m["member"], m["scope"], m["text"], m["pinned"]) for m in exported["memories"]] == [
        ("luis", "private", "Mi color favorito es el verde", True)
    ]
    by_id(browser, "memories-delete-all").click()
    browser.switch_to.alert.accept()
    wait_for(browser, lambda d: shown_memories(d) == [SHARED])
