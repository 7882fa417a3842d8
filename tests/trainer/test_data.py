"""The data pipeline: reading, chat formatting, loss masks, packing, sharding, resume,
and gs:// through a real GCS-compatible server (fake-gcs-server)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from posttrain.api.spec import DataColumns, PostTrainJobSpec
from posttrain.trainer import storage
from posttrain.trainer.data import (
    DataError,
    DataLoader,
    PreferenceBatcher,
    PromptBatcher,
    Rows,
    SftBatcher,
    SftTokenizer,
    build_loader,
    load_tokenizer,
    open_records,
    pack_examples,
)
from tests.trainer.data_helpers import (
    FAKE_GCS_BUILD,
    ROOT,
    fake_gcs_binary,
    gcs_bucket,
    make_tokenizer_dir,
)

PREAMBLE = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


def chat_row(i: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"What is {i} + {i % 7}?"},
            {"role": "assistant", "content": f"Answer: {i + i % 7}."},
        ]
    }


def pc_row(i: int) -> dict:
    return {"prompt": f"What is {i} + {i % 7}?", "completion": f"Answer: {i + i % 7}."}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(str(tok_dir))


def values(records) -> list[dict]:
    return [records[i].values for i in range(len(records))]


def tokenize_all(records, tok, **kw):
    """Every row of records tokenized (the SftTokenizer, with its counters)."""
    tokenize = SftTokenizer(records, tok, **kw)
    return tokenize([records[i] for i in range(len(records))]), tokenize


def tokenize_sft(records, tok, **kw):
    return tokenize_all(records, tok, **kw)[0]


@pytest.fixture
def sft_rows(tok, tmp_path):
    def make(n=40, max_length=64):
        path = write_jsonl(tmp_path / f"sft-{n}.jsonl", [chat_row(i) for i in range(n)])
        records = open_records(str(path))
        tokenize = SftTokenizer(records, tok, max_length=max_length)
        return Rows(records, SftBatcher(tokenize, max_length=max_length, pad_id=tok.pad_id))

    return make


# ----------------------------------------------------------------------- tokenizer


def test_load_tokenizer(tok, tok_dir):
    assert tok.eos_token == "<|im_end|>" and tok.eos_id == tok.token_to_id("<|im_end|>")
    assert tok.bos_id == tok.token_to_id("<|im_start|>")
    assert tok.pad_id == tok.token_to_id("<|endoftext|>")
    assert "<|im_start|>" in tok.chat_template
    ids = tok.encode("<|im_start|>user\nWhat is 2 + 3?<|im_end|>")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>"
    assert [e.ids for e in tok.encode_batch(["a b", "c"])] == [tok.encode("a b"), tok.encode("c")]


def test_load_tokenizer_missing_file_names_it(tmp_path):
    with pytest.raises(DataError, match=r"tokenizer\.json: not found.*spec\.model\.source"):
        load_tokenizer(str(tmp_path))


def test_chat_template_jinja_file_is_used_when_config_has_none(tmp_path):
    d = make_tokenizer_dir(tmp_path / "m", chat_template=None)
    assert load_tokenizer(str(d)).chat_template is None
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert load_tokenizer(str(d)).template().render([{"role": "u", "content": "hi"}]) == "hi"


# ------------------------------------------------------------------------- reading


def _parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_every_format_reads_the_same_rows(tmp_path):
    import datasets

    rows = [chat_row(i) for i in range(12)]
    jsonl = write_jsonl(tmp_path / "a.jsonl", rows)
    parquet = _parquet(tmp_path / "a.parquet", rows)
    shards = tmp_path / "shards"
    write_jsonl(shards / "part-10.jsonl", rows[8:])  # sorted by name: 00, 01, 10
    write_jsonl(shards / "part-00.jsonl", rows[:5])
    _parquet(shards / "part-01.parquet", rows[5:8])
    (shards / "README.md").write_text("not data")
    hf = datasets.Dataset.from_list(rows)
    hf.save_to_disk(str(tmp_path / "hf_ds"))
    datasets.DatasetDict({"train": hf, "test": hf.select(range(2))}).save_to_disk(
        str(tmp_path / "hf_dict")
    )
    for source, kw in [
        (jsonl, {}),
        (parquet, {}),
        (shards, {}),
        (tmp_path / "hf_ds", {}),
        (tmp_path / "hf_dict", {"split": "train"}),
        (tmp_path / "hf_dict" / "train", {"format": "arrow"}),
    ]:
        ds = open_records(str(source), **kw)
        assert values(ds) == rows, source
        assert ds.columns == ["messages"]
    assert len(open_records(str(tmp_path / "hf_dict"), split="test")) == 2
    arrow_file = next((tmp_path / "hf_ds").glob("*.arrow"))
    assert values(open_records(str(arrow_file))) == rows
    # a JSON array file, and ArrayRecord (one JSON object a record)
    (tmp_path / "array.json").write_text(json.dumps(rows))
    assert values(open_records(str(tmp_path / "array.json"))) == rows
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(tmp_path / "a.array_record"), "group_size:4")
    for r in rows:
        writer.write(json.dumps(r).encode())
    writer.close()
    assert values(open_records(str(tmp_path / "a.array_record"))) == rows


def test_row_locations_for_errors(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(pc_row(0)) + "\n\n" + json.dumps({"prompt": "p"}) + "\n")
    ds = open_records(str(path))
    assert len(ds) == 2 and ds.where(1) == f"{path}:3"
    with pytest.raises(DataError, match=rf"{path}:3: column 'completion' .*missing or null"):
        tokenize_sft(ds, load_tokenizer(str(make_tokenizer_dir(tmp_path / "t"))))


def test_missing_column_error_names_file_column_field_and_columns(tmp_path, tok):
    path = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "response": "r"}])
    with pytest.raises(DataError) as e:
        tokenize_sft(open_records(str(path)), tok)
    assert str(e.value) == (
        f"{path}: column 'completion' (spec.data.columns.completion) not found; "
        "columns are: prompt, response"
    )
    # custom column names are what the message names
    other = _parquet(tmp_path / "y.parquet", [{"question": "q", "reply": "r"}])
    cols = DataColumns(prompt="question", completion="answer_text")
    with pytest.raises(DataError, match=r"y\.parquet: column 'answer_text' \(spec\.data\.columns"):
        tokenize_sft(open_records(str(other)), tok, columns=cols)
    # neither messages nor prompt
    with pytest.raises(DataError, match=r"column 'messages' .*nor column 'prompt'.*columns are: a"):
        tokenize_sft(open_records(str(write_jsonl(tmp_path / "z.jsonl", [{"a": 1}]))), tok)
    # the file of a directory that lacks the column is the one named
    d = tmp_path / "dir"
    write_jsonl(d / "0.jsonl", [pc_row(0)])
    write_jsonl(d / "1.jsonl", [{"prompt": "p", "answer": "a"}])
    with pytest.raises(DataError, match=r"dir/1\.jsonl: column 'completion'.*prompt, answer"):
        tokenize_sft(open_records(str(d)), tok)


def test_empty_and_missing_sources_fail_clearly(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: the dataset is empty"):
        open_records(str(empty))
    empty_pq = _parquet(tmp_path / "e.parquet", [])
    with pytest.raises(DataError, match=r"e\.parquet: the dataset is empty"):
        open_records(str(empty_pq))
    with pytest.raises(DataError, match=r"nope\.jsonl: not found \(spec\.data\.source\)"):
        open_records(str(tmp_path / "nope.jsonl"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"holds no \.jsonl, \.parquet, \.arrow or \.array_record"):
        open_records(str(tmp_path / "d"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n\n{oops\n')
    records = open_records(str(bad))  # a bad row is found when it is read
    with pytest.raises(DataError, match=r"bad\.jsonl:3: invalid JSON"):
        records[1]
    (tmp_path / "data.txt").write_text("{}")
    with pytest.raises(DataError, match=r"set spec\.data\.format"):
        open_records(str(tmp_path / "data.txt"))
    assert len(open_records(str(tmp_path / "data.txt"), format="jsonl")) == 1


def test_missing_split_names_the_splits(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list([pc_row(0)])}).save_to_disk(
        str(tmp_path / "dd")
    )
    with pytest.raises(DataError, match=r"split 'validation' \(spec\.data\.split\).*: train"):
        open_records(str(tmp_path / "dd"), split="validation")


# ------------------------------------------------------- formatting and loss masks


def _masked_text(tok, example) -> str:
    return tok.decode(example["input_ids"][example["loss_mask"] == 1])


def test_loss_mask_covers_exactly_the_assistant_tokens(tok, tmp_path):
    ds = open_records(str(write_jsonl(tmp_path / "c.jsonl", [chat_row(3)])))
    ex = tokenize_sft(ds, tok, max_length=128)[0]
    assert ex["input_ids"].dtype == np.int32 and ex["loss_mask"].dtype == np.int32
    text = tok.decode(ex["input_ids"])
    assert text == (
        PREAMBLE + "<|im_start|>user\nWhat is 3 + 3?<|im_end|>\n"
        "<|im_start|>assistant\nAnswer: 6.<|im_end|>\n"
    )
    # exactly the assistant turn: a contiguous run at the end, nothing else
    assert _masked_text(tok, ex) == "Answer: 6.<|im_end|>\n"
    n_masked = int(ex["loss_mask"].sum())
    assert ex["loss_mask"][-n_masked:].all() and not ex["loss_mask"][:-n_masked].any()
    prefix = tok.encode(text[: text.index("Answer")])
    assert list(ex["input_ids"][: len(prefix)]) == prefix and len(prefix) + n_masked == len(
        ex["input_ids"]
    )


def test_multi_turn_masks_every_non_assistant_segment(tok, tmp_path):
    conv = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "Answer: 5."},
        {"role": "user", "content": "What colour is the sky?"},
        {"role": "assistant", "content": "Answer: blue."},
    ]
    ds = open_records(str(write_jsonl(tmp_path / "m.jsonl", [{"messages": conv}])))
    ex = tokenize_sft(ds, tok, max_length=256)[0]
    ids, mask = ex["input_ids"], ex["loss_mask"]
    runs, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(int(t))
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    assert runs == ["Answer: 5.<|im_end|>\n", "Answer: blue.<|im_end|>\n"]
    assert not mask[ids == tok.bos_id].any()  # no <|im_start|> is a target


def test_prompt_completion_columns_match_messages(tok, tmp_path):
    a = tokenize_sft(open_records(str(write_jsonl(tmp_path / "a.jsonl", [pc_row(4)]))), tok)
    b = tokenize_sft(open_records(str(write_jsonl(tmp_path / "b.jsonl", [chat_row(4)]))), tok)
    np.testing.assert_array_equal(a[0]["input_ids"], b[0]["input_ids"])
    np.testing.assert_array_equal(a[0]["loss_mask"], b[0]["loss_mask"])


def test_full_sequence_loss_and_truncation(tok, tmp_path):
    ds = open_records(str(write_jsonl(tmp_path / "a.jsonl", [chat_row(1), chat_row(2)])))
    full = tokenize_sft(ds, tok, completion_only_loss=False)
    assert all(e.loss_mask.all() for e in full)
    n = len(full[0]["input_ids"])
    cut, counts = tokenize_all(ds, tok, max_length=n - 3)
    assert counts.truncated == 2 and all(len(cut[i]["input_ids"]) == n - 3 for i in range(2))
    np.testing.assert_array_equal(cut[0]["input_ids"], full[0]["input_ids"][: n - 3])
    # truncated so far that no assistant token is left: the example is dropped (counted)
    dropped, counts = tokenize_all(ds, tok, max_length=8)
    assert dropped == [None, None] and counts.dropped == 2


def test_chat_template_file_overrides_the_tokenizers(tok, tmp_path):
    tpl = tmp_path / "plain.jinja"
    tpl.write_text(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    ds = open_records(str(write_jsonl(tmp_path / "a.jsonl", [pc_row(2)])))
    ex = tokenize_sft(ds, tok, chat_template=str(tpl))[0]
    assert tok.decode(ex["input_ids"]) == "user: What is 2 + 2?\nassistant: Answer: 4.\n"
    # byte-level BPE merges the space after "assistant:" into " Answer": that token
    # holds completion text, so it is learnt
    assert _masked_text(tok, ex) == " Answer: 4.\n"
    with pytest.raises(DataError, match=r"nope\.jinja: chat template file not found"):
        tokenize_sft(ds, tok, chat_template=str(tmp_path / "nope.jinja"))


def test_tokenizer_without_template_uses_plain_text_and_eos(tmp_path):
    plain = load_tokenizer(str(make_tokenizer_dir(tmp_path / "t", chat_template=None)))
    ds = open_records(str(write_jsonl(tmp_path / "a.jsonl", [pc_row(2)])))
    ex = tokenize_sft(ds, plain)[0]
    assert plain.decode(ex["input_ids"]) == "What is 2 + 2?Answer: 4.<|im_end|>"
    assert _masked_text(plain, ex) == "Answer: 4.<|im_end|>"
    row = chat_row(2)
    row["messages"].insert(0, {"role": "system", "content": "x"})
    chat = open_records(str(write_jsonl(tmp_path / "b.jsonl", [row])))
    with pytest.raises(DataError, match=r"b\.jsonl:1: the tokenizer has no chat template.*"):
        tokenize_sft(chat, plain)


def test_bad_messages_are_named(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [chat_row(0), {"messages": [{"role": "user"}]}])
    with pytest.raises(DataError, match=r"a\.jsonl:2: message 0 .* 'role' and 'content'"):
        tokenize_sft(open_records(str(path)), tok)
    path = write_jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(DataError, match=r"b\.jsonl:1: .* no assistant message"):
        tokenize_sft(open_records(str(path)), tok)


# ------------------------------------------------------------------------ packing


def test_padding_without_packing(tok, sft_rows):
    rows = sft_rows(n=4, max_length=64)
    ex = tokenize_sft(rows.records, tok)[2]
    r = {k: v[0] for k, v in rows.batch([2]).items()}
    n = len(ex["input_ids"])
    assert set(r) == {"input_ids", "loss_mask", "segment_ids", "positions", "example_rows"}
    assert all(v.shape == (64,) and v.dtype == np.int32 for v in r.values())
    np.testing.assert_array_equal(r["input_ids"][:n], ex["input_ids"])
    assert (r["input_ids"][n:] == tok.pad_id).all() and not r["loss_mask"][n:].any()
    assert (r["segment_ids"][:n] == 1).all() and not r["segment_ids"][n:].any()
    np.testing.assert_array_equal(r["positions"][:n], np.arange(n))
    assert set(r["example_rows"][:n]) == {2} and (r["example_rows"][n:] == -1).all()


def test_pack_examples_is_greedy_best_fit():
    rows = pack_examples([5, 3, 8, 2, 6, 1], 8)
    assert sorted(i for r in rows for i in r) == list(range(6))
    assert all(sum([5, 3, 8, 2, 6, 1][i] for i in r) <= 8 for r in rows)
    assert len(rows) == 4  # 8 | 6+2 | 5+3 | 1 is optimal: ceil(25 / 8) = 4
    with pytest.raises(ValueError):
        pack_examples([9], 8)


def packed_ids(batch) -> list[list[int]]:
    """The example rows of each packed row of a batch, in segment order."""
    out = []
    for seg, origin in zip(batch["segment_ids"], batch["example_rows"], strict=True):
        out.append([int(origin[seg == s][0]) for s in range(1, int(seg.max()) + 1)])
    return out


def test_packing_streams_segments_positions_and_fill(tok, sft_rows):
    rows = sft_rows(n=30, max_length=128)
    examples = tokenize_sft(rows.records, tok)
    loader = DataLoader(rows, batch_size=2, packing=True, window=10, shuffle=False, threads=0)
    seen = []
    while len(seen) < 30:
        b = next(loader)
        for r, members in enumerate(packed_ids(b)):
            seen.extend(members)
            seg, pos = b["segment_ids"][r], b["positions"][r]
            used = int((seg > 0).sum())
            assert (seg[:used] > 0).all() and not seg[used:].any()  # padding at the end
            assert (b["input_ids"][r, used:] == tok.pad_id).all()
            assert not b["loss_mask"][r, used:].any()
            for s, ex_id in enumerate(members, 1):
                sel = seg == s
                np.testing.assert_array_equal(b["input_ids"][r][sel], examples[ex_id].input_ids)
                np.testing.assert_array_equal(b["loss_mask"][r][sel], examples[ex_id].loss_mask)
                np.testing.assert_array_equal(pos[sel], np.arange(sel.sum()))  # restart at 0
    # windows of 10 examples: each window's examples are packed together, none twice
    assert sorted(seen[:30]) == list(range(30)) and max(len(m) for m in packed_ids(b)) >= 2
    assert sorted(seen[:10]) == list(range(10))
    unpacked = DataLoader(rows, batch_size=2, threads=0)
    for _ in range(5):
        next(unpacked)
    assert loader.metrics()["fill_ratio"] > 2 * unpacked.metrics()["fill_ratio"]


# -------------------------------------------------------- batching and determinism


def epoch_ids(loader: DataLoader, steps: int | None = None) -> list[list[int]]:
    """Row indices of each step of the loader's next `steps` (default: an epoch's)."""
    return [
        [int(i) for i in next(loader)["row_index"]] for _ in range(steps or loader.steps_per_epoch)
    ]


def test_batch_shapes_and_dtypes(sft_rows):
    loader = DataLoader(sft_rows(n=20, max_length=48), batch_size=8, process_count=2)
    b = next(loader)
    assert set(b) == {
        "input_ids",
        "loss_mask",
        "segment_ids",
        "positions",
        "example_rows",
        "row_index",
    }
    for k, v in b.items():
        assert v.dtype == np.int32, k
        assert v.shape == ((4,) if k == "row_index" else (4, 48)), k
    assert loader.steps_per_epoch == 2 and loader.per_host_batch_size == 4


def test_shuffle_is_deterministic_by_seed(sft_rows):
    rows = sft_rows(n=32, max_length=48)
    a = epoch_ids(DataLoader(rows, batch_size=4, seed=1))
    b = epoch_ids(DataLoader(rows, batch_size=4, seed=1))
    c = epoch_ids(DataLoader(rows, batch_size=4, seed=2))
    assert a == b and a != c
    assert sorted(sum(a, [])) == list(range(32))  # a permutation of every row
    ordered = epoch_ids(DataLoader(rows, batch_size=4, shuffle=False))
    assert sum(ordered, []) == list(range(32))
    loader = DataLoader(rows, batch_size=4, seed=1)
    first, second = epoch_ids(loader), epoch_ids(loader)
    assert first == a and second != first and sorted(sum(second, [])) == list(range(32))
    # a batch that crosses an epoch's end takes the next epoch's first rows
    odd = DataLoader(rows, batch_size=6, seed=1)
    flat = sum(epoch_ids(odd, 11), [])
    assert sorted(flat[:32]) == list(range(32)) and sorted(flat[32:64]) == list(range(32))


@pytest.mark.parametrize("hosts", [2, 4])
def test_hosts_get_disjoint_examples(sft_rows, hosts):
    rows = sft_rows(n=67, max_length=96)
    B = 8
    loaders = [
        DataLoader(rows, batch_size=B, process_index=p, process_count=hosts, seed=3)
        for p in range(hosts)
    ]
    per_host = [epoch_ids(ld) for ld in loaders]
    epoch_sets = [set(sum(per_host[p], [])) for p in range(hosts)]
    for p in range(hosts):  # across the epoch: no example on two hosts
        for q in range(p + 1, hosts):
            assert not epoch_sets[p] & epoch_sets[q]
    # hosts together see exactly what one host with the whole batch sees
    single = epoch_ids(DataLoader(rows, batch_size=B, seed=3))
    for s in range(loaders[0].steps_per_epoch):
        assert sum((per_host[p][s] for p in range(hosts)), []) == single[s]
    assert sum(single, []) == list(loaders[0].epoch_order(0)[: len(single) * B])


def assert_same_batches(got, want):
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.parametrize("packing", [False, True])
def test_exact_resume_from_state(sft_rows, packing):
    rows = sft_rows(n=30, max_length=128)

    def loader():
        return DataLoader(rows, batch_size=4, seed=7, packing=packing, window=8)

    ref = loader()
    expected = [next(ref) for _ in range(12)]  # crosses epoch boundaries
    for cut in (0, 1, 5, 11):
        first = loader()
        for _ in range(cut):
            next(first)
        state = json.loads(json.dumps(first.get_state()))
        resumed = loader()
        resumed.set_state(state)
        for want in expected[cut:]:
            assert_same_batches(next(resumed), want)
    with pytest.raises(ValueError, match="not a data loader state"):
        ref.set_state({"num_rows": 30})


def test_resume_on_a_different_host_count_continues_the_global_order(sft_rows):
    rows = sft_rows(n=40, max_length=48)
    one = DataLoader(rows, batch_size=8, seed=5)
    for _ in range(3):
        next(one)
    state = one.get_state()
    want = next(one)["row_index"]
    got = []
    for p in range(2):
        ld = DataLoader(rows, batch_size=8, seed=5, process_index=p, process_count=2)
        ld.set_state(state)
        got.extend(next(ld)["row_index"])
    assert list(want) == got


def test_batch_size_errors(sft_rows):
    rows = sft_rows(n=10, max_length=48)
    with pytest.raises(
        DataError, match=r"spec\.training\.batchSize \(6\) must be a multiple .*\(4\)"
    ):
        DataLoader(rows, batch_size=6, process_count=4)
    with pytest.raises(DataError, match=r"10 rows, fewer than spec\.training\.batchSize \(16\)"):
        DataLoader(rows, batch_size=16)
    with pytest.raises(DataError, match=r"spec\.training\.gradientAccumulation \(3\)"):
        DataLoader(rows, batch_size=8, process_count=2, gradient_accumulation=3)


# ----------------------------------------------------------- DPO and GRPO rows


def test_preference_rows(tok, tmp_path):
    rows = [
        {"prompt": f"What is {i} + 1?", "chosen": f"Answer: {i + 1}.", "rejected": "I think 7"}
        for i in range(6)
    ]
    ds = open_records(str(write_jsonl(tmp_path / "p.jsonl", rows)))
    pref = PreferenceBatcher(ds, tok, max_prompt_length=40, max_completion_length=12)
    loader = DataLoader(Rows(ds, pref), batch_size=2, shuffle=False)
    b = next(loader)
    assert {k: v.shape for k, v in b.items()} == {
        "prompt_ids": (2, 40),
        "prompt_mask": (2, 40),
        "chosen_ids": (2, 12),
        "chosen_mask": (2, 12),
        "rejected_ids": (2, 12),
        "rejected_mask": (2, 12),
        "row_index": (2,),
    }
    assert all(v.dtype == np.int32 for v in b.values())
    p_ids, p_mask = b["prompt_ids"][0], b["prompt_mask"][0]
    assert p_mask[-1] == 1 and p_mask[0] == 0  # left-padded
    assert tok.decode(p_ids[p_mask == 1]) == (
        PREAMBLE + "<|im_start|>user\nWhat is 0 + 1?<|im_end|>\n<|im_start|>assistant\n"
    )
    c_ids, c_mask = b["chosen_ids"][0], b["chosen_mask"][0]
    assert c_mask[0] == 1 and c_mask[-1] == 0  # right-padded
    assert tok.decode(c_ids[c_mask == 1]) == "Answer: 1.<|im_end|>\n"
    assert tok.decode(b["rejected_ids"][1][b["rejected_mask"][1] == 1]) == "I think 7<|im_end|>\n"
    missing = open_records(str(write_jsonl(tmp_path / "q.jsonl", [{"prompt": "a", "chosen": "b"}])))
    with pytest.raises(DataError, match=r"q\.jsonl: column 'rejected' \(spec\.data\.columns"):
        PreferenceBatcher(missing, tok)


def test_prompt_rows_for_grpo(tok, tmp_path):
    rows = [{"prompt": f"What is {i} + 2?", "answer": i + 2} for i in range(4)]
    ds = open_records(str(write_jsonl(tmp_path / "g.jsonl", rows)))
    b = next(DataLoader(Rows(ds, PromptBatcher(ds, tok)), batch_size=2, shuffle=False))
    assert list(b["answer"]) == ["2", "3"]
    assert b["prompts"][1] == (
        PREAMBLE + "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    no_answer = open_records(str(write_jsonl(tmp_path / "h.jsonl", [{"prompt": "x"}])))
    with pytest.raises(DataError, match=r"column 'answer' \(spec\.data\.columns\.answer\)"):
        PromptBatcher(no_answer, tok)


# ------------------------------------------------------------------------- wiring


def job(source: str, technique: str = "sft", **data_fields) -> PostTrainJobSpec:
    return PostTrainJobSpec.model_validate(
        {
            "technique": technique,
            "model": {"source": "/models/tiny"},
            "data": {"source": source, "maxLength": 64, **data_fields},
            "training": {"batchSize": 4, "seed": 11},
            "output": {"uri": "/tmp/out"},
            **({"grpo": {"rewards": [{"type": "exactAnswer"}]}} if technique == "grpo" else {}),
        }
    )


def test_build_loader_from_spec(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [chat_row(i) for i in range(24)])
    spec = job(str(path), packing=True, maxLength=128)
    loaders = [build_loader(spec, tok, process_index=p, process_count=2) for p in range(2)]
    b = next(loaders[1])
    assert b["input_ids"].shape == (2, 128) and b["segment_ids"].max() >= 2
    assert loaders[0].seed == 11 and isinstance(loaders[0].rows.batcher, SftBatcher)
    assert loaders[0].packing and len(loaders[0].rows) == 24


def test_build_loader_for_dpo_and_grpo(tok):
    d = ROOT / "examples" / "data"
    dpo = build_loader(job(str(d / "preferences-dpo.jsonl"), "dpo"), tok)
    assert isinstance(dpo.rows.batcher, PreferenceBatcher)
    assert dpo.rows.batcher.max_prompt_length == 32
    assert next(dpo)["chosen_ids"].shape == (4, 32)
    grpo = build_loader(job(str(d / "arithmetic-grpo.jsonl"), "grpo"), tok)
    assert isinstance(grpo.rows.batcher, PromptBatcher) and len(next(grpo)["prompts"]) == 4


def test_shipped_example_datasets(tok):
    d = ROOT / "examples" / "data"
    sft = open_records(str(d / "chat-sft.jsonl"))
    assert 250 <= len(sft) <= 400 and sft.columns == ["messages"]
    assert (d / "chat-sft.jsonl").stat().st_size < 100_000
    ex, counts = tokenize_all(sft, tok, max_length=256)
    assert len(ex) == len(sft) and counts.truncated == 0 and None not in ex
    grpo = open_records(str(d / "arithmetic-grpo.jsonl"))
    assert len(grpo) >= 150 and {"prompt", "answer"} <= set(grpo.columns)
    dpo = open_records(str(d / "preferences-dpo.jsonl"))
    assert len(dpo) >= 150 and {"prompt", "chosen", "rejected"} <= set(dpo.columns)
    assert (d / "README.md").is_file()


def test_example_datasets_match_their_generator(capsys):
    import importlib.util

    path = ROOT / "scripts" / "make_example_data.py"
    spec = importlib.util.spec_from_file_location("make_example_data", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0, capsys.readouterr().out


# -------------------------------------------------------------------------- gs://


@pytest.fixture(scope="module")
def gcs():
    with gcs_bucket("ptdata") as bucket:
        yield bucket


def test_fake_gcs_server_is_built():
    try:
        fake_gcs_binary()
    except AssertionError as e:
        pytest.fail(str(e))
    assert "go install github.com/fsouza/fake-gcs-server@" in FAKE_GCS_BUILD


def test_storage_on_gcs(gcs, tmp_path):
    base = f"{gcs}/storage"
    storage.write_bytes(f"{base}/a.bin", b"\x00\x01")
    storage.write_text(f"{base}/sub/b.txt", "héllo")
    with storage.open_uri(f"{base}/sub/c.txt", "w") as f:
        f.write("streamed")
    assert storage.read_bytes(f"{base}/a.bin") == b"\x00\x01"
    assert storage.read_text(f"{base}/sub/b.txt") == "héllo"
    with storage.open_uri(f"{base}/sub/c.txt", "r") as f:
        assert f.read() == "streamed"
    assert storage.exists(f"{base}/a.bin") and storage.exists(base)
    assert storage.is_dir(base) and storage.is_dir(f"{base}/sub")
    assert not storage.is_dir(f"{base}/a.bin") and not storage.exists(f"{base}/nope")
    assert storage.list_uri(base) == [f"{base}/a.bin"]
    assert storage.list_uri(base, recursive=True) == [
        f"{base}/a.bin",
        f"{base}/sub/b.txt",
        f"{base}/sub/c.txt",
    ]
    with pytest.raises(FileNotFoundError, match="nope"):
        storage.read_bytes(f"{base}/nope")
    local = storage.download_dir(base, tmp_path / "dl")
    assert (local / "sub" / "b.txt").read_text() == "héllo"
    storage.upload_dir(local, f"{gcs}/copy")
    assert storage.read_text(f"{gcs}/copy/sub/c.txt") == "streamed"
    storage.move(f"{gcs}/copy/sub", f"{gcs}/moved")
    assert storage.list_uri(f"{gcs}/moved") == [f"{gcs}/moved/b.txt", f"{gcs}/moved/c.txt"]
    assert not storage.exists(f"{gcs}/copy/sub")
    storage.delete(f"{gcs}/copy", recursive=True)
    assert not storage.exists(f"{gcs}/copy")


def test_read_dataset_and_tokenizer_from_gcs(gcs, tmp_path, tok, tok_dir):
    import datasets

    rows = [chat_row(i) for i in range(10)]
    storage.write_text(f"{gcs}/sft/train.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    ds = open_records(f"{gcs}/sft/train.jsonl")
    assert values(ds) == rows and ds.where(2) == f"{gcs}/sft/train.jsonl:3"
    # its offset index cached on gs:// by process 0, then fetched and memory-mapped
    for process in (0, 1):
        cached = open_records(
            f"{gcs}/sft/train.jsonl", index_dir=f"{gcs}/index", process_index=process
        )
        assert values(cached) == rows
    assert len(storage.list_uri(f"{gcs}/index")) == 1
    # ArrayRecord, fetched to a local file for its reader
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(tmp_path / "a.array_record"), "group_size:4")
    for r in rows:
        writer.write(json.dumps(r).encode())
    writer.close()
    storage.write_bytes(f"{gcs}/a.array_record", (tmp_path / "a.array_record").read_bytes())
    assert values(open_records(f"{gcs}/a.array_record")) == rows
    # a directory of parquet shards, read in sorted order
    for name, part in (("b.parquet", rows[4:]), ("a.parquet", rows[:4])):
        _parquet(tmp_path / name, part)
        storage.write_bytes(f"{gcs}/shards/{name}", (tmp_path / name).read_bytes())
    assert values(open_records(f"{gcs}/shards")) == rows
    # a datasets DatasetDict saved to disk and uploaded
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "dd")
    )
    storage.upload_dir(tmp_path / "dd", f"{gcs}/dd")
    assert values(open_records(f"{gcs}/dd", split="train")) == rows
    # missing column error names the gs:// object
    storage.write_text(f"{gcs}/bad.jsonl", json.dumps({"prompt": "p", "response": "r"}) + "\n")
    with pytest.raises(DataError, match=rf"^{gcs}/bad\.jsonl: column 'completion'"):
        tokenize_sft(open_records(f"{gcs}/bad.jsonl"), tok)
    # the model's tokenizer from gs://, and a chat template file there
    storage.upload_dir(tok_dir, f"{gcs}/model")
    remote = load_tokenizer(f"{gcs}/model")
    assert remote.eos_id == tok.eos_id and remote.chat_template == tok.chat_template
    storage.write_text(f"{gcs}/t.jinja", "{% for m in messages %}{{ m.content }}|{% endfor %}")
    ex = tokenize_sft(ds, remote, chat_template=f"{gcs}/t.jinja")
    assert remote.decode(ex[0]["input_ids"]) == "What is 0 + 0?|Answer: 0.|"


def test_pretokenized_rows_skip_the_tokenizer(tok, tmp_path):
    rows = [
        {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
        {"input_ids": list(range(10, 90))},  # no mask: every token learnt; truncated
    ]
    path = _parquet(tmp_path / "tok.parquet", rows)
    records = open_records(str(path))
    examples, counts = tokenize_all(records, tok, max_length=64)
    assert examples[0].input_ids.tolist() == [5, 6, 7, 8]
    assert examples[0].loss_mask.tolist() == [0, 0, 1, 1]
    assert examples[1].input_ids.tolist() == list(range(10, 74)) and examples[1].loss_mask.all()
    assert counts.truncated == 1
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"input_ids": [1, 2], "loss_mask": [1]}])
    with pytest.raises(DataError, match=r"bad\.jsonl:1: input_ids must be a list .*same length"):
        tokenize_sft(open_records(str(bad)), tok)
    big = write_jsonl(tmp_path / "big.jsonl", [{"input_ids": [1, 10**6]}])
    with pytest.raises(DataError, match=r"big\.jsonl:1: input_ids holds ids outside"):
        tokenize_sft(open_records(str(big)), tok)


def _bytes_read_by_process() -> int:
    with open("/proc/self/io") as f:  # rchar: bytes this process's reads returned
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_a_row_deep_in_a_jsonl_file_reads_only_its_line(tmp_path):
    path = write_jsonl(tmp_path / "big.jsonl", [chat_row(i) for i in range(20000)])
    records = open_records(str(path))
    before = _bytes_read_by_process()
    rows = records.read_many(list(range(19990, 20000)))
    read = _bytes_read_by_process() - before
    assert [r.values for r in rows] == [chat_row(i) for i in range(19990, 20000)]
    assert read < 64 << 10, (read, path.stat().st_size)  # the file is about 2 MB
    assert records.where(19999) == f"{path}:20000"  # counted when an error needs it


def test_nothing_is_read_past_the_last_step(sft_rows):
    rows = sft_rows(n=40, max_length=48)
    loader = DataLoader(rows, batch_size=4, max_steps=3, prefetch=4)
    for _ in range(3):
        next(loader)
    offsets = rows.records.files[0]._offsets
    size = np.diff(offsets)
    drawn = loader.epoch_order(0)[:12]
    assert rows.records.bytes_read == size[drawn].sum() + size[0]  # and row 0: its columns
    assert len(next(loader)["row_index"]) == 4  # asked for more, it goes on
