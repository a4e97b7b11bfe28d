"""
Use a trained run: generate text, chat, or measure bits per byte.

    python sample.py runs/smoke-cpu --prompt "Había una vez" --max-new-tokens 200 --seed 1
    python sample.py runs/smoke-cpu/ckpt_0000300.pt --prompt-file prompt.txt --num-samples 3 --batch 3
    python sample.py runs/sft-smoke-cpu --chat --system "Eres un asistente amable."
    python sample.py runs/sft-smoke-cpu --chat-eval val --max-new-tokens 400   # held-out conversations
    python sample.py runs/smoke-cpu --eval val            # the run's validation split
    python sample.py runs/smoke-cpu --eval texto.txt      # any UTF-8 text file

A run directory means its newest checkpoint. The checkpoint carries the resolved config and the tokenizer
it was trained with (checkpoint.load_run), so nothing here depends on the training code or on data/.
Inference runs in float32 on the CPU, or on CUDA with --device cuda.
"""

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

import checkpoint
import data
import fileio
from agent import grammar, tools
from chat import template
from checkpoint import CheckpointError
from decode import engine


class SampleError(Exception):
    """A problem the user can fix; printed without a traceback, exit status 2."""


def load_run(path, device="cpu"):
    """checkpoint.load_run with its errors as SampleError, which serve/app.py and agent/dataset.py catch."""
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
        settings = tools.load_settings(cfg.get("agent"))
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
        try:
            stream_text(model, tokenizer, prompt, args, generator, write_to(out, reply), stop_token=end_id)
        except KeyboardInterrupt:  # Ctrl-C ends this answer, not the session
            out.write(" [interrupted]")
        out.write("\n")
        text = "".join(reply).strip()
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
# Held-out conversations: assistant-only loss and bpb, and whether answers end with <|end|>


def run_chat_eval(model, cfg, tokenizer, args, out=sys.stdout):
    """Loss and bits per byte on the assistant tokens (mask 1) of held-out conversations, the share of
    their first prompts whose greedy answer ends with <|end|> within --max-new-tokens, and (teacher-forced,
    for conversations that fit the context) how often <|end|> is the most likely token where an answer ends."""
    end_id = check_chat_tokenizer(tokenizer, args.run)
    if args.chat_eval == "val":
        if cfg["data"]["format"] != "chat":
            raise SampleError(f"{args.run}: --chat-eval val needs a run fine-tuned on data.format: chat")
        paths = template.expand_paths(cfg["data"]["chat"]["val"], "data.chat.val")
    else:
        paths = [args.chat_eval]
    conversations = [c for path in paths for c in template.read_conversations(path)[0]][: args.limit or None]
    if not conversations:
        raise SampleError(f"{', '.join(paths)}: no conversations")
    nats, count, num_bytes, ended, examples = 0.0, 0, 0, 0, []
    end_turns, end_guessed = 0, 0
    answers = greedy_answers(model, tokenizer, [c for _, c in conversations], args, end_id)
    for (where, conversation), answer in zip(conversations, answers, strict=True):
        ids, mask = template.render(conversation, tokenizer)
        n, c, b = evaluate_tokens(
            model,
            torch.tensor(ids),
            tokenizer.token_bytes,
            max(1, model.seq_len // 2),
            mask=torch.tensor(mask),
        )
        nats, count, num_bytes = nats + n, count + c, num_bytes + b
        if len(ids) <= model.seq_len + 1:  # teacher-forced: is <|end|> the top guess where an answer ends?
            with torch.no_grad():
                logits, _ = model(torch.tensor([ids[:-1]], device=model.embed_tokens.weight.device))
            ends = [p for p in range(len(ids) - 1) if ids[p + 1] == end_id and mask[p + 1]]
            end_turns += len(ends)
            end_guessed += sum(int(logits[0, p].argmax()) == end_id for p in ends)
        messages = conversation["messages"]
        first_answer = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        ended += answer[-1] == end_id
        if len(examples) < args.show:
            examples.append(
                (where, messages[first_answer - 1]["content"], tokenizer.decode(answer), answer[-1] == end_id)
            )
    for where, question, answer, done in examples:
        out.write(f"{where}\n  user: {question}\n  model: {answer}{' <|end|>' if done else ' [budget]'}\n")
    result = {
        "conversations": len(conversations),
        "assistant_tokens": count,
        "loss": nats / max(count, 1),
        "bpb": nats / (math.log(2) * max(num_bytes, 1)),
        "ended": ended / len(conversations),
        "end_guessed": end_guessed / max(end_turns, 1),
    }
    out.write(
        f"{', '.join(paths)}: {len(conversations)} conversations, {count} assistant tokens, {num_bytes} bytes | "
        f"loss {result['loss']:.4f} | bpb {result['bpb']:.4f} | answers ending with <|end|> within "
        f"{args.max_new_tokens} tokens: {ended}/{len(conversations)} ({100 * result['ended']:.0f}%) | "
        f"<|end|> the top guess where an answer ends: {end_guessed}/{end_turns}\n"
    )
    return result


def greedy_answers(model, tokenizer, conversations, args, end_id):
    """The greedy answer (token ids, up to <|end|> included) to each conversation's first prompt, --batch
    conversations decoded together."""
    prompts = []
    for conversation in conversations:
        messages = conversation["messages"]
        first_answer = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompts.append(
            template.render({"messages": messages[:first_answer]}, tokenizer, for_generation=True)[0]
        )
    if (args.batch or 1) > 1:
        return generate_batch(model, prompts, args.max_new_tokens, args.batch, lambda _: {"temperature": 0.0},
                              {end_id})  # fmt: skip
    device = model.embed_tokens.weight.device
    return [list(engine.generate(model, torch.tensor(prompt, device=device), args.max_new_tokens, 0.0, stop_token=end_id))
            for prompt in prompts]  # fmt: skip


# -----------------------------------------------------------------------------
# Bits per byte


@torch.no_grad()
def evaluate_tokens(model, tokens, token_bytes, stride, batch_size=8, mask=None):
    """Score every token of `tokens` (a 1-D LongTensor) once, each with as much context as fits: windows
    of seq_len positions moving by `stride`, only the tokens new to a window scored. The first token has
    no context and is not scored (a run with a <|bos|> token puts it there); with `mask` (1-D, 0 or 1 per
    token), neither are the tokens whose mask is 0.
    Returns (total nats, scored tokens, UTF-8 bytes of the scored tokens)."""
    seq_len = model.seq_len
    token_bytes = torch.as_tensor(token_bytes, dtype=torch.long)
    if not 0 < stride <= seq_len:
        raise SampleError(f"stride {stride} must be in 1..{seq_len} (the model's context)")
    device = model.embed_tokens.weight.device
    windows = []  # (inputs, targets with unscored positions at -1)
    scored_until = 1  # tokens[1:scored_until] are scored (as targets)
    begin = 0
    while scored_until < len(tokens):
        end = min(begin + seq_len + 1, len(tokens))
        inputs, targets = tokens[begin : end - 1], tokens[begin + 1 : end].clone()
        already = scored_until - (begin + 1)  # targets before this were scored by an earlier window
        targets[:already] = -1
        if mask is not None:
            targets[mask[begin + 1 : end] == 0] = -1
        windows.append((inputs, targets))
        scored_until = end
        begin += stride
    nats = 0.0
    count = 0
    num_bytes = 0
    for first in range(0, len(windows), batch_size):
        group = windows[first : first + batch_size]
        width = max(len(w[0]) for w in group)
        x = torch.zeros(len(group), width, dtype=torch.long)
        y = torch.full((len(group), width), -1, dtype=torch.long)
        for row, (inputs, targets) in enumerate(group):
            x[row, : len(inputs)] = inputs
            y[row, : len(targets)] = targets
        logits, _ = model(x.to(device))
        y = y.to(device)
        nats += F.cross_entropy(
            logits.float().flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum"
        ).item()
        scored = y[y != -1]
        count += scored.numel()
        num_bytes += int(token_bytes[scored.cpu()].sum())
    return nats, count, num_bytes


def run_eval(model, cfg, tokenizer, args):
    if args.eval in ("val", "train"):
        tokens = torch.as_tensor(data.load_split_tokens(cfg["data"], args.eval).astype("int64"))
        source = f"the run's {args.eval} split"
    else:
        if not os.path.isfile(args.eval):
            raise SampleError(f"--eval {args.eval}: no such file (or use 'val' for the run's val split)")
        with open(args.eval, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SampleError(f"--eval {args.eval}: not UTF-8 text ({e})") from None
        tokens = torch.tensor(prompt_ids_of(tokenizer, text), dtype=torch.long)
        source = args.eval
    if args.max_tokens:
        tokens = tokens[: args.max_tokens]
    if len(tokens) < 2:
        raise SampleError(f"{source}: fewer than 2 tokens, nothing to score")
    stride = args.stride or max(1, model.seq_len // 2)
    nats, count, num_bytes = evaluate_tokens(model, tokens, tokenizer.token_bytes, stride, args.batch or 8)
    loss = nats / count
    bpb = nats / (math.log(2) * max(num_bytes, 1))
    print(f"{source}: {count} tokens, {num_bytes} bytes | loss {loss:.4f} | bpb {bpb:.4f}")
    return loss, bpb


# -----------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(description="Generate, chat or evaluate with a trained ENLACE run.")
    parser.add_argument("run", help="run directory (newest checkpoint) or a checkpoint file")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--prompt", default="", help="text to continue")
    mode.add_argument("--prompt-file", help="read the prompt from this UTF-8 file")
    mode.add_argument("--chat", action="store_true", help="interactive conversation")
    mode.add_argument("--eval", metavar="FILE_OR_SPLIT", help="loss and bits per byte on a file or 'val'")
    mode.add_argument(
        "--chat-eval",
        metavar="FILE_OR_VAL",
        help="held-out conversations (a JSONL file, or 'val': the run's data.chat.val): assistant-only loss "
        "and bpb, and the share of greedy answers ending with <|end|> within --max-new-tokens",
    )
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument(
        "--batch",
        type=int,
        help="sequences together: --num-samples and --chat-eval answers decoded at once (continuous "
        "batching; default 1), --eval windows per forward pass (default 8)",
    )
    parser.add_argument("--system", default="", help="system prompt for --chat")
    parser.add_argument("--no-tools", action="store_true", help="--chat without agent/tools.py's tools")
    parser.add_argument("--stride", type=int, default=0, help="--eval window stride (default seq_len/2)")
    parser.add_argument("--max-tokens", type=int, default=0, help="--eval only the first N tokens")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--show", type=int, default=3, help="--chat-eval: print this many answers")
    parser.add_argument("--limit", type=int, default=0, help="--chat-eval only the first N conversations")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.num_samples < 1:
        parser.error("--max-new-tokens and --num-samples must be >= 1")
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch {args.batch}: must be >= 1")
    return args


def main(argv):
    problem = fileio.undecodable_argument(argv)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    args = parse_args(argv)
    try:
        model, cfg, tokenizer, ckpt_path = load_run(args.run, args.device)
        if args.eval:
            run_eval(model, cfg, tokenizer, args)
        elif args.chat_eval:
            run_chat_eval(model, cfg, tokenizer, args)
        elif args.chat:
            run_chat(model, tokenizer, cfg, args)
        else:
            run_generation(model, tokenizer, args)
    except (SampleError, CheckpointError, template.ChatError, data.DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
