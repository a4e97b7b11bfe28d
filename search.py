"""
Web search for ENLACE: DuckDuckGo lite first (no key, no account), the Brave Search API as fallback once
BRAVE_API_KEY is set (without it, auto is DuckDuckGo alone and says so).

    python search.py "que es home assistant"            # numbered results and which provider answered
    python search.py -n 5 --provider ddg "receta de lentejas"
    python search.py --json "que es home assistant"     # {"provider", "results", "attempts"}

Library use (the agent): search(query, ...) -> SearchResponse(provider, results, attempts).

How the chain behaves:
- A provider that answers correctly with zero results IS the answer; only a real error (transport, a
  status other than 200, a challenge page, markup we cannot read) moves on to the next provider.
- The response names the provider that answered and keeps every failed attempt with its error.
- A Brave key that cannot be sent fails when the chain is built (the server builds it at start), not at
  the first query; --provider brave without a key fails there too.
- After DuckDuckGo rate-limits, blocks or challenges us, it is skipped for DDG_COOLDOWN_S.

Environment: BRAVE_API_KEY, ENLACE_DDG_URL and ENLACE_BRAVE_URL (override the endpoints; the tests point
them at a local server). The CLI also reads these three from .env at the repository root (or the file
named by ENLACE_ENV_FILE), as scripts/remote.sh does; a variable set in the environment wins.
"""

import argparse
import codecs
import html
import json
import logging
import os
import re
import ssl
import sys
import time
from dataclasses import asdict, dataclass, field
from html.parser import HTMLParser
from urllib.parse import parse_qs, urlencode, urlsplit

import urllib3

import fileio

log = logging.getLogger("search")

DDG_URL = "https://lite.duckduckgo.com/lite/"
BRAVE_URL = "https://api.search.brave.com/res/v1/web/search"
DEFAULT_REGION = "es-es"
PROVIDER_CHOICES = ("auto", "ddg", "brave")
TIME_RANGES = {"day": ("d", "pd"), "week": ("w", "pw"), "month": ("m", "pm"), "year": ("y", "py")}
# Safe search as each provider takes it: DuckDuckGo's kp (1 strict, -1 moderate, -2 off) and Brave's safesearch.
SAFE_SEARCH = {"strict": ("1", "strict"), "moderate": ("-1", "moderate"), "off": ("-2", "off")}
MAX_RESULTS_LIMIT = 20  # Brave's count is 1-20; DuckDuckGo lite gives at most ~10 on its first page
MAX_QUERY_CHARS = 400  # Brave rejects longer queries
DDG_COOLDOWN_S = 120.0  # DuckDuckGo's rate limits last minutes; retrying sooner only extends them

# Firefox ESR 140 on Linux: a current, common browser. DuckDuckGo serves the bot challenge to clients
# that do not look like one. Refresh when the ESR moves on.
BROWSER_USER_AGENT = "Mozilla/5.0 (X11; Linux x86_64; rv:140.0) Gecko/20100101 Firefox/140.0"
API_USER_AGENT = "ENLACE-search/1.0 (urllib3)"


@dataclass(frozen=True)
class HttpLimits:
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 10.0  # per socket read
    deadline_s: float = 20.0  # the whole request: connect, headers and body
    max_response_bytes: int = 2 * 1024 * 1024  # a results page is ~25 KB, a Brave answer ~50 KB


# --- results and errors ---------------------------------------------------------------------------


@dataclass
class SearchResult:
    title: str
    url: str
    snippet: str
    rank: int  # 1-based, after ads and DuckDuckGo's own links are dropped
    published: str | None = None  # as the provider gives it (DDG timestamp, Brave page_age)


@dataclass
class Attempt:
    provider: str
    error: str  # the error type, e.g. RateLimited
    message: str
    seconds: float


@dataclass
class SearchResponse:
    provider: str
    results: list[SearchResult]
    attempts: list[Attempt] = field(default_factory=list)  # the providers that failed before this one

    def to_dict(self) -> dict:
        return asdict(self)


class SearchError(Exception):
    """Base of every error this module raises on purpose."""


class ConfigError(SearchError):
    """Bad usage or configuration: a missing key, a bad region or URL. Raised before any request."""


class AllProvidersFailed(SearchError):
    def __init__(self, attempts: list[Attempt]):
        self.attempts = attempts
        lines = [f"{a.provider}: {a.error}: {a.message}" for a in attempts]
        super().__init__("every provider failed:\n  " + "\n  ".join(lines))


class ProviderError(SearchError):
    """A provider could not answer. The only kind of error that moves the chain to the next provider."""

    triggers_cooldown = False

    def __init__(self, provider: str, message: str):
        self.provider = provider
        super().__init__(message)


class TransportError(ProviderError):
    """Could not connect, TLS failed, or the connection broke mid-answer."""


class SearchTimeout(TransportError):
    """Connect or read timeout, or the overall deadline passed."""


class HttpStatusError(ProviderError):
    """A status other than exactly 200."""

    def __init__(self, provider: str, status: int, message: str):
        self.status = status
        super().__init__(provider, f"HTTP {status}: {message}")


class RateLimited(HttpStatusError):
    triggers_cooldown = True


class Blocked(HttpStatusError):
    triggers_cooldown = True


class Redirected(HttpStatusError):
    """3xx: never followed, so a credential cannot travel to another host."""


class BadApiKey(HttpStatusError):
    pass


class QuotaExceeded(HttpStatusError):
    pass


class ChallengePage(ProviderError):
    """DuckDuckGo's bot challenge (anomaly page), recognised by its markup whatever the status."""

    triggers_cooldown = True


class MalformedResponse(ProviderError):
    """A body we cannot read: unknown markup, invalid JSON, bytes that are not the declared charset."""


class ResponseTooLarge(ProviderError):
    pass


class CoolingDown(ProviderError):
    """Not an answer from the network: the provider was skipped because it recently pushed back."""


class Secret:
    """Holds a credential so that no repr, str or log line can show it."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__


def redact(text: str, secret: Secret | None) -> str:
    # Service text is echoed into our messages; a service that echoes the key must not leak it.
    if secret is not None and secret.reveal() and secret.reveal() in text:
        return text.replace(secret.reveal(), "[redacted]")
    return text


# --- HTTP -----------------------------------------------------------------------------------------


@dataclass
class HttpReply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


def make_pool(ssl_context: ssl.SSLContext | None = None) -> urllib3.PoolManager:
    # certifi is not a dependency: verify against the system CA bundle via the default context.
    context = ssl_context if ssl_context is not None else ssl.create_default_context()
    return urllib3.PoolManager(num_pools=4, maxsize=2, ssl_context=context, cert_reqs="CERT_REQUIRED")


def fetch(
    http: urllib3.PoolManager,
    method: str,
    url: str,
    *,
    provider: str,
    headers: dict[str, str],
    limits: HttpLimits,
    body: str | None = None,
    fields: dict[str, str] | None = None,
) -> HttpReply:
    """One request, no redirects, no retries; the body is read in chunks under a size cap and a deadline."""
    host = urlsplit(url).netloc
    deadline = time.monotonic() + limits.deadline_s
    timeout = urllib3.Timeout(
        connect=limits.connect_timeout_s, read=limits.read_timeout_s, total=limits.deadline_s
    )
    try:
        response = http.request(
            method,
            url,
            body=body,
            fields=fields,
            headers=headers,
            timeout=timeout,
            redirect=False,
            retries=False,
            preload_content=False,
        )
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise transport_error(provider, host, exc, limits) from exc

    complete = False
    try:
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limits.max_response_bytes:
            raise ResponseTooLarge(
                provider,
                f"{host} announced {int(declared)} bytes, over the {limits.max_response_bytes} byte cap",
            )
        chunks, size = [], 0
        while True:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise SearchTimeout(provider, f"{host} did not finish answering within {limits.deadline_s} s")
            # A body that trickles in never trips the per-read timeout; shrinking each read's timeout to
            # what is left of the deadline does. read1 returns whatever has arrived instead of waiting
            # for a full chunk.
            sock = getattr(response.connection, "sock", None)
            if sock is not None:
                sock.settimeout(min(limits.read_timeout_s, remaining_s))
            try:
                chunk = response.read1(64 * 1024)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise transport_error(provider, host, exc, limits) from exc
            if not chunk:
                break
            size += len(chunk)
            if size > limits.max_response_bytes:
                raise ResponseTooLarge(
                    provider, f"{host} sent more than the {limits.max_response_bytes} byte cap"
                )
            chunks.append(chunk)
        complete = True
        headers_lower = {name.lower(): value for name, value in response.headers.items()}
        return HttpReply(response.status, headers_lower, b"".join(chunks))
    finally:
        if not complete:
            response.close()  # drop the connection rather than drain an unwanted body
        response.release_conn()


def transport_error(provider: str, host: str, exc: Exception, limits: HttpLimits) -> TransportError:
    """Name what went wrong on the wire; the message says which host, never which headers."""
    if isinstance(exc, urllib3.exceptions.NewConnectionError):  # refused, unreachable, DNS
        return TransportError(provider, f"cannot connect to {host}: {exc}")
    # checked after NewConnectionError, which urllib3 derives from ConnectTimeoutError
    if isinstance(exc, urllib3.exceptions.TimeoutError | TimeoutError):
        return SearchTimeout(
            provider,
            f"no answer from {host} within the timeouts "
            f"(connect {limits.connect_timeout_s} s, read {limits.read_timeout_s} s)",
        )
    if isinstance(exc, urllib3.exceptions.SSLError | ssl.SSLError):
        return TransportError(provider, f"TLS with {host} failed: {exc}")
    return TransportError(provider, f"cannot talk to {host}: {exc}")


def declared_charset(content_type: str) -> str | None:
    for parameter in content_type.split(";")[1:]:
        name, _, value = parameter.strip().partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip("\"'")
    return None


def decode_text(reply: HttpReply, provider: str) -> str:
    charset = declared_charset(reply.headers.get("content-type", "")) or "utf-8"
    try:
        codec = codecs.lookup(charset)
    except LookupError:
        raise MalformedResponse(provider, f"the body declares an unknown charset {charset!r}") from None
    try:
        return reply.body.decode(codec.name)
    except UnicodeDecodeError as exc:
        raise MalformedResponse(
            provider, f"the body is not valid {charset}: byte {exc.start} is {reply.body[exc.start]:#04x}"
        ) from None


def status_error(provider: str, reply: HttpReply, detail: str) -> HttpStatusError:
    status = reply.status
    if 300 <= status < 400:
        target = urlsplit(reply.headers.get("location", ""))
        return Redirected(provider, status, f"redirect to {target.netloc}{target.path} not followed")
    if status in (202, 429):
        return RateLimited(provider, status, detail or "rate limited")
    if status == 403:
        return Blocked(provider, status, detail or "blocked")
    if status in (401, 422):
        return BadApiKey(provider, status, detail or "the API key was rejected")
    if status == 402:
        return QuotaExceeded(provider, status, detail or "quota exhausted")
    return HttpStatusError(provider, status, detail or "unexpected status")


# --- regions --------------------------------------------------------------------------------------

# DuckDuckGo's kl is <country>-<language> with a few codes of its own; these map them to ISO codes.
COUNTRY_FIXES = {"uk": "gb", "xa": "sa", "ct": "es"}
LANGUAGE_FIXES = {"jp": "ja", "kr": "ko", "tzh": "zh"}
# Brave's enums (api-dashboard.search.brave.com web search reference); others fall back to defaults.
BRAVE_COUNTRIES = set(
    "AR AU AT BE BR CA CL DK FI FR DE HK IN ID IT JP KR MY MX NL NZ NO CN PL PT PH RU SA ZA ES SE CH TW "
    "TR GB US".split()
)
BRAVE_LANGUAGES = set(
    "ar eu bn bg ca zh-hans zh-hant hr cs da nl en en-gb et fi fr gl de gu he hi hu is it jp kn ko lv lt "
    "ms ml mr nb pl pt-br pt-pt pa ro ru sr sk sl es sv ta te th tr uk vi".split()
)


@dataclass(frozen=True)
class Region:
    kl: str  # as DuckDuckGo wants it: es-es, us-en, wt-wt (no region)
    country: str | None  # ISO 3166 alpha-2, lower case; None for wt-wt
    language: str | None  # ISO 639-1; None for wt-wt

    def accept_language(self) -> str:
        if self.language is None or self.country is None:
            return "en-US,en;q=0.9"  # what most browsers send; wt-wt asks for no region
        return f"{self.language}-{self.country.upper()},{self.language};q=0.9"

    def brave_params(self) -> dict[str, str]:
        params = {"country": "ALL"}
        if self.country is not None and self.country.upper() in BRAVE_COUNTRIES:
            params["country"] = self.country.upper()
        language = {"ja": "jp", "no": "nb", "zh": "zh-hant" if self.kl.endswith("tzh") else "zh-hans"}.get(
            self.language or "", self.language
        )
        if language == "pt":
            language = "pt-br" if self.country == "br" else "pt-pt"
        if language == "en" and self.country == "gb":
            language = "en-gb"
        if language in BRAVE_LANGUAGES:
            params["search_lang"] = language
        return params


def parse_region(text: str) -> Region:
    kl = text.strip().lower()
    match = re.fullmatch(r"([a-z]{2})-([a-z]{2,3})", kl)
    if match is None:
        raise ConfigError(
            f"region {text!r} is not a DuckDuckGo kl code: use <country>-<language> like es-es, "
            "mx-es, us-en, or wt-wt for no region"
        )
    if kl == "wt-wt":
        return Region(kl, None, None)
    country, language = match.groups()
    return Region(kl, COUNTRY_FIXES.get(country, country), LANGUAGE_FIXES.get(language, language))


# --- DuckDuckGo lite ------------------------------------------------------------------------------


def is_duckduckgo_host(host: str) -> bool:
    return host == "duckduckgo.com" or host.endswith(".duckduckgo.com")


def is_result_redirect(href: str) -> bool:
    parts = urlsplit(href)
    host = parts.hostname or ""
    return (
        (not host or is_duckduckgo_host(host)) and parts.path.rstrip("/") == "/l" and "uddg=" in parts.query
    )


def result_target(href: str) -> str | None:
    """The result's real URL, or None for ads and links back to DuckDuckGo."""
    parts = urlsplit(href)
    host = parts.hostname or ""
    if not host or is_duckduckgo_host(host):
        if not is_result_redirect(href):
            return None  # ads (y.js), pagination, DuckDuckGo's own pages
        # parse_qs percent-decodes exactly once: uddg=...%2520... becomes ...%20..., never a space
        href = parse_qs(parts.query).get("uddg", [""])[0]
        parts = urlsplit(href)
        host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host or is_duckduckgo_host(host):
        return None
    return href


def is_challenge_tag(tag: str, attributes: dict[str, str]) -> bool:
    # Markup only: a query can echo the challenge's words into the page, but not into ids and classes.
    if attributes.get("id") == "challenge-form":
        return True
    if attributes.get("data-testid", "").startswith("anomaly-modal"):
        return True
    if any(name.startswith("anomaly-modal") for name in attributes.get("class", "").split()):
        return True
    return tag == "form" and urlsplit(attributes.get("action", "")).path.endswith("/anomaly.js")


class LitePageParser(HTMLParser):
    """One pass over a lite page: result rows, challenge markup, and whether it is a lite page at all."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.results: list[dict] = []
        self.challenge = False
        self.search_form = False  # the lite query form: present on results and empty pages alike
        self.result_links = 0  # result-link anchors, ads included
        self.redirect_links = 0  # //duckduckgo.com/l/?uddg= anchors anywhere
        self._in_lite_form = False
        self._row_sponsored = False
        self._current: dict | None = None  # the last kept result, waiting for its snippet
        self._capture: tuple[str, str] | None = None  # (field, closing tag)
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        attributes = {name: value or "" for name, value in attrs}
        classes = attributes.get("class", "").split()
        if is_challenge_tag(tag, attributes):
            self.challenge = True
        if tag == "form":
            self._in_lite_form = urlsplit(attributes.get("action", "")).path.rstrip("/").endswith("/lite")
        elif tag == "input" and self._in_lite_form and attributes.get("name") == "q":
            self.search_form = True
        elif tag == "tr":
            self._row_sponsored = "result-sponsored" in classes
        elif tag == "a":
            href = attributes.get("href", "")
            self.redirect_links += is_result_redirect(href)
            if "result-link" in classes:
                self.result_links += 1
                target = None if self._row_sponsored else result_target(href)
                self._current = None
                if target is not None:
                    self._current = {"title": "", "url": target, "snippet": "", "published": None}
                    self.results.append(self._current)
                    self._start("title", "a")
        elif tag == "td" and "result-snippet" in classes and self._current and not self._row_sponsored:
            self._start("snippet", "td")
        elif tag == "span" and "timestamp" in classes and self._current:
            self._start("published", "span")

    def handle_endtag(self, tag):
        if tag == "form":
            self._in_lite_form = False
        if self._capture is not None and tag == self._capture[1]:
            self._current[self._capture[0]] = " ".join("".join(self._text).split())
            self._capture = None

    def handle_data(self, data):
        if self._capture is not None:
            self._text.append(data)

    def _start(self, name: str, closing_tag: str):
        self._capture = (name, closing_tag)
        self._text = []


def parse_ddg_lite(page: str, provider: str = "ddg") -> list[SearchResult]:
    """Results of a lite page; [] for a recognised page without results. Raises ChallengePage or
    MalformedResponse for anything else."""
    parser = LitePageParser()
    parser.feed(page)
    parser.close()
    if parser.challenge:
        raise ChallengePage(provider, "DuckDuckGo served its bot challenge (anomaly page) instead of results")
    if parser.redirect_links and not parser.result_links:
        raise MalformedResponse(
            provider, "the page links to results but has no result-link rows: the lite markup changed"
        )
    if not parser.result_links and not parser.search_form:
        raise MalformedResponse(
            provider, "neither result rows nor the lite search form: not a DuckDuckGo lite page"
        )
    return [
        SearchResult(row["title"] or row["url"], row["url"], row["snippet"], rank, row["published"] or None)
        for rank, row in enumerate(parser.results, start=1)
    ]


class DuckDuckGoLite:
    name = "ddg"
    cooldown_s = DDG_COOLDOWN_S

    def __init__(self, http: urllib3.PoolManager, url: str = DDG_URL, limits: HttpLimits = HttpLimits()):
        self.http, self.url, self.limits = http, url, limits

    def __repr__(self) -> str:
        return f"DuckDuckGoLite(url={self.url!r})"

    def search(
        self,
        query: str,
        max_results: int,
        region: Region,
        time_range: str | None = None,
        safe_search: str = "moderate",
    ) -> list[SearchResult]:
        form = {"q": query, "kl": region.kl, "kp": SAFE_SEARCH[safe_search][0]}
        if time_range is not None:
            form["df"] = TIME_RANGES[time_range][0]
        origin = "{0.scheme}://{0.netloc}".format(urlsplit(self.url))
        headers = {
            "User-Agent": BROWSER_USER_AGENT,
            "Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8",
            "Accept-Language": region.accept_language(),
            "Accept-Encoding": "gzip, deflate",
            # urllib3 would send multipart/form-data for fields=; the lite form is url-encoded
            "Content-Type": "application/x-www-form-urlencoded",
            "Origin": origin,
            "Referer": origin + "/",
        }
        reply = fetch(
            self.http,
            "POST",
            self.url,
            provider=self.name,
            headers=headers,
            body=urlencode(form),
            limits=self.limits,
        )
        if reply.status != 200:  # exact: urllib3 counts 202 (DuckDuckGo's rate limit) as success
            detail = {
                202: "DuckDuckGo's rate limit (it serves its bot challenge)",
                403: "blocked by DuckDuckGo",
            }
            raise status_error(self.name, reply, detail.get(reply.status, ""))
        return parse_ddg_lite(decode_text(reply, self.name), self.name)[:max_results]


# --- Brave Search API -----------------------------------------------------------------------------

STRONG_TAG = re.compile(r"</?strong>")


def brave_text(value) -> str:
    return html.unescape(STRONG_TAG.sub("", value)) if isinstance(value, str) else ""


def parse_brave(body: bytes, provider: str = "brave") -> list[SearchResult]:
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise MalformedResponse(provider, f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("type") != "search":
        raise MalformedResponse(provider, 'the JSON is not a Brave search answer (no "type": "search")')
    web = data.get("web") or {}  # Brave leaves out "web" when nothing matched
    rows = web.get("results", []) if isinstance(web, dict) else None
    if not isinstance(rows, list):
        raise MalformedResponse(provider, "web.results is not a list")
    results = []
    for row in rows:
        if isinstance(row, dict) and isinstance(row.get("url"), str) and row["url"]:
            title = brave_text(row.get("title")) or row["url"]
            published = row.get("page_age") if isinstance(row.get("page_age"), str) else None
            results.append(SearchResult(title, row["url"], brave_text(row.get("description")), 0, published))
    for rank, result in enumerate(results, start=1):
        result.rank = rank
    return results


def brave_error_detail(body: bytes) -> str:
    """The service's own words from an ErrorResponse body, or '' when the body is not one."""
    try:
        data = json.loads(body)
        error = data["error"]
        detail = str(error.get("detail") or "")
        code = str(error.get("code") or "")
    except (ValueError, KeyError, TypeError, AttributeError):
        return ""
    return f"{detail} ({code})" if code else detail


class BraveSearch:
    name = "brave"
    cooldown_s = 0.0  # Brave's limits are per second: the next query may well pass

    def __init__(
        self, http: urllib3.PoolManager, api_key: str, url: str = BRAVE_URL, limits: HttpLimits = HttpLimits()
    ):
        self.http, self.url, self.limits = http, url, limits
        self._api_key = Secret(api_key)

    def __repr__(self) -> str:
        return f"BraveSearch(url={self.url!r}, api_key=***)"

    def search(
        self,
        query: str,
        max_results: int,
        region: Region,
        time_range: str | None = None,
        safe_search: str = "moderate",
    ) -> list[SearchResult]:
        params = {"q": query, "count": str(max_results), **region.brave_params()}
        params["safesearch"] = SAFE_SEARCH[safe_search][1]
        if time_range is not None:
            params["freshness"] = TIME_RANGES[time_range][1]
        headers = {
            "Accept": "application/json",
            "Accept-Encoding": "gzip",
            "User-Agent": API_USER_AGENT,
            "X-Subscription-Token": self._api_key.reveal(),
        }
        reply = fetch(
            self.http, "GET", self.url, provider=self.name, headers=headers, fields=params, limits=self.limits
        )
        if reply.status != 200:
            detail = redact(brave_error_detail(reply.body), self._api_key)
            raise status_error(self.name, reply, detail)
        return parse_brave(reply.body, self.name)[:max_results]


# --- the chain ------------------------------------------------------------------------------------


def check_endpoint(name: str, url: str, carries_key: bool) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"{name}={url!r} is not an http(s) URL like {BRAVE_URL if carries_key else DDG_URL}"
        )
    local = parts.hostname in ("127.0.0.1", "localhost", "::1")
    if carries_key and parts.scheme == "http" and not local:
        raise ConfigError(f"{name}={url!r}: the API key would travel unencrypted; use https")
    return url


MISSING_KEY_HELP = (
    "Add a line BRAVE_API_KEY=<your key> to .env in the repository root (or export it; keys at "
    "https://brave.com/search/api/), or search keyless with --provider ddg."
)
# What an HTTP header can carry: a key pasted with a space, a newline or a curly quote would fail at the
# first fallback instead of at start.
API_KEY = re.compile(r"[\x21-\x7e]+")


class SearchChain:
    """Providers tried in order over one connection pool; remembers DuckDuckGo's cooldown."""

    def __init__(self, providers: list, clock=time.monotonic, missing_fallback: str = ""):
        self.providers = providers
        self.clock = clock  # injectable so the cooldown can be tested without sleeping
        self.missing_fallback = missing_fallback  # why auto has no fallback ("" when it has one)
        self.cooldown_until: dict[str, float] = {}
        self.cooldown_reason: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"SearchChain({self.providers!r})"

    @classmethod
    def from_env(
        cls,
        provider: str = "auto",
        env=None,
        limits: HttpLimits = HttpLimits(),
        http: urllib3.PoolManager | None = None,
        clock=time.monotonic,
    ) -> "SearchChain":
        """Build the chain for --provider auto|ddg|brave; a credential that is missing or cannot be sent
        fails here, not later. auto without BRAVE_API_KEY is DuckDuckGo alone (no account needed), and
        says so in describe()."""
        env = os.environ if env is None else env
        if provider not in PROVIDER_CHOICES:
            raise ConfigError(f"provider {provider!r} is not one of {', '.join(PROVIDER_CHOICES)}")
        key = env.get("BRAVE_API_KEY", "").strip()
        if provider == "brave" and not key:
            raise ConfigError(f"BRAVE_API_KEY is not set: brave needs it. {MISSING_KEY_HELP}")
        if provider != "ddg" and key and not API_KEY.fullmatch(key):
            raise ConfigError(
                "BRAVE_API_KEY holds a space or a character an HTTP header cannot carry (a key is printable "
                f"ASCII without spaces): copy it again. {MISSING_KEY_HELP}"
            )
        missing = "no BRAVE_API_KEY" if provider == "auto" and not key else ""
        ddg_url = check_endpoint("ENLACE_DDG_URL", env.get("ENLACE_DDG_URL") or DDG_URL, carries_key=False)
        brave_url = check_endpoint(
            "ENLACE_BRAVE_URL", env.get("ENLACE_BRAVE_URL") or BRAVE_URL, carries_key=True
        )
        http = make_pool() if http is None else http
        providers = []
        if provider in ("auto", "ddg"):
            providers.append(DuckDuckGoLite(http, ddg_url, limits))
        if provider == "brave" or (provider == "auto" and key):
            providers.append(BraveSearch(http, key, brave_url, limits))
        return cls(providers, clock, missing)

    def describe(self) -> str:
        """One line for a start-up log: the providers in order, and when auto has no fallback, why."""
        order = " then ".join(provider.name for provider in self.providers)
        if self.missing_fallback:
            return (
                f"{order} alone, no fallback when it fails ({self.missing_fallback}; add a line "
                "BRAVE_API_KEY=<key> to .env for Brave, keys at https://brave.com/search/api/)"
            )
        return order

    def search(
        self,
        query: str,
        max_results: int = 10,
        region: str = DEFAULT_REGION,
        time_range: str | None = None,
        safe_search: str = "moderate",
    ) -> SearchResponse:
        query = " ".join(str(query).split())
        if not query:
            raise ConfigError("the query is empty")
        if len(query) > MAX_QUERY_CHARS:
            raise ConfigError(f"the query has {len(query)} characters; the limit is {MAX_QUERY_CHARS}")
        if not isinstance(max_results, int) or not 1 <= max_results <= MAX_RESULTS_LIMIT:
            raise ConfigError(f"max_results={max_results!r} must be an integer from 1 to {MAX_RESULTS_LIMIT}")
        if time_range is not None and time_range not in TIME_RANGES:
            raise ConfigError(f"time_range={time_range!r} must be one of {', '.join(TIME_RANGES)} or None")
        if safe_search not in SAFE_SEARCH:
            raise ConfigError(f"safe_search={safe_search!r} must be one of {', '.join(SAFE_SEARCH)}")
        parsed_region = parse_region(region)

        attempts: list[Attempt] = []
        for provider in self.providers:
            wait_s = self.cooldown_until.get(provider.name, 0.0) - self.clock()
            if wait_s > 0:
                reason = self.cooldown_reason[provider.name]
                skipped = CoolingDown(provider.name, f"skipped for another {wait_s:.0f} s after {reason}")
                attempts.append(Attempt(provider.name, "CoolingDown", str(skipped), 0.0))
                continue
            started = time.perf_counter()
            try:
                results = provider.search(query, max_results, parsed_region, time_range, safe_search)
            except ProviderError as exc:
                seconds = round(time.perf_counter() - started, 3)
                attempts.append(Attempt(provider.name, type(exc).__name__, str(exc), seconds))
                log.info("%s failed (%s): %s", provider.name, type(exc).__name__, exc)
                if exc.triggers_cooldown and provider.cooldown_s > 0:
                    self.cooldown_until[provider.name] = self.clock() + provider.cooldown_s
                    self.cooldown_reason[provider.name] = type(exc).__name__
                continue
            # zero results from a provider that answered correctly is the answer: no fallback
            return SearchResponse(provider.name, results, attempts)
        raise AllProvidersFailed(attempts)


_default_chains: dict[str, SearchChain] = {}


def search(
    query: str,
    max_results: int = 10,
    region: str = DEFAULT_REGION,
    provider: str = "auto",
    time_range: str | None = None,
) -> SearchResponse:
    """Search the web. One chain per provider mode lives for the process (so does DuckDuckGo's
    cooldown); the environment is read when a mode is first used."""
    chain = _default_chains.get(provider)
    if chain is None:
        chain = _default_chains[provider] = SearchChain.from_env(provider)
    return chain.search(query, max_results=max_results, region=region, time_range=time_range)


# --- CLI ------------------------------------------------------------------------------------------


ENV_FILE_KEYS = ("BRAVE_API_KEY", "ENLACE_DDG_URL", "ENLACE_BRAVE_URL")
ENV_LINE = re.compile(r"\s*(?:export\s+)?([A-Z_][A-Z0-9_]*)=(.*)")


def read_env_file(path: str, required: bool) -> dict[str, str]:
    """Our keys from a .env file, read the way scripts/remote.sh reads it: parsed, never sourced;
    KEY=value lines, optional `export `, quoted values kept whole, ` # comment` after bare values; other
    keys (REMOTE_*, ...) are skipped unread."""
    if not os.path.exists(path):
        if required:
            raise ConfigError(f"ENLACE_ENV_FILE={path!r}: no such file")
        return {}
    values = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            match = ENV_LINE.fullmatch(line.rstrip("\r\n"))
            if match is None or match.group(1) not in ENV_FILE_KEYS:
                continue
            value = match.group(2)
            quoted = re.fullmatch(r"\"(.*)\"\s*|'(.*)'\s*", value)
            if quoted:
                value = quoted.group(1) if quoted.group(1) is not None else quoted.group(2)
            else:
                value = re.sub(r"\s#.*", "", value).strip()
            values[match.group(1)] = value
    return values


def max_results_arg(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_RESULTS_LIMIT:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer from 1 to {MAX_RESULTS_LIMIT}")
    return int(text)


def print_response(response: SearchResponse) -> None:
    for attempt in response.attempts:
        print(f"note: {attempt.provider} failed ({attempt.error}): {attempt.message}", file=sys.stderr)
    if not response.results:
        print("No results.")
    for result in response.results:
        print(f"{result.rank:2d}. {result.title}\n    {result.url}")
        if result.snippet:
            print(f"    {result.snippet}")
        print()
    print(f"[{len(response.results)} results from {response.provider}]")


@fileio.takes_text_arguments("search.py")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Search the web: DuckDuckGo lite, then Brave as fallback.")
    parser.add_argument("query", nargs="+", help="the search terms (quote them or not)")
    parser.add_argument("-n", "--max-results", type=max_results_arg, default=10, help="1-20, default 10")
    parser.add_argument("--region", default=DEFAULT_REGION, help="DuckDuckGo kl code (default es-es)")
    parser.add_argument(
        "--provider",
        choices=PROVIDER_CHOICES,
        default="auto",
        help="default auto: ddg → brave (ddg alone without BRAVE_API_KEY)",
    )
    parser.add_argument("--time", choices=tuple(TIME_RANGES), default=None, help="only results this recent")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    try:
        named = os.environ.get("ENLACE_ENV_FILE")
        env_file = named or os.path.join(os.path.dirname(os.path.abspath(__file__)), ".env")
        env = {**read_env_file(env_file, required=bool(named)), **os.environ}  # the environment wins
        chain = SearchChain.from_env(args.provider, env=env)
        if chain.missing_fallback:
            print(f"note: {chain.describe()}", file=sys.stderr)
        response = chain.search(" ".join(args.query), args.max_results, args.region, args.time)
    except ConfigError as exc:
        print(f"search.py: error: {exc}", file=sys.stderr)
        return 2
    except AllProvidersFailed as exc:
        if args.json:
            print(
                json.dumps({"provider": None, "results": [], "attempts": [asdict(a) for a in exc.attempts]})
            )
        print(f"search.py: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(response.to_dict(), ensure_ascii=False, indent=2))
    else:
        print_response(response)
    return 0


if __name__ == "__main__":
    sys.exit(main())
