"""bench/model.py's table: each row is the median of several fresh-process rounds with its min-max, and a
ratio to a peer is taken round by round. (The timings themselves live in `make bench`, not here.)"""

import pytest

from bench import model as bench_model


def rounds_of(step_seconds, tokens_per_step=1000, params=1_000_000):
    return [{"step_s": [s], "tokens_per_step": tokens_per_step, "params": params, "peak_rss_mib": 100.0}
            for s in step_seconds]  # fmt: skip


def test_each_row_prints_the_median_and_min_max_of_its_rounds(capsys):
    rows = {label: rounds_of([1.0, 1.0, 1.0]) for label in bench_model.CONTENDERS}
    rows["nanoGPT"] = rounds_of([1.0, 2.0, 4.0])  # 1000, 500 and 250 tok/s
    rates = bench_model.print_steps("smoke", rows, peak=1e12)
    out = capsys.readouterr().out
    assert rates["nanoGPT"] == [1000.0, 500.0, 250.0]
    assert "median of 3 rounds" in out
    line = next(line for line in out.splitlines() if "nanoGPT " in line and "tok/s (" in line)
    assert "500 (250-1,000) tok/s (rounds 300% apart)" in line


def test_ratios_to_a_peer_are_paired_round_by_round(capsys):
    rows = {label: rounds_of([1.0, 2.0, 4.0]) for label in bench_model.CONTENDERS}
    rows["nanoGPT"] = rounds_of([2.0, 4.0, 8.0])  # every round half the speed of the others
    bench_model.print_steps("smoke", rows, peak=1e12)
    line = next(
        line for line in capsys.readouterr().out.splitlines() if line.split()[1:3] == ["ENLACE,", "full"]
    )
    # a slow round slows both sides: paired, the ratio is 2.00 in every round, however far the rounds
    assert "2.00 (2.00-2.00)x nanoGPT" in line
    assert "1.00 (1.00-1.00)x Qwen3" in line


def test_the_contenders_take_turns_at_running_first(monkeypatch):
    order = []
    monkeypatch.setattr(
        bench_model, "run_child", lambda kind, shape, label, *flags: order.append(label) or {}
    )
    rows = bench_model.step_rounds("smoke", 3)
    n = len(bench_model.CONTENDERS)
    firsts = [order[i * n] for i in range(3)]
    assert firsts == bench_model.CONTENDERS[:3]
    assert all(len(runs) == 3 for runs in rows.values())


def test_a_table_refuses_a_single_round(capsys):
    with pytest.raises(SystemExit) as stop:
        bench_model.main(["table", "--rounds", "1"])
    assert stop.value.code == 2
    assert "a spread needs at least 2 rounds" in capsys.readouterr().err
