"""The family's feedback on answers through the server (family/feedback.py behind serve/web.py's routes): every
route private to its member, whoever else asks (another adult, a child, the admin, by key or by cookie);
consent off by default, a child's set only by an adult; `python -m chat preferences` exports only consented
feedback, turning consent off withdraws what was given before; deleting an account deletes its feedback.
Real servers on 127.0.0.1 (test_serve's in-process uvicorn), a real `python -m chat preferences` subprocess, and
the page in headless Chromium (test_web's browser)."""

import json
import os
import sqlite3
import subprocess
import sys

import httpx
import pytest
from conftest import ROOT, live_server
from test_serve import login, member
from test_web import all_of, browser, by_id, log_in, screenshot, wait_for  # noqa: F401 - browser is a fixture

from family import accounts

SECRET = "Mi hermana está embarazada y aún no lo sabe nadie"  # what ana asks
BETTER = "¡Qué buena noticia! Guarda el secreto hasta que ella quiera contarlo."


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


def chat_turn(http, cid, text):
    """One stored turn of conversation cid; the answer's index in the conversation's messages."""
    answer = http.post(
        f"/api/conversations/{cid}/messages", json={"content": text, "max_tokens": 4, "stream": False}
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["message_index"]


def preferences(database, tmp_path, *extra):
    """`python -m chat preferences --db DATABASE OUT.jsonl`: (the pairs written, stdout)."""
    out = tmp_path / f"pairs-{len(os.listdir(tmp_path))}.jsonl"
    done = subprocess.run([sys.executable, "-m", "chat", "preferences", "--db", database, str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [
        json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()
    ], done.stdout + done.stderr


def test_every_feedback_route_reaches_only_the_members_own_and_the_admin_reads_none(chat_model, tmp_path):
    with live_server(chat_model, tmp_path, "serve.tools=false") as (url, server):
        keys = {name: member(server, name, role, "clave-" + name) for name, role in
                [("ana", "adult"), ("beto", "adult"), ("carla", "admin"), ("dani", "child")]}  # fmt: skip
        ana = httpx.Client(base_url=url, headers=bearer(keys["ana"]))
        cid = ana.post("/api/conversations").json()["id"]
        index = chat_turn(ana, cid, SECRET)
        assert index == 1
        rated = ana.post(
            f"/api/conversations/{cid}/messages/{index}/feedback", json={"rating": -1, "better": BETTER}
        )
        assert rated.status_code == 200, rated.text
        feedback_id = rated.json()["id"]
        assert (
            rated.json()["prompt"] == [{"role": "user", "content": SECRET}]
            and rated.json()["better"] == BETTER
        )
        own = ana.get(f"/api/conversations/{cid}").json()["messages"][index]["feedback"]
        assert own == {"id": feedback_id, "rating": -1, "better": BETTER}

        for name in ("beto", "carla", "dani"):
            for by_key in (True, False):
                if by_key:
                    other = httpx.Client(base_url=url, headers=bearer(keys[name]))
                else:
                    other, answer = login(url, name, "clave-" + name)
                    assert answer.status_code == 200
                listed = other.get("/api/feedback")
                exported = other.get("/api/feedback/export")
                assert listed.json()["data"] == [] and exported.json()["feedback"] == []
                attempts = [
                    other.post(f"/api/conversations/{cid}/messages/{index}/feedback", json={"rating": 1}),
                    other.delete(f"/api/conversations/{cid}/messages/{index}/feedback"),
                    other.delete(f"/api/feedback/{feedback_id}"),
                    other.get(f"/api/conversations/{cid}"),
                ]
                for attempt in attempts:
                    assert attempt.status_code == 404, (
                        name,
                        attempt.request.method,
                        attempt.request.url,
                        attempt.text,
                    )
                for answer in [
                    listed,
                    exported,
                    *attempts,
                    other.delete("/api/feedback"),
                    other.get("/api/consent"),
                ]:
                    assert SECRET not in answer.text and BETTER not in answer.text, (name, answer.request.url)
                other.close()
        # Their "delete all" deleted their own (none), not ana's.
        [kept] = ana.get("/api/feedback").json()["data"]
        assert kept["id"] == feedback_id and kept["rating"] == -1 and kept["answer"]
        assert ana.get("/api/feedback/export").json()["feedback"] == [kept]


def test_rating_an_answer_checks_what_is_rated_and_the_owner_changes_lists_and_deletes_it(
    chat_model, tmp_path
):
    with live_server(chat_model, tmp_path, "serve.tools=false") as (url, server):
        ana = httpx.Client(base_url=url, headers=bearer(member(server, "ana")))
        cid = ana.post("/api/conversations").json()["id"]
        first, second = chat_turn(ana, cid, "Hola"), chat_turn(ana, cid, "¿Qué tal?")
        assert (first, second) == (1, 3)
        route = f"/api/conversations/{cid}/messages"
        cases = [
            (
                ana.post(f"{route}/0/feedback", json={"rating": 1}),
                404,
                "message_not_found",
            ),  # the member's own
            (ana.post(f"{route}/9/feedback", json={"rating": 1}), 404, "message_not_found"),
            (ana.post(f"{route}/1/feedback", json={"rating": 2}), 400, "invalid_feedback"),
            (ana.post(f"{route}/1/feedback", json={"rating": True}), 400, "invalid_type"),
            (ana.post(f"{route}/1/feedback", json={"rating": "1"}), 400, "invalid_type"),
            (ana.post(f"{route}/1/feedback", json={"rating": -1, "better": "  "}), 400, "invalid_feedback"),
            (ana.post(f"{route}/1/feedback", json={"rating": -1, "better": 7}), 400, "invalid_type"),
            (
                ana.post(f"{route}/1/feedback", content=b"{", headers={"Content-Type": "application/json"}),
                400,
                "invalid_json",
            ),
            (
                ana.post("/api/conversations/nope/messages/1/feedback", json={"rating": 1}),
                404,
                "conversation_not_found",
            ),
            (ana.delete(f"{route}/3/feedback"), 404, "feedback_not_found"),
        ]
        for answer, status, code in cases:
            assert (answer.status_code, answer.json()["error"]["code"]) == (status, code), answer.text
        assert ana.get("/api/feedback").json()["data"] == []  # nothing stored by a refused request

        assert ana.post(f"{route}/1/feedback", json={"rating": 1}).json()["rating"] == 1
        ana.post(f"{route}/3/feedback", json={"rating": 1})
        changed = ana.post(f"{route}/3/feedback", json={"rating": -1, "better": "Muy bien, ¿y tú?"}).json()
        assert changed["rating"] == -1 and changed["better"] == "Muy bien, ¿y tú?"
        listed = ana.get("/api/feedback").json()["data"]
        assert [(f["message_index"], f["rating"]) for f in listed] == [(3, -1), (1, 1)]  # one per answer
        assert (
            listed[0]["prompt"][-1] == {"role": "user", "content": "¿Qué tal?"}
            and len(listed[0]["prompt"]) == 3
        )
        assert ana.delete(f"{route}/1/feedback").json() == {"deleted": listed[1]["id"]}
        assert ana.delete(f"/api/feedback/{listed[0]['id']}").json() == {"deleted": listed[0]["id"]}
        assert ana.delete(f"/api/feedback/{listed[0]['id']}").status_code == 404
        ana.post(f"{route}/1/feedback", json={"rating": 1})
        assert (
            ana.delete("/api/feedback").json() == {"deleted": 1}
            and ana.get("/api/feedback").json()["data"] == []
        )

        # Deleting the conversation deletes its feedback.
        ana.post(f"{route}/1/feedback", json={"rating": 1})
        assert ana.delete(f"/api/conversations/{cid}").status_code == 200
        assert ana.get("/api/feedback").json()["data"] == []


def test_consent_is_off_until_an_adult_sets_it_and_a_child_cannot(chat_model, tmp_path):
    with live_server(chat_model, tmp_path) as (url, server):
        keys = {name: member(server, name, role) for name, role in
                [("ana", "adult"), ("beto", "adult"), ("root", "admin"), ("luis", "child")]}  # fmt: skip
        ana, beto, root, luis = (httpx.Client(base_url=url, headers=bearer(keys[n])) for n in keys)
        assert luis.get("/api/consent").json() == {"granted": False, "set_by": None, "updated": None,
                                                   "may_change": False}  # fmt: skip
        mine = ana.get("/api/consent").json()
        assert mine["granted"] is False and mine["may_change"] is True
        assert mine["children"] == [{"name": "luis", "granted": False, "set_by": None, "updated": None}]

        refused = [luis.put("/api/consent", json={"granted": True}),
                   luis.put("/api/members/luis/consent", json={"granted": True}),
                   luis.put("/api/members/nadie/consent", json={"granted": True}),  # names are not probed
                   ana.put("/api/members/beto/consent", json={"granted": True}),
                   root.put("/api/members/ana/consent", json={"granted": True})]  # fmt: skip
        assert [(r.status_code, r.json()["error"]["code"]) for r in refused] == [
            (403, "consent_forbidden")
        ] * 5
        assert "set by an adult" in refused[0].json()["error"]["message"]
        bad = ana.put("/api/consent", json={"granted": "sí"})
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, "granted")
        assert ana.put("/api/members/nadie/consent", json={"granted": True}).status_code == 404
        assert all(not c.get("/api/consent").json()["granted"] for c in (ana, beto, root, luis))

        assert ana.put("/api/consent", json={"granted": True}).json()["granted"] is True
        child = ana.put("/api/members/luis/consent", json={"granted": True}).json()
        assert child["granted"] is True and child["set_by"] == "ana"
        assert luis.get("/api/consent").json()["granted"] is True  # the child sees what was decided
        assert root.put("/api/members/luis/consent", json={"granted": False}).json()["set_by"] == "root"
        assert beto.get("/api/consent").json()["granted"] is False  # each adult's own, untouched


def test_preferences_exports_only_consented_feedback_and_consent_off_withdraws_it(chat_model, tmp_path):
    with live_server(chat_model, tmp_path, "serve.tools=false") as (url, server):
        database = server.settings["database"]
        keys = {name: member(server, name, role) for name, role in [("ana", "adult"), ("luis", "child")]}
        ana, luis = (httpx.Client(base_url=url, headers=bearer(keys[n])) for n in ("ana", "luis"))
        cid = ana.post("/api/conversations").json()["id"]
        improved = chat_turn(ana, cid, SECRET)
        ana.post(
            f"/api/conversations/{cid}/messages/{improved}/feedback", json={"rating": -1, "better": BETTER}
        )
        # The same question twice in another conversation: one answer liked, one not -> a pair.
        liked_answers = []
        for rating in (1, -1):
            other = ana.post("/api/conversations").json()["id"]
            index = chat_turn(ana, other, "¿Cuánto es 2 más 2?")
            liked_answers.append(ana.get(f"/api/conversations/{other}").json()["messages"][index]["content"])
            ana.post(f"/api/conversations/{other}/messages/{index}/feedback", json={"rating": rating})
        lone = chat_turn(ana, cid, "Gracias")
        ana.post(f"/api/conversations/{cid}/messages/{lone}/feedback", json={"rating": -1})
        kid = luis.post("/api/conversations").json()["id"]
        kid_index = chat_turn(luis, kid, "¿Me cuentas un chiste?")
        luis.post(
            f"/api/conversations/{kid}/messages/{kid_index}/feedback",
            json={"rating": -1, "better": "¿Qué le dice un 1 a un 10?"},
        )

        pairs, said = preferences(database, tmp_path)  # nobody has consented yet
        assert pairs == [] and "left out: 5 ratings of members whose consent is off" in said

        ana.put("/api/consent", json={"granted": True})
        pairs, said = preferences(database, tmp_path)
        assert [p["source"] for p in pairs] == ["feedback:improved", "feedback:rated"]
        assert pairs[0]["prompt"] == [{"role": "user", "content": SECRET}]
        assert pairs[0]["chosen"] == [{"role": "assistant", "content": BETTER}]
        assert pairs[0]["rejected"][0]["content"] != BETTER
        if liked_answers[0] != liked_answers[1]:
            assert pairs[1]["chosen"][0]["content"] == liked_answers[0]
        assert "1 lone 👎" in said and "left out: 1 ratings" in said
        assert all(
            "¿Qué le dice" not in json.dumps(p, ensure_ascii=False) for p in pairs
        )  # luis: not consented

        ana.put("/api/members/luis/consent", json={"granted": True})  # an adult decides for the child
        pairs, _ = preferences(database, tmp_path)
        assert len(pairs) == 3

        val = tmp_path / "val.jsonl"
        pairs, said = preferences(database, tmp_path, "--val", str(val), "--val-share", "0.5")
        held_out = [json.loads(line) for line in val.read_text(encoding="utf-8").splitlines()]
        assert len(pairs) + len(held_out) == 3
        assert not {json.dumps(p["prompt"]) for p in pairs} & {json.dumps(p["prompt"]) for p in held_out}

        ana.put("/api/consent", json={"granted": False})  # withdraws what she gave before
        pairs, said = preferences(database, tmp_path)
        assert [p["source"] for p in pairs] == ["feedback:improved"] and "¿Qué le dice" in json.dumps(
            pairs, ensure_ascii=False
        )
        assert SECRET not in json.dumps(pairs, ensure_ascii=False)


def test_removing_a_member_removes_their_feedback_and_consent(chat_model, tmp_path):
    with live_server(chat_model, tmp_path, "serve.tools=false") as (url, server):
        keys = {name: member(server, name, role) for name, role in [("ana", "adult"), ("root", "admin")]}
        ana = httpx.Client(base_url=url, headers=bearer(keys["ana"]))
        cid = ana.post("/api/conversations").json()["id"]
        index = chat_turn(ana, cid, SECRET)
        ana.post(f"/api/conversations/{cid}/messages/{index}/feedback", json={"rating": -1, "better": BETTER})
        ana.put("/api/consent", json={"granted": True})
        assert httpx.delete(f"{url}/api/members/ana", headers=bearer(keys["root"])).status_code == 200
        database = server.settings["database"]
        with sqlite3.connect(database) as conn:
            assert conn.execute("SELECT COUNT(*) FROM feedback").fetchone() == (0,)
            assert conn.execute("SELECT COUNT(*) FROM training_consent").fetchone() == (0,)
        # A new member given the same name starts with nothing.
        again = httpx.Client(base_url=url, headers=bearer(member(server, "ana")))
        assert (
            again.get("/api/feedback").json()["data"] == []
            and again.get("/api/consent").json()["granted"] is False
        )
    with open(database, "rb") as f:  # secure_delete: the text is not left in the file's free pages
        assert BETTER.encode("utf-8") not in f.read()


def test_preferences_names_a_database_it_cannot_use(tmp_path):
    missing = subprocess.run([sys.executable, "-m", "chat", "preferences", "--db", str(tmp_path / "no.sqlite"),
                              str(tmp_path / "out.jsonl")], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert missing.returncode == 2 and "no.sqlite: no such database" in missing.stderr
    (tmp_path / "other.sqlite").write_bytes(b"")
    sqlite3.connect(tmp_path / "other.sqlite").execute("CREATE TABLE t (x)").connection.commit()
    other = subprocess.run([sys.executable, "-m", "chat", "preferences", "--db", str(tmp_path / "other.sqlite"),
                            str(tmp_path / "out.jsonl")], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert (
        other.returncode == 2
        and "cannot read the feedback" in other.stderr
        and "Traceback" not in other.stderr
    )
    half = subprocess.run([sys.executable, "-m", "chat", "preferences", "--db", str(tmp_path / "other.sqlite"),
                           str(tmp_path / "out.jsonl"), "--val", str(tmp_path / "v.jsonl")],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert half.returncode == 2 and "--val and --val-share go together" in half.stderr
    assert not (tmp_path / "out.jsonl").exists()


# -----------------------------------------------------------------------------
# The page: a member rates and improves answers in a real browser


@pytest.fixture(scope="module")
def web_feedback(chat_run, tmp_path_factory):
    """serve/app.py with ana (adult) and luis (child), both with web passwords; yields (URL, database)."""
    from conftest import start_server

    folder = tmp_path_factory.mktemp("web-feedback")
    database = str(folder / "familia.sqlite")
    store = accounts.Store(database)
    for name, role in (("ana", "adult"), ("luis", "child")):
        store.add_member(name, role)
        store.set_password(name, accounts.hash_password("clave-" + name, {"n": 1024, "r": 8, "p": 1}))
    proc, url = start_server(chat_run, database, "serve.default_max_tokens=16", "serve.tools=false",
                             log_path=folder / "server.log")  # fmt: skip
    yield url, database
    proc.kill()
    proc.wait()
    proc.stdout.close()


def ask_in_page(driver, text):
    count = len(all_of(driver, ".message.assistant[data-done='true']"))
    by_id(driver, "input").send_keys(text)
    by_id(driver, "send").click()
    wait_for(driver, lambda d: len(all_of(d, ".message.assistant[data-done='true']")) == count + 1)
    return wait_for(driver, lambda d: all_of(d, ".feedback"))[-1]


def pressed(driver):
    """Per answer bar: which of 👍 / 👎 is pressed."""
    return driver.execute_script(
        "return [...document.querySelectorAll('.feedback')].map((bar) => ["
        "bar.querySelector('.feedback-up').getAttribute('aria-pressed'),"
        "bar.querySelector('.feedback-down').getAttribute('aria-pressed')])"
    )


def wanted(driver):
    """Per answer bar: the answer the member wrote instead ("" where none)."""
    return driver.execute_script(
        "return [...document.querySelectorAll('.feedback-wanted')].map((p) => p.textContent)"
    )


def open_feedback_panel(driver):
    if not driver.execute_script("return document.getElementById('feedback-panel').open"):
        if by_id(driver, "menu").is_displayed():
            by_id(driver, "menu").click()
        wait_for(driver, lambda d: all_of(d, "#feedback-panel summary")[0].is_displayed())
        all_of(driver, "#feedback-panel summary")[0].click()
    wait_for(driver, lambda d: by_id(d, "feedback-consent").is_displayed())


def test_a_member_rates_and_improves_answers_in_the_page_and_an_adult_decides_for_the_child(
    browser,  # noqa: F811 - test_web's fixture
    web_feedback,
    tmp_path,
):
    url, database = web_feedback
    browser.delete_all_cookies()
    log_in(browser, url, "ana", "clave-ana")
    bar = ask_in_page(browser, "Hola")
    bar.find_element("css selector", ".feedback-up").click()
    wait_for(browser, lambda d: pressed(d) == [["true", "false"]])
    bar = ask_in_page(browser, "¿Qué cenamos?")
    bar.find_element("css selector", ".feedback-improve").click()
    field = wait_for(browser, lambda d: all_of(d, ".feedback-better"))[0]
    assert field.get_attribute("value") == browser.execute_script(
        "return document.querySelectorAll('.message.assistant')[1].textContent"
    )  # starts from the answer given
    field.clear()
    field.send_keys("Una tortilla de patatas y una ensalada.")
    all_of(browser, ".feedback-save")[0].click()
    wait_for(browser, lambda d: pressed(d) == [["true", "false"], ["false", "true"]])
    wait_for(browser, lambda d: wanted(d) == ["", "Tu versión: Una tortilla de patatas y una ensalada."])
    screenshot(browser, "feedback-1-rated.png")

    browser.refresh()  # what the page shows comes from the server
    wait_for(browser, lambda d: by_id(d, "app").is_displayed() and all_of(d, "#conversations li"))
    if by_id(browser, "menu").is_displayed():
        by_id(browser, "menu").click()
    wait_for(browser, lambda d: all_of(d, "#conversations li")[0].is_displayed())
    all_of(browser, "#conversations li")[0].click()
    wait_for(browser, lambda d: pressed(d) == [["true", "false"], ["false", "true"]])
    assert wanted(browser) == ["", "Tu versión: Una tortilla de patatas y una ensalada."]

    open_feedback_panel(browser)
    wait_for(browser, lambda d: len(all_of(d, "#feedback-list .feedback-item")) == 2)
    consent = by_id(browser, "feedback-consent")
    assert not consent.is_selected() and consent.is_enabled()  # off until she turns it on
    pairs, said = preferences(database, tmp_path)
    assert pairs == [] and "left out: 2 ratings" in said
    consent.click()
    wait_for(browser, lambda d: by_id(d, "feedback-consent-state").text.startswith("Activado"))
    pairs, _ = preferences(database, tmp_path)
    assert [p["chosen"][0]["content"] for p in pairs] == ["Una tortilla de patatas y una ensalada."]
    assert pairs[0]["prompt"][-1] == {"role": "user", "content": "¿Qué cenamos?"}
    [child] = wait_for(browser, lambda d: all_of(d, ".feedback-child-consent"))
    child.click()  # luis's consent, decided by ana
    wait_for(browser, lambda d: "ana" in all_of(d, ".feedback-child")[0].text)
    screenshot(browser, "feedback-2-panel.png")

    if not by_id(browser, "logout").is_displayed():  # on a phone the sidebar slides in
        by_id(browser, "menu").click()
        wait_for(browser, lambda d: by_id(d, "logout").is_displayed())
    by_id(browser, "logout").click()
    wait_for(browser, lambda d: by_id(d, "login").is_displayed())
    assert all_of(browser, "#feedback-list .feedback-item") == []  # nothing of ana's stays in the page
    log_in(browser, url, "luis", "clave-luis")
    open_feedback_panel(browser)
    consent = by_id(browser, "feedback-consent")
    assert consent.is_selected() and not consent.is_enabled()  # decided by an adult, shown to the child
    assert "adulta" in by_id(browser, "feedback-consent-state").text
    assert (
        all_of(browser, "#feedback-list .feedback-item") == []
        and all_of(browser, ".feedback-child-consent") == []
    )
    screenshot(browser, "feedback-3-child.png")
