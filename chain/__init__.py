"""
The whole run in one command: `make run BOARD=2060` (python -m chain run 2060).

A chain file configs/chain/<board>.yaml names the stages in order, each an existing command with its run
file (python -m corpus, python -m chat download and prepare, train.py, python -m evaluation, export.py).
The chain only orders them (runfile.py: the file checked whole at start), checks them (plan.py: data,
hours, disk and memory before anything runs) and remembers them (stages.py: a stamp per finished stage, a
resume where a stage was cut).
"""
