"""
Export an ENLACE run to the formats the ecosystem runs: Hugging Face (transformers, vLLM), GGUF
(llama.cpp) and an Ollama model folder.

    python export.py runs/sft-2060 --to hf out/enlace-hf                  # float32 (--dtype f16 | bf16)
    python export.py runs/sft-2060 --to gguf out/enlace-gguf --dtype q8_0  # f32 | f16 | q8_0
    python export.py runs/sft-2060 --to ollama out/enlace-ollama           # model.gguf + Modelfile
    python export.py runs/sft-2060/ckpt_0001000.pt --to hf out/x --force   # replace a non-empty folder

The model is model.py's Qwen3-style decoder, whose parameter names already follow Hugging Face's Qwen3:
the export renames, never transforms, and the tied embedding is stored once. The tokenizer is the
sentencepiece model inside the checkpoint (checkpoint.py), written as it is and translated into
tokenizer.json (a BPE with byte fallback and the same pieces and merge order) and GGUF's llama/spm
vocabulary. The chat template is chat.render's layout as Jinja (CHAT_TEMPLATE below; tests prove the two
give identical text and ids) and as a Go template for Ollama.

Control tokens and text that looks like one: chat.render never makes a control token out of text. The
Hugging Face tokenizer has the control tokens as special added tokens, because a chat template's output
is text in which they must be found; tokenize untrusted text with `split_special_tokens=True` (then a
user typing "<|user|>" gets the same plain-text ids as sentencepiece gives), or render the prompt from ids
as serve/app.py does. A template-based server (vLLM, llama.cpp, Ollama) sees "<|user|>" typed by a user as
the control token: that is how every text chat template works, and why ENLACE's own server renders ids.

Everything is written to a temporary folder beside OUT and renamed to OUT at the end: an interrupted or
failed export leaves no half-written OUT.
"""

import argparse
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

import data
import fileio
from chat import template
from checkpoint import CheckpointError, load_run

FORMATS = {"hf": ("f32", "f16", "bf16"), "gguf": ("f32", "f16", "q8_0"), "ollama": ("f32", "f16", "q8_0")}
DEFAULT_DTYPE = {"hf": "f32", "gguf": "f16", "ollama": "q8_0"}
TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
HF_DTYPE_NAMES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
STOP_TOKENS = ("<|end|>", "<|eos|>")  # end of a turn, end of a text
GGUF_NAME = "model.gguf"


class ExportError(Exception):
    """A run or an output folder that cannot be exported to; the message says which and why."""


# -----------------------------------------------------------------------------
# The chat template, as Jinja (transformers, vLLM, llama.cpp) and as a Go template (Ollama).
# Both write chat.segments()'s layout; test_export.py checks the Jinja one against chat.render_text.
# Tool-call arguments may be a dict (written with tojson, like chat/template.py's json.dumps) or a JSON string
# (written as it is: identical when it is json.dumps' default formatting, as OpenAI's Python client sends).
# The macro plain() is chat.plain_text: the tool tags in every role's text escaped (the assistant's too).

CHAT_TEMPLATE = (
    "{%- macro plain(text) -%}{{- text"
    + "".join(f" | replace('{tag}', '&lt;{tag[1:-1]}&gt;')" for tag in template.PROTOCOL_TAGS)
    + " -}}{%- endmacro -%}"
    "{{- '<|bos|>' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}{%- set system = none -%}{%- set rest = messages -%}{%- endif -%}"
    "{%- if system is not none or tools -%}"
    "{{- '<|system|>' -}}{%- if system -%}{{- plain(system) -}}{%- endif -%}"
    "{%- if system and tools -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{%- if tools -%}{{- '<tools>\\n' -}}"
    "{%- for tool in tools -%}{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}{{- tool | tojson -}}"
    "{%- endfor -%}{{- '\\n</tools>' -}}{%- endif -%}"
    "{{- '<|end|>' -}}"
    "{%- endif -%}"
    "{%- for message in rest -%}"
    "{%- if message['role'] == 'user' -%}{{- '<|user|>' + plain(message['content']) + '<|end|>' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- '<|assistant|>' -}}"
    "{%- set content = message['content'] if message['content'] else '' -%}{{- plain(content) -}}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set function = call['function'] if call['function'] is defined else call -%}"
    "{%- set arguments = function['arguments'] -%}"
    "{{- '<tool_call>\\n{\"name\": ' + function['name'] | tojson + ', \"arguments\": ' -}}"
    "{%- if arguments is string -%}{{- arguments if arguments else '{}' -}}"
    "{%- else -%}{{- arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}{{- '<|end|>' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|tool|><tool_response>\\n' + plain(message['content']) + '\\n</tool_response><|end|>' -}}"
    "{%- else -%}{{- raise_exception('a ' + message['role'] + ' message may only come first') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)

# Ollama's Go template: .System (the system message), .Tools and .Messages as Ollama passes them; system
# messages in .Messages are skipped, as in Ollama's own Qwen templates. Its json function (Go's
# encoding/json, the only JSON writer a template has) writes compact JSON with <, > and & escaped, and a
# tool's "required" before its "properties": only the JSON inside <tools> and a call's arguments differ
# from chat.render's text (tests/ollama_template.go executes this template as Ollama does). A Go template
# has no string replacement: tool tags inside system, user, tool or assistant text reach an Ollama model as the tags
# (chat.plain_text escapes them everywhere else; serve/app.py renders with chat.render).
# What export says once for --to ollama (docs/exportar.md, "Texto que imita el protocolo").
OLLAMA_LIMIT = (
    "ollama: text that spells a tool tag or a control token (<tool_call>, <|user|>) reaches the model as that "
    "token: a Go template cannot escape it and Ollama reads special tokens out of the prompt; for text you "
    "do not trust serve with ENLACE's own server (docs/exportar.md)"
)
OLLAMA_TEMPLATE = """<|bos|>{{- if or .System .Tools }}<|system|>{{ .System }}
{{- if and .System .Tools }}

{{ end }}
{{- if .Tools }}<tools>
{{ range $i, $tool := .Tools }}{{ if $i }}
{{ end }}{{ json $tool }}{{ end }}
</tools>{{ end }}<|end|>{{ end }}
{{- range .Messages }}
{{- if eq .Role "user" }}<|user|>{{ .Content }}<|end|>
{{- else if eq .Role "assistant" }}<|assistant|>{{ .Content }}{{ $content := .Content }}
{{- range $i, $call := .ToolCalls }}{{ if or $i $content }}
{{ end }}<tool_call>
{"name": "{{ $call.Function.Name }}", "arguments": {{ json $call.Function.Arguments }}}
</tool_call>{{ end }}<|end|>
{{- else if eq .Role "tool" }}<|tool|><tool_response>
{{ .Content }}
</tool_response><|end|>
{{- end }}
{{- end }}<|assistant|>"""


# -----------------------------------------------------------------------------
# Reading the run


def load_for_export(run):
    try:
        model, cfg, tokenizer, ckpt_path = load_run(run, log=lambda m: print(m, file=sys.stderr))
    except (CheckpointError, data.DataError) as e:
        raise ExportError(str(e)) from None
    if tokenizer.name != "sentencepiece":
        raise ExportError(
            f"{ckpt_path}: a {tokenizer.name} run; export needs a run trained with this project's "
            "sentencepiece tokenizer (data.format: shards), whose control tokens the chat template uses"
        )
    return model, cfg, tokenizer, ckpt_path


def hf_state_dict(model, dtype):
    """Qwen3ForCausalLM names: `model.` + ours; lm_head is the embedding (tie_word_embeddings) and omitted."""
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        state[f"model.{name}"] = tensor.detach().to(TORCH_DTYPES[dtype]).contiguous()
    return state


def hf_config(cfg, dtype):
    m = cfg["model"]
    table = data.TOKEN_TABLE
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": m["vocab_size"],
        "hidden_size": m["d_model"],
        "intermediate_size": m["ffn_hidden"],
        "num_hidden_layers": m["n_layers"],
        "num_attention_heads": m["n_heads"],
        "num_key_value_heads": m["n_kv_heads"],
        "head_dim": m["d_model"] // m["n_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": m["seq_len"],
        "rms_norm_eps": m["norm_eps"],
        "rope_theta": m["rope_base"],
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "bos_token_id": table["<|bos|>"],
        "eos_token_id": table["<|eos|>"],
        "initializer_range": m["init_std"],
        "dtype": HF_DTYPE_NAMES[dtype],  # transformers 5; earlier versions (and vLLM's) read torch_dtype
        "torch_dtype": HF_DTYPE_NAMES[dtype],
    }


# -----------------------------------------------------------------------------
# The tokenizer, translated


def vocabulary(tokenizer):
    """(pieces, scores, kinds) of every id; kind is normal, unknown, control, user_defined or byte."""
    processor = tokenizer.processor
    pieces, scores, kinds = [], [], []
    for index in range(tokenizer.vocab_size):
        piece = processor.id_to_piece(index)
        if processor.is_unknown(index):
            kind = "unknown"
        elif processor.is_control(index):
            kind = "control"
        elif processor.is_byte(index):
            kind = "byte"
        elif piece in data.USER_DEFINED_PIECES:
            kind = "user_defined"
        else:
            kind = "normal"
        pieces.append(piece)
        scores.append(processor.get_score(index))
        kinds.append(kind)
    return pieces, scores, kinds


def bpe_merges(pieces, scores, kinds):
    """The merges that rebuild sentencepiece's BPE: every split of a normal piece into two pieces of the
    vocabulary, ranked by the merged piece's score (sentencepiece merges the best-scoring piece first)."""
    vocab = {
        piece: index
        for index, (piece, kind) in enumerate(zip(pieces, kinds, strict=True))
        if kind == "normal"
    }
    merges = []
    for piece, index in vocab.items():
        splits = [
            (piece[:cut], piece[cut:])
            for cut in range(1, len(piece))
            if {piece[:cut], piece[cut:]} <= set(vocab)
        ]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges += [(-scores[index], index, left, right) for left, right in splits]
    merges.sort(key=lambda m: m[:2])
    return [(left, right) for _, _, left, right in merges]


def hf_tokenizer_json(tokenizer):
    """tokenizer.json: the same BPE, "▁" for spaces and no dummy prefix (add_dummy_prefix is off), byte
    fallback, control tokens as special added tokens and the newline and tool tags as plain added tokens
    (always one piece, also inside text, as for sentencepiece's user-defined pieces)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    pieces, scores, kinds = vocabulary(tokenizer)
    bpe = models.BPE(
        vocab={piece: index for index, piece in enumerate(pieces)},
        merges=bpe_merges(pieces, scores, kinds),
        unk_token=data.UNK_PIECE,
        byte_fallback=True,
        fuse_unk=True,
    )
    hf = Tokenizer(bpe)
    hf.normalizer = normalizers.Replace(" ", "\u2581")
    hf.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    special = [p for p, k in zip(pieces, kinds, strict=True) if k in ("unknown", "control")]
    hf.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in special])
    user = [p for p, k in zip(pieces, kinds, strict=True) if k == "user_defined"]
    hf.add_tokens([AddedToken(p, special=False, normalized=False) for p in user])
    return hf.to_str(pretty=True)


def hf_tokenizer_config(cfg):
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "unk_token": data.UNK_PIECE,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["model"]["seq_len"],
        "chat_template": CHAT_TEMPLATE,
        "enlace_chat_template_version": template.CHAT_TEMPLATE_VERSION,
    }


# -----------------------------------------------------------------------------
# Writers: each fills a fresh folder


def write_hf(folder, model, cfg, tokenizer, dtype):
    from safetensors.torch import save_file

    save_file(
        hf_state_dict(model, dtype), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"}
    )
    fileio.write_json(os.path.join(folder, "config.json"), hf_config(cfg, dtype))
    table = data.TOKEN_TABLE
    generation = {"bos_token_id": table["<|bos|>"], "eos_token_id": [table[t] for t in STOP_TOKENS]}
    fileio.write_json(os.path.join(folder, "generation_config.json"), generation)
    fileio.write_json(os.path.join(folder, "tokenizer_config.json"), hf_tokenizer_config(cfg))
    fileio.write_atomic(
        os.path.join(folder, "tokenizer.json"), lambda f: f.write(hf_tokenizer_json(tokenizer).encode())
    )
    proto = tokenizer.processor.serialized_model_proto()
    fileio.write_atomic(os.path.join(folder, "tokenizer.model"), lambda f: f.write(proto))


# llama.cpp's names of our tensors (arch qwen3); no permutation: both use rotate-half RoPE (NEOX).
GGUF_TENSORS = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GGUF_TOKEN_TYPES = {"normal": 1, "unknown": 2, "control": 3, "user_defined": 4, "byte": 6}


def gguf_name(name):
    if name.startswith("layers."):
        _, index, rest = name.split(".", 2)
        return f"blk.{index}.{GGUF_TENSORS[rest]}"
    return GGUF_TENSORS[name]


# q8_0 keeps the tied embedding in f16: it is also the output layer, where llama.cpp's q8_0 matmul (weights
# and activations in 8-bit blocks) flips near-tied top tokens. Measured on the smoke-sized SFT model (d256,
# 4096 tokens), top-1 agreement with ENLACE over 5120 positions: all q8_0 98.87%, this 99.39%, for a file
# 21% larger (4.57 -> 5.55 MB).
GGUF_F16_IN_Q8_0 = {"token_embd.weight"}


def gguf_tensor(name, tensor, dtype):
    """(array, quantization type) for GGUF: vectors stay float32 (as llama.cpp's converter keeps them); q8_0
    needs rows that are a multiple of its 32-value blocks, and a matrix whose rows are not falls back to f16."""
    import gguf

    array = tensor.detach().float().numpy()
    if array.ndim == 1 or dtype == "f32":
        return array, gguf.GGMLQuantizationType.F32
    if (
        dtype == "q8_0"
        and name not in GGUF_F16_IN_Q8_0
        and array.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0
    ):
        return gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    return array.astype(np.float16), gguf.GGMLQuantizationType.F16


def write_gguf(path, model, cfg, tokenizer, dtype):
    import gguf

    m = cfg["model"]
    table = data.TOKEN_TABLE
    writer = gguf.GGUFWriter(path, arch="qwen3")
    writer.add_name(cfg["run_name"])
    writer.add_file_type(
        {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16}.get(
            dtype, gguf.LlamaFileType.MOSTLY_Q8_0
        )
    )
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(m["seq_len"])
    writer.add_embedding_length(m["d_model"])
    writer.add_block_count(m["n_layers"])
    writer.add_feed_forward_length(m["ffn_hidden"])
    writer.add_head_count(m["n_heads"])
    writer.add_head_count_kv(m["n_kv_heads"])
    writer.add_key_length(m["d_model"] // m["n_heads"])
    writer.add_value_length(m["d_model"] // m["n_heads"])
    writer.add_rope_freq_base(m["rope_base"])
    writer.add_layer_norm_rms_eps(m["norm_eps"])
    writer.add_vocab_size(m["vocab_size"])

    pieces, scores, kinds = vocabulary(tokenizer)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types([GGUF_TOKEN_TYPES[k] for k in kinds])
    writer.add_unk_token_id(table[data.UNK_PIECE])
    writer.add_bos_token_id(table["<|bos|>"])
    writer.add_eos_token_id(table["<|eos|>"])
    writer.add_eot_token_id(table["<|end|>"])
    # The template writes <|bos|> itself, and documents were trained without a space in front.
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp uses token_embd when output.weight is absent
        array, kind = gguf_tensor(gguf_name(name), tensor, dtype)
        writer.add_tensor(gguf_name(name), array, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_ollama(folder, model, cfg, tokenizer, dtype):
    write_gguf(os.path.join(folder, GGUF_NAME), model, cfg, tokenizer, dtype)
    lines = [f"FROM ./{GGUF_NAME}", f'TEMPLATE """{OLLAMA_TEMPLATE}"""']
    lines += [f'PARAMETER stop "{token}"' for token in STOP_TOKENS]
    lines += [f"PARAMETER num_ctx {cfg['model']['seq_len']}"]
    text = "\n".join(lines) + "\n"
    fileio.write_atomic(os.path.join(folder, "Modelfile"), lambda f: f.write(text.encode()))


# -----------------------------------------------------------------------------


# Bytes per weight of each dtype; q8_0 counts as f16, an upper bound (its embedding and vectors are wider).
DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 2}


def export_bytes(model, dtype):
    """About the bytes an export writes: each weight once (tied ones once) at dtype's width, plus the
    tokenizer files (a few MB at most)."""
    return sum(p.numel() for p in model.parameters()) * DTYPE_BYTES[dtype] + 4 * 2**20


def write_format(fmt, folder, model, cfg, tokenizer, dtype):
    if fmt == "hf":
        write_hf(folder, model, cfg, tokenizer, dtype)
    elif fmt == "gguf":
        write_gguf(os.path.join(folder, GGUF_NAME), model, cfg, tokenizer, dtype)
    else:
        write_ollama(folder, model, cfg, tokenizer, dtype)


def export(run, fmt, out, dtype=None, force=False, log=print):
    """Write `run` in format `fmt` to the folder `out`; returns the list of files written."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    dtype = dtype or DEFAULT_DTYPE[fmt]
    if dtype not in FORMATS[fmt]:
        raise ExportError(
            f"--dtype {dtype} is not available for {fmt}; choose one of {', '.join(FORMATS[fmt])}"
        )
    out = os.path.abspath(out)
    if os.path.isfile(out) or (os.path.isdir(out) and os.listdir(out) and not force):
        raise ExportError(
            f"{out} exists and is not an empty folder; choose another or pass --force to replace it"
        )
    model, cfg, tokenizer, ckpt_path = load_for_export(run)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    needed = export_bytes(model, dtype)
    fileio.check_space(out, needed, what=f"the {fmt} export ({dtype})")
    scratch = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=parent)
    try:
        with fileio.reporting_storage(out, needed, what=f"the {fmt} export ({dtype})"):
            write_format(fmt, scratch, model, cfg, tokenizer, dtype)
        os.chmod(scratch, 0o755)  # mkdtemp makes it private; the files too may be (safetensors)
        for name in os.listdir(scratch):
            os.chmod(os.path.join(scratch, name), 0o644)
        if os.path.isdir(out):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".old", dir=parent)
            os.replace(out, os.path.join(old, "replaced"))
            os.replace(scratch, out)
            shutil.rmtree(old)
        else:
            os.replace(scratch, out)
    finally:
        if os.path.isdir(scratch):
            shutil.rmtree(scratch)
    files = sorted(os.listdir(out))
    log(f"exported {ckpt_path} ({dtype}) as {fmt} to {out}/: {', '.join(files)}")
    if fmt == "ollama":
        log(OLLAMA_LIMIT)
    return files


@fileio.reports_storage_errors
def main(argv):
    parser = argparse.ArgumentParser(description="Export an ENLACE run to Hugging Face, GGUF or Ollama.")
    parser.add_argument("run", help="run directory (newest checkpoint) or a checkpoint file")
    parser.add_argument("out", help="output folder (created; must be empty unless --force)")
    parser.add_argument("--to", required=True, metavar="FORMAT", help="hf, gguf or ollama")
    parser.add_argument("--dtype", help="f32, f16, bf16 (hf) or q8_0 (gguf, ollama)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    args = parser.parse_args(argv)
    try:
        export(args.run, args.to, args.out, args.dtype, args.force)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
