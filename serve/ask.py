"""
python -m serve.ask RUN OUT [serve.key=value ...]: the served model, asked as a family asks it.

Starts `python -m serve RUN` on a free port of 127.0.0.1 with a database of its own in OUT, adds one adult
member, asks the serve layer's ask.questions through the OpenAI API (POST /v1/chat/completions, temperature 0:
greedy) with the server's own tools, and writes OUT/answers.json and OUT/answers.md: each question, its
answer and whether the answer holds the question's `expect` text ("69104" for "¿Cuánto es 1234 por 56?",
which only a calculator call with the question's own numbers reaches). The last stage of a chain (make
rehearsal): a run ends having shown what its model does when it is served. An answer that misses its
expected text is reported, not an error: the stage measures the model, it does not judge it.
"""

import argparse
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import config
import fileio
from agent import call_bias

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "serve", "default.yaml")


class AskError(Exception):
    """The server did not start or did not answer; printed in one line, exit status 1."""


def start_server(run, database, log_path, overrides=()):
    """serve/app.py in a subprocess on a free port: (process, base URL); its stderr goes to log_path."""
    command = [sys.executable, "-m", "serve", run, "--port", "0", f"serve.database={database}", *overrides]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    line = proc.stdout.readline()
    if " at http://" not in line:
        proc.kill()
        proc.wait()
        raise AskError(f"the server did not start on {run}; its log: {log_path}")
    return proc, line.split(" at ")[1].split()[0].rstrip("/")


def add_member(database, log_path):
    """`python -m serve member add`: the new member's API key."""
    command = [sys.executable, "-m", "serve", "member", "add", "ask", "--role", "adult",
               f"serve.database={database}"]  # fmt: skip
    added = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(added.stderr)
    if added.returncode != 0:
        raise AskError(f"python -m serve member add failed (exit {added.returncode}); its log: {log_path}")
    return added.stdout.strip().splitlines()[-1]


def call(url, key, path, body=None):
    """The JSON reply of GET (or POST with a body) to the server's API, or an AskError naming the path."""
    request = urllib.request.Request(
        url + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        raise AskError(f"{path}: the server answered {e.code}: {e.read().decode(errors='replace')}") from None
    except (urllib.error.URLError, TimeoutError) as e:
        raise AskError(f"{path}: no answer from {url} ({e})") from None


def ask(url, key, model, question, max_tokens):
    """The answer of POST /v1/chat/completions to one user turn, greedy."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": max_tokens}  # fmt: skip
    reply = call(url, key, "/v1/chat/completions", body)
    return reply["choices"][0]["message"]["content"] or ""


def write_answers(out, run, answers):
    """OUT/answers.json and OUT/answers.md: each question, its answer and whether it holds the expected text,
    and the call bias the run was served with (agent/call_bias.py)."""
    bias = call_bias.chosen(run)
    served = "agent.call_bias.value (the run has no call_bias.json)" if bias is None else f"{bias['value']:g}"
    fileio.write_json(
        os.path.join(out, "answers.json"), {"run": run, "call_bias": served, "answers": answers}
    )
    lines = [f"# The served model, asked ({run})", "", f"Call bias: {served}.", ""]
    for item in answers:
        lines += [f"**{item['question']}**", "", "> " + item["answer"].replace("\n", "\n> "), ""]
        if item["expect"] is not None:
            lines += [f"expected `{item['expect']}`: {'found' if item['found'] else 'not found'}", ""]
    fileio.write_atomic(os.path.join(out, "answers.md"), lambda f: f.write("\n".join(lines).encode()))


def ask_all(url, key, questions, max_tokens):
    """Each question asked of the server at url: [{question, expect, answer, found}], printed as it comes."""
    model = call(url, key, "/v1/models")["data"][0]["id"]
    answers = []
    for item in questions:
        answer = ask(url, key, model, item["question"], max_tokens)
        expect = item.get("expect")
        found = None if expect is None else expect in answer
        answers.append({"question": item["question"], "expect": expect, "answer": answer, "found": found})
        mark = "" if found is None else f"  [{expect}: {'found' if found else 'not found'}]"
        print(f"ask: {item['question']}\n  -> {answer!r}{mark}", flush=True)
    return answers


def report(out, run, answers):
    """Write the answers and print how many expected texts were found, naming each one missed."""
    write_answers(out, run, answers)
    expected = [a for a in answers if a["found"] is not None]
    missed = "".join(
        f"; missed: {a['question']} (expected {a['expect']})" for a in expected if not a["found"]
    )
    print(f"ask: {sum(a['found'] for a in expected)} of {len(expected)} expected answers found{missed}; "
          f"{os.path.join(out, 'answers.md')}")  # fmt: skip


def run_questions(run, out, questions, max_tokens, overrides=()):
    os.makedirs(out, exist_ok=True)
    database, log_path = os.path.join(out, "ask.sqlite"), os.path.join(out, "serve.log")
    for stale in (database, database + "-wal", database + "-shm"):  # a cut earlier try's members
        if os.path.exists(stale):
            os.remove(stale)
    key = add_member(database, log_path)
    proc, url = start_server(run, database, log_path, overrides)
    try:
        answers = ask_all(url, key, questions, max_tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    report(out, run, answers)
    return answers


def parse_args(argv):
    """(arguments, the serve.key=value overrides: the server gets them and so does the ask section)."""
    overrides = [a for a in argv if config.is_override(a, "serve")]
    parser = argparse.ArgumentParser(prog="python -m serve.ask", description=__doc__.strip().splitlines()[0])
    parser.add_argument("run", help="run directory (newest checkpoint)")
    parser.add_argument("out", help="folder for the answers, the server's log and its database")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="serve layer file: its ask section")
    parser.epilog = "serve.key=value words go to the server too (e.g. serve.compile.cpu=off)."
    return parser.parse_args([a for a in argv if a not in overrides]), overrides


@fileio.takes_text_arguments()
@fileio.reports_storage_errors
def main(argv):
    args, overrides = parse_args(argv)
    if not os.path.isdir(args.run):
        print(f"error: {args.run}: no such run folder", file=sys.stderr)
        return 2
    try:
        asking = config.load_layer("serve", args.config, overrides)["ask"]
    except config.ConfigError as e:
        print(f"{args.config}: config problems:\n  " + "\n  ".join(e.problems), file=sys.stderr)
        return 2
    try:
        run_questions(args.run, args.out, asking["questions"], asking["max_tokens"], overrides)
    except AskError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
