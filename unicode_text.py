"""
Text from outside: request bodies, conversations and command lines. JSON's "\\ud800" escape and Python's
surrogateescape decoding of bytes that are not UTF-8 both give lone surrogates: valid str, but not Unicode
text, and every UTF-8 writer (SQLite, sentencepiece, a JSON answer, the terminal) fails on them.

The one rule of what text is acceptable (LONE_SURROGATE), below everything that reads text from outside:
serve/openai_api.py's check of a request's text, chat/template.py's check of a conversation, and every
command line that takes text (undecodable_argument).
"""

import os
import re
import sys

LONE_SURROGATE = re.compile("[\ud800-\udfff]")
NOT_TEXT = "is not Unicode text; send UTF-8 text"


def text_problem(value, max_depth=None, where=""):
    """(path, why) of the first string of a JSON-like value (a dict's keys included) that holds a lone
    surrogate, or of nesting deeper than max_depth; None when every string is text. The path joins keys and
    list indices with dots ("messages.0.content"; `where` for the value itself). A loop, not recursion: a
    deep value costs no stack."""
    pending = [(value, where, 0)]
    while pending:
        item, path, depth = pending.pop()
        if isinstance(item, str):
            found = LONE_SURROGATE.search(item)
            if found:
                code = f"\\u{ord(found.group()):04x}"
                return path, f"a lone surrogate ({code} at character {found.start()}) {NOT_TEXT}"
            continue
        if not isinstance(item, (dict, list)):
            continue
        if max_depth is not None and depth >= max_depth:
            return path, f"nested deeper than {max_depth} levels"
        children = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in reversed(list(children)):
            inner = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and LONE_SURROGATE.search(key):
                return path, f"a key ({ascii(key)}) holds a lone surrogate, which {NOT_TEXT}"
            pending.append((child, inner, depth + 1))
    return None


def undecodable_argument(argv):
    """Why a command-line argument cannot be used as text, or None. Python decodes arguments with the
    locale's encoding and turns bytes that are not in it into lone surrogates (surrogateescape): the terminal
    sent another encoding than its locale says. No guess is made (Latin-1 decodes any bytes, so a wrong guess
    would store wrong text without a sign): the person sets the terminal to the locale's encoding."""
    for argument in argv:
        if LONE_SURROGATE.search(argument):
            encoding = sys.getfilesystemencoding().upper()
            locale = os.environ.get("LC_ALL") or os.environ.get("LANG") or "unset"
            return (
                f"the argument '{ascii(os.fsencode(argument))[2:-1]}' is not valid {encoding}: the terminal "
                f"sends another encoding than its locale (LANG {locale}) says; set the terminal to {encoding} "
                "and type it again"
            )
    return None
