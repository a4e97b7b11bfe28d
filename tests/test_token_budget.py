"""The token budget checked when a pretraining run starts (corpus/token_budget.py)."""

import json
import os

import pytest
from conftest import ROOT, TINY, shard_overrides

import config
import train
from corpus import token_budget
from data import DataError


def mixture_data(tmp_path, **limits):
    """A data section whose manifest says: source `libros` fills 300 of the 1,000 train tokens with 100
    unique ones (3 epochs in the mixture), `web` fills 700 with 700 unique ones."""
    (tmp_path / "manifest.json").write_text(
        json.dumps(
            {
                "encode": {
                    "train": {
                        "complete": True,
                        "tokens": 1000,
                        "mixture": {
                            "libros": {"tokens": 300, "tokens_once": 100, "licence": "x"},
                            "web": {"tokens": 700, "tokens_once": 700, "licence": "y"},
                        },
                    }
                }
            }
        )
    )
    return {"format": "shards", "dir": str(tmp_path)} | limits


def test_the_epochs_of_each_source_are_its_mixture_epochs_times_the_passes_over_the_shards(tmp_path):
    lines = []
    epochs = token_budget.check_token_budget(mixture_data(tmp_path), run_tokens=2000, log=lines.append)
    assert epochs == pytest.approx({"libros": 6.0, "web": 2.0})
    assert lines == [
        "data: the run reads 2,000 tokens; the train shards hold 1,000 (2.00 passes); "
        "epochs per source: libros 6.00, web 2.00"
    ]


def test_past_warn_epochs_the_start_warns_and_names_the_source(tmp_path):
    lines = []
    token_budget.check_token_budget(
        mixture_data(tmp_path, warn_epochs=4, max_epochs=8), 2000, log=lines.append
    )
    assert lines[-1].startswith("warning: the run reads libros 6.0 times, past data.warn_epochs 4")
    quiet = []
    token_budget.check_token_budget(
        mixture_data(tmp_path, warn_epochs=4, max_epochs=8), 1000, log=quiet.append
    )
    assert len(quiet) == 1  # 3 epochs of libros: no warning


def test_past_max_epochs_the_run_is_refused_with_the_tokens_that_would_bring_it_within(tmp_path):
    with pytest.raises(DataError) as refused:
        token_budget.check_token_budget(mixture_data(tmp_path, max_epochs=4), 2000, log=lambda line: None)
    message = str(refused.value)
    assert message.startswith("data.max_epochs: the run would read libros 6.0 times, past 4; 50 more train")
    assert "python -m corpus download CONFIG && python -m corpus all CONFIG" in message
    # 50 more unique tokens of libros (same shares of the shards) give exactly 4 epochs: within the limit
    total, sources = token_budget.shard_tokens(mixture_data(tmp_path))
    sources["libros"] = (300, 150)
    assert max(token_budget.epochs_of(2000, total, sources).values()) == pytest.approx(4.0)


def test_without_a_mixture_the_epochs_are_the_passes_over_the_shards_and_bytes_count_one_token_each(tmp_path):
    (tmp_path / "train.bin").write_bytes(b"x" * 500)
    cfg = {"format": "bytes", "dir": str(tmp_path), "max_epochs": 4}
    assert token_budget.check_token_budget(cfg, 1000, log=lambda line: None) == {"train shards": 2.0}
    with pytest.raises(DataError, match=r"train shards 5\.0 times, past 4; 125 more train tokens"):
        token_budget.check_token_budget(cfg, 2500, log=lambda line: None)


def test_no_limit_checks_nothing_and_missing_shards_are_named(tmp_path):
    assert token_budget.check_token_budget(
        mixture_data(tmp_path, max_epochs=None), 10**9, log=lambda line: None
    )
    os.remove(tmp_path / "manifest.json")
    with pytest.raises(DataError, match="no finished train split; run `python -m corpus all CONFIG` first"):
        token_budget.check_token_budget({"format": "shards", "dir": str(tmp_path)}, 10, log=lambda line: None)


@pytest.mark.parametrize("run", ["pretrain-2060", "pretrain-5090", "pretrain-h200"])
def test_the_shipped_pretrain_runs_read_their_sized_corpus_once_so_no_source_passes_four_epochs(run):
    cfg = config.load(os.path.join(ROOT, "configs", f"{run}.yaml"))
    t = cfg["train"]
    run_tokens = t["max_steps"] * t["micro_batch_size"] * t["grad_accum_steps"] * cfg["model"]["seq_len"]
    mixture = cfg["data"]["corpus"]["mixture"]
    # The shards hold the run's tokens (one pass), so each source's epochs in the run are its epochs in
    # the mixture, which encode caps at mixture.max_epochs (or refuses naming the source).
    assert mixture["total_tokens"] == run_tokens
    assert mixture["max_epochs"] <= cfg["data"]["warn_epochs"] < cfg["data"]["max_epochs"]
    assert all("max_epochs" not in source for source in cfg["data"]["corpus"]["sources"])


def test_train_prints_the_budget_at_start_and_refuses_past_max_epochs_before_building_anything(
    shard_data_dir, tmp_path, capsys
):
    run_file = os.path.join(ROOT, "configs", "smoke-corpus-cpu.yaml")
    overrides = [*shard_overrides(shard_data_dir), *TINY, f"train.runs_dir={tmp_path}"]
    lines = []
    train.train(config.load(run_file, overrides), log=lines.append)
    run_tokens = 8 * 4 * 2 * 16  # TINY: max_steps x micro_batch_size x grad_accum_steps x seq_len
    budget_line = next(line for line in lines if line.startswith("data: the run reads"))
    assert budget_line.startswith(f"data: the run reads {run_tokens:,} tokens; the train shards hold ")

    refused = os.path.join(tmp_path, "refused")
    status = train.main([run_file, *overrides, f"train.runs_dir={refused}", "data.max_epochs=0.000000001"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert err[-1].startswith("error: data.max_epochs: the run would read train shards "), err[-1]
    assert "more train tokens are needed" in err[-1]
    assert not os.path.exists(refused)  # refused before the run folder, the model or a checkpoint


def packed_data(tmp_path, data_format, shard_rows, **limits):
    """A run section over packed data whose manifest says the train split has these shards' rows."""
    shards = [{"name": f"train_{i:06d}.bin", "rows": rows} for i, rows in enumerate(shard_rows)]
    prepared = {"complete": True, "seq_len": 16, "shards": shards}
    (tmp_path / "manifest.json").write_text(json.dumps({"prepare": {"train": prepared}}))
    return {
        "data": {"format": data_format, "dir": str(tmp_path)} | limits,
        "train": {"max_steps": 50, "micro_batch_size": 4, "grad_accum_steps": 2},
        "model": {"seq_len": 16},
    }


def test_sft_reports_the_epochs_of_its_packed_rows_steps_x_rows_over_the_rows_it_holds(tmp_path):
    cfg = packed_data(tmp_path, "chat", [60, 40])  # 100 rows; the run reads 50 x 4 x 2 = 400
    lines = []
    assert token_budget.check_run_budget(cfg, log=lines.append) == {"packed conversation rows": 4.0}
    assert lines == [
        "data: the run reads 400 packed conversation rows; the train split holds 100 (4.00 epochs)"
    ]
    assert token_budget.run_epochs(cfg, world_size=2) == {
        "packed conversation rows": 8.0
    }  # two ranks read twice
    # steps x rows x seq_len / data tokens: the same figure from tokens (every row is seq_len + 1 tokens)
    assert 50 * 4 * 2 * 17 / (100 * 17) == token_budget.run_epochs(cfg)["packed conversation rows"]


def test_sft_and_dpo_warn_past_warn_epochs_and_are_refused_past_max_epochs(tmp_path):
    lines = []
    token_budget.check_run_budget(packed_data(tmp_path, "chat", [100], warn_epochs=3), log=lines.append)
    assert lines[-1].startswith(
        "warning: the run reads its packed conversation rows 4.0 times, past data.warn_epochs 3"
    )
    with pytest.raises(DataError) as refused:
        token_budget.check_run_budget(
            packed_data(tmp_path, "preference", [100], max_epochs=4), log=lines.append
        )
    assert str(refused.value).startswith(  # 50 pairs in 100 rows, 400 pairs read: 8 epochs
        "data.max_epochs: the run would read its preference pairs 8.0 times, past 4; 50 more are needed: add pairs"
    )


def test_the_budget_of_packed_data_not_prepared_yet_names_the_command(tmp_path):
    with pytest.raises(
        DataError, match=r"no finished packed train split; run `python -m chat prepare CONFIG`"
    ):
        token_budget.run_epochs({"data": {"format": "chat", "dir": str(tmp_path)}, "train": {}, "model": {}})


def test_run_epochs_of_pretraining_are_the_epochs_the_start_check_reports(tmp_path):
    cfg = {
        "data": mixture_data(tmp_path),
        "train": {"max_steps": 10, "micro_batch_size": 2, "grad_accum_steps": 5},
        "model": {"seq_len": 20},
    }  # 2,000 tokens
    assert token_budget.run_epochs(cfg) == token_budget.check_token_budget(
        cfg["data"], 2000, log=lambda line: None
    )
