"""
Teaching a model the tool protocol: seeded Spanish tool-use conversations, and how well a run uses tools.

    python agent_data.py generate data/agent [--settings configs/agent/default.yaml]
        -> data/agent/train.jsonl and data/agent/eval.jsonl (conversation JSONL, chat.py's format)

The generator writes calculator word problems, date questions, web searches with canned results (some
with "Sin resultados", some where every provider failed) and conversations that need no tool, in the
mix and with the seed of the agent layer's `synthetic` section. Every tool result is produced by the
real tool in agent.py (the calculator computes, fecha_hora reads a fixed clock, buscar_web formats
canned search.SearchResults or a canned AllProvidersFailed), so the data shows exactly what the loop
shows a model. A conversation goes to eval.jsonl when a hash of its user message says so: the same
question never lands in both files.

agent_eval.py evaluates a run on the held-out conversations.
"""

import argparse
import datetime
import hashlib
import json
import os
import random
import re
import sys

import agent
import chat
import config
import fileio
import search

CITIES = {
    "Madrid": "Europe/Madrid",
    "Ciudad de México": "America/Mexico_City",
    "Buenos Aires": "America/Argentina/Buenos_Aires",
    "Bogotá": "America/Bogota",
    "Lima": "America/Lima",
    "Santiago de Chile": "America/Santiago",
    "Nueva York": "America/New_York",
    "Londres": "Europe/London",
    "Tokio": "Asia/Tokyo",
    "Canarias": "Atlantic/Canary",
    "Caracas": "America/Caracas",
    "Montevideo": "America/Montevideo",
}
TOWNS = (
    "Sevilla Valencia Zaragoza Bilbao Málaga Granada Salamanca Oviedo Murcia Cádiz Vigo Toledo Burgos León "
    "Santander Pamplona Logroño Almería Huelva Cuenca Soria Teruel Girona Lugo Ourense Cáceres Badajoz Ávila"
).split()
FRUITS = "manzanas naranjas peras plátanos tomates patatas fresas uvas".split()


def price(rng):
    """A price in euros as (Spanish text, Python expression text)."""
    cents = rng.choice((0, 0, 50, 25, 75, 20, 90))
    whole = rng.randint(1, 9)
    if cents == 0:
        return str(whole), str(whole)
    return f"{whole},{cents:02d}".rstrip("0"), f"{whole}.{cents:02d}".rstrip("0")


def calculator_case(rng):
    """(question, expression, answer with {r} for the result)."""
    a, b, n = rng.randint(2, 60), rng.randint(2, 40), rng.randint(2, 9)
    kind = rng.randrange(10)
    if kind == 0:
        text, expr = price(rng)
        fruit = rng.choice(FRUITS)
        return (
            f"Si compro {n} kilos de {fruit} a {text} euros el kilo, ¿cuánto pago?",
            f"{n}*{expr}",
            "Pagas {r} euros.",
        )
    if kind == 1:
        total = a + b * 3
        return f"Tengo {total} euros y gasto {b}. ¿Cuánto me queda?", f"{total}-{b}", "Te quedan {r} euros."
    if kind == 2:
        bill = n * rng.randint(8, 40)
        return (
            f"Somos {n} personas y la cuenta de la cena es de {bill} euros. ¿Cuánto paga cada uno?",
            f"{bill}/{n}",
            "Cada uno paga {r} euros.",
        )
    if kind == 3:
        percent = rng.choice((5, 10, 15, 20, 21, 25, 30, 50))
        amount = rng.randint(2, 90) * 10
        return (
            f"¿Cuánto es el {percent} % de {amount}?",
            f"{amount}*{percent}/100",
            f"El {percent} % de {amount} es {{r}}.",
        )
    if kind == 4:
        return f"¿Cuánto es {a} por {b}?", f"{a}*{b}", f"{a} por {b} son {{r}}."
    if kind == 5:
        c = rng.randint(2, 9)
        return f"Calcula {a} + {b} × {c}", f"{a}+{b}*{c}", "El resultado es {r}."
    if kind == 6:
        speed = rng.randint(6, 12) * 10
        return (
            f"Un coche va a {speed} km por hora. ¿Cuántos kilómetros recorre en {n} horas?",
            f"{speed}*{n}",
            "Recorre {r} kilómetros.",
        )
    if kind == 7:
        return (
            f"Cada caja trae {b} huevos y tengo {n} cajas. ¿Cuántos huevos tengo?",
            f"{b}*{n}",
            "Tienes {r} huevos.",
        )
    if kind == 8:
        base, power = rng.randint(2, 9), rng.randint(2, 6)
        return (
            f"¿Cuánto es {base} elevado a {power}?",
            f"{base}**{power}",
            f"{base} elevado a {power} es {{r}}.",
        )
    sweets = n * rng.randint(2, 12)
    return (
        f"Mi hija quiere repartir {sweets} caramelos entre {n} amigos. ¿Cuántos le tocan a cada uno?",
        f"{sweets}/{n}",
        "A cada uno le tocan {r} caramelos.",
    )


DATE_PATTERN = re.compile(r"\d{1,2} de [a-z]+ de \d{4}")
TIME_PATTERN = re.compile(r"\d{2}:\d{2}")


def date_case(rng):
    """(question, arguments, answer built from the result text)."""
    kind = rng.randrange(5)
    if kind == 0:
        question = rng.choice(("¿Qué día es hoy?", "¿A qué fecha estamos?", "Dime la fecha de hoy."))
        return question, {}, lambda result: f"Hoy es {result.rsplit(',', 1)[0]}."
    if kind == 1:
        question = rng.choice(("¿Qué hora es?", "¿Me dices la hora?", "¿Qué hora es ahora?"))
        return question, {}, lambda result: f"Son las {TIME_PATTERN.search(result).group()}."
    if kind == 2:
        city = rng.choice(list(CITIES))
        return (
            f"¿Qué hora es en {city}?",
            {"zona": CITIES[city]},
            lambda result: f"En {city} son las {TIME_PATTERN.search(result).group()}.",
        )
    days = rng.randint(2, 400)
    if kind == 3:
        question = rng.choice(("¿Qué día cae dentro de {n} días?", "¿Qué fecha será dentro de {n} días?"))
        return (
            question.format(n=days),
            {"dias": days},
            lambda r: f"Dentro de {days} días será {r.split(': ')[1]}.",
        )
    return (
        f"¿Qué día fue hace {days} días?",
        {"dias": -days},
        lambda r: f"Hace {days} días fue {r.split(': ')[1]}.",
    )


SEARCH_TOPICS = (
    (
        "¿Qué tiempo hará mañana en {town}?",
        "tiempo mañana {town}",
        "Previsión del tiempo en {town}",
        "www.eltiempo.es/{slug}.html",
        "Mañana en {town}: {sky}, con máximas de {t} grados y mínimas de {low}.",
        "Según [1], mañana en {town} habrá {sky} y máximas de {t} grados.",
    ),
    (
        "Busca el horario de la biblioteca municipal de {town}",
        "horario biblioteca municipal {town}",
        "Biblioteca municipal de {town} - Horarios",
        "www.{slug}.es/biblioteca",
        "Abre de lunes a viernes de {h1}:00 a {h2}:00 y los sábados por la mañana.",
        "Según [1], la biblioteca abre de lunes a viernes de {h1}:00 a {h2}:00 y los sábados por la mañana.",
    ),
    (
        "¿Hay alguna farmacia de guardia hoy en {town}?",
        "farmacia de guardia hoy {town}",
        "Farmacias de guardia en {town} hoy",
        "www.cofguardia.es/{slug}",
        "Hoy está de guardia la farmacia de la calle Mayor, {n}, abierta las 24 horas.",
        "Según [1], hoy está de guardia la farmacia de la calle Mayor, {n}, abierta las 24 horas.",
    ),
    (
        "Busca en internet cuándo es la fiesta mayor de {town}",
        "fiesta mayor {town} fechas",
        "Fiestas de {town}: programa y fechas",
        "www.turismo{slug}.es/fiestas",
        "Las fiestas de {town} se celebran del {d1} al {d2} de {month}, con conciertos y fuegos.",
        "Según [1], las fiestas de {town} son del {d1} al {d2} de {month}.",
    ),
    (
        "¿Puedes mirar el precio de la entrada del museo de {town}?",
        "precio entrada museo {town}",
        "Museo de {town}: tarifas",
        "www.museo{slug}.es/visita",
        "Entrada general: {t} euros. Menores de 12 años y mayores de 65, gratis.",
        "Según [1], la entrada general cuesta {t} euros y es gratis para menores de 12 y mayores de 65.",
    ),
)
SKIES = ("cielo despejado", "nubes y claros", "lluvia débil", "tormentas por la tarde", "niebla matinal")
MONTHS_WORDS = ("junio", "julio", "agosto", "septiembre")
NO_RESULTS = "No he encontrado resultados sobre «{q}». ¿Quieres que lo busque de otra forma?"
SEARCH_FAILED = (
    "No he podido buscar ahora mismo porque la búsqueda ha fallado. Inténtalo de nuevo en un rato."
)


def slug(text):
    table = str.maketrans("áéíóúñ ", "aeioun-")
    return text.lower().translate(table)


def search_case(rng):
    """(question, query, canned results, answer with the [n] citation)."""
    question, query, title, url, snippet, answer = rng.choice(SEARCH_TOPICS)
    values = {
        "town": rng.choice(TOWNS),
        "sky": rng.choice(SKIES),
        "t": rng.randint(8, 36),
        "low": rng.randint(0, 7),
        "h1": rng.randint(8, 10),
        "h2": rng.randint(18, 21),
        "n": rng.randint(2, 90),
        "d1": rng.randint(1, 14),
        "d2": rng.randint(15, 28),
        "month": rng.choice(MONTHS_WORDS),
    }
    values["slug"] = slug(values["town"])
    first = search.SearchResult(
        title.format(**values), "https://" + url.format(**values), snippet.format(**values), 1
    )
    other = search.SearchResult(
        f"{values['town']} - Wikipedia, la enciclopedia libre",
        f"https://es.wikipedia.org/wiki/{values['town'].replace(' ', '_')}",
        f"{values['town']} es un municipio de España.",
        2,
    )
    return question.format(**values), query.format(**values), [first, other], answer.format(**values)


NO_TOOL = (
    ("Hola", "¡Hola! ¿En qué puedo ayudarte?"),
    ("Hola, {name} aquí", "¡Hola! ¿En qué te ayudo hoy?"),
    ("Buenos días", "¡Buenos días! ¿Qué necesitas?"),
    ("Buenas noches", "¡Buenas noches! Que descanses."),
    ("Gracias por la ayuda", "¡De nada! Aquí estoy para lo que necesites."),
    (
        "¿Quién eres?",
        "Soy ENLACE, el asistente de la familia. Puedo calcular, decirte la fecha y buscar en internet.",
    ),
    (
        "¿Qué sabes hacer?",
        "Puedo responder preguntas, hacer cuentas, decirte la fecha y la hora y buscar en internet.",
    ),
    ("¿Cómo se dice {word} en inglés?", "{word} en inglés se dice «{english}»."),
    ("Traduce «{word}» al inglés", "«{word}» en inglés es «{english}»."),
    (
        "Dame una idea para cenar con {food}",
        "Puedes preparar {food} a la plancha con una ensalada. Es rápido y ligero.",
    ),
    (
        "¿Qué puedo hacer de comer con {food}?",
        "Con {food} puedes hacer un guiso sencillo con cebolla, ajo y un poco de arroz.",
    ),
    ("Escribe una frase para felicitar a {name}", "¡Feliz cumpleaños, {name}! Que pases un día estupendo."),
    (
        "Ayúdame a decir que llegaré tarde a {name}",
        "Puedes escribir: «{name}, llegaré un poco tarde. Lo siento, voy en camino».",
    ),
    (
        "Escribe un mensaje para dar las gracias a {name}",
        "«Muchas gracias, {name}, por tu ayuda. Te lo agradezco de corazón».",
    ),
    (
        "¿Qué es un verbo?",
        "Un verbo es la palabra que dice lo que alguien hace o lo que pasa, como «correr» o «llover».",
    ),
    ("¿Qué es un {thing}?", "{thing_answer}"),
    ("Cuéntame un chiste corto", "¿Qué le dice un jaguar a otro? ¡Jaguar you!"),
    (
        "Cuéntame un cuento corto sobre {animal_a}",
        "Había una vez {animal_a} que quería ver el mar. Caminó muchos días y, al llegar, sonrió feliz.",
    ),
    ("¿De qué color es el cielo?", "De día, cuando está despejado, el cielo es azul."),
    ("¿Cuántos días tiene una semana?", "Una semana tiene siete días."),
    ("¿Cuántas patas tiene {animal_a}?", "{legs}"),
    (
        "Dame un consejo para dormir mejor",
        "Intenta acostarte siempre a la misma hora y deja el móvil un rato antes.",
    ),
    (
        "¿Qué juego puedo hacer con {name}?",
        "Podéis jugar al veo veo: uno elige algo que ve y el otro lo adivina con pistas.",
    ),
    ("Dime una palabra que rime con {rhyme}", "{rhyme_answer}"),
    (
        "Haz una lista de la compra para una tortilla",
        "Para una tortilla: huevos, patatas, cebolla, aceite de oliva y sal.",
    ),
    ("¿Cómo se escribe «{spell}», con b o con v?", "Se escribe «{spell}»."),
)
THINGS = {
    "sustantivo": "Un sustantivo es la palabra que nombra personas, animales, cosas o ideas: «mesa», «perro».",
    "adjetivo": "Un adjetivo es la palabra que dice cómo es algo: «grande», «rojo», «simpático».",
    "mamífero": "Un mamífero es un animal que alimenta a sus crías con leche, como la vaca o el delfín.",
    "volcán": "Un volcán es una montaña por la que sale lava, ceniza y gases del interior de la Tierra.",
    "planeta": "Un planeta es un cuerpo grande que gira alrededor de una estrella, como la Tierra alrededor del Sol.",
}
ANIMALS = {
    "un gato": "Un gato tiene cuatro patas.",
    "una araña": "Una araña tiene ocho patas.",
    "una gallina": "Una gallina tiene dos patas.",
    "una hormiga": "Una hormiga tiene seis patas.",
    "un perro": "Un perro tiene cuatro patas.",
}
RHYMES = {
    "casa": "«Masa» rima con «casa».",
    "sol": "«Col» rima con «sol».",
    "luna": "«Cuna» rima con «luna».",
    "flor": "«Amor» rima con «flor».",
    "mar": "«Cantar» rima con «mar».",
}
SPELLING = ("vaca", "barco", "volar", "bebé", "nube", "verde", "bosque", "viento")
WORDS = {
    "gato": "cat",
    "perro": "dog",
    "casa": "house",
    "libro": "book",
    "agua": "water",
    "manzana": "apple",
    "escuela": "school",
    "árbol": "tree",
    "coche": "car",
    "pájaro": "bird",
    "leche": "milk",
    "pan": "bread",
}
FOODS = (
    "pollo",
    "merluza",
    "tofu",
    "huevos",
    "verduras",
    "salmón",
    "lentejas",
    "garbanzos",
    "pasta",
    "arroz",
)
NAMES = (
    "Lucía",
    "Mateo",
    "la abuela",
    "Pablo",
    "Carmen",
    "tu primo",
    "Sofía",
    "Diego",
    "el abuelo",
    "Valeria",
)


def no_tool_case(rng):
    question, answer = rng.choice(NO_TOOL)
    word = rng.choice(list(WORDS))
    thing, animal, rhyme = rng.choice(list(THINGS)), rng.choice(list(ANIMALS)), rng.choice(list(RHYMES))
    values = {
        "word": word,
        "english": WORDS[word],
        "food": rng.choice(FOODS),
        "name": rng.choice(NAMES),
        "thing": thing,
        "thing_answer": THINGS[thing],
        "animal_a": animal,
        "legs": ANIMALS[animal],
        "rhyme": rhyme,
        "rhyme_answer": RHYMES[rhyme],
        "spell": rng.choice(SPELLING),
    }
    return question.format(**values), answer.format(**values)


class CannedSearch:
    """A search provider's answer fixed in advance: the results, or every provider failing."""

    def __init__(self, results=None, failed=False):
        self.results, self.failed = results or [], failed

    def search(self, query, max_results, region):
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


def one_conversation(rng, kind, settings):
    """A conversation of the given kind, built the way Agent.run_turn would build it."""
    now = random_now(rng, settings["synthetic"])
    searcher = None
    if kind == "calculadora":
        question, expression, answer = calculator_case(rng)
        name, arguments = "calculadora", {"expresion": expression}
    elif kind == "fecha_hora":
        question, arguments, answer = date_case(rng)
        name = "fecha_hora"
    elif kind in ("buscar_web", "sin_resultados", "error_busqueda"):
        question, query, results, answer = search_case(rng)
        name, arguments = "buscar_web", {"consulta": query}
        if kind == "sin_resultados":
            searcher, answer = CannedSearch([]), NO_RESULTS.format(q=query)
        elif kind == "error_busqueda":
            searcher, answer = CannedSearch(failed=True), SEARCH_FAILED
        else:
            searcher = CannedSearch(results)
    else:
        question, answer = no_tool_case(rng)
        name = None
    helper = agent.Agent(settings, clock=lambda: now, searcher=searcher)
    messages = [{"role": "user", "content": question}]
    if name is not None:
        context = helper.new_context()
        result = helper.call(agent.Call(name, arguments), context)
        if isinstance(answer, str):
            answer = answer.replace("{r}", result.text)
        else:
            answer = answer(result.text)
        call = {"id": "call_0_0", "type": "function", "function": {"name": name, "arguments": arguments}}
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": result.text, "tool_call_id": "call_0_0", "name": name},
        ]
        answer = agent.cite_sources(answer, context.sources)
    messages.append({"role": "assistant", "content": answer})
    conversation = helper.conversation(messages)
    conversation["source"] = f"agent_data.py {kind} seed={settings['synthetic']['seed']}"
    return conversation


def generate(settings):
    """(train, eval) conversation lists, split by a hash of the user's question so that a question is
    never in both; eval keeps each question once."""
    synthetic = settings["synthetic"]
    rng = random.Random(synthetic["seed"])
    kinds, weights = zip(*synthetic["mix"].items(), strict=True)
    train, held_out, asked = [], [], set()
    for _ in range(synthetic["conversations"]):
        conversation = one_conversation(rng, rng.choices(kinds, weights)[0], settings)
        chat.check_conversation(conversation)
        question = conversation["messages"][1]["content"]
        bucket = int(hashlib.sha256(question.encode("utf-8")).hexdigest()[:8], 16) / 16**8
        if bucket >= synthetic["eval_fraction"]:
            train.append(conversation)
        elif question not in asked:
            asked.add(question)
            held_out.append(conversation)
    return train, held_out


def write_jsonl(path, conversations):

    text = "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations)
    fileio.write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv):
    parser = argparse.ArgumentParser(description="Tool-use conversations for training and evaluation.")
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("generate", help="write OUT/train.jsonl and OUT/eval.jsonl")
    make.add_argument("out")
    make.add_argument("--settings", default=agent.DEFAULT_SETTINGS, help="an agent layer file")
    args = parser.parse_args(argv)
    try:
        settings = agent.load_settings(path=args.settings)
    except config.ConfigError as exc:
        print(f"agent_data.py: {exc}", file=sys.stderr)
        return 2
    train, held_out = generate(settings)
    write_jsonl(os.path.join(args.out, "train.jsonl"), train)
    write_jsonl(os.path.join(args.out, "eval.jsonl"), held_out)
    print(f"{args.out}: {len(train)} train and {len(held_out)} eval conversations")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
