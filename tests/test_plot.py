"""evaluation/plot.py: curves of runs from their metrics.jsonl."""

import json

import pytest

from evaluation import plot


def write_metrics(run, records):
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(run)


def test_plot_writes_a_png_of_several_runs(tmp_path):
    a = write_metrics(
        tmp_path / "a",
        [{"step": 1, "loss": 5.0, "lr": 1e-3}, {"step": 2, "loss": 4.0, "lr": 1e-3}]
        + [{"step": 2, "val_loss": 4.2, "val_bpb": 2.1}],
    )
    b = write_metrics(tmp_path / "b", [{"step": 1, "loss": 3.0, "lr": 5e-4}])
    assert plot.main([a, b]) == 0
    assert (tmp_path / "a" / "plot.png").read_bytes().startswith(b"\x89PNG\r\n")
    assert plot.read_metrics(a) == {
        "train": [(1, 5.0), (2, 4.0)],
        "val_loss": [(2, 4.2)],
        "val_bpb": [(2, 2.1)],
        "lr": [(1, 1e-3), (2, 1e-3)],
        "eval_score": [],
    }


def png_height(path):
    return int.from_bytes(open(path, "rb").read()[20:24], "big")  # IHDR: width, then height


def test_a_run_with_train_eval_gets_a_fourth_panel_with_its_benchmark_score(tmp_path):
    plain = write_metrics(tmp_path / "plain", [{"step": 1, "loss": 5.0, "lr": 1e-3}])
    scored = write_metrics(
        tmp_path / "scored",
        [
            {"step": 1, "loss": 5.0, "lr": 1e-3},
            {"step": 1, "eval_score": 0.1, "eval_tasks": {"copa_es": 0.55}},
        ]
        + [
            {"step": 2, "loss": 4.0, "lr": 1e-3},
            {"step": 2, "eval_score": 0.25, "eval_tasks": {"copa_es": 0.62}},
        ],
    )
    assert plot.read_metrics(scored)["eval_score"] == [(1, 0.1), (2, 0.25)]
    assert plot.main([plain]) == 0 and plot.main([scored, plain]) == 0
    assert png_height(tmp_path / "plain" / "plot.png") == 1000  # loss, bits per byte, learning rate
    assert png_height(tmp_path / "scored" / "plot.png") == 1300  # and the benchmark score


def test_a_run_without_metrics_is_a_clear_error(tmp_path, capsys):
    assert plot.main([str(tmp_path)]) == 2
    assert f"{tmp_path}/metrics.jsonl: not found" in capsys.readouterr().err
    broken = write_metrics(tmp_path / "broken", [])
    (tmp_path / "broken" / "metrics.jsonl").write_text('{"step": 1, "loss": 2}\n{oops\n')
    with pytest.raises(plot.PlotError, match=r"broken/metrics.jsonl:2: not JSON"):
        plot.read_metrics(broken)
