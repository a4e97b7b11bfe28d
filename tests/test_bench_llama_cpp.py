"""bench/llama_cpp.py: ENLACE's decoding beside llama.cpp's on the same weights. The table pairs each ratio
round by round and the configurations take turns. That both sides decode the same greedy tokens, stream
by stream, is tests/test_export.py's (where llama-cpp-python is installed). Timings live in
`make bench ARGS=llama`."""

import pytest

from bench import llama_cpp as bench_llama_cpp


def run_of(rate):
    return {"compile_s": 1.0, **{str(s): rate * s for s in bench_llama_cpp.STREAMS},
            **{f"bytes{s}": 1e6 for s in bench_llama_cpp.STREAMS}}  # fmt: skip


def test_ratios_to_llama_cpp_are_paired_round_by_round(capsys):
    rows = {name: [run_of(100), run_of(200), run_of(400)] for name in bench_llama_cpp.CONFIGURATIONS}
    rows["llama.cpp f32"] = [run_of(50), run_of(100), run_of(200)]  # every round half of ENLACE's rate
    bench_llama_cpp.print_table("smoke", rows, bandwidth=1e9)
    lines = capsys.readouterr().out.splitlines()
    one_stream = next(line for line in lines if "ENLACE float32 " in line and "|       1 |" in line)
    # a slow round slows both sides: paired, the ratio is 2.00 in every round, however far the rounds
    assert "2.00 (2.00-2.00)x" in one_stream
    assert "200 (100-400)" in one_stream
    assert "20%" in one_stream  # 200 tok/s x 1 MB per step of 1 GB/s
    q8_0 = next(line for line in lines if "ENLACE int8 kernel " in line and "|       8 |" in line)
    assert "1.00 (1.00-1.00)x" in q8_0  # int8 beside llama.cpp q8_0, not f32


def test_the_configurations_take_turns_at_running_first(monkeypatch):
    order = []
    monkeypatch.setattr(
        bench_llama_cpp, "run_child", lambda folder, shape, name, profile: order.append(name) or {}
    )
    rows = bench_llama_cpp.rounds_of("folder", "smoke", 3)
    n = len(bench_llama_cpp.CONFIGURATIONS)
    assert [order[i * n] for i in range(3)] == list(bench_llama_cpp.CONFIGURATIONS[:3])
    assert all(len(runs) == 3 for runs in rows.values())


def test_a_table_refuses_a_single_round(capsys):
    with pytest.raises(SystemExit) as stop:
        bench_llama_cpp.main(["table", "--rounds", "1"])
    assert stop.value.code == 2
    assert "a spread needs at least 2 rounds" in capsys.readouterr().err


def test_a_table_of_some_configurations_pairs_each_with_its_peer_where_the_peer_ran(capsys):
    names = ("ENLACE int8 kernel aot", "llama.cpp q8_0", "ENLACE float32 kernel")
    bench_llama_cpp.print_table("smoke", {name: [run_of(100), run_of(300)] for name in names}, bandwidth=1e9)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "|       1 |" in line]
    assert [line.split("|")[0].removeprefix("llama:").strip() for line in lines] == list(names)
    assert lines[0].endswith("1.00 (1.00-1.00)x")  # int8 beside q8_0
    assert lines[2].rstrip().endswith("|")  # llama.cpp f32 did not run: no ratio
    assert "compiling the step of ENLACE int8 kernel aot" in out
