"""
The assistant's tools and the bounded tool-calling loop.

The tool registry (TOOLS) is the one place that says which tools exist: each entry is a function with its
Spanish name, description and JSON schema, registered by @tool. Adding a tool is one entry:

    @tool("fecha_hora", "Fecha y hora actuales ...", {"zona": {...}, "dias": {...}}, required=())
    def fecha_hora(arguments, context): ... return "text the model reads"

The protocol (Hermes / Qwen style, laid out by chat.render): the system turn lists the tools' schemas in
<tools>...</tools> and states the date; the model calls with

    <tool_call>
    {"name": "calculadora", "arguments": {"expresion": "2+2"}}
    </tool_call>

and every result comes back in a tool turn. run_turn() drives one answer:

    generate(conversation) -> text   (the model, or any policy; tools listed while calls are allowed)
    parse_reply(text)                 strict: the calls must be exactly the layout above, nothing after them
    check arguments against the schema, run the tool with a timeout, append the results, generate again
    ... at most max_calls_per_turn calls, then one last generation with the tools left out.

Every failure (bad JSON, unknown tool, bad arguments, timeout, a search that failed everywhere) goes back
to the model as a Spanish tool result that starts with "Error:" and says how to retry. Search results are
numbered [n]; the final answer gets a "Fuentes:" list of the URLs it cites. Each call and result goes to
on_event(kind, data) for a person to see (sample.py --chat prints them).

    python -m agent call calculadora '{"expresion": "2**10"}'      # run one tool as the model would
    python -m agent tools                                            # the tool schemas, one JSON per line

serve/app.py and sample.py use: load_settings(), Agent(settings, ...).run_turn(messages, generate) and
Agent.conversation(messages). No torch here; synthetic training data and the evaluation are in
agent/dataset.py.
"""

import argparse
import datetime
import json
import os
import re
import sys
import threading
import time
import zoneinfo
from dataclasses import dataclass, field

import jsonschema

import config
import fileio
import search
from agent import expression, grounding, privacy
from chat import visible
from family import memories

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SETTINGS = os.path.join(ROOT, "configs", "agent", "default.yaml")
RETRY_HINT = "Corrige la llamada y vuelve a intentarlo, o responde sin la herramienta."
NO_ANSWER = "Lo siento, no he podido completar la respuesta."


def load_settings(section=None, path=DEFAULT_SETTINGS):
    """The agent layer: a run's own agent section (validated when the run was loaded) or a layer file."""
    if section is not None:
        config.check_section("agent", section)
        return section
    return config.load_layer("agent", path)


# -----------------------------------------------------------------------------
# The registry


class ToolFailure(Exception):
    """A tool could not answer; the message (Spanish) goes to the model."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    properties: dict  # JSON schema of each argument
    required: tuple
    run: object  # run(arguments, context) -> str
    member_only: bool = False  # acts on a member's data: offered only when the Agent has a member

    def parameters(self, settings):
        properties = {key: dict(value) for key, value in self.properties.items()}
        if self.name == "buscar_web":  # the model is told the configured cap
            properties["max_resultados"]["maximum"] = settings["search"]["max_results"]
        return {
            "type": "object",
            "properties": properties,
            "required": list(self.required),
            "additionalProperties": False,
        }

    def spec(self, settings):
        """The OpenAI tool definition that chat.render lists in the system turn."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters(settings),
            },
        }


TOOLS = {}


def tool(name, description, properties, required=(), member_only=False):
    def register(function):
        TOOLS[name] = Tool(name, description, properties, tuple(required), function, member_only)
        return function

    return register


def default_tools(member=None):
    """Every registered tool, but those that act on a member's data only when there is a member."""
    return [name for name, entry in TOOLS.items() if member is not None or not entry.member_only]


def tool_specs(settings, names=None):
    return [TOOLS[name].spec(settings) for name in (names or default_tools())]


@dataclass
class Context:
    """What a tool may use besides its arguments. serve/app.py sets member (whose memories, say)."""

    settings: dict
    count_tokens: object  # text -> number of the model's tokens
    now: object  # () -> aware datetime
    searcher: object = None  # .search(query, max_results, region) -> search.SearchResponse
    member: object = None
    source_offset: int = 0  # search results of this turn so far: numbering goes on from here
    sources: list = field(default_factory=list)  # (n, title, url) shown to the model this turn
    question: str = ""  # the latest user turn: a calculation for a question about money is in cents


# -----------------------------------------------------------------------------
# buscar_web


@tool(
    "buscar_web",
    "Busca en internet información actual. Cita los resultados como [n].",
    {"consulta": {"type": "string"}, "max_resultados": {"type": "integer", "minimum": 1}},
    required=("consulta",),
)
def buscar_web(arguments, context):
    settings = context.settings["search"]
    if context.searcher is None:
        context.searcher = searcher_from_env(settings["provider"])
    wanted = arguments.get("max_resultados", settings["results"])
    role = getattr(context.member, "role", None)
    blocked = privacy.blocked_domain_named(arguments["consulta"], role, context.settings)
    if blocked:
        raise ToolFailure(f"{blocked} no está permitido en las cuentas infantiles")
    try:
        response = context.searcher.search(
            arguments["consulta"],
            max_results=wanted,
            region=settings["region"],
            safe_search=privacy.safe_search_of(role, context.settings),
        )
    except search.AllProvidersFailed as exc:
        failed = "; ".join(f"{a.provider}: {a.error}" for a in exc.attempts)
        raise ToolFailure(f"la búsqueda ha fallado en todos los proveedores ({failed})") from None
    except search.SearchError as exc:
        raise ToolFailure(f"la búsqueda no se pudo hacer ({exc})") from None
    return format_results(privacy.allowed_results(response.results, role, context.settings), context)


_chains = {}  # one chain per provider for the process, so DuckDuckGo's cooldown outlives a turn


def build_searcher(provider):
    """search.py's chain, configured like `python search.py` (the environment, then .env), built once
    per provider for the process; search.ConfigError when it cannot be."""
    if provider not in _chains:
        named = os.environ.get("ENLACE_ENV_FILE")
        env_file = named or os.path.join(ROOT, ".env")
        env = {**search.read_env_file(env_file, required=bool(named)), **os.environ}
        _chains[provider] = search.SearchChain.from_env(provider, env=env)
    return _chains[provider]


def searcher_from_env(provider):
    try:
        return build_searcher(provider)
    except search.ConfigError as exc:
        raise ToolFailure(f"la búsqueda no está configurada ({exc})") from None


def readiness(settings, names=None):
    """One line per tool on offer that needs more than its arguments, said when a server starts: what
    buscar_web searches with (its chain built now, so a credential is checked now), or why a tool will
    fail. The other tools need nothing outside the process."""
    lines = []
    for name in names or default_tools(member=True):
        if name == "buscar_web":
            try:
                lines.append(
                    f"buscar_web searches with {build_searcher(settings['search']['provider']).describe()}"
                )
            except search.ConfigError as exc:
                lines.append(f"buscar_web will fail every call: {exc}")
        elif name == "fecha_hora":
            try:
                zoneinfo.ZoneInfo(settings["timezone"])
            except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
                lines.append(
                    f"fecha_hora will fail without a zone: agent.timezone {settings['timezone']!r} is not in "
                    "this machine's time zone database (pip install tzdata)"
                )
    return lines


def shorten(text, limit):
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    if " " in cut[limit // 2 :]:
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip(" ,.;:") + "…"


def format_results(results, context):
    """'[n] title — url' and a snippet per result, as many whole results as fit the token budget."""
    if not results:
        return "Sin resultados"
    settings = context.settings["search"]
    budget = settings["max_tokens"]
    blocks, shown = [], []
    for offset, result in enumerate(results, start=1):
        number = context.source_offset + offset
        lines = [f"[{number}] {' '.join(result.title.split())} — {result.url}"]
        if result.snippet.strip():
            lines.append(shorten(result.snippet, settings["snippet_chars"]))
        candidate = "\n\n".join(blocks + ["\n".join(lines)])
        if blocks and context.count_tokens(candidate) > budget:
            break
        blocks.append("\n".join(lines))
        shown.append((number, result.title, result.url))
    text = "\n\n".join(blocks)
    if context.count_tokens(text) > budget:  # the first result alone is over the budget: cut it
        low, high = 0, len(text)
        while low < high:
            middle = (low + high + 1) // 2
            if context.count_tokens(text[:middle] + "…") <= budget:
                low = middle
            else:
                high = middle - 1
        text = text[:low] + "…"
    context.source_offset += len(shown)
    context.sources.extend(shown)
    return text


# -----------------------------------------------------------------------------
# calculadora


@tool(
    "calculadora",
    "Calcula una cuenta: números como 1.250,5 o 2,35; + - x : ** y paréntesis; 15%, 100 - 10%, 10% de 250; "
    "raíz(16).",
    {"expresion": {"type": "string"}},
    required=("expresion",),
)
def calculadora(arguments, context):
    limits = context.settings["calculator"]
    money = speaks_of_money(context.question, limits["money_words"])
    return expression.render(calculate(arguments["expresion"], limits), money=money)


def calculate(text, limits):
    """The value of an expression in the calculator's language (agent/expression.py); ToolFailure (one
    Spanish line) for anything it cannot compute."""
    try:
        return expression.evaluate(text, limits)
    except expression.ExpressionError as exc:
        raise ToolFailure(str(exc)) from None


def speaks_of_money(question, money_words):
    """Whether the question names money (calculator.money_words): then a result is rounded to the cent."""
    words = {grounding.plain(word) for word in re.findall(r"[^\W\d_]+|[€$£]", question)}
    return bool(words & {grounding.plain(word) for word in money_words})


# -----------------------------------------------------------------------------
# fecha_hora

WEEKDAYS = ("lunes", "martes", "miércoles", "jueves", "viernes", "sábado", "domingo")
MONTHS = "enero febrero marzo abril mayo junio julio agosto septiembre octubre noviembre diciembre".split()


def spanish_date(moment):
    return f"{WEEKDAYS[moment.weekday()]}, {moment.day} de {MONTHS[moment.month - 1]} de {moment.year}"


@tool(
    "fecha_hora",
    "Fecha y hora actuales (zona IANA opcional); 'dias' suma días a hoy, o los resta si es negativo.",
    {"zona": {"type": "string"}, "dias": {"type": "integer"}},
)
def fecha_hora(arguments, context):
    zone = arguments.get("zona", context.settings["timezone"])
    try:
        now = context.now().astimezone(zoneinfo.ZoneInfo(zone))
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a folder of tzdata, "Europe"
        raise ToolFailure(
            f"no conozco la zona horaria {echo(zone, context.settings)}; usa un nombre IANA como "
            "'Europe/Madrid'"
        ) from None
    days = arguments.get("dias")
    if days is None:
        return f"{spanish_date(now)}, {now:%H:%M} ({zone})"
    limit = context.settings["date"]["max_days"]
    if abs(days) > limit:
        raise ToolFailure(f"dias={echo(days, context.settings)} supera el máximo de {limit} días")
    target = now + datetime.timedelta(days=days)
    unit = "día" if abs(days) == 1 else "días"
    when = f"dentro de {days} {unit}" if days >= 0 else f"hace {-days} {unit}"
    return f"hoy es {spanish_date(now)}; {when}: {spanish_date(target)}"


def system_text(settings, now, base=None):
    """The system turn's text: the configured prompt (or base) and today's date in the family's zone."""
    today = now.astimezone(zoneinfo.ZoneInfo(settings["timezone"]))
    return f"{base or settings['system_prompt']}\nHoy es {spanish_date(today)}."


# -----------------------------------------------------------------------------
# The strict call parser

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
NAME_IN_TEXT = re.compile(r'"name"\s*:\s*"([^"\\]{1,64})"')


@dataclass
class Call:
    name: str
    arguments: dict
    error: str | None = None  # why the text of this call is not a valid call (Spanish)
    raw: str = ""


@dataclass
class Reply:
    content: str
    calls: list


def parse_reply(text):
    """Split a generated reply into its text and its calls. A call is exactly <tool_call>, a JSON object
    {"name": str, "arguments": object}, </tool_call>; the calls come after the text, one per line, and
    nothing follows the last one. A broken call becomes a Call with error set (never silently dropped)."""
    start = text.find(CALL_OPEN)
    if start < 0:
        if CALL_CLOSE in text:
            return Reply(
                text[: text.index(CALL_CLOSE)].rstrip(), [broken("", f"{CALL_CLOSE} sin {CALL_OPEN}")]
            )
        return Reply(text.strip(), [])
    content, rest, calls = text[:start].strip(), text[start:], []
    while rest:
        if not rest.startswith(CALL_OPEN):
            calls.append(broken(rest, f"texto después de {CALL_CLOSE}; la respuesta acaba con las llamadas"))
            break
        end = rest.find(CALL_CLOSE)
        if end < 0:
            calls.append(broken(rest, f"falta {CALL_CLOSE}"))
            break
        body = rest[len(CALL_OPEN) : end]
        calls.append(parse_call(body))
        rest = rest[end + len(CALL_CLOSE) :].lstrip("\n").rstrip()
    return Reply(content, calls)


def visible_text(partial):
    """What of a reply still being generated may be shown to a person (chat/visible.py decides): the text
    before its first call or anything else of the protocol, holding back an ending that could become one."""
    return visible.shown(partial, final=False)


def broken(raw, why):
    match = NAME_IN_TEXT.search(raw)
    return Call(match.group(1) if match else "", {}, f"llamada mal formada: {why}", raw)


def parse_call(body):
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return broken(body, f"no es JSON válido ({exc.msg}, carácter {exc.pos})")
    except RecursionError:  # json's C scanner recurses once per level of nesting
        return broken(body, "el JSON anida demasiados niveles")
    except ValueError:  # an integer past Python's digit limit (sys.get_int_max_str_digits)
        return broken(body, "un número del JSON tiene demasiadas cifras")
    if not isinstance(value, dict):
        return broken(body, f'se esperaba un objeto con "name" y "arguments", llegó {type(value).__name__}')
    if set(value) != {"name", "arguments"}:
        missing = [f'"{key}"' for key in ("name", "arguments") if key not in value]
        extra = len(set(value) - {"name", "arguments"})
        why = (f"falta {' y '.join(missing)}" if missing else "") + (" y " if missing and extra else "")
        why += f"sobran {extra} claves" if extra > 1 else "sobra 1 clave" if extra else ""
        return broken(body, f'se esperaba un objeto con "name" y "arguments": {why}')
    if not isinstance(value["name"], str) or not value["name"]:
        return broken(body, '"name" debe ser el nombre de una herramienta')
    if not isinstance(value["arguments"], dict):
        return Call(value["name"], {}, 'llamada mal formada: "arguments" debe ser un objeto JSON', body)
    return Call(value["name"], value["arguments"], raw=body)


# -----------------------------------------------------------------------------
# Running a call


@dataclass
class ToolResult:
    name: str
    arguments: dict
    text: str  # what the model reads
    ok: bool
    seconds: float = 0.0


def normalised(tool_entry, arguments):
    """The arguments as a tool reads them best: a whole float where the schema says integer (JSON Schema
    takes 1.0 as an integer; fecha_hora would answer "dentro de 1.0 días") is an int, and a string has no
    surrounding spaces."""
    properties, fixed = tool_entry.properties, dict(arguments)
    for key, value in arguments.items():
        kind = properties.get(key, {}).get("type")
        if kind == "integer" and isinstance(value, float) and value.is_integer():
            fixed[key] = int(value)
        elif kind == "string" and isinstance(value, str):
            fixed[key] = value.strip()
    return fixed


def argument_problem(tool_entry, arguments, settings):
    validator = jsonschema.Draft202012Validator(tool_entry.parameters(settings))
    errors = sorted(validator.iter_errors(arguments), key=lambda e: list(map(str, e.path)))
    if not errors:
        return None
    error = errors[0]
    where = echo(".".join(map(str, error.absolute_path)), settings)
    if error.validator == "required":
        return f"falta el argumento obligatorio {error.message.split(chr(39))[1]!r}"
    if error.validator == "additionalProperties":
        extra = sorted(set(arguments) - set(tool_entry.properties))
        return (
            f"argumento desconocido {echo(extra, settings)[1:-1]}; admite {', '.join(tool_entry.properties)}"
        )
    if error.validator == "type":
        return f"el argumento {where} debe ser de tipo {error.validator_value}, no {echo(error.instance, settings)}"
    return f"el argumento {where} no es válido: {echo(error.message, settings)[1:-1]}"


def echo(value, settings):
    """repr(value), cut to the agent's max_echo_chars: model text quoted back in an error is never whole."""
    limit = settings["max_echo_chars"]
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit has no repr
        return f"<un número de más de {sys.get_int_max_str_digits()} cifras>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def nesting(value):
    """Levels of lists and objects in a JSON value, counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def run_with_timeout(function, seconds):
    """function() on a daemon thread; (value, None), (None, exception) or (None, TimeoutError)."""
    outcome = {}

    def target():
        try:
            outcome["value"] = function()
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            outcome["error"] = exc

    worker = threading.Thread(target=target, daemon=True, name="agent-tool")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        return None, TimeoutError()
    return outcome.get("value"), outcome.get("error")


# -----------------------------------------------------------------------------
# recordar, buscar_recuerdos, olvidar: the member's memories (family/memories.py). serve/app.py passes the member as a
# memory.Caller; the access rules live in family/memories.py.


def memory_call(context, tool_function, arguments):
    if not isinstance(context.member, memories.Caller):
        raise ToolFailure("los recuerdos solo están disponibles en el servidor de la familia")
    try:
        return context.member.run(tool_function, **arguments)
    except memories.Refusal as exc:
        raise ToolFailure(str(exc)) from None


@tool(
    "recordar",
    "Guarda un recuerdo de la persona con quien hablas, cuando te pida que recuerdes algo. Ámbito "
    "«privado» (por defecto, solo para ella) o «familia» (para todos; solo personas adultas).",
    {"texto": {"type": "string"}, "ambito": {"type": "string", "enum": ["privado", "familia"]}},
    required=("texto",),
    member_only=True,
)
def recordar(arguments, context):
    return memory_call(context, memories.recordar, arguments)


@tool(
    "buscar_recuerdos",
    "Busca en los recuerdos guardados de esta persona y de la familia.",
    {"consulta": {"type": "string"}},
    required=("consulta",),
    member_only=True,
)
def buscar_recuerdos(arguments, context):
    return memory_call(context, memories.buscar_recuerdos, arguments)


@tool(
    "olvidar",
    "Borra un recuerdo por su número (el que va entre corchetes), cuando te pidan olvidarlo.",
    {"id": {"type": "integer", "minimum": 1}},
    required=("id",),
    member_only=True,
)
def olvidar(arguments, context):
    return memory_call(context, memories.olvidar, arguments)


# -----------------------------------------------------------------------------
# Grounding: the numbers of a calculation or a date offset come from the conversation


def said_numbers(text):
    """The numbers a text says, as calculator literals without marks (grounding.number_text): digits as
    the calculator reads them ("1.250" is 1250, "2,35" is 2.35), words too ("doce", "media docena")."""
    return {grounding.number_text(value) for value in grounding.spoken_numbers(text)}


def literal_value(number):
    """A number of a call as the calculator reads it, as a literal without marks ("1.000" is "1000")."""
    try:
        return grounding.number_text(expression.read_number(number))
    except expression.ExpressionError:
        return number


def ungrounded(call, texts, settings):
    """The numbers of a calculadora expression or a fecha_hora offset that none of the texts says and
    that are not among the grounding constants (grounding.numbers, grounding.days, the day words said), in
    the call's order."""
    if call.name == "calculadora" and isinstance(call.arguments.get("expresion"), str):
        numbers = expression.NUMBER.findall(call.arguments["expresion"])
        known = settings["grounding"]["numbers"]
    elif call.name == "fecha_hora" and isinstance(call.arguments.get("dias"), int):
        words = settings["grounding"]["day_words"]  # "mañana" says 1
        told = [day for text in texts for day in grounding.asked_days(text, {}, words)]
        numbers, known = [str(abs(call.arguments["dias"]))], [0, *settings["grounding"]["days"], *told]
    else:
        return []
    said = set().union(*map(said_numbers, texts)) | {literal_value(str(n)) for n in known}
    unsaid = [number for number in numbers if literal_value(number) not in said]
    return list(dict.fromkeys(unsaid))


def grounding_hint(numbers):
    listed = " ni ".join(numbers)
    verb = "aparece" if len(numbers) == 1 else "aparecen"
    noun = "el número" if len(numbers) == 1 else "los números"
    return f"(Aviso: {noun} {listed} no {verb} en la pregunta; usa los números que ha dicho la persona.)"


# -----------------------------------------------------------------------------
# The loop


def failure(name, arguments, message, hint=RETRY_HINT):
    return ToolResult(name, arguments, f"Error: {message}. {hint}", ok=False)


class Agent:
    """One family member's tool user: holds the settings, the tools on offer and who watches the calls."""

    def __init__(
        self,
        settings,
        *,
        tools_enabled=True,
        tool_names=None,
        count_tokens=None,
        clock=None,
        searcher=None,
        on_event=None,
        member=None,
    ):
        self.settings = settings
        self.tools_enabled = tools_enabled
        self.tool_names = list(tool_names or default_tools(member))
        unknown = [name for name in self.tool_names if name not in TOOLS]
        if unknown:
            raise ValueError(f"unknown tools {unknown}; registered: {', '.join(TOOLS)}")
        # Bytes bound tokens from above for any byte-fallback tokenizer: a safe default budget count.
        self.count_tokens = count_tokens or (lambda text: len(text.encode("utf-8")))
        self.clock = clock or (lambda: datetime.datetime.now(datetime.UTC))
        self.searcher = searcher
        self.on_event = on_event or (lambda kind, data: None)
        self.member = member
        self.ungrounded = 0  # calls told that a number of theirs appears nowhere in the conversation

    def new_context(self):
        return Context(self.settings, self.count_tokens, self.clock, self.searcher, self.member)

    def conversation(self, messages, tools=True):
        """The conversation to render for the next reply: a system turn with today's date (the first
        message's text if it is a system message, else the configured prompt) and, when tools are on,
        the tools' schemas."""
        base = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
        rest = messages[1:] if base is not None else messages
        conversation = {
            "messages": [{"role": "system", "content": system_text(self.settings, self.clock(), base)}]
        }
        conversation["messages"] += rest
        if tools and self.tools_enabled:
            conversation["tools"] = tool_specs(self.settings, self.tool_names)
        return conversation

    def call(self, call, context=None):
        """Run one parsed call: check it, check its arguments, run the tool under its timeout."""
        context = context or self.new_context()
        call = self.shallow(call)
        if call.error:
            return failure(call.name or "?", call.arguments, call.error)
        if call.name not in self.tool_names:
            name = echo(call.name, self.settings)
            return failure(
                name[1:-1],
                call.arguments,
                f"no existe la herramienta {name}; hay {', '.join(self.tool_names)}",
            )
        entry = TOOLS[call.name]
        call = Call(call.name, normalised(entry, call.arguments), call.error, call.raw)
        problem = argument_problem(entry, call.arguments, self.settings)
        if problem:
            return failure(call.name, call.arguments, problem)
        timeouts = self.settings["timeouts_s"]
        seconds = timeouts.get(call.name, timeouts["default"])
        started = time.perf_counter()
        value, error = run_with_timeout(lambda: entry.run(call.arguments, context), seconds)
        elapsed = time.perf_counter() - started
        if isinstance(error, TimeoutError):
            result = failure(call.name, call.arguments, f"la herramienta no respondió en {seconds:g} s")
        elif isinstance(error, ToolFailure):
            result = failure(call.name, call.arguments, str(error))
        elif error is not None:
            result = failure(
                call.name, call.arguments, f"fallo interno de la herramienta ({type(error).__name__})"
            )
        else:
            result = ToolResult(call.name, call.arguments, value, ok=True)
        result.seconds = elapsed
        return result

    def shallow(self, call):
        """The call, or a broken one when its arguments nest deeper than max_call_depth (Python's JSON
        functions recurse per level: such a call is never rendered back into a prompt)."""
        depth = self.settings["max_call_depth"]
        if call.error is None and nesting(call.arguments) > depth:
            return Call(
                call.name, {}, f"llamada mal formada: los argumentos anidan más de {depth} niveles", call.raw
            )
        return call

    def run_turn(self, messages, generate):
        """Answer the last user message. generate(conversation) -> the model's reply text. Returns the new
        messages (assistant calls, tool results, the final assistant answer) to append to messages."""
        context = self.new_context()
        context.question = latest_question(messages)
        limit = self.settings["max_calls_per_turn"]
        new, used, hinted = [], 0, False
        while True:
            tools_on = self.tools_enabled and used < limit
            text = generate(self.conversation(messages + new, tools=tools_on))
            reply = parse_reply(text)
            if not tools_on or not reply.calls:
                if reply.calls:
                    self.on_event("dropped", {"text": text, "reason": "tools are off for the final answer"})
                answer = cite_sources(visible.shown(reply.content), context.sources) or NO_ANSWER
                self.on_event("answer", {"text": answer})
                new.append({"role": "assistant", "content": answer})
                return new
            message = {"role": "assistant", "content": visible.shown(reply.content), "tool_calls": []}
            results = []
            for call in map(self.shallow, reply.calls):
                self.on_event(
                    "call",
                    {"name": call.name, "arguments": call.arguments, "error": call.error, "raw": call.raw},
                )
                if used >= limit:
                    reached = f"se alcanzó el máximo de {limit} llamadas en esta respuesta"
                    result = failure(
                        call.name or "?", call.arguments, reached, "Responde con lo que ya sabes."
                    )
                else:
                    call, result = self.guarded(call, messages + new)
                    result = result or self.call(call, context)
                    if not hinted and result.ok:
                        hinted = self.hint_ungrounded(call, result, messages + new)
                used += 1
                self.on_event(
                    "result",
                    {"name": result.name, "text": result.text, "ok": result.ok, "seconds": result.seconds},
                )
                number = len(message["tool_calls"])
                message["tool_calls"].append(
                    {
                        "id": f"call_{len(new)}_{number}",
                        "type": "function",
                        "function": {"name": result.name, "arguments": result.arguments},
                    }
                )
                results.append(
                    {
                        "role": "tool",
                        "content": result.text,
                        "tool_call_id": f"call_{len(new)}_{number}",
                        "name": result.name,
                    }
                )
            new += [message, *results]

    def guarded(self, call, messages):
        """(the call, None), or (the call, its refusal) when agent/privacy.py refuses it: a secret to the web,
        a memory written or forgotten without the user's own words. A memory holding a secret is kept private."""
        if call.error is not None or not isinstance(call.arguments, dict):
            return call, None
        refusal = privacy.check_call(call.name, call.arguments, messages, self.settings)
        if refusal:
            self.on_event("refused", {"name": call.name, "reason": refusal})
            return call, failure(call.name, call.arguments, refusal, "Responde sin esta herramienta.")
        arguments = privacy.kept_private(call.name, call.arguments, messages, self.settings)
        return Call(call.name, arguments, call.error, call.raw), None

    def hint_ungrounded(self, call, result, messages):
        """Append the grounding hint to the result when the call uses a number the conversation never
        says; whether it did (the hint is given once a turn)."""
        if self.settings["grounding"]["mode"] == "off":
            return False
        texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
        numbers = ungrounded(call, texts, self.settings)
        if not numbers:
            return False
        result.text = f"{result.text} {grounding_hint(numbers)}"
        self.ungrounded += 1
        self.on_event("ungrounded", {"name": call.name, "numbers": numbers})
        return True


def latest_question(messages):
    users = [m["content"] for m in messages if m.get("role") == "user" and isinstance(m.get("content"), str)]
    return users[-1] if users else ""


SOURCES_HEADER = "Fuentes:"
CITATION = re.compile(r"\[(\d{1,3})\]")


def cite_sources(answer, sources):
    """The answer with its own "Fuentes:" list (if the model wrote one) replaced by the URLs of the
    results it cites as [n], or of every result shown when it cites none."""
    answer = answer.strip()
    if not sources:
        return answer
    cut = answer.find("\n" + SOURCES_HEADER)
    if cut >= 0:
        answer = answer[:cut].rstrip()
    numbers = {int(n) for n in CITATION.findall(answer)}
    cited = [source for source in sources if source[0] in numbers] or sources
    lines = [f"[{number}] {url}" for number, _, url in cited]
    return f"{answer}\n\n{SOURCES_HEADER}\n" + "\n".join(lines) if answer else ""


# -----------------------------------------------------------------------------


@fileio.takes_text_arguments("agent/tools.py")
def main(argv):
    parser = argparse.ArgumentParser(description="The assistant's tools: list them or run one.")
    parser.add_argument("--settings", default=DEFAULT_SETTINGS, help="an agent layer file")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("tools", help="print the tool schemas, one JSON per line")
    one = commands.add_parser("call", help="run one tool call")
    one.add_argument("name")
    one.add_argument("arguments", nargs="?", default="{}", help="the arguments as a JSON object")
    args = parser.parse_args(argv)
    try:
        settings = load_settings(path=args.settings)
    except config.ConfigError as exc:
        print(f"agent/tools.py: {args.settings}:\n  {exc}", file=sys.stderr)
        return 2
    if args.command == "tools":
        for spec in tool_specs(settings):
            print(json.dumps(spec, ensure_ascii=False))
        return 0
    try:
        arguments = json.loads(args.arguments)
    except ValueError as exc:
        print(f"agent/tools.py: the arguments are not JSON: {exc}", file=sys.stderr)
        return 2
    if not isinstance(arguments, dict):
        print(
            'agent/tools.py: the arguments must be a JSON object, e.g. \'{"expresion": "2+2"}\'',
            file=sys.stderr,
        )
        return 2
    result = Agent(settings).call(Call(args.name, arguments))
    print(result.text)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
