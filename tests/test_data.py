"""data.py: tokenizers, the shard format and loaders with exact state."""

import copy
import io
import os

import numpy as np
import pytest
import torch
from conftest import data_layer, read_docs

import data
import fileio

# -----------------------------------------------------------------------------
# Loaders


def byte_cfg(directory, train_bytes, val_bytes=b"abcdefghij" * 10):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "train.bin").write_bytes(train_bytes)
    (directory / "val.bin").write_bytes(val_bytes)
    return data_layer("smoke", dir=str(directory))


def positional_shards(directory, sizes, vocab_size=65536):
    """Shards whose tokens are their global positions: every window says where it came from."""
    directory.mkdir(parents=True, exist_ok=True)
    start = 0
    for index, size in enumerate(sizes):
        data.write_shard(
            str(directory / data.shard_name("train", index)), np.arange(start, start + size), vocab_size
        )
        start += size
    data.write_shard(str(directory / data.shard_name("val", 0)), np.arange(500), vocab_size)
    return data_layer("corpus-smoke", dir=str(directory), tokenizer={"vocab_size": vocab_size})


def batches(loader, count):
    return [loader.next_batch() for _ in range(count)]


def assert_same_batches(first, second):
    assert len(first) == len(second)
    for (x1, y1), (x2, y2) in zip(first, second, strict=True):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def through_checkpoint(state):
    """What the trainer does with a loader state: torch.save, then torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu", weights_only=True)


def test_byte_loader_restored_from_its_state_continues_with_the_same_batches(tmp_path):
    cfg = byte_cfg(tmp_path, bytes(range(256)) * 40)
    loader = data.build_loader(cfg, "train", 4, 16, seed=7)
    batches(loader, 5)
    state = through_checkpoint(loader.state_dict())
    expected = batches(loader, 6)
    restored = data.build_loader(cfg, "train", 4, 16, seed=7)
    restored.load_state_dict(state)
    assert_same_batches(batches(restored, 6), expected)


def test_byte_batches_are_int64_windows_with_targets_shifted_by_one(tmp_path):
    text = bytes(range(256)) * 4
    cfg = byte_cfg(tmp_path, text)
    x, y = data.build_loader(cfg, "train", 3, 8, seed=1).next_batch()
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, 8)
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        start = text.index(bytes(row_x))  # bytes(range(256)) makes every window unique
        assert bytes(row_y) == text[start + 1 : start + 9]


def test_byte_loader_ranks_draw_from_disjoint_slices(tmp_path):
    cfg = byte_cfg(tmp_path, np.repeat(np.arange(4, dtype=np.uint8), 1000).tobytes())
    for rank in range(4):
        loader = data.build_loader(cfg, "train", 8, 32, seed=3, rank=rank, world_size=4)
        seen = torch.cat([torch.cat([x, y]) for x, y in batches(loader, 20)]).unique().tolist()
        assert seen == [rank]


def test_a_fresh_val_loader_with_the_same_seed_repeats_its_batches(tmp_path):
    cfg = byte_cfg(tmp_path, b"x" * 1000, val_bytes=bytes(range(256)) * 4)
    first = batches(data.build_loader(cfg, "val", 2, 8, seed=5), 3)
    assert_same_batches(batches(data.build_loader(cfg, "val", 2, 8, seed=5), 3), first)


def test_shard_loader_restored_from_its_state_continues_across_shards_and_epochs(tmp_path):
    cfg = positional_shards(tmp_path, [300, 170, 90])
    loader = data.build_loader(cfg, "train", 4, 10, seed=11)
    batches(loader, 9)  # 55 windows per epoch: the next batches cross shards and the epoch boundary
    state = through_checkpoint(loader.state_dict())
    expected = batches(loader, 12)
    restored = data.build_loader(cfg, "train", 4, 10, seed=11)
    restored.load_state_dict(state)
    assert_same_batches(batches(restored, 12), expected)


def test_shard_loader_reads_every_window_once_per_epoch_in_a_seeded_order(tmp_path):
    cfg = positional_shards(tmp_path, [301, 171, 91])  # 30 + 17 + 9 windows of 10 (+1) tokens
    loader = data.build_loader(cfg, "train", 8, 10, seed=2)
    starts = torch.cat([x[:, 0] for x, _ in batches(loader, 7)]).tolist()  # exactly one epoch
    expected = sorted(
        shard_start + 10 * w for shard_start, n in ((0, 30), (301, 17), (472, 9)) for w in range(n)
    )
    assert sorted(starts) == expected
    other_seed = data.build_loader(cfg, "train", 8, 10, seed=3)
    assert torch.cat([x[:, 0] for x, _ in batches(other_seed, 7)]).tolist() != starts


def test_shard_loader_ranks_read_disjoint_windows(tmp_path):
    cfg = positional_shards(tmp_path, [301, 181])  # 30 + 18 windows: 10 + 6 for each of 3 ranks
    per_rank = []
    for rank in range(3):
        loader = data.build_loader(cfg, "train", 4, 10, seed=4, rank=rank, world_size=3)
        per_rank.append(set(torch.cat([x for x, _ in batches(loader, 4)]).flatten().tolist()))  # one epoch
    assert not per_rank[0] & per_rank[1] and not per_rank[0] & per_rank[2] and not per_rank[1] & per_rank[2]
    assert sum(map(len, per_rank)) == 3 * 16 * 10


BOS = data.TOKEN_TABLE["<|bos|>"]


def documents_shards(directory, lengths, vocab_size=4096):
    """One train shard of documents <|bos|> 100 101 ... of the given lengths (the <|bos|> included)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokens = np.concatenate([[BOS, *range(100, 100 + n - 1)] for n in lengths])
    data.write_shard(str(directory / data.shard_name("train", 0)), tokens, vocab_size)
    data.write_shard(str(directory / data.shard_name("val", 0)), tokens, vocab_size)
    cfg = data_layer("corpus-smoke", dir=str(directory), tokenizer={"vocab_size": vocab_size})
    return cfg | {"packing": "bos_aligned"}, tokens


def test_bos_aligned_rows_start_at_a_document_unless_it_is_longer_than_a_row(tmp_path):
    lengths = [4, 7, 3, 30, 5, 6, 9, 2, 8]  # the fourth document spans three rows of 10 (+1)
    cfg, tokens = documents_shards(tmp_path, lengths)
    starts = data.bos_aligned_starts(tokens, 10)
    document_starts = set(np.cumsum([0, *lengths[:-1]]).tolist())
    long_document = range(14, 44)
    assert all(start in document_starts or start in long_document for start in starts.tolist())
    assert starts.tolist() == [0, 11, 21, 31, 44, 55]  # the first <|bos|> at or after the last end
    assert all(b - a >= 10 for a, b in zip(starts, starts[1:], strict=False)), "rows never overlap"
    loader = data.build_loader(cfg, "train", 6, 10, seed=5)
    x, y = loader.next_batch()  # exactly one epoch
    assert sorted(x[:, 0].tolist()) == sorted(tokens[starts].tolist())
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_a_bos_aligned_loader_state_continues_and_a_windows_state_is_refused(tmp_path):
    cfg, _ = documents_shards(tmp_path, [4, 7, 3, 30, 5, 6, 9, 2, 8] * 5)
    loader = data.build_loader(cfg, "train", 3, 10, seed=1)
    batches(loader, 4)
    state = through_checkpoint(loader.state_dict())
    expected = batches(loader, 6)
    restored = data.build_loader(cfg, "train", 3, 10, seed=1)
    restored.load_state_dict(state)
    assert_same_batches(batches(restored, 6), expected)
    with pytest.raises(data.DataError, match="packing: state has 'bos_aligned', this loader has 'windows'"):
        data.build_loader(cfg | {"packing": "windows"}, "train", 3, 10, seed=1).load_state_dict(state)


def test_a_loader_state_from_another_world_size_or_shape_is_refused(tmp_path):
    cfg = positional_shards(tmp_path, [300])
    state = data.build_loader(cfg, "train", 4, 10, seed=1, rank=0, world_size=2).state_dict()
    with pytest.raises(data.DataError, match="world_size: state has 2, this loader has 1"):
        data.build_loader(cfg, "train", 4, 10, seed=1).load_state_dict(state)
    byte_state = data.build_loader(byte_cfg(tmp_path / "b", b"z" * 500), "train", 4, 10, seed=1).state_dict()
    with pytest.raises(data.DataError, match="seq_len: state has 10, this loader has 12"):
        data.build_loader(byte_cfg(tmp_path / "b", b"z" * 500), "train", 4, 12, seed=1).load_state_dict(
            byte_state
        )


def test_loaders_explain_missing_or_too_small_data(tmp_path):
    with pytest.raises(data.DataError, match="train.bin: not found; build it with `make data-smoke`"):
        data.build_loader(data_layer("smoke", dir=str(tmp_path / "none")), "train", 2, 8, seed=0)
    with pytest.raises(data.DataError, match="fewer than one window"):
        data.build_loader(byte_cfg(tmp_path / "small", b"abc"), "train", 2, 8, seed=0)
    empty_dir = data_layer("corpus-smoke", dir=str(tmp_path / "no-shards"))
    with pytest.raises(data.DataError, match=r"train_\*\.bin: no shards"):
        data.build_loader(empty_dir, "train", 2, 8, seed=0)
    with pytest.raises(data.DataError, match="unknown split 'test'"):
        data.build_loader(empty_dir, "test", 2, 8, seed=0)


# -----------------------------------------------------------------------------
# Shard format


def test_a_shard_round_trips_its_tokens_and_header(tmp_path):
    path = str(tmp_path / "train_000000.bin")
    tokens = np.array([0, 1, 65535, 300, 7], dtype=np.uint16)
    sha256 = data.write_shard(path, tokens, 65536)
    assert sha256 == fileio.sha256_of_file(path)
    assert data.read_shard_header(path) == (5, 65536)
    assert np.array_equal(data.read_shard(path), tokens)
    header = np.fromfile(path, dtype="<i4", count=4)
    assert header.tolist() == [20240520, 1, 5, 65536]
    assert os.path.getsize(path) == 1024 + 2 * 5


def broken_shard(tmp_path, index, value=None, cut=0):
    path = str(tmp_path / f"bad_{index}.bin")
    data.write_shard(path, np.arange(50), 1000)
    raw = bytearray(open(path, "rb").read())
    if value is not None:
        raw[index * 4 : index * 4 + 4] = np.array([value], dtype="<i4").tobytes()
    with open(path, "wb") as f:
        f.write(raw[: len(raw) - cut])
    return path


@pytest.mark.parametrize(
    "index, value, cut, message",
    [
        (0, 12345, 0, "not a token shard: magic number 12345, expected 20240520"),
        (1, 2, 0, "shard version 2, this data.py reads version 1"),
        (2, 50, 10, r"truncated or corrupt shard: 1114 bytes, but the header says 50 tokens \(1124 bytes\)"),
        (2, 60, 0, "truncated or corrupt shard: 1124 bytes, but the header says 60 tokens"),
        (3, 0, 0, "header vocab size 0"),
        (4, None, 1000, "truncated shard: 124 bytes, shorter than the 1024-byte header"),
    ],
)
def test_a_broken_shard_is_refused_with_the_file_and_the_problem(tmp_path, index, value, cut, message):
    path = broken_shard(tmp_path, index, value, cut)
    with pytest.raises(data.DataError, match=message) as excinfo:
        data.read_shard(path)
    assert str(excinfo.value).startswith(path + ":")


def test_shards_of_another_vocabulary_are_refused_by_the_loader(tmp_path):
    cfg = positional_shards(tmp_path, [300], vocab_size=65000)
    cfg["tokenizer"]["vocab_size"] = 4096
    with pytest.raises(data.DataError, match="train_000000.bin: encoded with a 65000-token vocabulary"):
        data.build_loader(cfg, "train", 2, 8, seed=0)


# -----------------------------------------------------------------------------
# Tokenizer


def test_the_tokenizer_round_trips_the_val_split_exactly(pipeline):
    tokenizer = data.load_tokenizer(pipeline)
    assert tokenizer.name == "sentencepiece" and tokenizer.vocab_size == 512
    val = read_docs(pipeline, "val")
    assert len(val) > 10
    for text in val:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    tricky = "  dos espacios\tun tab\n\n\nlíneas  vacías \n 2024 ¿Qué? 日本 🙂 fin "
    assert tokenizer.decode(tokenizer.encode(tricky)) == tricky


def test_line_by_line_encoding_equals_sentencepiece_on_the_whole_text(pipeline):
    tokenizer = data.load_tokenizer(pipeline)
    for text in read_docs(pipeline, "val")[:50]:
        assert tokenizer.encode(text) == tokenizer.processor.encode(text)


def test_control_tokens_have_reserved_ids_and_never_come_from_plain_text(pipeline):
    tokenizer = data.load_tokenizer(pipeline)
    assert tokenizer.special_ids == {
        "<|bos|>": 1,
        "<|eos|>": 2,
        "<|system|>": 3,
        "<|user|>": 4,
        "<|assistant|>": 5,
        "<|end|>": 6,
        "<|tool|>": 7,
        **{f"<|reserved_{i}|>": 8 + i for i in range(8)},
    }
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.newline_id) == (1, 2, 16)
    text = "<|bos|><|user|> hola <|assistant|> adiós <|end|><|eos|><|system|><|tool|><|reserved_3|>"
    ids = tokenizer.encode(text)
    assert not set(ids) & set(tokenizer.special_ids.values())
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([1, *tokenizer.encode("hola"), 4, 2]) == "hola"


def test_tool_tags_are_single_pieces_at_fixed_ids(pipeline):
    tokenizer = data.load_tokenizer(pipeline)
    assert tokenizer.tag_ids == {
        "<tool_call>": 17,
        "</tool_call>": 18,
        "<tool_response>": 19,
        "</tool_response>": 20,
        "<tools>": 21,
        "</tools>": 22,
    }
    for tag, tag_id in tokenizer.tag_ids.items():
        ids = tokenizer.encode(f"antes{tag}después")
        assert tag_id in ids and tokenizer.decode(ids) == f"antes{tag}después"


def test_a_tokenizer_without_the_token_table_is_refused(pipeline, tmp_path):
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(read_docs(pipeline, "train")[:200]),
        model_writer=model,
        model_type="bpe",
        vocab_size=300,
        minloglevel=2,
    )
    path = tmp_path / "tokenizer.model"
    path.write_bytes(model.getvalue())
    with pytest.raises(data.DataError, match=r"tokenizer\.model: its reserved ids do not hold"):
        data.SentencePieceTokenizer(str(path))


def test_token_bytes_add_up_to_the_utf8_length_of_the_text(pipeline):
    tokenizer = data.load_tokenizer(pipeline)
    for text in read_docs(pipeline, "val")[:20] + ["año 🙂 日本\n\tfin"]:
        ids = [tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id]
        assert sum(tokenizer.token_bytes[i] for i in ids) == len(text.encode("utf-8"))


def test_the_byte_tokenizer_is_utf8_with_replacement():
    tokenizer = data.load_tokenizer(data_layer("smoke"))
    assert (tokenizer.name, tokenizer.vocab_size, tokenizer.eos_id, tokenizer.special_ids) == (
        "bytes",
        256,
        None,
        {},
    )
    assert tokenizer.encode("ñ") == [0xC3, 0xB1] and tokenizer.decode([0xC3, 0xB1, 0xFF]) == "ñ\ufffd"


def test_a_tokenizer_that_does_not_match_the_config_is_refused(pipeline):
    cfg = copy.deepcopy(pipeline)
    cfg["tokenizer"]["vocab_size"] = 1024
    with pytest.raises(data.DataError, match="has 512 tokens but data.tokenizer.vocab_size is 1024"):
        data.load_tokenizer(cfg)


def test_the_shard_loader_reads_the_encoded_corpus(pipeline):
    x, y = data.build_loader(pipeline, "train", 4, 32, seed=0).next_batch()
    assert x.shape == (4, 32) and int(x.max()) < 512 and torch.equal(x[:, 1:], y[:, :-1])
