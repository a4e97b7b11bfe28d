"""plot.py: curves of runs from their metrics.jsonl."""

import json

import pytest

import plot


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
    }


def test_a_run_without_metrics_is_a_clear_error(tmp_path, capsys):
    assert plot.main([str(tmp_path)]) == 2
    assert f"{tmp_path}/metrics.jsonl: not found" in capsys.readouterr().err
    broken = write_metrics(tmp_path / "broken", [])
    (tmp_path / "broken" / "metrics.jsonl").write_text('{"step": 1, "loss": 2}\n{oops\n')
    with pytest.raises(plot.PlotError, match=r"broken/metrics.jsonl:2: not JSON"):
        plot.read_metrics(broken)
