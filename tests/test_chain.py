"""The chain (python -m chain, make run / make rehearsal): its file checked whole at start, the plan of every
board, the refusals before anything runs, and the tiny chain (configs/chain/rehearsal-tiny.yaml) run for real:
a second run that skips everything, a changed config that reruns only what follows it, and a SIGKILL in the
middle of pretraining whose resume ends in the same checkpoint as a run that was never killed."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from conftest import ROOT

import config
from chain import __main__ as chain_main
from chain import plan as chain_plan
from chain import runfile, stages

TINY = os.path.join(ROOT, "configs", "chain", "rehearsal-tiny.yaml")


def run_main(argv, capsys):
    code = chain_main.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def chain_command(board, folder, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "chain", "run", board, f"chain.folder={folder}", *extra]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def tiny_file(tmp_path, name, change):
    """The tiny chain file with `change(chain)` applied, written under tmp_path/chain/."""
    with open(TINY, encoding="utf-8") as f:
        content = yaml.safe_load(f)
    change(content["chain"])
    path = tmp_path / "chain" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(content), encoding="utf-8")
    shared = tmp_path / "chain" / "shared"  # what the chain file includes, beside it as in configs/
    if not shared.exists():
        shutil.copytree(os.path.join(ROOT, "configs", "chain", "shared"), shared)
    return str(path)


def stage_lines(output, verb):
    return [
        line.split()[2].rstrip(":")
        for line in output.splitlines()
        if line.startswith("stage ") and verb in line
    ]


def test_unknown_board_is_one_line_listing_the_boards(capsys):
    code, out, err = run_main(["run", "tpu"], capsys)
    assert code == 2
    assert err.strip().splitlines() == [f"BOARD=tpu: unknown board; boards: {', '.join(runfile.boards())}"]
    assert {"2060", "5090", "h200", "cpu", "rehearsal"} <= set(runfile.boards())


def test_every_shipped_chain_file_is_valid(capsys):
    assert run_main(["check"], capsys)[0] == 0


def test_every_problem_of_a_chain_file_is_reported_at_once(tmp_path, capsys):
    def spoil(chain):
        chain["stages"][1]["data"] = "later"  # not an earlier stage
        chain["stages"][3]["args"] = ["train.max_steps=-1"]  # the SFT run file refuses it
        chain["stages"][4]["command"] = "evaluate-all"  # not a command
        chain["assume"]["mfu"] = 2

    code, _, err = run_main(["run", tiny_file(tmp_path, "bad", spoil), "--plan"], capsys)
    assert code == 2
    text = err.lower()
    assert "stages.4.command" in text and "'evaluate-all' is not allowed" in text
    assert "mfu" in text and "expected <= 1" in text
    # The schema's problems come first and stop there; the stages' own problems come all at once too.
    code, _, err = run_main(["run", tiny_file(tmp_path, "bad2", lambda c: spoil(c) or c["assume"].update(mfu=0.5)
                                              or c["stages"][4].update(command="evaluate")), "--plan"], capsys)  # fmt: skip
    assert code == 2
    assert "stages.1 (pretrain): data: 'later' is not an earlier stage" in err
    assert "stages.3 (sft)" in err and "train.max_steps" in err


@pytest.mark.parametrize("board", ["2060", "5090", "h200"])
def test_plan_prints_every_stage_and_touches_nothing(board, capsys):
    chain, _ = runfile.load(board)
    code, out, _ = run_main(["run", board, "--plan"], capsys)
    assert code == 0
    for stage in chain["stages"]:
        assert f" {stage['name']} " in out
    assert "pretrain: epochs 1.00 passes; memory fits" in out
    assert "disk" in out and "at peak" in out and "throughput of" in out
    assert "estimate:" in out and "TFLOP/s x MFU" in out
    assert "data sources and their licences:\n" in out and "\n  fineweb2-spa: ODC-By 1.0" in out
    assert not os.path.exists(os.path.join(ROOT, chain["folder"]))


def test_a_measured_throughput_replaces_the_estimate():
    cfg = config.load(os.path.join(ROOT, "configs", "pretrain-2060.yaml"))
    hardware = dict(
        cfg["hardware"], measured={"tiny-50m": {"tokens_per_s": 50000, "date": "2026-12-04", "machine": "x"}}
    )
    assume = {"mfu": 0.35, "peak_tflops": None}
    rate, basis = chain_plan.train_rate(cfg, hardware, assume, "tiny-50m")
    assert (rate, basis) == (50000, "measured 2026-12-04 on x")
    rate, basis = chain_plan.train_rate(cfg, cfg["hardware"], assume, "tiny-50m")
    assert basis.startswith("estimate") and rate == pytest.approx(
        28.7e12 * 0.35 / chain_plan.flops_per_token(cfg["model"])
    )


def test_a_model_that_does_not_fit_the_board_is_refused(capsys):
    chain, _ = runfile.load("2060")
    pretrain = runfile.stage_by_name(chain, "pretrain")
    pretrain["args"] = ["train.micro_batch_size=128", "train.grad_accum_steps=1"]
    plan = chain_plan.make_plan(chain)
    line = chain_plan.refusal(chain, plan, done=set())
    assert (
        line.startswith("refused: stage pretrain needs")
        and "of 10.5 GiB (turing-2060 memory_gib; estimate: step " in line
    )


def test_an_attention_kernel_the_board_lacks_is_one_line_before_any_download(tmp_path, capsys):
    with open(os.path.join(ROOT, "configs", "chain", "2060.yaml"), encoding="utf-8") as f:
        content = yaml.safe_load(f)
    pretrain = next(s for s in content["chain"]["stages"] if s["name"] == "pretrain")
    pretrain["args"] = ["hardware.attention_backend=flash"]  # FlashAttention-2 needs sm80; the 2060 is sm75
    shutil.copytree(os.path.join(ROOT, "configs", "chain", "shared"), tmp_path / "chain" / "shared")
    path = tmp_path / "chain" / "2060-flash.yaml"  # beside the layers it includes, as in configs/chain/
    path.write_text(yaml.safe_dump(content), encoding="utf-8")
    code, out, err = run_main(["run", str(path), "--plan"], capsys)
    assert code == 2 and out == ""  # no plan, no download
    (line,) = err.strip().splitlines()
    assert f"{path}: stages.4 (pretrain): hardware profile 'turing-2060' (sm75 cuda, float16)" in line
    assert "attention_backend flash for a model of head_dim 64 (d_model 512 / n_heads 8)" in line
    assert (
        "flash runs on sm80 to sm121 only; kernels that take this on this board: math, mem_efficient" in line
    )


def test_a_too_small_disk_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    free = type("Usage", (), {"free": 10_000_000, "total": 0, "used": 0})
    monkeypatch.setattr(chain_plan.shutil, "disk_usage", lambda path: free)
    folder = tmp_path / "run"
    code, _, err = run_main(["run", "rehearsal-tiny", f"chain.folder={folder}"], capsys)
    assert code == 2
    assert err.startswith("refused: the run needs ") and "0.01 GB are free on" in err
    assert len(err.strip().splitlines()) == 1
    assert not folder.exists()


def test_a_budget_scales_the_download_the_corpus_and_the_training(capsys):
    code, out, _ = run_main(["run", "h200", "--plan", "--budget-min", "20"], capsys)
    assert code == 0
    assert out.startswith("budget: 20 min; the download, the corpus and the training scaled by 0.")
    rows = {line.split()[1]: line for line in out.splitlines() if line[:3].strip().isdigit()}
    assert "20,000 steps" not in rows["pretrain"] and "5.7 GB" not in rows["download"]
    assert "total: 20 min (" in out
    code, _, err = run_main(["run", "h200", "--plan", "--budget-min", "0"], capsys)
    assert code == 2 and "give a larger budget" in err


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chain") / "tiny"
    first = chain_command("rehearsal-tiny", folder)
    return folder, first


def test_the_tiny_chain_ends_in_a_served_model_with_a_report_card_and_a_gguf(tiny_run):
    folder, first = tiny_run
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.strip().splitlines()[-1] == f"ready: make serve RUN={folder}/sft"
    assert (folder / "sft" / "report.md").is_file()
    assert "fortunes-es: public domain" in (folder / "chain" / "plan.txt").read_text(encoding="utf-8")
    run_report = (folder / "report.md").read_text(encoding="utf-8")  # the run's own, beside the card
    assert "| pretrain | " in run_report and "- fortunes-es: public domain" in run_report
    assert f"`{folder}/sft/report.md`" in run_report and f"`{folder}/ask/answers.md`" in run_report
    assert (folder / "sft" / "export-gguf" / "model.gguf").is_file() or list(
        (folder / "sft" / "export-gguf").glob("*.gguf")
    )
    assert stage_lines(first.stdout, "starting") == [
        s["name"] for s in runfile.load("rehearsal-tiny")[0]["stages"]
    ]


def test_the_tiny_chain_ends_by_asking_its_served_model_the_serve_layers_questions(tiny_run):
    folder, first = tiny_run
    asked = config.load_layer("serve", os.path.join(ROOT, "configs", "serve", "default.yaml"))["ask"]
    with open(folder / "ask" / "answers.json", encoding="utf-8") as f:
        answers = json.load(f)["answers"]
    assert [a["question"] for a in answers] == [q["question"] for q in asked["questions"]]
    for answer, question in zip(answers, asked["questions"], strict=True):
        assert isinstance(answer["answer"], str)  # the tiny model's words: what it says is not judged here
        expect = question.get("expect")
        assert answer["found"] == (None if expect is None else expect in answer["answer"])
    assert "¿Cuánto es 1234 por 56?" in (folder / "ask" / "answers.md").read_text(encoding="utf-8")
    assert " expected answers found; " in first.stdout


def test_a_boards_rehearsal_trains_every_stage_under_its_policy_and_ends_in_a_served_model(tmp_path):
    # make rehearsal BOARD=2060 (configs/chain/rehearsal-2060.yaml): the tiny chain with the 2060's policy
    folder = tmp_path / "run"
    result = chain_command("rehearsal-2060", folder)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == f"ready: make serve RUN={folder}/sft"
    assert "hardware profile 'cpu-2060' runs the dtype policy of turing-2060 on the CPU; not exercised" in (
        result.stdout
    )
    for stage in ("pretrain", "sft"):
        with open(folder / stage / "config.yaml", encoding="utf-8") as f:
            trained = yaml.safe_load(f)["hardware"]
        assert (trained["name"], trained["dtype"], trained["grad_scaler"]) == ("cpu-2060", "float16", True)
        with open(folder / stage / "metrics.jsonl", encoding="utf-8") as f:
            assert any("loss_scale" in json.loads(line) for line in f)
    with open(folder / "ask" / "answers.json", encoding="utf-8") as f:
        assert json.load(f)["answers"]  # the served model answered
    chain, _ = runfile.load("rehearsal-2060")
    assert chain["policy"] == "hardware/cpu-2060.yaml"
    assert chain["stages"] == runfile.load("rehearsal-tiny")[0]["stages"]


def test_a_second_run_with_nothing_changed_skips_every_stage(tiny_run):
    folder, _ = tiny_run
    again = chain_command("rehearsal-tiny", folder)
    assert again.returncode == 0, again.stderr[-2000:]
    assert stage_lines(again.stdout, "starting") == []
    assert len(stage_lines(again.stdout, "done already")) == 8


def test_a_changed_config_reruns_only_the_stages_after_it(tiny_run, tmp_path):
    folder, _ = tiny_run
    changed = tiny_file(
        tmp_path, "lr", lambda c: c["stages"][3].setdefault("args", []).append("train.lr=2.0e-3")
    )
    rerun = chain_command(changed, folder)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert stage_lines(rerun.stdout, "done already") == ["corpus", "pretrain", "chat-data"]
    assert stage_lines(rerun.stdout, "starting") == ["sft", "evaluation", "report", "export", "ask"]


def test_a_failing_stage_names_itself_its_log_and_the_command_that_reruns_it(tiny_run, tmp_path):
    def spoil(chain):  # the previous test's chain (then only the evaluation runs), with a task that is not
        chain["stages"][3].setdefault("args", []).append("train.lr=2.0e-3")
        chain["stages"][4]["tasks"] = "no-such-task"

    folder, _ = tiny_run
    result = chain_command(tiny_file(tmp_path, "fail", spoil), folder)
    assert result.returncode == 1
    line = result.stderr.strip().splitlines()[-1]
    log = os.path.join(folder, "chain", "evaluation.log")
    assert line.startswith(f"stage evaluation failed (exit 2); log: {log}; rerun it alone: ")
    assert "-m evaluation" in line and "--tasks no-such-task" in line
    # What the finished stages wrote is still there and stamped.
    assert stages.read_mark({"folder": str(folder)}, "sft", "done") is not None


LONGER = ["train.max_steps=40", "train.ckpt_interval=4", "train.eval_interval=40"]


def pretrain_only(chain):
    chain["stages"] = chain["stages"][:2]
    chain["stages"][1]["args"] = list(LONGER)


def through_sft(chain):
    chain["stages"] = chain["stages"][:4]
    chain["stages"][3]["args"] = list(LONGER)


def model_of(path):
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


@pytest.fixture(scope="module")
def unkilled(tmp_path_factory):
    """{stage: (chain file, its last checkpoint)}: the tiny chain up to a longer pretraining, and up to a
    longer SFT, never interrupted."""
    root, ends = tmp_path_factory.mktemp("unkilled"), {}
    for stage, change in (("pretrain", pretrain_only), ("sft", through_sft)):
        chain_file = tiny_file(root, f"kill-{stage}", change)
        assert chain_command(chain_file, root / stage).returncode == 0
        ends[stage] = chain_file, model_of(root / stage / stage / "ckpt_0000040.pt")
    return ends


@pytest.mark.parametrize(
    "stage,signum",
    [("pretrain", signal.SIGKILL), ("pretrain", signal.SIGINT), ("sft", signal.SIGKILL)],
    ids=["pretrain-sigkill", "pretrain-ctrl-c", "sft-sigkill"],
)
def test_a_run_stopped_in_training_resumes_to_the_same_checkpoint(unkilled, stage, signum, tmp_path):
    chain_file, expected = unkilled[stage]
    killed = tmp_path / "killed"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "chain", "run", chain_file, f"chain.folder={killed}"]
    child = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)  # fmt: skip
    deadline = time.time() + 600
    while not list((killed / stage).glob("ckpt_*.pt")):
        assert child.poll() is None and time.time() < deadline, "the chain ended before a checkpoint"
        time.sleep(0.05)
    os.killpg(child.pid, signum)  # SIGINT to the group: what Ctrl-C in a terminal does
    _, err = child.communicate(timeout=600)
    assert stages.read_mark({"folder": str(killed)}, stage, "done") is None
    if signum == signal.SIGINT:
        assert child.returncode == 130
        assert err.strip().splitlines()[-1] == (
            f"stopped by SIGINT at a safe point; `make run BOARD={chain_file}` resumes where it stopped"
        )
    resumed = chain_command(chain_file, killed)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "corpus: done already" in resumed.stdout
    assert f"{stage}: resuming" in resumed.stdout
    got = model_of(killed / stage / "ckpt_0000040.pt")
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_the_2060_plan_downloads_the_conversations_and_tunes_tool_use_with_its_own_run_file(capsys):
    chain, _ = runfile.load("2060")
    names = [s["name"] for s in chain["stages"]]
    assert names.index("chat-download") < names.index("chat-data")
    download = runfile.stage_by_name(chain, "chat-download")
    assert runfile.command_line(chain, download)[1:] == ["-m", "chat", "download", "configs/sft-2060.yaml"]
    tools = runfile.stage_by_name(chain, "sft-tools")
    assert tools["config"] == "sft-agent-2060.yaml" and "args" not in tools
    assert runfile.stage_by_name(chain, "tools-data")["config"] == "sft-agent-2060.yaml"
    # The mixture's tool conversations are the ones this run generates, not a folder a clone lacks.
    assert names.index("agent-16k") < names.index("chat-data")
    mix_cfg = runfile.load_stage_config(chain, runfile.stage_by_name(chain, "chat-data"))["data"]["chat"][
        "mixture"
    ]
    paths = {s["name"]: s.get("path") for s in mix_cfg["sources"]}
    assert paths["tools"] == "runs/run-2060/agent-16k/train.jsonl"
    assert paths["seed"] == "conversations/seed/*.jsonl" and paths["oasst2-es"] is None
    code, out, _ = run_main(["run", "2060", "--plan"], capsys)
    assert code == 0
    rows = {line.split()[1]: line for line in out.splitlines() if line[:3].strip().isdigit()}
    assert "oasst2-es, aya-es: 200 MB assumed (0 MB here)" in rows["chat-download"]
    assert "10 MB/s" in rows["chat-download"]
    assert "mixture: 12,000 conversations of 4 sources" in rows["chat-data"]
    assert "375 steps x 65,536 tokens" in rows["sft-tools"]  # train/sft-agent.yaml's schedule
    assert "   sft: epochs 10,880 rows read; rows known after chat-data, each source's epochs (max 4)" in out
    assert "shares seed 0.05, oasst2-es 0.4, aya-es 0.25, tools 0.3" in out
    assert "   sft-tools: epochs 12,000 rows read; rows known after tools-data" in out
    assert "  oasst2-es: Apache-2.0" in out and "  aya-es: Apache-2.0" in out
    assert "left out" not in out


def test_the_sft_epochs_per_source_come_from_the_built_mixture(tmp_path):
    chain, _ = runfile.load("2060", [f"chain.folder={tmp_path}"])
    sft = runfile.stage_by_name(chain, "sft")
    mixture_dir = tmp_path / "mixture"
    runfile.stage_by_name(chain, "chat-data")["args"] = [f"data.chat.mixture.dir={mixture_dir}"]
    cfg = runfile.load_stage_config(chain, sft)
    chat_data = tmp_path / "chat-data"
    chat_data.mkdir()
    shards = [{"rows": 5440}]  # 10,880 rows read: two passes
    prepared = {"prepare": {"train": {"complete": True, "shards": shards}}}
    (chat_data / "manifest.json").write_text(json.dumps(prepared), encoding="utf-8")
    mixture_dir.mkdir()
    built = {"sources": {"seed": {"mixture": {"epochs": 1.5}}, "tools": {"mixture": {"epochs": 0.25}}}}
    (mixture_dir / "manifest.json").write_text(json.dumps(built), encoding="utf-8")
    epochs = chain_plan.epochs_of(chain, sft, cfg, 0)
    assert epochs == "2.0 epochs of 5,440 rows; per source: seed 3.00, tools 0.50"


def test_the_cpu_plan_says_its_sft_data_is_local_and_leaves_the_hub_conversations_out(capsys):
    code, out, _ = run_main(["run", "cpu", "--plan"], capsys)
    assert code == 0 and " chat-download " not in out
    assert "chat-data: local conversations only (conversations/seed/*.jsonl); the Hub conversation" in out
    assert "left out" in out


def test_the_schema_accepts_chat_download_and_a_misspelt_command_is_one_line(tmp_path, capsys):
    def add(command):
        def change(chain):
            chain["assume"]["chat_download_mb"] = 1
            stage = {"name": "chat-download", "command": command, "config": "rehearsal-tiny-sft-cpu.yaml"}
            chain["stages"].insert(0, stage)

        return change

    assert run_main(["check", tiny_file(tmp_path, "good", add("chat-download"))], capsys)[0] == 0
    code, _, err = run_main(["check", tiny_file(tmp_path, "bad", add("chat-downlaod"))], capsys)
    assert code == 2
    lines = [line for line in err.strip().splitlines() if "chat-downlaod" in line]
    assert len(lines) == 1 and "stages.0.command" in lines[0]


def test_the_memory_of_a_training_stage_counts_the_attention_kernels_workspace_and_the_evaluation():
    import microbatch

    cfg = config.load(os.path.join(ROOT, "configs", "pretrain-2060.yaml"))
    step = microbatch.step_peak_bytes(cfg["model"], 16, "float16", 1024)
    workspace = chain_plan.attention_workspace_bytes(cfg["model"], 16, "float16", "mem_efficient")
    # tiny-50m has 8 heads over 4 kv heads: mem_efficient repeats k and v to every head, in every layer
    repeated = 12 * 16 * 1024 * 2 * 4 * 64 * 2
    assert workspace > repeated > 0
    assert chain_plan.step_memory_bytes(cfg) == step + workspace
    math = chain_plan.attention_workspace_bytes(cfg["model"], 16, "float16", "math")
    assert math >= 12 * 16 * 8 * 1024 * 1024 * 2  # every layer's attention weights
    fits, line = chain_plan.memory_fit(cfg, cfg["hardware"])
    assert fits and line.startswith(f"{(step + workspace) / microbatch.GIB:.1f} of 10.5 GiB")
    assert "estimate: step 7.3 + attention mem_efficient 0.27, evaluation 1.4" in line


def test_the_corpus_stage_is_planned_with_the_cost_per_mb_of_docs_corpus_md_on_the_machines_cores(capsys):
    """docs/corpus.md: the 2060's 9.1 GB of text cost ~7.6 h of CPU with spaCy's word split (~2 h with
    regex), about an hour on 8 cores, and the encode ~1.3 h of CPU; a flat 5 MB/s said 31 minutes."""

    def corpus_row(*overrides):
        code, out, _ = run_main(["run", "2060", *overrides, "--plan"], capsys)
        assert code == 0
        return next(line for line in out.splitlines() if line[3:].startswith("corpus "))

    chain, _ = runfile.load("2060", ["chain.assume.cores=8"])
    stage = runfile.stage_by_name(chain, "corpus")
    plan = chain_plan.stage_plan(chain, stage, {})
    assert "7.8 h of CPU (spacy words) on 8 of 8 cores + encode 1.3 h of CPU on 8" in plan["basis"]
    assert 1.0 < plan["hours"] < 1.5  # docs/corpus.md: a little under an hour and a half on 8 cores
    two = chain_plan.stage_plan(runfile.load("2060", ["chain.assume.cores=2"])[0], stage, {})
    assert 4 * plan["hours"] > two["hours"] > 3 * plan["hours"]
    regex = runfile.load("2060", ["chain.assume.cores=8"])[0]
    regex_stage = dict(stage, args=["data.corpus.filters.word_tokenizer=regex"])
    assert "2.0 h of CPU (regex words)" in chain_plan.stage_plan(regex, regex_stage, {})["basis"]
    row = corpus_row("chain.assume.cores=8")
    assert "1.2 h" in row and "docs/corpus.md's cost per MB" in row


def test_the_plan_names_the_driver_and_the_cuda_torch_the_board_needs_from_its_profile(capsys):
    chain, _ = runfile.load("2060")
    needs = chain_plan.make_plan(chain)["hardware"]["needs"]
    code, out, _ = run_main(["run", "2060", "--plan"], capsys)
    assert code == 0
    assert (
        f"needs on the board: NVIDIA driver >= {needs['nvidia_driver']} and torch built for CUDA {needs['cuda']}"
        in out
    )
    # The line is the profile's, not the code's: another profile value prints another line.
    plan = chain_plan.make_plan(chain)
    plan["hardware"] = dict(plan["hardware"], needs={"nvidia_driver": "999.1", "cuda": "14.2"})
    assert "NVIDIA driver >= 999.1 and torch built for CUDA 14.2" in chain_plan.format_plan(chain, plan)
    # The CPU chain needs no driver; a cuda profile that does not say what it needs is refused.
    code, out, _ = run_main(["run", "cpu", "--plan"], capsys)
    assert code == 0 and "NVIDIA driver" not in out
    with pytest.raises(config.ConfigError, match="needs"):
        config.load(os.path.join(ROOT, "configs", "pretrain-2060.yaml"), ["hardware.needs=null"])
