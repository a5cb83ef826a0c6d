"""geotrain data prepare (training.data.prepare), its tokenizers (training.data.tokenizer)
and the loaders that read prepared shards (training.data.tokens)."""

from __future__ import annotations

import gzip
import json
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import zstandard
from click.testing import CliRunner

from geotrain.cli import cli
from training.data.prepare import prepare
from training.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from training.data.tokens import MixtureLoader, TokenLoader
from training.errors import DataError, OutputError

WORDS = ["alpha", "beta", "gamma", "delta", "zeta", "région", "naïve", "東京", "l'été\tfin"]


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
        + rng.choice(["", "\n", "\n\nfin."])
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer (vocab ~300) trained here on generated text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(make_docs(300, seed=1), trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def bpe(tok_file: Path) -> HFTokenizer:
    tok = load_tokenizer(tok_file)
    assert isinstance(tok, HFTokenizer)
    return tok


def write_corpus(root: Path, fmt: str, docs: list[str], field: str = "text") -> Path:
    """`docs` in format `fmt`; returns the input to give prepare."""
    root.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs))
    if fmt == "txt":  # a directory of text files, one document each
        for i, d in enumerate(docs):
            sub = root / "corpus" / f"part{i % 3}"
            sub.mkdir(parents=True, exist_ok=True)
            (sub / f"{i:04d}.txt").write_text(d, encoding="utf-8", newline="")
        return root / "corpus"
    path = root / f"c.{fmt}"
    if fmt == "jsonl":
        path.write_text(lines, encoding="utf-8")
    elif fmt == "jsonl.gz":
        path.write_bytes(gzip.compress(lines.encode()))
    elif fmt == "jsonl.zst":  # two frames: a reader must not stop after the first
        half = len(lines) // 2
        c = zstandard.ZstdCompressor()
        path.write_bytes(c.compress(lines[:half].encode()) + c.compress(lines[half:].encode()))
    elif fmt == "parquet":
        table = pa.table({"id": list(range(len(docs))), field: docs})
        pq.write_table(table, path, row_group_size=50)
    return path


def split_docs(out: Path, tok: HFTokenizer | ByteTokenizer, files: list[str]) -> list[str]:
    ids: list[int] = []
    for f in files:
        ids += np.fromfile(out / f, dtype="<u2").tolist()
    docs, cur = [], []
    for i in ids:
        if i == tok.eos_id:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(i)
    assert not cur, "every document ends with the end token"
    return docs


# ---- tokenizers: one contract, every implementation


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_every_tokenizer_round_trips_text_and_keeps_ids_inside_its_vocab(kind, tok_file):
    tok = load_tokenizer(None if kind == "bytes" else tok_file)
    docs = make_docs(20)
    encoded = tok.encode_batch(docs)
    assert [tok.decode(ids) for ids in encoded] == docs
    assert all(0 <= i < tok.vocab_size for ids in encoded for i in ids)
    assert tok.eos_id is None or 0 <= tok.eos_id < tok.vocab_size
    assert len(tok.digest) == 64 or tok.digest == "bytes"


def test_tokenizer_digest_is_the_sha256_of_tokenizer_json_and_a_model_dir_names_eos(
    tmp_path, tok_file
):
    import hashlib

    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_bytes(tok_file.read_bytes())
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "l"}}))
    tok = load_tokenizer(model)
    assert tok.digest == hashlib.sha256(tok_file.read_bytes()).hexdigest()
    assert tok.eos_id == HFTokenizer(tok_file, "l").eos_id != load_tokenizer(tok_file).eos_id
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)


@pytest.mark.parametrize("case", ["missing", "dir without json", "not a tokenizer"])
def test_a_bad_tokenizer_ref_is_one_data_error_naming_it(tmp_path, case):
    ref = tmp_path / "tok"
    if case == "dir without json":
        ref.mkdir()
    elif case == "not a tokenizer":
        ref.write_text("{not json")
    with pytest.raises(DataError, match="--tokenizer bytes") as e:
        load_tokenizer(ref)
    assert str(ref) in str(e.value) and "\n" not in str(e.value)


# ---- prepare


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "jsonl.gz", "jsonl.zst", "parquet"])
def test_prepare_round_trips_every_format_into_train_and_eval(tmp_path, bpe, fmt):
    docs = make_docs(120)
    src = write_corpus(tmp_path / "in", fmt, docs)
    m = prepare([src], tmp_path / "out", bpe, eval_fraction=0.2, shard_tokens=500)
    out = tmp_path / "out"
    train = split_docs(out, bpe, [s["file"] for s in m["shards"]])
    held = split_docs(out, bpe, [s["file"] for s in m["eval"]])
    assert Counter(train + held) == Counter(docs)
    assert 5 <= len(held) <= 50 and m["documents"] == {"train": len(train), "eval": len(held)}
    assert m["dtype"] == "uint16" and m["tokenizer"]["digest"] == bpe.digest
    assert all(s["tokens"] <= 500 for s in m["shards"]) and len(m["shards"]) > 1
    assert m["tokens"]["train"] == sum(s["tokens"] for s in m["shards"])
    assert json.loads((out / "manifest.json").read_text()) == m
    assert sum(i["documents"] for i in m["inputs"]) == len(docs)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir()), "no temp dir left"


def test_eval_choice_is_reproducible_by_seed_and_moves_with_it(tmp_path, bpe):
    src = write_corpus(tmp_path / "in", "jsonl", make_docs(200))
    runs = [
        prepare([src], tmp_path / f"o{i}", bpe, eval_fraction=0.1, seed=seed)
        for i, seed in enumerate([0, 0, 1])
    ]
    assert runs[0]["eval"] == runs[1]["eval"] and runs[0]["shards"] == runs[1]["shards"]
    assert runs[0]["eval"] != runs[2]["eval"]
    nothing_held = prepare([src], tmp_path / "o3", bpe, eval_fraction=0.0)
    assert nothing_held["eval"] == [] and nothing_held["documents"]["eval"] == 0


class WideTokenizer(ByteTokenizer):
    """Bytes shifted past 65535: ids that need uint32."""

    vocab_size = 70_000
    digest = "wide"
    eos_id: int | None = 69_999

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [[65_600 + b for b in t.encode()] for t in texts]


def test_token_dtype_is_uint16_up_to_65536_ids_and_uint32_past(tmp_path, bpe):
    src = write_corpus(tmp_path / "in", "jsonl", make_docs(10))
    m = prepare([src], tmp_path / "wide", WideTokenizer(), eval_fraction=0)
    assert m["dtype"] == "uint32"
    shard = tmp_path / "wide" / m["shards"][0]["file"]
    assert shard.stat().st_size == 4 * m["tokens"]["train"]
    assert np.fromfile(shard, dtype="<u4").min() >= 65_600
    assert prepare([src], tmp_path / "narrow", bpe)["dtype"] == "uint16"


def test_an_existing_prepared_dir_is_kept_unless_overwrite_and_foreign_dirs_never_replaced(
    tmp_path, bpe
):
    src = write_corpus(tmp_path / "in", "jsonl", make_docs(30))
    out = tmp_path / "out"
    first = prepare([src], out, bpe, seed=0, eval_fraction=0.3)
    with pytest.raises(OutputError, match="--overwrite"):
        prepare([src], out, bpe, seed=1, eval_fraction=0.3)
    assert json.loads((out / "manifest.json").read_text()) == first
    second = prepare([src], out, bpe, seed=1, eval_fraction=0.3, overwrite=True)
    assert json.loads((out / "manifest.json").read_text()) == second != first
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="never replaced"):
        prepare([src], foreign, bpe, overwrite=True)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_a_failure_midway_leaves_the_old_prepared_dir_and_no_temp_files(tmp_path, bpe):
    good = write_corpus(tmp_path / "in", "jsonl", make_docs(30))
    out = tmp_path / "out"
    first = prepare([good], out, bpe)
    bad = tmp_path / "in" / "z.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"z\.jsonl:2"):
        prepare([good, bad], out, bpe, overwrite=True)
    assert json.loads((out / "manifest.json").read_text()) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]


def bad_input(tmp_path: Path, case: str) -> tuple[Path, str]:
    """(input, what the error must say besides its path)."""
    p = tmp_path / {"parquet": "t.parquet", "ext": "t.csv", "empty": "t.txt"}.get(case, "t.jsonl")
    if case == "parquet":
        pq.write_table(pa.table({"body": ["x"], "id": [1]}), p)
        return p, "columns: body, id"
    if case == "ext":
        p.write_text("a,b\n")
        return p, "unsupported file type"
    if case == "empty":
        p.write_text("")
        return p, "no training tokens"
    if case == "unreadable":
        p.symlink_to(tmp_path / "gone.jsonl")
        return p, "cannot read"
    if case == "corrupt gz":
        p = tmp_path / "t.jsonl.gz"
        p.write_bytes(gzip.compress(b'{"text": "abc"}\n' * 50)[:-20])
        return p, "truncated or corrupt"
    if case in ("corrupt zst", "truncated zst"):
        p = tmp_path / "t.jsonl.zst"
        whole = zstandard.ZstdCompressor().compress(b'{"text": "abc"}\n' * 50)
        p.write_bytes(whole[:-5] if case == "truncated zst" else b"garbage" + whole)
        return p, "zstd"
    body, said = {
        "not json": ('{"text": "ok"}\n{"text": \n', "t.jsonl:2: not JSON"),
        "no field": ('{"text": "ok"}\n\n{"body": "x"}\n', "t.jsonl:3: no field 'text'"),
        "not str": ('{"text": ["x"]}\n', "t.jsonl:1: field 'text' is a list"),
        "not object": ('["x"]\n', "t.jsonl:1: no field"),
    }[case]
    p.write_text(body)
    return p, said


@pytest.mark.parametrize(
    "case",
    [
        "parquet",
        "ext",
        "empty",
        "unreadable",
        "corrupt gz",
        "corrupt zst",
        "truncated zst",
        "not json",
        "no field",
        "not str",
        "not object",
    ],
)
def test_every_bad_input_is_one_data_error_line_naming_the_file(tmp_path, bpe, case):
    path, said = bad_input(tmp_path, case)
    with pytest.raises(DataError) as e:
        prepare([path], tmp_path / "out", bpe)
    msg = str(e.value)
    assert str(path) in msg and said in msg and "\n" not in msg, msg
    assert not (tmp_path / "out").exists()


def test_a_missing_input_and_an_empty_directory_are_refused(tmp_path, bpe):
    with pytest.raises(DataError, match="no such file"):
        prepare([tmp_path / "nope.jsonl"], tmp_path / "out", bpe)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no files"):
        prepare([tmp_path / "empty"], tmp_path / "out", bpe)


# ---- loaders


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, bpe) -> Path:
    root = tmp_path_factory.mktemp("prepared")
    src = write_corpus(root / "in", "jsonl", make_docs(400))
    prepare([src], root / "out", bpe, eval_fraction=0.1, shard_tokens=3000)
    return root / "out"


def test_token_loader_memory_maps_its_shards_read_only(prepared):
    loader = TokenLoader(f"tokens:{prepared}", 4, 32, seed=0)
    assert len(loader.maps) > 1
    assert all(isinstance(m, np.memmap) and m.mode == "r" for m in loader.maps)
    batch = loader.next()
    assert batch.shape == (4, 33) and batch.dtype == torch.int64 and loader.drawn == 1


def test_token_loader_resumes_bitwise_from_its_state_dict(prepared):
    a = TokenLoader(prepared, 8, 32, seed=5)
    for _ in range(3):
        a.next()
    state = a.state_dict()
    after = [a.next() for _ in range(4)]
    b = TokenLoader(prepared, 8, 32, seed=99)
    b.load_state_dict(state)
    assert b.drawn == 3
    assert all(torch.equal(x, b.next()) for x in after)
    other = TokenLoader(prepared, 8, 32, seed=6)
    assert not torch.equal(other.next(), TokenLoader(prepared, 8, 32, seed=5).next())


def test_windows_never_cross_a_shard_boundary(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "ab.txt").write_text("a" * 1000 + "b" * 1000 + "c" * 50)
    prepare(
        [tmp_path / "in"], tmp_path / "out", ByteTokenizer(), eval_fraction=0, shard_tokens=1000
    )
    loader = TokenLoader(tmp_path / "out", 64, 99, seed=0)  # the 50-token shard is too short
    rows = torch.cat([loader.next() for _ in range(20)])
    assert all(len(set(r.tolist())) == 1 for r in rows)
    assert {r[0].item() for r in rows} == {ord("a"), ord("b")}
    with pytest.raises(DataError, match=r"train-00000.bin holds 1000 tokens.*seq_len \+ 1 = 1001"):
        TokenLoader(tmp_path / "out", 1, 1000, seed=0)


def test_eval_batches_cover_the_eval_split_in_order(prepared):
    loader = TokenLoader(prepared, 4, 16, seed=0)
    held = np.concatenate([np.fromfile(s.path, dtype="<u2") for s in loader.data.eval]).astype(
        np.int64
    )
    rows = torch.cat(list(loader.eval_batches()))
    assert all(b.shape[0] <= 4 for b in loader.eval_batches())
    assert torch.equal(rows[0], torch.from_numpy(held[:17]))
    assert torch.equal(
        rows[:, 1:].flatten()[: len(held) // 2], torch.from_numpy(held[1:])[: len(held) // 2]
    )


def test_a_flipped_byte_or_a_truncated_shard_is_refused(prepared, tmp_path):
    import shutil

    for damage in ("flip", "truncate"):
        copy = tmp_path / damage
        shutil.copytree(prepared, copy)
        shard = copy / "train-00001.bin"
        raw = bytearray(shard.read_bytes())
        if damage == "flip":
            raw[7] ^= 0x01
        else:
            raw = raw[:-2]
        shard.write_bytes(bytes(raw))
        said = "sha256" if damage == "flip" else "truncated"
        with pytest.raises(DataError, match=said) as e:
            TokenLoader(copy, 2, 8, seed=0)
        assert str(shard) in str(e.value)


def test_a_manifest_naming_a_file_outside_its_directory_is_refused(prepared, tmp_path):
    import shutil

    copy = tmp_path / "p"
    shutil.copytree(prepared, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["shards"][0]["file"] = "../../etc/passwd"
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DataError, match="malformed"):
        TokenLoader(copy, 2, 8, seed=0)
    with pytest.raises(DataError, match=r"no manifest\.json"):
        TokenLoader(tmp_path, 2, 8, seed=0)


def test_check_tokenizer_accepts_the_preparing_digest_and_refuses_another(prepared, bpe):
    loader = TokenLoader(prepared, 2, 8, seed=0)
    loader.check_tokenizer(bpe.digest, vocab_size=bpe.vocab_size)
    with pytest.raises(DataError, match=r"prepared with tokenizer \w+, the model's is bytes"):
        loader.check_tokenizer("bytes")
    with pytest.raises(DataError, match="vocab"):
        loader.check_tokenizer(bpe.digest, vocab_size=bpe.vocab_size - 1)


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mix")
    for name, letters in (("lo", "abcdefghijklm"), ("hi", "nopqrstuvwxyz")):
        (root / name).mkdir()
        (root / name / "t.txt").write_text("".join(random.Random(0).choices(letters, k=5000)))
        prepare([root / name], root / f"{name}-out", ByteTokenizer(), eval_fraction=0)
    return root / "lo-out", root / "hi-out"


def test_mixture_draws_sources_by_weight_and_resumes_bitwise(two_sources):
    def mix(weights: tuple[float, float], seed: int = 3) -> MixtureLoader:
        pairs = zip(two_sources, weights, strict=True)
        sources = [(TokenLoader(p, 1, 16, seed=0), w) for p, w in pairs]
        return MixtureLoader(sources, batch=16, seed=seed)

    m = mix((3.0, 1.0))
    rows = torch.cat([m.next() for _ in range(100)])
    from_lo = (rows[:, 0] <= ord("m")).float().mean().item()
    assert 0.70 < from_lo < 0.80
    assert all(len({c <= ord("m") for c in r.tolist()}) == 1 for r in rows), "one source a row"
    only_hi = torch.cat([mix((0.0, 1.0)).next() for _ in range(5)])
    assert (only_hi > ord("m")).all()
    state = m.state_dict()
    after = [m.next() for _ in range(3)]
    again = mix((3.0, 1.0), seed=7)
    again.load_state_dict(state)
    assert all(torch.equal(x, again.next()) for x in after)
    with pytest.raises(DataError, match="weights"):
        mix((0.0, 0.0))


# ---- CLI


def test_cli_prepare_then_inspect_and_a_bad_input_exits_2_with_one_line(tmp_path, tok_file):
    src = write_corpus(tmp_path / "in", "jsonl.zst", make_docs(50))
    out = tmp_path / "out"
    runner = CliRunner()
    args = ["data", "prepare", "--tokenizer", str(tok_file), "--out", str(out), str(src)]
    r = runner.invoke(cli, args)
    assert r.exit_code == 0, r.output
    assert r.output.count("\n") == 1 and "train tokens" in r.output and "uint16" in r.output
    r = runner.invoke(cli, ["data", "inspect", str(out)])
    assert r.exit_code == 0 and "verified" in r.output and "c.jsonl.zst" in r.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text("nope\n")
    r = runner.invoke(cli, [*args[:5], str(tmp_path / "o2"), str(bad)])
    assert r.exit_code == 2
    assert r.stderr.count("\n") == 1 and "bad.jsonl:1: not JSON" in r.stderr
    (out / "train-00000.bin").write_bytes(b"\x00\x00")
    r = runner.invoke(cli, ["data", "inspect", str(out)])
    assert r.exit_code == 2 and r.stderr.startswith("geotrain: error: shard ")
