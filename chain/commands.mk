# The command line of each kind of chain stage (a stage's `command:` in configs/chain/), after the Python
# interpreter. The Makefile's targets run these ($(call STAGE.train,$(CONFIG)) ...) and chain/commands.py
# reads this file for the chain, so a stage's option is written here once. chain/commands.py reads only
# lines `STAGE.<name> = <words>`, each $(1), $(2), $(3) a word of its own; tests/test_makefile.py checks
# that each target's dry run is its stage's command line.

# $(1): the run file (configs/...)
STAGE.corpus-download = -m corpus download $(1)
STAGE.corpus = -m corpus all $(1)
STAGE.chat-download = -m chat download $(1)
STAGE.chat-prepare = -m chat prepare $(1)
STAGE.train = train.py $(1)
# train.py goes on from the run's last checkpoint (make RESUME=1; a chain stage that was cut)
STAGE.resume = --resume
# $(1): the task suite (a file of configs/eval/, or lm-eval's task names)
STAGE.eval-download = -m evaluation download $(1)
# $(1): the folder it writes; the settings file (configs/agent/...) follows --settings
STAGE.agent-data = -m agent.dataset generate $(1)
STAGE.agent-settings = --settings $(1)
# $(1): the run it reads; evaluate's $(2): the task suite; export's $(2): where, $(3): the format
STAGE.evaluate = -m evaluation $(1) --tasks $(2)
STAGE.report = -m evaluation report $(1)
STAGE.tool-eval = -m evaluation.tool_use $(1)
STAGE.export = export.py $(1) $(2) --to $(3)
# $(2): the folder of the answers, the server's log and its database
STAGE.ask = -m serve.ask $(1) $(2)
