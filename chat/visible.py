"""
What of a model's reply a person may see, and which tokens a reply may never hold: the one place that
decides it, used by the server (the API's content, the page's stream, what is stored), agent/tools.py's
loop and `sample.py --chat`.

A reply is text, then its calls (chat.render's layout). The person sees the text only, and never anything of
the protocol in it:

    shown(text, final)    the text up to the first thing that is protocol: a tool tag (<tool_call>, also
                          spelled in pieces or spaced, "<tool_call >", "< /tool_call>"), a control token's
                          spelling ("<|user|>"), or call-shaped JSON ({"name": ...}, a "key": value pair
                          such as '", "ambito": "familia", "arguments": {...}'): a model that writes a call
                          as text has its call cut, never shown. While the reply still grows (final=False)
                          an ending that could still become one of those is held back.
    ProtocolBan(inner)    a constraint (mask/accept, see engine.Decoder.sample) that forbids the control
                          tokens but <|end|> and <|eos|>, and the tags the template alone writes
                          (<tool_response>, <tools> and their closers), in every generation; without tools on
                          offer also <tool_call> and </tool_call>. inner (agent/grammar.py's constraint of the
                          calls, or None) runs first.

Stop strings of a request apply to shown text only (serve/openai_api.py's Reply), never inside a call.
"""

import re

# Tokens only the template writes: a generation never produces them (the reply's own end is <|end|>/<|eos|>).
# data.CONTROL_TOKENS and data.TOOL_TAGS but the reply's own (this module stays free of torch; a test keeps
# them equal).
TEMPLATE_ONLY = (
    "<|bos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    *(f"<|reserved_{i}|>" for i in range(8)),
    "<tool_response>",
    "</tool_response>",
    "<tools>",
    "</tools>",
)
CALL_TAGS = ("<tool_call>", "</tool_call>")

# A tag or control token spelled out of pieces, spaced, or escaped as chat.plain_text writes it.
TAG = re.compile(
    r"(?:<|&lt;)\s*/?\s*(?:tool[\s_]*(?:call|response)|tools)\s*(?:>|&gt;)|<\|\s*\w+\s*\|>", re.I
)
# Call-shaped JSON: an object opening with a key, or a "key": value pair (a call's arguments written as text).
CALL_JSON = re.compile(r'\{\s*"\w+"\s*:|"\w+"\s*:\s*["{\[\d-]|"\w+"\s*:\s*(?:true|false|null)\b')
# What a cut leaves at its end: the punctuation that joined the fragment to the text.
JOINING = ' \t\n,:;{["'
# While a reply grows, endings that may still become a tag or call-shaped JSON, and the punctuation before
# them that a cut would take too.
PARTIAL = re.compile(
    r'(?:<|&(?:l(?:t;?)?)?)[\sa-zA-Z_/|;&]{0,24}|"\w*(?:"\s*(?::\s*)?)?|\{\s*(?:"\w*(?:"\s*(?::\s*)?)?)?'
)
HELD_JOINING = re.compile(r'[\s,:;{\["]*["{\[][\s,:;{\["]*$|\n+$')  # with a quote or brace; or newlines
HOLD_CHARS = 40  # longer than a tag spelled with spaces and than a call's '"key": ' with a long key


def protocol_start(text):
    """Where the first piece of protocol in text starts (len(text) when there is none)."""
    starts = [match.start() for pattern in (TAG, CALL_JSON) for match in [pattern.search(text)] if match]
    return min(starts, default=len(text))


def held_from(text):
    """Where the ending that may still become protocol starts (len(text) when nothing is held)."""
    at = next(
        (
            at
            for at in range(max(0, len(text) - HOLD_CHARS), len(text))
            if text[at] in '<&"{' and PARTIAL.fullmatch(text, at)
        ),
        len(text),
    )
    joined = HELD_JOINING.search(text[:at])
    return joined.start() if joined else at


def shown(text, final=True):
    """The prefix of a reply's text a person may see (see the module docstring)."""
    start = protocol_start(text)
    if start < len(text):
        return text[:start].rstrip(JOINING)
    return text if final else text[: held_from(text)]


class ProtocolBan:
    """Forbids TEMPLATE_ONLY (and, with calls not allowed, the call tags) in every token of a reply; inner
    (a constraint or None) masks first and is told each token."""

    def __init__(self, token_ids, inner=None, calls_allowed=False):
        """token_ids: piece -> id (data.TOKEN_TABLE, which every ENLACE tokenizer holds)."""
        banned = [token_ids[piece] for piece in TEMPLATE_ONLY]
        if not calls_allowed:
            banned += [token_ids[piece] for piece in CALL_TAGS]
        self.banned, self.inner = banned, inner

    def mask(self, logits):
        if self.inner is not None:
            logits = self.inner.mask(logits)
        logits[self.banned] = float("-inf")
        return logits

    def accept(self, token):
        if self.inner is not None:
            self.inner.accept(token)

    def __getattr__(self, name):  # the inner constraint's state (calls, in_call) for whoever reads it
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)
