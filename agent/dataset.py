"""
Teaching a model the tool protocol: seeded Spanish tool-use conversations.

    python -m agent.dataset generate data/agent [--settings configs/agent/default.yaml]
        -> data/agent/train.jsonl and data/agent/eval.jsonl (conversation JSONL, chat/template.py's format), and
           the share of held-out call arguments that training never shows

The generator writes, in the mix and with the seed of the agent layer's `synthetic` section: calculator
problems, date and time questions (in ~100 places), web searches (some with "Sin resultados", some where
every provider failed), members asking the assistant to remember something (recordar, private or for the
family), what it remembers (buscar_recuerdos) and to forget (olvidar), and questions that need no tool,
many of them with numbers and dates. The phrasings, places, people and numbers come from wide pools
(agent/phrases.py), so an argument string rarely repeats: a model has to copy it from the question.

Every tool result comes from the real tool in agent/tools.py: the calculator computes, fecha_hora reads the
conversation's clock, buscar_web formats canned search.SearchResults (or a canned AllProvidersFailed),
and the memory tools act on a real family/memories.py database built for the run, one member per conversation,
whose memories the system turn lists as the server's would (memory.context_for_turn). A share of the
other conversations is offered the member tools too, as the server offers them to every member; the rest
gets the three tools sample.py --chat offers. A conversation goes to eval.jsonl when a hash of its user
message says so: the same question never lands in both files.

evaluation/tool_use.py evaluates a run on the held-out conversations and on the hand-written set
(conversations/agent/handwritten.jsonl), which no generated conversation repeats.
"""

import argparse
import datetime
import hashlib
import json
import os
import random
import re
import sys
import tempfile
import threading
import unicodedata

import config
import fileio
import search
from agent import phrases, tools
from chat import template
from family import memories

DATE_PATTERN = re.compile(r"\d{1,2} de [a-z]+ de \d{4}")
TIME_PATTERN = re.compile(r"\d{2}:\d{2}")
MEMORY_KINDS = ("recordar", "buscar_recuerdos", "olvidar")


class CannedSearch:
    """A search provider's answer fixed in advance: the results, or every provider failing."""

    def __init__(self, results=None, failed=False):
        self.results, self.failed = results or [], failed

    def search(self, query, max_results, region, safe_search="moderate"):
        if self.failed:
            raise search.AllProvidersFailed(
                [
                    search.Attempt("ddg", "RateLimited", "HTTP 202: DuckDuckGo's rate limit", 0.4),
                    search.Attempt("brave", "TransportError", "cannot connect to api.search.brave.com", 0.1),
                ]
            )
        return search.SearchResponse("ddg", self.results[:max_results])


def random_now(rng, synthetic):
    first = datetime.date.fromisoformat(synthetic["first_day"])
    last = datetime.date.fromisoformat(synthetic["last_day"])
    day = first + datetime.timedelta(days=rng.randint(0, (last - first).days))
    seconds = rng.randint(7 * 3600, 23 * 3600)
    return datetime.datetime(day.year, day.month, day.day, tzinfo=datetime.UTC) + datetime.timedelta(
        seconds=seconds
    )


# -----------------------------------------------------------------------------
# The family's memories: a real family/memories.py database


def rough_tokens(text):
    """The server counts the served tokenizer's tokens; here, about three UTF-8 bytes to a token."""
    return len(text.encode("utf-8")) // 3 + 1


class Family:
    """The generator's memory database (family/memories.py's tables in a file of a temporary folder): each member
    conversation gets a new member, adult or (child_share) child, with a few memories of their own."""

    def __init__(self, folder, synthetic):
        self.cfg = memories.load_config()
        self.conn = memories.connect(os.path.join(folder, "family.sqlite"), self.cfg)
        self.conn.execute("PRAGMA synchronous = OFF")  # a scratch database: no fsync per memory
        self.lock, self.synthetic, self.members = threading.Lock(), synthetic, 0

    def member(self, rng, facts=()):
        """A new memory.Caller holding the facts (memory_fact dicts) and 0-5 others, a few pinned."""
        self.members += 1
        role = "child" if rng.random() < self.synthetic["child_share"] else "adult"
        caller = memories.Caller(f"miembro{self.members}", role, self.conn, self.lock, self.cfg)
        held = [phrases.memory_fact(rng) for _ in range(rng.randint(0, 5))] + list(facts)
        rng.shuffle(held)
        for fact in held:
            scope = "family" if role == "adult" and rng.random() < 0.2 else "private"
            fact["id"] = memories.add(
                self.conn, caller.name, role, fact["text"], self.cfg, scope, pinned=rng.random() < 0.15
            )
        return caller

    def block(self, caller, question):
        """The memories the server would put in the system turn for this question."""
        return memories.context_for_turn(
            self.conn, caller.name, caller.role, question, self.cfg, rough_tokens
        )


# -----------------------------------------------------------------------------
# One conversation per kind: (question, tool name or None, arguments, answer(result) -> text, searcher)


def calculator(rng, synthetic):
    question, expression, answer = phrases.calculator_case(rng, synthetic["words_share"])
    return question, "calculadora", {"expresion": expression}, lambda r: answer.replace("{r}", r.text)


def date_answer(rng, what, place, arguments, text):
    """The answer stating fecha_hora's result: the time, the date, or the day `dias` away."""
    if what == "time":
        time = TIME_PATTERN.search(text).group()
        if place:
            return f"En {place} son las {time}."
        return phrases.pick(rng, ("Son las {t}.", "Ahora son las {t}.", "Son las {t} en punto.")).format(
            t=time
        )
    if what == "date":
        day = text.split(",")[0] + ", " + DATE_PATTERN.search(text).group()
        if place:
            return f"En {place} es {day}."
        return phrases.pick(rng, ("Hoy es {d}.", "Estamos a {d}.", "Es {d}.")).format(d=day)
    days, target = arguments["dias"], text.split(": ", 1)[1]
    if days in (1, 2):
        return f"{'Mañana' if days == 1 else 'Pasado mañana'} será {target}."
    if days < 0:
        return phrases.pick(rng, ("Hace {n} días fue {t}.", "Fue el {t}.", "Hace {n} días era {t}.")).format(
            n=-days, t=target
        )
    return phrases.pick(rng, ("Dentro de {n} días será {t}.", "Será {t}.", "Caerá en {t}.")).format(
        n=days, t=target
    )


def date_and_time(rng, settings):
    words_share, units = settings["synthetic"]["words_share"], settings["grounding"]["units"]
    question, arguments, what, place = phrases.date_case(rng, words_share, units)
    return question, "fecha_hora", arguments, lambda r: date_answer(rng, what, place, arguments, r.text)


def web_search(rng, outcome):
    question, query, (title, url, snippet), answer = phrases.search_case(rng)
    if outcome == "sin_resultados":
        searcher, answer = CannedSearch([]), phrases.pick(rng, phrases.NO_RESULTS).format(q=query)
    elif outcome == "error_busqueda":
        searcher, answer = CannedSearch(failed=True), phrases.pick(rng, phrases.SEARCH_FAILED)
    else:
        other = search.SearchResult(
            f"{query.split()[-1]} - Wikipedia, la enciclopedia libre",
            f"https://es.wikipedia.org/wiki/{query.split()[-1]}",
            f"Artículo de la enciclopedia sobre {query.split()[-1]}.",
            2,
        )
        searcher = CannedSearch([search.SearchResult(title, url, snippet, 1), other])
    return question, "buscar_web", {"consulta": query}, lambda r: answer, searcher


def memory_failure(rng, result):
    why = result.text.removeprefix("Error: ").split(". ")[0]
    return phrases.pick(rng, phrases.FAILED_MEMORY).format(why=why)


def remember(rng):
    fact = phrases.memory_fact(rng)
    draw = rng.random()
    if draw < 0.3:
        question, arguments = (
            phrases.ask(rng, phrases.REMEMBER_FAMILY),
            {"texto": fact["text"], "ambito": "familia"},
        )
    elif draw < 0.4:
        question, arguments = (
            phrases.ask(rng, phrases.REMEMBER_PRIVATE),
            {"texto": fact["text"], "ambito": "privado"},
        )
    else:
        question, arguments = phrases.ask(rng, phrases.REMEMBER), {"texto": fact["text"]}
    saved = phrases.SAVED_FAMILY if arguments.get("ambito") == "familia" else phrases.SAVED

    def answer(result):
        if not result.ok:
            return memory_failure(rng, result)
        return phrases.pick(rng, saved).format(x=fact["text"])

    return question.replace("{c}", fact["clause"]), "recordar", arguments, answer, []


def recall(rng):
    fact = phrases.memory_fact(rng)
    held = [fact] if rng.random() < 0.8 else []  # else the member never told it: nothing is found
    question = phrases.ask(rng, phrases.SEARCH_MEMORY).replace("{t}", fact["topic"])

    def answer(result):
        if not result.ok:
            return memory_failure(rng, result)
        if not result.text.startswith("- ["):
            return phrases.pick(rng, phrases.NOT_FOUND).format(t=fact["topic"])
        first = result.text.split("\n")[0].split("] ", 1)[1].removeprefix("(familia) ")
        said = (
            first[0].lower() + first[1:]
            if first.split()[0] in ("El", "La", "Los", "Las", "Mi", "A")
            else first
        )
        return phrases.pick(rng, phrases.FOUND).format(x=first, y=said)

    return question, "buscar_recuerdos", {"consulta": fact["query"]}, answer, held


def forget(rng):
    """(question with {n} for a memory's number if it names one, "olvidar", arguments to fill, answer, the
    memory to forget)."""
    fact = phrases.memory_fact(rng)
    templates = phrases.FORGET_NUMBER if rng.random() < 0.35 else phrases.FORGET
    question = phrases.ask(rng, templates).replace("{t}", fact["topic"])

    def answer(result):
        if not result.ok:
            return memory_failure(rng, result)
        return phrases.pick(rng, phrases.FORGOTTEN).format(n=fact["id"], x=fact["text"])

    return question, "olvidar", {}, answer, [fact]


def one_conversation(rng, kind, settings, family):
    """A conversation of the given kind, built the way the server's agent turn builds it."""
    synthetic = settings["synthetic"]
    now = random_now(rng, synthetic)
    searcher, held, caller = None, [], None
    if kind == "calculadora":
        question, name, arguments, answer = calculator(rng, synthetic)
    elif kind == "fecha_hora":
        question, name, arguments, answer = date_and_time(rng, settings)
    elif kind in ("buscar_web", "sin_resultados", "error_busqueda"):
        question, name, arguments, answer, searcher = web_search(rng, kind)
    elif kind in MEMORY_KINDS:
        question, name, arguments, answer, held = {"recordar": remember, "buscar_recuerdos": recall,
                                                   "olvidar": forget}[kind](rng)  # fmt: skip
    else:
        question, text = phrases.no_tool_case(rng)
        name, answer = None, lambda result: text
    if kind in MEMORY_KINDS or rng.random() < synthetic["member_share"]:
        caller = family.member(rng, held)
    if kind == "olvidar":  # by its number: said in the question, or read in the memories listed
        number = str(held[0]["id"])
        if "{n}" not in question and f"[{number}]" not in family.block(caller, question):
            question = phrases.ask(rng, phrases.FORGET_NUMBER)
        question, arguments = question.replace("{n}", number), {"id": held[0]["id"]}
    block = family.block(caller, question) if caller else ""
    base = "\n\n".join((settings["system_prompt"], block)) if block else None
    helper = tools.Agent(settings, clock=lambda: now, searcher=searcher, member=caller)
    messages = ([{"role": "system", "content": base}] if base else []) + [
        {"role": "user", "content": question}
    ]
    if name is None:
        reply = answer(None)
    else:
        context = helper.new_context()
        context.question = question  # a question about money gets its result in cents
        result = helper.call(tools.Call(name, arguments), context)
        reply = tools.cite_sources(answer(result), context.sources)
        call = {"id": "call_0_0", "type": "function", "function": {"name": name, "arguments": arguments}}
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": result.text, "tool_call_id": "call_0_0", "name": name},
        ]
    messages.append({"role": "assistant", "content": reply})
    conversation = helper.conversation(messages)
    conversation["source"] = f"agent/dataset.py {kind} seed={synthetic['seed']}"
    return conversation


def generate(settings):
    """(train, eval) conversation lists, split by a hash of the call's tool and values (of the question
    when the call has none, or there is no call), so that neither a question nor a (tool, values) pair is
    in both: a held-out call's values are never trained on. Eval keeps each question once."""
    synthetic = settings["synthetic"]
    rng = random.Random(synthetic["seed"])
    kinds, weights = zip(*synthetic["mix"].items(), strict=True)
    train, held_out, asked = [], [], set()
    with tempfile.TemporaryDirectory(prefix="agent-data-") as folder:
        family = Family(folder, synthetic)
        for _ in range(synthetic["conversations"]):
            conversation = one_conversation(rng, rng.choices(kinds, weights)[0], settings, family)
            template.check_conversation(conversation, training=True)
            question = user_question(conversation)
            key = call_key(conversation) or question
            bucket = int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:8], 16) / 16**8
            if bucket >= synthetic["eval_fraction"]:
                train.append(conversation)
            elif question not in asked:
                asked.add(question)
                held_out.append(conversation)
        family.conn.close()
    return train, held_out


def call_key(conversation):
    """'tool {values}' of the conversation's call, or None without a call or without values."""
    for message in conversation["messages"]:
        for call in message.get("tool_calls", []):
            arguments = template.arguments_of(call)
            if not arguments:
                return None
            return call["function"]["name"] + " " + json.dumps(arguments, ensure_ascii=False, sort_keys=True)
    return None


def user_question(conversation):
    return next(m["content"] for m in conversation["messages"] if m["role"] == "user")


def call_arguments(conversation):
    """The arguments of the conversation's call as one canonical string, or None without a call."""
    for message in conversation["messages"]:
        for call in message.get("tool_calls", []):
            return json.dumps(template.arguments_of(call), ensure_ascii=False, sort_keys=True)
    return None


def unseen_share(train, held_out):
    """(held-out calls, the share of them whose arguments no training call has)."""
    seen = {call_arguments(c) for c in train} - {None}
    calls = [arguments for arguments in map(call_arguments, held_out) if arguments is not None]
    return len(calls), sum(arguments not in seen for arguments in calls) / max(1, len(calls))


PIECE = re.compile(r"\d+(?:[.,]\d+)?|[^\W\d_]+")


def pieces(text):
    """The numbers (decimal comma as point) and words of a text, lower case and without accents."""
    plain = "".join(
        c for c in unicodedata.normalize("NFD", str(text).lower()) if unicodedata.category(c) != "Mn"
    )
    return [piece.replace(",", ".") for piece in PIECE.findall(plain)]


def copied(value, prompt):
    """Whether an argument value is a copy of the prompt: every number and word of it (an int's digits,
    without its sign) is in the prompt, in the canonical form the tool accepts ("2,35" is "2.35")."""
    held = set(pieces(prompt))
    return all(piece in held for piece in pieces(abs(value) if isinstance(value, int) else value))


def copy_shares(conversations):
    """{tool: (arguments, the share copied from the prompt: the user's question and the system turn,
    where the member's memories are listed with their numbers)}, and "all" over every tool."""
    tally = {}
    for conversation in conversations:
        messages = conversation["messages"]
        prompt = "\n".join(m["content"] for m in messages if m["role"] in ("system", "user"))
        for message in messages:
            for call in message.get("tool_calls", [])[:1]:
                name = call["function"]["name"]
                for value in template.arguments_of(call).values():
                    for key in (name, "all"):
                        count, hits = tally.get(key, (0, 0))
                        tally[key] = (count + 1, hits + copied(value, prompt))
    return {key: (count, hits / count) for key, (count, hits) in sorted(tally.items())}


def write_jsonl(path, conversations):
    text = "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations)
    fileio.write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@fileio.reports_storage_errors
def main(argv):
    parser = argparse.ArgumentParser(description="Tool-use conversations for training and evaluation.")
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("generate", help="write OUT/train.jsonl and OUT/eval.jsonl")
    make.add_argument("out")
    make.add_argument("--settings", default=tools.DEFAULT_SETTINGS, help="an agent layer file")
    args = parser.parse_args(argv)
    try:
        settings = tools.load_settings(path=args.settings)
    except config.ConfigError as exc:
        print(f"agent/dataset.py: {exc}", file=sys.stderr)
        return 2
    train, held_out = generate(settings)
    write_jsonl(os.path.join(args.out, "train.jsonl"), train)
    write_jsonl(os.path.join(args.out, "eval.jsonl"), held_out)
    calls, unseen = unseen_share(train, held_out)
    print(
        f"{args.out}: {len(train)} train and {len(held_out)} eval conversations; the arguments of "
        f"{100 * unseen:.1f}% of the {calls} held-out calls appear in no training call"
    )
    shares = copy_shares(held_out)
    count, share = shares.pop("all", (0, 0.0))
    per_tool = ", ".join(f"{name} {100 * part:.0f}% of {n}" for name, (n, part) in shares.items())
    print(f"{100 * share:.1f}% of the {count} held-out arguments are spans of their prompt ({per_tool})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
