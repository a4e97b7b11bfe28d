"""
The decision to call, calibrated: agent.call_bias.value is added to the logit of <tool_call> against text at
the first token of a reply that may open a call (agent/grammar.py, ToolCallConstraint), in every caller of
the agent loop (the server, sample.py --chat, the evaluation).

A run's own bias is chosen on its *generated* evaluation set (agent/dataset.py's held-out split, never the
hand-written prompts) by python -m evaluation.tool_use and written to RUN/call_bias.json; settings_for_run
puts it in the agent settings wherever the run is served, sampled or evaluated, and the report card shows it.

    decisions = [Decision(needed, margin, called, words), ...]   # one per prompt of the generated set
    value, rows = call_bias.choose(decisions, settings["call_bias"]["candidates"])

The sweep costs two greedy replies per prompt, whatever the number of candidates: with greedy decoding a
bias changes only the first token's choice between <tool_call> and the best text token, so a prompt has one
reply that opens a call (its first call names `called`) and one that does not (`words`: the first call it
makes later, if any), and its margin (the <tool_call> logit minus the best other's, after the masks) says
which of the two each bias gives: the call where margin + bias > 0.

The rule: the candidate with the highest mean of "right tool" (the prompts needing a tool whose first call
names it) and "no tool" (the prompts needing none that make no call) — each kind of prompt weighs the same
whatever its share of the set; on a tie the smallest in size (the nearest to the model as trained), then the
lower.
"""

import dataclasses
import json
import os

import fileio

FILE = "call_bias.json"
FORCE = 1e6  # a bias that decides the first token whatever the model's logits: the sweep's two replies
RULE = ("the candidate with the highest mean of right tool (prompts needing a tool) and no tool (prompts "
        "needing none) on the generated set; on a tie the smallest in size, then the lower")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Decision:
    needed: str | None  # the tool the prompt needs, None for none
    # <tool_call>'s logit minus the best other's at the first token; None where no call may open
    margin: float | None
    called: str | None  # the first call's tool of the reply that opens a call
    words: str | None  # the first call's tool of the reply that does not open one at its first token


def opens(decision, bias):
    """Whether a greedy reply under this bias opens a call at its first token."""
    return decision.margin is not None and decision.margin + bias > 0


def outcome(decision, bias):
    """The tool a greedy reply calls first under this bias, or None."""
    return decision.called if opens(decision, bias) else decision.words


def rates(decisions, bias):
    """{"right_tool", "no_tool", "score"} (shares, None where no prompt of the kind) and their counts."""
    needing = [d for d in decisions if d.needed is not None]
    none = [d for d in decisions if d.needed is None]
    right = sum(outcome(d, bias) == d.needed for d in needing)
    silent = sum(outcome(d, bias) is None for d in none)
    row = {"bias": bias, "right_tool": right / len(needing) if needing else None,
           "no_tool": silent / len(none) if none else None,
           "counts": {"right": right, "needing": len(needing), "no_tool": silent, "none": len(none)}}  # fmt: skip
    shares = [share for share in (row["right_tool"], row["no_tool"]) if share is not None]
    row["score"] = sum(shares) / len(shares) if shares else 0.0
    return row


def choose(decisions, candidates):
    """(the chosen bias, the sweep's rows in the candidates' order) by the module's rule."""
    rows = [rates(decisions, bias) for bias in candidates]
    best = max(rows, key=lambda row: (round(row["score"], 9), -abs(row["bias"]), -row["bias"]))
    return best["bias"], rows


def folder_of(run):
    return run if os.path.isdir(run) else os.path.dirname(run)


def chosen(run):
    """RUN/call_bias.json's record ({"value", "chosen_on", "rule", "sweep"}), or None."""
    path = os.path.join(folder_of(run), FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        record = json.load(f)
    if not isinstance(record, dict) or not isinstance(record.get("value"), int | float):
        raise ValueError(
            f"{path}: no number under 'value'; rerun python -m evaluation.tool_use {folder_of(run)}"
        )
    return record


def with_value(settings, value):
    return {**settings, "call_bias": {**settings["call_bias"], "value": value}}


def settings_for_run(settings, run):
    """The agent settings with the run's chosen bias, where it has one (RUN/call_bias.json)."""
    record = chosen(run)
    return settings if record is None else with_value(settings, record["value"])


def write(path, value, rows, chosen_on):
    fileio.write_json(path, {"value": value, "chosen_on": chosen_on, "rule": RULE, "sweep": rows})
