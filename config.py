"""
Layered YAML configuration checked by JSON Schema.

A run file `configs/<run>.yaml` names one file per layer under `include:` (paths relative to the folder
of the run file, i.e. configs/) and may set values of its own:

    include:
      hardware: hardware/cpu.yaml
      model: model/smoke.yaml
      train: train/smoke.yaml
      data: data/smoke.yaml
    run_name: smoke-cpu
    train:
      max_steps: 300        # overrides the value from train/smoke.yaml

A layer file holds one top-level key, its layer (`model:` ...), and may itself name a base file of the
same layer with `include: model/smoke.yaml` to override only a few values. Composition order, later
wins: included layer files, the run file, then command-line overrides `section.key=value` (values parsed
as YAML scalars; `run_name=x` for keys of the run file itself).

The composed config is validated against schema/<layer>.schema.json (the one place that says what a
valid config is), then against the cross-field rules that JSON Schema cannot say well. Every problem is
reported at once, one line each, naming the file the value came from, the key path, the value and what
would be right.

    python config.py configs/smoke-cpu.yaml [section.key=value ...] [--print]

A run's config.yaml (dump) records CONFIG_FORMAT as config_format; one without it (release 2026-12-02
and before) is format 0 and loads as is, one written by newer code is refused by name, and load returns
the config without the key.

This module never imports torch: `make lint` validates every config in a second or so.
"""

import difflib
import functools
import os
import re
import sys

import jsonschema
import yaml

LAYERS = ("hardware", "model", "train", "data", "agent", "serve", "memory", "eval")
# A run file may leave these out; their users then read a default layer file (configs/<layer>/default.yaml).
OPTIONAL_LAYERS = ("agent", "serve", "memory", "eval")
SCHEMA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schema")
COMMAND_LINE = "command line"
# 1: config_format recorded, and the keys this round made required (release 2026-12-02 and before: format 0).
CONFIG_FORMAT = 1


def _format_1(config):
    """A config.yaml of release 2026-12-02 or before gets the keys that release did not know, set to what
    its run did: no space check refused it (refuse is what every shipped train layer says now), it trained
    with AdamW from a normal initialization, shard rows were windows, and it downloaded nothing. Muon's
    Newton-Schulz dtype is float32, valid on every board (such a run never used Muon)."""
    sections = {name: config.get(name) for name in ("hardware", "model", "train", "data")}
    if isinstance(sections["train"], dict):
        sections["train"].setdefault("space_check", "refuse")
        sections["train"].setdefault("optimizer", "adamw")
    if isinstance(sections["model"], dict):
        sections["model"].setdefault("zero_init_out_proj", False)
    if isinstance(sections["hardware"], dict):
        sections["hardware"].setdefault("muon_ns_dtype", "float32")
    data = sections["data"]
    if isinstance(data, dict):
        if data.get("format") == "shards":
            data.setdefault("packing", "windows")
        if isinstance(data.get("corpus"), dict):
            data["corpus"].setdefault("download", {"workers": 4})


# CONFIG_MIGRATIONS[n] takes a saved config.yaml (a resolved config) from format n to n + 1; run files in
# configs/ are always read as they are. Add steps at the end; never edit one.
CONFIG_MIGRATIONS = (_format_1,)
EXPONENT_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")
# The one override syntax of every command: `section.key=value` (`key=value` for a key of the run file
# itself, such as run_name), the key's parts split by dots, the value a YAML scalar (parse_override).
OVERRIDE = re.compile(r"(?P<key>[A-Za-z_][\w-]*(?:\.[A-Za-z_][\w-]*)*)=(?P<value>.*)", re.DOTALL)


class ConfigError(Exception):
    """One or more problems with a config; str() gives one line per problem."""

    def __init__(self, problems):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


# -----------------------------------------------------------------------------
# Reading and composing


def _read_yaml(path, included_from=None):
    where = f" (included from {included_from})" if included_from else ""
    if not os.path.isfile(path):
        raise ConfigError([f"{path}: file not found{where}"])
    try:
        with open(path, encoding="utf-8") as f:
            content = yaml.safe_load(f)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError([f"{path}: YAML syntax error{at}: {problem}"]) from None
    if content is None:
        content = {}
    if not isinstance(content, dict):
        raise ConfigError([f"{path}: expected a mapping at the top level, got {type(content).__name__}"])
    return content


def _merge(base, update, origins, source, prefix=()):
    """Deep-merge `update` into `base` in place, recording which file set each leaf."""
    for key, value in update.items():
        path = prefix + (key,)
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value, origins, source, path)
        else:
            base[key] = _copy(value)
            for leaf in _leaf_paths(value, path):
                origins[leaf] = source


def _copy(value):
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _leaf_paths(value, path):
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from _leaf_paths(v, path + (k,))
    else:
        yield path


def _load_layer(layer, relpath, configs_root, included_from, stack):
    path = os.path.normpath(os.path.join(configs_root, relpath))
    if path in stack:
        chain = " -> ".join(stack + [path])
        raise ConfigError([f"{included_from}: include cycle: {chain}"])
    content = _read_yaml(path, included_from)
    base_relpath = content.pop("include", None)
    unexpected = sorted(set(content) - {layer})
    if unexpected:
        raise ConfigError(
            [
                f"{path}: a {layer} layer file holds only the key '{layer}:' (and optionally "
                f"'include: {layer}/<base>.yaml'); found {', '.join(map(repr, unexpected))}"
            ]
        )
    section, origins = {}, {}
    if base_relpath is not None:
        if not isinstance(base_relpath, str):
            raise ConfigError([f"{path}: include: expected a path like '{layer}/<base>.yaml'"])
        section, origins = _load_layer(layer, base_relpath, configs_root, path, stack + [path])
    body = content.get(layer) or {}
    if not isinstance(body, dict):
        raise ConfigError([f"{path}: {layer}: expected a mapping, got {type(body).__name__}"])
    _merge(section, body, origins, path, (layer,))
    return section, origins


def is_override(word, layer=None):
    """Whether a command-line word is an override, and with layer, one of that layer's settings
    (`serve.queue_size=4` for 'serve'): how a command that takes other arguments too picks them out."""
    match = OVERRIDE.fullmatch(word)
    return match is not None and (layer is None or match["key"].startswith(f"{layer}."))


def parse_override(text):
    """'train.lr=3e-4' -> (('train', 'lr'), 0.0003). Values are YAML scalars."""
    match = OVERRIDE.fullmatch(text)
    if match is None:
        raise ConfigError([f"{COMMAND_LINE}: {text!r}: expected section.key=value (e.g. train.seed=99)"])
    key, raw = match["key"], match["value"]
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return tuple(key.split(".")), _as_number(value)


def _as_number(value):
    """YAML 1.1 reads '3e-4' (no dot) as a string; on the command line it is clearly a number."""
    if isinstance(value, str) and EXPONENT_NUMBER.fullmatch(value.strip()):
        return float(value)
    return value


def compose(path, overrides=()):
    """Compose a run file, its layers and the overrides. Returns (config, origins), unvalidated."""
    configs_root = os.path.dirname(os.path.abspath(path)) or "."
    run = _read_yaml(path)
    # A run's saved config.yaml is a run file too: every layer written out, nothing to include.
    required = [layer for layer in LAYERS if layer not in OPTIONAL_LAYERS]
    resolved = "include" not in run and all(isinstance(run.get(layer), dict) for layer in required)
    includes = run.pop("include", {} if resolved else None)
    if not isinstance(includes, dict):
        raise ConfigError(
            [f"{path}: include: expected a mapping of layer to file, e.g. 'model: model/smoke.yaml'"]
        )
    problems = []
    for layer in LAYERS:
        if layer not in includes and layer not in OPTIONAL_LAYERS and not resolved:
            problems.append(f"{path}: include.{layer}: missing; name the {layer} layer file")
    for layer in includes:
        if layer not in LAYERS:
            problems.append(f"{path}: include.{layer}: unknown layer; {_suggest(layer, LAYERS, 'include.')}")
    if problems:
        raise ConfigError(problems)

    config, origins = {}, {}
    for layer in (layer for layer in LAYERS if layer in includes):
        relpath = includes[layer]
        if not isinstance(relpath, str):
            raise ConfigError([f"{path}: include.{layer}: expected a file path, got {relpath!r}"])
        section, section_origins = _load_layer(layer, relpath, configs_root, path, [os.path.abspath(path)])
        config[layer] = section
        origins.update(section_origins)
    _merge(config, run, origins, path)
    written = config.get("config_format", 0)
    if resolved and isinstance(written, int):
        for step in CONFIG_MIGRATIONS[written:]:
            step(config)

    _apply_overrides(config, origins, overrides)
    return config, origins


def _apply_overrides(config, origins, overrides, only=None):
    for text in overrides:
        keys, value = parse_override(text)
        if only is not None and keys[0] != only:
            raise ConfigError([f"{COMMAND_LINE}: {text!r}: expected {only}.key=value"])
        node = config
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        node[keys[-1]] = value
        for leaf in _leaf_paths(value, keys):
            origins[leaf] = f"{COMMAND_LINE} ({text})"


# -----------------------------------------------------------------------------
# Validation


@functools.cache
def load_schema(name):
    path = os.path.join(SCHEMA_DIR, f"{name}.schema.json")
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)  # JSON is YAML; avoids a second parser import


def _suggest(word, candidates, prefix=""):
    close = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1, cutoff=0.5)
    if close:
        return f"did you mean {prefix}{close[0]}?"
    return "valid keys: " + ", ".join(sorted(str(c) for c in candidates))


def _origin_of(path, origins, fallback):
    """The file that set `path` (or, for a missing key, the file that set its parent)."""
    path = tuple(path)
    while path:
        if path in origins:
            return origins[path]
        matches = [src for p, src in origins.items() if p[: len(path)] == path]
        if matches:
            return matches[-1]
        path = path[:-1]
    return fallback


def _schema_at(schema, path):
    node = schema
    for key in path:
        if isinstance(key, int):
            node = node.get("items", {})
        else:
            node = node.get("properties", {}).get(key, {})
    return node


def _schema_problems(section_name, instance, schema, origins, fallback):
    problems = []
    validator = jsonschema.Draft202012Validator(schema)
    for error in sorted(validator.iter_errors(instance), key=lambda e: [str(p) for p in e.absolute_path]):
        path = (section_name,) + tuple(error.absolute_path) if section_name else tuple(error.absolute_path)
        dotted = ".".join(str(p) for p in path)
        if error.validator == "additionalProperties":
            allowed = list(_schema_at(schema, error.absolute_path).get("properties", {}))
            for key in sorted(set(error.instance) - set(allowed)):
                key_path = path + (key,)
                source = _origin_of(key_path, origins, fallback)
                parent = dotted + "." if dotted else ""
                hint = _suggest(key, allowed, parent)
                problems.append(f"{source}: {parent}{key}: unknown key; {hint}")
        elif error.validator == "required":
            missing = error.message.split("'")[1] if "'" in error.message else error.message
            source = _origin_of(path, origins, fallback)
            parent = dotted + "." if dotted else ""
            description = _schema_at(schema, tuple(error.absolute_path) + (missing,)).get("description", "")
            detail = f" ({description})" if description else ""
            problems.append(f"{source}: {parent}{missing}: required key missing{detail}")
        else:
            source = _origin_of(path, origins, fallback)
            problems.append(f"{source}: {dotted}: {_describe(error)}")
    return problems


def _describe(error):
    value = error.instance
    schema = error.schema
    kind = error.validator
    if kind == "enum":
        return f"{value!r} is not allowed; allowed: {', '.join(map(repr, schema['enum']))}"
    if kind == "type":
        hint = ""
        if isinstance(value, str) and _as_number(value) is not value:
            hint = f" (YAML reads {value} as text; write it with a dot, e.g. {float(value)!r})"
        return f"{value!r} has the wrong type; expected {schema['type']}{hint}"
    if kind in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        sign = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}[kind]
        return f"{value!r} is out of range; expected {sign} {schema[kind]}"
    if kind == "pattern":
        return f"{value!r} does not match the pattern {schema['pattern']!r}"
    return f"{value!r}: {error.message}"


def _model_problems(model):
    """(key, message) for each reason a schema-valid model section cannot be built."""
    found = []
    d_model, heads, kv_heads = model["d_model"], model["n_heads"], model["n_kv_heads"]
    if d_model % heads:
        found.append(("d_model", f"{d_model} must be divisible by model.n_heads={heads}"))
    elif (d_model // heads) % 2:
        found.append(
            ("n_heads", f"head_dim = d_model/n_heads = {d_model // heads} must be even (RoPE rotates pairs)")
        )
    if heads % kv_heads:
        found.append(
            ("n_kv_heads", f"{kv_heads} must divide model.n_heads={heads} (grouped-query attention)")
        )
    return found


def _cross_field_problems(config, origins):
    """Rules between keys that JSON Schema cannot say well. Runs only on a schema-valid config."""
    problems = []

    def problem(path, message):
        dotted = ".".join(path)
        problems.append(f"{_origin_of(path, origins, COMMAND_LINE)}: {dotted}: {message}")

    hardware, model, train, data = (config[name] for name in ("hardware", "model", "train", "data"))
    for key, message in _model_problems(model):
        problem(("model", key), message)
    if data["format"] in ("shards", "chat", "preference") and model["vocab_size"] > 65536:
        problem(
            ("model", "vocab_size"),
            f"{model['vocab_size']} does not fit the uint16 shards; expected <= 65536",
        )
    tokenizer_vocab = data.get("tokenizer", {}).get("vocab_size")
    if data["format"] == "shards" and tokenizer_vocab is not None and tokenizer_vocab != model["vocab_size"]:
        problem(
            ("model", "vocab_size"),
            f"{model['vocab_size']} but data.tokenizer.vocab_size is {tokenizer_vocab}; they must be equal",
        )
    if data["format"] == "bytes" and model["vocab_size"] != 256:
        problem(("model", "vocab_size"), f"{model['vocab_size']} but data.format is bytes; expected 256")

    dpo_run, pairs = train["objective"] == "dpo", data["format"] == "preference"
    if dpo_run and not pairs:
        problem(("data", "format"), f"{data['format']!r}, but train.objective dpo trains on preference pairs; "
                "expected preference (packed by `python -m chat prepare`)")  # fmt: skip
    if pairs and not dpo_run:
        problem(("train", "objective"), f"{train['objective']!r}, but data.format preference holds pairs for "
                "DPO; expected dpo")  # fmt: skip
    if dpo_run and train["init_from"] is None:
        problem(("train", "init_from"), "null, but DPO starts from a run, which is also its reference model; "
                "name it (e.g. runs/sft-smoke-cpu)")  # fmt: skip
    dpo = train.get("dpo")
    if dpo and not dpo_run:
        problem(("train", "dpo"), f"set, but train.objective is {train['objective']!r}; remove it, or set "
                "train.objective: dpo")  # fmt: skip
    if dpo and dpo["loss_type"] == "sigmoid" and dpo["label_smoothing"] > 0:
        problem(("train", "dpo", "label_smoothing"), f"{dpo['label_smoothing']} with loss_type sigmoid, which "
                "ignores it (as TRL's DPOTrainer does); use loss_type: robust, or 0")  # fmt: skip

    decay_steps = int(train["decay_fraction"] * train["max_steps"])
    if train["warmup_steps"] + decay_steps > train["max_steps"]:
        problem(
            ("train", "warmup_steps"),
            f"warmup_steps ({train['warmup_steps']}) + decay steps ({decay_steps} = decay_fraction "
            f"{train['decay_fraction']} x max_steps) exceed train.max_steps={train['max_steps']}",
        )

    if hardware["dtype"] == "float16" and not hardware["grad_scaler"]:
        problem(("hardware", "grad_scaler"), "false, but float16 needs a GradScaler; set grad_scaler: true")
    if hardware["grad_scaler"] and hardware["dtype"] != "float16":
        problem(("hardware", "grad_scaler"), f"true, but only float16 uses it (dtype is {hardware['dtype']})")
    if hardware["dtype"] == "float16" and hardware["muon_ns_dtype"] == "bfloat16":
        problem(("hardware", "muon_ns_dtype"), "bfloat16, but the profile autocasts in float16 (a board without "
                "native bf16, where bf16 runs emulated); use float16 or float32")  # fmt: skip
    return problems


def check_section(layer, section, source="config"):
    """Validate one layer's section on its own (a model built from a dict, say); raise ConfigError."""
    problems = _schema_problems(layer, section, load_schema(layer), {}, source)
    if not problems and layer == "model":
        problems = [f"{source}: model.{key}: {message}" for key, message in _model_problems(section)]
    if problems:
        raise ConfigError(problems)


def validate(config, origins, run_path):
    """Check a composed config; raise ConfigError listing every problem."""
    written = config.get("config_format", 0)
    if isinstance(written, int) and written > CONFIG_FORMAT:  # its other keys mean what newer code says
        where = _origin_of(("config_format",), origins, run_path)
        raise ConfigError([f"{where}: config_format: {written} is newer than this code reads ({CONFIG_FORMAT}); "
                           "a later ENLACE wrote it: update this checkout"])  # fmt: skip
    run_view = {k: v for k, v in config.items() if k not in LAYERS}
    problems = _schema_problems("", run_view, load_schema("run"), origins, run_path)
    for layer in LAYERS:
        if layer in OPTIONAL_LAYERS and layer not in config:
            continue
        if not isinstance(config.get(layer), dict):
            problems.append(f"{run_path}: {layer}: expected a mapping")
            continue
        layer_problems = _schema_problems(layer, config[layer], load_schema(layer), origins, run_path)
        problems.extend(layer_problems)
    if not problems:
        problems = _cross_field_problems(config, origins)
    if problems:
        raise ConfigError(problems)


def load(path, overrides=()):
    """Compose, validate and return the resolved config of a run file."""
    config, origins = compose(path, overrides)
    validate(config, origins, path)
    config.pop("config_format", None)  # a saved config.yaml's (checked above); dump writes this code's
    return config


def load_layer(layer, path, overrides=()):
    """One layer file on its own (and the base files it includes) plus `layer.key=value` overrides,
    validated against its schema: what a tool reads when the run it serves names no such layer
    (agent/tools.py's defaults, serve/app.py's configs/serve/*.yaml)."""
    configs_root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    section, origins = _load_layer(
        layer, os.path.relpath(os.path.abspath(path), configs_root), configs_root, None, []
    )
    config = {layer: section}
    _apply_overrides(config, origins, overrides, only=layer)
    problems = _schema_problems(layer, config[layer], load_schema(layer), origins, path)
    if problems:
        raise ConfigError(problems)
    return config[layer]


def dump(config):
    """The resolved config as YAML, in layer order, with this code's config_format first (what a run saves
    as config.yaml)."""
    ordered = {"config_format": CONFIG_FORMAT}
    ordered.update({k: config[k] for k in config if k not in LAYERS and k != "config_format"})
    ordered.update({layer: config[layer] for layer in LAYERS if layer in config})
    return yaml.safe_dump(ordered, sort_keys=False, allow_unicode=True)


def _report(path, problems):
    count = len(problems)
    print(f"{path}: {count} config problem{'s' if count != 1 else ''}:", file=sys.stderr)
    for line in problems:
        print(f"  {line}", file=sys.stderr)


def check_all(folder):
    """Validate every run file directly in `folder`; returns the number of invalid ones."""
    run_files = sorted(os.path.join(folder, name) for name in os.listdir(folder) if name.endswith(".yaml"))
    if not run_files:
        print(f"{folder}: no run files (*.yaml) found", file=sys.stderr)
        return 1
    failures = 0
    for path in run_files:
        try:
            load(path)
        except ConfigError as e:
            _report(path, e.problems)
            failures += 1
    print(f"{len(run_files) - failures}/{len(run_files)} run files valid in {folder}/")
    for layer in OPTIONAL_LAYERS:
        layer_dir = os.path.join(folder, layer)
        names = (
            sorted(n for n in os.listdir(layer_dir) if n.endswith(".yaml"))
            if os.path.isdir(layer_dir)
            else []
        )
        for name in names:
            try:
                load_layer(layer, os.path.join(layer_dir, name))
            except ConfigError as e:
                _report(os.path.join(layer_dir, name), e.problems)
                failures += 1
        if names:
            print(f"{len(names)} {layer} layer files checked in {layer_dir}/")
    return failures


USAGE = (
    "usage: python config.py CONFIG [section.key=value ...] [--print]\n       python config.py --all [FOLDER]"
)


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] == "--all":
        return 2 if check_all(argv[1] if len(argv) > 1 else "configs") else 0
    args = [a for a in argv if a != "--print"]
    path, overrides = args[0], args[1:]
    try:
        config = load(path, overrides)
    except ConfigError as e:
        _report(path, e.problems)
        return 2
    if "--print" in argv:
        print(dump(config), end="")
    else:
        print(f"{path}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
