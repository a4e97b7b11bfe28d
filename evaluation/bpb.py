"""
A run measured on text: loss and bits per byte on its val split or any UTF-8 file, and on held-out
conversations (the assistant's tokens only), with the share of greedy answers that end with <|end|>.

    python -m evaluation.bpb runs/smoke-cpu --eval val            # the run's validation split
    python -m evaluation.bpb runs/smoke-cpu --eval texto.txt      # any UTF-8 text file
    python -m evaluation.bpb runs/sft-smoke-cpu --chat-eval val --max-new-tokens 400   # held-out conversations

The run loads as sample.py loads it (decode/load.run_command): the checkpoint carries its config and tokenizer.
"""

import math
import os
import sys

import torch
import torch.nn.functional as F

import data
from chat import template
from decode import engine, load
from sample import SampleError, check_chat_tokenizer, generate_batch, prompt_ids_of

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
    parser = load.run_parser("Loss and bits per byte of a trained ENLACE run.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--eval", metavar="FILE_OR_SPLIT", help="loss and bits per byte on a file or 'val'")
    mode.add_argument(
        "--chat-eval",
        metavar="FILE_OR_VAL",
        help="held-out conversations (a JSONL file, or 'val': the run's data.chat.val): assistant-only loss "
        "and bpb, and the share of greedy answers ending with <|end|> within --max-new-tokens",
    )
    parser.add_argument("--max-new-tokens", type=int, default=200, help="--chat-eval: an answer's budget")
    parser.add_argument(
        "--batch",
        type=int,
        help="--chat-eval answers decoded at once (continuous batching; default 1), --eval windows per "
        "forward pass (default 8)",
    )
    parser.add_argument("--stride", type=int, default=0, help="--eval window stride (default seq_len/2)")
    parser.add_argument("--max-tokens", type=int, default=0, help="--eval only the first N tokens")
    parser.add_argument("--show", type=int, default=3, help="--chat-eval: print this many answers")
    parser.add_argument("--limit", type=int, default=0, help="--chat-eval only the first N conversations")
    args = parser.parse_args(argv)
    load.check_batch(parser, args)
    return args


def measure(model, cfg, tokenizer, args):
    if args.eval:
        run_eval(model, cfg, tokenizer, args)
    else:
        run_chat_eval(model, cfg, tokenizer, args)


def main(argv):
    return load.run_command(argv, parse_args, measure)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
