"""
The document stages of corpus/pipeline.py's corpus step, each a small object built from the data layer's YAML:

    LanguageStage    py3langid (its model ships inside the wheel): keep documents in the listed languages
                     whose normalized probability reaches min_score
    quality_stages   FineWeb-2's filters from datatrove, called on a Document directly (no executor needed):
                     GopherRepetitionFilter, FineWebQualityFilter, GopherQualityFilter, with the thresholds
                     and stop words of FineWeb-2's spa_Latn config (in configs/data/*.yaml) and, by default,
                     its word split (datatrove's spaCy tokenizer for spa_Latn)
    PiiScrubber      e-mail, public IP, Spanish phone numbers (phonenumbers), DNI/NIE and IBAN (python-stdnum
                     check digits) replaced by fixed placeholders, counted by type
    MinHasher        datatrove's MinHash signature (word n-grams of simplify_text, 64-bit xxhash, buckets x
                     hashes), reduced to one 64-bit key per bucket for the LSH step in corpus/pipeline.py
    Decontaminator   13-grams of lowercased words without punctuation; a document sharing one with a
                     protected text (an evaluation file, the val split) is dropped

Every verdict is (keep, reason); reasons are the names the report and the manifest count.
"""

import collections
import hashlib
import ipaddress
import os
import re

import numpy as np
import regex
from datatrove.data import Document
from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
from datatrove.pipeline.filters import FineWebQualityFilter, GopherQualityFilter, GopherRepetitionFilter
from datatrove.utils.hashing import HashConfig
from datatrove.utils.word_tokenizers import WordTokenizer

# -----------------------------------------------------------------------------
# Words


class RegexWords(WordTokenizer):
    """Words and punctuation marks as spaCy's blank Spanish tokenizer (FineWeb-2's word tokenizer for
    spa_Latn) splits most prose, without spaCy: word_tokenizer: regex, an explicit option. It splits technical
    text more finely ("less(1)" 4 words, spaCy 2), so the filters' verdicts drift from FineWeb-2's there;
    `make bench ARGS=corpus` measures the agreement and the cost of both. Word-internal hyphens, apostrophes
    and dots stay ("1.999", "auto-ayuda")."""

    # Like spaCy: hyphens stay on a word's edges ("-Sí", "-¡Viva", "moneda-"), short capitalized abbreviations and
    # "etc." keep their dot ("Sr.", "D."), "..." is one token, other punctuation marks are tokens of their own.
    PATTERN = regex.compile(
        r"\p{Lu}\p{Ll}{0,2}\.(?=\s|$)|etc\.(?!\w)|(?:-+[¡¿]*)?\w+(?:[-'’.]\w+)*-*|\.\.\.|[^\w\s]"
    )

    def __init__(self):
        super().__init__("es")

    def word_tokenize(self, text):
        return self.PATTERN.findall(text)

    def sent_tokenize(self, text):
        raise NotImplementedError("RegexWords splits words only")

    def span_tokenize(self, text):
        raise NotImplementedError("RegexWords splits words only")


# What FineWeb-2's pipeline passes as `language`: datatrove's load_word_tokenizer gives spaCy's blank "es".
FINEWEB2_LANGUAGE = "spa_Latn"


def word_splitter(name):
    """datatrove's `language` argument: RegexWords, or FineWeb-2's language code for its own word split."""
    return RegexWords() if name == "regex" else FINEWEB2_LANGUAGE


# -----------------------------------------------------------------------------
# Language identification


class LanguageStage:
    name = "language"

    def __init__(self, cfg):
        self.languages = set(cfg["languages"])
        self.min_score = cfg["min_score"]
        self.max_chars = cfg["max_chars"]
        self.identifier = None  # built in the worker: the model does not need pickling

    def score(self, text):
        """(best language, its normalized probability) of the first max_chars characters."""
        if self.identifier is None:
            from py3langid.langid import MODEL_DIR, MODEL_FILE, LanguageIdentifier

            self.identifier = LanguageIdentifier.from_modelpath(
                os.path.join(MODEL_DIR, MODEL_FILE), norm_probs=True
            )
        language, probability = self.identifier.classify(text[: self.max_chars])
        return language, float(probability)

    def __call__(self, document):
        language, probability = self.score(document.text)
        document.metadata["language"], document.metadata["language_score"] = language, probability
        if language not in self.languages:
            return False, f"language_{language}"
        if probability < self.min_score:
            return False, "language_low_score"
        return True, None


# -----------------------------------------------------------------------------
# FineWeb-2 quality filters (datatrove)


class DatatroveStage:
    """One datatrove filter as a named stage: its own drop reasons, prefixed with the stage's name."""

    def __init__(self, name, datatrove_filter):
        self.name, self.filter = name, datatrove_filter

    def __call__(self, document):
        result = self.filter.filter(document)
        keep, reason = result if isinstance(result, tuple) else (result, None)
        return keep, None if keep else f"{self.name}:{reason or 'dropped'}"


def pairs(items):
    return tuple((int(n), float(fraction)) for n, fraction in items)


def quality_stages(filters_cfg):
    """The enabled datatrove filters in FineWeb-2's order: repetition, FineWeb quality, Gopher quality."""
    words = word_splitter(filters_cfg["word_tokenizer"])
    stages = []
    cfg = filters_cfg["gopher_repetition"]
    if cfg["enabled"]:
        stages.append(
            DatatroveStage(
                "gopher_repetition",
                GopherRepetitionFilter(
                    dup_line_frac=cfg["dup_line_frac"],
                    dup_para_frac=cfg["dup_para_frac"],
                    dup_line_char_frac=cfg["dup_line_char_frac"],
                    dup_para_char_frac=cfg["dup_para_char_frac"],
                    top_n_grams=pairs(cfg["top_n_grams"]),
                    dup_n_grams=pairs(cfg["dup_n_grams"]),
                    language=words,
                ),
            )
        )
    cfg = filters_cfg["fineweb_quality"]
    if cfg["enabled"]:
        stages.append(
            DatatroveStage(
                "fineweb_quality",
                FineWebQualityFilter(
                    line_punct_thr=cfg["line_punct_thr"],
                    line_punct_exclude_zero=cfg["line_punct_exclude_zero"],
                    short_line_thr=cfg["short_line_thr"],
                    short_line_length=cfg["short_line_length"],
                    char_duplicates_ratio=cfg["char_duplicates_ratio"],
                    new_line_ratio=cfg["new_line_ratio"],
                    language=words,
                ),
            )
        )
    cfg = filters_cfg["gopher_quality"]
    if cfg["enabled"]:
        stages.append(
            DatatroveStage(
                "gopher_quality",
                GopherQualityFilter(
                    min_doc_words=cfg["min_doc_words"],
                    max_doc_words=cfg["max_doc_words"],
                    min_avg_word_length=cfg["min_avg_word_length"],
                    max_avg_word_length=cfg["max_avg_word_length"],
                    max_symbol_word_ratio=cfg["max_symbol_word_ratio"],
                    max_bullet_lines_ratio=cfg["max_bullet_lines_ratio"],
                    max_ellipsis_lines_ratio=cfg["max_ellipsis_lines_ratio"],
                    max_non_alpha_words_ratio=cfg["max_non_alpha_words_ratio"],
                    min_stop_words=cfg["min_stop_words"],
                    stop_words=cfg["stop_words"],
                    language=words,
                ),
            )
        )
    return stages


def document(text, source=None):
    return Document(text=text, id=source or "", metadata={})


# -----------------------------------------------------------------------------
# Personal data


EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[a-zA-Z]{2,}\b")
IPV4 = re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}\b")
# Spanish numbers: optional +34/0034, nine digits starting 6-9, in groups of 2-3 separated by space, dot or
# hyphen; phonenumbers decides which candidates are valid numbers.
PHONE = re.compile(r"(?<![\w+])(?:(?:\+|00)34[\s.-]?)?[6-9]\d{2}(?:[\s.-]?\d{2,3}){2,3}(?!\w)")
DNI = re.compile(r"\b\d{8}-?[A-Za-z]\b")
NIE = re.compile(r"\b[XYZxyz]-?\d{7}-?[A-Za-z]\b")
IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){3,7}(?: ?[A-Z0-9]{1,3})?\b")
PII_TYPES = ("email", "ip", "phone", "dni", "nie", "iban")


class PiiScrubber:
    """Replace personal data by the configured placeholders; counts what it replaced, by type."""

    name = "pii"

    def __init__(self, cfg):
        from phonenumbers import PhoneNumberFormat, format_number, is_valid_number, parse
        from stdnum import iban
        from stdnum.es import dni, nie

        self.placeholders = cfg["placeholders"]

        def valid_phone(candidate):
            try:
                number = parse(candidate, "ES")
            except Exception:  # phonenumbers raises NumberParseException on text that is no number
                return False
            return is_valid_number(number) and format_number(number, PhoneNumberFormat.E164).startswith("+34")

        def public_ip(candidate):
            try:
                return ipaddress.ip_address(candidate).is_global
            except ValueError:
                return False

        self.checks = (  # order matters: an IBAN holds digit runs a phone pattern would also match
            ("email", EMAIL, lambda s: True),
            ("iban", IBAN, lambda s: iban.is_valid(s)),
            ("nie", NIE, lambda s: nie.is_valid(s)),
            ("dni", DNI, lambda s: dni.is_valid(s)),
            ("ip", IPV4, public_ip),
            ("phone", PHONE, valid_phone),
        )

    def __call__(self, text):
        """(scrubbed text, {type: replacements})."""
        counts = {}
        for kind, pattern, valid in self.checks:
            if kind not in self.placeholders or not pattern.search(text):
                continue

            def replace(match, kind=kind, valid=valid):
                if not valid(match.group()):
                    return match.group()
                counts[kind] = counts.get(kind, 0) + 1
                return self.placeholders[kind]

            text = pattern.sub(replace, text)
        return text, counts


# -----------------------------------------------------------------------------
# Near-duplicates: datatrove's MinHash signature, one key per LSH bucket


class MinHasher:
    def __init__(self, cfg, word_tokenizer):
        self.config = MinhashConfig(
            n_grams=cfg["ngram"],
            num_buckets=cfg["buckets"],
            hashes_per_bucket=cfg["hashes_per_bucket"],
            seed=cfg["seed"],
            hash_config=HashConfig(precision=64, hash_fc="xxhash"),
        )
        self.word_tokenizer = word_tokenizer
        self.signer = None  # built in the worker

    def bucket_keys(self, text):
        """uint64[buckets]: each bucket's hashes_per_bucket minimum hashes, digested to 64 bits (two
        documents land in the same bucket exactly when their band of hashes is equal, bar a 2^-64 chance);
        None for a text with fewer words than one n-gram."""
        if self.signer is None:
            self.signer = MinhashDedupSignature(
                output_folder=os.devnull, config=self.config, language=self.word_tokenizer
            )
        shingles = self.signer.get_shingles(text)
        if shingles.size == 0:
            return None
        bands = np.asarray(self.signer.get_signature(shingles), dtype="<u8")
        return np.array(
            [
                int.from_bytes(hashlib.blake2b(band.tobytes(), digest_size=8).digest(), "little")
                for band in bands
            ],
            dtype=np.uint64,
        )


def near_duplicate_clusters(keys):
    """keys: uint64 [documents, buckets] (rows of zeros: no signature). Union of documents that share a
    bucket key -> cluster id (the smallest member's index) per document."""
    parent = np.arange(len(keys))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    has_signature = keys.any(axis=1)
    for bucket in range(keys.shape[1]):
        first = {}
        for index in np.flatnonzero(has_signature):
            key = int(keys[index, bucket])
            other = first.setdefault(key, index)
            if other != index:
                a, b = root(index), root(other)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    return np.array([root(i) for i in range(len(keys))], dtype=np.int64)


# -----------------------------------------------------------------------------
# Decontamination


NON_WORD = regex.compile(r"[^\p{L}\p{N}]+")


def ngram_hashes(text, n):
    """Hashes of the word n-grams of a text lowercased with punctuation stripped (a set of ints)."""
    words = NON_WORD.sub(" ", text.lower()).split()
    return {hash(" ".join(words[i : i + n])) for i in range(len(words) - n + 1)}


class Decontaminator:
    """Protected n-grams by the name of the text they came from. `hit(text)` names the evaluation file a
    document shares any n-gram with, or "val" when at least val_max_overlap of the document's n-grams are
    in the val split (a near-copy of a val document: a phrase shared by a whole register, such as a
    parliamentary formula, is not one); None when clean. Hashes live in one process (Python's str hash is
    salted per process), which is where corpus/pipeline.py builds and probes them."""

    def __init__(self, n, common_in, val_max_overlap):
        self.n, self.common_in, self.val_max_overlap = n, common_in, val_max_overlap
        self.owner, self.documents = {}, collections.Counter()

    def protect(self, name, text):
        hashes = ngram_hashes(text, self.n)
        self.documents.update(hashes)
        for h in hashes:
            self.owner.setdefault(h, name)

    def drop_common(self):
        """Forget n-grams found in common_in or more protected documents (boilerplate); returns how many."""
        if not self.common_in:
            return 0
        common = [h for h, count in self.documents.items() if count >= self.common_in]
        for h in common:
            del self.owner[h]
        self.documents.clear()
        return len(common)

    def hit(self, text):
        words = NON_WORD.sub(" ", text.lower()).split()
        owner, in_val, total = self.owner, 0, len(words) - self.n + 1
        for i in range(total):
            name = owner.get(hash(" ".join(words[i : i + self.n])))
            if name == "val":
                in_val += 1
            elif name is not None:
                return name
        return "val" if total > 0 and in_val >= self.val_max_overlap * total else None
