import pytest
import torch

from workbench.data import (
    Batch,
    PromptDataError,
    PromptLoader,
    PromptLoaderConfig,
    load_prompts,
    tokenize_prompts,
    write_arithmetic,
    write_jsonl,
)
from workbench.data.arithmetic import ArithmeticConfig
from workbench.models import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture
def rows():
    return [
        {"prompt": "Q: 1+2=? A:", "ground_truth": "3"},
        {"prompt": "Q: 12+345=? A:", "ground_truth": "357"},
        {"prompt": "Q: 1234+5678=? A:", "ground_truth": "6912", "uid": "mine"},
    ]


def test_arithmetic_jsonl_round_trip(tmp_path):
    path = write_arithmetic(tmp_path / "train.jsonl", ArithmeticConfig(digits=3), n=25, seed=4)
    rows = load_prompts(path)
    again = write_arithmetic(tmp_path / "b.jsonl", ArithmeticConfig(digits=3), 25, 4)
    assert len(rows) == 25 and rows == load_prompts(again)
    assert set(rows[0]) == {"prompt", "ground_truth", "data_source"}
    assert rows[0]["prompt"].startswith("Q: ") and rows[0]["ground_truth"].lstrip("-").isdigit()


def test_own_column_names_are_renamed(tmp_path):
    path = write_jsonl([{"question": "How many?", "answer": 18, "id": 1}], tmp_path / "gsm.jsonl")
    rows = load_prompts(path, prompt_key="question", ground_truth_key="answer")
    assert rows == [{"prompt": "How many?", "ground_truth": "18", "id": 1}]


def test_missing_column_names_it_and_the_columns_found(tmp_path):
    path = write_jsonl([{"prompt": "a", "ground_truth": "1"}, {"question": "b", "answer": "2"}], tmp_path / "x.jsonl")
    found = r"row 1: missing column 'prompt'; columns found: \['answer', 'question'\]"
    with pytest.raises(PromptDataError, match=found):
        load_prompts(path)


def test_bad_files(tmp_path):
    with pytest.raises(PromptDataError, match="does not exist"):
        load_prompts(tmp_path / "none.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "ground_truth": "1"}\n{oops\n')
    with pytest.raises(PromptDataError, match="line 2: not valid JSON"):
        load_prompts(tmp_path / "broken.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(PromptDataError, match="no rows"):
        load_prompts(tmp_path / "empty.jsonl")
    (tmp_path / "data.docx").write_text("prompt,ground_truth\n")
    with pytest.raises(PromptDataError, match="unknown format '.docx'; use .jsonl or .parquet"):
        load_prompts(tmp_path / "data.docx")


def test_parquet(tmp_path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        (tmp_path / "p.parquet").write_bytes(b"PAR1")
        with pytest.raises(PromptDataError, match="pip install pyarrow"):
            load_prompts(tmp_path / "p.parquet")
        return
    pq.write_table(pa.table({"prompt": ["Q: 1+1=? A:"], "ground_truth": ["2"]}), tmp_path / "p.parquet")
    assert load_prompts(tmp_path / "p.parquet") == [{"prompt": "Q: 1+1=? A:", "ground_truth": "2"}]


def test_batch_is_left_padded_with_positions(tokenizer, rows):
    batch = tokenize_prompts(rows, tokenizer, max_prompt_length=64)
    assert isinstance(batch, Batch) and len(batch) == 3
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    lengths = [len(tokenizer(r["prompt"])["input_ids"]) for r in rows]
    assert ids.shape == mask.shape == pos.shape == (3, max(lengths))
    assert ids.dtype == mask.dtype == pos.dtype == torch.long
    for i, (row, n) in enumerate(zip(rows, lengths)):
        assert mask[i].tolist() == [0] * (ids.shape[1] - n) + [1] * n
        assert (ids[i, : ids.shape[1] - n] == tokenizer.pad_token_id).all()
        assert ids[i, -n] == tokenizer.bos_token_id  # every prompt ends at the last column
        assert tokenizer.decode(ids[i][mask[i].bool()], skip_special_tokens=True) == row["prompt"]
        assert pos[i, -n:].tolist() == list(range(n)) and (pos[i, : ids.shape[1] - n] == 0).all()
    assert list(batch["prompt"]) == [r["prompt"] for r in rows]
    assert list(batch["ground_truth"]) == ["3", "357", "6912"]
    assert list(batch["uid"]) == ["0", "1", "mine"]
    assert batch.info["num_truncated"] == 0


def test_pad_to_max_length(tokenizer, rows):
    assert tokenize_prompts(rows, tokenizer, 40, pad_to_max_length=True)["input_ids"].shape == (3, 40)


def test_overlong_prompt_refused_naming_row_and_length(tokenizer, rows):
    n = len(tokenizer(rows[2]["prompt"])["input_ids"])
    expected = f"row 2 is {n} tokens, over max_prompt_length=14.*overlong='truncate'"
    with pytest.raises(PromptDataError, match=expected):
        tokenize_prompts(rows, tokenizer, max_prompt_length=14)


def test_overlong_prompt_truncated_on_the_left(tokenizer, rows):
    batch = tokenize_prompts(rows, tokenizer, max_prompt_length=14, overlong="truncate")
    assert batch["input_ids"].shape[1] == 14 and batch.info["num_truncated"] == 1
    full = tokenizer(rows[2]["prompt"])["input_ids"]
    assert batch["input_ids"][2].tolist() == full[-14:]  # the end, where the question is, survives
    assert batch["attention_mask"][2].tolist() == [1] * 14
    assert tokenizer.decode(full[-14:]).endswith("=? A:")


def test_loader_refuses_before_the_first_epoch(tokenizer, rows):
    with pytest.raises(PromptDataError, match="row 2 is .* tokens.*1 rows are too long"):
        PromptLoader(rows, tokenizer, PromptLoaderConfig(max_prompt_length=14))


def test_loader_epochs_cover_every_row_and_reshuffle(tokenizer, tmp_path):
    rows = load_prompts(write_arithmetic(tmp_path / "t.jsonl", n=10))
    loader = PromptLoader(rows, tokenizer, PromptLoaderConfig(batch_size=4, seed=1))
    assert len(loader) == 3
    first = list(loader)
    assert [len(b) for b in first] == [4, 4, 2]
    uids = [u for b in first for u in b["uid"]]
    assert sorted(uids, key=int) == [str(i) for i in range(10)]
    second = [u for b in loader for u in b["uid"]]
    assert second != uids and sorted(second) == sorted(uids)
    for batch in first:  # uid points back at the row it came from
        for uid, truth in zip(batch["uid"], batch["ground_truth"]):
            assert rows[int(uid)]["ground_truth"] == truth
    same = PromptLoader(rows, tokenizer, PromptLoaderConfig(batch_size=4, seed=1))
    assert [u for b in same for u in b["uid"]] == uids


def test_loader_batches_resume_from_a_batch_count(tokenizer, tmp_path):
    rows = load_prompts(write_arithmetic(tmp_path / "t.jsonl", n=10))
    cfg = PromptLoaderConfig(batch_size=4, seed=1)
    epochs = PromptLoader(rows, tokenizer, cfg)
    two_epochs = [list(b["uid"]) for b in [*epochs, *epochs]]  # 3 batches each, reshuffled
    endless = PromptLoader(rows, tokenizer, cfg).batches()
    assert [list(next(endless)["uid"]) for _ in range(6)] == two_epochs
    resumed = PromptLoader(rows, tokenizer, cfg).batches(start=4)  # mid second epoch
    assert [list(next(resumed)["uid"]) for _ in range(2)] == two_epochs[4:]


def test_mean_width_is_the_mean_padded_width_of_the_first_epochs_batches(tokenizer, rows):
    cfg = PromptLoaderConfig(batch_size=2, shuffle=True, seed=3)
    loader = PromptLoader(rows, tokenizer, cfg)
    widths = [b["input_ids"].shape[1] for b in PromptLoader(rows, tokenizer, cfg)]
    assert loader.mean_width() == pytest.approx(sum(widths) / len(widths))
    assert loader.epoch == 0  # reading the widths consumes no epoch
    longest = max(len(tokenizer(r["prompt"])["input_ids"]) for r in rows)
    assert loader.mean_width() < longest  # one batch holds only the short prompts
    padded = PromptLoader(
        rows, tokenizer, PromptLoaderConfig(batch_size=2, max_prompt_length=40, pad_to_max_length=True)
    )
    assert padded.mean_width() == 40


def test_loader_drop_last_and_no_shuffle(tokenizer, rows):
    loader = PromptLoader(rows, tokenizer, PromptLoaderConfig(batch_size=2, drop_last=True, shuffle=False))
    batches = list(loader)
    assert len(loader) == len(batches) == 1 and list(batches[0]["uid"]) == ["0", "1"]


def test_batches_split_for_data_parallel_workers(tokenizer, rows):
    batch = tokenize_prompts(rows, tokenizer, 64).pad_to_multiple(2)
    parts = batch.chunk(2)
    assert [len(p) for p in parts] == [2, 2]
    assert list(batch.unpad()["uid"]) == ["0", "1", "mine"]


def test_tokenizer_without_pad_is_refused(rows):
    tok = train_tokenizer()
    tok.pad_token = None
    with pytest.raises(PromptDataError, match="no pad token"):
        tokenize_prompts(rows, tok, 64)
