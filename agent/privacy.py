"""
What the assistant may do with a tool call, beyond its schema: secrets stay in their member's room, and the
tools that act on the family's data or send words out act only on the member's own words.

    problem = privacy.check_call(name, arguments, messages, settings, role)   # None, or a Spanish refusal
    arguments = privacy.kept_private(name, arguments, messages, settings)     # recordar of a secret: privado

Secrets are what the corpus stage's personal-data detectors find (corpus/filters.py: e-mail, public IP,
Spanish phone, DNI/NIE, IBAN) and, from agent.trust.secret_words (PIN, clave, contraseña, tarjeta...), a
text naming one of those words together with a run of digits: "el pin de la tarjeta es 4821". A value the
conversation's user turns say next to such a word is a secret wherever it appears ("busca 4821").

    buscar_web   never with a secret in its query (refused: the model reads a short note and answers
                 without searching), never a URL with credentials in it (user:password@host)
    recordar     only when the latest user turn asks to remember (agent.trust.remember_words); a secret is
                 kept "privado" whatever scope the model chose
    olvidar      only when the latest user turn asks to forget or delete (agent.trust.forget_words)

A child's web is filtered: every search goes with the providers' strictest safe search (adults': the
family's agent.trust.safe_search_adult), results from agent.trust.blocked_domains never reach a child, and
a child's search naming one is refused in one line.

A tool result (a web page) that asks to remember, forget or search is not the user's words: only the
latest user turn counts. agent/tools.py's loop applies these before running a call.
"""

import functools
import os
import re
from urllib.parse import urlsplit

import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORD = re.compile(r"\w+")
CREDENTIALS_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s/@]+@", re.I)


@functools.lru_cache(maxsize=1)
def default_trust():
    """agent.trust of configs/agent/default.yaml: what a run's agent section recorded before it existed."""
    return config.load_layer("agent", os.path.join(ROOT, "configs", "agent", "default.yaml"))["trust"]


def trust_of(settings):
    return settings.get("trust") or default_trust()


@functools.lru_cache(maxsize=1)
def detectors():
    """corpus/filters.py's personal-data checks: (kind, pattern, valid) triples."""
    from corpus import filters  # phonenumbers and stdnum: only when a call is checked

    return filters.PiiScrubber({"placeholders": dict.fromkeys(filters.PII_TYPES, "")}).checks


def words_of(text):
    return [word.lower() for word in WORD.findall(text)]


def says(text, stems):
    """Whether a word of text starts with one of stems ("olvid" matches "olvídalo" and "olvida")."""
    plain = [strip_accents(word) for word in words_of(text)]
    return any(word.startswith(strip_accents(stem)) for word in plain for stem in stems)


def strip_accents(word):
    return word.translate(str.maketrans("áéíóúü", "aeiouu"))


def secrets_in(text, trust):
    """The secret values of a text: personal data the detectors find, and the digit runs of a text that
    names a secret word."""
    found = [
        match.group()
        for _, pattern, valid in detectors()
        for match in pattern.finditer(text)
        if valid(match.group())
    ]
    words = {strip_accents(word.lower()) for word in trust["secret_words"]}
    if any(strip_accents(word) in words for word in words_of(text)):
        found += re.findall(rf"\d{{{trust['secret_min_digits']},}}", text)
    return found


def secret_in(argument, messages, trust):
    """Whether a call's text argument holds a secret: its own, or one a user turn said."""
    if secrets_in(argument, trust):
        return True
    said = [
        value
        for m in messages
        if m.get("role") == "user"
        for value in secrets_in(m.get("content") or "", trust)
    ]
    compact = re.sub(r"[\s.-]", "", argument)
    return any(re.sub(r"[\s.-]", "", value) in compact for value in said)


def latest_user_text(messages):
    return next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "user"), "")


def check_call(name, arguments, messages, settings):
    """None when the call may run, else the Spanish note the model reads instead of a result."""
    trust = trust_of(settings)
    latest = latest_user_text(messages)
    if name == "buscar_web":
        query = arguments.get("consulta")
        if isinstance(query, str) and CREDENTIALS_URL.search(query):
            return "no busco direcciones con usuario o contraseña; responde sin buscar"
        if isinstance(query, str) and secret_in(query, messages, trust):
            return "no envío datos privados (un PIN, una clave, un documento, un teléfono) a internet; responde sin buscar"
    if name == "recordar" and not says(latest, trust["remember_words"]):
        return "solo guardo un recuerdo cuando la persona lo pide con sus palabras; no lo guardes"
    if name == "olvidar" and not says(latest, trust["forget_words"]):
        return "solo borro un recuerdo cuando la persona pide olvidarlo o borrarlo; no lo borres"
    return None


def kept_private(name, arguments, messages, settings):
    """The arguments, with a recordar of a secret kept in the member's own scope (never "familia")."""
    text = arguments.get("texto")
    if name == "recordar" and isinstance(text, str) and secret_in(text, messages, trust_of(settings)):
        return {**arguments, "ambito": "privado"}
    return arguments


# -----------------------------------------------------------------------------
# A child's web


def safe_search_of(role, settings):
    return "strict" if role == "child" else trust_of(settings)["safe_search_adult"]


def host_blocked(host, blocked_domains):
    host = host.lower().rstrip(".")
    return next((d for d in blocked_domains if host == d or host.endswith("." + d)), None)


def blocked_domain_named(query, role, settings):
    """The blocked domain a child's query names ("pornhub.com", or its name "pornhub"), else None."""
    if role != "child":
        return None
    words = set(words_of(query))
    for domain in trust_of(settings)["blocked_domains"]:
        if domain in query.lower() or domain.split(".")[0] in words:
            return domain
    return None


def allowed_results(results, role, settings):
    """The results a member may see: a child none from a blocked domain (or its subdomains)."""
    if role != "child":
        return results
    blocked = trust_of(settings)["blocked_domains"]
    return [r for r in results if not host_blocked(urlsplit(r.url).hostname or "", blocked)]
