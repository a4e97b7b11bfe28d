"""
The decoder's caches of keys and values: KVCache, every layer's keys and values for a Decoder's slots
(decode/engine.py), and PrefixCache, prompt prefixes kept between requests with its member-scope rule (PUBLIC
blocks are everyone's, the others only their member's).
"""

import collections

import torch


class KVCache:
    """Keys and values of every layer for `slots` sequences, each at its own length: per layer a keys and a
    values tensor (slots, kv_heads, max_len, head_dim), preallocated by allocate() or on the first store
    (with the dtype and device of the first keys stored). lengths[s] positions of slot s are filled."""

    def __init__(self, n_layers, max_len, slots=1):
        self.max_len, self.slots = max_len, slots
        self.lengths = [0] * slots
        self.keys = [None] * n_layers
        self.values = [None] * n_layers

    @property
    def length(self):
        """The filled length of a cache whose slots are filled together (forward_with_cache without slot)."""
        return self.lengths[0]

    @length.setter
    def length(self, value):
        self.lengths = [value] * self.slots

    def allocate(self, kv_heads, head_dim, dtype, device):
        for layer_index in range(len(self.keys)):
            shape = (self.slots, kv_heads, self.max_len, head_dim)
            self.keys[layer_index] = torch.zeros(shape, dtype=dtype, device=device)
            self.values[layer_index] = torch.zeros(shape, dtype=dtype, device=device)

    def store(self, layer_index, k, v, slot=None):
        """Write k, v (B, kv_heads, T, head_dim) after the filled positions, into every slot (B = slots,
        filled together) or into slot `slot` alone (B = 1); return the keys and values of those slots'
        positions 0..length+T-1. The caller advances the lengths once every layer has stored."""
        B, H, T, D = k.shape
        if self.keys[layer_index] is None:
            self.allocate(H, D, k.dtype, k.device)
        rows = slice(None) if slot is None else slice(slot, slot + 1)
        start = self.lengths[slot or 0]
        end = start + T
        self.keys[layer_index][rows, :, start:end] = k
        self.values[layer_index][rows, :, start:end] = v
        return self.keys[layer_index][rows, :, :end], self.values[layer_index][rows, :, :end]

    def store_step(self, layer_index, k, v, step):
        """Write one position per slot in use (a DecodeStep), at that slot's length: k, v (slots, kv_heads,
        head_dim) hold every slot's new key and value. Returns the layer's whole keys and values."""
        if self.keys[layer_index] is None:
            self.allocate(k.shape[1], k.shape[2], k.dtype, k.device)
        self.keys[layer_index][step.index, :, step.positions] = k[step.index]
        self.values[layer_index][step.index, :, step.positions] = v[step.index]
        return self.keys[layer_index], self.values[layer_index]


def new_kv_cache(model, slots=1):
    """An empty cache for the model's engine.forward_with_cache and engine.decode_step: `slots` sequences of
    up to seq_len positions each."""
    parts = model.layout()
    return KVCache(len(parts.blocks), parts.seq_len, slots)


def kv_cache_bytes(model, slots, bytes_per_value=4):
    """Memory of a KVCache of `slots` slots: keys and values of every layer, seq_len positions each."""
    parts = model.layout()
    return 2 * len(parts.blocks) * slots * parts.kv_heads * parts.seq_len * parts.head_dim * bytes_per_value


PUBLIC = ("public",)  # the PrefixCache scope of the blocks every request may share


class PrefixCache:
    """Keys and values of prompt prefixes, in blocks of `block` positions cut at the fixed points 0, block,
    2 * block, ... (Decoder prefills every prompt in chunks at those points, so a block restored here holds
    the very numbers its prefill would compute, and an answer is the same with or without the cache).
    A block is keyed by its scope and every token id up to its end: a block within a prompt's first
    `shared` tokens (text the server wrote for everyone) has the scope PUBLIC; any later block the scope of
    the request's member, and only that member's requests find it. At most max_bytes, least recently used
    blocks evicted first (a prompt's later blocks before its earlier ones)."""

    def __init__(self, block, max_bytes):
        self.block, self.max_bytes, self.bytes = block, max_bytes, 0
        self.blocks = collections.OrderedDict()  # (scope, ids) -> [(keys, values) per layer]
        self.stats = {"reused_tokens": 0, "prefilled_tokens": 0, "evicted_blocks": 0}

    def key(self, ids, end, scope, shared):
        return (PUBLIC if end <= shared else ("member", scope), tuple(ids[:end]))

    def restore(self, cache, slot, ids, scope, shared):
        """Copy the cached blocks that start ids (leaving at least its last token to prefill) into the
        slot; returns how many positions they fill, and the keys of the blocks used."""
        used = []
        for end in range(self.block, len(ids), self.block):
            entry = self.blocks.get(self.key(ids, end, scope, shared))
            if entry is None:
                break
            for layer_index, (keys, values) in enumerate(entry):
                cache.keys[layer_index][slot, :, end - self.block : end] = keys
                cache.values[layer_index][slot, :, end - self.block : end] = values
            used.append(self.key(ids, end, scope, shared))
        filled = len(used) * self.block
        cache.lengths[slot] = filled
        self.stats["reused_tokens"] += filled
        return filled, used

    def store(self, cache, slot, ids, end, scope, shared):
        """Keep positions end - block .. end - 1 of the slot (just prefilled from ids)."""
        key = self.key(ids, end, scope, shared)
        if key in self.blocks:
            return key
        entry = [(keys[slot, :, end - self.block : end].clone(), values[slot, :, end - self.block : end].clone())
                 for keys, values in zip(cache.keys, cache.values, strict=True)]  # fmt: skip
        self.blocks[key] = entry
        self.bytes += sum(k.nbytes + v.nbytes for k, v in entry)
        while self.bytes > self.max_bytes and self.blocks:
            _, evicted = self.blocks.popitem(last=False)
            self.bytes -= sum(k.nbytes + v.nbytes for k, v in evicted)
            self.stats["evicted_blocks"] += 1
        return key

    def touch(self, keys):
        """Mark a prompt's blocks used, its first block last: eviction takes a prompt's later blocks
        first, which are useless without the earlier ones."""
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)
