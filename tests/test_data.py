"""Data, in-process: the test corpus generator's bytes, packing, the loader's order, the sources."""

import dataclasses
import hashlib
import json
from types import SimpleNamespace

import numpy as np
import pytest

from common import data
from common.config import ConfigError, OptimizerOptions, parse
from synthetic import corpus_file, save_bos_tokenizer, synthetic_documents
from train_extras.observe.metrics import bigram_entropy
from train_extras.options import TrainConfig


pytestmark = pytest.mark.quick  # launches nothing: docs/testing.md#running-the-tests

# sha256 of the first 4096 bytes of the default corpus (8000 documents, generator v1). The
# generator uses only random.Random(0).random(), so this holds on every Python and platform.
FIRST_4096_BYTES_SHA256 = "0ba11ed34f1900bcae1f73ece679965350e0febae127edf9071355b3b9553f85"
SYNTHETIC_FILE = corpus_file(200)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """Keep datasets' cache (and ours under it) in a temp folder."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    return tmp_path


def test_generator_bytes_are_pinned():
    text = "".join(synthetic_documents(8000))
    assert text.startswith("imslhtx dfuivc clpx rsxqjn. fjtvxer mko sovoz")
    assert hashlib.sha256(text[:4096].encode()).hexdigest() == FIRST_4096_BYTES_SHA256
    assert synthetic_documents(3) == synthetic_documents(3)


def test_pack_into_blocks_loses_and_duplicates_nothing():
    stream = np.arange(1003)
    blocks = data.pack_into_blocks(stream, 10)
    assert blocks.shape == (100, 10)
    assert np.array_equal(blocks.reshape(-1), stream[:1000])  # in order, each token once
    assert len(stream) - blocks.size < 10  # only the final partial block is dropped


def test_packed_blocks_shift_labels_by_one():
    ds = data.PackedBlocks(np.arange(50, dtype=np.uint16), seq_len=4)
    assert len(ds) == 10
    item = ds[3]
    assert item["input_ids"].tolist() == [15, 16, 17, 18]
    assert item["labels"].tolist() == [16, 17, 18, 19]


def test_epoch_sampler_depends_on_seed_and_epoch_only():
    import torch

    sampler = data.EpochShuffleSampler(100, seed=7)
    first = list(sampler)
    torch.manual_seed(999)  # the global RNG (restored by load_state) must not matter
    assert list(sampler) == first and sorted(first) == list(range(100))
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first and sorted(second) == list(range(100))
    assert list(data.EpochShuffleSampler(100, seed=8)) != first


def test_bigram_entropy_by_hand():
    # pairs: after 0 always 1 (3 times, entropy 0); after 1: 1 twice, 0 three times.
    # H = P(prev=1) * H(2/5, 3/5) = 5/8 * -(0.4 ln 0.4 + 0.6 ln 0.6)
    stream = np.array([0, 1, 1, 0, 1, 0, 1, 1, 0])
    expected = 5 / 8 * -(0.4 * np.log(0.4) + 0.6 * np.log(0.6))
    assert bigram_entropy(stream) == pytest.approx(expected)
    assert bigram_entropy(np.array([3, 3, 3, 3])) == pytest.approx(0.0)


def test_byte_tokenizer_roundtrip():
    tokenizer = data.build_tokenizer(TrainConfig())
    ids = tokenizer("héllo", add_special_tokens=False)["input_ids"]
    assert len(ids) == len("héllo".encode())  # one id per byte
    assert tokenizer.decode(ids) == "héllo"
    assert len(tokenizer) == 259 and tokenizer.eos_token_id is not None


def test_synthetic_split_and_cache(hf_cache):
    cfg = TrainConfig(data_files=[corpus_file(200)], seq_len=32)
    tokenizer = data.build_tokenizer(cfg)
    train, held_out = data.build_datasets(cfg, tokenizer)
    text = "".join(synthetic_documents(200))
    # every byte plus one EOS per document, split between the two streams
    total = len(text.encode()) + 200
    streams = sorted((hf_cache / "datasets" / "accelerate_recipes" / "streams").iterdir())
    assert sum(np.memmap(p, dtype=np.uint16, mode="r").size for p in streams) == total
    assert len(train) > 10 * len(held_out) > 0


def test_local_text_and_jsonl_files(hf_cache, tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("first paragraph\nstill first\n\nsecond paragraph\n")
    cfg = TrainConfig(data_files=[str(txt)])
    assert data.load_documents(cfg)["text"] == ["first paragraph\nstill first", "second paragraph\n"]
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text("\n".join(json.dumps({"body": f"doc {i}", "id": i}) for i in range(5)))
    docs = data.load_documents(TrainConfig(data_files=[str(jsonl)], text_column="body"))
    assert docs.column_names == ["text"] and docs["text"][4] == "doc 4"


def test_dataset_name_loads_a_local_dataset_folder(hf_cache, tmp_path):
    folder = tmp_path / "my_dataset"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(json.dumps({"text": f"row {i}"}) for i in range(4)))
    docs = data.load_documents(TrainConfig(dataset_name=str(folder)))
    assert docs["text"] == [f"row {i}" for i in range(4)]


def test_source_errors(hf_cache, tmp_path):
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"text": ""}\n{"text": "   "}\n')
    with pytest.raises(ConfigError, match="dataset is empty"):
        data.load_documents(TrainConfig(data_files=[str(blank)]))
    with pytest.raises(ConfigError, match="no column 'body'"):
        data.load_documents(TrainConfig(data_files=[str(blank)], text_column="body"))
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("one\n\ntwo\n")
    cfg = TrainConfig(data_files=[str(tiny)], seq_len=64)
    with pytest.raises(ConfigError, match="fewer than seq_len"):
        data.build_datasets(cfg, data.build_tokenizer(cfg))


@pytest.mark.parametrize("name, content, holds", [
    ("numbers.csv", "text,label\n1,0\n2,1\n3,0\n", "Value('int64')"),
    ("lists.jsonl", '{"text": ["a", "b"]}\n{"text": ["c"]}\n', "List(Value('string'))"),
])
def test_a_text_column_that_holds_no_text_is_one_line(hf_cache, tmp_path, name, content, holds):
    """A CSV whose text column is numbers, a JSONL whose text is a list: one line naming the file
    and the column, loaded or streamed (once an AttributeError, and nothing at all when streamed)."""
    from train_extras.data import at_scale

    path = tmp_path / name
    path.write_text(content)
    expected = f"{path}: column 'text' holds {holds}, not text: set --text_column"
    with pytest.raises(ConfigError) as err:
        data.load_documents(TrainConfig(data_files=[str(path)]))
    assert str(err.value) == expected
    cfg = parse(TrainConfig, ["--data_files", str(path), "--eval_data_files", str(path), "--streaming"],
                recipe="train.py")
    with pytest.raises(ConfigError, match=f"{path}: column 'text' holds (int|list) values, not text"):
        next(iter(at_scale.StreamedBlocks(cfg, data.build_tokenizer(cfg), 0, 1)))


def test_unpacked_documents_are_padded_with_ignored_labels(hf_cache, tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": "x" * n}) for n in (3, 10, 1, 7, 40, 5)))
    cfg = TrainConfig(data_files=[str(jsonl)], packing=False, seq_len=8, eval_fraction=0.2)
    tokenizer = data.build_tokenizer(cfg)
    train, held_out = data.build_datasets(cfg, tokenizer)
    assert len(train) + len(held_out) == 6
    targets = sorted(int((train[i]["labels"] != -100).sum()) for i in range(len(train)))
    for i in range(len(train)):
        row = train[i]
        n = int((row["labels"] != -100).sum())
        assert row["input_ids"].shape == row["labels"].shape == (8,)
        assert row["labels"][:n].tolist() == row["input_ids"][1:n].tolist() + [row["labels"][n - 1].item()]
        assert (row["labels"][n:] == -100).all() and (row["input_ids"][n:] == tokenizer.pad_token_id).all()
    assert len(set(targets)) > 1 and max(targets) == 8  # uneven rows; the 40-byte document is truncated


# ---- your data, your pretrained model's tokens (issue: the fine-tuning path) ----
def test_a_txt_file_splits_into_documents_by_paragraph_line_or_file(hf_cache, tmp_path):
    txt = tmp_path / "docs.txt"
    txt.write_text("one line\nanother line\n\nthird line\n")
    by = {unit: data.load_documents(TrainConfig(data_files=[str(txt)], txt_documents=unit))["text"]
          for unit in ("paragraph", "line", "file")}
    assert by["paragraph"] == ["one line\nanother line", "third line\n"]
    assert by["line"] == ["one line", "another line", "third line"]  # the blank line is no document
    assert by["file"] == ["one line\nanother line\n\nthird line\n"]


@pytest.fixture
def dataset_with_validation(tmp_path):
    """A local dataset folder with a train and a validation split (datasets names them by file)."""
    folder = tmp_path / "with_validation"
    folder.mkdir()
    docs = synthetic_documents(60)
    (folder / "train.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs[:53]))
    (folder / "validation.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs[53:]))
    return folder, docs[53:]


def test_eval_split_holds_out_the_datasets_own_validation_split(hf_cache, dataset_with_validation):
    folder, validation = dataset_with_validation
    cfg = TrainConfig(dataset_name=str(folder), eval_split="validation", packing=False, seq_len=64)
    train, held_out = data.build_datasets(cfg, data.build_tokenizer(cfg))
    assert (len(train), len(held_out)) == (53, 7)  # every train document trains; the held-out count is the split's
    packed = TrainConfig(dataset_name=str(folder), eval_split="validation", seq_len=64)
    _, held_out_blocks = data.build_datasets(packed, data.build_tokenizer(packed))
    tokens = sum(len(d.encode()) + 1 for d in validation)  # bytes + EOS of each validation document
    assert len(held_out_blocks) == tokens // 65
    with pytest.raises(ConfigError, match="cannot load dataset .*"):
        bad = TrainConfig(dataset_name=str(folder), eval_split="no_such_split")
        data.build_datasets(bad, data.build_tokenizer(bad))


def test_eval_data_files_are_the_held_out_set(hf_cache, tmp_path):
    train_file, eval_file = tmp_path / "train.txt", tmp_path / "eval.txt"
    docs = synthetic_documents(45)
    train_file.write_text("".join(docs[:40]))
    eval_file.write_text("".join(docs[40:]))
    cfg = TrainConfig(data_files=[str(train_file)], eval_data_files=[str(eval_file)], txt_documents="line",
                      packing=False, seq_len=64)
    train, held_out = data.build_datasets(cfg, data.build_tokenizer(cfg))
    assert (len(train), len(held_out)) == (40, 5)


@pytest.mark.parametrize("argv, message", [
    (["--eval_split", "validation"], "--eval_split goes with --dataset_name"),
    (["--data_files", SYNTHETIC_FILE, "--eval_data_files", "/no/such/file.txt"], "data file not found"),
    (["--dataset_name", "d", "--eval_split", "validation", "--eval_fraction", "0.1"], "--eval_fraction cuts"),
    (["--warmup_ratio", "1.5"], "--warmup_ratio must be in"),
    (["--eval_only"], "--eval_only evaluates --model_name_or_path or --resume_from_checkpoint"),
    (["--streaming"], "--streaming needs --data_files or --dataset_name"),
    (["--streaming", "--data_files", SYNTHETIC_FILE], "--streaming needs a held-out set of its own"),
    (["--dataset_num_proc", "0"], "--dataset_num_proc must be positive"),
    (["--txt_documents", "sentence"], "invalid choice"),
    (["--streaming", "--data_files", SYNTHETIC_FILE, "--eval_data_files", SYNTHETIC_FILE, "--packing_strategy",
      "best_fit"], "--streaming concatenates the stream into blocks: not with --packing_strategy best_fit"),
    (["--packing", "false", "--packing_strategy", "concatenate"], "--packing_strategy concatenate packs examples: "
                                                                   "not with --packing false"),
    (["--packing_strategy", "first_fit"], "invalid choice"),
])
def test_fine_tuning_and_data_options_refuse_what_cannot_work(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse(TrainConfig, argv, recipe="train.py")


def test_warmup_ratio_is_a_fraction_of_the_run():
    assert parse(TrainConfig, ["--max_steps", "10", "--warmup_ratio", "0.25"], recipe="train.py").warmup_steps == 2
    assert parse(TrainConfig, ["--max_steps", "300", "--warmup_ratio", "0.05"], recipe="train.py").warmup_steps == 15
    steps = parse(TrainConfig, ["--max_steps", "300", "--warmup_ratio", "0.05", "--warmup_steps", "7"],
                  recipe="train.py")
    assert steps.warmup_steps == 7  # given, the steps win over the ratio (a config file's, or the default)
    for max_steps in (100, 720, 5000):  # the default: a fixed share of the run, whatever its length
        default = TrainConfig(max_steps=max_steps)
        assert default.warmup_steps == round(OptimizerOptions.warmup_ratio * max_steps) > 0


def stream_of(cfg, tokenizer, num_proc=None):
    train, _ = data.build_datasets(cfg, tokenizer, num_proc)
    return np.asarray(train.blocks).reshape(-1)


def test_each_document_starts_with_bos_when_the_tokenizer_has_one(hf_cache, tmp_path):
    from transformers import AutoTokenizer

    corpus = tmp_path / "docs.txt"
    corpus.write_text("".join(synthetic_documents(30)))  # each ends with a newline
    tokenizer = AutoTokenizer.from_pretrained(save_bos_tokenizer(tmp_path / "bos_tokenizer"))
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    cfg = TrainConfig(data_files=[str(corpus)], txt_documents="line", eval_data_files=[str(corpus)], seq_len=16)
    stream = stream_of(cfg, tokenizer).tolist()
    texts = data.load_documents(cfg)["text"]  # one per line, as read
    assert len(texts) == 30
    # BOS, the document's own tokens, EOS: every document, back to back
    expected = [t for text in texts for t in [bos, *tokenizer(text, add_special_tokens=False).input_ids, eos]]
    assert stream == expected[: len(stream)] and len(expected) - len(stream) < 17
    assert stream[0] == bos and all(stream[i + 1] == bos for i, t in enumerate(stream[:-1]) if t == eos)
    no_bos = TrainConfig(data_files=[str(corpus)], txt_documents="line", eval_data_files=[str(corpus)], seq_len=16,
                         add_bos=False)
    assert bos not in stream_of(no_bos, tokenizer).tolist()
    # the byte tokenizer has no BOS: its documents are the bytes and EOS only, as before
    byte_cfg = TrainConfig(data_files=[str(corpus)], txt_documents="line", eval_data_files=[str(corpus)], seq_len=16)
    byte_tokenizer = data.build_tokenizer(byte_cfg)
    assert byte_tokenizer.bos_token_id is None
    byte_stream = stream_of(byte_cfg, byte_tokenizer)
    first = [*byte_tokenizer(texts[0], add_special_tokens=False).input_ids, byte_tokenizer.eos_token_id]
    assert byte_stream[: len(first)].tolist() == first


def test_padded_rows_start_with_bos_too(hf_cache, tmp_path):
    from transformers import AutoTokenizer

    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(synthetic_documents(12)))
    tokenizer = AutoTokenizer.from_pretrained(save_bos_tokenizer(tmp_path / "bos_tokenizer"))
    cfg = TrainConfig(data_files=[str(corpus)], txt_documents="line", eval_data_files=[str(corpus)], seq_len=32,
                      packing=False)
    train, _ = data.build_datasets(cfg, tokenizer)
    assert all(train[i]["input_ids"][0] == tokenizer.bos_token_id for i in range(len(train)))


def test_two_tokenising_processes_give_the_same_stream(tmp_path, monkeypatch):
    import datasets

    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(synthetic_documents(400)))
    hashes = {}
    for num_proc in (None, 2):  # each in a cache of its own: the stream file is keyed by content, not num_proc
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / f"cache_{num_proc}")
        cfg = parse(TrainConfig, ["--data_files", str(corpus), "--txt_documents", "line", "--seq_len", "64",
                                  *(["--dataset_num_proc", str(num_proc)] if num_proc else [])], recipe="train.py")
        stream = stream_of(cfg, data.build_tokenizer(cfg), cfg.dataset_num_proc)
        hashes[num_proc] = hashlib.sha256(stream.tobytes()).hexdigest()
    assert hashes[None] == hashes[2]
    assert list((tmp_path / "cache_2").rglob("*_00001_of_00002.arrow"))  # two processes really tokenised


# ---- the data files users have: csv, parquet, folders, globs (issue 29) ----
ROWS = [f"document {i}: {word}" for i, word in enumerate(["alpha", "beta, with a comma", "gamma\nover two lines",
                                                          "delta", "epsilon", "zeta"])]


def test_csv_parquet_folders_and_globs_read_as_their_rows(hf_cache, tmp_path):
    import datasets

    source = datasets.Dataset.from_dict({"id": list(range(len(ROWS))), "body": ROWS})
    source.to_parquet(str(tmp_path / "rows.parquet"))
    source.to_csv(str(tmp_path / "rows.csv"), index=False)
    for name in ("rows.parquet", "rows.csv"):  # the text column is --text_column, as for JSON
        assert data.load_documents(TrainConfig(data_files=[str(tmp_path / name)], text_column="body"))["text"] == ROWS
    folder = tmp_path / "shards"
    (folder / "more").mkdir(parents=True)
    for i, name in enumerate(["b.jsonl", "a.jsonl", "more/c.jsonl"]):  # written out of order
        (folder / name).write_text("\n".join(json.dumps({"text": t}) for t in ROWS[2 * i: 2 * i + 2]) + "\n")
    (folder / "README.md").write_text("about these shards\n")  # skipped, as datasets skips it
    (folder / ".hidden.jsonl").write_text(json.dumps({"text": "not read"}) + "\n")  # skipped: hidden
    in_order = ROWS[2:4] + ROWS[0:2] + ROWS[4:6]  # a.jsonl, b.jsonl, more/c.jsonl: sorted paths
    assert data.load_documents(TrainConfig(data_files=[str(folder)]))["text"] == in_order
    assert data.load_documents(TrainConfig(data_files=[str(folder / "*.jsonl")]))["text"] == in_order[:4]
    assert data.load_documents(TrainConfig(data_files=[str(folder / "**" / "*.jsonl")]))["text"] == in_order
    # as the user gave them (recorded so in run_summary.json and the checkpoints), resolved when read
    cfg = parse(TrainConfig, ["--data_files", str(folder / "*.jsonl"), "--eval_data_files", str(folder / "more")],
                recipe="train.py")
    assert cfg.data_files == [str(folder / "*.jsonl")] and cfg.eval_data_files == [str(folder / "more")]
    assert data.load_documents(cfg, held_out=True)["text"] == ROWS[4:6]


def test_a_glob_reads_the_same_files_in_the_same_order_whatever_the_folder_listing(tmp_path):
    from common.config import data_file_list

    for name in ("3.txt", "1.txt", "2.txt"):
        (tmp_path / name).write_text(f"text of {name}\n")
    expected = [str(tmp_path / f"{i}.txt") for i in (1, 2, 3)]
    assert data_file_list([str(tmp_path / "*.txt")]) == data_file_list([str(tmp_path)]) == expected
    # several entries keep the order given: each entry's own files are sorted
    assert data_file_list([str(tmp_path / "3.txt"), str(tmp_path / "[12].txt")]) == expected[2:] + expected[:2]


def data_file_cases(tmp_path):
    (tmp_path / "empty_folder").mkdir()
    (tmp_path / "no_data").mkdir()
    (tmp_path / "no_data" / "notes.md").write_text("notes\n")
    (tmp_path / "blank.txt").write_text("\n \n")
    (tmp_path / "a.csv").write_text("text\nhello\n")
    (tmp_path / "b.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "c.md").write_text("hello\n")
    return {
        "missing file": ([tmp_path / "nope.jsonl"], f"data file not found: {tmp_path / 'nope.jsonl'}"),
        "glob matching nothing": ([tmp_path / "*.parquet"], f"no file matches {tmp_path / '*.parquet'}"),
        "empty file": ([tmp_path / "blank.txt"], f"data file is empty: {tmp_path / 'blank.txt'}"),
        "empty folder": ([tmp_path / "empty_folder"], "no .txt/.text/.json/.jsonl/.csv/.parquet file in the folder "
                         f"{tmp_path / 'empty_folder'}"),
        "folder without data files": ([tmp_path / "no_data"], "no .txt/.text/.json/.jsonl/.csv/.parquet file"),
        "mixed formats": ([tmp_path / "a.csv", tmp_path / "b.jsonl"],
                          "data files must all be .txt, all .json/.jsonl, all .csv or all .parquet; got .csv, .jsonl"),
        "unknown format": ([tmp_path / "c.md"], "data files must all be .txt, all .json/.jsonl, all .csv or all "
                           ".parquet; got .md"),
    }


@pytest.mark.parametrize("case", ["missing file", "glob matching nothing", "empty file", "empty folder",
                                  "folder without data files", "mixed formats", "unknown format"])
@pytest.mark.parametrize("option", ["--data_files", "--eval_data_files"])
def test_bad_data_files_are_one_line_before_anything_loads(tmp_path, case, option):
    paths, message = data_file_cases(tmp_path)[case]
    paths = [str(p) for p in paths]
    argv = ["--data_files", *paths] if option == "--data_files" else [
        "--data_files", str(tmp_path / "b.jsonl"), "--eval_data_files", *paths]
    with pytest.raises(ConfigError) as err:
        parse(TrainConfig, argv, recipe="train.py")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert err.value.every_rank  # the same on every rank: one process per launcher prints it


# ---- too little data for one micro-batch: an error, never a loop waiting for ever (issue 29) ----
def test_training_data_that_cannot_fill_a_micro_batch_on_every_rank_is_refused(hf_cache, tmp_path):
    small, held_out = tmp_path / "small.txt", tmp_path / "held_out.txt"
    small.write_text("a short training file, " * 20 + "\n")  # 461 bytes + EOS: 7 blocks of 65 tokens
    held_out.write_text("held-out text, " * 10 + "\n")
    cfg = TrainConfig(data_files=[str(small)], eval_data_files=[str(held_out)], seq_len=64, micro_batch_size=8)
    train, eval_set = data.build_datasets(cfg, data.build_tokenizer(cfg))
    assert len(train) == 7
    with pytest.raises(ConfigError) as err:
        data.build_loaders(cfg, train, eval_set, pin_memory=False)
    assert str(err.value) == ("the training set has 7 blocks of 65 tokens; one micro-batch on each of 1 data-parallel "
                              "rank(s) needs 8 (--micro_batch_size 8 x 1): lower --micro_batch_size or --seq_len, "
                              "or give more data")
    assert err.value.every_rank
    assert data.build_loaders(cfg, train, eval_set, pin_memory=False, trains=False)  # evaluates only (--eval_only)
    fits = TrainConfig(data_files=[str(small)], eval_data_files=[str(held_out)], seq_len=64, micro_batch_size=7)
    assert len(data.build_loaders(fits, train, eval_set, pin_memory=False)[0]) == 1
    with pytest.raises(ConfigError, match="has 7 blocks .* on each of 2 data-parallel rank.* needs 8 "):
        data.build_loaders(TrainConfig(micro_batch_size=4), train, eval_set, pin_memory=False, data_ranks=2)
    # one document, not packed: one row
    unpacked = TrainConfig(data_files=[str(small)], eval_data_files=[str(held_out)], packing=False, micro_batch_size=2)
    train, eval_set = data.build_datasets(unpacked, data.build_tokenizer(unpacked))
    with pytest.raises(ConfigError, match=r"has 1 documents; .* needs 2 .*: lower --micro_batch_size, or give more"):
        data.build_loaders(unpacked, train, eval_set, pin_memory=False)


def test_an_epoch_without_a_batch_raises_instead_of_spinning():
    from common.config import TrainingError
    from conftest import load_recipe

    class NoBatches(list):
        def set_epoch(self, epoch):
            pass

    batches = load_recipe("train").batches_forever(SimpleNamespace(process_index=0), NoBatches())
    with pytest.raises(TrainingError, match="epoch 0 of the training data gave rank 0 no micro-batch"):
        next(batches)


def test_a_stream_without_a_micro_batch_on_some_rank_stops_every_rank(hf_cache, tmp_path):
    """Each rank learns at the first batch whether every rank has one: all stop with the same line."""
    import torch

    from train_extras.data import at_scale

    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"text": "x" * 200}) + "\n")  # 201 tokens: 3 blocks of 65
    cfg = parse(TrainConfig, ["--data_files", str(small), "--eval_data_files", str(small), "--streaming",
                              "--seq_len", "64", "--micro_batch_size", "4"], recipe="train.py")
    tokenizer = data.build_tokenizer(cfg)

    def first_batch(cfg, others_have: list[int]):
        loader, _ = at_scale.streamed_loaders(cfg, at_scale.StreamedBlocks(cfg, tokenizer, 0, 1), [], False)
        accelerator = SimpleNamespace(device=torch.device("cpu"), process_index=0,
                                      gather=lambda mine: torch.cat([mine, torch.tensor(others_have)]))
        return next(at_scale.streamed_batches(accelerator, loader))

    with pytest.raises(ConfigError) as err:
        first_batch(cfg, [1])  # this rank (0) has none; rank 1 has one
    assert "the part of the stream of rank(s) 0 (of 2) holds no full micro-batch of 4 blocks of 65 tokens" in str(err)
    assert err.value.every_rank
    fits = dataclasses.replace(cfg, micro_batch_size=3)
    with pytest.raises(ConfigError, match=r"rank\(s\) 1, 2 \(of 3\) holds no full micro-batch of 3 blocks"):
        first_batch(fits, [0, 0])  # this rank has its batch, ranks 1 and 2 have none: it stops as they do
    assert first_batch(fits, [1])["input_ids"].shape == (3, 64)


def test_streaming_tokenises_in_the_dataloader_workers_into_the_same_blocks(hf_cache, tmp_path, monkeypatch):
    """--num_workers 2 with --streaming: two worker processes tokenise every other document each, and
    the blocks (ids and restarted positions) are exactly those of no workers, in the same order. A
    worker's ConfigError (a column that is not there) is still one line."""
    import os

    from train_extras.data import at_scale

    corpus = corpus_file(120)
    args = ["--data_files", corpus, "--eval_data_files", corpus, "--streaming", "--seq_len", "64"]
    cfg = parse(TrainConfig, args, recipe="train.py")
    tokenizer = data.build_tokenizer(cfg)

    def blocks(workers: int) -> list:
        stream = at_scale.StreamedBlocks(dataclasses.replace(cfg, num_workers=workers), tokenizer, 1, 2)
        return [(b["input_ids"].tolist(), b["position_ids"].tolist(), b["index"]) for b in stream]

    alone = blocks(0)
    tokenized, marks = at_scale.StreamedBlocks.tokenized, tmp_path / "calls"
    marks.mkdir()

    def recorded(self, share=0, shares=1):
        (marks / f"{os.getpid()}-{share}-{shares}").touch()
        yield from tokenized(self, share, shares)

    monkeypatch.setattr(at_scale.StreamedBlocks, "tokenized", recorded)
    assert blocks(2) == alone and len(alone) > 100
    calls = [name.split("-") for name in sorted(p.name for p in marks.iterdir())]
    assert sorted(share for _, share, _ in calls) == ["0", "1"] and {n for _, _, n in calls} == {"2"}
    assert str(os.getpid()) not in {pid for pid, _, _ in calls}  # in the workers, not here
    wrong = at_scale.StreamedBlocks(dataclasses.replace(cfg, num_workers=2, text_column="body"), tokenizer, 0, 1)
    with pytest.raises(ConfigError) as err:
        next(iter(wrong))
    assert str(err.value) == "streamed rows have no column 'body' (columns: ['text']); set --text_column"
