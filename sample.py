"""
Use a trained run: generate text or chat (bits per byte and held-out conversations: evaluation/bpb.py).

    python sample.py runs/smoke-cpu --prompt "Había una vez" --max-new-tokens 200 --seed 1
    python sample.py runs/smoke-cpu/ckpt_0000300.pt --prompt-file prompt.txt --num-samples 3 --batch 3
    python sample.py runs/sft-smoke-cpu --chat --system "Eres un asistente amable."

A run directory means its newest checkpoint. The checkpoint carries the resolved config and the tokenizer
it was trained with (checkpoint.load_run), so nothing here depends on the training code or on data/.
Inference runs in float32 on the CPU, or on CUDA with --device cuda.
"""

import json
import sys

import torch

import checkpoint
import data
from agent import call_bias, grammar, tools
from chat import template, visible
from checkpoint import CheckpointError
from decode import engine, load


class SampleError(load.LoadError):
    """A problem the user can fix; printed without a traceback, exit status 2 (decode/load.run_command)."""


def load_run(path, device="cpu"):
    """checkpoint.load_run with its errors as SampleError, which evaluation/tool_use.py catches."""
    try:
        return checkpoint.load_run(path, device)
    except CheckpointError as e:
        raise SampleError(str(e)) from None


# -----------------------------------------------------------------------------
# Generation


def stream_text(model, tokenizer, prompt_ids, args, generator, write, stop_token=None, constraint=None):
    """Generate from prompt_ids, handing decoded text to write(piece) as it comes; write returns True to
    end the reply early. Stops at stop_token or the end-of-text token (neither is written). A constraint
    (agent/grammar.py) masks each step's logits: the tool calls of a chat reply."""
    device = model.embed_tokens.weight.device
    stop_tokens = {stop_token, tokenizer.eos_id} - {None}
    decoder = data.StreamDecoder(tokenizer)
    for token in engine.generate(
        model,
        torch.tensor(prompt_ids, device=device),
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        generator=generator,
        constraint=constraint,
    ):  # stop tokens are checked here: a chat has two (end of turn, end of text)
        if token in stop_tokens:
            break
        if write(decoder.push(token)):
            return
    write(decoder.flush())


def generate_batch(model, prompts, max_new_tokens, slots, sampling, stop_tokens=(), decoder=None):
    """Continuous batching over a list of prompts (lists of token ids): up to `slots` rows decode together
    in an engine.Decoder, a row leaving at a stop token (kept) or after max_new_tokens, the next prompt taking
    its slot. sampling(i) gives prompt i's Decoder.add settings (temperature, top_k, top_p, generator).
    Returns each prompt's new token ids, in order. The tokens are those each prompt gets alone in a
    decoder of as many slots; against --batch 1 they can differ only where float32 rounding flips a tie.
    `decoder`: an empty Decoder of the model to use (a compiled one, built once for many calls) instead
    of a plain one of `slots` slots."""
    decoder = decoder or engine.Decoder(model, slots)
    waiting, rows, generated = list(enumerate(prompts)), {}, [[] for _ in prompts]
    with torch.no_grad():
        while waiting or rows:
            while waiting and len(rows) < slots:
                index, prompt = waiting.pop(0)
                rows[decoder.add(prompt, **sampling(index))] = index
            going_on = {}
            chosen = decoder.sample_rows(list(rows))
            for row, index in list(rows.items()):
                token = chosen[row]
                generated[index].append(token)
                if token in stop_tokens or len(generated[index]) == max_new_tokens:
                    decoder.remove(row)
                    del rows[row]
                else:
                    going_on[row] = token
            decoder.advance(going_on)
    return generated


def write_to(out, collected=None):
    def write(piece):
        out.write(piece)
        out.flush()
        if collected is not None:
            collected.append(piece)
        return False

    return write


def shown_writer(out, pieces):
    """write(piece, final=False) for a chat reply: collects the pieces and writes what chat/visible.py lets a
    person see of the reply so far (never a call, a tag or call-shaped JSON)."""
    sent = [0]

    def write(piece, final=False):
        pieces.append(piece)
        seen = visible.shown("".join(pieces), final)
        if len(seen) > sent[0]:
            out.write(seen[sent[0] :])
            out.flush()
            sent[0] = len(seen)
        return False

    return write


def prompt_ids_of(tokenizer, text):
    ids = tokenizer.encode(text)
    if tokenizer.bos_id is not None:
        ids = [tokenizer.bos_id] + ids
    if not ids:
        raise SampleError("the prompt is empty and this tokenizer has no <|bos|> token to start from")
    return ids


def run_generation(model, tokenizer, args):
    """--num-samples samples of the prompt; sample i draws with its own generator seeded --seed + i, so
    that --batch (samples decoded together, each printed when all are done) draws the same."""
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompt = f.read()
    else:
        prompt = args.prompt
    prompt_ids = prompt_ids_of(tokenizer, prompt)

    def generator_of(index):
        return torch.Generator().manual_seed(args.seed + index)  # CPU: the same draws on any device

    def settings(index):
        return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                "generator": generator_of(index)}  # fmt: skip

    slots = min(args.batch or 1, args.num_samples)
    if slots > 1:
        samples = generate_batch(model, [prompt_ids] * args.num_samples, args.max_new_tokens, slots, settings,
                                 {tokenizer.eos_id} - {None})  # fmt: skip
    for index in range(args.num_samples):
        if args.num_samples > 1:
            print(f"--- sample {index + 1}/{args.num_samples}")
        sys.stdout.write(prompt)
        if slots > 1:
            ids = [token for token in samples[index] if token != tokenizer.eos_id]
            sys.stdout.write(tokenizer.decode(ids))
        else:
            stream_text(model, tokenizer, prompt_ids, args, generator_of(index), write_to(sys.stdout))
        sys.stdout.write("\n")
        sys.stdout.flush()


# -----------------------------------------------------------------------------
# Chat REPL: every prompt is chat.render's ids, the one template training used


def check_chat_tokenizer(tokenizer, run):
    if "<|end|>" not in tokenizer.special_ids:
        raise SampleError(
            f"{run}: this model uses the {tokenizer.name} tokenizer, which has no control tokens; chat needs "
            "a sentencepiece tokenizer (pretrain with data.format: shards, fine-tune with data.format: chat)"
        )
    return tokenizer.special_ids["<|end|>"]


def fit_history(system, history, tokenizer, budget):
    """Drop the oldest exchanges (and, for one long message, its start) until the prompt fits budget
    tokens. Returns (prompt ids, whether anything was dropped)."""
    dropped = False
    while True:
        prompt, _ = template.render({"messages": system + history}, tokenizer, for_generation=True)
        if len(prompt) <= budget:
            return prompt, dropped
        dropped = True
        if len(history) == 1:  # a single message longer than the window: keep its end
            content = history[0]["content"]
            history[0] = {**history[0], "content": content[len(content) // 4 + 1 :]}
            continue
        history.pop(0)
        while history and history[0]["role"] != "user":
            history.pop(0)


def run_chat(model, tokenizer, cfg, args, stdin=sys.stdin, out=sys.stdout, policy=None):
    """The REPL. With tools (the default; --no-tools to leave them out) each answer is agent/tools.py's loop,
    its calls and results shown; policy(conversation) -> text stands in for the model in tests."""
    end_id = check_chat_tokenizer(tokenizer, args.run)
    context = cfg["model"]["seq_len"]
    budget = context - args.max_new_tokens
    if budget < 16:
        raise SampleError(
            f"--max-new-tokens {args.max_new_tokens} leaves no room in a {context}-token context"
        )
    system = [{"role": "system", "content": args.system}] if args.system else []
    history = []  # the conversation's messages after the system one
    told_about_trimming = False
    generator = torch.Generator().manual_seed(args.seed)
    specs = None
    if not args.no_tools:
        try:  # the run's own call bias, chosen by evaluation/tool_use.py
            settings = call_bias.settings_for_run(tools.load_settings(cfg.get("agent")), args.run)
        except (ValueError, OSError) as e:
            raise SampleError(str(e)) from None
        count = lambda text: len(tokenizer.encode(text))
        specs = tools.Agent(settings, count_tokens=count, on_event=show_tool_event(out))
        needed = len(template.render(specs.conversation([{"role": "user", "content": "hola"}]), tokenizer)[0])
        if needed > budget:
            out.write(
                f"(tools off: their schemas need {needed} of the {budget} tokens this context leaves)\n"
            )
            specs = None
        elif policy is not None:
            policy = shown_reply(policy, out)
        else:
            policy = streamed_reply(model, tokenizer, args, generator, end_id, budget, out, settings)
    out.write(f"chat with {args.run}; /reset clears the history, /exit quits\n")
    while True:
        out.write("> ")
        out.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:  # Ctrl-C at the prompt drops the line; /exit or Ctrl-D quit
            out.write("\n")
            continue
        if not line:  # end of input
            out.write("\n")
            return
        line = line.strip()
        if line == "/exit":
            return
        if line == "/reset":
            history = []
            out.write("(history cleared)\n")
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        if specs is not None:
            while (
                len(history) > 1
                and len(template.render(specs.conversation(system + history), tokenizer)[0]) > budget
            ):
                history.pop(0)  # the oldest exchange goes, up to the next user message
                while history[0]["role"] != "user":
                    history.pop(0)
                if not told_about_trimming:
                    out.write("(oldest turns dropped to fit the context window)\n")
                    told_about_trimming = True
            history += specs.run_turn(system + history, policy)
            continue
        prompt, dropped = fit_history(system, history, tokenizer, budget)
        if dropped and not told_about_trimming:
            out.write("(oldest turns dropped to fit the context window)\n")
            told_about_trimming = True
        reply = []
        write = shown_writer(out, reply)
        banned = visible.ProtocolBan(data.TOKEN_TABLE)  # no tools: no call, no control token
        try:
            stream_text(
                model, tokenizer, prompt, args, generator, write, stop_token=end_id, constraint=banned
            )
        except KeyboardInterrupt:  # Ctrl-C ends this answer, not the session
            out.write(" [interrupted]")
        write("", final=True)
        out.write("\n")
        text = visible.shown("".join(reply)).strip()
        if text:
            history.append({"role": "assistant", "content": text})
        else:  # an empty answer is no turn: the template never holds one
            history.pop()
            out.write("(empty reply)\n")


def streamed_reply(model, tokenizer, args, generator, end_id, budget, out, settings):
    """tools.run_turn's generate: the model's next reply, streamed to out without its tool calls; its calls
    constrained to the tools on offer (agent/grammar.py) unless agent.constrained is off."""

    def reply(conversation):
        ids, _ = template.render(conversation, tokenizer, for_generation=True)
        if len(ids) > budget:
            out.write(f"(the conversation is {len(ids)} tokens, over the {budget}-token budget; /reset)\n")
            return ""
        pieces, shown = [], [0]

        def write(piece):
            pieces.append(piece)
            visible = tools.visible_text("".join(pieces))
            out.write(visible[shown[0] :])
            out.flush()
            shown[0] = max(shown[0], len(visible))
            return False

        specs = conversation.get("tools")
        constraint = grammar.constraint_for(
            tokenizer, specs, settings, args.max_new_tokens, conversation["messages"]
        )
        constraint = visible.ProtocolBan(data.TOKEN_TABLE, constraint, calls_allowed=bool(specs))
        try:
            stream_text(model, tokenizer, ids, args, generator, write, end_id, constraint)
        except KeyboardInterrupt:  # Ctrl-C ends this reply, not the session
            out.write(" [interrupted]")
        out.write("\n")
        return "".join(pieces)

    return reply


def shown_reply(policy, out):
    """A policy's replies written to out as the model's would be streamed (tests drive the REPL so)."""

    def reply(conversation):
        text = policy(conversation)
        out.write(tools.visible_text(text) + "\n")
        return text

    return reply


def show_tool_event(out):
    """agent.Agent's on_event for a person: each call, each result, and what the loop added."""

    def show(kind, info):
        if kind == "call":
            what = info["raw"].strip() if info["error"] else json.dumps(info["arguments"], ensure_ascii=False)
            line = f"{info['name'] or '?'} {what}"
            out.write(f"  [tool call] {line if len(line) <= 400 else line[:400] + '…'}\n")
        elif kind == "result":
            text = info["text"] if len(info["text"]) <= 400 else info["text"][:400] + "…"
            label = "tool result" if info["ok"] else "tool error"
            out.write(f"  [{label}] " + text.replace("\n", "\n    ") + "\n")
        elif kind == "dropped":
            out.write(f"  [tool calls dropped: {info['reason']}]\n")
        elif kind == "answer" and info["text"] == tools.NO_ANSWER:
            out.write(info["text"] + "\n")
        elif kind == "answer" and f"\n{tools.SOURCES_HEADER}\n" in info["text"]:
            out.write(info["text"][info["text"].index(tools.SOURCES_HEADER) :] + "\n")
        out.flush()

    return show


# -----------------------------------------------------------------------------


def parse_args(argv):
    parser = load.run_parser("Generate or chat with a trained ENLACE run.")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--prompt", default="", help="text to continue")
    mode.add_argument("--prompt-file", help="read the prompt from this UTF-8 file")
    mode.add_argument("--chat", action="store_true", help="interactive conversation")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument(
        "--batch",
        type=int,
        help="sequences together: --num-samples decoded at once (continuous batching; default 1)",
    )
    parser.add_argument("--system", default="", help="system prompt for --chat")
    parser.add_argument("--no-tools", action="store_true", help="--chat without agent/tools.py's tools")
    args = parser.parse_args(argv)
    if args.num_samples < 1:
        parser.error("--num-samples must be >= 1")
    load.check_batch(parser, args)
    return args


def sample(model, cfg, tokenizer, args):
    if args.chat:
        run_chat(model, tokenizer, cfg, args)
    else:
        run_generation(model, tokenizer, args)


def main(argv):
    return load.run_command(argv, parse_args, sample)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
