"""
What a training step minimizes (train.objective), chosen once when train.py sets a run up (build): each
objective is a small class with the same interface, so the loop never asks which one it runs.

    next_token  NextToken: the next token's cross-entropy; pretraining, and SFT on chat data (prompt and
                padding positions, target -1, are not scored)
    dpo         DPO: Direct Preference Optimization on preference pairs (below)

    describe()               the start log's lines about the batch
    micro_step(model, batch) (loss, figure sums, tokens run) of one micro-batch from the run's loader
    figures(sums)            ({name: value}, log text) of a step's summed figures ({} and "" for NextToken)
    evaluate(model)          ({name: value}, log text) of the held-out evaluation
    checkpoint_state()       what a checkpoint needs to resume the objective ({} for NextToken)

DPO: Direct Preference Optimization (Rafailov et al., 2023) on the pairs
`python -m chat prepare` lays out (data.format preference), starting from the run in train.init_from, which is
also the reference model.

For a pair of a prompt x, a chosen answer c and a rejected answer r, with log p(a|x) the sum of the
log-probabilities of the answer's tokens (the completion mask: the prompt is context, never scored):

    chosen reward   = beta * (log p_model(c|x) - log p_ref(c|x))
    rejected reward = beta * (log p_model(r|x) - log p_ref(r|x))
    margin          = chosen reward - rejected reward
    loss            = -log sigmoid(margin)                                          loss_type sigmoid
                    = (-(1 - e) log sigmoid(margin) + e log sigmoid(-margin)) / (1 - 2e)   loss_type robust

(e = label_smoothing, the probability that a pair's preference is flipped: Robust DPO), the formulas and
names of TRL's DPOTrainer; tests/test_dpo.py checks the numbers against TRL's own code. Logged per step:
the loss, the mean margin, the mean chosen and rejected rewards, and the accuracy (share of pairs whose
margin > 0).

The reference: the log-probabilities of every pair's two answers under the starting run, computed once
when the run starts, with the weights just loaded from init_from and before the first step (TRL's
precompute_ref_log_probs), and saved in every checkpoint: a resumed run uses the very same numbers, and no
second copy of the model is kept in memory or run at every step (why: docs/conversaciones.md).

Log-probabilities come from the logits of the model's forward pass without targets (answer_log_probs),
so they do not depend on how the model computes its own training loss.
"""

import hashlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

import data
import microbatch

PAIR_STATS = ("loss", "margin", "chosen_reward", "rejected_reward", "correct", "pairs")


NO_FIGURES = torch.zeros(0, dtype=torch.float64)  # NextToken sums no figures beyond the loss


def build(cfg, model, tokenizer, hardware, ctx, state, log):
    """The objective of train.objective for a run whose weights `model` holds. DPO's reference is the
    resumed checkpoint's (`state`), else computed now, from the weights just loaded from init_from."""
    if cfg["train"]["objective"] != "dpo":
        return NextToken(cfg, hardware, ctx, tokenizer)
    if state is not None:
        return DPO(cfg, hardware, ctx, state["reference"])
    return DPO(cfg, hardware, ctx, reference_log_probs(model, cfg, hardware, ctx, log))


class NextToken:
    """The next token's cross-entropy, and bits per byte on the held-out split."""

    def __init__(self, cfg, hardware, ctx, tokenizer):
        self.cfg, self.hardware, self.ctx = cfg, hardware, ctx
        self.token_bytes = torch.as_tensor(tokenizer.token_bytes, dtype=torch.float64, device=hardware.device)

    def describe(self):
        train, model_cfg, ranks, hardware = (
            self.cfg["train"],
            self.cfg["model"],
            self.ctx.world_size,
            self.hardware,
        )
        batch, seq_len, accum = train["micro_batch_size"], model_cfg["seq_len"], train["grad_accum_steps"]
        lines = [
            f"global batch {batch * seq_len * accum * ranks} tokens = {ranks} ranks x {batch} "
            f"sequences x {seq_len} tokens x {accum} accumulation; {train['max_steps']} steps"
        ]
        if hardware.memory_gib is not None:
            lines.append(
                memory_line(model_cfg, batch, hardware.dtype, hardware.loss_chunk_size, hardware.memory_gib)
            )
        return lines

    def micro_step(self, model, batch):
        x, y = (t.to(self.hardware.device, non_blocking=True) for t in batch)
        with self.hardware.autocast():
            _, losses = model(x, y)
        return losses["loss"], NO_FIGURES, x.numel()

    def figures(self, sums):
        return {}, ""

    def evaluate(self, model):
        result = next_token_evaluate(model, self.cfg, self.hardware, self.ctx, self.token_bytes)
        return result, f"val_loss {result['val_loss']:.4f} | val_bpb {result['val_bpb']:.4f}"

    def checkpoint_state(self):
        return {}


class DPO:
    """DPO against `reference`, every pair's answers' log-probs under the starting run ({split: (pairs, 2)},
    reference_log_probs), which each checkpoint keeps."""

    def __init__(self, cfg, hardware, ctx, reference):
        self.cfg, self.hardware, self.ctx, self.reference = cfg, hardware, ctx, reference

    def describe(self):  # no memory estimate: microbatch.py models a next-token step
        train, ranks = self.cfg["train"], self.ctx.world_size
        batch, accum = train["micro_batch_size"], train["grad_accum_steps"]
        return [
            f"global batch {ranks * batch * accum} pairs = {ranks} ranks x {batch} pairs (a chosen and a "
            f"rejected sequence each, up to {self.cfg['model']['seq_len']} tokens) x {accum} accumulation; "
            f"{train['max_steps']} steps"
        ]

    def micro_step(self, model, batch):
        return dpo_micro_step(model, batch, self.reference["train"], self.cfg["train"]["dpo"], self.hardware)

    def figures(self, sums):
        pairs = pair_means(sums)  # this step's pairs
        record = {key: pairs[key] for key in ("margin", "chosen_reward", "rejected_reward", "accuracy")}
        return record, f"margin {pairs['margin']:.3f} | acc {100 * pairs['accuracy']:.0f}% | "

    def evaluate(self, model):
        result = dpo_evaluate(model, self.reference, self.cfg, self.hardware, self.ctx)
        return result, (
            f"val_loss {result['val_loss']:.4f} | held-out reward accuracy "
            f"{100 * result['val_accuracy']:.1f}% of {result['val_pairs']} pairs | margin "
            f"{result['val_margin']:.3f} | chosen answer likelier than under {self.cfg['train']['init_from']} for "
            f"{100 * result['val_chosen_likelier']:.1f}% of {result['val_prompts']} prompts"
        )

    def checkpoint_state(self):
        return {"reference": self.reference}


# -----------------------------------------------------------------------------
# Next token: the held-out loss and bits per byte, the step's memory estimate


def next_token_evaluate(model, cfg, hardware, ctx, token_bytes):
    """Mean loss and bits per byte over the same `eval_batches` val batches every time."""
    train = cfg["train"]
    loader = data.build_loader(
        cfg["data"],
        "val",
        train["micro_batch_size"],
        cfg["model"]["seq_len"],
        train["seed"],
        ctx.rank,
        ctx.world_size,
    )
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=hardware.device)  # nats, tokens, bytes
    with torch.no_grad():
        for _ in range(train["eval_batches"]):
            x, y = (t.to(hardware.device) for t in loader.next_batch())
            with hardware.autocast():
                _, losses = model(x, y)  # the training loss's path: no full logits in memory
            # Targets -1 (chat data: prompt and padding positions) are not scored.
            scored = y != -1
            totals += torch.stack(
                [
                    losses["ce"].double() * scored.sum(),
                    scored.sum().double(),
                    torch.where(scored, token_bytes[y.clamp(min=0)], 0.0).sum().double(),
                ]
            )
    if ctx.enabled:
        dist.all_reduce(totals)
    model.train()
    nats, tokens, num_bytes = totals.tolist()
    return {"val_loss": nats / max(tokens, 1.0), "val_bpb": nats / (math.log(2) * max(num_bytes, 1.0))}


def memory_line(model_cfg, batch, dtype, chunk, memory_gib):
    """The step's estimated peak memory (microbatch.py) for the profile's dtype and loss chunks against
    its memory_gib, and what to change when it does not fit."""
    peak = microbatch.step_peak_bytes(model_cfg, batch, dtype, chunk) / microbatch.GIB
    fits = microbatch.largest_micro_batch(model_cfg, dtype, chunk, memory_gib * microbatch.GIB)
    line = (
        f"memory: ~{peak:.1f} GiB estimated for a step of {batch} sequences ({fits} fit in {memory_gib} GiB)"
    )
    if batch > fits:
        line += (
            f"; WARNING: it may not fit hardware.memory_gib: lower train.micro_batch_size to {fits} and raise "
            "train.grad_accum_steps to keep the global batch"
            + ("" if chunk else ", or set hardware.loss_chunk_size (0 keeps the full logits)")
        )
    return line


# -----------------------------------------------------------------------------
# DPO: the loss and its figures


def completion_log_probs(logits, targets):
    """Per row, the sum of log p(target) over the positions whose target is not -1: (rows,), in float32
    (float64 for float64 logits)."""
    log_probs = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(targets != -1, picked, 0.0).sum(dim=-1)


def answer_log_probs(model, x, y, hardware):
    """(log p of each row's answer, tokens run): rows are cut after the last position any of them scores,
    since the rest is padding that a causal model's earlier positions never see."""
    scored = (y != -1).any(dim=0).nonzero()
    length = int(scored[-1]) + 1 if len(scored) else 1
    x, y = x[:, :length], y[:, :length]
    with hardware.autocast():
        logits, _ = model(x)
    return completion_log_probs(logits, y), x.numel()


def dpo_losses(chosen, rejected, ref_chosen, ref_rejected, dpo):
    """(per-pair losses, chosen rewards, rejected rewards) of policy and reference log-probs (pairs,)."""
    beta, smoothing = dpo["beta"], dpo["label_smoothing"]
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    margin = beta * (chosen_ratio - rejected_ratio)
    if dpo["loss_type"] == "sigmoid":
        losses = -F.logsigmoid(margin)
    else:  # robust
        losses = (-(1 - smoothing) * F.logsigmoid(margin) + smoothing * F.logsigmoid(-margin)) / (
            1 - 2 * smoothing
        )
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def pair_stats(losses, chosen_rewards, rejected_rewards):
    """Sums of PAIR_STATS over a micro-batch's pairs, as a float64 tensor (summed over steps and ranks)."""
    margins = chosen_rewards - rejected_rewards
    sums = [losses.detach().sum(), margins.sum(), chosen_rewards.sum(), rejected_rewards.sum()]
    sums += [(margins > 0).sum(), torch.tensor(len(losses))]
    return torch.stack([value.double().cpu() for value in sums])


def pair_means(sums):
    """PAIR_STATS sums -> {name: mean over the pairs} (accuracy for correct)."""
    pairs = max(sums[-1].item(), 1.0)
    values = {name: sums[i].item() / pairs for i, name in enumerate(PAIR_STATS[:-1])}
    values["accuracy"] = values.pop("correct")
    return values


def dpo_micro_step(model, batch, reference, dpo, hardware):
    """(mean loss of the micro-batch's pairs, their PAIR_STATS sums, tokens run) of one micro-batch from
    data.PairLoader: x, y of 2 x B rows (chosen first) and the B pairs' indices into reference."""
    x, y, pairs = batch
    device = hardware.device
    log_probs, tokens = answer_log_probs(model, x.to(device), y.to(device), hardware)
    chosen, rejected = log_probs.chunk(2)
    ref = reference[pairs.to(reference.device)].to(device)
    losses, chosen_rewards, rejected_rewards = dpo_losses(chosen, rejected, ref[:, 0], ref[:, 1], dpo)
    return losses.mean(), pair_stats(losses, chosen_rewards, rejected_rewards), tokens


# -----------------------------------------------------------------------------
# The reference and the held-out figures


def split_loader(cfg, split, ctx):
    train = cfg["train"]
    return data.build_loader(
        cfg["data"], split, train["micro_batch_size"], cfg["model"]["seq_len"], train["seed"], ctx.rank,
        ctx.world_size,
    )  # fmt: skip


@torch.no_grad()
def split_log_probs(model, loader, pairs, hardware):
    """{pair: (log p chosen, log p rejected)} of the pairs, in micro-batches of the loader's size."""
    found = {}
    for first in range(0, len(pairs), loader.batch_size):
        chunk = pairs[first : first + loader.batch_size]
        x, y = loader.pair_rows(chunk)
        log_probs, _ = answer_log_probs(model, x.to(hardware.device), y.to(hardware.device), hardware)
        chosen, rejected = log_probs.float().cpu().chunk(2)
        found.update({p: (c, r) for p, c, r in zip(chunk, chosen.tolist(), rejected.tolist(), strict=True)})
    return found


def reference_log_probs(model, cfg, hardware, ctx, log=print):
    """{split: (pairs, 2) float32 CPU tensor} of every pair's chosen and rejected log-probs under `model`,
    the run just loaded from init_from. Rank r computes pairs r, r + world_size, ...; an all-reduce of
    the tables (zeros elsewhere) gives every rank all of them."""
    model.eval()
    tables = {}
    for split in data.SPLITS:
        loader = split_loader(cfg, split, ctx)
        table = torch.zeros(loader.pairs, 2, dtype=torch.float32)
        for pair, values in split_log_probs(model, loader, loader.rank_pairs(), hardware).items():
            table[pair] = torch.tensor(values)
        if ctx.enabled:
            shared = table.to(hardware.device)
            dist.all_reduce(shared)
            table = shared.cpu()
        tables[split] = table
        log(
            f"reference: log-probs of the {loader.pairs} {split} pairs' answers under {cfg['train']['init_from']}"
        )
    model.train()
    return tables


def dpo_evaluate(model, reference, cfg, hardware, ctx):
    """Held-out figures over the val pairs, each once (at most train.eval_batches micro-batches per rank):
    the mean DPO loss (val_loss), margin and rewards, the reward accuracy (share of pairs whose margin > 0),
    and val_chosen_likelier: the share of held-out prompts (a prompt with its chosen answer, counted once
    however many pairs share it) whose chosen answer this model finds likelier than the reference run did."""
    loader = split_loader(cfg, "val", ctx)
    pairs = loader.rank_pairs()[: cfg["train"]["eval_batches"] * loader.batch_size]
    model.eval()
    found = split_log_probs(model, loader, pairs, hardware)
    model.train()
    ref = reference["val"][pairs]
    chosen = torch.tensor([found[p][0] for p in pairs])
    rejected = torch.tensor([found[p][1] for p in pairs])
    losses, chosen_rewards, rejected_rewards = dpo_losses(
        chosen, rejected, ref[:, 0], ref[:, 1], cfg["train"]["dpo"]
    )
    sums = pair_stats(losses, chosen_rewards, rejected_rewards)
    prompts = [
        (prompt_key(loader, p), reward) for p, reward in zip(pairs, chosen_rewards.tolist(), strict=True)
    ]
    if ctx.enabled:
        sums = sums.to(hardware.device)
        dist.all_reduce(sums)
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, prompts)
        prompts = [item for part in gathered for item in part]
    rewards = {}
    for key, reward in prompts:
        rewards.setdefault(key, []).append(reward)
    likelier = sum(sum(values) / len(values) > 0 for values in rewards.values())
    figures = pair_means(sums.cpu())
    return {f"val_{name}": value for name, value in figures.items()} | {
        "val_chosen_likelier": likelier / max(len(rewards), 1),
        "val_pairs": int(sums[-1].item()),
        "val_prompts": len(rewards),
    }


def prompt_key(loader, pair):
    """The same for every pair of one prompt and chosen answer, as packed: a digest of the chosen row. Not
    the answer alone, nor the last user turn with it: two conversations may end in the same exchange
    ("Gracias" - "De nada.") after different histories. A pair that had to drop its prompt's oldest turns
    to fit a row (a long rejected answer) scores its chosen answer in a shorter context, so it counts as a
    prompt of its own."""
    tokens, _ = loader.row(2 * pair)
    return hashlib.sha256(tokens.tobytes()).hexdigest()
