"""
python -m chain: the command line of make run and make rehearsal.

    python -m chain run 2060 --plan                # the plan only: nothing is touched
    python -m chain run 2060                       # plan, checks, then every stage not done yet
    python -m chain run h200 --budget-min 20       # download, corpus and training scaled to fit 20 min
    python -m chain run rehearsal chain.folder=runs/x   # chain.key=value overrides, as every command
    python -m chain run 2060 --offline             # data already here: checked by checksum, no server asked
    python -m chain check                          # every chain file in configs/chain/
"""

import argparse
import os
import sys

import config
import fileio
import hardware
from chain import plan as chain_plan
from chain import runfile, stages, time_budget


def final_run(chain):
    """The run a person serves: the one the export stage reads, else the last training stage."""
    exports = [s["from"] for s in chain["stages"] if s["command"] == "export"]
    trained = [s["name"] for s in chain["stages"] if s["command"] == "train"]
    name = exports[-1] if exports else (trained[-1] if trained else None)
    return runfile.folder_of(chain, name) if name else chain["folder"]


def go_offline():
    """HF_HUB_OFFLINE and HF_DATASETS_OFFLINE for every stage's command: the Hub downloads check the files
    their last download recorded (corpus/hub.py), the evaluation reads only the datasets' cache."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"


def run(args):
    if args.offline:
        go_offline()
    chain, path = runfile.load(args.board, args.overrides)
    plan = chain_plan.make_plan(chain)
    if args.budget_min is not None:
        factor = time_budget.scale(chain, plan, args.budget_min)
        if factor is None:
            raise config.ConfigError([f"--budget-min {args.budget_min}: the stages that do not scale (data, "
                                      "evaluation, export) alone take longer; give a larger budget"])  # fmt: skip
        plan = chain_plan.make_plan(chain)
        scaled = f"scaled by {factor:.3f}" if factor < 1 else "fit without scaling"
        print(f"budget: {args.budget_min:g} min; the download, the corpus and the training {scaled}")
    text = chain_plan.format_plan(chain, plan)
    print(text)
    if "policy" in chain:  # a board's dtype policy on the CPU: say what only the board shows
        print(
            hardware.not_exercised(
                config.load_layer("hardware", os.path.join(runfile.CONFIGS, chain["policy"]))
            )
        )
    if args.plan:
        return 0
    stamp_of = stages.stamps(chain)
    refused = chain_plan.refusal(chain, plan, stages.finished(chain, stamp_of))
    if refused:
        print(refused, file=sys.stderr)
        return 2
    os.makedirs(os.path.join(chain["folder"], "chain"), exist_ok=True)  # the plan stays with the run
    fileio.write_atomic(
        os.path.join(chain["folder"], "chain", "plan.txt"), lambda f: f.write(text.encode() + b"\n")
    )
    stages.run_chain(chain, plan)
    print(
        f"the run's report: {stages.write_run_report(chain, chain_plan.make_plan(chain), final_run(chain))}"
    )
    print(f"ready: make serve RUN={final_run(chain)}")
    return 0


def check(boards):
    failures = 0
    for board in boards or runfile.boards():
        try:
            runfile.load(board)
        except config.ConfigError as e:
            print(
                f"{board}: {len(e.problems)} chain problem(s):\n  " + "\n  ".join(e.problems), file=sys.stderr
            )
            failures += 1
    print(f"{len(boards or runfile.boards()) - failures} chain files valid in configs/chain/")
    return 2 if failures else 0


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m chain", description="The whole run in one command.")
    commands = parser.add_subparsers(dest="command", required=True)
    go = commands.add_parser("run", help="plan, check and run a board's chain")
    go.add_argument("board", help="a chain file's name in configs/chain/ (2060, 5090, h200, cpu, rehearsal)")
    go.add_argument("overrides", nargs="*", help="chain.key=value")
    go.add_argument("--plan", action="store_true", help="print the plan and stop: nothing is touched")
    go.add_argument(
        "--budget-min",
        type=float,
        help="scale the download, the corpus and the training to fit this many minutes",
    )
    go.add_argument(
        "--offline",
        action="store_true",
        help="ask no server: downloaded data is checked against its recorded checksums (HF_HUB_OFFLINE)",
    )
    checking = commands.add_parser("check", help="check chain files (all of configs/chain/ by default)")
    checking.add_argument("boards", nargs="*")
    return parser.parse_args(argv)


def main(argv):
    args = parse_args(argv)
    try:
        if args.command == "check":
            return check(args.boards)
        return run(args)
    except config.ConfigError as e:
        where = f"{args.board}: " if len(e.problems) > 1 else ""
        print(where + "\n".join(e.problems), file=sys.stderr)
        return 2
    except stages.StageFailed as e:
        print(str(e), file=sys.stderr)
        return 1
    except stages.ChainStopped as e:
        again = "make rehearsal" if args.board == "rehearsal" else f"make run BOARD={args.board}"
        print(f"stopped by {e} at a safe point; `{again}` resumes where it stopped", file=sys.stderr)
        return 130
    except fileio.StorageError as e:
        return fileio.exit_on_storage_error(e)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
