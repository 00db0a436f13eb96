"""The pretraining example's data: corpus split, tokenizer, blocks, batches and BERT masking."""
import os
import sys

import pytest
import torch

from onebitlamb.train import data
from onebitlamb.train.model import ModelConfig, build_model, mlm_loss


def _docs(n):
    return [data.Document(f"dir/file{i:03d}.txt", f"text number {i} " * 20) for i in range(n)]


def test_split_is_deterministic_disjoint_and_order_free():
    docs = _docs(200)
    train, held = data.split_documents(docs, 0.1)
    train2, held2 = data.split_documents(list(reversed(docs)), 0.1)
    assert [d.name for d in train] == [d.name for d in train2]
    assert [d.name for d in held] == [d.name for d in held2]
    names_t, names_h = {d.name for d in train}, {d.name for d in held}
    assert not names_t & names_h
    assert names_t | names_h == {d.name for d in docs}
    assert 5 <= len(held) <= 40  # about 10% of 200
    # a document's side depends on its name only, not on which other documents exist
    train3, held3 = data.split_documents(docs[:100], 0.1)
    assert {d.name for d in held3} == {d.name for d in held if d.name in {x.name for x in docs[:100]}}


def test_split_small_corpus_has_both_sides():
    train, held = data.split_documents(_docs(3), 0.01)
    assert len(held) == 1 and len(train) == 2
    train, held = data.split_documents(_docs(3), 0.99)
    assert len(train) >= 1 and len(held) >= 1
    with pytest.raises(ValueError):
        data.split_documents(_docs(1), 0.1)


def test_stdlib_corpus_and_split_by_file():
    docs = data.stdlib_documents()
    names = [d.name for d in docs]
    assert len(names) == len(set(names)) > 100
    assert any(n.startswith("stdlib/") for n in names) and any(n.startswith("topic/") for n in names)
    assert not any("/test/" in n or "site-packages" in n for n in names)
    train, held = data.split_documents(docs, 0.05)
    assert {d.name for d in train}.isdisjoint({d.name for d in held})
    assert 0.01 < len(held) / len(docs) < 0.15


def test_path_documents(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("more text")
    (tmp_path / "bin.dat").write_bytes(b"\0\1\2")
    (tmp_path / ".hidden").write_text("secret")
    docs = data.path_documents([str(tmp_path)])
    base = os.path.basename(str(tmp_path))
    assert sorted(d.name for d in docs) == [f"{base}/a.txt", f"{base}/sub/b.md"]
    with pytest.raises(FileNotFoundError):
        data.path_documents([str(tmp_path / "missing")])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import email

    cache = tmp_path_factory.mktemp("cache")
    root = os.path.dirname(email.__file__)
    c = data.prepare_corpus([root], 512, 32, 0.1, str(cache), log=lambda *a: None)
    return c, root, str(cache)


def test_prepare_corpus_blocks_and_cache(corpus):
    c, root, cache = corpus
    for blocks in (c.train, c.heldout):
        assert blocks.dtype == torch.int32 and blocks.shape[1] == 32 and len(blocks) > 0
        assert (blocks[:, 0] == data.CLS_ID).all() and (blocks[:, -1] == data.SEP_ID).all()
        assert (blocks[:, 1:-1] != data.CLS_ID).all() and (blocks >= 0).all() and (blocks < 512).all()
        assert (blocks != data.PAD_ID).all()  # no padding: the stream is cut into full blocks
    again = data.prepare_corpus([root], 512, 32, 0.1, cache, log=lambda *a: pytest.fail("re-tokenized"))
    assert torch.equal(again.train, c.train) and torch.equal(again.heldout, c.heldout)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(cache, os.listdir(cache)[0], "tokenizer.json"))
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    assert [i for _, i in vocab] == list(range(512))  # canonical ids, whatever the trainer's hash order
    assert tokens[:data.NUM_SPECIAL] == data.SPECIAL_TOKENS and tokens[data.NUM_SPECIAL:] == sorted(tokens[5:])
    assert tok.encode("[CLS] def [MASK] x").ids[0] == data.CLS_ID


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this creates the marker file
        return exec, (f"open({self.marker!r}, 'w').close()",)


def test_the_cache_is_read_as_plain_data_and_a_planted_one_runs_no_code(corpus, tmp_path):
    import shutil

    c, root, cache = corpus
    planted = tmp_path / "cache"
    shutil.copytree(cache, planted)
    blocks = planted / os.listdir(cache)[0] / "blocks.pt"
    saved = torch.load(blocks, weights_only=True)  # what the cache holds is plain data
    assert set(saved) == {"train", "heldout", "info"}
    marker = tmp_path / "planted-code-ran"
    torch.save({**saved, "info": _Payload(str(marker))}, blocks)
    with pytest.raises(ValueError, match="blocks.pt.*plain data.*delete"):
        data.prepare_corpus([root], 512, 32, 0.1, str(planted), log=lambda *a: None)
    assert not marker.exists()
    blocks.write_bytes(blocks.read_bytes()[:100])  # a damaged one: the same clear error, no EOFError
    with pytest.raises(ValueError, match="blocks.pt.*plain data"):
        data.prepare_corpus([root], 512, 32, 0.1, str(planted), log=lambda *a: None)


def test_builtin_module_help_leaves_out_the_values_of_the_process():
    docs = {d.name: d.text for d in data._builtin_module_docs()}
    assert "builtin/sys" in docs and "exc_info(" in docs["builtin/sys"]  # its functions are documented
    assert sys.argv[0] not in docs["builtin/sys"] and "argv =" not in docs["builtin/sys"]
    assert "\nDATA\n" not in docs["builtin/sys"] and "\nFUNCTIONS\n" in docs["builtin/sys"]


def _vocabulary_of_a_tied_corpus(_rank, _n):
    """Every ordered pair of 8 letters followed by x, y or z, each word equally often: the
    vocabulary's cut-off falls among merges that all tie, the case the trainer used to break in
    hash-map order."""
    import itertools
    import string

    words = ["".join(p) + q for p in itertools.permutations(string.ascii_lowercase[:8], 2) for q in "xyz"]
    tok = data.train_tokenizer([" ".join(words)] * 3, 60)
    return sorted(tok.get_vocab().items())


def test_the_same_texts_give_the_same_vocabulary_in_every_process():
    """In separate processes (each with its own hash seeds) the trainer alone chose different
    merges on this corpus nearly every time; train_tokenizer must not."""
    from rank_pool import run_ranks

    first, *others = run_ranks(_vocabulary_of_a_tied_corpus, 3, (), timeout_s=120)
    assert len(first) == 60 and all(vocab == first for vocab in others)
    tokens = dict(first)
    assert "##a" in tokens and "##x" in tokens
    tok = data.train_tokenizer(["ab ab [MASK] ##x"], 40)
    assert tok.encode("ab ##x").tokens == ["ab", "#", "#", "x"]  # the pieces are no special tokens


def test_mask_tokens_rate_and_special_tokens():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(data.NUM_SPECIAL, 1000, (256, 64))
    tokens[:, 0], tokens[:, -1], tokens[:, 10] = data.CLS_ID, data.SEP_ID, data.SEP_ID
    tokens[:, 20] = data.UNK_ID
    inputs, labels = data.mask_tokens(tokens, g, 1000, 0.15)
    assert inputs.shape == labels.shape == tokens.shape and inputs.dtype == labels.dtype == torch.int64
    selected = labels != data.IGNORE_INDEX
    special = tokens < data.NUM_SPECIAL
    assert not (selected & special).any()  # special tokens never masked
    assert torch.equal(inputs[special], tokens[special])
    assert torch.equal(labels[selected], tokens[selected])  # labels are the original tokens
    assert torch.equal(inputs[~selected], tokens[~selected])  # unselected positions untouched
    rate = selected.sum().item() / (~special).sum().item()
    assert abs(rate - 0.15) < 0.01
    n = selected.sum().item()
    masked = (inputs == data.MASK_ID) & selected
    kept = (inputs == tokens) & selected
    assert abs(masked.sum().item() / n - 0.8) < 0.03
    assert abs(kept.sum().item() / n - 0.1) < 0.03  # (+ the rare random draw of the same token)
    replaced = selected & ~masked & ~kept
    assert (inputs[replaced] >= data.NUM_SPECIAL).all()  # random replacements are never special


def test_rank_batches_are_shards_of_one_global_batch(corpus):
    c, _, _ = corpus
    full_in, full_lab = data.rank_batch(c, 3, 0, 1, 16, seed=7)
    parts = [data.rank_batch(c, 3, r, 4, 16, seed=7) for r in range(4)]
    assert all(p[0].shape == (4, 32) for p in parts)
    assert torch.equal(torch.cat([p[0] for p in parts]), full_in)
    assert torch.equal(torch.cat([p[1] for p in parts]), full_lab)
    again = data.rank_batch(c, 3, 2, 4, 16, seed=7)
    assert torch.equal(again[0], parts[2][0]) and torch.equal(again[1], parts[2][1])
    other = data.rank_batch(c, 4, 2, 4, 16, seed=7)
    assert not torch.equal(other[0], parts[2][0])
    with pytest.raises(ValueError):
        data.rank_batch(c, 0, 0, 3, 16, seed=7)


def test_global_batches_cover_an_epoch_without_repeats():
    n, gb = 50, 8
    idx = torch.cat([data.global_batch_indices(s, gb, n, seed=1) for s in range(12)])  # 96 samples
    assert sorted(idx[:n].tolist()) == list(range(n))  # epoch 0 is a permutation
    assert len(set(idx[n:].tolist())) == len(idx) - n  # epoch 1 (begun) repeats nothing
    assert not torch.equal(idx[:len(idx) - n], idx[n:])  # a fresh order each epoch
    assert torch.equal(data.global_batch_indices(5, gb, n, 1), data.global_batch_indices(5, gb, n, 1))


def test_eval_batch_is_fixed(corpus):
    c, _, _ = corpus
    a = data.eval_batch(c, 20, seed=3)
    b = data.eval_batch(c, 20, seed=3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[0].shape == (20, 32)


def test_mlm_loss_matches_transformers_loss():
    cfg = ModelConfig(vocab_size=300, seq_len=16, hidden=32, layers=1, heads=2, intermediate=64)
    model = build_model(cfg, seed=0)
    same = build_model(cfg, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), same.parameters()))
    tokens = torch.randint(data.NUM_SPECIAL, 300, (4, 16))
    inputs, labels = data.mask_tokens(tokens, torch.Generator().manual_seed(1), 300, 0.3)
    ours = mlm_loss(model, inputs, labels)
    ref = model(input_ids=inputs, labels=labels).loss
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
