"""
Grounding: the values a tool call may copy from the conversation so far. agent/grammar.py turns them into
the grammar of a call's arguments when agent.grounding.mode is "constrained"; agent/tools.py's hint uses
the same numbers.

    found = grounding.candidates(conversation["messages"], settings)
    found.numbers   calculadora's number literals: said with digits ("1.234,5", "6,2", "15 %") or in
                    words ("doce", "media docena", "un cuarto", "dos mil"), then grounding.numbers
    found.said      the numbers said, without the constants: what a calculation starts with
    found.latest    the numbers the latest user turn says: with two or more (and grounding.said_first 2), a
                    calculation starts with two different ones ("1250 y gasté 487" computes with both)
    found.pairs, found.ordered
                    the numbers the latest turn joins with an operator word ("12 por 12": paired even when
                    others are said), and those joined by words of an operator whose order matters ("9.75
                    entre 3", "2 elevado a 16"): a calculation starting with the pair's second number
                    cannot take its first as its partner ("3/9.75", "16**2")
    found.percents  the numbers the latest user turn says only as a percentage ("el 15% de 2400", "quince por
                    ciento"): a calculation writes them with their "%" ("2400*15%"), never bare ("15*2400")
    found.days      fecha_hora's dias: whole numbers said ("dos semanas" is 14 with grounding.units), the
                    day words said ("mañana" is 1 with grounding.day_words), then grounding.days; either
                    sign may be written
    found.zones     IANA zones of the places named (grounding.places, or a tzdata city spelled out);
                    empty when none is named, and then zona is left out (the family's zone)
    found.asked_days, found.asked_zones
                    what the latest user turn asks about: days counted with their unit ("dentro de 45
                    días", "hace tres semanas") or named by a day word ("mañana"), places named; a
                    fecha_hora call must then take one of them ("¿Qué hora es en Bogotá?" is no call
                    without Bogotá's zone, "dentro de 45 días" none without 45)
    found.words     the words of the user's recent turns, the latest turn first, each in its order: what a
                    search or a memory is made of (at most grounding.max_spans contiguous spans of them)
    found.turn_ends where each turn's words end in found.words: a span never crosses one
    found.ids       the numbers the latest user turn gives right after a grounding.id_words word ("borra el
                    recuerdo 7", "el recuerdo número tres": a memory named though not shown; olvidar itself
                    refuses another member's), then the memory numbers shown ("- [12] ..." lines of the
                    system turn and tool results)

The sources are the user turns, the tool results and the system turn's memories (not its date line: "Hoy es
sábado, 5 de diciembre de 2026" would offer 5 and 2026 to every calculation), most recent first;
each kind holds at most grounding.max_candidates values, so a conversation with thousands of numbers
costs no more than one with a few. A word is letters and digits only ("tool_call", quotes, tags and
control characters never make one), so nothing copied can close a string or spell a protocol tag.
"""

import dataclasses
import functools
import re
import unicodedata
import zoneinfo
from decimal import Decimal

from agent import expression

WORD = re.compile(r"[^\W_]+(?:[.,:/'-][^\W_]+)*")
DIGITS = re.compile(r"\d+(?:[.,]\d+)*")
MEMORY_LINE = re.compile(r"^- \[(\d{1,18})\]", re.MULTILINE)  # family/memories.py's memory_line
MEMORY_TEXT = re.compile(r"^- \[\d{1,18}\] ?(.*)$", re.MULTILINE)  # the memory itself, after its number

UNITS = dict(zip("cero un uno una dos tres cuatro cinco seis siete ocho nueve".split(),
                 (0, 1, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9), strict=True))  # fmt: skip
TEENS = dict(zip(("diez once doce trece catorce quince dieciseis diecisiete dieciocho diecinueve veinte "
                  "veintiun veintiuno veintiuna veintidos veintitres veinticuatro veinticinco veintiseis "
                  "veintisiete veintiocho veintinueve").split(),
                 (*range(10, 21), 21, 21, 21, *range(22, 30)), strict=True))  # fmt: skip
TENS = dict(
    zip("treinta cuarenta cincuenta sesenta setenta ochenta noventa".split(), range(30, 100, 10), strict=True)
)
HUNDREDS = {"cien": 100, "ciento": 100, "quinientos": 500, "quinientas": 500, "setecientos": 700,
            "setecientas": 700, "novecientos": 900, "novecientas": 900}  # fmt: skip
for _word, _value in (("dos", 2), ("tres", 3), ("cuatro", 4), ("seis", 6), ("ocho", 8)):
    HUNDREDS[_word + "cientos"] = HUNDREDS[_word + "cientas"] = 100 * _value
HALF = ("medio", "media")
ARTICLES = ("un", "una", "uno")
# Words that are a number only beside another: alone, "un"/"una"/"uno" is an article or a pronoun ("una cena",
# "cada uno") and "medio"/"media"/"mitad" a noun ("la media es 5", "a medias", "la mitad") far more often
# than 1 or 0.5. "media docena", "dos y media" and "medio millón" stay numbers.
LONE_WORDS = ARTICLES + HALF + ("mitad",)


SPELLED_UNITS = "cero uno dos tres cuatro cinco seis siete ocho nueve".split()
SPELLED_TEENS = ("diez once doce trece catorce quince dieciséis diecisiete dieciocho diecinueve veinte veintiuno "
                 "veintidós veintitrés veinticuatro veinticinco veintiséis veintisiete veintiocho veintinueve").split()  # fmt: skip
SPELLED_HUNDREDS = ("", "ciento", "doscientos", "trescientos", "cuatrocientos", "quinientos", "seiscientos",
                    "setecientos", "ochocientos", "novecientos")  # fmt: skip


def number_words(number):
    """A whole number from 0 to 999,999 in Spanish words, as read_words reads it back: 32 is 'treinta y
    dos', 2345 'dos mil trescientos cuarenta y cinco'."""
    if number >= 1000:
        thousands, rest = divmod(number, 1000)
        head = number_words(thousands)
        if thousands % 10 == 1 and thousands % 100 != 11:  # "veintiún mil", "treinta y un mil"
            head = head[:-1].replace("veintiun", "veintiún")
        head = "mil" if thousands == 1 else f"{head} mil"
        return head if rest == 0 else f"{head} {number_words(rest)}"
    if number >= 100:
        hundreds, rest = divmod(number, 100)
        if rest == 0:
            return "cien" if hundreds == 1 else SPELLED_HUNDREDS[hundreds]
        return f"{SPELLED_HUNDREDS[hundreds]} {number_words(rest)}"
    if number >= 30:
        tens, unit = divmod(number, 10)
        name = list(TENS)[tens - 3]
        return name if unit == 0 else f"{name} y {SPELLED_UNITS[unit]}"
    return SPELLED_TEENS[number - 10] if number >= 10 else SPELLED_UNITS[number]


def plain(text):
    """Lower case without accents: 'Dieciséis' is 'dieciseis', 'Japón' is 'japon'."""
    decomposed = unicodedata.normalize("NFD", text.lower())
    return "".join(ch for ch in decomposed if unicodedata.category(ch) != "Mn")


def digit_values(number):
    """The value a number written with digits has, as the calculator reads it (agent/expression.py): "2,35"
    is 2.35, "1.250" is 1250, "1.234,5" and "1,234.5" are 1234.5, "1.000.000" is 1000000; none for marks
    that group nothing ("1.2.3")."""
    try:
        return [expression.read_number(number)]
    except expression.ExpressionError:
        return []


def read_words(words, start):
    """(value, words used) of the number spelled out in words from words[start], or (None, 0)."""
    total, current, used, last = Decimal(0), Decimal(0), 0, None
    index = start
    while index < len(words):
        word = words[index]
        following = words[index + 1] if index + 1 < len(words) else ""
        if word in UNITS and (last in (None, "hundred", "mil") or (last == "y" and UNITS[word] > 0)):
            current, last = current + UNITS[word], "unit"
        elif word in TEENS and last in (None, "hundred", "mil"):
            current, last = current + TEENS[word], "unit"
        elif word in TENS and last in (None, "hundred", "mil"):
            current, last = current + TENS[word], "tens"
        elif word in HUNDREDS and last in (None, "mil") and current % 1000 == 0:
            current, last = current + HUNDREDS[word], "hundred"
        elif word == "y" and last == "tens" and following in UNITS:
            last = "y"
        elif word == "y" and last in ("unit", "tens", "hundred") and following in HALF:
            current, last, index = current + Decimal("0.5"), "half", index + 1
        elif word in HALF and last is None:
            current, last = Decimal("0.5"), "half"
        elif word == "mitad" and last is None:
            current, last = Decimal("0.5"), "half"
        elif word == "mil" and last in (None, "unit", "tens", "hundred"):
            total, current, last = total + (current or 1) * 1000, Decimal(0), "mil"
        elif word in ("millon", "millones") and last in (None, "unit", "tens", "hundred", "half", "mil"):
            total, current, last = (total + (current or 1)) * 1000000, Decimal(0), "mil"
        elif word in ("docena", "docenas") and last in (None, "unit", "tens", "half"):
            current, last = (current or 1) * 12, "unit"
        elif word in ("cuarto", "cuartos") and last == "unit" and 0 < current < 10 and not total:
            current, last = current / 4, "half"
        elif word == "coma" and last in ("unit", "tens") and following in UNITS | TEENS:
            digits = str((UNITS | TEENS)[following])
            current, last, index = current + Decimal("0." + digits), "half", index + 1
        else:
            break
        index += 1
        used = index - start
    if used == 0 or last == "y":
        return None, 0
    return total + current, used


def said(text):
    """(values, next word, whether it is a lone word: LONE_WORDS) of each number a text says, with digits or
    in Spanish words, in the order said (see said_in)."""
    return [(values, after, lone) for values, after, lone, _, _ in said_in(plain_words(text))]


def plain_words(text):
    return [plain(word) for word in WORD.findall(text)]


def said_in(words):
    """(values, next word, lone, first word's index, index after it) of each number in these plain words: a
    number written with digits has the value the calculator reads (digit_values); lone is a LONE_WORDS word
    said alone, which spoken_numbers and joined_numbers do not count."""
    found, index = [], 0
    while index < len(words):
        word = words[index]
        if DIGITS.fullmatch(word):
            values = digit_values(word)
            scale = {"mil": 1000, "millon": 1000000, "millones": 1000000}.get(
                words[index + 1] if index + 1 < len(words) else ""
            )
            values, used = ([value * scale for value in values], 2) if scale else (values, 1)
        elif any(ch.isdigit() for ch in word):  # "12:30", "3kg": the numbers inside
            values, used = [v for number in DIGITS.findall(word) for v in digit_values(number)], 1
        else:
            value, used = read_words(words, index)
            values, used = ([value], used) if used else ([], 1)
        # "una cena", "cada uno", "la media": no number to compute with
        lone = used == 1 and word in LONE_WORDS
        index += used
        if values:
            found.append((values, words[index] if index < len(words) else "", lone, index - used, index))
    return found


# -----------------------------------------------------------------------------
# Operators from the words said

FREE_OPERATORS = ("+", "-", "*", "/", "%")  # where a turn says no operator word ("%": a percentage)
# an operator written between two numbers of the text ("125 x 48", "2^16"), or a percentage ("15 %")
SYMBOL = re.compile(r"(?<=\d)\s*(\*\*|[x×*·/÷+^−-](?=\s*\d)|%)")
SYMBOLS = {"x": "*", "×": "*", "*": "*", "·": "*", "/": "/", "÷": "/", "+": "+", "-": "-", "−": "-", "^": "**",
           "**": "**", "%": "%"}  # fmt: skip


def operator_table(operator_words):
    """{plain phrase: frozenset of operators} from grounding.operator_words (an operator -> its phrases;
    a phrase listed under several operators may mean each, one under "none" means none)."""
    table = {}
    for operator, phrases in operator_words.items():
        for phrase in phrases:
            key = " ".join(plain_words(phrase)) or phrase
            table[key] = table.get(key, frozenset()) | ({operator} if operator != "none" else frozenset())
    return table


def operator_phrases(words, table):
    """[(start, end, operators)] of the phrases of the table in these plain words, longest first, each
    word in one phrase at most."""
    longest = max((len(phrase.split()) for phrase in table), default=1)
    found, index = [], 0
    while index < len(words):
        for size in range(min(longest, len(words) - index), 0, -1):
            phrase = " ".join(words[index : index + size])
            if phrase in table:
                found.append((index, index + size, table[phrase]))
                index += size
                break
        else:
            index += 1
    return found


def said_operators(text, operator_words):
    """The calculator's operators a question allows: those of its unambiguous operator words ("entre" is
    a division) where it says any, else each of its ambiguous ones ("cada uno": a share or a price each),
    else FREE_OPERATORS. "%" (a percentage) brings "*" ("el 15% de 2400" is 2400*15%); "mod", "**" and
    "//" only where said."""
    table = operator_table(operator_words)
    said = [operators for _, _, operators in operator_phrases(plain_words(text), table) if operators]
    said += [frozenset({SYMBOLS[symbol]}) for symbol in SYMBOL.findall(text)]
    said += [frozenset({"**"})] if "^" in text else []  # "seis^dos"
    if not said:
        return FREE_OPERATORS
    sure = [operators for operators in said if len(operators) == 1]
    allowed = set().union(*(sure or said))
    if "%" in allowed:
        allowed.add("*")
    return tuple(operator for operator in (*FREE_OPERATORS, "mod", "**", "//") if operator in allowed)


ORDERED_OPERATORS = {"-", "/", "**", "//", "mod"}  # "9.75 entre 3" is 9.75/3, never 3/9.75


def joined_numbers(text, operator_words):
    """(first, second, operators) of the numbers the text joins with an operator word, as calculator
    literals: "12 por 12" joins 12 with 12 (at most three words between them, one an operator phrase)."""
    table = operator_table(operator_words)
    words = plain_words(text)
    numbers = [(values, start, end) for values, _, lone, start, end in said_in(words) if not lone]
    phrases = [
        (start, end, operators) for start, end, operators in operator_phrases(words, table) if operators
    ]
    joined = []
    for (first, _, end), (second, start, _) in zip(numbers, numbers[1:], strict=False):
        between = [operators for a, b, operators in phrases if end <= a and b <= start]
        if 0 < start - end <= 3 and between:
            joined.append((number_text(first[0]), number_text(second[0]), frozenset().union(*between)))
    return joined


def ordered_pairs(joined):
    """Of joined_numbers' pairs, those joined only by words of operators whose order matters ("9.75 entre
    3", "2 elevado a 16", "17 menos 5"): a calculation starting with the second number may not take the
    first as its partner."""
    return [(first, second) for first, second, operators in joined
            if operators <= ORDERED_OPERATORS and first != second]  # fmt: skip


def spoken_numbers(text):
    """Every value of the numbers a text says (see said), but a lone word of LONE_WORDS: an article, a
    pronoun or a noun far more often than a number (1 and 2 are among grounding.numbers anyway). The one rule
    for what a text states: the calculator's candidates, the answer's guard (agent/answers.py) and the
    evaluation's unsaid numbers (evaluation/tool_use.py) all read it here."""
    return [value for values, _, lone in said(text) if not lone for value in values]


PERCENT = re.compile(r"(\d+(?:[.,]\d+)*)\s*%")


def percent_numbers(text):
    """The numbers a text says only as a percentage ("15%", "15 %", "quince por ciento"), as calculator
    literals: a number also said otherwise ("el 12% de 12") is not among them."""
    words = plain_words(text)
    shares = [number_text(v) for match in PERCENT.finditer(text) for v in digit_values(match.group(1))]
    shares += [number_text(v) for values, _, lone, _, end in said_in(words) if not lone
               and words[end : end + 2] == ["por", "ciento"] for v in values]  # fmt: skip
    said = [number_text(value) for value in spoken_numbers(text)]
    return tuple(n for n in dict.fromkeys(shares) if said.count(n) <= shares.count(n))


def asked_days(text, units, day_words):
    """The day offsets a text asks about in so many words: a whole number before a unit ("45 días", "tres
    semanas": units) or a word that is one on its own ("mañana", "anteayer": day_words). "a las 10" is
    none: a number without its unit is not a day count."""
    units = {plain(name): days for name, days in units.items()}
    counted = [int(value) * units[after] for values, after, _ in said(text) if after in units
               for value in values if value == value.to_integral_value()]  # fmt: skip
    day_words = {plain(word): days for word, days in day_words.items()}
    return counted + [day_words[word] for word in map(plain, WORD.findall(text)) if word in day_words]


def named_ids(text, id_words):
    """The whole numbers a text says right after one of `id_words` ("recuerdo 7", "número tres")."""
    words = [plain(word) for word in WORD.findall(text)]
    naming = {plain(word) for word in id_words}
    ids = []
    for index in range(1, len(words)):
        if words[index - 1] not in naming:
            continue
        if DIGITS.fullmatch(words[index]):
            values = digit_values(words[index])
        else:
            value, used = read_words(words, index)
            values = [value] if used else []
        ids += [int(v) for v in values if v == int(v) and 0 < v < 10**18]
    return ids


def counted_days(text, units):
    """Whole numbers of days a text says: '45 días' is 45, 'dos semanas' is 14 (units: a word -> days)."""
    units = {plain(name): days for name, days in units.items()}
    return [
        int(value) * units.get(after, 1)
        for values, after, _ in said(text)  # "una semana" is 7 days
        for value in values
        if value == value.to_integral_value()
    ]


def number_text(value):
    """A Decimal as a calculator literal without exponent or trailing zeros: '1234.5', '2000'."""
    text = format(value.normalize(), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


@functools.lru_cache(maxsize=1)
def tzdata_cities():
    """'buenos aires' -> ('America/Argentina/Buenos_Aires',): the last part of each IANA zone, spelled out."""
    cities = {}
    for zone in sorted(zoneinfo.available_timezones()):
        if "/" in zone and not zone.startswith("Etc/"):
            cities.setdefault(plain(zone.rsplit("/", 1)[1].replace("_", " ")), []).append(zone)
    return {city: tuple(zones) for city, zones in cities.items()}


def named_zones(text, places):
    """The zones of the places a text names, in the order named: places maps Spanish names to zones."""
    words = [plain(word) for word in WORD.findall(text)]
    table = dict(tzdata_cities())
    table.update({plain(name): (zone,) for name, zone in places.items()})
    longest = max(len(name.split()) for name in table)
    zones = []
    for index in range(len(words)):
        for size in range(longest, 0, -1):
            name = " ".join(words[index : index + size])
            if name in table:
                zones += table[name]
                break
    return zones


# the candidates a tool's required argument takes (fecha_hora has none required: always callable)
REQUIRED = {"calculadora": "numbers", "buscar_web": "words", "recordar": "words", "buscar_recuerdos": "words",
            "olvidar": "ids"}  # fmt: skip


def callable_tool(name, found):
    """Whether a call to our tool `name` can be grounded in these Candidates: a value for each required
    argument."""
    return name not in REQUIRED or bool(getattr(found, REQUIRED[name]))


@dataclasses.dataclass(frozen=True)
class Candidates:
    numbers: tuple
    said: tuple
    latest: tuple
    days: tuple
    zones: tuple
    asked_days: tuple
    asked_zones: tuple
    words: tuple
    ids: tuple
    operators: tuple = FREE_OPERATORS
    pairs: tuple = ()
    turn_ends: tuple = ()
    percents: tuple = ()
    ordered: tuple = ()


def recent_first(values, bound):
    """The last `bound` distinct values, most recent first."""
    kept = []
    for value in reversed(values):
        if value not in kept:
            kept.append(value)
            if len(kept) == bound:
                break
    return kept


def candidates(messages, settings):
    """The Candidates of a conversation (its messages so far) under the agent layer's grounding section."""
    grounding = settings["grounding"]
    bound = grounding["max_candidates"]
    told = [
        m
        for m in messages
        if m.get("role") in ("system", "user", "tool") and isinstance(m.get("content"), str)
    ]
    told = told[-bound:]  # a value per message at least: older messages cannot be among the most recent
    users = [m["content"] for m in told if m["role"] == "user"]
    numbers, days, zones, ids = [], [], [], []
    for message in told:
        text = message["content"]
        ids += [int(number) for number in MEMORY_LINE.findall(text)]
        if message["role"] == "system":  # its memories only: not today's date nor the family's own zone
            text = "\n".join(MEMORY_TEXT.findall(text))
        else:
            zones += named_zones(text, grounding["places"])
        numbers += [number_text(value) for value in spoken_numbers(text)]
        days += counted_days(text, grounding["units"]) + asked_days(text, {}, grounding["day_words"])
    limit = settings["date"]["max_days"]
    said = recent_first(numbers, bound)
    latest_values = spoken_numbers(users[-1]) if users else []
    latest = recent_first([number_text(v) for v in latest_values], bound)
    ids += reversed(named_ids(users[-1], grounding["id_words"])) if users else []  # the first named leads
    asked = asked_days(users[-1], grounding["units"], grounding["day_words"]) if users else []
    asked_zones = named_zones(users[-1], grounding["places"]) if users else []
    joined = joined_numbers(users[-1], grounding["operator_words"]) if users else []
    numbers = said + [number_text(Decimal(str(n))) for n in grounding["numbers"]]
    days = [day for day in recent_first(days, bound) if abs(day) <= limit] + list(grounding["days"])
    words, ends = [], []
    for text in reversed(users):  # the latest turn's words first ("tiempo" asked now, "Albarracín" before)
        words += WORD.findall(text)[-(bound - len(words)) :] if len(words) < bound else []
        ends.append(len(words))
    return Candidates(
        numbers=tuple(sorted(set(numbers), key=numbers.index)),
        said=tuple(said),
        latest=tuple(latest),
        days=tuple(sorted(set(days), key=days.index)),
        zones=tuple(recent_first(zones, bound)),
        asked_days=tuple(recent_first([day for day in asked if abs(day) <= limit], bound)),
        asked_zones=tuple(recent_first(asked_zones, bound)),
        words=tuple(words),
        ids=tuple(recent_first(ids, bound)),
        operators=said_operators(users[-1], grounding["operator_words"]) if users else FREE_OPERATORS,
        pairs=tuple((first, second) for first, second, _ in joined[:bound]),
        ordered=tuple(ordered_pairs(joined)[:bound]),
        turn_ends=tuple(dict.fromkeys(ends)),
        percents=percent_numbers(users[-1]) if users else (),
    )


def is_spans(text, found, joining_words, max_spans):
    """Whether a text (a search, a memory) is what agent/grammar.py's words_rules let a grounded call write:
    at most max_spans contiguous spans of the user's words (found.words, none crossing a turn's end), each
    later span further on, a joining word left out or one added inside a span, one before the first.
    Measured on calls written freely (evaluation/tool_use.py); compared without case or accents."""
    joining = {plain(word) for word in joining_words}
    said = [plain(word) for word in found.words]
    stops = set(found.turn_ends) | {len(said)}
    wanted = [plain(word) for word in WORD.findall(text)]

    def starts(k):  # the text positions a said word may be matched at: k, or after one joining word added
        return [k] + ([k + 1] if k + 1 < len(wanted) and wanted[k] in joining else [])

    @functools.cache
    def rest(k, i, level):  # wanted[k] is said[i], in span number `level`: can the rest follow?
        if k + 1 == len(wanted):
            return True
        steps, after = [], i + 1
        while after not in stops:  # the next word, or one after joining words left out
            steps.append((after, level))
            if said[after] not in joining:
                break
            after += 1
        if level < max_spans:
            steps += [(j, level + 1) for j in range(i + 1, len(said))]  # the next span, further on
        return any(wanted[n] == said[j] and rest(n, j, span) for n in starts(k + 1) for j, span in steps)

    return bool(wanted) and any(
        wanted[k] == word and rest(k, j, 1) for k in starts(0) for j, word in enumerate(said)
    )
