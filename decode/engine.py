"""
The serving engine over model.py's Transformer: forward passes with a KV cache (decode/kvcache.py), the
batched decode step, its static-shape forms for a compiled step (decode_all, prefill_block), the Decoder
(continuous batching: rows join and leave between steps), generate, and the sampling of a token.

decode/weights.with_kernels may hang ENLACE's CPU kernels on the model's modules, which the functions here
call instead of the torch code: an Attention's qkv_kernel (x -> (q, k, v) in one operator) and
decode_kernel (a decode step's attention: (q, keys, values, ends) -> y), an MLP's gate_up_kernel (x ->
(gate, up)). The model's own forward (training) never reads them.
"""

import functools

import torch
from torch.nn.attention import SDPBackend

from decode import kvcache

# ---- the model's layers with a KV cache ----


def project(attn, x, cos, sin):
    """attn.project(x, cos, sin), the three products in one call where decode/weights.py put a qkv_kernel."""
    kernel = getattr(attn, "qkv_kernel", None)
    return attn.project(x, cos, sin) if kernel is None else attn.heads(*kernel(x), cos, sin)


def feed_forward(mlp, x):
    """mlp(x), gate and up in one call where decode/weights.py put a gate_up_kernel."""
    kernel = getattr(mlp, "gate_up_kernel", None)
    return mlp(x) if kernel is None else mlp.swiglu(*kernel(x))


def attend_cached(attn, x, cos, sin, cache, layer_index, backend, slot=None):
    """Attention of the new tokens x (B, T, d_model) over the cached positions and themselves, their keys
    and values stored in the cache (KVCache.store)."""
    B, T, _ = x.shape
    q, k, v = project(attn, x, cos, sin)
    mask, is_causal = None, True
    # Flash kernels take no explicit mask: decoding may fall back to the math kernel.
    backends = [backend, SDPBackend.MATH]
    start = cache.lengths[slot or 0]
    k, v = cache.store(layer_index, k, v, slot)
    if start > 0:
        # New queries sit at positions start..start+T-1 and see every cached key up to their own
        # position; is_causal would align the mask to the top-left corner instead.
        is_causal = False
        if T > 1:
            key_pos = torch.arange(start + T, device=x.device)
            query_pos = torch.arange(start, start + T, device=x.device)
            mask = key_pos[None, :] <= query_pos[:, None]
    y = attn.attend(q, k, v, mask, is_causal, backends)
    return attn.out(y.transpose(1, 2).reshape(B, T, -1))


def attend_step(attn, x, cos, sin, cache, layer_index, step):
    """One new token for each cache slot: x (slots, 1, d_model) at each slot's own position (cos, sin:
    (slots, 1, head_dim)); step (a DecodeStep) lists the slots in use, the others' outputs are zeros.
    The projections run over every slot at once; attention runs row by row over the row's own filled
    keys, so that it is exactly the computation of that row decoding alone. (One masked attention over
    the longest row would add the other rows' lengths to each row's softmax sums, which changes their
    float32 rounding.) A single query needs no mask; these three products cost about what the flash
    kernel does and a fifth to a twentieth of the math kernel with its grouped-query expansion."""
    slots = x.shape[0]
    q, k, v = project(attn, x, cos, sin)
    keys, values = cache.store_step(layer_index, k[:, :, 0], v[:, :, 0], step)
    # Query heads grouped by the key/value head they read: head h reads kv head h // group.
    kv_heads, head_dim = keys.shape[1], keys.shape[3]
    q = q.reshape(slots, kv_heads, -1, head_dim) * head_dim**-0.5
    decode_kernel = getattr(attn, "decode_kernel", None)
    if decode_kernel is not None:  # each row over its own filled keys; zeros for unused slots
        return attn.out(decode_kernel(q, keys, values, step.slot_ends).reshape(slots, 1, -1))
    outputs = []
    for row, end in zip(step.rows, step.ends, strict=True):
        scores = q[row] @ keys[row, :, :end].transpose(1, 2)  # (kv_heads, group, end)
        outputs.append(scores.softmax(-1) @ values[row, :, :end])  # (kv_heads, group, head_dim)
    y = torch.stack(outputs)
    if len(step.rows) < slots:
        y = q.new_zeros(q.shape).index_copy_(0, step.index, y)
    return attn.out(y.reshape(slots, 1, -1))


def attend_all(attn, x, cos, sin, keys, values, positions, visible):
    """attend_step with static shapes, for a compiled step: every slot writes its new key and value at its
    position and attends over the whole preallocated cache, the keys past its position masked (visible:
    (slots, max_len) bool). The shapes never depend on the lengths or on the slots in use, so one graph
    (or CUDA graph) serves every step; a row's result depends only on its own inputs, so it is the same
    whichever other slots are in use."""
    slots = x.shape[0]
    q, k, v = project(attn, x, cos, sin)
    rows = torch.arange(slots, device=x.device)
    keys[rows, :, positions] = k[:, :, 0]
    values[rows, :, positions] = v[:, :, 0]
    kv_heads, head_dim = keys.shape[1], keys.shape[3]
    q = q.reshape(slots, kv_heads, -1, head_dim) * head_dim**-0.5
    decode_kernel = getattr(attn, "decode_kernel", None)
    if decode_kernel is not None:  # the filled keys only, not the whole cache
        return attn.out(decode_kernel(q, keys, values, positions + 1).reshape(slots, 1, -1))
    scores = (q @ keys.transpose(2, 3)).masked_fill(~visible[:, None, None, :], float("-inf"))
    y = scores.softmax(-1) @ values  # (slots, kv_heads, group, head_dim)
    return attn.out(y.reshape(slots, 1, -1))


def attend_block(attn, x, cos, sin, keys, values, slot, positions, visible):
    """A block of T tokens of one slot with static shapes, for a compiled prefill: x (1, T, d_model) at
    `positions` (T,) of slot `slot` (a 0-d tensor) writes its keys and values there and attends over the
    slot's whole preallocated cache, each query seeing the keys up to its own position (visible: (T,
    max_len) bool). Positions past the prompt (the block's padding) write keys nothing sees: the next
    step or prefill at that position writes again."""
    T = x.shape[1]
    q, k, v = project(attn, x, cos, sin)  # (1, heads, T, head_dim)
    rows = slot.expand(T)
    keys[rows, :, positions] = k[0].transpose(0, 1)
    values[rows, :, positions] = v[0].transpose(0, 1)
    slot_keys, slot_values = keys.index_select(0, slot[None])[0], values.index_select(0, slot[None])[0]
    # Query heads grouped by the key/value head they read, as in attend_step: (kv_heads, group, T, head_dim).
    kv_heads, head_dim = slot_keys.shape[0], slot_keys.shape[2]
    q = q.reshape(kv_heads, -1, T, head_dim) * head_dim**-0.5
    scores = (q @ slot_keys[:, None].transpose(2, 3)).masked_fill(~visible, float("-inf"))
    y = scores.softmax(-1) @ slot_values[:, None]  # (kv_heads, group, T, head_dim)
    return attn.out(y.reshape(1, -1, T, head_dim).transpose(1, 2).reshape(1, T, -1))


def run_layers(parts, x, attend):
    """x through the blocks of a model's layout (model.layout), attend(layer_index, attention, h) standing
    for each block's attention of its normed input h."""
    for layer_index, block in enumerate(parts.blocks):
        x = x + attend(layer_index, block.attention, block.attn_norm(x))
        x = x + feed_forward(block.ffn, block.ffn_norm(x))
    return x


# ---- the model's forward passes with a KV cache ----
# Each takes a model or its layout (model.layout()): a Decoder reads its model's layout once, not at every
# step (reading it walks every layer's modules).


def layout_of(model):
    """model.layout(), or model itself when it already is one (a Layout has no layout())."""
    return model.layout() if hasattr(model, "layout") else model


def forward_with_cache(model, idx, cache, slot=None):
    """Run the new tokens idx (B, T) at positions cache.length..cache.length+T-1, attending to every
    cached position, and append their keys/values to the cache: to every slot (B = cache.slots, all
    filled together), or with `slot` to that slot alone (B = 1, from its own length). Returns logits
    (B, T, vocab_size): the same as the model's full forward pass over all the tokens seen so far, at the
    new positions."""
    start, T = cache.lengths[slot or 0], idx.shape[1]
    if start + T > cache.max_len:
        raise ValueError(
            f"{start} cached + {T} new tokens exceed model.seq_len={cache.max_len}; "
            "start a new cache from the most recent tokens"
        )
    parts = layout_of(model)
    x = parts.embed(idx)
    cos, sin = parts.cos[start : start + T], parts.sin[start : start + T]
    x = run_layers(
        parts, x, lambda index, attn, h: attend_cached(attn, h, cos, sin, cache, index, parts.backend, slot)
    )
    if slot is None:
        cache.length = start + T
    else:
        cache.lengths[slot] = start + T
    return parts.head(parts.final_norm(x))


def decode_step(model, tokens, cache, rows):
    """One generation step for several sequences at once, each at its own position: tokens (slots,)
    holds the next token of each cache slot, of which the slots listed in `rows` are in use (the
    others' tokens are ignored). Appends the rows' keys and values at their slots' lengths and returns
    logits (slots, vocab_size). The projections and the LM head always run over all cache.slots
    rows, so a row's logits are bit for bit the same whichever other slots are in use (a float32
    matrix product may round a row differently when the number of rows changes)."""
    full = [row for row in rows if cache.lengths[row] >= cache.max_len]
    if full:
        raise ValueError(f"slots {full} hold model.seq_len={cache.max_len} positions; restart their window")
    step = DecodeStep(rows, cache.lengths, tokens.device)
    positions = torch.zeros(cache.slots, dtype=torch.long, device=tokens.device)
    positions[step.index] = step.positions
    parts = layout_of(model)
    x = parts.embed(tokens[:, None])
    cos, sin = parts.cos[positions][:, None, :], parts.sin[positions][:, None, :]
    x = run_layers(parts, x, lambda index, attn, h: attend_step(attn, h, cos, sin, cache, index, step))
    for row, end in zip(step.rows, step.ends, strict=True):
        cache.lengths[row] = end
    return parts.head(parts.final_norm(x))[:, 0]


def decode_all(model, tokens, positions, cache):
    """decode_step for every slot at once with static shapes (what Decoder compiles): tokens (slots,)
    and positions (slots,) each slot's next token and the position it takes; writes every slot's keys
    and values there (a slot not in use writes past its filled length, where its next step or prefill
    writes again) and returns logits (slots, vocab_size). The caller advances the lengths."""
    parts = layout_of(model)
    x = parts.embed(tokens[:, None])
    cos, sin = parts.cos[positions][:, None, :], parts.sin[positions][:, None, :]
    visible = torch.arange(cache.max_len, device=tokens.device)[None, :] <= positions[:, None]

    def attend(index, attn, h):
        return attend_all(attn, h, cos, sin, cache.keys[index], cache.values[index], positions, visible)

    return parts.head(parts.final_norm(run_layers(parts, x, attend)))[:, 0]


def prefill_block(model, tokens, slot, start, last, cache):
    """A block of one slot's prompt with static shapes (what a Decoder's compiled prefill runs): tokens
    (1, T) at positions start..start+T-1 of slot `slot` (0-d tensors, start + T <= max_len), the
    prompt's tokens first and any padding after; writes their keys and values and returns the logits
    (vocab_size,) of the block's position `last` (0-d), the prompt's last. The caller sets the slot's
    length. A token's keys, values and logits do not depend on the padding after it (causal)."""
    T = tokens.shape[1]
    positions = start + torch.arange(T, device=tokens.device)
    parts = layout_of(model)
    x = parts.embed(tokens)
    cos, sin = parts.cos[positions], parts.sin[positions]
    visible = torch.arange(cache.max_len, device=tokens.device)[None, :] <= positions[:, None]

    def attend(index, attn, h):
        return attend_block(
            attn, h, cos, sin, cache.keys[index], cache.values[index], slot, positions, visible
        )

    return parts.head(parts.final_norm(run_layers(parts, x, attend)[:, last]))[0]


class DecodeStep:
    """The slots in use in one decode_step: rows (ints, ascending) and as a tensor (index), their
    positions (a tensor: the slots' lengths before the step) and the lengths after it (ends; and as a
    tensor over every slot, 0 for a slot not in use: slot_ends, what a decode kernel reads)."""

    def __init__(self, rows, lengths, device):
        self.rows = sorted(rows)
        self.ends = [lengths[row] + 1 for row in self.rows]
        self.index = torch.tensor(self.rows, device=device)
        self.positions = torch.tensor([end - 1 for end in self.ends], device=device)
        ends = dict(zip(self.rows, self.ends, strict=True))
        self.slot_ends = torch.tensor([ends.get(slot, 0) for slot in range(len(lengths))], device=device)


# ---- generation: the Decoder and its rows ----


class Row:
    """One sequence of a Decoder: its cache slot, the window of tokens its cache holds, its sampling
    settings, and the logits of its next token."""

    def __init__(self, slot, window, temperature, top_k, top_p, generator, constraint):
        self.slot, self.window, self.logits = slot, window, None
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator, self.constraint = generator, constraint


def sampling_of(row):
    """(temperature, top_k, top_p) of a row's next token: its own, but greedy inside a tool call (its
    constraint's in_call), whatever the answer's sampling: a call's operator is never a coin toss."""
    if getattr(row.constraint, "in_call", False):
        return 0, None, None
    return row.temperature, row.top_k, row.top_p


class Decoder:
    """Generation for up to `slots` sequences at once, each at its own position (continuous batching:
    rows join and leave between steps). add() prefills a prompt on its own into a free slot of the KV
    cache; sample() picks a row's next token with the row's own settings, generator and constraint;
    advance() feeds every continuing row its token in one batched decode_step; remove() frees the slot.
    A row's tokens are those it would get alone in a Decoder of as many slots (decode_step). Windows
    past seq_len restart as generate describes, each row on its own.

    With a compile_mode ("default": inductor; "reduce-overhead": CUDA graphs too; the server's on a GPU) the
    batched step is decode_all under torch.compile: static shapes (every slot, the whole preallocated
    cache), so compile() builds the one graph before any row arrives and no later step compiles again. Its
    logits are the eager step's up to float32 rounding; a row's tokens still do not depend on the other rows.
    compile_with(model, cache, block=...) builds such a step elsewhere instead (decode/aot.py: ahead of
    time), given the prefix cache's block when there is one: a step that also has prefill_block (a block of
    a prompt at static shapes) prefills the prompts' chunks with it.

    With prefix_block (and prefix_cache_bytes > 0) prompts are prefilled in chunks of prefix_block tokens
    and their whole blocks kept in a PrefixCache of at most prefix_cache_bytes, which later prompts
    starting with the same blocks copy instead of computing (see PrefixCache for who may reuse what)."""

    def __init__(self, model, slots, allocate=False, compile_mode=None, prefix_block=None, prefix_cache_bytes=0,
                 compile_with=None):  # fmt: skip
        self.model, self.slots = model, slots
        self.cache = kvcache.new_kv_cache(model, slots)
        self.parts = parts = model.layout()  # read once: the model's modules stay what they are
        self.seq_len = parts.seq_len
        weight = parts.embed.weight
        self.device = weight.device
        if allocate or compile_mode or compile_with:
            self.cache.allocate(parts.kv_heads, parts.head_dim, weight.dtype, weight.device)
        self.prefix_cache = (
            kvcache.PrefixCache(prefix_block, prefix_cache_bytes)
            if prefix_block and prefix_cache_bytes
            else None
        )
        self.compiled_step = None
        if compile_with is not None:  # built elsewhere (decode/aot.py), with decode_all's contract
            block = self.prefix_cache.block if self.prefix_cache else None
            self.compiled_step = compile_with(model, self.cache, block=block)
        elif compile_mode:
            for tensor in self.cache.keys + self.cache.values:  # CUDA graphs write into them in place
                torch._dynamo.mark_static_address(tensor)
            self.compiled_step = torch.compile(
                functools.partial(decode_all, model), fullgraph=True, dynamic=False, mode=compile_mode
            )
        self.free = list(range(slots))
        self.rows = {}  # slot -> Row

    @torch.no_grad()
    def compile(self):
        """Run the compiled step until it is built (CUDA graphs record on the third call), before any row
        is added: the garbage it writes at position 0 of every slot is overwritten by each prefill."""
        for width in self.step_widths():
            for _ in range(3):
                tokens, positions = (torch.zeros(width, dtype=torch.long, device=self.device) for _ in "tp")
                float(self.compiled_step(tokens, positions, self.cache)[0, 0])  # waits for the device
        if self.compiled_prefill():
            self.prefill_chunk(0, 0, [0])
            self.cache.lengths[0] = 0

    @torch.no_grad()
    def add(self, prompt, temperature=1.0, top_k=None, top_p=None, generator=None, constraint=None, scope=None,
            shared=0):  # fmt: skip
        """A new row continuing `prompt` (a list of token ids, its last seq_len read), prefilled into the
        lowest free slot; raises ValueError when every slot is taken. With a prefix cache, scope (who
        asks) and shared (how many first tokens are everyone's) say which cached blocks it may reuse."""
        check_sampling(temperature, top_k, top_p)
        if not prompt:
            raise ValueError("a row needs a non-empty prompt")
        if not self.free:
            raise ValueError(f"all {self.slots} slots are in use")
        row = Row(min(self.free), list(prompt)[-self.seq_len :], temperature, top_k, top_p, generator,
                  constraint)  # fmt: skip
        row.scope, row.shared = scope, shared if len(prompt) <= self.seq_len else 0
        self.prefill(row)
        self.free.remove(row.slot)
        self.rows[row.slot] = row
        return row

    def prefill(self, row):
        if self.prefix_cache is None:
            self.cache.lengths[row.slot] = 0
            ids = torch.tensor([row.window], device=self.device)
            row.logits = forward_with_cache(self.parts, ids, self.cache, row.slot)[0, -1]
            return
        # In chunks cut at multiples of the block, from the first position the cache did not restore.
        cache, block, window = self.prefix_cache, self.prefix_cache.block, row.window
        start, used = cache.restore(self.cache, row.slot, window, row.scope, row.shared)
        for begin in range(start, len(window), block):
            logits = self.prefill_chunk(row.slot, begin, window[begin : begin + block])
            if begin + block <= len(window):
                used.append(cache.store(self.cache, row.slot, window, begin + block, row.scope, row.shared))
        cache.touch(used)
        cache.stats["prefilled_tokens"] += len(window) - start
        row.logits = logits

    def compiled_prefill(self):
        """Whether the compiled step prefills blocks too (decode/aot.py's AotStep given the prefix block)."""
        return getattr(self.compiled_step, "prefill", None) is not None

    def prefill_chunk(self, slot, start, chunk):
        """Write the chunk's keys and values at positions start.. of the slot and return its last token's
        logits: through the compiled prefill_block where there is one and a whole block fits the cache from
        start (the chunk padded to the block: a fixed shape, one program for every prompt), else eager. Every
        chunk at a given start takes the same path, so a block the prefix cache restores holds what its
        prefill would compute."""
        block = self.prefix_cache.block
        if not self.compiled_prefill() or start + block > self.cache.max_len:
            ids = torch.tensor([chunk], device=self.device)
            return forward_with_cache(self.parts, ids, self.cache, slot)[0, -1]
        padded = torch.tensor([chunk + [0] * (block - len(chunk))], device=self.device)
        where = [torch.tensor(value, device=self.device) for value in (slot, start, len(chunk) - 1)]
        logits = self.compiled_step.prefill_block(padded, *where, self.cache).clone()
        self.cache.lengths[slot] = start + len(chunk)
        return logits

    def sample(self, row):
        """The row's next token (sample_rows of it alone)."""
        return self.sample_rows([row])[row]

    def sample_rows(self, rows):
        """{row: its next token} for `rows`: each row's logits, masked by its constraint (constraint.mask(
        logits) returns the logits with forbidden tokens at -inf; constraint.accept(token) is told the
        choice), drawn by sample_tokens with the row's settings and generator. Rows with the same settings
        are drawn in one call (one top-k over all of them: a pass over the vocabulary per row, on the
        machine's threads); each row's token is the one it gets alone."""
        groups = {}
        for row in rows:
            groups.setdefault(sampling_of(row), []).append(row)
        tokens = {}
        for (temperature, top_k, top_p), group in groups.items():
            logits = [
                row.logits if row.constraint is None else row.constraint.mask(row.logits) for row in group
            ]
            logits = logits[0][None] if len(group) == 1 else torch.stack(logits)
            drawn = sample_tokens(logits, temperature, top_k, top_p, [row.generator for row in group])
            for row, token in zip(group, drawn, strict=True):
                if row.constraint is not None:
                    row.constraint.accept(token)
                tokens[row] = token
        return tokens

    @torch.no_grad()
    def advance(self, tokens):
        """Feed each row of `tokens` ({row: token}) its token: one decode_step for the rows whose slot has
        room, a prefill of its last seq_len // 2 tokens for a row whose window is full."""
        batched = []
        for row, token in tokens.items():
            row.window.append(token)
            if self.cache.lengths[row.slot] < self.seq_len:
                batched.append(row)
            else:
                row.window = row.window[-(self.seq_len // 2) :]
                row.shared = 0  # the window no longer starts where the prompt did
                self.prefill(row)
        if batched:
            ids = torch.zeros(self.slots, dtype=torch.long)
            for row in batched:
                ids[row.slot] = row.window[-1]
            if self.compiled_step is None:
                logits = decode_step(
                    self.parts, ids.to(self.device), self.cache, [row.slot for row in batched]
                )
            else:
                logits = self.step_compiled(ids, batched)
            for row in batched:
                row.logits = logits[row.slot]

    def step_widths(self):
        """The numbers of first slots the compiled step runs over (decode/aot.py's AotStep builds narrower
        steps where each row's logits do not depend on the width); every slot otherwise."""
        return getattr(self.compiled_step, "widths", [self.slots])

    def step_compiled(self, ids, batched):
        """The compiled decode_all for the rows in `batched`, over the narrowest width that holds their slots
        (add() takes the lowest free slot); the other slots of that width write at their length (at
        most max_len - 1), past what they have filled. The logits are copied out of the graph's buffer,
        which the next step overwrites."""
        highest = max(row.slot for row in batched) + 1
        width = next(width for width in self.step_widths() if width >= highest)
        last = self.cache.max_len - 1
        positions = torch.tensor([min(length, last) for length in self.cache.lengths[:width]])
        logits = self.compiled_step(
            ids[:width].to(self.device), positions.to(self.device), self.cache
        ).clone()
        for row in batched:
            self.cache.lengths[row.slot] += 1
        return logits

    def remove(self, row):
        """Free the row's slot (a later add() overwrites its cache)."""
        if self.rows.pop(row.slot, None) is row:
            self.free.append(row.slot)


@torch.no_grad()
def generate(
    model,
    idx,
    max_new_tokens,
    temperature=1.0,
    top_k=None,
    top_p=None,
    stop_token=None,
    generator=None,
    constraint=None,
):
    """Yield up to max_new_tokens new token ids (ints), one per step, continuing the prompt idx (a 1-D
    tensor or shape (1, T)). temperature 0 or top_k 1 is greedy argmax; otherwise sample from
    softmax(logits / temperature), restricted to the top_k tokens and/or the smallest set whose
    probability reaches top_p, drawing with `generator` (sampling runs on the generator's device, so a
    CPU generator gives the same draws whatever the model's device). A constraint (see Decoder.sample)
    masks each step's logits before sampling and is told the token chosen. The stop token is yielded,
    then generation ends. This is a Decoder with one slot: the server's batches run the same steps.

    Each step's logits are exactly those of a full forward pass over a window of the most recent
    tokens. The first window is the prompt's last seq_len tokens; each step adds the new token to it
    until it holds seq_len; the next step's window is then the last seq_len // 2 tokens (the cache
    restarts from them with one batched prefill) and it grows again. So past seq_len every token is
    predicted from at least seq_len // 2 tokens, and a long chat costs one prefill of seq_len // 2
    tokens every seq_len // 2 steps instead of a full window at every step. (A rolling cache would
    keep keys computed while older tokens were still in view: no forward pass computes those.)"""
    if idx.dim() == 2 and idx.shape[0] == 1:
        idx = idx[0]
    if idx.dim() != 1 or idx.numel() == 0:
        raise ValueError(f"generate needs a non-empty prompt of shape (T,) or (1, T), not {tuple(idx.shape)}")
    decoder = Decoder(model, slots=1)
    row = decoder.add(idx.tolist(), temperature, top_k, top_p, generator, constraint)
    for step in range(max_new_tokens):
        token = decoder.sample(row)
        yield token
        if token == stop_token or step == max_new_tokens - 1:
            return
        decoder.advance({row: token})


# ---- sampling ----


def check_sampling(temperature, top_k, top_p):
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 (or None for no limit)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (or None for no limit)")


def sample_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """Pick one token id from logits (vocab_size,), see generate: sample_tokens of one row."""
    return sample_tokens(logits[None], temperature, top_k, top_p, [generator])[0]


def sample_tokens(logits, temperature=1.0, top_k=None, top_p=None, generators=None):
    """One token id per row of logits (rows, vocab_size), each row drawn with its own generator
    (generators: one per row, or None for torch's default). With top_k or top_p the draw is among the
    candidates only, most likely first (the top_k, or the vocabulary sorted for top_p): the softmax over
    them is the full softmax with the others masked out. Dividing by the temperature keeps the order, so
    it is done on the candidates only. Each draw is one uniform number from the row's generator placed on
    the candidates' cumulative probabilities (torch.multinomial draws a number per entry: measured 1.27 ms
    per token at 32,768 tokens before candidates, then 9 us of a 31 us top-50 draw at 4,096 tokens,
    docs/rendimiento.md). Every step works row by row, so a row's token does not depend on the others."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0 or top_k == 1:
        return logits.max(dim=-1).indices.tolist()  # the first of equal maxima, as argmax; 2-3x faster
    generators = generators or [None] * logits.shape[0]
    device = generators[0].device if generators[0] is not None else logits.device
    logits = logits.to(device)
    if top_k is not None and top_k < logits.shape[-1]:
        logits, order = torch.topk(logits, top_k, dim=-1)  # sorted, most likely first
    elif top_p is not None and top_p < 1:
        logits, order = torch.sort(logits, dim=-1, descending=True)
    else:
        order = None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    below = probs.cumsum(-1)  # below[:, i]: the probability of candidates 0..i
    draws = [torch.rand(1, generator=generator, device=device) for generator in generators]
    uniform = (draws[0] if len(draws) == 1 else torch.cat(draws))[:, None]
    if top_p is not None and top_p < 1:
        # Drop a token when the more likely ones already reach top_p; the most likely always stays.
        last = ((below - probs) < top_p).sum(-1, keepdim=True) - 1
        index = torch.minimum((below <= uniform * below.gather(-1, last)).sum(-1, keepdim=True), last)
    else:
        index = (below <= uniform * below[:, -1:]).sum(-1, keepdim=True).clamp_(max=below.shape[-1] - 1)
    return (index if order is None else order.gather(-1, index)).squeeze(-1).tolist()
