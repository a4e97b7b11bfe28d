# ENLACE: the verbs a person types. Every target bootstraps .venv on first use (and again only when a
# requirements file changes), so a fresh clone needs no separate setup step.

# A target that runs a kind of chain stage (pretrain, sft, dpo, chat-prepare, eval-bench, export, ...) takes
# its command from chain/commands.mk, as the chain does (make run): $(call STAGE.train,$(CONFIG)) is
# `train.py CONFIG`. A stage's option is written there once; the smoke targets spell their commands.
include chain/commands.mk

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements.stamp

CONFIG ?= configs/pretrain-2060.yaml
SFT_CONFIG ?= configs/sft-2060.yaml
DPO_CONFIG ?= configs/dpo-2060.yaml
NPROC ?= 1
RUN ?= runs/smoke-cpu
DB ?=
SNAPSHOT ?=
ARGS ?=
RESUME_FLAG := $(if $(filter 1 yes true,$(RESUME)),$(STAGE.resume),)
# The interpreter of the training stages: torchrun with NPROC > 1 processes
LAUNCH := $(if $(filter 1,$(NPROC)),$(PY),$(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC))

.PHONY: setup lint check-configs test test-other-cpu clean smoke smoke-2060 pretrain resume-check data-smoke \
	corpus-download corpus tokenizer encode corpus-smoke corpus-report smoke-corpus sample sample-chat bpb chat eval \
	serve kernels bench search agent-data agent-data-16k agent-eval sft-agent agent-ladder agent-ladder-16k agent-ladder-c agent-ladder-digits agent-ladder-table sync \
	remote-setup remote-smoke-2060 remote-pretrain logs fetch status chat-prepare sft sft-smoke \
	plot export gguf-check snapshot restore install-service fuzz gpu-check eval-bench report preferences dpo dpo-smoke recipe
.PHONY: run rehearsal remote-run

# What a fresh install needs, checked before .venv is made (scripts/check_setup.py, one line per missing
# thing): PYTHON at least SETUP_PYTHON_MIN (the code uses datetime.UTC), and SETUP_FREE_GIB of free disk
# (.venv measured 3.6 GB with torch's CPU build, 2026-12-06; PyPI's Linux torch brings CUDA's libraries,
# several GB more, and pip caches what it downloads).
SETUP_PYTHON_MIN ?= 3.11
SETUP_FREE_GIB ?= 10

setup: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt
	$(PYTHON) scripts/check_setup.py --min-python $(SETUP_PYTHON_MIN) --min-free-gib $(SETUP_FREE_GIB) --venv $(VENV)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $(STAMP)

# --- checks ---------------------------------------------------------------------------------------

lint: $(STAMP)
	$(VENV)/bin/yamllint --strict .
	$(PY) config.py --all configs
	$(PY) -m chain check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror decode/*.cpp

check-configs: $(STAMP)
	$(PY) config.py --all configs

test: $(STAMP)
	$(VENV)/bin/pytest -q

# The tests whose numbers come from a model (parity with transformers and lm-eval, greedy text, exact
# resume, a loss that falls) again with PyTorch's, MKL's and oneDNN's kernels forced down to the baseline
# x86-64 instruction set: another CPU sums float32 in another order, and a test must hold on every CPU.
KERNEL_TESTS ?= tests/test_export.py tests/test_eval.py tests/test_train.py tests/test_model.py \
	tests/test_sample.py tests/test_dpo.py tests/test_resume.py
# Its own inductor cache: torch 2.13 keys compiled kernels and precompiled headers by the machine, not by
# ATEN_CPU_CAPABILITY, and the AVX2 ones fail to build under the baseline setting.
test-other-cpu: $(STAMP)
	cache=$$(mktemp -d) && ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 \
		TORCHINDUCTOR_CACHE_DIR=$$cache $(VENV)/bin/pytest -q $(KERNEL_TESTS); status=$$?; rm -rf $$cache; exit $$status

bench: $(STAMP)
	$(PY) -m bench $(ARGS)

# The training recipes side by side at a fixed token budget (bench/recipe.py, docs/entrenamiento.md):
# make recipe                                      (smoke-cpu: adamw, muon, muon+zero_init, 3 seeds)
# make recipe ARGS="--config configs/smoke-corpus-cpu.yaml --recipes adamw muon muon+bos"
# make recipe ARGS="--config configs/recipe-6l-cpu.yaml --steps 100 --batch 8 --evals 5 --recipes adamw muon"  (a larger shape)
recipe: data-smoke
	$(PY) -m bench.recipe $(ARGS)

# The GPU acceptance check on the board this machine has (bench/gpu_check.py, report in gpu-report.md). A bare
# machine gets the check's own venv first (requirements.txt and requirements-gpu-check.txt), timed into the
# report. DEVICE=cpu runs the same plumbing with tiny shapes in .venv. OFFLINE=1: no venv and no package
# index: PYTHON (an interpreter with torch 2.11-2.13, numpy, pyyaml and sentencepiece; CUDA torch on a board)
# is checked against the wheelhouse (one line naming what is missing), gets the wheelhouse's wheels with
# pip --no-index and trains on its pretokenised shards (bench/wheelhouse.py; make wheelhouse makes it).
OFFLINE ?=
OFFLINE_FLAG := $(if $(filter 1 yes true,$(OFFLINE)),--offline,)
DEVICE ?= cuda
GPU_CHECK_VENV := .venv-gpu-check
WHEELHOUSE ?= wheelhouse
gpu-check: $(if $(filter cpu,$(DEVICE)),$(if $(OFFLINE_FLAG),,$(STAMP)))
	@start=$$(date +%s); python=$(PY); data=; \
	if [ -n "$(OFFLINE_FLAG)" ]; then \
		python=$(PYTHON); data="--data $(WHEELHOUSE)/data"; \
		HF_HUB_OFFLINE=1 $$python -m bench.wheelhouse check $(WHEELHOUSE) --device $(DEVICE) || exit 2; \
		$$python -m bench.wheelhouse install $(WHEELHOUSE) || exit 2; \
	elif [ "$(DEVICE)" != cpu ]; then \
		python=$(GPU_CHECK_VENV)/bin/python; \
		test -x $$python || $(PYTHON) -m venv $(GPU_CHECK_VENV) || exit 1; \
		if ! cat requirements-gpu-check.txt requirements.txt | cmp -s - $(GPU_CHECK_VENV)/.installed; then \
			echo "gpu-check: installing requirements.txt and requirements-gpu-check.txt into $(GPU_CHECK_VENV) ..."; \
			$$python -m pip install --quiet --upgrade pip && \
			$$python -m pip install --quiet -r requirements.txt -r requirements-gpu-check.txt || exit 1; \
			cat requirements-gpu-check.txt requirements.txt > $(GPU_CHECK_VENV)/.installed; \
		fi; \
	fi; \
	$(if $(OFFLINE_FLAG),HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1) $$python -m bench.gpu_check --device $(DEVICE) $$data \
		--setup-seconds $$(( $$(date +%s) - start )) $(ARGS)

# The offline GPU check's wheelhouse (bench/wheelhouse.py): requirements-gpu-check.txt's wheels (for the GPU
# machine's Python: PY_VERSION=3.12) and the pretokenised shards of the embedded smoke corpus, in WHEELHOUSE/.
PY_VERSION ?=
.PHONY: wheelhouse
wheelhouse: $(STAMP)
	$(PY) -m bench.wheelhouse build $(WHEELHOUSE) $(if $(PY_VERSION),--python-version $(PY_VERSION))

# Hostile input at every request path, many examples per route and a new seed each time (make test runs
# a few of each); a failing example is kept in .hypothesis/ and replayed first on the next run.
fuzz: $(STAMP)
	ENLACE_FUZZ_PROFILE=fuzz $(VENV)/bin/pytest -q tests/test_fuzz.py $(ARGS)

clean:
	rm -rf .pytest_cache .ruff_cache
	find . -name __pycache__ -not -path './$(VENV)/*' -prune -exec rm -rf {} +

# --- data -----------------------------------------------------------------------------------------

data-smoke: $(STAMP)
	scripts/prepare_smoke_data.sh

# The sources of CONFIG's data layer that name a Hugging Face dataset (HF_TOKEN for gated ones)
corpus-download: $(STAMP)
	$(PY) $(call STAGE.corpus-download,$(CONFIG)) $(ARGS)

corpus: $(STAMP)
	$(PY) -m corpus corpus $(CONFIG)

tokenizer: $(STAMP)
	$(PY) -m corpus tokenizer $(CONFIG)

encode: $(STAMP)
	$(PY) -m corpus encode $(CONFIG)

corpus-smoke: $(STAMP)
	$(PY) -m corpus all configs/smoke-corpus-cpu.yaml
	$(PY) -m corpus report configs/smoke-corpus-cpu.yaml

corpus-report: $(STAMP)
	$(PY) -m corpus report $(CONFIG)

# --- training -------------------------------------------------------------------------------------

smoke: data-smoke
	$(PY) train.py configs/smoke-cpu.yaml $(ARGS)

smoke-2060: data-smoke
	$(PY) train.py configs/smoke-2060.yaml $(ARGS)

smoke-corpus: corpus-smoke
	$(PY) train.py configs/smoke-corpus-cpu.yaml $(ARGS)

pretrain: $(STAMP)
	$(LAUNCH) $(call STAGE.train,$(CONFIG)) $(ARGS) $(RESUME_FLAG)

# The data a check or an evaluation reads is built first (idempotent: a no-op when up to date), so both
# work on a fresh clone as `make smoke` does.
resume-check: $(STAMP)
	$(PY) $(call STAGE.corpus,$(CONFIG)) $(filter-out --%,$(ARGS))
	$(PY) train.py $(CONFIG) --resume-check $(ARGS)

# The micro-batch that fits: CONFIG's estimated peak memory per step (microbatch.py, no torch);
# `python microbatch.py --table` prints tiny-50m on every GPU profile.
.PHONY: microbatch
microbatch: $(STAMP)
	$(PY) microbatch.py $(CONFIG) $(ARGS)

# --- fine-tuning on conversations (SFT) -----------------------------------------------------------

# OASST2 and Aya for the SFT mixture (configs/data/sft.yaml), from the Hub into data/hub/ (resumable, checksummed)
.PHONY: chat-download
chat-download: $(STAMP)
	$(PY) $(call STAGE.chat-download,$(SFT_CONFIG))

chat-prepare: $(STAMP)
	$(PY) $(call STAGE.chat-prepare,$(SFT_CONFIG))

sft: chat-prepare
	$(LAUNCH) $(call STAGE.train,$(SFT_CONFIG)) $(ARGS) $(RESUME_FLAG)

# corpus-smoke tokenizer -> the smoke-corpus-cpu pretraining (kept when it already has a checkpoint)
# -> SFT on the seed conversations (from scratch each time) -> held-out evaluation. The held-out first
# answers are 106-378 tokens of this tokenizer with their <|end|> (median 291): a 400-token budget lets
# a reply end.
sft-smoke: corpus-smoke
	ls runs/smoke-corpus-cpu/ckpt_*.pt >/dev/null 2>&1 || $(PY) train.py configs/smoke-corpus-cpu.yaml
	$(PY) -m chat prepare configs/sft-smoke-cpu.yaml
	rm -rf runs/sft-smoke-cpu
	$(PY) train.py configs/sft-smoke-cpu.yaml $(ARGS)
	$(PY) -m evaluation.bpb runs/sft-smoke-cpu --chat-eval val --max-new-tokens 400

# Does the SFT mixture help (docs/conversaciones.md)? Assistant-token bpb on the mixture's held-out slice of
# OASST2 and Aya and on conversations/heldout.jsonl: the smoke-corpus-cpu run before SFT, then, for each seed
# of SFT_BPB_SEEDS, after the same steps on the seed set alone and on the whole mixture. Needs the Hub files
# once: python -m chat download configs/sft-mix-cpu.yaml (with a network).
SFT_BPB_SEEDS ?= 1 2 3
SFT_BPB_VAL := data/sft-mix-cpu/mixture/val.jsonl conversations/heldout.jsonl
.PHONY: sft-bpb
sft-bpb: corpus-smoke
	ls runs/smoke-corpus-cpu/ckpt_*.pt >/dev/null 2>&1 || $(PY) train.py configs/smoke-corpus-cpu.yaml
	$(PY) -m chat prepare configs/sft-mix-cpu.yaml
	$(PY) -m chat prepare configs/sft-seed-only-cpu.yaml
	for val in $(SFT_BPB_VAL); do \
	  $(PY) -m evaluation.bpb runs/smoke-corpus-cpu --chat-eval $$val --max-new-tokens 1 --show 0 || exit 1; done
	for seed in $(SFT_BPB_SEEDS); do for arm in seed-only mix; do \
	  rm -rf runs/sft-$$arm-cpu-s$$seed && \
	  $(PY) train.py configs/sft-$$arm-cpu.yaml run_name=sft-$$arm-cpu-s$$seed train.seed=$$seed || exit 1; \
	  for val in $(SFT_BPB_VAL); do \
	    $(PY) -m evaluation.bpb runs/sft-$$arm-cpu-s$$seed --chat-eval $$val --max-new-tokens 1 --show 0 || exit 1; done; \
	done; done

# --- the family teaches its assistant: preference pairs and DPO ---------------------------------------

# The pairs of the feedback of the members who consent (under var/, never committed), a tenth of the
# prompts held out: python -m chat preferences --db DB ...
preferences: $(STAMP)
	$(PY) -m chat preferences --db $(or $(DB),var/enlace.sqlite) var/preferences/train.jsonl \
		--val var/preferences/val.jsonl --val-share 0.1

dpo: $(STAMP)
	$(PY) $(call STAGE.chat-prepare,$(DPO_CONFIG))
	$(LAUNCH) $(call STAGE.train,$(DPO_CONFIG)) $(ARGS) $(RESUME_FLAG)

# sft-smoke-cpu (made by `make sft-smoke` when missing) -> preference pairs made from the seed
# conversations (train) and the held-out ones (val): the seed answer chosen, a worse one rejected -> DPO
# from the SFT run (from scratch each time) -> the held-out figures, printed by the final eval line: reward
# accuracy, and the share of held-out prompts whose chosen answer the tuned model finds likelier than the
# SFT run did.
dpo-smoke: corpus-smoke
	ls runs/sft-smoke-cpu/ckpt_*.pt >/dev/null 2>&1 || $(MAKE) sft-smoke ARGS=
	$(PY) -m chat seed-pairs data/seed-pairs/train.jsonl conversations/seed/*.jsonl --seed 0
	$(PY) -m chat seed-pairs data/seed-pairs/val.jsonl conversations/heldout.jsonl --seed 1
	$(PY) -m chat prepare configs/dpo-smoke-cpu.yaml
	rm -rf runs/dpo-smoke-cpu
	$(PY) train.py configs/dpo-smoke-cpu.yaml $(ARGS)

# --- using a model --------------------------------------------------------------------------------

sample: $(STAMP)
	$(PY) sample.py $(RUN) $(ARGS)

sample-chat: $(STAMP)
	$(PY) sample.py $(RUN) --chat $(ARGS)

RUN_DIR = $(if $(filter %.pt,$(RUN)),$(patsubst %/,%,$(dir $(RUN))),$(RUN))

# A run's loss and bits per byte on its val split. Pretraining data is rebuilt from the run's saved config
# (chat data comes from `python -m chat prepare`); a config saved by an older version may no longer
# validate: then the data already there is used.
bpb: $(STAMP)
	if [ -f $(RUN_DIR)/config.yaml ] && ! grep -qE '^  format: (chat|preference)$$' $(RUN_DIR)/config.yaml; then \
		$(PY) $(call STAGE.corpus,$(RUN_DIR)/config.yaml) || echo "bpb: could not rebuild the run's data (above)"; fi
	$(PY) -m evaluation.bpb $(RUN) --eval val $(ARGS)

# The old names said less than what they ran (`make chat` is not chat/, `make eval` not evaluation/): they
# name the new ones and stop.
chat:
	@echo "make chat is now make sample-chat RUN=... (sample.py --chat: talk to a run here); chat data: python -m chat" >&2; exit 2
eval:
	@echo "make eval is now make bpb RUN=... (python -m evaluation.bpb --eval: loss and bits per byte on val); benchmarks: make eval-bench" >&2; exit 2

plot: $(STAMP)
	$(PY) -m evaluation.plot $(RUN)

# --- benchmarks and the report card (evaluation/runs.py) -----------------------------------------------------

# make eval-bench RUN=runs/pretrain-2060                   (TASKS: a suite of configs/eval/ or lm-eval tasks)
# make eval-bench RUN=runs/smoke-corpus-cpu TASKS=fixtures  (the local test tasks: no network needed)
# make report RUN=runs/smoke-corpus-cpu                     (-> RUN/report.md)
# runs/smoke-corpus-cpu is trained first when it is missing (a fresh clone), as make serve does; the report
# rebuilds a pretraining run's data from its saved config, as make bpb does, for characters per token.
TASKS ?= enlace-es
eval-bench: $(STAMP)
	@test -e $(RUN_DIR) || test "$(RUN_DIR)" != runs/smoke-corpus-cpu || $(MAKE) smoke-corpus ARGS=
	$(PY) $(call STAGE.evaluate,$(RUN),$(TASKS)) $(ARGS)

report: $(STAMP)
	@test -e $(RUN_DIR) || test "$(RUN_DIR)" != runs/smoke-corpus-cpu || $(MAKE) smoke-corpus ARGS=
	if [ -f $(RUN_DIR)/config.yaml ] && ! grep -q '^  format: chat$$' $(RUN_DIR)/config.yaml; then \
		$(PY) $(call STAGE.corpus,$(RUN_DIR)/config.yaml) || echo "report: could not rebuild the run's data (above)"; fi
	$(PY) $(call STAGE.report,$(RUN_DIR)) $(ARGS)

# make export RUN=runs/sft-2060 TO=gguf ARGS="--dtype q8_0"   (TO: hf, gguf or ollama; OUT defaults to out/)
TO ?= hf
OUT ?= out/$(notdir $(RUN_DIR))-$(TO)
export: $(STAMP)
	$(PY) $(call STAGE.export,$(RUN),$(OUT),$(TO)) $(ARGS)

# llama.cpp parity of the GGUF export (tests/test_export.py -k llama_cpp). The first run builds
# llama-cpp-python from source for the CPU: about half an hour, which is why CI does not run it.
gguf-check: $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF" \
		$(PY) -m pip install --quiet -r requirements-gguf-check.txt
	$(VENV)/bin/pytest -q -s tests/test_export.py -k llama_cpp

search: $(STAMP)
	$(PY) search.py "$(Q)" $(ARGS)

# The family's server (API + web page) on http://127.0.0.1:8000/. Chat needs a sentencepiece run: without
# RUN= it serves runs/smoke-corpus-cpu, training it first on a fresh clone. Accounts: python -m serve member.
# DEVICE=cpu|cuda; without it, auto: the device the run trained on, where this machine has it.
SERVE_RUN = $(if $(filter command line environment,$(origin RUN)),$(RUN),runs/smoke-corpus-cpu)
SERVE_DEVICE = $(if $(filter command line environment,$(origin DEVICE)),$(DEVICE),auto)
serve: $(STAMP)
	@test -e $(SERVE_RUN) || test "$(SERVE_RUN)" != runs/smoke-corpus-cpu || $(MAKE) smoke-corpus ARGS=
	$(PY) -m serve $(SERVE_RUN) --device $(SERVE_DEVICE) $(ARGS)

# ENLACE's own CPU kernels (decode/matvec.cpp, decode/attention.cpp), built once into ~/.cache/enlace/kernels/
# (the server otherwise builds them on its first start): the compiler's output shown, then where they are.
kernels: $(STAMP)
	$(PY) -m decode.kernel

# --- tools (agent/tools.py) -----------------------------------------------------------------------------

AGENT_DATA ?= data/agent

AGENT_DATA_SOURCES := $(STAMP) agent/tools.py agent/dataset.py agent/phrases.py family/memories.py configs/agent/default.yaml

agent-data: $(AGENT_DATA)/eval.jsonl

$(AGENT_DATA)/eval.jsonl: $(AGENT_DATA_SOURCES)
	$(PY) $(call STAGE.agent-data,$(AGENT_DATA))

agent-eval: agent-data
	$(PY) $(call STAGE.tool-eval,$(RUN)) --generated $(AGENT_DATA)/eval.jsonl $(ARGS)

# corpus-smoke tokenizer -> the 16k generated tool-use conversations and the seed set, packed -> the tiny
# agent model trained on them from scratch: the ladder's best rung, a16k (one epoch, ~21 min; a second run
# replaces the first) -> the tool-use rates on every held-out conversation.
sft-agent: corpus-smoke agent-data agent-data-16k
	$(PY) $(call STAGE.chat-prepare,configs/sft-agent-tiny-16k-cpu.yaml)
	$(PY) $(call STAGE.train,configs/sft-agent-tiny-16k-cpu.yaml) $(ARGS)
	$(PY) $(call STAGE.tool-eval,runs/sft-agent-tiny-16k-cpu) --generated $(AGENT_DATA)/eval.jsonl

# The agent on a size ladder (evaluation/ladder.py): each rung trained on the same tool data with SFT
# seeds LADDER_SEEDS, then one table of the mean and min-max over seeds on both sets. A seed already
# evaluated is kept: a stopped ladder goes on where it stopped. Rung a: the 0.92M model from scratch;
# rung b: the 4.2M smoke model after the smoke-corpus pretraining. agent-ladder-c adds the ~17M rung
# (hours of CPU: docs/herramientas.md); agent-ladder-table prints the table of what has run.
LADDER_SEEDS ?= 1 2 3
LADDER_AB := --rung a configs/sft-agent-tiny-cpu.yaml --rung b configs/sft-agent-cpu.yaml configs/smoke-corpus-cpu.yaml
LADDER_C := --rung c configs/ladder-c-sft-cpu.yaml configs/ladder-c-pretrain-cpu.yaml

agent-ladder: corpus-smoke agent-data
	$(PY) -m chat prepare configs/sft-agent-cpu.yaml
	$(PY) -m evaluation.ladder $(LADDER_AB) --seeds $(LADDER_SEEDS) --generated $(AGENT_DATA)/eval.jsonl

agent-ladder-c: corpus-smoke agent-data
	$(PY) -m chat prepare configs/sft-agent-cpu.yaml
	$(PY) -m evaluation.ladder $(LADDER_AB) $(LADDER_C) --seeds $(LADDER_SEEDS) --generated $(AGENT_DATA)/eval.jsonl

# Rung a16k: rung a's model on four times the tool data (configs/agent/ladder-16k.yaml), ~21 min a seed.
AGENT_DATA_16K ?= data/agent-16k
LADDER_A16K := --rung a16k configs/sft-agent-tiny-16k-cpu.yaml

agent-data-16k: $(AGENT_DATA_16K)/eval.jsonl

$(AGENT_DATA_16K)/eval.jsonl: $(AGENT_DATA_SOURCES) configs/agent/ladder-16k.yaml
	$(PY) $(call STAGE.agent-data,$(AGENT_DATA_16K)) $(call STAGE.agent-settings,configs/agent/ladder-16k.yaml)

agent-ladder-16k: corpus-smoke agent-data agent-data-16k
	$(PY) -m chat prepare configs/sft-agent-tiny-16k-cpu.yaml
	$(PY) -m evaluation.ladder $(LADDER_A16K) --seeds $(LADDER_SEEDS) --generated $(AGENT_DATA)/eval.jsonl

# The tokenizer question (issue 35): rungs a and b on the same conversations packed with a BPE that merges
# digits into pieces (configs/data/corpus-smoke-whole-digits.yaml) instead of a token per digit. Its
# packing gives 2,888 rows: one epoch is 1,444 steps of 2 rows (rung a's 1,456 with a token per digit).
LADDER_DIGITS := --rung a-whole-digits configs/sft-agent-tiny-cpu.yaml \
	--rung b-whole-digits configs/sft-agent-cpu.yaml configs/smoke-corpus-whole-digits-cpu.yaml \
	--override data.dir=data/sft-agent-whole-digits train.max_steps=1444

agent-ladder-digits: agent-data
	$(PY) -m corpus all configs/smoke-corpus-whole-digits-cpu.yaml
	$(PY) -m chat prepare configs/sft-agent-cpu.yaml data.dir=data/sft-agent-whole-digits \
		data.chat.tokenizer=data/corpus-smoke-whole-digits/tokenizer.model
	$(PY) -m evaluation.ladder $(LADDER_DIGITS) --seeds $(LADDER_SEEDS) --generated $(AGENT_DATA)/eval.jsonl

agent-ladder-table: $(STAMP)
	$(PY) -m evaluation.ladder $(LADDER_AB) $(LADDER_A16K) $(LADDER_C) --seeds $(LADDER_SEEDS) --table

# --- the whole run in one command (chain/, docs/ejecucion.md) ----------------------------------------

# make run BOARD=2060|5090|h200|cpu [PLAN=1] [BUDGET_MIN=20] [OFFLINE=1]: configs/chain/BOARD.yaml's stages in
# order, each skipped when done and resumed where it was cut. PLAN=1 prints the plan and touches nothing;
# BUDGET_MIN scales the training stages to fit that many minutes on the board; OFFLINE=1 asks no server (the
# data downloaded elsewhere is checked here against its recorded checksums: HF_HUB_OFFLINE).
BOARD ?=
PLAN ?=
BUDGET_MIN ?=
run: $(STAMP)
	$(PY) -m chain run "$(BOARD)" $(if $(filter 1 yes true,$(PLAN)),--plan) $(OFFLINE_FLAG) \
		$(if $(BUDGET_MIN),--budget-min $(BUDGET_MIN)) $(ARGS)

# The CPU chain on this machine with the embedded corpus: ends with `ready: make serve RUN=...`.
# BOARD=2060|5090|h200: the same chain under that board's dtype policy (configs/chain/rehearsal-BOARD.yaml).
rehearsal: $(STAMP)
	$(PY) -m chain run $(if $(BOARD),rehearsal-$(BOARD),rehearsal) $(if $(filter 1 yes true,$(PLAN)),--plan) $(ARGS)

# --- the family's database ------------------------------------------------------------------------

snapshot: $(STAMP)
	$(PY) -m family $(if $(DB),--db $(DB)) snapshot

restore: $(STAMP)
	@test -n "$(SNAPSHOT)" || { echo "usage: make restore SNAPSHOT=var/snapshots/<time>" >&2; exit 2; }
	$(PY) -m family $(if $(DB),--db $(DB)) restore $(SNAPSHOT)

# --- the family's server as a system service (docs/servidor.md) -----------------------------------

# sudo make install-service RUN=runs/NAME [PORT=8000] [HOST=0.0.0.0] [DEVICE=cuda]: scripts/enlace.service
# with this folder's paths, run as SERVICE_USER (a system user, created when missing, that owns var/),
# enabled at boot and (re)started; again with another RUN= to serve another run. Without PORT=/HOST= the
# unit takes serve.port and serve.host of configs/serve/default.yaml; without DEVICE=, auto (as make serve).
SERVICE_USER ?= enlace
UNIT_DIR ?= /etc/systemd/system
SYSTEMCTL ?= systemctl
# serve.host and serve.port of the serve layer, read once and only when install-service needs them.
SERVE_DEFAULTS = $(eval SERVE_DEFAULTS := $$(shell $(PY) -c "import config; s = config.load_layer('serve', \
	'configs/serve/default.yaml'); print(s['host'], s['port'])"))$(SERVE_DEFAULTS)
SERVICE_HOST = $(if $(filter command line,$(origin HOST)),$(HOST),$(word 1,$(SERVE_DEFAULTS)))
SERVICE_PORT = $(if $(filter command line,$(origin PORT)),$(PORT),$(word 2,$(SERVE_DEFAULTS)))

install-service: $(STAMP)
	@test -e $(SERVE_RUN) || { echo "install-service: no run $(SERVE_RUN); pass RUN=runs/NAME" >&2; exit 2; }
	id -u $(SERVICE_USER) >/dev/null 2>&1 || useradd --system --user-group --home-dir $(CURDIR)/var \
		--no-create-home --shell /usr/sbin/nologin $(SERVICE_USER)
	@runuser -u $(SERVICE_USER) -- test -r $(SERVE_RUN) -a -x $(PY) || { echo "install-service: user" \
		"$(SERVICE_USER) cannot read $(CURDIR)/$(SERVE_RUN) or run $(PY): put the repository where" \
		"every user can read it (e.g. /srv/enlace)" >&2; exit 2; }
	mkdir -p var && chown -R $(SERVICE_USER): var
	sed -e 's|@ROOT@|$(CURDIR)|g' -e 's|@USER@|$(SERVICE_USER)|g' -e 's|@RUN@|$(SERVE_RUN)|g' \
		-e 's|@PORT@|$(SERVICE_PORT)|g' -e 's|@HOST@|$(SERVICE_HOST)|g' -e 's|@DEVICE@|$(SERVE_DEVICE)|g' \
		scripts/enlace.service \
		> $(UNIT_DIR)/enlace.service
	$(SYSTEMCTL) daemon-reload
	$(SYSTEMCTL) enable enlace.service
	$(SYSTEMCTL) restart enlace.service
	@echo "install-service: $(SERVE_RUN) on http://$(SERVICE_HOST):$(SERVICE_PORT)/ ($(SERVE_DEVICE)) as $(SERVICE_USER);" \
		"logs: journalctl -u enlace"

# --- the GPU server over SSH (settings in .env, see .env.example) ---------------------------------

sync:
	scripts/remote.sh sync

remote-setup: sync
	scripts/remote.sh exec make setup

remote-smoke-2060: sync
	scripts/remote.sh exec make data-smoke
	scripts/remote.sh run configs/smoke-2060.yaml $(ARGS)

remote-pretrain: sync
	scripts/remote.sh run $(CONFIG) $(ARGS) $(RESUME_FLAG)

# make run on the GPU server (make remote-setup first): the chain in tmux there, so it outlives this
# terminal and the SSH connection. make status lists it, make logs RUN_NAME=run-BOARD follows it,
# scripts/remote.sh attach run-BOARD shows it (Ctrl-b d leaves it running); again to resume after a stop.
remote-run: sync
	scripts/remote.sh chain "$(BOARD)" $(if $(BUDGET_MIN),--budget-min $(BUDGET_MIN)) $(ARGS)

logs:
	scripts/remote.sh logs $(RUN_NAME)

fetch:
	scripts/remote.sh fetch $(RUN_NAME)

status:
	scripts/remote.sh status
