"""torchrun + DistributedDataParallel on the CPU (gloo, 2 processes): the same training as one process,
exact resume, and a crashing rank ending the whole job."""

import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import ROOT, tiny_args, tiny_config

import checkpoint
import train

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
pytestmark = pytest.mark.skipif(
    not shutil.which(TORCHRUN), reason="torchrun not found beside the interpreter"
)
quiet = lambda *a, **k: None  # noqa: E731


def torchrun(args, script="train.py", timeout=180):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [TORCHRUN, "--standalone", "--nproc_per_node=2", script, *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def newest(run_dir):
    return checkpoint.load_checkpoint(train.list_checkpoints(run_dir)[0])


def test_two_ranks_with_accumulation_k_match_one_process_with_accumulation_2k(tmp_path, shard_data_dir):
    # Rank r takes windows r, r + 2, ... of the same seeded order, so 2 ranks x k micro-batches cover
    # exactly the windows of 1 process x 2k micro-batches: the same global batches, summed in another order.
    ddp = torchrun(tiny_args(tmp_path, "shards", shard_data_dir, "run_name=ddp", "train.grad_accum_steps=2"))
    assert ddp.returncode == 0, ddp.stdout + ddp.stderr
    assert "global batch 256 tokens = 2 ranks x 4 sequences x 16 tokens x 2 accumulation" in ddp.stdout
    single = tiny_config(tmp_path, "shards", shard_data_dir, "run_name=single", "train.grad_accum_steps=4")
    train.train(single, log=quiet)
    a, b = newest(tmp_path / "ddp"), newest(tmp_path / "single")
    assert a["step"] == b["step"] == 8 and a["world_size"] == 2
    for name, tensor in a["model"].items():
        assert torch.allclose(tensor, b["model"][name], rtol=1e-4, atol=1e-5), name


def test_ddp_resume_is_bit_exact(tmp_path, shard_data_dir):
    def args(*extra):
        return tiny_args(tmp_path, "shards", shard_data_dir, "train.decay_fraction=0", *extra)

    full = torchrun(args("run_name=full"))
    assert full.returncode == 0, full.stderr
    first = torchrun(args("run_name=split", "train.max_steps=4"))
    assert first.returncode == 0, first.stderr
    assert len(newest(tmp_path / "split")["ranks"]) == 2, "every rank's RNG and loader state is saved"
    second = torchrun([*args("run_name=split"), "--resume"])
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout
    count, differing, largest = checkpoint.compare_states(
        newest(tmp_path / "full"), newest(tmp_path / "split")
    )
    assert not differing, f"{len(differing)}/{count} tensors differ (largest {largest})"

    # The loader and RNG states are per rank: one process cannot continue a 2-process run.
    alone = tiny_config(
        tmp_path, "shards", shard_data_dir, "train.decay_fraction=0", "run_name=split", "train.max_steps=12"
    )
    with pytest.raises(train.TrainError, match="world size: checkpoint was written by 2 processes"):
        train.train(alone, resume=True, log=quiet)


def test_a_rank_that_raises_ends_the_whole_job_with_an_error(tmp_path, byte_data_dir):
    # Fault injection: rank 1's loader raises on its 4th batch, while rank 0 waits in an all-reduce.
    crashing = tmp_path / "crash_rank1.py"
    crashing.write_text(
        textwrap.dedent(f"""
        import os, runpy, sys
        sys.path.insert(0, {ROOT!r})
        import data

        real_build_loader = data.build_loader

        def build_loader(*args, **kwargs):
            loader = real_build_loader(*args, **kwargs)
            if os.environ["RANK"] == "1" and args[1] == "train":
                real_next, calls = loader.next_batch, []

                def next_batch():
                    calls.append(1)
                    if len(calls) > 3:
                        raise RuntimeError("injected failure on rank 1")
                    return real_next()

                loader.next_batch = next_batch
            return loader

        data.build_loader = build_loader
        sys.argv = ["train.py", *sys.argv[1:]]
        runpy.run_path({os.path.join(ROOT, "train.py")!r}, run_name="__main__")
    """)
    )
    start = time.monotonic()
    result = torchrun(
        tiny_args(
            tmp_path,
            "bytes",
            byte_data_dir,
            "run_name=crash",
            "train.max_steps=50",
            "train.dist_timeout_s=30",
        ),
        script=str(crashing),
    )
    assert result.returncode != 0
    assert "injected failure on rank 1" in result.stderr
    assert time.monotonic() - start < 120, "the job ended by itself, long before the test's timeout"
