"""The web chat page in a real browser: Debian's headless Chromium driven by selenium, on a phone-sized
window, against serve/app.py in a subprocess on 127.0.0.1. Screenshots go to test-artifacts/web/ (or
$ENLACE_ARTIFACTS/web/), kept for people to look at, never committed."""

import os
import re
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from conftest import ROOT, ScriptedModel, live_server, start_server

from family import accounts
from serve import web

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
ARTIFACTS = os.path.join(os.environ.get("ENLACE_ARTIFACTS", os.path.join(ROOT, "test-artifacts")), "web")
COUNT_UPDATES = """
window.updates = 0;
new MutationObserver((changes) => { window.updates += changes.length; })
  .observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
"""


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        message = "needs Debian's chromium and chromium-driver (apt install chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=390,844"):
        options.add_argument(argument)
    shutil.rmtree(ARTIFACTS, ignore_errors=True)  # the screenshots are this run's, none left from older ones
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_window_size(390, 844)  # a phone
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def family(chat_run, tmp_path_factory):
    """serve/app.py with two adults, ana and beto; yields (url, ana's API key)."""
    folder = tmp_path_factory.mktemp("web")
    database = str(folder / "family.sqlite")
    store = accounts.Store(database)
    keys = {}
    for name in ("ana", "beto"):
        keys[name] = store.add_member(name, "adult")
        store.set_password(name, accounts.hash_password("clave-" + name, {"n": 1024, "r": 8, "p": 1}))
    proc, url = start_server(
        chat_run, database, "serve.default_max_tokens=24", log_path=folder / "server.log"
    )
    yield url, keys["ana"]
    proc.kill()
    proc.wait()


def wait_for(driver, condition, timeout=30):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # the page re-renders lists when an answer ends: an element read mid-render is "not yet", not a failure
    return WebDriverWait(driver, timeout, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: condition(d)
    )


def by_id(driver, element_id):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def all_of(driver, selector):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def send_login(driver, url, name, password):
    """Opens the page and sends its login form."""
    driver.get(url + "/")
    wait_for(driver, lambda d: by_id(d, "login").is_displayed())
    by_id(driver, "login-name").send_keys(name)
    by_id(driver, "login-password").send_keys(password)
    screenshot(driver, f"0-login-{name}.png")
    by_id(driver, "login-button").click()


def log_in(driver, url, name, password):
    send_login(driver, url, name, password)
    wait_for(driver, lambda d: by_id(d, "app").is_displayed())


def change_password(driver, current, new, repeat):
    """Fills the page's password form and sends it."""
    for field, text in (("password-current", current), ("password-new", new), ("password-repeat", repeat)):
        by_id(driver, field).clear()
        by_id(driver, field).send_keys(text)
    by_id(driver, "password-button").click()


def screenshot(driver, name):
    os.makedirs(ARTIFACTS, exist_ok=True)
    driver.save_screenshot(os.path.join(ARTIFACTS, name))


def test_a_member_chats_finds_the_conversation_after_a_reload_and_another_member_cannot_see_it(
    browser, family
):
    url, ana_key = family
    log_in(browser, url, "ana", "clave-ana")
    cookie = next(c for c in browser.get_cookies() if c["name"] == web.SESSION_COOKIE)
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert browser.execute_script("return document.cookie") == ""  # the page's script cannot read it

    browser.execute_script(COUNT_UPDATES)
    by_id(browser, "input").send_keys("Hola, ¿quién eres?")
    by_id(browser, "send").click()
    wait_for(browser, lambda d: all_of(d, ".message.assistant[data-done='true']"))
    [question] = all_of(browser, ".message.user")
    [answer] = all_of(browser, ".message.assistant")
    shown = browser.execute_script("return arguments[0].textContent", answer)
    assert question.text == "Hola, ¿quién eres?" and by_id(browser, "chat-error").text == ""
    assert browser.execute_script("return window.updates") > 3  # the answer arrived in pieces
    wait_for(browser, lambda d: by_id(d, "title").text == "Hola, ¿quién eres?")
    screenshot(browser, "1-streamed-answer.png")

    # What the page showed is what the server stored, in ana's conversation.
    headers = {"Authorization": f"Bearer {ana_key}"}
    [listed] = httpx.get(url + "/api/conversations", headers=headers).json()["data"]
    stored = httpx.get(f"{url}/api/conversations/{listed['id']}", headers=headers).json()["messages"]
    assert [(m["role"], m["content"]) for m in stored] == [
        ("user", "Hola, ¿quién eres?"),
        ("assistant", shown),
    ]

    browser.refresh()  # the session cookie keeps ana logged in
    wait_for(browser, lambda d: by_id(d, "app").is_displayed() and all_of(d, "#conversations li"))
    by_id(browser, "menu").click()  # on a phone the list slides in
    [item] = wait_for(browser, lambda d: [li for li in all_of(d, "#conversations li") if li.is_displayed()])
    assert item.text == "Hola, ¿quién eres?"
    screenshot(browser, "2-conversation-list.png")
    item.click()
    wait_for(browser, lambda d: len(all_of(d, ".message")) == 2)
    reopened = [
        browser.execute_script("return arguments[0].textContent", m) for m in all_of(browser, ".message")
    ]
    assert reopened == ["Hola, ¿quién eres?", shown]
    screenshot(browser, "3-reopened-after-reload.png")

    by_id(browser, "menu").click()
    wait_for(browser, lambda d: by_id(d, "logout").is_displayed())
    by_id(browser, "logout").click()
    log_in(browser, url, "beto", "clave-beto")
    assert all_of(browser, "#conversations li") == [] and all_of(browser, ".message") == []
    status = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        f"fetch('/api/conversations/{listed['id']}', {{headers: sessionHeaders()}}).then((r) => done(r.status));"
    )
    assert status == 404
    screenshot(browser, "4-second-member.png")


def test_a_wrong_password_is_refused_in_spanish(browser, family):
    url, _ = family
    browser.delete_all_cookies()
    send_login(browser, url, "ana", "no-es-esta")
    wait_for(browser, lambda d: by_id(d, "login-error").text)
    assert by_id(browser, "login-error").text == "Nombre o contraseña incorrectos."
    assert not by_id(browser, "app").is_displayed()


def test_a_new_conversation_starts_empty_and_its_owner_deletes_one_from_the_page(browser, family):
    from selenium.webdriver.support import expected_conditions

    url, _ = family
    browser.delete_all_cookies()
    log_in(browser, url, "beto", "clave-beto")
    for number, text in enumerate(("Primera pregunta", "Segunda pregunta")):
        if number:
            by_id(browser, "menu").click()
            wait_for(browser, lambda d: by_id(d, "new-conversation").is_displayed())
            by_id(browser, "new-conversation").click()
            wait_for(browser, lambda d: all_of(d, ".message") == [])
            assert by_id(browser, "title").text == "Nueva conversación"
        by_id(browser, "input").send_keys(text)
        by_id(browser, "send").click()
        wait_for(browser, lambda d: all_of(d, ".message.assistant[data-done='true']"))
        wait_for(browser, lambda d, text=text: by_id(d, "title").text == text)
        assert [m.text for m in all_of(browser, ".message.user")] == [text]  # a conversation of its own

    by_id(browser, "menu").click()
    titles = wait_for(
        browser, lambda d: [li.text for li in all_of(d, "#conversations li") if li.is_displayed()]
    )
    assert titles == ["Segunda pregunta", "Primera pregunta"]  # newest first

    def open_first(d):  # read and click the same rendering of the list
        item = all_of(d, "#conversations li")[1]
        first = item.get_attribute("data-id")
        item.click()
        return first

    first_id = wait_for(browser, open_first)
    wait_for(
        browser, lambda d: by_id(d, "title").text == "Primera pregunta" and len(all_of(d, ".message")) == 2
    )
    by_id(browser, "delete-conversation").click()
    wait_for(browser, expected_conditions.alert_is_present())
    browser.switch_to.alert.accept()  # "¿Borrar esta conversación?"
    wait_for(browser, lambda d: [li.get_attribute("textContent") for li in all_of(d, "#conversations li")]
             == ["Segunda pregunta"])  # fmt: skip
    assert by_id(browser, "title").text == "Nueva conversación" and all_of(browser, ".message") == []
    screenshot(browser, "6-after-deleting-a-conversation.png")
    status = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        f"fetch('/api/conversations/{first_id}', {{headers: sessionHeaders()}}).then((r) => done(r.status));"
    )
    assert status == 404  # gone from the server, not only from the page


def test_a_member_an_admin_created_changes_the_password_on_the_page_then_chats(browser, chat_model, tmp_path):
    with live_server(chat_model, tmp_path, "serve.default_max_tokens=16") as (url, server):
        admin = {"Authorization": f"Bearer {server.store.add_member('carla', 'admin')}"}
        made = httpx.post(
            url + "/api/members", headers=admin, json={"name": "eva", "role": "adult", "password": "de-carla"}
        )
        admins_key = made.json()["api_key"]
        browser.delete_all_cookies()
        send_login(browser, url, "eva", "de-carla")
        # Asked to choose her own password before anything else.
        wait_for(browser, lambda d: by_id(d, "password").is_displayed())
        assert (
            not by_id(browser, "app").is_displayed() and "administra" in by_id(browser, "password-why").text
        )
        screenshot(browser, "7-provisional-password.png")
        change_password(browser, "de-carla", "solo-de-eva", "solo-de-Eva")
        wait_for(browser, lambda d: by_id(d, "password-error").text)
        assert by_id(browser, "password-error").text == "Las dos contraseñas nuevas no coinciden."
        change_password(browser, "de-carla", "solo-de-eva", "solo-de-eva")
        wait_for(browser, lambda d: by_id(d, "new-key").is_displayed())
        evas_key = by_id(browser, "new-key").text
        screenshot(browser, "8-new-api-key.png")
        # The key on the page is eva's; what the admin knew no longer works.
        assert httpx.get(url + "/api/me", headers={"Authorization": f"Bearer {evas_key}"}).status_code == 200
        assert (
            httpx.get(url + "/api/me", headers={"Authorization": f"Bearer {admins_key}"}).status_code == 401
        )
        old_login = httpx.post(url + "/api/login", json={"name": "eva", "password": "de-carla"})
        assert old_login.status_code == 401
        by_id(browser, "password-continue").click()
        wait_for(browser, lambda d: by_id(d, "app").is_displayed())
        assert by_id(browser, "new-key").text == ""  # shown once, not left in the page
        by_id(browser, "input").send_keys("Hola")
        by_id(browser, "send").click()
        wait_for(browser, lambda d: all_of(d, ".message.assistant[data-done='true']"))
        assert by_id(browser, "chat-error").text == ""
        screenshot(browser, "9-chat-after-password-change.png")
        headers = {"Authorization": f"Bearer {evas_key}"}
        [listed] = httpx.get(url + "/api/conversations", headers=headers).json()["data"]
        assert listed["title"] == "Hola"

        # Later, from the sidebar: a wrong current password is told in Spanish; the right one changes it.
        by_id(browser, "menu").click()
        wait_for(browser, lambda d: by_id(d, "change-password").is_displayed())
        by_id(browser, "change-password").click()
        wait_for(browser, lambda d: by_id(d, "password").is_displayed())
        change_password(browser, "no-es-esta", "otra-de-eva", "otra-de-eva")
        wait_for(browser, lambda d: by_id(d, "password-error").text)
        assert by_id(browser, "password-error").text == "La contraseña actual no es correcta."
        change_password(browser, "solo-de-eva", "otra-de-eva", "otra-de-eva")
        wait_for(browser, lambda d: by_id(d, "password-done").is_displayed())
        assert not by_id(browser, "new-key-box").is_displayed()  # not provisional: the key stays
        by_id(browser, "password-continue").click()
        wait_for(browser, lambda d: by_id(d, "app").is_displayed())
        new_login = httpx.post(url + "/api/login", json={"name": "eva", "password": "otra-de-eva"})
        assert new_login.status_code == 200
        assert httpx.get(url + "/api/me", headers=headers).status_code == 200


def test_the_page_loads_nothing_from_outside_the_server(chat_model, tmp_path):
    # No CDN, no build step: every file the page uses is in web/ and named by a path on this server,
    # and the Content-Security-Policy makes the browser refuse anything else.
    for name in os.listdir(os.path.join(ROOT, "web")):
        with open(os.path.join(ROOT, "web", name), encoding="utf-8") as f:
            text = f.read()
        assert not re.search(r"https?:|(src|href)=\"//|@import|import\s*\(", text), name
    with live_server(chat_model, tmp_path) as (url, _):
        page = httpx.get(url + "/")
        scripts = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assets = [httpx.get(url + path) for path in scripts]
    assert page.status_code == 200 and "default-src 'self'" in page.headers["content-security-policy"]
    # api.js first: the page scripts after it call its api()
    assert scripts == [
        "/web/style.css",
        "/web/api.js",
        "/web/actions.js",
        "/web/app.js",
        "/web/memories.js",
        "/web/feedback.js",
    ]
    assert all(asset.status_code == 200 for asset in assets)


def test_every_page_script_talks_to_the_server_through_the_one_api_helper():
    def script(name):
        with open(os.path.join(ROOT, "web", name), encoding="utf-8") as f:
            return f.read()

    assert re.findall(r"async function (\w+)", script("api.js")) == ["errorOf", "api"]
    for name in ("feedback.js", "memories.js"):  # their Spanish messages go to api() with each call
        assert "fetch(" not in script(name) and "=> api(method, path, body, SPANISH)" in script(name), name
    # app.js fetches the streamed answer itself (read as it arrives), and its errors go through errorOf
    app = script("app.js")
    assert app.count("fetch(") == 1 and "throw await errorOf(response)" in app
    assert not re.search(
        r"function (api|errorOf|call)\b", app + script("feedback.js") + script("memories.js")
    )


def test_the_stop_button_ends_the_answer_and_keeps_what_was_shown(browser, chat_model, tmp_path):
    tokenizer = chat_model[1]
    slow = ScriptedModel(tokenizer.encode("Había una vez un perro que"), delay=0.05)  # ~10 s if not stopped
    with live_server(chat_model, tmp_path, model=slow) as (url, server):
        key = server.store.add_member("ana", "adult")
        server.store.set_password("ana", accounts.hash_password("clave-ana", {"n": 1024, "r": 8, "p": 1}))
        browser.delete_all_cookies()
        log_in(browser, url, "ana", "clave-ana")
        by_id(browser, "input").send_keys("Cuéntame un cuento")
        by_id(browser, "send").click()
        wait_for(
            browser,
            lambda d: by_id(d, "stop").is_displayed() and len(all_of(d, ".message.assistant")[0].text) > 10,
        )
        screenshot(browser, "5-answering-with-stop.png")
        by_id(browser, "stop").click()
        wait_for(browser, lambda d: all_of(d, ".message.assistant[data-done='true']"), timeout=5)
        assert by_id(browser, "send").is_displayed() and not by_id(browser, "stop").is_displayed()
        shown = browser.execute_script(
            "return arguments[0].textContent", all_of(browser, ".message.assistant")[0]
        )
        deadline = time.monotonic() + 10
        while server.worker.stats["cancelled"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.worker.stats["cancelled"] == 1 and server.worker.stats["answered"] == 0
        headers = {"Authorization": f"Bearer {key}"}
        [listed] = httpx.get(url + "/api/conversations", headers=headers).json()["data"]
        stored = httpx.get(f"{url}/api/conversations/{listed['id']}", headers=headers).json()["messages"]
    assert stored[0]["content"] == "Cuéntame un cuento" and stored[1]["content"].startswith(shown)
    assert server.worker.stats["generated_tokens"] < 150  # stopped well before its ~190 tokens


def test_an_admin_sees_on_the_page_that_the_servers_disk_refuses_writes_until_one_goes_through(
    browser, chat_model, tmp_path
):
    with live_server(chat_model, tmp_path) as (url, server):
        server.store.add_member("carla", "admin")
        server.store.set_password("carla", accounts.hash_password("clave-carla", {"n": 1024, "r": 8, "p": 1}))
        ana = {"Authorization": f"Bearer {server.store.add_member('ana', 'adult')}"}
        browser.delete_all_cookies()
        log_in(browser, url, "carla", "clave-carla")
        assert not by_id(browser, "storage-alert").is_displayed()
        server.store.db.execute("PRAGMA query_only = 1")  # SQLite refuses every write: SQLITE_READONLY
        assert httpx.post(url + "/api/conversations", headers=ana, json={}).status_code == 507
        browser.refresh()  # the admin's session is read, not written: the page opens
        wait_for(browser, lambda d: by_id(d, "storage-alert").is_displayed())
        alert = by_id(browser, "storage-alert").text
        assert (
            alert.startswith("El disco del servidor no admite más escrituras") and server.store.path in alert
        )
        screenshot(browser, "10-storage-alert.png")
        server.store.db.execute("PRAGMA query_only = 0")
        assert httpx.post(url + "/api/conversations", headers=ana, json={}).status_code == 201
        browser.refresh()
        wait_for(browser, lambda d: by_id(d, "storage-alert").get_attribute("data-checked") == "true")
        assert not by_id(browser, "storage-alert").is_displayed()


# -----------------------------------------------------------------------------
# Pages of other origins (issue 65)

OTHER_PAGE = """<!doctype html><title>otra</title><script>
const target = "TARGET";
const tries = [
  fetch(target + "/api/memories", {method: "POST", mode: "no-cors", credentials: "include",
        headers: {"Content-Type": "text/plain"}, body: JSON.stringify({text: "nota de otra web"})}),
  fetch(target + "/api/memories", {method: "POST", credentials: "include",
        headers: {"Content-Type": "application/json"}, body: JSON.stringify({text: "nota con json"})}),
  fetch(target + "/api/conversations", {method: "POST", mode: "no-cors", credentials: "include"}),
  fetch("/recoger", {credentials: "include"}),
];
Promise.allSettled(tries).then(() => { document.title = "listo"; });
</script>"""


def other_origin(target):
    """A page on another port of 127.0.0.1 that tries to act on `target` and keeps every Cookie header it
    receives; returns (the HTTP server, its URL, the cookies it got)."""
    received = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            received.append(self.headers.get("Cookie") or "")
            body = OTHER_PAGE.replace("TARGET", target).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", received


def test_a_page_on_another_port_can_neither_change_anything_nor_take_the_session(browser, family):
    url, ana_key = family
    ana = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ana_key}"})
    before = (ana.get("/api/memories").json()["data"], ana.get("/api/conversations").json()["data"])
    browser.delete_all_cookies()
    log_in(browser, url, "ana", "clave-ana")
    server, other_url, received = other_origin(url)
    try:
        browser.get(other_url + "/")
        wait_for(browser, lambda d: d.title == "listo")
    finally:
        server.shutdown()
    assert (ana.get("/api/memories").json()["data"], ana.get("/api/conversations").json()["data"]) == before
    # Cookies know no ports: the other page's server receives ana's cookie, which alone opens nothing.
    cookies = [c.split("=", 1) for line in received for c in line.split("; ") if c]
    stolen = [value for name, value in cookies if name == web.SESSION_COOKIE]
    assert stolen, received
    for value in stolen:
        replay = httpx.get(url + "/api/conversations", cookies={web.SESSION_COOKIE: value})
        assert replay.status_code == 401
    browser.get(url + "/")  # ana's own page still works
    wait_for(browser, lambda d: by_id(d, "app").is_displayed())
    ana.close()


def test_a_page_reaching_the_server_by_a_rebinding_name_is_refused(chat_model, tmp_path):
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("needs Debian's chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--host-resolver-rules=MAP rebind.attacker.example 127.0.0.1"):  # fmt: skip
        options.add_argument(argument)
    with live_server(chat_model, tmp_path) as (url, server):
        server.store.add_member("ana", "adult")
        server.store.set_password("ana", accounts.hash_password("clave-de-ana", server.settings["scrypt"]))
        rebound = url.replace("127.0.0.1", "rebind.attacker.example")
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        try:
            driver.get(rebound + "/")
            page = driver.find_element("tag name", "body").text
            login = driver.execute_async_script(
                "const done = arguments[0];"
                "fetch('/api/login', {method: 'POST', headers: {'Content-Type': 'application/json'},"
                " body: JSON.stringify({name: 'ana', password: 'clave-de-ana'})})"
                ".then(r => done(r.status)).catch(e => done(String(e)));"
            )
        finally:
            driver.quit()
        direct = httpx.post(url + "/api/login", headers={"Host": "rebind.attacker.example"},
                            json={"name": "ana", "password": "clave-de-ana"})  # fmt: skip
    assert "invalid_host" in page and login == 421
    assert direct.status_code == 421 and "set-cookie" not in direct.headers
    assert "serve.allowed_hosts" in direct.json()["error"]["message"]
