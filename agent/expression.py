"""
The calculator's expression language, Spanish first (docs/herramientas.md, "La calculadora"): one reader
shared by the calculadora tool (agent/tools.py) and the grounding (agent/grounding.py, agent/grammar.py),
so that a number the grammar offers is read by the calculator as it was meant.

    expression.evaluate("1.250,5 + 1", limits)        -> Fraction(2503, 2)
    expression.evaluate("100 - 10%", limits)          -> 90   (a share of what precedes it)
    expression.evaluate("10% de 250", limits)         -> 25
    expression.render(Fraction(186, 7), money=True)   -> "26,57"
    expression.read_number("1.000.000")               -> Decimal(1000000)
    expression.number_forms(Decimal("1125.5"))       -> ["1125.5", "1125,5"]

Numbers: a comma is the decimal mark ("2,35"); a point groups thousands where every group after it has
three digits and the first is a number ("1.000", "1.000.000"), else it is the decimal mark ("12.50",
"0.125"); with both marks the last one is the decimal mark ("1.250,5", "1,250.5"). Operators: + - * x ×
· / : ÷ // ** ^ and "%": after a number, a percentage ("15%" is 0.15; after + or - a share of what
precedes it: "100 - 10%" is 90; "10% de 250" is 25), between two numbers the remainder ("10 % 3").
Functions: raíz (sqrt), abs, redondear. Values are exact fractions (money adds up to the cent); a root is
a float. Every error is an ExpressionError with one Spanish line naming what is wrong; nesting, exponents
and sizes are bounded by the agent layer's `calculator` limits, so no input hangs.
"""

import math
import re
import unicodedata
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction

NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
WORD = re.compile(r"[^\W\d_]+")
SYMBOLS = (("**", "**"), ("//", "//"), ("^", "**"), ("*", "*"), ("×", "*"), ("·", "*"), ("/", "/"),
           (":", "/"), ("÷", "/"), ("+", "+"), ("-", "-"), ("−", "-"), ("–", "-"), ("%", "%"), ("(", "("),
           (")", ")"))  # fmt: skip
WORDS = {"x": "*", "por": "*", "de": "de", "mod": "mod", "modulo": "mod"}
FUNCTIONS = {"raiz": "raíz", "sqrt": "raíz", "abs": "abs", "redondear": "redondear", "redondea": "redondear",
             "round": "redondear"}  # fmt: skip
SHOWN = {"**": "**", "//": "//", "*": "*", "/": "/", "+": "+", "-": "-", "%": "%", "de": "de", "mod": "mod"}


class ExpressionError(ValueError):
    """An expression the calculator cannot compute; the message is one Spanish line for the model."""


def plain(text):
    decomposed = unicodedata.normalize("NFD", text.lower())
    return "".join(ch for ch in decomposed if unicodedata.category(ch) != "Mn")


# -----------------------------------------------------------------------------
# Numbers


def read_number(text):
    """The Decimal a number written with digits means, Spanish first (see the module docstring); raises
    ExpressionError for marks that group nothing ("1.2.3")."""
    marks = [ch for ch in text if ch in ".,"]
    if not marks:
        return Decimal(text)
    if len(set(marks)) == 2:
        cut = max(text.rindex("."), text.rindex(","))
        head, fraction = text[:cut], text[cut + 1 :]
        if not thousands(re.split(r"[.,]", head)):
            raise ExpressionError(f"el número {text} no se entiende: agrupa los miles de tres en tres")
        return Decimal(re.sub(r"[.,]", "", head) + "." + fraction)
    groups = text.split(marks[0])
    if len(groups) == 2 and (marks[0] == "," or not thousands(groups)):
        return Decimal(groups[0] + "." + groups[1])
    if thousands(groups):
        return Decimal("".join(groups))
    raise ExpressionError(f"el número {text} no se entiende: agrupa los miles de tres en tres")


def thousands(groups):
    """Whether these digit groups are a number with its thousands grouped: "1", "000", "000"."""
    first = groups[0]
    return 1 <= len(first) <= 3 and first[0] != "0" and all(len(group) == 3 for group in groups[1:])


def number_forms(value):
    """The literals the calculator reads as this Decimal, plain first: "1250", "1.25" and "1,25", but
    "1,125" alone for 1.125 ("1.125" is a thousand one hundred and twenty-five)."""
    text = format(value.normalize(), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    forms = [text, text.replace(".", ",")] if "." in text else [text]
    return [form for form in forms if read_number(form) == value]


# -----------------------------------------------------------------------------
# Tokens


def tokens(expression):
    """[(kind, value, position)]: ("num", Decimal), ("op", "+" ...), ("fn", name); "x" and "por" are
    multiplication, "de" follows a percentage, "mod"/"módulo" is the remainder."""
    found, index = [], 0
    while index < len(expression):
        char = expression[index]
        if char.isspace():
            index += 1
            continue
        number = NUMBER.match(expression, index)
        if number:
            found.append(("num", read_number(number.group()), index))
            index = number.end()
            continue
        symbol = next((s for s, _ in SYMBOLS if expression.startswith(s, index)), None)
        if symbol:
            found.append(("op", dict(SYMBOLS)[symbol], index))
            index += len(symbol)
            continue
        word = WORD.match(expression, index)
        if word:
            name = plain(word.group())
            if name in WORDS:
                found.append(("op", WORDS[name], index))
            elif name in FUNCTIONS:
                found.append(("fn", FUNCTIONS[name], index))
            elif name in ("cuadrada",) and found and found[-1][:2] == ("fn", "raíz"):
                pass  # "raíz cuadrada de 16"
            else:
                known = ", ".join(dict.fromkeys(FUNCTIONS.values()))
                raise ExpressionError(
                    f"no conozco «{shorten(word.group())}»: una cuenta lleva números, operadores y las "
                    f"funciones {known}"
                )
            index = word.end()
            continue
        raise ExpressionError(f"el carácter «{char}» no cabe en una cuenta (posición {index + 1})")
    return found


def shorten(text, limit=20):
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -----------------------------------------------------------------------------
# Parsing: a tree of tuples, ("num", Fraction), ("pct", node), ("neg", node), ("fn", name, node),
# ("bin", op, left, right)


class Parser:
    def __init__(self, expression, max_depth):
        self.items, self.at, self.max_depth, self.depth = tokens(expression), 0, max_depth, 0
        if not self.items:
            raise ExpressionError("la expresión está vacía: escribe una cuenta, como 12*3")

    def peek(self, ahead=0):
        index = self.at + ahead
        return self.items[index] if index < len(self.items) else (None, None, None)

    def take(self):
        item = self.peek()
        self.at += 1
        return item

    def deeper(self):
        self.depth += 1
        if self.depth > self.max_depth:
            raise ExpressionError(f"la expresión anida más de {self.max_depth} paréntesis u operaciones")

    def parse(self):
        tree = self.sum()
        kind, value, position = self.peek()
        if kind is not None:
            if (kind, value) == ("op", ")"):
                raise ExpressionError(f"sobra un «)» en la posición {position + 1}")
            raise ExpressionError(f"falta un operador antes de la posición {position + 1}")
        return tree

    def sum(self):
        tree = self.product()
        while self.peek()[:2] in (("op", "+"), ("op", "-")):
            operator = self.take()[1]
            tree = ("bin", operator, tree, self.product())
        return tree

    def product(self):
        tree = self.unary()
        while True:
            kind, value, position = self.peek()
            if kind != "op" or value not in ("*", "/", "//", "%", "mod", "de"):
                return tree
            if value == "de" and tree[0] != "pct":
                raise ExpressionError("«de» solo va detrás de un porcentaje, como en «10% de 250»")
            self.take()
            operator = "*" if value == "de" else "mod" if value == "%" else value
            tree = ("bin", operator, tree, self.unary())

    def unary(self):
        if self.peek()[:2] not in (("op", "-"), ("op", "+")):
            return self.power()
        self.deeper()
        sign = self.take()[1]
        operand = self.unary()
        self.depth -= 1
        return ("neg", operand) if sign == "-" else operand

    def power(self):
        base = self.percent()
        if self.peek()[:2] == ("op", "**"):
            self.take()
            return ("bin", "**", base, self.unary())
        return base

    def percent(self):
        tree = self.primary()
        if self.peek()[:2] == ("op", "%") and not self.starts_operand(self.peek(1)):
            self.take()
            return ("pct", tree)
        return tree

    @staticmethod
    def starts_operand(item):
        kind, value, _ = item
        return kind in ("num", "fn") or (kind == "op" and value in ("(", "-", "+"))

    def primary(self):
        kind, value, position = self.take()
        if kind == "num":
            return ("num", Fraction(value))
        if kind == "fn":
            self.deeper()
            if self.peek()[:2] == ("op", "de"):
                self.take()
            tree = ("fn", value, self.percent())
            self.depth -= 1
            return tree
        if (kind, value) == ("op", "("):
            self.deeper()
            tree = self.sum()
            self.depth -= 1
            if self.peek()[:2] != ("op", ")"):
                raise ExpressionError(f"falta cerrar el paréntesis abierto en la posición {position + 1}")
            self.take()
            return tree
        if kind is None:
            last = self.items[-1][1]
            raise ExpressionError(f"falta un número al final, después de «{SHOWN.get(last, last)}»")
        raise ExpressionError(
            f"falta un número antes de «{SHOWN.get(value, value)}» (posición {position + 1})"
        )


# -----------------------------------------------------------------------------
# Evaluating


def evaluate(expression, limits):
    """The value (Fraction, or float after a root) of an expression under the agent layer's calculator
    limits (max_expression_chars, max_depth, max_exponent, max_result_digits); raises ExpressionError."""
    if len(expression) > limits["max_expression_chars"]:
        raise ExpressionError(
            f"la expresión tiene {len(expression)} caracteres; el máximo es {limits['max_expression_chars']}"
        )
    tree = Parser(expression, limits["max_depth"]).parse()
    try:
        return value_of(tree, limits)
    except ZeroDivisionError:
        raise ExpressionError("no se puede dividir entre cero") from None
    except OverflowError:
        raise ExpressionError("el resultado es demasiado grande") from None


def value_of(tree, limits):
    kind = tree[0]
    if kind == "num":
        return checked(tree[1], limits)
    if kind == "pct":
        return checked(value_of(tree[1], limits) / 100, limits)
    if kind == "neg":
        return -value_of(tree[1], limits)
    if kind == "fn":
        return function(tree[1], value_of(tree[2], limits))
    _, operator, left_tree, right_tree = tree
    left, right = value_of(left_tree, limits), value_of(right_tree, limits)
    if operator in ("+", "-") and right_tree[0] == "pct":  # "100 - 10%": a share of what precedes it
        right = left * right
    if operator == "+":
        value = left + right
    elif operator == "-":
        value = left - right
    elif operator == "*":
        value = left * right
    elif operator == "/":
        value = left / right
    elif operator == "//":
        value = left // right
    elif operator == "mod":
        value = left % right
    else:
        value = power(left, right, limits)
    return checked(value, limits)


def power(base, exponent, limits):
    if abs(exponent) > limits["max_exponent"]:
        raise ExpressionError(f"el exponente {render(exponent)} supera el máximo de {limits['max_exponent']}")
    if base == 0 and exponent < 0:
        raise ZeroDivisionError
    whole_exponent = isinstance(exponent, Fraction) and exponent.denominator == 1
    if base < 0 and not whole_exponent:
        raise ExpressionError("una potencia de base negativa con exponente fraccionario no es un número real")
    if whole_exponent and isinstance(base, Fraction):
        size = max(abs(base.numerator), base.denominator)
        digits = abs(int(exponent)) * math.log10(size) if size > 1 else 0
        if digits > limits["max_result_digits"]:
            raise ExpressionError(
                f"el resultado tendría unas {digits:.0f} cifras; el máximo es {limits['max_result_digits']}"
            )
        return base ** int(exponent)
    return float(base) ** float(exponent)


def function(name, value):
    if name == "raíz":
        if value < 0:
            raise ExpressionError(f"no hay raíz cuadrada de un número negativo ({render(value)})")
        if (
            isinstance(value, Fraction)
            and value.denominator == 1
            and math.isqrt(value.numerator) ** 2 == value
        ):
            return Fraction(math.isqrt(value.numerator))
        return math.sqrt(value)
    if name == "abs":
        return abs(value)
    return Fraction(math.floor(Fraction(value) + Fraction(1, 2))) if value >= 0 else -function(name, -value)


def checked(value, limits):
    most = limits["max_result_digits"]
    if isinstance(value, int):  # Fraction // Fraction is an int
        value = Fraction(value)
    if isinstance(value, float):
        if not math.isfinite(value) or abs(value) >= 10.0**most:
            raise ExpressionError("el resultado es demasiado grande")
        return value
    if max(abs(value.numerator), value.denominator).bit_length() * math.log10(2) > most:
        raise ExpressionError(f"un resultado intermedio supera las {most} cifras")
    return value


# -----------------------------------------------------------------------------
# Showing a value


def render(value, money=False):
    """Spanish notation without thousands separators: "7,5", "0,3333333333"; whole values as integers.
    money: rounded to the cent ("26,57"; a whole amount stays "42")."""
    if money and not (isinstance(value, Fraction) and value.denominator == 1):
        exact = (
            Decimal(value.numerator) / Decimal(value.denominator)
            if isinstance(value, Fraction)
            else Decimal(repr(value))
        )
        cents = exact.quantize(Decimal("0.01"), ROUND_HALF_UP)
        if cents == cents.to_integral_value():
            return str(int(cents))
        return f"{cents:.2f}".replace(".", ",")
    if isinstance(value, Fraction):
        if value.denominator == 1:
            return str(value.numerator)
        value = float(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.10g}".replace(".", ",")
