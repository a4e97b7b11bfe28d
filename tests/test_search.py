"""search.py against a real HTTP server on 127.0.0.1 serving the captured service responses."""

import gzip
import json
import logging
import os
import socket
import ssl
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import search  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "search"
KEY = "BSAtestkey-0123456789abcdef"  # fake; every leak test looks for this exact string
HTML = "text/html; charset=UTF-8"
JSON = "application/json; charset=utf-8"
FAST = search.HttpLimits(
    connect_timeout_s=0.5, read_timeout_s=0.3, deadline_s=1.0, max_response_bytes=256 * 1024
)

TEN_TITLES = [
    "10 Day Weather - Downtown, San Francisco, California",
    "San Francisco, CA Weather Forecast | AccuWeather",
    "7-Day Forecast 37.77N 122.41W - National Weather Service",
    "San Francisco Weather Forecast",
    "San Francisco, CA Weather Conditions - Weather Underground",
    "San Francisco 14 Day Weather Forecast",
    "San Francisco, 8 to 14 Day Extended Weather Forecast (°C)",
    "San Francisco, CA Weather Forecast, Conditions, and Maps - Yahoo Weather",
    "Live Doppler 7 | Bay Area Weather News - ABC7 San Francisco",
    "San Francisco Bay Area Weather | KRON4",
]
TEN_URLS = [
    "https://weather.com/weather/tenday/l/San%20Francisco%20CA%20USCA0987:1:US",
    "https://www.accuweather.com/en/us/san-francisco/94103/weather-forecast/347629",
    "https://forecast.weather.gov/zipcity.php?inputstring=San+Francisco,CA",
    "https://www.weather-forecast.com/locations/San-Francisco/forecasts/latest",
    "https://www.wunderground.com/weather/us/ca/san-francisco",
    "https://world-weather.info/forecast/usa/san_francisco/14days/",
    "https://www.weatherforyou.com/report/co/san+francisco-extended",
    "https://weather.yahoo.com/us/ca/san-francisco",
    "https://abc7news.com/weather/",
    "https://www.kron4.com/weather-san-francisco/",
]


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


# --- a real local server ----------------------------------------------------------------------------


@dataclass
class Route:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0  # sleep before answering
    drip_s: float = 0.0  # send the body a byte at a time with this pause
    send_length: bool = True  # False: close-delimited body, no Content-Length


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.answer()

    def do_POST(self):
        self.answer()

    def answer(self):
        owner = self.server.owner
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        owner.requests.append(Recorded(self.command, self.path, dict(self.headers.items()), body))
        route = owner.routes.get(urlsplit(self.path).path, Route(404, b"no route"))
        if route.delay_s:
            owner.release.wait(route.delay_s)  # teardown sets it, so no thread outlives its test
        try:
            self.send_response(route.status)
            for name, value in route.headers.items():
                self.send_header(name, value)
            if route.send_length and not route.drip_s:
                self.send_header("Content-Length", str(len(route.body)))
            self.end_headers()
            if route.drip_s:
                for index in range(len(route.body)):
                    self.wfile.write(route.body[index : index + 1])
                    self.wfile.flush()
                    if owner.release.wait(route.drip_s):
                        return
            else:
                self.wfile.write(route.body)
        except OSError:
            pass  # the client gave up first (timeouts, size cap): that is the point of those tests

    def log_message(self, format, *args):
        pass


class LocalServer:
    def __init__(self, tls: ssl.SSLContext | None = None):
        self.routes: dict[str, Route] = {}
        self.requests: list[Recorded] = []
        self.release = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.owner = self
        if tls is not None:
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
        self.scheme = "https" if tls is not None else "http"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01})
        self.thread.start()

    def url(self, path: str) -> str:
        return f"{self.scheme}://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def route(self, path: str, status: int, body: bytes, content_type: str = HTML, **options) -> None:
        headers = {"Content-Type": content_type, **options.pop("headers", {})}
        self.routes[path] = Route(status, body, headers, **options)

    def hits(self, path: str) -> int:
        return sum(urlsplit(r.path).path == path for r in self.requests)

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture
def server():
    local = LocalServer()
    yield local
    local.close()


@pytest.fixture
def recorder():
    """A second host: a redirect must never carry anything here."""
    local = LocalServer()
    yield local
    local.close()


DDG_PATH, BRAVE_PATH = "/lite/", "/res/v1/web/search"


def env_for(server: LocalServer, key: str | None = KEY) -> dict[str, str]:
    env = {"ENLACE_DDG_URL": server.url(DDG_PATH), "ENLACE_BRAVE_URL": server.url(BRAVE_PATH)}
    if key is not None:
        env["BRAVE_API_KEY"] = key
    return env


def chain(server: LocalServer, provider: str = "auto", **options) -> search.SearchChain:
    return search.SearchChain.from_env(
        provider, env=env_for(server), limits=options.pop("limits", FAST), **options
    )


def failure(server: LocalServer, provider: str, **options) -> search.Attempt:
    """Search with a single provider that must fail; return its attempt."""
    with pytest.raises(search.AllProvidersFailed) as raised:
        chain(server, provider, **options).search("weather san francisco", region="us-en")
    (attempt,) = raised.value.attempts
    return attempt


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- DuckDuckGo lite ----------------------------------------------------------------------------------


def test_lite_page_parses_to_its_ten_results_with_exact_titles_and_urls(server):
    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"))
    response = chain(server, "ddg").search("weather san francisco", max_results=20)
    assert response.provider == "ddg" and response.attempts == []
    assert [r.title for r in response.results] == TEN_TITLES
    assert [r.url for r in response.results] == TEN_URLS
    assert [r.rank for r in response.results] == list(range(1, 11))
    assert response.results[4].snippet == (
        "San Francisco Weather Forecasts. Weather Underground provides local & long-range weather "
        "forecasts, weatherreports, maps & tropical weather conditions for the San Francisco area."
    )
    assert response.results[2].published == "2026-01-20T09:43:00.0000000"
    assert response.results[0].published is None


def test_uddg_is_decoded_exactly_once():
    href = "//duckduckgo.com/l/?uddg=https%3A%2F%2Fa.example%2FSan%2520Francisco%3Fq%3Da%2Bb&rut=1"
    assert search.result_target(href) == "https://a.example/San%20Francisco?q=a+b"


def test_max_results_truncates_the_page(server):
    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"))
    response = chain(server, "ddg").search("weather san francisco", max_results=3)
    assert [r.url for r in response.results] == TEN_URLS[:3]


def test_lite_request_is_a_urlencoded_form_with_region_and_browser_headers(server):
    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"))
    chain(server, "auto").search("qué es home assistant", region="es-es", time_range="week")
    (request,) = server.requests
    assert request.method == "POST"
    assert request.headers["Content-Type"] == "application/x-www-form-urlencoded"
    assert parse_qs(request.body.decode("ascii")) == {
        "q": ["qué es home assistant"],
        "kl": ["es-es"],
        "kp": ["-1"],  # moderate safe search unless asked (agent/privacy.py asks strict for a child)
        "df": ["w"],
    }
    assert request.headers["User-Agent"].startswith("Mozilla/5.0 (")
    assert request.headers["Accept-Language"] == "es-ES,es;q=0.9"
    assert "X-Subscription-Token" not in request.headers


def test_empty_lite_page_is_an_answer_and_does_not_fall_back(server):
    server.route(DDG_PATH, 200, fixture("ddg_lite_empty.html"))
    server.route(BRAVE_PATH, 200, fixture("brave_web_results.json"), JSON)
    response = chain(server, "auto").search("xqzv kfjrw plmtq")
    assert (response.provider, response.results, response.attempts) == ("ddg", [], [])
    assert server.hits(BRAVE_PATH) == 0


def test_ads_and_links_back_to_duckduckgo_are_skipped(server):
    server.route(DDG_PATH, 200, fixture("ddg_lite_with_ads.html"))
    response = chain(server, "ddg").search("weather san francisco", max_results=20)
    assert [r.url for r in response.results] == TEN_URLS
    assert [r.rank for r in response.results] == list(range(1, 11))


def test_rate_limit_202_falls_back_to_brave_and_records_the_attempt(server):
    server.route(DDG_PATH, 202, fixture("ddg_lite_challenge_202.html"))
    server.route(BRAVE_PATH, 200, fixture("brave_web_results.json"), JSON)
    response = chain(server, "auto").search("brave search", max_results=5)
    assert response.provider == "brave"
    assert [r.title for r in response.results][:2] == [
        "Private Search Engine - Brave Search",
        "Brave Search - Wikipedia",
    ]
    assert len(response.results) == 5
    (attempt,) = response.attempts
    assert (attempt.provider, attempt.error) == ("ddg", "RateLimited")
    assert "HTTP 202" in attempt.message


def test_challenge_page_served_with_200_is_a_challenge(server):
    server.route(DDG_PATH, 200, fixture("ddg_lite_challenge_202.html"))
    assert failure(server, "ddg").error == "ChallengePage"


def test_query_that_echoes_the_challenge_words_is_not_a_challenge(server):
    echo = "Unfortunately, bots use DuckDuckGo too: challenge-form anomaly-modal"
    page = fixture("ddg_lite_results.html").decode().replace("weather san francisco", echo)
    server.route(DDG_PATH, 200, page.encode())
    response = chain(server, "ddg").search(echo)
    assert [r.url for r in response.results] == TEN_URLS


def test_403_block_is_its_own_error(server):
    server.route(DDG_PATH, 403, fixture("ddg_lite_blocked_403.html"))
    attempt = failure(server, "ddg")
    assert attempt.error == "Blocked" and "HTTP 403" in attempt.message


def test_redirect_from_duckduckgo_is_not_followed(server, recorder):
    server.route(DDG_PATH, 302, b"", headers={"Location": recorder.url("/elsewhere")})
    assert failure(server, "ddg").error == "Redirected"
    assert recorder.requests == []


def test_malformed_html_is_unrecognised_markup(server):
    server.route(DDG_PATH, 200, b"<html><body><div class='new-layout'>resultados</div></body></html>")
    attempt = failure(server, "ddg")
    assert attempt.error == "MalformedResponse" and "not a DuckDuckGo lite page" in attempt.message


def test_changed_result_markup_is_an_error_not_an_empty_answer(server):
    page = fixture("ddg_lite_results.html").replace(b"class='result-link'", b"class='result-title'")
    server.route(DDG_PATH, 200, page)
    assert failure(server, "ddg").error == "MalformedResponse"


def test_non_utf8_body_is_decoded_by_its_declared_charset(server):
    latin1 = fixture("ddg_lite_results.html").decode("utf-8").encode("iso-8859-1")
    server.route(DDG_PATH, 200, latin1, "text/html; charset=ISO-8859-1")
    response = chain(server, "ddg").search("weather san francisco")
    assert response.results[6].title == "San Francisco, 8 to 14 Day Extended Weather Forecast (°C)"


def test_body_that_is_not_its_declared_charset_falls_back(server):
    latin1 = fixture("ddg_lite_results.html").decode("utf-8").encode("iso-8859-1")
    server.route(DDG_PATH, 200, latin1, HTML)
    server.route(BRAVE_PATH, 200, fixture("brave_web_results.json"), JSON)
    response = chain(server, "auto").search("weather san francisco")
    assert response.provider == "brave"
    assert response.attempts[0].error == "MalformedResponse"
    assert "not valid UTF-8" in response.attempts[0].message


@pytest.mark.parametrize("send_length", [True, False], ids=["content-length", "close-delimited"])
def test_oversized_body_is_refused(server, send_length):
    server.route(DDG_PATH, 200, b"<html>" + b"x" * (FAST.max_response_bytes + 1), send_length=send_length)
    assert failure(server, "ddg").error == "ResponseTooLarge"


def test_gzip_body_is_decoded_and_capped_by_its_decoded_size(server):
    server.route(
        DDG_PATH, 200, gzip.compress(fixture("ddg_lite_results.html")), headers={"Content-Encoding": "gzip"}
    )
    assert [r.url for r in chain(server, "ddg").search("weather").results] == TEN_URLS
    bomb = gzip.compress(b"<html>" + b" " * (4 * FAST.max_response_bytes))  # small on the wire
    assert len(bomb) < FAST.max_response_bytes
    server.route(DDG_PATH, 200, bomb, headers={"Content-Encoding": "gzip"})
    assert failure(server, "ddg").error == "ResponseTooLarge"


def test_search_function_keeps_one_chain_per_provider_mode(server, monkeypatch):
    for name, value in env_for(server, key=None).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(search, "_default_chains", {})
    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"))
    first = search.search("weather san francisco", max_results=2, provider="ddg")
    second = search.search("weather san francisco", max_results=2, provider="ddg")
    assert first == second and [r.url for r in first.results] == TEN_URLS[:2]
    assert list(search._default_chains) == ["ddg"]


def test_cooldown_skips_duckduckgo_after_a_rate_limit_until_it_expires(server):
    now = [1000.0]
    searcher = chain(server, "auto", clock=lambda: now[0])
    server.route(DDG_PATH, 202, fixture("ddg_lite_challenge_202.html"))
    server.route(BRAVE_PATH, 200, fixture("brave_web_results.json"), JSON)
    assert searcher.search("brave search").provider == "brave"
    assert server.hits(DDG_PATH) == 1

    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"))  # DuckDuckGo would answer now...
    now[0] += search.DDG_COOLDOWN_S - 1
    response = searcher.search("brave search")  # ...but it is not asked during the cooldown
    assert response.provider == "brave" and server.hits(DDG_PATH) == 1
    assert response.attempts[0].error == "CoolingDown" and "RateLimited" in response.attempts[0].message

    now[0] += 1
    assert searcher.search("weather san francisco").provider == "ddg"
    assert server.hits(DDG_PATH) == 2
    assert search.DDG_COOLDOWN_S >= 60


def test_challenge_at_200_also_starts_the_cooldown(server):
    now = [0.0]
    searcher = chain(server, "ddg", clock=lambda: now[0])
    server.route(DDG_PATH, 200, fixture("ddg_lite_challenge_202.html"))
    for _ in range(2):
        with pytest.raises(search.AllProvidersFailed):
            searcher.search("x")
    assert server.hits(DDG_PATH) == 1


# --- transport ----------------------------------------------------------------------------------------


def test_server_that_sleeps_past_the_read_timeout_is_a_timeout(server):
    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"), delay_s=5.0)
    attempt = failure(server, "ddg")
    assert attempt.error == "SearchTimeout"


def test_body_that_trickles_in_hits_the_overall_deadline(server):
    # each byte arrives well within the read timeout; only the deadline stops this
    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"), drip_s=0.05)
    attempt = failure(server, "ddg", limits=search.HttpLimits(0.5, 0.3, 0.4, FAST.max_response_bytes))
    assert attempt.error == "SearchTimeout" and "did not finish" in attempt.message


def test_connection_refused_is_a_transport_error():
    env = {"ENLACE_DDG_URL": f"http://127.0.0.1:{closed_port()}/lite/"}
    with pytest.raises(search.AllProvidersFailed) as raised:
        search.SearchChain.from_env("ddg", env=env, limits=FAST).search("x")
    (attempt,) = raised.value.attempts
    assert attempt.error == "TransportError" and "refused" in attempt.message.lower()


def test_tls_certificate_is_verified():
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(FIXTURES / "tls_localhost_cert.pem", FIXTURES / "tls_localhost_key.pem")
    local = LocalServer(tls)
    try:
        local.route(DDG_PATH, 200, fixture("ddg_lite_results.html"))
        env = {"ENLACE_DDG_URL": local.url(DDG_PATH)}
        with pytest.raises(search.AllProvidersFailed) as raised:  # system CAs do not know this certificate
            search.SearchChain.from_env("ddg", env=env, limits=FAST).search("x")
        assert raised.value.attempts[0].error == "TransportError"
        assert "CERTIFICATE_VERIFY_FAILED" in raised.value.attempts[0].message
        trusting = search.make_pool(ssl.create_default_context(cafile=FIXTURES / "tls_localhost_cert.pem"))
        response = search.SearchChain.from_env("ddg", env=env, limits=FAST, http=trusting).search("x")
        assert [r.url for r in response.results] == TEN_URLS
    finally:
        local.close()


# --- Brave --------------------------------------------------------------------------------------------


def test_brave_results_parse_with_strong_markup_stripped(server):
    server.route(BRAVE_PATH, 200, fixture("brave_web_results.json"), JSON)
    response = chain(server, "brave").search("brave search", max_results=20, region="es-es")
    assert response.provider == "brave" and len(response.results) == 19
    first = response.results[0]
    assert (first.title, first.url, first.rank) == (
        "Private Search Engine - Brave Search",
        "https://search.brave.com/",
        1,
    )
    assert first.snippet.startswith("Brave Search doesn’t track you or your queries.")
    assert not any("<strong>" in r.snippet or "&#x27;" in r.snippet for r in response.results)
    assert "I'm very happy so far" in response.results[10].snippet
    (request,) = server.requests
    assert request.method == "GET" and request.headers["X-Subscription-Token"] == KEY
    query = parse_qs(urlsplit(request.path).query)
    assert query == {
        "q": ["brave search"],
        "count": ["20"],
        "country": ["ES"],
        "search_lang": ["es"],
        "safesearch": ["moderate"],
    }


def test_brave_without_web_results_is_an_empty_answer(server):
    server.route(BRAVE_PATH, 200, b'{"type": "search", "query": {"original": "xqzv"}}', JSON)
    response = chain(server, "brave").search("xqzv")
    assert (response.provider, response.results) == ("brave", [])


def test_brave_429_shows_the_service_detail(server):
    server.route(BRAVE_PATH, 429, fixture("brave_error_429.json"), JSON)
    attempt = failure(server, "brave")
    assert attempt.error == "RateLimited"
    assert "Request rate limit exceeded for plan" in attempt.message and "RATE_LIMITED" in attempt.message


@pytest.mark.parametrize(
    "status, error",
    [(401, "BadApiKey"), (422, "BadApiKey"), (402, "QuotaExceeded")],
    ids=["401", "422", "402"],
)
def test_brave_key_and_quota_errors_show_the_service_detail(server, status, error):
    body = {
        "type": "ErrorResponse",
        "error": {"status": status, "detail": f"detail for {status}", "code": "X"},
    }
    server.route(BRAVE_PATH, status, json.dumps(body).encode(), JSON)
    attempt = failure(server, "brave")
    assert attempt.error == error and f"detail for {status}" in attempt.message


def test_region_maps_to_accept_language_and_brave_parameters():
    assert search.parse_region("us-en").brave_params() == {"country": "US", "search_lang": "en"}
    assert search.parse_region("uk-en").brave_params() == {"country": "GB", "search_lang": "en-gb"}
    assert search.parse_region("br-pt").brave_params() == {"country": "BR", "search_lang": "pt-br"}
    assert search.parse_region("bg-bg").brave_params() == {"country": "ALL", "search_lang": "bg"}
    assert search.parse_region("wt-wt").brave_params() == {"country": "ALL"}
    assert search.parse_region("jp-jp").accept_language() == "ja-JP,ja;q=0.9"
    with pytest.raises(search.ConfigError, match="kl code"):
        search.parse_region("spain")


# --- chain semantics and configuration ------------------------------------------------------------------


def test_every_failed_attempt_is_recorded_in_order(server):
    server.route(DDG_PATH, 403, fixture("ddg_lite_blocked_403.html"))
    server.route(BRAVE_PATH, 429, fixture("brave_error_429.json"), JSON)
    with pytest.raises(search.AllProvidersFailed) as raised:
        chain(server, "auto").search("x")
    assert [(a.provider, a.error) for a in raised.value.attempts] == [
        ("ddg", "Blocked"),
        ("brave", "RateLimited"),
    ]
    assert "ddg: Blocked" in str(raised.value) and "brave: RateLimited" in str(raised.value)


def test_brave_without_a_key_fails_at_construction_not_at_the_first_query(server):
    with pytest.raises(search.ConfigError) as raised:
        search.SearchChain.from_env("brave", env=env_for(server, key=None))
    assert "BRAVE_API_KEY" in str(raised.value) and ".env" in str(raised.value)
    assert "--provider ddg" in str(raised.value)
    assert server.requests == []
    assert [p.name for p in search.SearchChain.from_env("ddg", env=env_for(server, key=None)).providers] == [
        "ddg"
    ]


def test_auto_without_a_key_is_duckduckgo_alone_and_says_there_is_no_fallback(server):
    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"))
    keyless = search.SearchChain.from_env("auto", env=env_for(server, key=None), limits=FAST)
    assert [p.name for p in keyless.providers] == ["ddg"]
    assert keyless.describe().startswith("ddg alone, no fallback when it fails (no BRAVE_API_KEY; ")
    assert [r.url for r in keyless.search("weather san francisco", region="us-en").results] == TEN_URLS
    assert chain(server).describe() == "ddg then brave"


@pytest.mark.parametrize("key", ["abc def", "abc\u201d", "abc\x7f"])
def test_a_brave_key_that_no_header_can_carry_fails_at_construction(server, key):
    for provider in ("auto", "brave"):
        with pytest.raises(search.ConfigError, match="BRAVE_API_KEY holds a space or a character"):
            search.SearchChain.from_env(provider, env=env_for(server, key=key))
    assert server.requests == []


def test_bad_usage_is_a_config_error(server):
    searcher = chain(server, "ddg")
    for bad in [
        {"query": "  "},
        {"query": "x", "max_results": 0},
        {"query": "x", "max_results": 21},
        {"query": "x", "region": "es_ES"},
        {"query": "x", "time_range": "hour"},
    ]:
        with pytest.raises(search.ConfigError):
            searcher.search(**bad)
    with pytest.raises(search.ConfigError, match="unencrypted"):
        search.SearchChain.from_env(
            "brave", env={"BRAVE_API_KEY": KEY, "ENLACE_BRAVE_URL": "http://example.com/"}
        )
    assert server.requests == []


def test_key_never_leaks_through_a_redirect(server, recorder, caplog):
    caplog.set_level(logging.DEBUG)
    server.route(BRAVE_PATH, 302, b"", JSON, headers={"Location": recorder.url("/steal?x=1")})
    searcher = chain(server, "brave")
    with pytest.raises(search.AllProvidersFailed) as raised:
        searcher.search("x")
    assert recorder.requests == []  # the redirect was not followed: the other host got nothing
    assert server.requests[0].headers["X-Subscription-Token"] == KEY  # it did go to the right host
    attempt = raised.value.attempts[0]
    assert attempt.error == "Redirected"
    shown = [
        str(raised.value),
        repr(raised.value),
        repr(attempt),
        repr(searcher),
        repr(searcher.providers[0]),
        repr(vars(searcher.providers[0])),
        caplog.text,
    ]
    assert not any(KEY in text for text in shown)


def test_key_echoed_by_the_service_is_redacted(server):
    body = {"type": "ErrorResponse", "error": {"detail": f"The token {KEY} is invalid", "code": "TOKEN"}}
    server.route(BRAVE_PATH, 401, json.dumps(body).encode(), JSON)
    attempt = failure(server, "brave")
    assert KEY not in attempt.message and "The token [redacted] is invalid" in attempt.message


# --- CLI ------------------------------------------------------------------------------------------------


def run_cli(args: list[str], env: dict[str, str], folder: Path) -> subprocess.CompletedProcess:
    """search.py in a subprocess that sees only folder/.env, never a real .env at the repository root."""
    env_file = folder / ".env"
    if not env_file.exists():
        env_file.write_text("")
    base = {name: value for name, value in os.environ.items() if not name.startswith(("BRAVE_", "ENLACE_"))}
    env = {**base, "ENLACE_ENV_FILE": str(env_file), **env}
    command = [sys.executable, str(REPO / "search.py"), *args]
    return subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True, timeout=30)


def test_env_file_is_read_like_remote_sh_reads_it(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text(
        "# settings\nREMOTE_HOST=gpu.example.org\nexport BRAVE_API_KEY='a b # c'\n"
        "ENLACE_DDG_URL=http://127.0.0.1:9/lite/  # local\nOTHER_TOKEN=x\nnot a setting\n"
    )
    assert search.read_env_file(str(env_file), required=True) == {
        "BRAVE_API_KEY": "a b # c",
        "ENLACE_DDG_URL": "http://127.0.0.1:9/lite/",
    }
    assert search.read_env_file(str(tmp_path / "absent"), required=False) == {}
    with pytest.raises(search.ConfigError, match="ENLACE_ENV_FILE"):
        search.read_env_file(str(tmp_path / "absent"), required=True)


def test_cli_json_prints_provider_results_and_attempts(server, tmp_path):
    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"))
    (tmp_path / ".env").write_text(f"# key for the fallback\nBRAVE_API_KEY='{KEY}'\n")
    done = run_cli(["--json", "-n", "3", "weather", "san francisco"], env_for(server, key=None), tmp_path)
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["provider"] == "ddg" and answer["attempts"] == []
    assert [r["url"] for r in answer["results"]] == TEN_URLS[:3]
    assert set(answer["results"][0]) == {"title", "url", "snippet", "rank", "published"}
    assert parse_qs(server.requests[0].body.decode())["q"] == ["weather san francisco"]


def test_cli_exit_codes(server, tmp_path):
    no_key = env_for(server, key=None)
    missing = run_cli(["--provider", "brave", "x"], no_key, tmp_path)
    assert missing.returncode == 2
    assert (
        "BRAVE_API_KEY" in missing.stderr and ".env" in missing.stderr and "--provider ddg" in missing.stderr
    )
    assert run_cli(["-n", "0", "--provider", "ddg", "x"], no_key, tmp_path).returncode == 2

    server.route(DDG_PATH, 202, fixture("ddg_lite_challenge_202.html"))
    server.route(BRAVE_PATH, 429, fixture("brave_error_429.json"), JSON)
    failed = run_cli(["x"], env_for(server), tmp_path)
    assert failed.returncode == 1
    assert "ddg: RateLimited" in failed.stderr and "brave: RateLimited" in failed.stderr
    assert KEY not in failed.stderr + failed.stdout

    server.route(DDG_PATH, 200, fixture("ddg_lite_empty.html"))
    empty = run_cli(["--provider", "ddg", "xqzv"], no_key, tmp_path)
    assert empty.returncode == 0 and "No results." in empty.stdout and "from ddg" in empty.stdout

    server.route(DDG_PATH, 200, fixture("ddg_lite_results.html"))
    keyless = run_cli(["weather"], no_key, tmp_path)  # a fresh install: auto, no key, no account
    assert keyless.returncode == 0 and "[10 results from ddg]" in keyless.stdout
    assert keyless.stderr.startswith("note: ddg alone, no fallback when it fails (no BRAVE_API_KEY;")
