"""serve/ask.py: the last stage of a chain asks the served model the serve layer's questions and reports
whether each answer holds its expected text ("69104" for "¿Cuánto es 1234 por 56?"). A stand-in for the
served model's answers, on a real HTTP server of 127.0.0.1, lets the report be checked on a right answer and
on the one the rehearsal's model gave before answers were grounded ("Son 15544.")."""

import contextlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import config
from agent import call_bias
from serve import ask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def standin_model(answer_of):
    """/v1/models and /v1/chat/completions on a free port of 127.0.0.1, each chat answered by answer_of(question);
    yields (base URL, the request bodies received)."""
    bodies = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, payload):
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.reply({"data": [{"id": "enlace-ask"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            text = answer_of(body["messages"][-1]["content"])
            self.reply({"choices": [{"message": {"role": "assistant", "content": text}}]})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def questions():
    return config.load_layer("serve", os.path.join(ROOT, "configs", "serve", "default.yaml"))["ask"][
        "questions"
    ]


@pytest.mark.parametrize(("answer", "found"), [("Son 69104.", True), ("Son 15544.", False)])
def test_the_ask_stage_reports_whether_1234_por_56_was_answered_69104(
    questions, tmp_path, capsys, answer, found
):
    assert {"question": "¿Cuánto es 1234 por 56?", "expect": "69104"} in questions
    run = tmp_path / "run"
    run.mkdir()
    record = {"value": 1.5, "chosen_on": "agent-data/eval.jsonl", "rule": call_bias.RULE, "sweep": []}
    (run / call_bias.FILE).write_text(json.dumps(record))
    words = lambda question: answer if "1234" in question else "Hola, familia."  # noqa: E731
    with standin_model(words) as (url, bodies):
        answers = ask.ask_all(url, "key", questions, 64)
    assert all(
        body["temperature"] == 0 and body["max_tokens"] == 64 for body in bodies
    )  # greedy, as configured
    ask.report(str(tmp_path / "ask"), str(run), answers)
    asked = next(a for a in answers if a["question"] == "¿Cuánto es 1234 por 56?")
    assert asked == {
        "question": "¿Cuánto es 1234 por 56?",
        "expect": "69104",
        "answer": answer,
        "found": found,
    }
    written = json.loads((tmp_path / "ask" / "answers.json").read_text(encoding="utf-8"))
    assert written["answers"] == answers and written["call_bias"] == "1.5"
    page = (tmp_path / "ask" / "answers.md").read_text(encoding="utf-8")
    assert f"expected `69104`: {'found' if found else 'not found'}" in page and "Call bias: 1.5." in page
    out = capsys.readouterr().out
    assert f"ask: {int(found)} of 1 expected answers found" in out
    assert ("missed: ¿Cuánto es 1234 por 56? (expected 69104)" in out) is not found
