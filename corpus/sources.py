"""
The sources of the corpus step: each `kind` of data.corpus.sources read into raw documents, tagged with
their source, streamed (a file is never loaded whole, except a `documents: file` text).

    text        documents separated by blank lines, or the whole file as one document
    jsonl       one JSON object per line, the text under text_field (id and url kept)
    parquet     row group by row group with pyarrow; FineWeb-2/CulturaX columns kept when present
    mediawiki   a Wikipedia/Wikisource XML dump: main-namespace articles, no redirects, wikitext as plain text
.gz, .bz2 and .zst files are decompressed; a file that cannot be read is an error naming it.
"""

import bz2
import collections
import glob
import gzip
import io
import json
import os
import zlib

import zstandard

from data import NEWLINE, DataError

PARQUET_METADATA = ("id", "url", "language_score", "minhash_cluster_size")  # kept when present (FineWeb-2)


def expand_sources(corpus_cfg):
    """[(source index, file path)] in config order, sorted within each glob; errors name the source."""
    files = []
    for index, source in enumerate(corpus_cfg["sources"]):
        pattern, where = source["path"], f"data.corpus.sources[{index}] ({source['name']}).path"
        if glob.has_magic(pattern):
            matches = [path for path in sorted(glob.glob(pattern, recursive=True)) if os.path.isfile(path)]
            if not matches:
                fetch = "; fetch it with `python -m corpus download CONFIG`" if "hub" in source else ""
                raise DataError(f"{where}: no file matches {pattern!r}{fetch}")
        elif not os.path.exists(pattern):
            raise DataError(f"{where}: {pattern}: file not found")
        elif os.path.isdir(pattern):
            raise DataError(
                f"{where}: {pattern} is a directory; name files or a glob such as {pattern}/*.txt"
            )
        else:
            matches = [pattern]
        files.extend((index, path) for path in matches)
    return files


def open_input(path):
    """A binary stream of the file, decompressed by its extension (.gz, .bz2, .zst)."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".bz2"):
        return bz2.open(path, "rb")
    if path.endswith(".zst"):
        return io.BufferedReader(ZstdReader(path))
    return open(path, "rb")


class ZstdReader(io.RawIOBase):
    """A .zst file's decompressed bytes, frame after frame; a file that ends inside a frame is an error
    (zstandard's stream reader would end quietly there)."""

    def __init__(self, path):
        self.file, self.path = open(path, "rb"), path
        self.decompressor, self.pending = zstandard.ZstdDecompressor().decompressobj(), b""

    def readable(self):
        return True

    def readinto(self, buffer):
        while not self.pending:
            compressed = self.file.read(1 << 16)
            if not compressed:
                if not self.decompressor.eof:
                    raise EOFError("the file ends inside a zstd frame (truncated)")
                return 0
            if self.decompressor.eof:  # a new frame follows
                self.decompressor = zstandard.ZstdDecompressor().decompressobj()
            self.pending = self.decompressor.decompress(compressed)
        size = min(len(buffer), len(self.pending))
        buffer[:size], self.pending = self.pending[:size], self.pending[size:]
        return size

    def close(self):
        self.file.close()
        super().close()


def read_text_like(path, source, stats):
    """Documents of a text (blank_line / file) or jsonl file. Undecodable bytes arrive as lone surrogates
    (surrogateescape); the worker replaces and counts them. Bad JSON lines are counted in `stats`."""
    kind, mode = source["kind"], source.get("documents", "blank_line")
    with open_input(path) as f:
        if kind == "text" and mode == "file":
            content = f.read()
            stats["bytes_in"] += len(content)
            yield content.decode("utf-8", "surrogateescape"), {}
            return
        lines = []
        for raw_line in f:
            stats["bytes_in"] += len(raw_line)
            line = raw_line.decode("utf-8", "surrogateescape")
            if kind == "jsonl":
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    stats["drops"]["bad_json"] += 1
                    continue
                text = record.get(source["text_field"]) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    stats["drops"]["missing_text_field"] += 1
                    continue
                yield text, {key: record[key] for key in ("id", "url") if key in record}
            elif line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines), {}
                lines = []
        if lines:
            yield "".join(lines), {}


def read_parquet(path, source, stats):
    """Row group by row group: the text column and FineWeb-2's metadata columns when present."""
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError for files that are not parquet
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    names = parquet.schema_arrow.names
    if source["text_field"] not in names:
        raise DataError(
            f"{path}: no column {source['text_field']!r} (text_field of source {source['name']}); "
            f"the file has {', '.join(names)}"
        )
    columns = [source["text_field"], *(c for c in PARQUET_METADATA if c in names)]
    for group in range(parquet.num_row_groups):
        try:
            rows = parquet.read_row_group(group, columns=columns).to_pylist()
        except Exception as e:
            raise DataError(f"{path}: row group {group} is unreadable ({e})") from None
        stats["bytes_in"] += parquet.metadata.row_group(group).total_byte_size
        for row in rows:
            text = row.pop(source["text_field"])
            if not isinstance(text, str):
                stats["drops"]["missing_text_field"] += 1
                continue
            yield text, {key: value for key, value in row.items() if value is not None}


def read_mediawiki(path, source, stats):
    """A Wikipedia/Wikisource XML dump, streamed: main-namespace pages that are not redirects, their
    wikitext as plain text (templates, tables, references, files and categories dropped; headings kept)."""
    import xml.etree.ElementTree as ElementTree

    counted = CountingReader(open_input(path), stats)
    try:
        events = ElementTree.iterparse(counted, events=("start", "end"))
        _, root = next(events)
        if not root.tag.endswith("mediawiki"):
            raise DataError(f"{path}: not a MediaWiki XML dump (root element <{root.tag}>)")
        namespace = root.tag[: -len("mediawiki")]
        for event, element in events:
            if event != "end" or element.tag != namespace + "page":
                continue
            title = element.findtext(namespace + "title") or ""
            page_ns = element.findtext(namespace + "ns")
            redirect = element.find(namespace + "redirect") is not None
            text = element.findtext(f"{namespace}revision/{namespace}text") or ""
            root.clear()  # pages already read are not kept: memory stays flat over the dump
            if page_ns != "0" or redirect or text.lstrip().lower().startswith("#redir"):
                stats["drops"]["wiki_not_article"] += 1
                continue
            yield wikitext_to_text(title, text), {"id": title}
    except ElementTree.ParseError as e:
        raise DataError(f"{path}: not well-formed MediaWiki XML ({e})") from None
    finally:
        counted.close()


class CountingReader(io.RawIOBase):
    """A read-only stream that adds the bytes it hands out to stats['bytes_in']."""

    def __init__(self, stream, stats):
        self.stream, self.stats = stream, stats

    def readable(self):
        return True

    def readinto(self, buffer):
        data = self.stream.read(len(buffer))
        buffer[: len(data)] = data
        self.stats["bytes_in"] += len(data)
        return len(data)

    def close(self):
        self.stream.close()
        super().close()


def wikitext_to_text(title, wikitext):
    import mwparserfromhell

    code = mwparserfromhell.parse(wikitext)
    for node in code.filter_wikilinks(recursive=False):
        if ":" in str(node.title):  # Archivo:, Categoría:, interwiki links: not text
            code.remove(node)
    for node in code.filter_tags(recursive=False):
        if str(node.tag).lower() in ("ref", "table", "gallery", "math"):
            code.remove(node)
    lines = [title, ""]
    for line in code.strip_code(normalize=True, collapse=True).split(NEWLINE):
        lines.append(line.strip())  # heading titles come back as " Historia "
    return NEWLINE.join(lines)


READERS = {
    "text": read_text_like,
    "jsonl": read_text_like,
    "parquet": read_parquet,
    "mediawiki": read_mediawiki,
}


def raw_documents(corpus_cfg, stats_of):
    """(source index, raw text, metadata) of every document in config order, at most
    max_documents_per_file per file; stats_of(source index) is that source's counters."""
    limit = corpus_cfg["max_documents_per_file"]
    taken = collections.Counter()  # documents per source, for a source's max_documents
    for index, path in expand_sources(corpus_cfg):
        source = corpus_cfg["sources"][index]
        source_limit = source.get("max_documents")
        documents = READERS[source["kind"]](path, source, stats_of(index))
        try:
            for count, (text, meta) in enumerate(documents):
                if (limit is not None and count >= limit) or (
                    source_limit is not None and taken[index] >= source_limit
                ):
                    break
                taken[index] += 1
                yield index, text, meta
        except (OSError, EOFError, zlib.error, zstandard.ZstdError) as e:  # damaged: not a bug of ours
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
            raise DataError(f"{path}: cannot read ({reason}) [data.corpus.sources[{index}]]") from None
        finally:
            documents.close()
