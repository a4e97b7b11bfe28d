"""
What training reads at run time: tokenizers and the control-token table, the shard format, loaders with
exact state. corpus/pipeline.py (stage 1) builds the files they read.

Format chat (SFT): DIR holds tokenizer.model (a copy of the pretraining one), {train,val}_NNNNNN.bin (packed
rows of seq_len + 1 tokens) and mask_{train,val}_NNNNNN.bin (1 = a token the model learns to produce),
written by `python -m chat prepare CONFIG`. Format preference (DPO) uses the same files with one sequence
per row: row 2p holds pair p's prompt + chosen answer, row 2p + 1 its prompt + rejected answer.

Shard format (version 1, the layout of llm.c's token files): a header of 256 little-endian int32
    [0] magic 20240520   [1] version 1   [2] number of tokens   [3] vocabulary size   [4:] zero
followed by the tokens as little-endian uint16. Every document is stored as <|bos|> ids <|eos|>, and
documents follow each other across shard boundaries.

Loaders yield windows of seq_len + 1 tokens as (x, y) = (window[:-1], window[1:]), int64 CPU tensors.
    bytes:  window starts drawn by a seeded torch.Generator inside this rank's 1/world_size slice.
    shards: a shard's windows start every seq_len tokens (each token is a target exactly once); each epoch
            visits the shards in an order drawn from (seed, epoch) and a shard's windows in an order
            drawn from (seed, epoch, shard); rank r takes windows r, r + world_size, ... of that order.
    chat:   rows of seq_len + 1 packed conversations (python -m chat prepare) and their loss mask; y is -1 where the
            mask is 0. Each epoch visits the rows in an order drawn from (seed, epoch); rank r takes rows
            r, r + world_size, ... of that order.
    preference: the same for pairs: a batch of batch_size pairs is 2 x batch_size rows, the chosen ones
            first (TRL's layout), and next_batch() also returns the pairs' indices.
Their state_dict() holds only tensors, ints and strings, so checkpoints load with weights_only=True, and
a restored loader continues with exactly the batches the uninterrupted one would have produced. A state
from another rank count, batch geometry or data is refused with the differences listed.

Known limit of the sentencepiece round trip: the character U+2581 (the piece separator) comes back as a
space. Everything else, including runs of spaces, tabs and newlines, comes back exactly.
"""

import glob
import hashlib
import json
import os

import numpy as np
import sentencepiece as spm
import torch

import fileio

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
PIPELINE_VERSION = 1  # bump when cleaning or encoding changes what the same input produces
SPLITS = ("train", "val")
UNK_PIECE = "<unk>"
NEWLINE = "\n"

# The token table of every sentencepiece tokenizer ENLACE trains, checked each time one loads:
#   0 <unk> | 1 <|bos|> | 2 <|eos|> | 3 <|system|> | 4 <|user|> | 5 <|assistant|> | 6 <|end|> | 7 <|tool|>
#   8..15 <|reserved_0|> .. <|reserved_7|>   (spare control tokens for later stages)
#   16 "\n" | 17 <tool_call> | 18 </tool_call> | 19 <tool_response> | 20 </tool_response> | 21 <tools> | 22 </tools>
# Control tokens (1..15) are never produced by encode(): text that looks like one ("<|user|>") is encoded
# as plain text, so a prompt's control tokens only ever come from chat.render()'s ids. The newline and the
# tool-call tags are user-defined pieces: always one piece, also inside text (Hermes/Qwen style, which is
# what vLLM's hermes parser and llama.cpp's template detection look for).
CONTROL_TOKENS = (
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|tool|>",
    *(f"<|reserved_{i}|>" for i in range(8)),
)
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>")
USER_DEFINED_PIECES = (NEWLINE, *TOOL_TAGS)
TOKEN_TABLE = {
    UNK_PIECE: 0,
    **{piece: i + 1 for i, piece in enumerate(CONTROL_TOKENS)},
    **{piece: i + 1 + len(CONTROL_TOKENS) for i, piece in enumerate(USER_DEFINED_PIECES)},
}


class DataError(Exception):
    """Bad data or a bad data config; the message names the file, key or value."""


# -----------------------------------------------------------------------------
# Manifests (the atomic writer and file digests are fileio.py's)


def manifest_path(data_cfg):
    return os.path.join(data_cfg["dir"], "manifest.json")


def read_manifest(data_cfg):
    path = manifest_path(data_cfg)
    if not os.path.exists(path):
        return {"version": PIPELINE_VERSION}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(
            f"{path}: unreadable manifest ({e}); delete it to rebuild {data_cfg['dir']}/"
        ) from None


def check_split(split):
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")


# -----------------------------------------------------------------------------
# Tokenizers


class ByteTokenizer:
    """UTF-8 bytes as tokens: 256 ids, no special tokens."""

    name = "bytes"
    vocab_size = 256
    bos_id = None
    eos_id = None
    special_ids = {}
    tag_ids = {}
    token_bytes = [1] * 256

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A sentencepiece BPE model trained by `python -m corpus tokenizer` (see train_tokenizer)."""

    name = "sentencepiece"

    def __init__(self, model_path, model_proto=None):
        """From the file model_path, or from model_proto (the file's bytes, as a checkpoint carries
        them; model_path then only names where they came from)."""
        if model_proto is None and not os.path.exists(model_path):
            raise DataError(
                f"{model_path}: tokenizer not found; build it with `python -m corpus tokenizer CONFIG`"
            )
        try:
            if model_proto is None:
                self.processor = spm.SentencePieceProcessor(model_file=model_path)
            else:
                self.processor = spm.SentencePieceProcessor(model_proto=model_proto)
        except (OSError, RuntimeError) as e:
            raise DataError(f"{model_path}: not a sentencepiece model ({e})") from None
        processor = self.processor
        self.path = model_path
        self.vocab_size = processor.get_piece_size()
        found = {
            piece: processor.id_to_piece(index) if index < self.vocab_size else None
            for piece, index in TOKEN_TABLE.items()
        }
        wrong = {piece: at for piece, at in found.items() if at != piece}
        if wrong:
            raise DataError(
                f"{model_path}: its reserved ids do not hold data.py's token table "
                f"(id: expected piece, found piece: "
                + ", ".join(f"{TOKEN_TABLE[p]}: {p!r}, {at!r}" for p, at in wrong.items())
                + "); retrain it with `python -m corpus tokenizer CONFIG`"
            )
        self.special_ids = {piece: TOKEN_TABLE[piece] for piece in CONTROL_TOKENS}
        self.tag_ids = {piece: TOKEN_TABLE[piece] for piece in TOOL_TAGS}
        self.bos_id = self.special_ids["<|bos|>"]
        self.eos_id = self.special_ids["<|eos|>"]
        self.newline_id = TOKEN_TABLE[NEWLINE]
        self.token_bytes = [self._piece_bytes(i) for i in range(self.vocab_size)]

    def _piece_bytes(self, index):
        """UTF-8 bytes a piece decodes to; 0 for special pieces (so bits per byte compares tokenizers)."""
        processor = self.processor
        if processor.is_control(index) or processor.is_unknown(index):
            return 0
        if processor.is_byte(index):
            return 1
        return len(processor.id_to_piece(index).replace("\u2581", " ").encode("utf-8"))

    def encode(self, text):
        # Lines are encoded one by one: pieces never cross "\n" (a piece of its own), and sentencepiece is
        # several times slower on one long string than on the same text cut into lines.
        lines = text.split(NEWLINE)
        encoded = self.processor.encode(lines, num_threads=1)
        ids = encoded[0]
        for line_ids in encoded[1:]:
            ids.append(self.newline_id)
            ids.extend(line_ids)
        return ids

    def decode(self, ids):
        return self.processor.decode([int(i) for i in ids])


class StreamDecoder:
    """Turns token ids into text as they arrive, holding back an incomplete UTF-8 sequence (a byte
    token or a byte-fallback piece can end in the middle of a character). Sentencepiece decodes each byte
    of an unfinished character as its own U+FFFD, so every trailing U+FFFD is held back (flush() gives
    what is left, a real U+FFFD included)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids = []
        self.emitted = 0

    def push(self, token):
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        stable = len(text.rstrip("\ufffd"))
        new, self.emitted = text[self.emitted : stable], max(self.emitted, stable)
        return new

    def flush(self):
        text = self.tokenizer.decode(self.ids)
        new, self.emitted = text[self.emitted :], len(text)
        return new


def load_tokenizer(data_cfg):
    if data_cfg["format"] == "bytes":
        return ByteTokenizer()
    if data_cfg["format"] in (
        "chat",
        "preference",
    ):  # the copy `python -m chat prepare` made of data.chat.tokenizer
        path = tokenizer_path(data_cfg)
        if not os.path.exists(path):
            raise DataError(f"{path}: not found; pack the conversations with `python -m chat prepare CONFIG`")
        return SentencePieceTokenizer(path)
    tokenizer = SentencePieceTokenizer(tokenizer_path(data_cfg))
    configured = data_cfg["tokenizer"]["vocab_size"]
    if tokenizer.vocab_size != configured:
        raise DataError(
            f"{tokenizer.path}: has {tokenizer.vocab_size} tokens but data.tokenizer.vocab_size is {configured}; "
            "retrain it with `python -m corpus tokenizer CONFIG`"
        )
    return tokenizer


def tokenizer_path(data_cfg):
    return os.path.join(data_cfg["dir"], "tokenizer.model")


# -----------------------------------------------------------------------------
# Shard files


def write_shard(path, tokens, vocab_size):
    """Write a uint16 token shard atomically; returns its sha256. A disk without room for it is a
    fileio.StorageError before anything is written."""
    if not 0 < vocab_size <= 65536:
        raise DataError(f"{path}: vocab size {vocab_size} does not fit uint16 tokens (1..65536)")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:4] = (SHARD_MAGIC, SHARD_VERSION, len(tokens), vocab_size)
    body = np.ascontiguousarray(tokens, dtype="<u2")
    digest = hashlib.sha256()
    size = header.nbytes + body.nbytes
    fileio.check_space(path, size, what="the shard")

    def write(f):
        for part in (header.tobytes(), body.tobytes()):
            digest.update(part)
            f.write(part)

    fileio.write_atomic(path, write, needed=size, what="the shard")
    return digest.hexdigest()


def read_shard_header(path):
    """Check a shard's header against its size; returns (num_tokens, vocab_size)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise DataError(f"{path}: cannot read shard ({e.strerror})") from None
    if size < HEADER_BYTES:
        raise DataError(f"{path}: truncated shard: {size} bytes, shorter than the {HEADER_BYTES}-byte header")
    header = np.frombuffer(raw, dtype="<i4")
    magic, version, num_tokens, vocab_size = (int(v) for v in header[:4])
    if magic != SHARD_MAGIC:
        raise DataError(f"{path}: not a token shard: magic number {magic}, expected {SHARD_MAGIC}")
    if version != SHARD_VERSION:
        raise DataError(f"{path}: shard version {version}, this data.py reads version {SHARD_VERSION}")
    if not 0 < vocab_size <= 65536:
        raise DataError(f"{path}: header vocab size {vocab_size}, expected 1..65536")
    expected = HEADER_BYTES + 2 * num_tokens
    if num_tokens < 0 or size != expected:
        raise DataError(
            f"{path}: truncated or corrupt shard: {size} bytes, but the header says {num_tokens} tokens "
            f"({expected} bytes)"
        )
    return num_tokens, vocab_size


def read_shard(path):
    """Memory-map a checked shard's tokens (uint16)."""
    num_tokens, _ = read_shard_header(path)
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(num_tokens,))


def shard_name(split, index):
    return f"{split}_{index:06d}.bin"


def shard_paths(data_cfg, split):
    return sorted(glob.glob(os.path.join(glob.escape(data_cfg["dir"]), f"{split}_[0-9]*.bin")))


def byte_path(data_cfg, split):
    return os.path.join(data_cfg["dir"], f"{split}.bin")


def load_split_tokens(data_cfg, split):
    """All tokens of a split as one array (uint8 for bytes, uint16 for shards), e.g. for evaluation."""
    check_split(split)
    if data_cfg["format"] == "bytes":
        return np.asarray(ByteLoader.open(byte_path(data_cfg, split)))
    if data_cfg["format"] in ("chat", "preference"):
        raise DataError(
            f"{data_cfg['dir']}: packed conversations are rows with a loss mask, not one token stream; "
            "evaluate a chat run with `python -m evaluation.bpb RUN --chat-eval FILE.jsonl`"
        )
    paths = ShardLoader.find(data_cfg, split)
    return np.concatenate([read_shard(path) for path in paths])


# -----------------------------------------------------------------------------
# Loaders


def build_loader(data_cfg, split, batch_size, seq_len, seed, rank=0, world_size=1):
    """The loader of `split` for one rank. next_batch() -> (x, y), int64 tensors (batch_size, seq_len)."""
    check_split(split)
    if not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is outside world size {world_size}")
    if data_cfg["format"] == "bytes":
        return ByteLoader(byte_path(data_cfg, split), split, batch_size, seq_len, seed, rank, world_size)
    if data_cfg["format"] == "chat":
        return ChatLoader(data_cfg, split, batch_size, seq_len, seed, rank, world_size)
    if data_cfg["format"] == "preference":
        return PairLoader(data_cfg, split, batch_size, seq_len, seed, rank, world_size)
    return ShardLoader(data_cfg, split, batch_size, seq_len, seed, rank, world_size)


def check_state(state, expected, what):
    differences = [
        f"{key}: state has {state.get(key)!r}, this loader has {value!r}"
        for key, value in expected.items()
        if state.get(key) != value
    ]
    if differences:
        raise DataError(f"cannot restore the {what} loader state:\n  " + "\n  ".join(differences))


class ByteLoader:
    """Random windows of a uint8 file; each rank draws inside its own contiguous slice."""

    def __init__(self, path, split, batch_size, seq_len, seed, rank, world_size):
        self.tokens = self.open(path)
        self.path, self.split = path, split
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size = rank, world_size
        slice_len = len(self.tokens) // world_size
        if slice_len < seq_len + 1:
            raise DataError(
                f"{path}: {len(self.tokens)} bytes give each of {world_size} ranks {slice_len}, fewer than "
                f"one window of seq_len + 1 = {seq_len + 1}"
            )
        self.slice_start = rank * slice_len
        self.num_starts = slice_len - seq_len  # window starts that fit inside the slice
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = np.arange(seq_len + 1)

    @staticmethod
    def open(path):
        if not os.path.exists(path):
            raise DataError(
                f"{path}: not found; build it with `make data-smoke` (scripts/prepare_smoke_data.sh)"
            )
        if os.path.getsize(path) == 0:
            raise DataError(f"{path}: empty file")
        return np.memmap(path, dtype=np.uint8, mode="r")

    def next_batch(self):
        starts = torch.randint(self.num_starts, (self.batch_size,), generator=self.generator).numpy()
        windows = torch.from_numpy(
            self.tokens[self.slice_start + starts[:, None] + self.offsets].astype(np.int64)
        )
        return windows[:, :-1], windows[:, 1:]

    def identity(self):
        return {
            "format": "bytes",
            "split": self.split,
            "rank": self.rank,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "num_tokens": len(self.tokens),
        }

    def state_dict(self):
        return self.identity() | {"seed": self.seed, "generator": self.generator.get_state()}

    def load_state_dict(self, state):
        check_state(state, self.identity(), f"{self.split} byte")
        self.seed = state["seed"]
        self.generator.set_state(state["generator"].to(device="cpu", dtype=torch.uint8))


class ShardLoader:
    """Windows of seq_len + 1 tokens over the uint16 shards of a split, in a seeded order per epoch."""

    def __init__(self, data_cfg, split, batch_size, seq_len, seed, rank, world_size):
        self.split = split
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self.paths = self.find(data_cfg, split)
        self.packing = data_cfg["packing"]
        vocab_size = data_cfg["tokenizer"]["vocab_size"]
        self.shard_tokens = []
        for path in self.paths:
            num_tokens, shard_vocab = read_shard_header(path)
            if shard_vocab != vocab_size:
                raise DataError(
                    f"{path}: encoded with a {shard_vocab}-token vocabulary, data.tokenizer.vocab_size is "
                    f"{vocab_size}; re-encode with `python -m corpus encode CONFIG`"
                )
            self.shard_tokens.append(num_tokens)
        if sum(self.windows_per_rank(n) for n in self.shard_tokens) == 0:
            raise DataError(
                f"{data_cfg['dir']}/{split}_*.bin: {sum(self.shard_tokens)} tokens are not one window of "
                f"seq_len + 1 = {seq_len + 1} tokens per rank ({world_size} ranks)"
            )
        self.epoch, self.shard_position, self.window_position = 0, 0, 0
        self.offsets = np.arange(seq_len + 1)
        self.current = None  # (epoch, shard_position) whose tokens and windows are loaded

    @staticmethod
    def find(data_cfg, split):
        paths = shard_paths(data_cfg, split)
        if not paths:
            raise DataError(
                f"{data_cfg['dir']}/{split}_*.bin: no shards; build them with `python -m corpus all CONFIG`"
            )
        manifest = read_manifest(data_cfg)
        encoded = manifest.get("encode", {}).get(split)
        if encoded is not None and not encoded.get("complete"):
            raise DataError(
                f"{manifest_path(data_cfg)}: encoding of the {split} split is unfinished; "
                "finish it with `python -m corpus encode CONFIG`"
            )
        return paths

    def windows_per_rank(self, num_tokens):
        return (num_tokens - 1) // self.seq_len // self.world_size

    def shard_order(self, epoch):
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.paths))

    def load_current(self):
        shard = int(self.shard_order(self.epoch)[self.shard_position])
        self.tokens = read_shard(self.paths[shard])
        if self.packing == "bos_aligned":
            starts = bos_aligned_starts(self.tokens, self.seq_len)
        else:
            starts = np.arange((len(self.tokens) - 1) // self.seq_len) * self.seq_len
        usable = len(starts) // self.world_size * self.world_size  # every rank gets as many
        order = np.random.default_rng([self.seed, self.epoch, shard]).permutation(len(starts))[:usable]
        self.window_starts = starts[order[self.rank :: self.world_size]]
        self.current = (self.epoch, self.shard_position)

    def next_batch(self):
        parts, count, empty_shards = [], 0, 0
        while count < self.batch_size:
            if self.current != (self.epoch, self.shard_position):
                self.load_current()
                empty_shards = 0 if len(self.window_starts) else empty_shards + 1
                if empty_shards > len(self.paths):  # bos_aligned: no shard holds a whole row for this rank
                    raise DataError(
                        f"{self.split} shards: no row of seq_len + 1 = {self.seq_len + 1} tokens starts at a "
                        f"<|bos|> for rank {self.rank} of {self.world_size}; use data.packing: windows"
                    )
            take = min(self.batch_size - count, len(self.window_starts) - self.window_position)
            chosen = self.window_starts[self.window_position : self.window_position + take]
            parts.append(self.tokens[chosen[:, None] + self.offsets])
            count += take
            self.window_position += take
            if self.window_position == len(self.window_starts):
                self.window_position = 0
                self.shard_position += 1
                if self.shard_position == len(self.paths):
                    self.shard_position, self.epoch = 0, self.epoch + 1
        windows = torch.from_numpy(np.concatenate(parts).astype(np.int64))
        return windows[:, :-1], windows[:, 1:]

    def identity(self):
        return {
            "format": "shards",
            "split": self.split,
            "rank": self.rank,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "shards": [os.path.basename(p) for p in self.paths],
            "shard_tokens": list(self.shard_tokens),
            "packing": self.packing,
        }

    def state_dict(self):
        return self.identity() | {
            "seed": self.seed,
            "epoch": self.epoch,
            "shard_position": self.shard_position,
            "window_position": self.window_position,
        }

    def load_state_dict(self, state):
        check_state(state, self.identity(), f"{self.split} shard")
        self.seed = state["seed"]
        self.epoch, self.shard_position = state["epoch"], state["shard_position"]
        self.window_position = state["window_position"]
        self.current = None


def bos_aligned_starts(tokens, seq_len):
    """Starts of rows of seq_len + 1 tokens that each begin at a document's <|bos|> (data.packing
    bos_aligned): the next row starts at the first <|bos|> at or after the previous row's last token, or
    right there when the document runs on for more than a row (a long document is read whole, in rows;
    only the first of them starts at its <|bos|>). The rest of a document cut by a row's end is skipped."""
    bos = np.flatnonzero(tokens == TOKEN_TABLE["<|bos|>"])
    starts, position = [], int(bos[0]) if len(bos) else len(tokens)
    while position + seq_len < len(tokens):
        starts.append(position)
        end = position + seq_len  # the row's last token, the next row's first at the latest
        following = np.searchsorted(bos, end)
        position = int(bos[following]) if following < len(bos) and bos[following] - end < seq_len else end
    return np.array(starts, dtype=np.int64)


def mask_shard_name(split, index):
    return f"mask_{split}_{index:06d}.bin"


class ChatLoader:
    """Packed conversations (`python -m chat prepare`): rows of seq_len + 1 tokens, each starting with
    <|bos|>, and a parallel loss mask. A row gives x = row[:-1] and y = row[1:] with y = -1 wherever the
    mask of that token is 0 (prompt, system, tool and padding tokens teach nothing). Each epoch visits every
    row once, in an order drawn from (seed, epoch); rank r takes rows r, r + world_size, ... of that order."""

    def __init__(self, data_cfg, split, batch_size, seq_len, seed, rank, world_size):
        self.split = split
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self.row_len = seq_len + 1
        prepared = read_manifest(data_cfg).get("prepare", {}).get(split)
        where = f"{data_cfg['dir']}/{split}_*.bin"
        if not prepared or not prepared.get("complete"):
            state = "unfinished" if prepared else "missing"
            raise DataError(f"{where}: packed conversations {state}; run `python -m chat prepare CONFIG`")
        if prepared["seq_len"] != seq_len:
            raise DataError(
                f"{where}: packed for seq_len {prepared['seq_len']}, model.seq_len is {seq_len}; "
                "rerun `python -m chat prepare CONFIG`"
            )
        self.tokens, self.masks, self.shard_rows = [], [], []
        for shard in prepared["shards"]:
            for name, into in ((shard["name"], self.tokens), (shard["mask"], self.masks)):
                array = read_shard(os.path.join(data_cfg["dir"], name))
                if len(array) != shard["rows"] * self.row_len:
                    raise DataError(
                        f"{data_cfg['dir']}/{name}: {len(array)} tokens, the manifest says {shard['rows']} rows "
                        f"of {self.row_len}; rerun `python -m chat prepare CONFIG`"
                    )
                into.append(array.reshape(shard["rows"], self.row_len))
            self.shard_rows.append(shard["rows"])
        self.shard_names = [shard["name"] for shard in prepared["shards"]]
        self.row_starts = np.cumsum([0] + self.shard_rows)
        self.rows_per_rank = self.row_starts[-1] // world_size
        if self.rows_per_rank == 0:
            raise DataError(
                f"{where}: {self.row_starts[-1]} packed rows, fewer than one per rank ({world_size})"
            )
        self.epoch, self.position = 0, 0
        self.order_epoch, self.order = None, None

    def rows_of_epoch(self):
        if self.order_epoch != self.epoch:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(int(self.row_starts[-1]))
            self.order = order[self.rank :: self.world_size][: self.rows_per_rank]
            self.order_epoch = self.epoch
        return self.order

    def row(self, index):
        shard = int(np.searchsorted(self.row_starts, index, side="right")) - 1
        within = index - self.row_starts[shard]
        return self.tokens[shard][within], self.masks[shard][within]

    def next_batch(self):
        tokens = np.empty((self.batch_size, self.row_len), dtype=np.int64)
        trained = np.empty((self.batch_size, self.row_len), dtype=bool)
        for i in range(self.batch_size):
            tokens[i], trained[i] = self.row(int(self.rows_of_epoch()[self.position]))
            self.position += 1
            if self.position == self.rows_per_rank:
                self.position, self.epoch = 0, self.epoch + 1
        x = torch.from_numpy(tokens[:, :-1].copy())
        y = torch.from_numpy(np.where(trained[:, 1:], tokens[:, 1:], -1))
        return x, y

    def identity(self):
        return {
            "format": "chat",
            "split": self.split,
            "rank": self.rank,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "shards": list(self.shard_names),
            "shard_rows": [int(n) for n in self.shard_rows],
        }

    def state_dict(self):
        return self.identity() | {"seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state):
        check_state(state, self.identity(), f"{self.split} chat")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self.order_epoch = None


class PairLoader(ChatLoader):
    """Preference pairs (`python -m chat prepare` with data.format preference): rows 2p and 2p + 1 are pair
    p's prompt + chosen and prompt + rejected sequences, with the loss mask on the answers only. A batch of
    batch_size pairs gives x, y of 2 x batch_size rows (the chosen ones first, then the rejected ones in
    the same order: TRL's layout) and the pairs' indices. Each epoch visits every pair once, in an order
    drawn from (seed, epoch); rank r takes pairs r, r + world_size, ... of that order."""

    def __init__(self, data_cfg, split, batch_size, seq_len, seed, rank, world_size):
        super().__init__(data_cfg, split, batch_size, seq_len, seed, rank, world_size)
        rows = int(self.row_starts[-1])
        if rows % 2:
            raise DataError(
                f"{data_cfg['dir']}/{split}_*.bin: {rows} rows, not whole pairs; rerun `python -m chat prepare CONFIG`"
            )
        self.pairs = rows // 2
        self.pairs_per_rank = self.pairs // world_size
        if self.pairs_per_rank == 0:
            raise DataError(f"{data_cfg['dir']}/{split}_*.bin: {self.pairs} pairs, fewer than one per rank")

    def pairs_of_epoch(self):
        if self.order_epoch != self.epoch:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(self.pairs)
            self.order = order[self.rank :: self.world_size][: self.pairs_per_rank]
            self.order_epoch = self.epoch
        return self.order

    def rank_pairs(self):
        """This rank's share of the pairs, each once, in file order (evaluation and reference log-probs)."""
        return list(range(self.rank, self.pairs, self.world_size))

    def pair_rows(self, pairs):
        """x, y of the pairs: 2 x len(pairs) rows, chosen first; y = -1 where the mask is 0."""
        rows = [2 * p for p in pairs] + [2 * p + 1 for p in pairs]
        tokens = np.empty((len(rows), self.row_len), dtype=np.int64)
        trained = np.empty((len(rows), self.row_len), dtype=bool)
        for i, row in enumerate(rows):
            tokens[i], trained[i] = self.row(row)
        x = torch.from_numpy(tokens[:, :-1].copy())
        y = torch.from_numpy(np.where(trained[:, 1:], tokens[:, 1:], -1))
        return x, y

    def next_batch(self):
        pairs = []
        for _ in range(self.batch_size):
            pairs.append(int(self.pairs_of_epoch()[self.position]))
            self.position += 1
            if self.position == self.pairs_per_rank:
                self.position, self.epoch = 0, self.epoch + 1
        x, y = self.pair_rows(pairs)
        return x, y, torch.tensor(pairs, dtype=torch.int64)

    def identity(self):
        return super().identity() | {"format": "preference"}


if __name__ == "__main__":
    import sys

    print("data.py has no commands any more; the corpus pipeline is `python -m corpus`", file=sys.stderr)
    sys.exit(2)
