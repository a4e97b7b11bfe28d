"""evaluation/ladder.py: the agent on a size ladder — a seed already evaluated is read, not trained again,
and the table gives each rung's figures per seed, then the mean and the min–max over its seeds and the worst."""

import os

import pytest
from test_agent_eval import replaying

import fileio
from agent import dataset, tools
from evaluation import ladder, tool_use

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "sft-agent-tiny-cpu.yaml")


@pytest.fixture(scope="module")
def reports():
    """Two seeds' agent_eval.json as evaluation/tool_use.py writes them: one model that replies as the
    references do, one that never calls a tool."""
    settings = tools.load_settings()
    entries = dataset.read_jsonl(tool_use.HANDWRITTEN)
    cases = list(tool_use.handwritten_cases(entries, settings, tools.Agent(settings).count_tokens, 4096))
    quiet = lambda *args: None  # noqa: E731
    right = tool_use.evaluate(cases, replaying(cases), settings, log=quiet)
    silent = tool_use.evaluate(cases, replaying(cases, silent=True), settings, log=quiet)
    return [{"sets": {"generated": report, "hand-written": report}} for report in (right, silent)]


def test_the_table_gives_the_mean_and_the_range_over_the_seeds_there_are(reports, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the runs are <runs_dir>/ladder-<rung>-s<seed>, runs_dir "runs" here
    for seed, report in zip((1, 2), reports, strict=True):
        fileio.write_json(f"runs/ladder-a-s{seed}/agent_eval.json", report)
        fileio.write_json(
            f"runs/ladder-a-s{seed}/train_time.json", {"user_s": 60.0 * seed, "system_s": 0.0, "wall_s": 1}
        )
    rows, seeds = ladder.rung_figures("a", TINY, None, [1, 2, 3])  # seed 3 has not run
    assert seeds == [1, 2]
    none_needed = sum(entry["tool"] is None for entry in dataset.read_jsonl(tool_use.HANDWRITTEN))
    silent_right = 100 * none_needed / reports[1]["sets"]["hand-written"]["counts"]["all"]
    assert rows["hand-written: right tool (%)"] == [100.0, silent_right]
    assert rows["hand-written: ninguna right tool (%)"] == [100.0, 100.0]
    assert rows["hand-written: no tool when none is needed (%)"] == [100.0, 100.0]
    assert rows["hand-written: right tool, needing one (%)"] == [100.0, 0.0]
    assert rows["hand-written: calculadora right tool (%)"] == [100.0, 0.0]
    assert rows["hand-written: fecha_hora key values (%)"] == [100.0, 0.0]
    assert rows["hand-written: answers stating an unsaid number (%)"] == [0.0, 0.0]
    spans = reports[0]["sets"]["hand-written"][
        "counts"
    ]  # four references add a word nobody said ("cartelera")
    assert rows["hand-written: text arguments that are spans (%)"] == [
        100 * spans["spans"] / spans["texts"],
        None,
    ]
    assert rows["hand-written: valid syntax (%)"] == [100.0, None]  # the silent seed made no call to judge
    assert rows["parameters (M)"] == [pytest.approx(0.918272)] * 2
    assert (
        rows["SFT tokens (M)"] == [1456 * 2 * 2048 / 1e6] * 2 and rows["pretraining tokens (M)"] == [0.0] * 2
    )
    assert rows["SFT CPU time (min)"] == [1.0, 2.0]
    text = ladder.table([("a", TINY, None), ("b", TINY, None)], [1, 2, 3])
    line = next(line for line in text.splitlines() if line.startswith("hand-written: right tool (%)"))
    mean = (100 + silent_right) / 2
    assert line.split()[-7:] == [
        "100.0",
        f"{silent_right:.1f}",
        f"{mean:.1f}",
        f"({silent_right:.1f}–100.0)",
        f"{silent_right:.1f}",
        "-",
        "-",
    ]  # fmt: skip (b has no seed: two dashes)
    cpu = next(line for line in text.splitlines() if line.startswith("SFT CPU time"))
    assert cpu.split()[-4:] == ["(1.0–2.0)", "2.0", "-", "-"]  # more minutes are the worse
    assert text.splitlines()[0].split()[:5] == ["s1", "s2", "a", "(2", "seeds)"] and "b (0 seeds)" in text


def test_a_seed_already_evaluated_is_not_trained_again(reports, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    fileio.write_json("runs/ladder-a-s1/agent_eval.json", reports[0])
    ladder.climb([("a", TINY, None)], [1], "data/agent/eval.jsonl")  # would fail: no data to train on here
    assert "+ " not in capsys.readouterr().out


def test_a_long_rung_name_keeps_its_column_apart_from_the_next(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rungs = [("a-whole-digits", TINY, None), ("b-whole-digits", TINY, None)]
    header = ladder.table(rungs, [1]).splitlines()[0]
    assert header.split() == [
        "a-whole-digits",
        "(0",
        "seeds)",
        "worst",
        "b-whole-digits",
        "(0",
        "seeds)",
        "worst",
    ]
    assert "worst  b-whole-digits" in header


def test_a_cell_is_the_mean_and_the_range_or_one_value_or_a_dash():
    assert ladder.cell([40.0, 50.0, 60.0]) == "50.0 (40.0–60.0)"
    assert ladder.cell([46.4]) == "46.4" and ladder.cell([7.0, 7.0]) == "7.0" and ladder.cell([]) == "-"
    assert (
        ladder.cell([None, 5.0]) == "5.0" and ladder.worst("x: right tool (%)", [40.0, None, 60.0]) == "40.0"
    )
    assert ladder.worst("x: answers stating an unsaid number (%)", [0.0, 2.5]) == "2.5"


def test_a_rung_needs_a_name_and_one_or_two_run_files(capsys):
    with pytest.raises(SystemExit) as exit_info:
        ladder.main(["--rung", "a"])
    assert exit_info.value.code == 2 and "give NAME SFT_CONFIG [PRETRAIN_CONFIG]" in capsys.readouterr().err
    assert ladder.main(["--rung", "a", "configs/no-such-run.yaml", "--table"]) == 2
    assert "no-such-run.yaml" in capsys.readouterr().err


def test_a_disk_that_fills_while_climbing_ends_the_ladder_with_one_line_and_exit_74(monkeypatch, capsys):
    def full_disk(*args):  # as fileio.write_json of a seed's train_time.json on a full disk
        raise fileio.StorageError("runs/a/train_time.json", "full", free=0)

    monkeypatch.setattr(ladder, "climb", full_disk)
    assert ladder.main(["--rung", "a", TINY, "--seeds", "1"]) == fileio.STORAGE_EXIT
    err = capsys.readouterr().err
    assert err.startswith("error: runs/a/train_time.json: the disk is full") and err.count("\n") == 1


def test_a_grounding_mode_reads_and_writes_its_own_report_beside_the_runs(
    reports, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    fileio.write_json("runs/ladder-a-s1/agent_eval-hint.json", reports[1])
    fileio.write_json("runs/ladder-a-s1/agent_eval.json", reports[0])
    rows, seeds = ladder.rung_figures("a", TINY, None, [1], grounding_mode="hint")
    assert seeds == [1] and rows["hand-written: calculadora right tool (%)"] == [0.0]
    assert rows["hand-written: calculadora value right (%)"] == [0.0]
    assert ladder.rung_figures("a", TINY, None, [1])[0]["hand-written: calculadora value right (%)"] == [
        100.0
    ]
    ladder.climb([("a", TINY, None)], [1], "data/agent/eval.jsonl", grounding_mode="hint")
    assert "+ " not in capsys.readouterr().out  # evaluated in that mode already: nothing runs
