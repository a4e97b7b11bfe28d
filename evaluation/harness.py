"""
ENLACE inside EleutherAI's lm-evaluation-harness: the model class lm-eval runs, the suites of the eval
layer (configs/eval/), task loading that fails fast and names the dataset, and the score.

    EnlaceLM            an lm-eval model (`@register_model("enlace")`) over a checkpoint, no export step:
                        loglikelihood, loglikelihood_rolling and generate_until, and chat prompts from
                        chat.render (lm-eval's --apply_chat_template / --system_instruction)
    plan_of(...)        what `--tasks` names: a suite of the eval layer or lm-eval task names
    load_tasks(...)     lm-eval Task objects, or one EvalError naming every dataset that cannot be read
    run(...)            lm-eval's evaluation of a plan -> its results dict
    score_rows(...)     each task's metric, standard error, chance level and centred value; score(...)
                        the ENLACE-es score: the mean of (accuracy - chance) / (1 - chance) over the tasks
    TrainingEval        the cheap subset train.py runs at checkpoints (train.eval)

Conventions (the same as lm-eval's `hf` backend, so that `--model hf` on an export gives the same numbers,
which tests/test_eval.py checks request by request):
- A context is the tokenizer's ids after <|bos|>, as training documents start (lm-eval's `hf` with
  add_bos_token=True); an empty context is <|bos|> alone. The continuation is the end of the ids of
  context + continuation (lm-eval's TemplateLM pairs them), trailing spaces of the context moved to it.
- A context that does not fit is cut from the left: the model sees the last seq_len tokens of context +
  continuation minus the last one, and scores the continuation's positions (context_window).
- Rolling log-likelihood scores a text after the prefix token in windows of seq_len (each later window
  with as much earlier text as fits), with lm-eval's own get_rolling_token_windows and
  make_disjoint_window (context_len 1, as `hf` calls them). The text itself gets no <|bos|>: `hf` with
  add_bos_token=True would also score P(<|bos|> | <|bos|>); `hf` with its default gives these numbers.
- Generation is greedy unless the task samples, with the KV cache, up to max_gen_toks new tokens after a
  context cut to seq_len - max_gen_toks, ending at <|eos|>, <|end|> or the first stop string.
- Byte-level runs work too: their prefix token is the newline byte (documents in the byte data are
  separated by blank lines) and they have no chat template (--chat is refused).

Requests are sorted longest first and batched (right padding), those with the same input sharing a row;
only the continuation's positions go through the LM head, so scoring costs the trunk plus one head row
per scored token. On the CPU attention runs on the flash kernel (as the cpu hardware profile trains).
"""

import contextlib
import difflib
import math
import os
import socket
import sys
import threading
import time
import types
import urllib.parse
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

import checkpoint
import config
import data
import fileio
from chat import template
from decode import engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SETTINGS = os.path.join(ROOT, "configs", "eval", "default.yaml")
BYTE_PREFIX = 10  # the newline byte: what precedes a document in the byte-level data


class EvalError(Exception):
    """A problem the user can fix (a task, a dataset, an argument); printed without a traceback."""


class DataMissing(EvalError):
    """Known tasks whose datasets cannot be read here (not downloaded, no network); `command` fetches them."""

    def __init__(self, message, problems, command):
        super().__init__(message)
        self.problems, self.command = problems, command


def load_settings(section=None, path=DEFAULT_SETTINGS):
    """The eval layer: a run's own eval section (validated when the run was loaded) or a layer file."""
    if section is not None:
        config.check_section("eval", section)
        return section
    return config.load_layer("eval", path)


# -----------------------------------------------------------------------------
# The model


def hidden_states(model, idx):
    """Transformer.forward without the LM head: the final-norm hidden states (B, T, d_model). Scoring
    applies the head only where a token is scored (tests check lm_head of this equals forward's logits)."""
    T = idx.shape[1]
    x = model.embed_tokens(idx)
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    for layer in model.layers:
        x = layer(x, cos, sin)
    return model.norm(x)


def context_window(context, continuation, seq_len):
    """(input ids, ids scored) of one request: the last seq_len + 1 tokens of context + continuation, cut
    from the left, minus the last; the continuation's tokens are predicted by the last len(continuation)
    inputs. A continuation longer than the window cannot be scored."""
    if not continuation:
        raise EvalError("an empty continuation has nothing to score")
    if len(continuation) > seq_len:
        raise EvalError(
            f"a continuation of {len(continuation)} tokens does not fit the model's context of {seq_len}"
        )
    tokens = (context + continuation)[-(seq_len + 1) :]
    return tokens[:-1], tokens[-len(continuation) :]


@register_model("enlace")
class EnlaceLM(TemplateLM):
    """An ENLACE checkpoint as lm-eval's model. From lm-eval's side: `--model enlace --model_args
    run=runs/x` (or simple_evaluate(model="enlace", model_args={"run": ...})); from ours: from_model()."""

    def __init__(
        self, run=None, batch_size=None, device="cpu", max_gen_toks=None, max_batch_size=None, **kwargs
    ):
        super().__init__()
        if run is None:
            raise EvalError("model_args needs run=<run directory or checkpoint file>")
        if kwargs:
            raise EvalError(f"unknown model_args for enlace: {', '.join(sorted(kwargs))}; expected run=...")
        settings = load_settings()
        device = device or "cpu"
        backend = settings["attention_backend"][torch.device(device).type]
        loaded, cfg, tokenizer, ckpt_path = checkpoint.load_run(run, device, attention_backend=backend)
        batch_size, max_gen_toks = (
            batch_size or settings["batch_size"],
            max_gen_toks or settings["max_gen_toks"],
        )
        self._setup(loaded, tokenizer, batch_size, max_gen_toks, settings["seed"], ckpt_path)

    @classmethod
    def from_model(cls, model, tokenizer, batch_size, max_gen_toks, seed, name, autocast=None):
        """A loaded model (train.py's, evaluation/runs.py's) without reading a checkpoint again; name is what the
        results call it (the checkpoint's path)."""
        lm = cls.__new__(cls)
        TemplateLM.__init__(lm)
        lm._setup(model, tokenizer, batch_size, max_gen_toks, seed, name, autocast)
        return lm

    def _setup(self, model, tokenizer, batch_size, max_gen_toks, seed, name, autocast=None):
        try:
            self.batch_size = int(batch_size)
        except (TypeError, ValueError):
            raise EvalError(f"batch size {batch_size!r}: expected a whole number (no 'auto')") from None
        if self.batch_size < 1:
            raise EvalError(f"batch size {self.batch_size}: expected >= 1")
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.max_gen_toks, self.seed = int(max_gen_toks), seed
        self.autocast = autocast or contextlib.nullcontext
        self._device = model.embed_tokens.weight.device
        self.rendered = {}  # chat prompt text -> chat.render's ids (apply_chat_template)
        self.stop_ids = {tokenizer.eos_id, tokenizer.special_ids.get("<|end|>")} - {None}
        # <unk> carries no text: left out of generated text, as lm-eval's `hf` skips special tokens.
        self.unknown_id = data.TOKEN_TABLE[data.UNK_PIECE] if tokenizer.name == "sentencepiece" else None
        self.truncated = 0  # requests whose context was cut from the left

    # ---- what lm-eval asks of a model

    @property
    def max_length(self):
        return self.model.seq_len

    @property
    def eot_token_id(self):
        return self.tokenizer.eos_id if self.tokenizer.eos_id is not None else BYTE_PREFIX

    @property
    def prefix_token_id(self):
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else BYTE_PREFIX

    @property
    def tokenizer_name(self):
        return f"enlace-{self.tokenizer.name}-{os.path.basename(str(self.name))}"

    def chat_template(self, chat_template=False):
        return f"chat.render (ENLACE chat template version {template.CHAT_TEMPLATE_VERSION})"

    def apply_chat_template(self, chat_history, add_generation_prompt=True):
        """lm-eval's chat turns as chat.render lays them out. lm-eval wants text; the text returned is
        chat.render_text's (what the export's Jinja template writes) and the ids are kept beside it, so
        the model reads chat.render's ids, never a re-tokenization of control tokens written as text.
        A final assistant message with add_generation_prompt=False is a prefill the reply continues."""
        if "<|end|>" not in self.tokenizer.special_ids:
            raise EvalError(f"{self.name}: a {self.tokenizer.name} run has no chat template (no --chat)")
        messages = [{"role": m["role"], "content": m["content"]} for m in chat_history]
        prefill = None
        if not add_generation_prompt and messages and messages[-1]["role"] == "assistant":
            prefill = messages.pop()["content"]
        conversation = {"messages": messages}
        ids, _ = template.render(conversation, self.tokenizer, for_generation=True)
        text = template.render_text(conversation, for_generation=True)
        if prefill:
            ids, text = ids + self.tokenizer.encode(prefill), text + prefill
        self.rendered[text] = ids
        return text

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        if string in self.rendered:
            return list(self.rendered[string])
        ids = self.tokenizer.encode(string)
        if add_special_tokens is not False and self.tokenizer.bos_id is not None:
            ids = [self.tokenizer.bos_id] + ids
        return ids

    def _encode_pair(self, context, continuation):
        if context in self.rendered:  # a chat prompt ends with a control token: the reply is encoded alone
            return list(self.rendered[context]), self.tokenizer.encode(continuation)
        return super()._encode_pair(context, continuation)

    # ---- scoring

    @torch.no_grad()
    def score_rows(self, rows):
        """[(input ids, [ids scored, ...])] -> for each row, [(sum of log-probabilities, every scored id the
        argmax), ...]: each list of ids scored is predicted by the row's last positions. One forward pass
        for all rows (right-padded: causal attention keeps the padding out of the rest)."""
        width = max(len(inputs) for inputs, _ in rows)
        x = torch.zeros(len(rows), width, dtype=torch.long)
        at_row, at_col, targets = [], [], []
        for row, (inputs, scored_lists) in enumerate(rows):
            x[row, : len(inputs)] = torch.tensor(inputs)
            for scored in scored_lists:
                at_row += [row] * len(scored)
                at_col += range(len(inputs) - len(scored), len(inputs))
                targets += scored
        with self.autocast():
            hidden = hidden_states(self.model, x.to(self._device))
            logits = self.model.lm_head(hidden[torch.tensor(at_row), torch.tensor(at_col)])
        logits = logits.float()
        targets = torch.tensor(targets, device=logits.device)
        picked = F.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0].tolist()
        hits = (logits.argmax(dim=-1) == targets).tolist()
        results, start = [], 0
        for _, scored_lists in rows:
            results.append([])
            for scored in scored_lists:
                end = start + len(scored)
                results[-1].append((sum(picked[start:end]), all(hits[start:end])))
                start = end
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """requests: [((context, continuation) or None, context ids, continuation ids)] -> [(log-likelihood,
        is greedy)] in the requests' order. Requests with the same model input (the choices of a question
        that are one token long, say) share one row, as lm-eval's `hf` shares their logits; the rows are
        scored longest first, batch_size at a time."""
        windows = []
        for _, context, continuation in requests:
            if len(context) + len(continuation) > self.max_length + 1:
                self.truncated += 1
            windows.append(context_window(context, continuation, self.max_length))
        rows = {}  # input ids -> the requests it serves, longest inputs first
        for index in sorted(range(len(windows)), key=lambda i: (-len(windows[i][0]), i)):
            rows.setdefault(tuple(windows[index][0]), []).append(index)
        rows = list(rows.items())
        results = [None] * len(requests)
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            scored = self.score_rows(
                [(list(inputs), [windows[i][1] for i in members]) for inputs, members in chunk]
            )
            for (_, members), answers in zip(chunk, scored, strict=True):
                for index, answer in zip(members, answers, strict=True):
                    results[index] = answer
                    if requests[index][0] is not None:
                        self.cache_hook.add_partial("loglikelihood", requests[index][0], answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        windows, owners = [], []
        for owner, request in enumerate(requests):
            (text,) = request.args
            pairs = get_rolling_token_windows(
                token_list=self.tokenizer.encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(make_disjoint_window, pairs):
                windows.append((None, context, continuation))
                owners.append(owner)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ---- generation

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm=False):
        texts = []
        for request in requests:
            context, gen_kwargs = request.args
            texts.append(self.generate_one(context, gen_kwargs))
            self.cache_hook.add_partial("generate_until", request.args, texts[-1])
        return texts

    def generate_one(self, context, gen_kwargs):
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = [stop for stop in handle_stop_sequences(kwargs.pop("until", None), eos=None) if stop]
        max_gen_toks = kwargs.pop("max_gen_toks")
        room = self.max_length - max_gen_toks
        if room < 1:
            raise EvalError(
                f"max_gen_toks {max_gen_toks} leaves no room for a prompt in the model's {self.max_length}-token "
                "context; lower it (eval layer max_gen_toks, or the task's generation_kwargs)"
            )
        ids = self.tok_encode(context)
        if len(ids) > room:
            self.truncated += 1
            ids = ids[-room:]
        temperature = kwargs.get("temperature", 0.0) if kwargs.get("do_sample") else 0.0
        generator = torch.Generator().manual_seed(self.seed)  # the same draws on any device
        new = []
        with self.autocast():
            tokens = engine.generate(
                self.model,
                torch.tensor(ids, device=self._device),
                max_gen_toks,
                temperature=temperature,
                top_k=kwargs.get("top_k") or None,
                top_p=kwargs.get("top_p"),
                generator=generator,
            )
            for token in tokens:
                if token in self.stop_ids:
                    break
                if token == self.unknown_id:
                    continue
                new.append(token)
                if until and any(stop in self.tokenizer.decode(new) for stop in until):
                    break
        return postprocess_generated_text(self.tokenizer.decode(new), until, None)


# -----------------------------------------------------------------------------
# Reaching the datasets


def install_lm_eval_compat():
    """lm-eval 0.4.13's spanish_bench/utils.py imports transformers.data.metrics.squad_metrics, which
    transformers 5 removed; the SpanishBench tasks that load that file (copa_es, paws_es, xnli_es, ...)
    then fail to load. Only xquad_es uses it: an empty module lets the others load, and xquad_es fails
    with an AttributeError naming squad_metrics if someone runs it."""
    name = "transformers.data.metrics.squad_metrics"
    try:
        __import__(name)
    except ImportError:
        import transformers.data

        metrics = types.ModuleType("transformers.data.metrics")
        metrics.squad_metrics = types.ModuleType(name)
        transformers.data.metrics = metrics
        sys.modules["transformers.data.metrics"], sys.modules[name] = metrics, metrics.squad_metrics


def offline_requested():
    return any(
        os.environ.get(k, "").lower() in ("1", "true", "yes")
        for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def go_offline():
    """Only what the Hugging Face cache holds, from now on in this process (before or after the hub and
    datasets libraries are imported)."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        sys.modules["datasets"].config.HF_HUB_OFFLINE = sys.modules["datasets"].config.HF_DATASETS_OFFLINE = (
            True
        )


def hub_reachable(timeout_s):
    """Whether a TCP connection to the Hugging Face Hub opens within timeout_s (name lookup included,
    which has no timeout of its own: it runs in a thread that is left behind if it hangs)."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urllib.parse.urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    answer = []

    def connect():
        with contextlib.suppress(OSError):
            socket.create_connection((url.hostname, port), timeout=timeout_s).close()
            answer.append(True)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return bool(answer)


def prepare_hub_access(settings, offline=False, log=print):
    """Offline when asked (--offline, HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) or when the Hub does not
    answer within hub_timeout_s: a dataset not in the cache then fails at once instead of retrying."""
    if offline or offline_requested():
        go_offline()
    elif not hub_reachable(settings["hub_timeout_s"]):
        log(
            f"huggingface.co cannot be reached (waited up to {settings['hub_timeout_s']} s): using only cached datasets"
        )
        go_offline()


def cache_folder():
    return os.environ.get("HF_DATASETS_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"),
        "datasets",
    )


# -----------------------------------------------------------------------------
# What to evaluate


@dataclass
class TaskSpec:
    name: str
    num_fewshot: int | None = None  # None: the task's own default (0 unless its YAML says)
    metric: str | None = None  # lm-eval's results key ("acc,none"); None: by output type
    chat_only: bool = False


@dataclass
class Plan:
    label: str  # the suite's name, or the task names: names the stored result
    tasks: list = field(default_factory=list)  # TaskSpec
    include_path: str | None = None
    suite: str | None = None


def plan_of(tasks_arg, settings, chat_mode, include_path=None, num_fewshot=None):
    """--tasks: the name of a suite of the eval layer, or lm-eval task names separated by commas. A
    suite's chat-only tasks (generative ones) are left out unless the prompts go through the chat
    template. num_fewshot (--num-fewshot) replaces every task's few-shot count."""
    plan = _plan_of(tasks_arg, settings, chat_mode, include_path)
    if num_fewshot is not None:
        for spec in plan.tasks:
            spec.num_fewshot = num_fewshot
    return plan


def _plan_of(tasks_arg, settings, chat_mode, include_path):
    suites = settings["suites"]
    if tasks_arg in suites:
        suite = suites[tasks_arg]
        specs = [
            TaskSpec(t["task"], t["num_fewshot"], t["metric"], t["chat_only"])
            for t in suite["tasks"]
            if chat_mode or not t["chat_only"]
        ]
        suite_path = suite.get("include_path")
        if suite_path and not os.path.isabs(suite_path):
            suite_path = os.path.join(ROOT, suite_path)
        paths = [p for p in (suite_path, include_path) if p]
        return Plan(tasks_arg, specs, paths[0] if len(paths) == 1 else paths or None, tasks_arg)
    names = [name.strip() for name in tasks_arg.split(",") if name.strip()]
    if not names:
        raise EvalError("--tasks: expected a suite name or task names separated by commas")
    label = "+".join(names)
    if len(label) > 60:
        label = f"{names[0]}+{len(names) - 1}-more-{fileio.fingerprint(names)[:8]}"
    return Plan(label, [TaskSpec(name) for name in names], include_path)


def check_include_paths(include_path):
    for path in include_path if isinstance(include_path, list) else [include_path] if include_path else []:
        if not os.path.isdir(path):
            raise EvalError(f"--include-path {path}: no such folder (expected task YAML files)")


_task_managers = {}  # (include path, with lm-eval's own tasks) -> TaskManager, built once per process


def task_manager_for(plan):
    """A TaskManager that knows the plan's tasks: only the include path's when it holds them all (a
    second), else lm-eval's whole index too (~6 s: 14,000 tasks)."""
    from lm_eval.tasks import TaskManager

    check_include_paths(plan.include_path)
    key = tuple(plan.include_path) if isinstance(plan.include_path, list) else plan.include_path
    if plan.include_path:
        if (key, False) not in _task_managers:
            _task_managers[key, False] = TaskManager(include_path=plan.include_path, include_defaults=False)
        local = _task_managers[key, False]
        if all(spec.name in local.all_tasks for spec in plan.tasks):
            return local
    if (key, True) not in _task_managers:
        _task_managers[key, True] = TaskManager(include_path=plan.include_path)
    return _task_managers[key, True]


def dataset_of(manager, name):
    """'path (name)' of a task's dataset, from its YAML, for messages."""
    entry = manager.task_index.get(name)
    try:
        from lm_eval.tasks._yaml_loader import load_yaml

        cfg = load_yaml(entry.yaml_path, resolve_func=False) if entry and entry.yaml_path else {}
    except Exception:  # noqa: BLE001 - only for the message
        cfg = {}
    path, subset = cfg.get("dataset_path"), cfg.get("dataset_name")
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if path in ("json", "csv", "parquet", "text") and files:
        listed = list(files.values()) if isinstance(files, dict) else [files]
        missing = [f for f in listed if isinstance(f, str) and "://" not in f and not os.path.exists(f)]
        return f"{path} files {', '.join(map(str, missing or listed))}" + (" (not found)" if missing else "")
    return f"{path}" + (f" ({subset})" if subset else "") if path else "its dataset"


def load_tasks(manager, plan, suites=()):
    """The plan's lm-eval tasks (Task or Group objects), each with its few-shot count set. Unknown names
    get a did-you-mean (from lm-eval's tasks and the eval layer's suites); datasets that cannot be read
    are all named in one EvalError."""
    install_lm_eval_compat()
    known = set(manager.all_tasks)
    unknown = [spec.name for spec in plan.tasks if spec.name not in known]
    if unknown:
        lines = []
        for name in unknown:
            close = difflib.get_close_matches(name, [*suites, *manager.all_tasks], n=3, cutoff=0.6)
            lines.append(
                f"{name!r}: no such lm-eval task or suite"
                + (f"; did you mean {', '.join(close)}?" if close else "")
            )
        raise EvalError("\n".join(lines) + "\n(suites of the eval layer: see configs/eval/default.yaml)")
    loaded, problems = [], []
    for spec in plan.tasks:
        try:
            with contextlib.redirect_stdout(sys.stderr):
                built = manager.load([spec.name])
        except Exception as e:  # noqa: BLE001 - datasets, the Hub and task code raise many kinds
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            problems.append(f"{spec.name}: cannot read {dataset_of(manager, spec.name)}: {reason}")
            continue
        objects = list(built["groups"].values())[:1] if built["groups"] else list(built["tasks"].values())
        if spec.num_fewshot is not None:
            for task in built["tasks"].values():
                task.set_config(key="num_fewshot", value=spec.num_fewshot)
        loaded += objects
    if problems:
        offline = offline_requested()
        command = f"python -m evaluation download {plan.suite or ','.join(s.name for s in plan.tasks)}"
        raise DataMissing(
            "\n".join(problems)
            + "\nThe Hugging Face datasets are downloaded on first use into "
            + f"{cache_folder()} (HF_HOME / HF_DATASETS_CACHE). "
            + (
                "This run is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, or huggingface.co unreachable): "
                if offline
                else ""
            )
            + f"on a machine with internet run `{command}`, copy that folder here and run with HF_DATASETS_OFFLINE=1.",
            problems,
            command,
        )
    return loaded


# -----------------------------------------------------------------------------
# Running and scoring


def run(lm, manager, task_objects, settings, limit=None, chat_mode=False, system=None, full_record=True):
    """lm-eval's evaluation of the loaded tasks: simple_evaluate's results dict (what lm-eval's CLI
    writes, samples under "samples") or, with full_record=False (training), evaluate()'s alone, without
    the environment report that costs seconds."""
    from lm_eval import evaluator

    lm.truncated = 0
    kwargs = dict(limit=limit, log_samples=True, system_instruction=system, apply_chat_template=chat_mode,
                  fewshot_as_multiturn=chat_mode, bootstrap_iters=settings["bootstrap_iters"])  # fmt: skip
    with contextlib.redirect_stdout(sys.stderr):  # lm-eval prints progress; stdout is for our table
        if full_record:
            return evaluator.simple_evaluate(
                model=lm, tasks=task_objects, task_manager=manager, batch_size=lm.batch_size, device=str(lm.device),
                random_seed=settings["seed"], numpy_random_seed=settings["seed"],
                torch_random_seed=settings["seed"], fewshot_random_seed=settings["seed"], **kwargs,
            )  # fmt: skip
        loaded = manager.load(task_objects)
        for task in loaded["tasks"].values():
            if task.get_config("num_fewshot") is None:
                task.set_config(key="num_fewshot", value=0)
            task.set_fewshot_seed(seed=settings["seed"])
        return evaluator.evaluate(lm=lm, task_dict=loaded, **kwargs)


def default_metric(output_type, task_results):
    """The metric scored when the suite names none: accuracy, exact match, or bits per byte."""
    keys = [k for k in task_results if "_stderr" not in k and k != "alias" and "," in k]
    wanted = {"multiple_choice": "acc,", "generate_until": "exact_match,", "loglikelihood": "acc,"}
    prefix = wanted.get(output_type, "bits_per_byte,")
    return next((k for k in keys if k.startswith(prefix)), keys[0] if keys else None)


def chance_of(output_type, samples):
    """Expected accuracy of a random guess: the mean of 1/choices over the documents evaluated for a
    multiple-choice task, 0 for exact-match generation; None where accuracy does not apply."""
    if output_type == "multiple_choice" and samples:
        return sum(1 / len(s["arguments"]) for s in samples) / len(samples)
    if output_type == "generate_until":
        return 0.0
    return None


def centred(value, chance):
    """(accuracy - chance) / (1 - chance): 0 at chance, 1 at perfect (nanochat's CORE centring)."""
    if chance is None or value is None or chance >= 1:
        return None
    return (value - chance) / (1 - chance)


def score_rows(results, plan):
    """One row per task of the plan (a group's subtasks each get one): metric, value, stderr, n, shots,
    chance and centred value."""
    specs = {spec.name: spec for spec in plan.tasks}
    rows = []
    for task, task_results in results["results"].items():
        if task in results.get("groups", {}) or task not in results.get("configs", {}):
            continue
        output_type = results["configs"][task].get("output_type")
        spec = specs.get(task) or TaskSpec(task)
        metric = spec.metric if spec.metric and "," in spec.metric else None
        if spec.metric and metric is None:
            metric = next((k for k in task_results if k.startswith(spec.metric + ",")), None)
        metric = metric or default_metric(output_type, task_results)
        value = task_results.get(metric)
        stderr = task_results.get(metric.replace(",", "_stderr,", 1)) if metric else None
        chance = (
            chance_of(output_type, results.get("samples", {}).get(task))
            if "acc" in str(metric) or output_type == "generate_until"
            else None
        )
        rows.append({
            "task": task, "metric": metric, "value": value,
            "stderr": stderr if isinstance(stderr, int | float) else None,
            "n": results.get("n-samples", {}).get(task, {}).get("effective"),
            "shots": results.get("n-shot", {}).get(task), "chance": chance,
            "centred": centred(value, chance),
        })  # fmt: skip
    return rows


def score(rows):
    """The mean centred value over the rows that have one (None when none has)."""
    values = [row["centred"] for row in rows if row["centred"] is not None]
    return sum(values) / len(values) if values else None


def score_name(plan):
    return "ENLACE-es score" if plan.suite == "enlace-es" else "centred score"


def fmt(value, digits=4):
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def markdown_table(rows, plan, title=None):
    lines = [f"### {title}", ""] if title else []
    lines += [
        "| task | shots | n | metric | value | ± stderr | chance | centred |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['shots'] if r['shots'] is not None else '–'} | {r['n'] or '–'} | "
            f"{r['metric']} | {fmt(r['value'])} | {fmt(r['stderr'])} | {fmt(r['chance'])} | {fmt(r['centred'])} |"
        )
    total, counted = score(rows), sum(r["centred"] is not None for r in rows)
    lines += ["", f"**{score_name(plan)}: {fmt(total)}** (mean of (accuracy − chance) / (1 − chance) over "
              f"{counted} task{'s' if counted != 1 else ''})"]  # fmt: skip
    return "\n".join(lines) + "\n"


# -----------------------------------------------------------------------------
# During training (train.eval)


@contextlib.contextmanager
def kept_rng_state():
    """lm-eval seeds and draws from the global generators: put them back, so that a run trains the same
    with or without train.eval."""
    import random

    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class TrainingEval:
    """The train.eval block: its tasks are loaded once, when training starts, then run on rank 0 every
    `interval` steps with `limit` documents per task. Each run is one metrics.jsonl record. Datasets that
    cannot be read here (no network, nothing cached) do not stop days of training for a side measurement:
    the run goes on without the benchmark, said in one line with the command that fetches them. A task
    name that does not exist still stops the run: that is a mistake in the config."""

    def __init__(self, cfg, tokenizer, autocast, log=print):
        block = cfg["train"]["eval"]
        self.settings = load_settings(cfg.get("eval"))
        self.interval, self.limit = block["interval"], block["limit"]
        self.chat_mode = cfg["data"]["format"] == "chat"
        self.plan = plan_of(block["tasks"], self.settings, self.chat_mode, block.get("include_path"))
        self.tokenizer, self.autocast, self.name = tokenizer, autocast, cfg["run_name"]
        prepare_hub_access(self.settings, log=log)
        self.manager = task_manager_for(self.plan)
        try:
            self.tasks = load_tasks(self.manager, self.plan, self.settings["suites"])
        except DataMissing as e:
            self.tasks = None
            more = f" and {len(e.problems) - 1} more" if len(e.problems) > 1 else ""
            log(
                f"train.eval: skipped, training without the benchmark: {e.problems[0]}{more}; fetch the data "
                f"with `{e.command}` (where the Hub is reachable; the cache is {cache_folder()}), then "
                "--resume benchmarks the next checkpoints, or evaluate the finished run with `python -m evaluation RUN`"
            )
            return
        log(
            f"train.eval: {', '.join(s.name for s in self.plan.tasks)} every {self.interval} steps, limit {self.limit}"
        )

    def due(self, step, at_end):
        return self.tasks is not None and (step % self.interval == 0 or at_end)

    def __call__(self, model, step):
        """Evaluate `model` (in train mode; put back in it) -> the metrics record of this step."""
        start = time.perf_counter()
        lm = EnlaceLM.from_model(model, self.tokenizer, self.settings["batch_size"],
                                 self.settings["max_gen_toks"], self.settings["seed"], self.name, self.autocast)  # fmt: skip
        model.eval()
        try:
            with kept_rng_state():
                results = run(
                    lm, self.manager, self.tasks, self.settings, self.limit, self.chat_mode, full_record=False
                )
        finally:
            model.train()
        rows = score_rows(results, self.plan)
        return {
            "step": step,
            "eval_score": score(rows),
            "eval_tasks": {r["task"]: r["value"] for r in rows},
            "eval_suite": self.plan.label,
            "eval_limit": self.limit,
            "eval_s": time.perf_counter() - start,
        }

    def line(self, record):
        tasks = " ".join(f"{name} {fmt(value, 3)}" for name, value in record["eval_tasks"].items())
        return (f"eval step {record['step']} | {score_name(self.plan)} {fmt(record['eval_score'])} | {tasks} | "
                f"{record['eval_s']:.0f}s")  # fmt: skip
