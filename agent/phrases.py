"""
What people say to the family's assistant, for agent/dataset.py's generator: wide pools of places, people,
numbers and phrasings (Spain and Latin America, tú and usted, typos), so that the model learns to copy a
question's values into a call instead of memorising a few argument strings.

Each draw_* function takes a random.Random and returns plain values; nothing here runs a tool. The pools
are data, the functions only pick and inflect.
"""

import math
import re

from agent import grounding

# -----------------------------------------------------------------------------
# Places and time zones (the zone is what fecha_hora takes)

CITY_ZONES = {
    "Madrid": "Europe/Madrid", "Barcelona": "Europe/Madrid", "Sevilla": "Europe/Madrid",
    "Valencia": "Europe/Madrid", "Bilbao": "Europe/Madrid", "Málaga": "Europe/Madrid",
    "Las Palmas": "Atlantic/Canary", "Tenerife": "Atlantic/Canary", "Canarias": "Atlantic/Canary",
    "Lanzarote": "Atlantic/Canary", "Palma de Mallorca": "Europe/Madrid", "Ceuta": "Africa/Ceuta",
    "Ciudad de México": "America/Mexico_City", "CDMX": "America/Mexico_City",
    "Guadalajara de México": "America/Mexico_City", "Monterrey": "America/Monterrey",
    "Cancún": "America/Cancun", "Tijuana": "America/Tijuana", "Mérida de Yucatán": "America/Merida",
    "Chihuahua": "America/Chihuahua", "Hermosillo": "America/Hermosillo",
    "Buenos Aires": "America/Argentina/Buenos_Aires", "Córdoba de Argentina": "America/Argentina/Cordoba",
    "Mendoza": "America/Argentina/Mendoza", "Ushuaia": "America/Argentina/Ushuaia",
    "Bogotá": "America/Bogota", "Medellín": "America/Bogota", "Cali": "America/Bogota",
    "Cartagena de Indias": "America/Bogota", "Lima": "America/Lima", "Cusco": "America/Lima",
    "Santiago de Chile": "America/Santiago", "Valparaíso": "America/Santiago",
    "Isla de Pascua": "Pacific/Easter", "Caracas": "America/Caracas", "Maracaibo": "America/Caracas",
    "Quito": "America/Guayaquil", "Guayaquil": "America/Guayaquil", "Galápagos": "Pacific/Galapagos",
    "La Paz": "America/La_Paz", "Santa Cruz de la Sierra": "America/La_Paz",
    "Asunción": "America/Asuncion", "Montevideo": "America/Montevideo",
    "La Habana": "America/Havana", "Santo Domingo": "America/Santo_Domingo",
    "San Juan de Puerto Rico": "America/Puerto_Rico", "Ciudad de Guatemala": "America/Guatemala",
    "San Salvador": "America/El_Salvador", "Tegucigalpa": "America/Tegucigalpa",
    "Managua": "America/Managua", "San José de Costa Rica": "America/Costa_Rica",
    "Ciudad de Panamá": "America/Panama", "Nueva York": "America/New_York", "Miami": "America/New_York",
    "Los Ángeles": "America/Los_Angeles", "Chicago": "America/Chicago", "Toronto": "America/Toronto",
    "Londres": "Europe/London", "París": "Europe/Paris", "Roma": "Europe/Rome", "Berlín": "Europe/Berlin",
    "Lisboa": "Europe/Lisbon", "Oporto": "Europe/Lisbon", "Ámsterdam": "Europe/Amsterdam",
    "Bruselas": "Europe/Brussels", "Zúrich": "Europe/Zurich", "Atenas": "Europe/Athens",
    "Moscú": "Europe/Moscow", "Estambul": "Europe/Istanbul", "El Cairo": "Africa/Cairo",
    "Marrakech": "Africa/Casablanca", "Dubái": "Asia/Dubai", "Nueva Delhi": "Asia/Kolkata",
    "Pekín": "Asia/Shanghai", "Shanghái": "Asia/Shanghai", "Tokio": "Asia/Tokyo", "Seúl": "Asia/Seoul",
    "Manila": "Asia/Manila", "Bangkok": "Asia/Bangkok", "Sídney": "Australia/Sydney",
    "Melbourne": "Australia/Melbourne", "Auckland": "Pacific/Auckland", "Malabo": "Africa/Malabo",
}  # fmt: skip
COUNTRY_ZONES = {
    "México": "America/Mexico_City", "Argentina": "America/Argentina/Buenos_Aires",
    "Colombia": "America/Bogota", "Perú": "America/Lima", "Chile": "America/Santiago",
    "Venezuela": "America/Caracas", "Ecuador": "America/Guayaquil", "Bolivia": "America/La_Paz",
    "Paraguay": "America/Asuncion", "Uruguay": "America/Montevideo", "Cuba": "America/Havana",
    "República Dominicana": "America/Santo_Domingo", "Puerto Rico": "America/Puerto_Rico",
    "Guatemala": "America/Guatemala", "El Salvador": "America/El_Salvador", "Honduras": "America/Tegucigalpa",
    "Nicaragua": "America/Managua", "Costa Rica": "America/Costa_Rica", "Panamá": "America/Panama",
    "España": "Europe/Madrid", "Portugal": "Europe/Lisbon", "Francia": "Europe/Paris", "Italia": "Europe/Rome",
    "Alemania": "Europe/Berlin", "Inglaterra": "Europe/London", "Japón": "Asia/Tokyo", "China": "Asia/Shanghai",
    "Corea del Sur": "Asia/Seoul", "India": "Asia/Kolkata", "Guinea Ecuatorial": "Africa/Malabo",
    "Marruecos": "Africa/Casablanca", "Egipto": "Africa/Cairo", "Filipinas": "Asia/Manila",
}  # fmt: skip
TOWNS = (
    "Albacete Alicante Almería Ávila Badajoz Burgos Cáceres Cádiz Castellón Córdoba Cuenca Girona "
    "Granada Guadalajara Huelva Huesca Jaén León Lleida Logroño Lugo Murcia Ourense Oviedo Palencia Pamplona "
    "Pontevedra Salamanca Santander Segovia Soria Tarragona Teruel Toledo Valladolid Vitoria Zamora Zaragoza "
    "Gijón Vigo Elche Cartagena Jerez Marbella Getafe Alcalá Móstoles Leganés Sabadell Terrassa Badalona "
    "Reus Ponferrada Mérida Talavera Ronda Úbeda Baeza Jaca Benidorm Gandía Torrelavega Avilés Ferrol "
    "Puebla Querétaro León Morelia Oaxaca Veracruz Toluca Saltillo Aguascalientes Mazatlán Acapulco "
    "Rosario Mendoza Salta Tucumán Bariloche Neuquén Barranquilla Bucaramanga Manizales "
    "Pereira Cúcuta Arequipa Trujillo Chiclayo Piura Antofagasta Concepción Temuco Valdivia Cuenca "
    "Loja Ambato Cochabamba Sucre Tarija Salto Paysandú Rivera Encarnación Maracay Valencia Barquisimeto "
    "Mérida Cumaná Heredia Alajuela Liberia Masaya Quetzaltenango Antigua"
).split()
MULTIWORD_TOWNS = ("Ciudad Real", "Mar del Plata", "Santa Ana", "San Sebastián", "Santiago de Compostela",
                   "Las Palmas", "Palma de Mallorca", "Santa Cruz de Tenerife", "San Luis Potosí",
                   "Ciudad Juárez", "San Miguel de Allende", "Villa Carlos Paz", "Punta del Este")  # fmt: skip

# -----------------------------------------------------------------------------
# People

NAMES = (
    "Lucía Mateo Sofía Hugo Martina Leo Valeria Daniel Paula Pablo Carmen Diego Julia Álvaro Emma Adrián "
    "Alba Manuel Noa Javier Sara Marcos Irene Bruno Elena Tomás Camila Santiago Valentina Sebastián Ximena "
    "Emiliano Renata Matías Florencia Joaquín Catalina Benjamín Antonella Thiago Luciana Nicolás Guadalupe "
    "Andrés Mariana Felipe Gabriela Rodrigo Daniela Fernando Rocío Ignacio Pilar Jorge Inés Ramón Teresa"
).split()
RELATIVES = (
    ("mi madre", "f"), ("mi padre", "m"), ("mi suegra", "f"), ("mi suegro", "m"), ("la abuela", "f"),
    ("el abuelo", "m"), ("mi hermana", "f"), ("mi hermano", "m"), ("mi tía", "f"), ("mi tío", "m"),
    ("mi prima", "f"), ("mi primo", "m"), ("mi hija", "f"), ("mi hijo", "m"), ("mi sobrina", "f"),
    ("mi sobrino", "m"), ("mi cuñada", "f"), ("mi cuñado", "m"), ("mi mujer", "f"), ("mi marido", "m"),
    ("mi pareja", "f"), ("mi nuera", "f"), ("mi yerno", "m"), ("la vecina", "f"), ("el vecino", "m"),
)  # fmt: skip
FEMININE_NAMES = set(
    "Lucía Sofía Martina Valeria Paula Carmen Julia Emma Alba Noa Sara Irene Elena Camila Valentina Ximena "
    "Renata Florencia Catalina Antonella Luciana Guadalupe Mariana Gabriela Daniela Rocío Pilar Inés Teresa".split()
)
SURNAMES = (
    "García Rodríguez González Fernández López Martínez Sánchez Pérez Gómez Martín Jiménez Ruiz Hernández "
    "Díaz Moreno Muñoz Álvarez Romero Navarro Torres Ramírez Flores Rivera Vargas Castillo Morales Ortiz "
    "Silva Rojas Mendoza Herrera Medina Aguilar Castro Vega Cruz Reyes Guerrero Ríos Paredes Quispe"
).split()


def person(rng):
    """(how the member names someone, 'f' or 'm')."""
    if rng.random() < 0.5:
        return rng.choice(RELATIVES)
    name = rng.choice(NAMES)
    return name, "f" if name in FEMININE_NAMES else "m"


# -----------------------------------------------------------------------------
# Numbers as people write them

CURRENCIES = ("euros", "euros", "€", "pesos", "dólares", "soles", "bolívares", "quetzales", "colones", "$")
MONTHS = "enero febrero marzo abril mayo junio julio agosto septiembre octubre noviembre diciembre".split()
WEEKDAYS = ("lunes", "martes", "miércoles", "jueves", "viernes", "sábados", "domingos")
WEEKDAY = ("lunes", "martes", "miércoles", "jueves", "viernes", "sábado", "domingo")


def whole(rng, low=2, high=99999):
    """An integer drawn log-uniformly from low..high: small numbers often, big ones too."""
    return int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))) if high > low else low


def decimal(rng, high=200):
    """A price with cents as written in the question (decimal comma or point) and in the expression: the
    calculator reads both, so the call copies the question's digits."""
    value = f"{whole(rng, 1, high)}{rng.choice(',,,.')}{rng.randint(1, 99):02d}"
    return value.rstrip("0") if value[-1] == "0" else value


def amount(rng):
    return decimal(rng) if rng.random() < 0.3 else str(whole(rng, 2, 5000))


def day_month(rng):
    return f"{rng.randint(1, 28)} de {rng.choice(MONTHS)}"


def clock_time(rng):
    return f"{rng.randint(7, 21)}:{rng.choice(('00', '15', '30', '45', '10', '20', '40', '50'))}"


# -----------------------------------------------------------------------------
# The way people ask: openers, closers, typos


OPENERS = ("", "", "", "", "Oye, ", "Hola, ", "Una pregunta: ", "Perdona, ", "Disculpe, ", "Oiga, ",
           "Buenas, ", "Ey, ", "A ver, ", "Oye una cosa, ", "Hola ENLACE, ", "Por favor, ")  # fmt: skip
CLOSERS = ("", "", "", "", " Gracias.", " Gracias!", " porfa", ", por favor", " xfa", " ¡Gracias!", " porfi",
           ", si eres tan amable", " Muchas gracias.", " 🙏")  # fmt: skip
ACCENTED = str.maketrans("áéíóúÁÉÍÓÚ", "aeiouAEIOU")


def dress(rng, template):
    """A question template with an opener and a closer, and now and then written in a hurry: no accents,
    no opening ¿ or ¡, all lower case, "q" for "que", a doubled or dropped letter. Only the template's
    words change: the values go in afterwards, as the person typed them."""
    opener, closer, text = rng.choice(OPENERS), rng.choice(CLOSERS), template
    first = 1 if text.startswith(("¿", "¡")) else 0
    if opener and text[first : first + 1].isupper() and not text[first + 1 : first + 2].isupper():
        text = text[:first] + text[first].lower() + text[first + 1 :]
    if text.endswith(("?", ".", "!")) and closer.startswith(","):
        closer = ""
    elif not text.endswith(("?", ".", "!")) and closer[1:2].isupper() or closer.startswith(" ¡"):
        closer = "." + closer
    text = opener + text + closer
    if rng.random() < 0.25:
        text = text.translate(ACCENTED)
    if rng.random() < 0.2:
        text = text.replace("¿", "").replace("¡", "")
    if rng.random() < 0.15:
        text = text.lower()
    if rng.random() < 0.1:
        text = text.replace(" que ", " q ")
    if rng.random() < 0.1:
        words = text.split(" ")
        at = rng.randrange(len(words))
        word = words[at]
        if len(word) > 4 and word.isalpha():
            cut = rng.randrange(1, len(word) - 1)
            words[at] = (
                word[:cut] + word[cut + 1 :] if rng.random() < 0.5 else word[:cut] + word[cut] + word[cut:]
            )
        text = " ".join(words)
    return text


def pick(rng, options):
    return rng.choice(options)


def ask(rng, templates):
    """One of the question templates, dressed (see dress)."""
    return dress(rng, rng.choice(templates))


# -----------------------------------------------------------------------------
# calculadora: (question, expression, answer with {r} for the result)

THINGS_BOUGHT = (("kilos", "manzanas"), ("kilos", "tomates"), ("kilos", "naranjas"), ("litros", "leche"),
                 ("litros", "aceite"), ("paquetes", "arroz"), ("cajas", "galletas"), ("botellas", "agua"),
                 ("metros", "tela"), ("entradas", "cine"), ("kilos", "papas"), ("kilos", "jitomate"),
                 ("docenas", "huevos"), ("barras", "pan"), ("cuadernos", "la escuela"), ("kilos", "carne"),
                 ("bolsas", "pienso"), ("latas", "atún"), ("rollos", "papel"), ("tarros", "miel"))  # fmt: skip
SHARED = ("caramelos", "cromos", "galletas", "canicas", "lápices", "fichas", "libros", "pegatinas")


PERCENTS = (5, 7, 10, 12, 15, 16, 18, 20, 21, 25, 30, 33, 35, 40, 45, 50, 60, 75)
UNIT_FACTORS = (("horas", "minutos", 60), ("minutos", "segundos", 60), ("días", "horas", 24),
                ("semanas", "días", 7), ("años", "meses", 12), ("horas", "segundos", 3600),
                ("kilómetros", "metros", 1000), ("metros", "centímetros", 100),
                ("kilos", "gramos", 1000), ("litros", "mililitros", 1000))  # fmt: skip


def draw_shared(rng):
    return {"things": rng.choice(SHARED), "t": whole(rng, 6, 600)}


def draw_bought(rng):
    unit, thing = rng.choice(THINGS_BOUGHT)
    return {"unit": unit, "thing": thing, "price": decimal(rng, 30)}


def draw_units(rng):
    unit, to, factor = rng.choice(UNIT_FACTORS)
    return {"unit": unit, "to": to, "factor": factor, "c": whole(rng, 2, 900)}


def draw_marks(rng):
    marks = [
        str(rng.randint(1, 10) if rng.random() < 0.5 else whole(rng, 2, 300))
        for _ in range(rng.randint(3, 5))
    ]
    return {"m": ", ".join(marks[:-1]) + " y " + marks[-1], "sum": "+".join(marks), "k": len(marks)}


# Each kind of calculation: values drawn (in order) besides a, b, cur, n and p; question templates; the
# expression; answers with {r} for the result (one answer: no draw). Optional: "named" (placeholder, what
# replaces expression or answers when the question names it), "squared" (probability, templates, values:
# drawn after the question, another question), "otherwise" (probability of keeping this kind, else the
# kind drawn instead, after the values).
CALCULATIONS = (
    {"questions": ("¿Cuánto es {a} por {b}?", "Calcula {a} × {b}", "{a} x {b}", "¿{a} por {b}?",
                   "¿Cuánto da {a} multiplicado por {b}?", "Multiplica {a} por {b}", "¿Me dices cuánto es {a}*{b}?",
                   "Necesito saber cuánto es {a} por {b}", "¿Y {a} por {b}? ¿Cuánto sale?",
                   "Hazme esta cuenta: {a} por {b}",
                   "{a} y {b}: son las dos cifras que tengo apuntadas en la libreta desde ayer, ¿cuánto da si las multiplico?"),
     "expression": "{a}*{b}",
     "answers": ("{a} por {b} son {r}.", "Son {r}.", "El resultado es {r}.", "Da {r}.")},
    {"draws": (lambda rng: {"c": amount(rng)},),
     "questions": ("¿Cuánto es {a} más {b}?", "Suma {a} y {b}", "¿Cuánto suman {a}, {b} y {c}?", "{a} + {b} + {c}",
                   "Súmame {a} más {b} más {c}", "¿Cuánto es {a} + {b}?", "Necesito el total de {a}, {b} y {c}"),
     "expression": "{a}+{b}", "answers": ("Suman {r}.", "El total es {r}.", "Son {r}."),
     "named": ("c", {"expression": "{a}+{b}+{c}"})},
    {"questions": ("¿Cuánto es {a} menos {b}?", "Réstale {b} a {a}", "{a} - {b}",
                   "Si tengo {a} {cur} y me gasto {b}, ¿cuánto me queda?",
                   "Tenía {a} {cur} y pagué {b}, ¿cuánto me sobra?",
                   "Me quedan {a} {cur} y debo {b}, ¿con cuánto me quedo?"),
     "expression": "{a}-{b}", "answers": ("Son {r}.", "Da {r}."),
     "named": ("cur", {"answers": ("Te quedan {r} {cur}.",)})},
    {"questions": ("¿Cuánto es {a} entre {n}?", "Divide {a} entre {n}", "¿{a} dividido por {n}?",
                   "Somos {n} y la cuenta es de {a} {cur}, ¿cuánto paga cada uno?",
                   "Hay que pagar {a} {cur} entre {n} personas, ¿a cuánto tocamos?",
                   "Tenemos que repartir {a} {cur} entre {n}, ¿cuánto le toca a cada uno?",
                   "Una cena de {a} {cur} que al final pagamos a medias entre los {n} que fuimos, ¿a cuánto sale cada uno?"),
     "expression": "{a}/{n}", "answers": ("Sale a {r}.", "Son {r}."),
     "named": ("cur", {"answers": ("Cada uno paga {r} {cur}.",)})},
    {"draws": (draw_shared,),
     "questions": ("Quiero repartir {t} {things} entre {n} niños, ¿cuántos le tocan a cada uno?",
                   "Mi hija tiene {t} {things} para {n} amigas, ¿cuántos da a cada una?",
                   "¿Cuántos {things} son para cada uno si repartimos {t} entre {n}?"),
     "expression": "{t}/{n}", "answers": ("A cada uno le tocan {r} {things}.",)},
    {"questions": ("¿Cuánto es el {p}% de {a}?", "Calcula el {p} por ciento de {a}", "¿Qué es el {p} % de {a} {cur}?",
                   "Sácame el {p}% de {a}", "¿El {p} por ciento de {a} cuánto es?"),
     "expression": "{a}*{p}%", "answers": ("El {p} % de {a} es {r}.",)},
    {"questions": ("Algo cuesta {a} {cur} con un {p}% de descuento, ¿cuánto pago?",
                   "Me rebajan un {p}% sobre {a} {cur}, ¿en cuánto se queda?",
                   "¿Cuánto queda un precio de {a} {cur} con el {p}% de descuento?",
                   "Está a {a} {cur} y le quitan el {p}%, ¿cuánto cuesta ahora?"),
     "expression": "{a}-{a}*{p}%", "answers": ("Con el descuento se queda en {r} {cur}.",)},
    {"draws": (draw_bought,),
     "questions": ("Si compro {n} {unit} de {thing} a {price} {cur} cada uno, ¿cuánto pago?",
                   "{n} {unit} de {thing} a {price} {cur}, ¿cuánto es en total?",
                   "¿Cuánto me cuestan {n} {unit} de {thing} si cada uno sale a {price} {cur}?",
                   "Compré {n} {unit} de {thing} a {price} {cur}, ¿cuánto gasté?"),
     "expression": "{n}*{price}", "answers": ("Son {r} {cur} en total.",)},
    {"draws": (lambda rng: {"x": whole(rng, 2, 40), "y": rng.randint(2, 12)},),
     "questions": ("¿Cuánto es {x} elevado a {y}?", "{x} elevado a la {y}", "Calcula {x}^{y}",
                   "¿Me calculas {x} a la potencia {y}?"),
     "squared": (0.25, ("¿Cuánto es {x} al cuadrado?", "{x} al cuadrado"), {"y": 2}),
     "expression": "{x}**{y}", "answers": ("{x} elevado a {y} es {r}.",)},
    {"draws": (draw_units,),
     "questions": ("¿Cuántos {to} son {c} {unit}?", "¿Cuántos {to} hay en {c} {unit}?", "Pasa {c} {unit} a {to}",
                   "{c} {unit}, ¿cuántos {to} son?"),
     "expression": "{c}*{factor}", "answers": ("{c} {unit} son {r} {to}.",)},
    {"draws": (draw_marks,),
     "questions": ("¿Cuál es la media de {m}?", "Hazme el promedio de {m}", "Saca la media de {m}"),
     "expression": "({sum})/{k}", "answers": ("La media es {r}.",)},
    {"draws": (lambda rng: {"y1": rng.randint(1930, 2020), "y2": rng.randint(2024, 2060)},),
     "questions": ("Si nací en {y1}, ¿cuántos años cumplo en {y2}?", "¿Cuántos años hay de {y1} a {y2}?",
                   "Mi abuela nació en {y1}, ¿cuántos años tendrá en {y2}?"),
     "expression": "{y2}-{y1}", "answers": ("Son {r} años.",)},
    {"questions": ("La cuenta es de {a} {cur}, ¿cuánto es una propina del {p}%?",
                   "¿Cuánto dejo de propina si es el {p}% de {a} {cur}?"),
     "expression": "{a}*{p}%", "answers": ("La propina sería de {r} {cur}.",)},
    {"questions": ("¿Cuánto es {a} euros más el IVA del 21%?", "Ponle el IVA del 21% a {a} euros",
                   "{a} € con IVA (21%), ¿cuánto es?"),
     "expression": "{a}+{a}*21%", "answers": ("Con el IVA son {r} euros.",)},
    {"draws": (lambda rng: {"v": whole(rng, 4, 130), "h": whole(rng, 2, 12)},),
     "questions": ("A {v} km por hora, ¿cuántos kilómetros hago en {h} horas?",
                   "Si voy a {v} km/h durante {h} horas, ¿cuánto recorro?"),
     "expression": "{v}*{h}", "answers": ("Recorres {r} kilómetros.",),
     "otherwise": (0.5, {"draws": (lambda rng: {"d": whole(rng, 5, 2000)},),
                         "questions": ("¿Cuántas horas tardo en hacer {d} km a {v} km por hora?",
                                       "Son {d} kilómetros a {v} km/h, ¿cuánto tiempo tardo?"),
                         "expression": "{d}/{v}", "answers": ("Tardas {r} horas.",)})},
    {"questions": ("Si ahorro {a} {cur} al mes, ¿cuánto tendré en {n} meses?",
                   "Pago {a} {cur} cada mes, ¿cuánto es en {n} meses?", "Son {n} cuotas de {a} {cur}, ¿cuánto pago en total?"),
     "expression": "{a}*{n}", "answers": ("En total son {r} {cur}.",)},
)  # fmt: skip


SPELLABLE = ("a", "b", "c", "n", "t", "x", "y", "h", "v", "d")  # values a question may say in words


def in_words(rng, value, words_share):
    """The value as the question says it: now and then, a whole number in Spanish words ("doce",
    "dos mil trescientos"); the call still writes its digits, which the grounded grammar allows."""
    text = str(value)
    if text.isdigit() and int(text) < 1000000 and rng.random() < words_share:
        return grounding.number_words(int(text))
    return text


def calculator_case(rng, words_share=0.0):
    """(question, expression, answer with {r} for the result): a kind of CALCULATIONS filled with drawn
    values; words_share of the whole numbers are said in words in the question."""
    values = {"a": amount(rng), "b": amount(rng), "cur": rng.choice(CURRENCIES), "n": whole(rng, 2, 60)}
    values["p"] = rng.choice(PERCENTS)
    case = CALCULATIONS[rng.randrange(len(CALCULATIONS))]
    while True:
        for draw in case.get("draws", ()):
            values.update(draw(rng))
        if "otherwise" not in case or rng.random() < case["otherwise"][0]:
            break
        case = case["otherwise"][1]
    template = ask(rng, case["questions"])
    if "squared" in case:
        chance, squares, fixed = case["squared"]
        if rng.random() < chance:
            template = ask(rng, squares)
            values.update(fixed)
    if "named" in case and "{" + case["named"][0] + "}" in template:
        case = {**case, **case["named"][1]}
    answers = case["answers"]
    answer = answers[0] if len(answers) == 1 else pick(rng, answers)
    said = {
        key: in_words(rng, value, words_share) if key in SPELLABLE else value for key, value in values.items()
    }
    return template.format(**said), case["expression"].format(**values), answer.format(**values, r="{r}")


# -----------------------------------------------------------------------------
# fecha_hora: (question, arguments, how the answer reads the result: "date", "time" or "target")

TODAY = ("¿Qué día es hoy?", "¿A qué fecha estamos?", "Dime la fecha de hoy", "¿Qué fecha es hoy?",
         "¿Hoy qué día es?", "¿En qué día estamos?", "¿Me dices la fecha?", "¿Sabes qué día es hoy?",
         "¿Qué día de la semana es hoy?", "¿Hoy es qué fecha?", "Necesito la fecha de hoy",
         "¿Cuál es la fecha de hoy?", "¿Estamos a qué día?")  # fmt: skip
NOW = ("¿Qué hora es?", "¿Me dices la hora?", "¿Qué hora es ahora?", "¿Tienes hora?", "¿Sabes qué hora es?",
       "Dime la hora", "¿Qué horas son?", "¿Qué hora tenemos?", "¿Me da la hora, por favor?",
       "¿Qué hora marca el reloj?", "Hora actual, porfa")  # fmt: skip
IN_PLACE = ("¿Qué hora es en {place}?", "¿Qué hora es ahora en {place}?", "Dime la hora de {place}",
            "¿Qué hora tienen en {place}?", "¿Qué horas son en {place}?", "¿Qué hora será ahora en {place}?",
            "Hora en {place}", "¿Me dices qué hora es en {place}?", "¿Es muy tarde en {place}? ¿Qué hora es allí?",
            "Quiero llamar a {place}, ¿qué hora es allá?", "¿Qué día es ahora en {place}?",
            "{place}: allí vive mi hermana desde hace años y quiero llamarla sin despertarla, ¿qué hora es ahora?")  # fmt: skip
AHEAD = ("¿Qué día será dentro de {n} días?", "¿Qué fecha cae dentro de {n} días?", "¿Qué día es en {n} días?",
         "Dentro de {n} días, ¿qué fecha será?", "¿Qué fecha será de aquí a {n} días?",
         "Si cuento {n} días desde hoy, ¿qué día es?", "Tengo un plazo de {n} días, ¿cuándo acaba?",
         "¿En qué fecha estaremos dentro de {n} días?",
         "{n} días de plazo me han dado en el banco para llevar los papeles, contando desde hoy: ¿qué fecha será?")  # fmt: skip
AGO = ("¿Qué día fue hace {n} días?", "¿Qué fecha era hace {n} días?", "Hace {n} días, ¿qué día era?",
       "¿Qué día fue hace {n} días exactamente?", "Si resto {n} días a hoy, ¿qué fecha sale?")  # fmt: skip
NEAR = ((1, ("¿Qué día es mañana?", "¿Qué fecha es mañana?", "Mañana, ¿qué día será?")),
        (2, ("¿Qué día es pasado mañana?", "¿Qué fecha cae pasado mañana?")),
        (-1, ("¿Qué día fue ayer?", "¿A qué fecha estábamos ayer?")),
        (-2, ("¿Qué día fue anteayer?", "¿Qué fecha era antier?")))  # fmt: skip


WEEKS_AHEAD = ("¿Qué día será dentro de {w} semanas?", "¿Qué fecha es dentro de {w} semanas?",
               "Dentro de {w} semanas, ¿qué día será?", "Me operan dentro de {w} semanas, ¿qué fecha es?")  # fmt: skip
WEEKS_AGO = ("¿Qué día fue hace {w} semanas?", "Hace {w} semanas, ¿a qué fecha estábamos?",
             "Llegué hace {w} semanas, ¿qué día fue?")  # fmt: skip


def date_case(rng, words_share=0.0, units=None):
    """(question, arguments, what the answer states, the place named or None); words_share of the day
    counts said in words, and now and then weeks (units: a word -> its days, the grounding layer's)."""
    kind = rng.randrange(11)
    if kind == 10:
        weeks, ahead = rng.randint(2, 12), rng.random() < 0.6
        days = weeks * (units or {}).get("semanas", 7)
        template = ask(rng, WEEKS_AHEAD if ahead else WEEKS_AGO).replace(
            "{w}", in_words(rng, weeks, words_share)
        )
        return template, {"dias": days if ahead else -days}, "target", None
    if kind == 0:
        return ask(rng, TODAY), {}, "date", None
    if kind == 1:
        return ask(rng, NOW), {}, "time", None
    if kind in (2, 3, 4):
        places = CITY_ZONES if rng.random() < 0.75 else COUNTRY_ZONES
        place = rng.choice(list(places))
        template = ask(rng, IN_PLACE)
        return (
            template.replace("{place}", place),
            {"zona": places[place]},
            ("date" if "día" in template else "time"),
            place,
        )
    if kind in (5, 6):
        days = whole(rng, 2, 3000)
        return (
            ask(rng, AHEAD).replace("{n}", in_words(rng, days, words_share)),
            {"dias": days},
            "target",
            None,
        )
    if kind in (7, 8):
        days = whole(rng, 2, 3000)
        return ask(rng, AGO).replace("{n}", in_words(rng, days, words_share)), {"dias": -days}, "target", None
    days, questions = rng.choice(NEAR)
    return ask(rng, questions), {"dias": days}, "target", None


# -----------------------------------------------------------------------------
# buscar_web: subjects, each (question templates, result title, url, snippet, answer); the query is the
# question's own words (keywords)

SKIES = ("cielo despejado", "nubes y claros", "lluvia débil", "tormentas por la tarde", "niebla por la mañana",
         "chubascos", "viento fuerte", "cielo cubierto", "sol y calor", "nieve en las zonas altas")  # fmt: skip
PLACES = ("la biblioteca municipal", "la piscina municipal", "el polideportivo", "el centro de salud",
          "la oficina de Correos", "el mercado central", "el museo de historia", "el ayuntamiento",
          "el archivo municipal", "el punto limpio", "la oficina de turismo", "el cementerio municipal")  # fmt: skip
TEAMS = ("Betis", "Sevilla", "Atlético", "Real Madrid", "Barça", "Valencia", "Osasuna", "Celta", "Boca Juniors",
         "River Plate", "América", "Chivas", "Cruz Azul", "Millonarios", "Nacional", "Colo-Colo",
         "Universitario", "Peñarol", "Racing", "Rayo Vallecano")  # fmt: skip
TOPICS = ("las elecciones", "la huelga de transporte", "el precio de la luz", "las lluvias", "el metro",
          "la vuelta al cole", "el festival de cine", "la subida de las pensiones", "el calendario escolar",
          "las rebajas", "el tráfico en la autopista", "la campaña de vacunación de la gripe")  # fmt: skip
EVENTS = ("la feria", "las fiestas patronales", "el carnaval", "la Semana Santa", "el mercadillo medieval",
          "la noche de San Juan", "el desfile de Reyes", "la feria del libro", "el festival de música")  # fmt: skip
SEARCHES = (
    (("¿Qué tiempo hará mañana en {town}?", "¿Va a llover mañana en {town}?", "Busca el tiempo de {town} para mañana",
      "¿Qué tal el clima en {town} mañana?", "¿Hará frío mañana en {town}?",
      "{town}, que es adonde vamos mañana de excursión con los niños del colegio: ¿qué tiempo hará?"),
     "El tiempo en {town}", "www.eltiempo.es/{slug}.html",
     "Mañana en {town}: {sky}, máxima de {t} grados y mínima de {low}.",
     "Según [1], mañana en {town} habrá {sky}, con máximas de {t} grados."),
    (("¿Hay alguna farmacia de guardia hoy en {town}?", "Busca la farmacia de guardia de {town}",
      "¿Qué farmacia está abierta esta noche en {town}?"),
     "Farmacias de guardia en {town}", "www.farmaciasdeguardia.es/{slug}",
     "Hoy está de guardia la farmacia de la calle Mayor, {n}, abierta las 24 horas.",
     "Según [1], hoy está de guardia la farmacia de la calle Mayor, {n}."),
    (("¿A qué hora abre {place} de {town}?", "Busca el horario de {place} de {town}",
      "¿{place} de {town} abre los sábados?", "¿Cuál es el horario de {place} en {town}?"),
     "{Place} de {town}: horarios", "www.{slug}.es/horarios",
     "Abre de lunes a viernes de {h1}:00 a {h2}:00 y los sábados de 10:00 a 14:00.",
     "Según [1], abre de lunes a viernes de {h1}:00 a {h2}:00 y los sábados por la mañana."),
    (("¿Cuándo es {event} de {town} este año?", "Busca las fechas de {event} de {town}",
      "¿Qué días son {event} en {town}?"),
     "{Event} de {town}: programa", "www.turismo{slug}.es/agenda",
     "{Event} de {town} se celebra del {d1} al {d2} de {month}, con conciertos y actividades.",
     "Según [1], {event} de {town} es del {d1} al {d2} de {month}."),
    (("¿Cuánto cuesta la entrada del museo de {town}?", "¿Es gratis el museo de {town}?",
      "Mira el precio de la entrada al museo de {town}"),
     "Museo de {town}: tarifas", "www.museo{slug}.es/visita",
     "Entrada general: {t} euros. Menores de 12 años y mayores de 65, gratis.",
     "Según [1], la entrada general cuesta {t} euros; menores de 12 y mayores de 65 entran gratis."),
    (("¿Cuándo juega el {team}?", "¿A qué hora es el partido del {team}?", "Busca el próximo partido del {team}",
      "¿Cómo quedó el {team} ayer?"),
     "{team}: calendario y resultados", "www.resultados-futbol.com/{slug}",
     "Próximo partido del {team}: el domingo a las {h2}:00. El último lo ganó {g1}-{g2}.",
     "Según [1], el {team} juega el domingo a las {h2}:00; el último partido lo ganó {g1}-{g2}."),
    (("¿Qué películas echan en los cines de {town}?", "Busca la cartelera de cine de {town}",
      "¿Qué ponen hoy en el cine en {town}?"),
     "Cartelera de cine en {town}", "www.cartelera.es/{slug}",
     "Hoy en {town}: {n} películas en cartel, con sesiones desde las {h1}:00.",
     "Según [1], hoy hay {n} películas en cartel en {town}, con sesiones desde las {h1}:00."),
    (("¿A cuánto está la gasolina en {town}?", "Busca el precio del diésel en {town}",
      "¿Dónde está más barata la gasolina en {town}?"),
     "Precio del combustible en {town}", "www.preciocombustible.com/{slug}",
     "La gasolina más barata de {town} está a 1,{n} el litro en la gasolinera de la avenida principal.",
     "Según [1], la gasolina más barata en {town} está a 1,{n} el litro."),
    (("¿A qué hora sale el último autobús de {town} a {town2}?", "Busca el horario del tren de {town} a {town2}",
      "¿Cuánto tarda el tren de {town} a {town2}?"),
     "Horarios {town} - {town2}", "www.horarios.es/{slug}",
     "Último servicio de {town} a {town2} a las {h2}:30; el viaje dura {n} minutos.",
     "Según [1], el último sale de {town} a {town2} a las {h2}:30 y tarda {n} minutos."),
    (("¿Qué ha pasado hoy con {topic}?", "Busca noticias de {topic}", "¿Hay novedades sobre {topic}?",
      "Mira qué dicen las noticias de {topic}"),
     "Última hora: {topic}", "www.noticias.es/{slug}",
     "Las últimas noticias sobre {topic}: novedades importantes esta mañana, según fuentes oficiales.",
     "Según [1], hay novedades sobre {topic} esta mañana."),
    (("¿Cuál es el teléfono del ayuntamiento de {town}?", "Busca el teléfono de atención ciudadana de {town}"),
     "Ayuntamiento de {town}: contacto", "www.{slug}.es/contacto",
     "Atención ciudadana: 010, o 9{n}0 {n}{n} 00 desde fuera del municipio.",
     "Según [1], el teléfono de atención ciudadana es el 010."),
    (("¿Cuándo abre la piscina de verano en {town}?", "Busca cuándo abren las piscinas de {town}"),
     "Piscinas de verano de {town}", "www.deportes{slug}.es/piscinas",
     "Las piscinas de verano de {town} abren el {d1} de junio, de 11:00 a {h2}:00.",
     "Según [1], las piscinas de {town} abren el {d1} de junio."),
    (("¿Qué restaurantes abren el domingo en {town}?", "Busca un sitio para comer en {town} el domingo"),
     "Dónde comer en {town}", "www.guiagastro.es/{slug}",
     "En {town} abren el domingo {n} restaurantes del centro; casi todos piden reserva.",
     "Según [1], en {town} abren el domingo {n} restaurantes del centro y conviene reservar."),
    (("¿A cuánto está el {coin} hoy en {coin2}?", "Busca el cambio de {coin} a {coin2}",
      "¿Cuántos {coin2} es un {coin} hoy?", "¿Cómo está el {coin} frente al {coin2}?"),
     "Cambio de divisas hoy", "www.cambio.es/hoy",
     "Hoy el cambio está a 1,{n} por unidad, según el banco central.",
     "Según [1], hoy el cambio está a 1,{n}."),
)  # fmt: skip
COINS = ("dólar", "euro", "peso mexicano", "peso argentino", "peso colombiano", "sol", "real", "yen", "bolívar",
         "quetzal", "franco suizo")  # fmt: skip
MONTHS_SUMMER = ("junio", "julio", "agosto", "septiembre", "mayo", "octubre")


def slug(text):
    return text.lower().translate(str.maketrans("áéíóúñü ", "aeiounu-"))


# Words a search leaves out: asking words, articles and prepositions, and the openers and closers of dress
NOT_SEARCHED = set(
    "a al algo alguna alguno allí cómo como con cuál cual cuándo cuando cuánto cuanto cuántos cuantos "
    "de del dime donde dónde el en es esta está este hay la las lo los me mira mucho muy para por q qué "
    "que se si sí sobre su tal te un una va y ya busca búscame búscalo dicen sabes necesito saber "
    "oye hola enlace perdona disculpe oiga buenas ey ver cosa favor gracias muchas porfa porfi xfa eres tan "
    "amable pregunta"
    .split()
)  # fmt: skip
WORD = re.compile(r"[^\W_]+(?:[-'][^\W_]+)*")


def keywords(question):
    """The question's own words a search needs, in order and as typed: 'Oiga, ¿a qué hora abre el
    polideportivo de Soria?' -> 'hora abre polideportivo Soria'."""
    words = WORD.findall(question)
    return " ".join(word for word in words if word.lower() not in NOT_SEARCHED)


def search_case(rng):
    """(question, query: the question's keywords, [(title, url, snippet) of the first result], answer
    citing [1])."""
    questions, title, url, snippet, answer = rng.choice(SEARCHES)
    town = rng.choice(TOWNS + list(MULTIWORD_TOWNS))
    values = {
        "town": town, "town2": rng.choice([t for t in TOWNS if t != town]), "place": rng.choice(PLACES),
        "event": rng.choice(EVENTS), "team": rng.choice(TEAMS), "topic": rng.choice(TOPICS),
        "sky": rng.choice(SKIES), "t": rng.randint(4, 42), "low": rng.randint(-5, 15), "h1": rng.randint(7, 10),
        "h2": rng.randint(17, 22), "n": rng.randint(10, 99), "d1": rng.randint(1, 14), "d2": rng.randint(15, 28),
        "month": rng.choice(MONTHS_SUMMER), "g1": rng.randint(1, 4), "g2": rng.randint(0, 3),
    }  # fmt: skip
    values["coin"], values["coin2"] = rng.sample(COINS, 2)
    values["Place"], values["Event"] = (
        values["place"][0].upper() + values["place"][1:],
        values["event"].capitalize(),
    )
    values["slug"] = slug(values["town"])
    question = contract(ask(rng, questions).format(**values))
    question = question[0].upper() + question[1:] if question[0] == "¿" else question
    result = (
        contract(title.format(**values)),
        "https://" + url.format(**values),
        contract(snippet.format(**values)),
    )
    return question, keywords(question), result, contract(answer.format(**values))


def contract(text):
    """Spanish contractions of "de el" and "a el" left by filling a template."""
    return text.replace(" de el ", " del ").replace(" a el ", " al ").replace("De el ", "Del ")


NO_RESULTS = (
    "No he encontrado resultados sobre «{q}». ¿Quieres que lo busque de otra forma?",
    "No he encontrado nada sobre «{q}». Puedo probar con otras palabras.",
    "Lo siento, no he encontrado nada sobre «{q}».",
)
SEARCH_FAILED = ("No he podido buscar ahora mismo porque la búsqueda ha fallado. Inténtalo de nuevo en un rato.",
                 "Ahora mismo no he podido buscar: la búsqueda ha fallado. Prueba otra vez dentro de un rato.",
                 "No he podido hacer la búsqueda, ha fallado. ¿Lo intentamos más tarde?")  # fmt: skip


# -----------------------------------------------------------------------------
# The memory tools: facts a member asks to keep, and how they refer to them later

ALLERGENS = ("los frutos secos", "la penicilina", "el polen", "el marisco", "la lactosa", "el gluten",
             "los ácaros", "el huevo", "las picaduras de abeja", "el níquel", "los gatos", "el ibuprofeno")  # fmt: skip
FOODS_DISLIKED = ("el pescado", "las espinacas", "el brócoli", "la cebolla", "el picante", "las lentejas",
                  "el hígado", "los champiñones", "el cilantro", "la coliflor", "las aceitunas")  # fmt: skip
VEHICLES = ("del coche", "del carro", "del auto", "de la moto", "de la furgoneta", "de la camioneta")
SPOTS = ("la tercera planta del parking", "la calle de atrás", "el garaje de la abuela", "la plaza del mercado",
         "el parking del hospital", "la planta -2, plaza 47", "la calle del colegio", "el centro comercial")  # fmt: skip
KEY_SPOTS = ("el cajón de la entrada", "casa de la vecina", "la caja de galletas", "el joyero", "la maceta del balcón",
             "el bolsillo del abrigo gris", "la estantería del salón")  # fmt: skip
APPOINTMENTS = (("dentista", "el dentista"), ("pediatra", "el pediatra"), ("oculista", "el oculista"),
                ("fisio", "el fisio"), ("analítica", "una analítica"), ("vacuna", "la vacuna"),
                ("peluquería", "peluquería"), ("logopeda", "logopeda"), ("tutoría", "tutoría"))  # fmt: skip
GARMENTS = ("zapato", "pantalón", "camisa", "camiseta", "vestido", "abrigo", "zapatilla", "falda")
SIZES = ("S", "M", "L", "XL", "36", "38", "40", "42", "44", "37", "39", "41", "43", "12", "14")
ACTIVITIES = ("natación", "inglés", "fútbol", "música", "teatro", "judo", "baloncesto", "clase", "catequesis",
              "ballet", "ajedrez", "robótica")  # fmt: skip
INSURED = ("coche", "carro", "hogar", "piso", "móvil", "seguro médico", "moto")
GROUPS = ("padres del colegio", "la comunidad de vecinos", "la asociación", "trabajo", "la parroquia",
          "la peña", "el club")  # fmt: skip
PROFESSIONALS = ("fontanero", "electricista", "veterinario", "pediatra", "taxista", "cerrajero", "jardinero")
PETS = ("el perro", "la perra", "el gato", "la gata", "Toby", "Luna", "Coco", "Nala", "Rocky", "Michi")
TITLES = ("la doctora", "el doctor", "la doctora", "el doctor")


def short(who):
    """'mi suegra' -> 'suegra', 'el abuelo' -> 'abuelo', 'Lucía' -> 'Lucía': the word a search needs."""
    first, _, rest = who.partition(" ")
    return rest if rest and first in ("mi", "el", "la", "los", "las", "tu") else who


def draw_when(rng):
    return {"when": rng.choice(WEEKDAY) if rng.random() < 0.5 else f"día {rng.randint(1, 28)}"}


def draw_wifi(rng):
    place = rng.choice(
        ("de casa", "del apartamento", "de la playa", "del pueblo", "de la oficina", "de los abuelos")
    )
    word = rng.choice(("Marea", "Sol", "Casa", "Gato", "Luna", "Verano", "Nido", "Olivo")) + str(
        rng.randint(10, 9999)
    )
    return {"place": place, "where": place.split()[-1], "word": word}


def draw_revision(rng):
    vehicle = rng.choice(VEHICLES)
    return {"vehicle": vehicle, "noun": vehicle.rsplit(" ", 1)[1], "dm": day_month(rng)}


def draw_appointment(rng):
    word, what = rng.choice(APPOINTMENTS)
    return {"word": word, "what": what}


def draw_phone(rng):
    return {"pro": rng.choice(PROFESSIONALS),
            "phone": f"6{rng.randint(10, 99)} {rng.randint(100, 999)} {rng.randint(100, 999)}"}  # fmt: skip


def one_of(name, pool, short_name=None):
    """A drawer of one value of pool under name (and its short() form under short_name)."""

    def draw(rng):
        value = rng.choice(pool)
        return {name: value, short_name: short(value)} if short_name else {name: value}

    return draw


# Each kind of fact: values drawn in order (besides who, o for the gender's ending and short for
# short(who)), then (clause as said after "que", topic as they refer to it, the words a search needs).
FACTS = (
    ((lambda rng: {"dm": day_month(rng)},),
     "el cumpleaños de {who} es el {dm}", "el cumpleaños de {who}", "cumpleaños {short}"),
    ((one_of("allergen", ALLERGENS),), "{who} es alérgic{o} a {allergen}", "la alergia de {who}", "alérgic{o} {short}"),
    ((one_of("food", FOODS_DISLIKED),), "a {who} no le gusta {food}", "lo que no le gusta a {who}", "gusta {short}"),
    ((draw_revision,),
     "la revisión {vehicle} es el {dm}", "la revisión {vehicle}", "revisión {noun}"),
    ((lambda rng: {"code": rng.randint(1000, 9999)},), "el código del portal es {code}", "el código del portal",
     "código portal"),
    ((draw_wifi,), "la clave del wifi {place} es {word}", "la clave del wifi {place}", "clave wifi {where}"),
    ((draw_appointment, draw_when, lambda rng: {"hour": clock_time(rng)}),
     "{who} tiene {what} el {when} a las {hour}", "lo de {word} de {who}", "{word} {short}"),
    ((one_of("garment", GARMENTS), one_of("size", SIZES)),
     "mi talla de {garment} es la {size}", "mi talla de {garment}", "talla {garment}"),
    ((one_of("vehicle", ("coche", "carro", "auto")), one_of("spot", SPOTS)),
     "el {vehicle} está aparcado en {spot}", "dónde está aparcado el {vehicle}", "aparcado {vehicle}"),
    ((one_of("spot", KEY_SPOTS),), "la copia de las llaves está en {spot}", "la copia de las llaves", "copia llaves"),
    ((one_of("activity", ACTIVITIES), lambda rng: {"hour": clock_time(rng)}),
     "{who} sale de {activity} a las {hour}", "la hora de {activity} de {who}", "{activity} {short}"),
    ((one_of("thing", INSURED), lambda rng: {"dm": day_month(rng)}),
     "el seguro del {thing} vence el {dm}", "el seguro del {thing}", "seguro {thing}"),
    ((lambda rng: dict(zip(("d1", "d2"), rng.sample(WEEKDAYS[:5], 2), strict=True)),),
     "el camión de la basura pasa los {d1} y {d2}", "el camión de la basura", "camión basura"),
    ((one_of("group", GROUPS, "short_group"), one_of("day", WEEKDAY), lambda rng: {"hour": clock_time(rng)}),
     "la reunión de {group} es el {day} a las {hour}", "la reunión de {group}", "reunión {short_group}"),
    ((draw_phone,), "el teléfono del {pro} es el {phone}", "el teléfono del {pro}", "teléfono {pro}"),
    ((one_of("pet", PETS, "short_pet"), lambda rng: {"dm": day_month(rng)}),
     "{pet} tiene vacuna el {dm}", "la vacuna de {pet}", "vacuna {short_pet}"),
    ((one_of("title", TITLES), one_of("surname", SURNAMES)),
     "el médico de {who} es {title} {surname}", "el médico de {who}", "médico {short}"),
)  # fmt: skip


def memory_fact(rng):
    """A fact a member may ask to keep: {"clause": as said after "que", "topic": how they refer to it,
    "query": the words a search for it needs, "text": the clause as a memory}."""
    who, gender = person(rng)
    values = {"who": who, "o": "a" if gender == "f" else "o", "short": short(who)}
    draws, *templates = FACTS[rng.randrange(len(FACTS))]
    for draw in draws:
        values.update(draw(rng))
    clause, topic, query = (template.format(**values) for template in templates)
    return {"clause": clause, "topic": topic, "query": query, "text": clause[0].upper() + clause[1:]}


REMEMBER = ("Recuerda que {c}", "Apunta que {c}", "Acuérdate de que {c}", "No te olvides de que {c}",
            "Guarda que {c}", "Anota esto: {c}", "Quiero que recuerdes que {c}", "Toma nota: {c}",
            "Memoriza que {c}", "Guárdame esto: {c}", "Apúntate que {c}", "Que no se te olvide que {c}",
            "Recuérdame que {c}", "Ten presente que {c}", "Para que lo sepas: {c}. Guárdalo",
            "Apunta en mis recuerdos que {c}",
            "Esto es importante y no quiero que se me olvide: {c}. Guárdalo en mis recuerdos, por favor",
            "Que {c}: apúntalo en mis recuerdos, que luego se me olvida y no quiero liarla")  # fmt: skip
REMEMBER_FAMILY = ("Recuerda para toda la familia que {c}", "Guarda para todos que {c}",
                   "Apunta en los recuerdos de la familia que {c}", "Que lo sepa toda la familia: {c}",
                   "Recuérdale a toda la familia que {c}", "Anota para toda la casa que {c}",
                   "Guárdalo para la familia: {c}", "Para todos en casa: {c}. Apúntalo")  # fmt: skip
REMEMBER_PRIVATE = ("Solo para mí: recuerda que {c}", "Guárdalo en privado: {c}", "Recuerda, solo para mí, que {c}",
                    "Apunta en privado que {c}")  # fmt: skip
SEARCH_MEMORY = ("¿Qué te dije de {t}?", "¿Recuerdas {t}?", "¿Tienes apuntado algo sobre {t}?",
                 "Busca en mis recuerdos {t}", "¿Te acuerdas de {t}?", "¿Qué tengo guardado sobre {t}?",
                 "Mira en tus recuerdos {t}", "¿Qué te conté de {t}?", "¿Me recuerdas {t}?",
                 "¿Guardaste algo de {t}?", "¿Qué apuntaste sobre {t}?", "Busca lo que te dije de {t}",
                 "¿Sabes algo de {t}? Creo que te lo dije",
                 "Sobre {t}, hace tiempo te lo conté y ahora no me acuerdo bien: ¿qué te dije?")  # fmt: skip
FORGET = ("Olvida {t}", "Borra lo de {t}", "Ya no hace falta que recuerdes {t}", "Quita de tus recuerdos {t}",
          "Olvídate de {t}", "Bórrame lo de {t}", "Elimina {t} de tus recuerdos", "Olvida lo de {t}, ya no sirve",
          "Borra {t}, que ya no vale",
          "Lo de {t} ya no sirve porque lo hemos cambiado todo esta semana, así que bórralo")  # fmt: skip
FORGET_NUMBER = ("Olvida el recuerdo {n}", "Borra el recuerdo número {n}", "Elimina el recuerdo {n}",
                 "Quita el recuerdo {n}", "Borra el {n}", "Olvida el número {n}, por favor",
                 "Puedes borrar el recuerdo {n}?",
                 "El recuerdo {n} ya no sirve de nada porque lo hemos cambiado todo, bórralo")  # fmt: skip
SAVED = ("Hecho, lo he guardado: {x}.", "Guardado: {x}.", "Listo, queda guardado: {x}.",
         "Lo he guardado en tus recuerdos: {x}.", "Apuntado y guardado: {x}.")  # fmt: skip
SAVED_FAMILY = ("Hecho, lo he guardado para toda la familia: {x}.", "Guardado para toda la familia: {x}.",
                "Listo, queda guardado en los recuerdos de la familia: {x}.")  # fmt: skip
FOUND = (
    "Tengo apuntado esto: {x}.",
    "Según tus recuerdos: {x}.",
    "Me dijiste que {y}.",
    "Lo tengo guardado: {x}.",
)
NOT_FOUND = (
    "No tengo nada guardado sobre {t}.",
    "No tengo nada guardado sobre {t}. ¿Quieres que lo apunte?",
    "Lo siento, no hay nada guardado de {t}.",
)
FORGOTTEN = ("Hecho, he borrado el recuerdo {n}: {x}.", "Borrado: {x}.", "Listo, ya lo he borrado: {x}.",
             "He borrado el recuerdo {n}.")  # fmt: skip
FAILED_MEMORY = ("No he podido hacerlo: {why}.", "Lo siento, no he podido: {why}.")


# -----------------------------------------------------------------------------
# No tool: questions the model answers itself, many of them with numbers and dates

NO_TOOL = (
    ("Hola", "¡Hola! ¿En qué puedo ayudarte?"), ("Buenos días", "¡Buenos días! ¿Qué necesitas?"),
    ("Buenas noches", "¡Buenas noches! Que descanses."), ("Gracias por la ayuda", "¡De nada! Aquí estoy."),
    ("Muchas gracias, eres un sol", "¡Gracias a ti! Para lo que necesites."),
    ("¿Quién eres?", "Soy ENLACE, el asistente de la familia. Puedo calcular, decirte la fecha y la hora, buscar en internet y recordar cosas."),
    ("¿Qué sabes hacer?", "Puedo responder preguntas, hacer cuentas, decirte la fecha y la hora, buscar en internet y guardar lo que me pidas recordar."),
    ("¿Cómo se dice {word} en inglés?", "{word} en inglés se dice «{english}»."),
    ("Traduce «{word}» al inglés", "«{word}» en inglés es «{english}»."),
    ("Dame una idea para cenar con {food}", "Puedes preparar {food} a la plancha con una ensalada. Es rápido y ligero."),
    ("¿Qué puedo hacer de comer con {food}?", "Con {food} puedes hacer un guiso sencillo con cebolla, ajo y un poco de arroz."),
    ("Escribe una frase para felicitar a {name} por sus {n} años", "¡Feliz cumpleaños, {name}! {n} años no se cumplen todos los días: que lo disfrutes mucho."),
    ("Ayúdame a decirle a {name} que llegaré tarde", "Puedes escribir: «{name}, llegaré un poco tarde. Lo siento, voy en camino»."),
    ("Escribe un mensaje para dar las gracias a {name}", "«Muchas gracias, {name}, por tu ayuda. Te lo agradezco de corazón»."),
    ("¿Qué es un {thing}?", "{thing_answer}"), ("Cuéntame un chiste corto", "¿Qué le dice un jaguar a otro? ¡Jaguar you!"),
    ("Cuéntame un cuento corto sobre {animal}", "Había una vez {animal} que quería ver el mar. Caminó muchos días y, al llegar, sonrió feliz."),
    ("¿Cuántas patas tiene {animal}?", "{legs}"), ("Dime una palabra que rime con {rhyme}", "{rhyme_answer}"),
    ("Dame un consejo para dormir mejor", "Intenta acostarte siempre a la misma hora y deja el móvil un rato antes."),
    ("¿Qué juego puedo hacer con {name}?", "Podéis jugar al veo veo: uno elige algo que ve y el otro lo adivina con pistas."),
    ("Haz una lista de la compra para una tortilla", "Para una tortilla: huevos, patatas, cebolla, aceite de oliva y sal."),
    ("¿Cómo se escribe «{spell}», con b o con v?", "Se escribe «{spell}»."),
    ("¿Cuántos días tiene {month}?", "{month_days}"),
    ("¿Cuántos días tiene un año bisiesto?", "Un año bisiesto tiene 366 días: febrero tiene 29."),
    ("¿Qué se celebra el 12 de octubre?", "El 12 de octubre es la Fiesta Nacional de España y, en muchos países de América, el Día de la Hispanidad o de la Diversidad Cultural."),
    ("¿En qué año llegó el hombre a la Luna?", "En 1969: el Apolo 11 aterrizó en la Luna el 20 de julio de ese año."),
    ("¿Cuántos lados tiene un {shape}?", "{shape_answer}"),
    ("Escribe una felicitación para el {dm}, que es el santo de {name}", "¡Feliz santo, {name}! Que pases un {dm} estupendo."),
    ("Mi hijo tiene {n} años, ¿qué libro le regalo?", "Para {n} años, un libro de aventuras con ilustraciones suele gustar mucho. Pregunta en tu librería por los más leídos de su edad."),
    ("Tengo {n} invitados a comer, ¿qué preparo?", "Para {n} personas, un arroz o un guiso al centro es fácil de servir. Acompáñalo con una ensalada y fruta de postre."),
    ("¿Qué significa la palabra «{hard}»?", "{hard_answer}"),
    ("Explícame qué es la {science} para un niño", "{science_answer}"),
    ("Recomiéndame una película para ver en familia", "Una película de animación suele gustar a todas las edades. Elige una que dure menos de dos horas si hay niños pequeños."),
    ("¿Me ayudas a escribir una nota para el colegio? {name} faltó el {dm}", "Claro: «Estimada maestra: {name} faltó a clase el {dm} por motivos de salud. Un saludo cordial»."),
    ("¿Cuántos minutos tiene una hora?", "Una hora tiene 60 minutos."),
    ("¿Cuántos meses tiene un año?", "Un año tiene 12 meses."),
    ("Dime tres frutas de verano", "Sandía, melón y melocotón."),
    ("¿Por qué {why}?", "{why_answer}"),
    ("Quedamos el {dm} para cenar, ¿qué me pongo?", "Algo cómodo y arreglado a la vez: unos pantalones oscuros y una camisa o un jersey ligero."),
    ("Estoy aburrido, ¿qué hago?", "Puedes salir a dar un paseo, leer un rato o llamar a alguien a quien hace tiempo que no ves."),
    ("¿Me cuentas una adivinanza?", "Blanco por dentro, verde por fuera; si quieres que te lo diga, espera. ¿Qué es? ¡La pera!"),
)  # fmt: skip
THINGS = {
    "sustantivo": "Un sustantivo es la palabra que nombra personas, animales, cosas o ideas: «mesa», «perro».",
    "adjetivo": "Un adjetivo es la palabra que dice cómo es algo: «grande», «rojo», «simpático».",
    "mamífero": "Un mamífero es un animal que alimenta a sus crías con leche, como la vaca o el delfín.",
    "volcán": "Un volcán es una montaña por la que sale lava, ceniza y gases del interior de la Tierra.",
    "planeta": "Un planeta es un cuerpo grande que gira alrededor de una estrella, como la Tierra alrededor del Sol.",
    "verbo": "Un verbo es la palabra que dice lo que alguien hace o lo que pasa, como «correr» o «llover».",
    "río": "Un río es una corriente de agua que baja por la tierra hasta el mar, un lago u otro río.",
}
ANIMALS = {
    "un gato": "Un gato tiene cuatro patas.", "una araña": "Una araña tiene ocho patas.",
    "una gallina": "Una gallina tiene dos patas.", "una hormiga": "Una hormiga tiene seis patas.",
    "un perro": "Un perro tiene cuatro patas.", "un pulpo": "Un pulpo no tiene patas: tiene ocho brazos.",
}  # fmt: skip
RHYMES = {"casa": "«Masa» rima con «casa».", "sol": "«Col» rima con «sol».", "luna": "«Cuna» rima con «luna».",
          "flor": "«Amor» rima con «flor».", "mar": "«Cantar» rima con «mar».", "gato": "«Zapato» rima con «gato»."}  # fmt: skip
SPELLING = ("vaca", "barco", "volar", "bebé", "nube", "verde", "bosque", "viento", "bicicleta", "avión")
WORDS = {"gato": "cat", "perro": "dog", "casa": "house", "libro": "book", "agua": "water", "manzana": "apple",
         "escuela": "school", "árbol": "tree", "coche": "car", "pájaro": "bird", "leche": "milk", "pan": "bread",
         "mariposa": "butterfly", "ventana": "window", "cuchara": "spoon", "abuela": "grandmother"}  # fmt: skip
FOODS = ("pollo", "merluza", "tofu", "huevos", "verduras", "salmón", "lentejas", "garbanzos", "pasta", "arroz",
         "calabacín", "frijoles", "papas", "atún")  # fmt: skip
MONTH_DAYS = {"enero": 31, "febrero": 28, "marzo": 31, "abril": 30, "mayo": 31, "junio": 30, "julio": 31,
              "agosto": 31, "septiembre": 30, "octubre": 31, "noviembre": 30, "diciembre": 31}  # fmt: skip
SHAPES = {"triángulo": 3, "cuadrado": 4, "pentágono": 5, "hexágono": 6, "octógono": 8}
HARD_WORDS = {"efímero": "«Efímero» quiere decir que dura poco tiempo.",
              "resiliencia": "«Resiliencia» es la capacidad de reponerse de algo difícil.",
              "nostalgia": "«Nostalgia» es la tristeza suave de echar de menos algo o a alguien.",
              "procrastinar": "«Procrastinar» es dejar para más tarde lo que se tendría que hacer ya."}  # fmt: skip
SCIENCE = {"fotosíntesis": "Las plantas usan la luz del sol, el agua y el aire para fabricar su alimento: eso es la fotosíntesis.",
           "gravedad": "La gravedad es la fuerza que hace que las cosas caigan al suelo y que la Luna gire alrededor de la Tierra.",
           "evaporación": "La evaporación es cuando el agua se calienta y se convierte en vapor, como el agua de un charco al sol."}  # fmt: skip
WHYS = {"las hojas se caen en otoño": "Porque con menos luz y frío el árbol deja de alimentarlas y las suelta para ahorrar agua.",
        "llueve": "Porque el vapor de agua sube, se enfría en las nubes y cae en gotas cuando pesan demasiado.",
        "el mar es salado": "Porque los ríos llevan al mar sales de las rocas, y al evaporarse el agua la sal se queda."}  # fmt: skip


def no_tool_case(rng):
    """(question, answer) that needs no tool."""
    question, answer = rng.choice(NO_TOOL)
    word, thing, animal = rng.choice(list(WORDS)), rng.choice(list(THINGS)), rng.choice(list(ANIMALS))
    rhyme, month, shape = rng.choice(list(RHYMES)), rng.choice(MONTHS), rng.choice(list(SHAPES))
    hard, science, why = rng.choice(list(HARD_WORDS)), rng.choice(list(SCIENCE)), rng.choice(list(WHYS))
    days = MONTH_DAYS[month]
    values = {
        "word": word, "english": WORDS[word], "food": rng.choice(FOODS), "name": rng.choice(NAMES),
        "thing": thing, "thing_answer": THINGS[thing], "animal": animal, "legs": ANIMALS[animal],
        "rhyme": rhyme, "rhyme_answer": RHYMES[rhyme], "spell": rng.choice(SPELLING), "n": rng.randint(2, 90),
        "month": month, "month_days": f"{month.capitalize()} tiene {days} días" + (" (29 en los años bisiestos)." if days == 28 else "."),
        "shape": shape, "shape_answer": f"Un {shape} tiene {SHAPES[shape]} lados.", "dm": day_month(rng),
        "hard": hard, "hard_answer": HARD_WORDS[hard], "science": science, "science_answer": SCIENCE[science],
        "why": why, "why_answer": WHYS[why],
    }  # fmt: skip
    answer = answer.format(**values)
    return dress(rng, question).format(**values), answer[0].upper() + answer[1:]
