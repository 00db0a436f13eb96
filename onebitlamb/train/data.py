"""Data for the pretraining example: a real text corpus, a WordPiece tokenizer trained on it, and
BERT's masked-language-model batches.

The default corpus exists offline on every machine: the running Python's own standard library
(its ``.py`` sources with their docstrings and comments, the rendered documentation of the modules
built into the interpreter, and the ``pydoc`` documentation topics). ``--corpus PATH`` replaces it
with the user's text files or folders.

Everything here is a pure function of its arguments and a seed, so every optimizer of a comparison,
every rank and a resumed run all see the same data:

- the train / held-out split is decided per *document* (file) by a hash of its name, so it does
  not depend on the order files are found in, and no file contributes to both sides;
- the tokenizer is trained on the training split only;
- the samples of global batch ``step`` and their masks depend on ``(seed, step)`` only: rank ``r``
  of ``n`` takes the ``r``-th contiguous ``1/n`` of the global batch.
"""
from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from onebitlamb.train import files

# Fixed ids: the tokenizer trainer assigns them in this order.
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(len(SPECIAL_TOKENS))
NUM_SPECIAL = len(SPECIAL_TOKENS)
IGNORE_INDEX = -100  # label of positions that are not predicted (the loss skips them)

WORDPIECE_PREFIX = "##"
CACHE_VERSION = 3  # bump when the tokenization below changes


# ----------------------------------------------------------------------------------------------
# Documents


@dataclass(frozen=True)
class Document:
    name: str  # stable identifier, used for the split (a path relative to its root, or a topic)
    text: str


_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def stdlib_documents(include_tests: bool = False) -> List[Document]:
    """The running Python's standard library as documents: every ``.py`` source outside the
    third-party folders (and outside the test suites unless ``include_tests``: they triple the
    size), the plain-text help of each built-in (C) module (whose docstrings have no source file)
    and every ``pydoc`` documentation topic."""
    root = sysconfig.get_paths()["stdlib"]
    skip = _SKIP_DIRS - ({"test", "tests", "idle_test"} if include_tests else set())
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        for fname in sorted(filenames):
            if fname.endswith(".py"):
                path = os.path.join(dirpath, fname)
                text = _read_text(path)
                if text:
                    docs.append(Document("stdlib/" + os.path.relpath(path, root).replace(os.sep, "/"), text))
    docs.extend(_builtin_module_docs())
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip it
        topics = {}
    docs.extend(Document(f"topic/{key}", topics[key]) for key in sorted(topics))
    return docs


def _builtin_module_docs() -> List[Document]:
    import importlib
    import pydoc

    docs = []
    for name in sorted(sys.builtin_module_names):
        if name.startswith("_"):
            continue
        try:
            text = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
        except Exception:  # a module that cannot be imported or rendered is simply left out
            continue
        docs.append(Document(f"builtin/{name}", _without_data_section(text)))
    return docs


def _without_data_section(text: str) -> str:
    """A module's plain-text help without its DATA section: the values of the running process
    (``sys.argv``, ``sys.path``, ``sys.modules``, ...) would make the corpus differ from one run,
    folder or machine to the next."""
    kept, in_data = [], False
    for line in text.splitlines(keepends=True):
        if line.strip() and not line[0].isspace():  # a section's title starts a line
            in_data = line.strip() == "DATA"
        if not in_data:
            kept.append(line)
    return "".join(kept)


def path_documents(paths: Sequence[str]) -> List[Document]:
    """Every readable UTF-8 text file under the given files or folders (hidden entries skipped)."""
    docs = []
    for top in paths:
        top = os.path.abspath(top)
        if os.path.isfile(top):
            found = [(top, os.path.basename(top))]
        elif os.path.isdir(top):
            found = []
            for dirpath, dirnames, filenames in os.walk(top):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
                for fname in sorted(filenames):
                    if not fname.startswith("."):
                        path = os.path.join(dirpath, fname)
                        found.append((path, os.path.relpath(path, top).replace(os.sep, "/")))
        else:
            raise FileNotFoundError(f"--corpus: no such file or folder: {top}")
        for path, rel in found:
            text = _read_text(path)
            if text:
                docs.append(Document(f"{os.path.basename(top)}/{rel}", text))
    if not docs:
        raise ValueError(f"--corpus: no readable UTF-8 text under {list(paths)}")
    return docs


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            raw = f.read()
        if b"\0" in raw:
            return None  # binary
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.strip() else None


def _name_hash(name: str) -> float:
    """A number in [0, 1) from a document's name, the same on every machine and Python version."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2**64


def is_heldout(name: str, heldout_fraction: float) -> bool:
    """Whether document ``name`` belongs to the held-out split: decided by a hash of the name, so
    the answer does not depend on which other documents exist or in what order they were found."""
    return _name_hash(name) < heldout_fraction


def split_documents(docs: Iterable[Document], heldout_fraction: float) -> Tuple[List[Document], List[Document]]:
    """(train, held-out), each sorted by name; every document goes to exactly one side, by
    ``is_heldout``. A corpus of a few files may hash all to one side: then the document with the
    smallest hash is held out (or the one with the largest is trained on), so both sides exist."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    docs = sorted(docs, key=lambda d: d.name)
    if len({d.name for d in docs}) != len(docs):
        raise ValueError("two documents share a name")
    if len(docs) < 2:
        raise ValueError(f"the corpus must have at least 2 documents (files) to split, got {len(docs)}")
    held = {d.name for d in docs if is_heldout(d.name, heldout_fraction)}
    by_hash = sorted(docs, key=lambda d: _name_hash(d.name))
    if not held:
        held = {by_hash[0].name}
    elif len(held) == len(docs):
        held.discard(by_hash[-1].name)
    return [d for d in docs if d.name not in held], [d for d in docs if d.name in held]


# ----------------------------------------------------------------------------------------------
# Tokenizer and tokenized blocks


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A BERT-style WordPiece tokenizer (cased) trained from scratch on ``texts``; the same texts
    give the same vocabulary in every process."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    def fresh(model):
        tok = Tokenizer(model)
        tok.normalizer = normalizers.BertNormalizer(lowercase=False, strip_accents=False, clean_text=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        return tok

    texts = list(texts)
    tok = fresh(models.WordPiece(unk_token="[UNK]"))
    # The trainer breaks ties between equally frequent merges by token id, and numbers the
    # word-internal pieces ("##e") in hash-map order, which changes from process to process: in
    # about one training in three the vocabulary differed by a token or two at its cut-off, and
    # so did every number of a run. Registering those pieces up front, in sorted order, fixes
    # their ids and so the ties. They are dropped as special tokens again below.
    words = (word for text in texts
             for word, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(text)))
    inner = sorted({c for word in words for c in word[1:]})
    pieces = [WORDPIECE_PREFIX + c for c in inner]
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + pieces,
                                        show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # Ids: special tokens first, then the rest sorted (the trainer's own numbering is in hash-map
    # order), in a tokenizer whose only special tokens are SPECIAL_TOKENS
    ordered = SPECIAL_TOKENS + sorted(t for t in tok.get_vocab() if t not in SPECIAL_TOKENS)
    tok = fresh(models.WordPiece({t: i for i, t in enumerate(ordered)}, unk_token="[UNK]"))
    tok.add_special_tokens(SPECIAL_TOKENS)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, f"special token {t} got id {tok.token_to_id(t)}"
    return tok


def encode_blocks(tokenizer, docs: Sequence[Document], seq_len: int) -> torch.Tensor:
    """Tokenize ``docs`` into one stream (``[SEP]`` after each document), cut it into pieces of
    ``seq_len - 2`` tokens and frame each as ``[CLS] piece [SEP]``: an ``(N, seq_len)`` tensor with
    no padding (the incomplete last piece is dropped)."""
    if seq_len < 8:
        raise ValueError(f"seq_len must be >= 8, got {seq_len}")
    stream: List[int] = []
    for enc in tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False):
        stream.extend(enc.ids)
        stream.append(SEP_ID)
    body = seq_len - 2
    n = len(stream) // body
    if n == 0:
        return torch.empty(0, seq_len, dtype=torch.int32)
    pieces = torch.tensor(stream[: n * body], dtype=torch.int32).view(n, body)
    cls = torch.full((n, 1), CLS_ID, dtype=torch.int32)
    sep = torch.full((n, 1), SEP_ID, dtype=torch.int32)
    return torch.cat([cls, pieces, sep], dim=1)


@dataclass
class Corpus:
    train: torch.Tensor  # (N, seq_len) int32 token ids
    heldout: torch.Tensor  # (M, seq_len) int32
    vocab_size: int
    info: dict  # what was read: documents, tokens, source


def corpus_key(paths: Optional[Sequence[str]], vocab_size: int, seq_len: int, heldout_fraction: float,
               stdlib_tests: bool = False) -> dict:
    """What decides the cached tensors: the source (with file sizes and times), the sizes and the
    split. Two runs with equal keys share the cache."""
    if paths:
        files = []
        for top in paths:
            top = os.path.abspath(top)
            walk = [(os.path.dirname(top), [], [os.path.basename(top)])] if os.path.isfile(top) else os.walk(top)
            for dirpath, _, filenames in walk:
                for f in filenames:
                    st = os.stat(os.path.join(dirpath, f))
                    files.append((os.path.join(dirpath, f), st.st_size, st.st_mtime_ns))
        source = {"paths": [os.path.abspath(p) for p in paths],
                  "files": hashlib.sha256(json.dumps(sorted(files)).encode()).hexdigest()}
    else:
        source = {"stdlib": sysconfig.get_paths()["stdlib"], "python": sys.version, "tests": stdlib_tests}
    return {"version": CACHE_VERSION, "source": source, "vocab_size": vocab_size, "seq_len": seq_len,
            "heldout_fraction": heldout_fraction}


def prepare_corpus(paths: Optional[Sequence[str]], vocab_size: int, seq_len: int, heldout_fraction: float,
                   cache_dir: str, log=print, stdlib_tests: bool = False) -> Corpus:
    """Read, split, train the tokenizer and tokenize, or load all of it from ``cache_dir``.

    Call it once before starting workers (they then only load the cache): it is the slow part of a
    first run and must not run ``n`` times in parallel."""
    key = corpus_key(paths, vocab_size, seq_len, heldout_fraction, stdlib_tests)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = os.path.join(cache_dir, f"corpus-{digest}")
    tensors = os.path.join(folder, "blocks.pt")
    if os.path.exists(tensors):
        saved = load_cache(tensors, _tokenizer_size(os.path.join(folder, "tokenizer.json")), seq_len)
        return Corpus(saved["train"], saved["heldout"], vocab_size, saved["info"])

    log(f"preparing corpus ({'--corpus ' + ' '.join(paths) if paths else 'Python standard library'}) "
        f"into {folder} ...")
    docs = path_documents(paths) if paths else stdlib_documents(include_tests=stdlib_tests)
    train_docs, heldout_docs = split_documents(docs, heldout_fraction)
    tokenizer = train_tokenizer((d.text for d in train_docs), vocab_size)
    train = encode_blocks(tokenizer, train_docs, seq_len)
    heldout = encode_blocks(tokenizer, heldout_docs, seq_len)
    if len(train) == 0 or len(heldout) == 0:
        raise ValueError(f"corpus too small for seq_len {seq_len}: {len(train)} training and "
                         f"{len(heldout)} held-out sequences")
    info = {"key": key, "documents": {"train": len(train_docs), "heldout": len(heldout_docs)},
            "sequences": {"train": len(train), "heldout": len(heldout)},
            "tokens": {"train": train.numel(), "heldout": heldout.numel()},
            "heldout_names": [d.name for d in heldout_docs]}
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    atomic_save({"train": train, "heldout": heldout, "info": info}, tensors)
    log(f"corpus: {info['documents']['train']}+{info['documents']['heldout']} documents, "
        f"{len(train)} training and {len(heldout)} held-out sequences of {seq_len} tokens")
    return Corpus(train, heldout, vocab_size, info)


def _tokenizer_size(path: str) -> Optional[int]:
    """The number of tokens of the cached tokenizer (its ids are 0..n-1), None if unreadable."""
    try:
        with open(path) as f:
            return len(json.load(f)["model"]["vocab"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_cache(path: str, vocab_size: Optional[int] = None, seq_len: Optional[int] = None) -> dict:
    """The cached tensors, read as plain data (``weights_only=True``: unpickling a planted file
    runs no code), and checked: both splits non-empty, ``seq_len`` tokens a row, every token id in
    ``[0, vocab_size)`` (the tokenizer's size, not the model's: ``loop.prepare_corpus`` checks that). A file that is not so is refused with a clear error (an empty held-out
    split reported a held-out loss of 0.0000; an id beyond the vocabulary failed inside the model)."""
    try:
        saved = torch.load(path, weights_only=True)
        if not isinstance(saved, dict) or not {"train", "heldout", "info"} <= set(saved):
            raise ValueError("not a corpus cache")
    except Exception as exc:  # noqa: BLE001 (unpickling raises many types)
        raise ValueError(f"the corpus cache {path} cannot be read as plain data "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                         f"delete {os.path.dirname(path)} to rebuild it") from None
    for split in ("train", "heldout"):
        blocks = saved[split]
        problem = None
        if not isinstance(blocks, torch.Tensor) or blocks.dim() != 2 or blocks.dtype.is_floating_point:
            problem = "is not a table of token ids"
        elif len(blocks) == 0 or blocks.shape[1] == 0:
            problem = "is empty"
        elif seq_len is not None and blocks.shape[1] != seq_len:
            problem = f"has rows of {blocks.shape[1]} tokens, not {seq_len}"
        elif int(blocks.min()) < 0 or (vocab_size is not None and int(blocks.max()) >= vocab_size):
            problem = (f"holds token ids from {int(blocks.min())} to {int(blocks.max())}, outside the vocabulary "
                       f"[0, {vocab_size})")
        if problem:
            raise ValueError(f"the corpus cache {path} is damaged: its {split} split {problem}; delete "
                             f"{os.path.dirname(path)} to rebuild it")
    return saved


def atomic_save(obj, path: str, rename: bool = True) -> str:
    """``torch.save`` to a temporary file in the same folder (``files.temporary_name``), flushed to
    disk, then rename: a crash leaves either the old file or the new one, never half of one.
    Returns the sha256 of the bytes written. ``rename=False``: the file stays at
    ``files.temporary_name(path, unique=False)``, for the caller to rename (a checkpoint's files,
    once every one of them is written and listed in its manifest)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    blob = buffer.getbuffer()
    tmp = files.temporary_name(path, unique=rename)
    with files.writing(path, tmp):  # a full disk: the temporary file removed, one sentence
        with files.create(tmp) as f:  # never through a link (files.py); the rename replaces one
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        if rename:
            os.replace(tmp, path)
    return hashlib.sha256(blob).hexdigest()


# ----------------------------------------------------------------------------------------------
# Batches: which samples, and BERT's masking


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(_mix(seed, 0x5EED, epoch))
    return torch.randperm(n, generator=g)


def _mix(*values: int) -> int:
    """A 63-bit seed from several integers (``hash`` of a tuple is not stable across versions)."""
    h = hashlib.sha256(repr(tuple(int(v) for v in values)).encode()).digest()
    return int.from_bytes(h[:8], "big") >> 1


def global_batch_indices(step: int, global_batch: int, num_samples: int, seed: int) -> torch.Tensor:
    """Indices of the ``global_batch`` training samples of optimizer step ``step`` (0-based): the
    samples are taken in order from a fresh permutation of the training set each epoch."""
    k = torch.arange(step * global_batch, (step + 1) * global_batch)
    epochs, pos = k // num_samples, k % num_samples
    out = torch.empty_like(k)
    for e in epochs.unique().tolist():
        sel = epochs == e
        out[sel] = _epoch_order(num_samples, seed, e)[pos[sel]]
    return out


def mask_tokens(tokens: torch.Tensor, generator: torch.Generator, vocab_size: int,
                mask_prob: float = 0.15) -> Tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: each non-special token is selected with probability ``mask_prob``; a
    selected token becomes ``[MASK]`` (80%), a random non-special token (10%) or stays (10%).
    Returns ``(input_ids, labels)`` as int64, with ``labels = IGNORE_INDEX`` where not selected."""
    tokens = tokens.long()
    u_select = torch.rand(tokens.shape, generator=generator)
    u_kind = torch.rand(tokens.shape, generator=generator)
    random_ids = torch.randint(NUM_SPECIAL, vocab_size, tokens.shape, generator=generator)
    selected = (u_select < mask_prob) & (tokens >= NUM_SPECIAL)
    labels = torch.where(selected, tokens, torch.full_like(tokens, IGNORE_INDEX))
    inputs = tokens.clone()
    inputs[selected & (u_kind < 0.8)] = MASK_ID
    swap = selected & (u_kind >= 0.8) & (u_kind < 0.9)
    inputs[swap] = random_ids[swap]
    return inputs, labels


def rank_batch(corpus: Corpus, step: int, rank: int, world_size: int, global_batch: int, seed: int,
               mask_prob: float = 0.15) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of global batch ``step``: ``(input_ids, labels)`` of shape
    ``(global_batch // world_size, seq_len)``. The whole global batch is masked from one generator
    seeded by ``(seed, step)`` and then sliced, so the data do not depend on the number of workers."""
    if global_batch % world_size:
        raise ValueError(f"global batch {global_batch} is not divisible by {world_size} workers")
    idx = global_batch_indices(step, global_batch, len(corpus.train), seed)
    g = torch.Generator().manual_seed(_mix(seed, 0xA5C, step))
    inputs, labels = mask_tokens(corpus.train[idx], g, corpus.vocab_size, mask_prob)
    per = global_batch // world_size
    return inputs[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per]


def eval_batch(corpus: Corpus, num_samples: int, seed: int, mask_prob: float = 0.15) -> Tuple[torch.Tensor, torch.Tensor]:
    """A fixed held-out set: ``num_samples`` held-out sequences with fixed masks (the same at
    every evaluation and for every optimizer)."""
    n = min(num_samples, len(corpus.heldout))
    g = torch.Generator().manual_seed(_mix(seed, 0xE7A1))
    idx = torch.randperm(len(corpus.heldout), generator=g)[:n]
    return mask_tokens(corpus.heldout[idx], g, corpus.vocab_size, mask_prob)
