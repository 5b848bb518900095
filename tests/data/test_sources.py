"""Prompt sources in the ecosystem's formats (verl Parquet, Hugging Face datasets), column
mappings, extra columns through Batches and rollout logs, and the held-out split."""

import json
import pickle
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from workbench.data import Batch, PromptDataError, load_prompts, split_held_out, tokenize_prompts, write_jsonl
from workbench.models import train_tokenizer
from workbench.run.logs import rollout_rows

datasets = pytest.importorskip("datasets")


def verl_rows(n=3):
    """Rows as verl's data preprocessing writes them (examples/data_preprocess/gsm8k.py)."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": i, "answer": f"{i} + 1 = {i + 1}", "question": f"{i} + 1"},
        }
        for i in range(n)
    ]


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Every source here is local: a connection attempt fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a prompt source tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def plain(value):
    """True when value holds only plain Python (no numpy or pyarrow objects)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(plain(v) for v in value)
    return value is None or type(value) in (str, int, float, bool)


def test_verl_parquet_loads_with_no_mapping(tmp_path):
    pq.write_table(pa.Table.from_pylist(verl_rows()), tmp_path / "train.parquet")
    rows = load_prompts(tmp_path / "train.parquet")
    assert [r["ground_truth"] for r in rows] == ["1", "2", "3"]
    assert rows[0]["prompt"] == [{"role": "user", "content": "What is 0 + 1?"}]
    assert rows[2]["extra_info"] == verl_rows()[2]["extra_info"] and rows[0]["data_source"] == "openai/gsm8k"
    assert rows[0]["reward_model"] == {"style": "rule", "ground_truth": "1"}  # a nested source stays
    assert list(rows[0]) == ["prompt", "ground_truth", "data_source", "ability", "reward_model", "extra_info"]
    assert all(plain(r) for r in rows)


def test_saved_dataset_and_dataset_dict_split(tmp_path):
    data = datasets.Dataset.from_list(verl_rows(2))
    data.save_to_disk(str(tmp_path / "one"))
    assert [r["ground_truth"] for r in load_prompts(tmp_path / "one")] == ["1", "2"]
    test = datasets.Dataset.from_list([{"question": "2+2?", "answer": 4, "metadata": {"level": [1, 2]}}])
    datasets.DatasetDict({"train": data, "test": test}).save_to_disk(str(tmp_path / "both"))
    rows = load_prompts(tmp_path / "both", {"prompt": "question", "ground_truth": "answer"}, split="test")
    assert rows == [{"prompt": "2+2?", "ground_truth": "4", "metadata": {"level": [1, 2]}}]
    assert len(load_prompts(tmp_path / "both")) == 2  # "train" by default
    with pytest.raises(PromptDataError, match=r"no split 'dev'; its splits are \['train', 'test'\]"):
        load_prompts(tmp_path / "both", split="dev")


def test_folder_and_files_through_load_dataset(tmp_path):
    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(verl_rows(2)), tmp_path / "data" / "train-0.parquet")
    rows = load_prompts(tmp_path / "data")
    assert [r["ground_truth"] for r in rows] == ["1", "2"] and rows[1]["extra_info"]["index"] == 1
    (tmp_path / "gsm.csv").write_text("question,answer,level\nHow many?,18,3\n")
    assert load_prompts(tmp_path / "gsm.csv", prompt_key="question", ground_truth_key="answer") == [
        {"prompt": "How many?", "ground_truth": "18", "level": 3}
    ]
    (tmp_path / "nothing").mkdir()
    with pytest.raises(PromptDataError, match="no data files datasets reads; use .jsonl or .parquet"):
        load_prompts(tmp_path / "nothing")


def test_dotted_mapping(tmp_path):
    rows = [{"q": {"text": "Q: 1+1=? A:"}, "meta": {"answers": {"final": 2}}, "id": 7}]
    path = write_jsonl(rows, tmp_path / "nested.jsonl")
    loaded = load_prompts(path, {"prompt": "q.text", "ground_truth": "meta.answers.final"})
    assert loaded == [{"prompt": "Q: 1+1=? A:", "ground_truth": "2", **rows[0]}]


def test_missing_dotted_path_names_what_was_found_and_the_fix(tmp_path):
    pq.write_table(pa.Table.from_pylist(verl_rows(2)), tmp_path / "train.parquet")
    expected = (
        r"train.parquet' row 0: missing column 'reward_model.answer'; keys found in 'reward_model': "
        r"\['ground_truth', 'style'\]\. .*data.columns.ground_truth=\.\.\. in a run config, or "
        r"load_prompts\(path, columns=\{'ground_truth': \.\.\.\}\)"
    )
    with pytest.raises(PromptDataError, match=expected):
        load_prompts(tmp_path / "train.parquet", {"ground_truth": "reward_model.answer"})
    with pytest.raises(PromptDataError, match=r"missing column 'extra_info.index.value'; 'extra_info.index' is int"):
        load_prompts(tmp_path / "train.parquet", {"ground_truth": "extra_info.index.value"})
    path = write_jsonl([{"prompt": "a", "answer": "1"}], tmp_path / "x.jsonl")
    with pytest.raises(PromptDataError, match=r"'ground_truth' \(nor verl's 'reward_model.ground_truth'\)"):
        load_prompts(path)
    with pytest.raises(
        PromptDataError, match=r"unknown key\(s\) \['answer'\]; the keys are \['prompt', 'ground_truth'\]"
    ):
        load_prompts(path, {"answer": "answer"})
    with pytest.raises(PromptDataError, match="ground_truth is mapped twice"):
        load_prompts(path, {"ground_truth": "answer"}, ground_truth_key="other")


def test_jsonl_rows_with_different_keys_get_the_same_keys(tmp_path):
    rows = [{"prompt": "a", "ground_truth": 1, "uid": "u0"}, {"prompt": "b", "ground_truth": "2", "level": 3}]
    loaded = load_prompts(write_jsonl(rows, tmp_path / "mixed.jsonl"))
    assert loaded == [
        {"prompt": "a", "ground_truth": "1", "uid": "u0", "level": None},
        {"prompt": "b", "ground_truth": "2", "uid": None, "level": 3},
    ]
    assert list(loaded[0]) == list(loaded[1])


def test_extra_columns_ride_in_the_batch(tokenizer, tmp_path):
    pq.write_table(pa.Table.from_pylist(verl_rows(3)), tmp_path / "train.parquet")
    rows = load_prompts(tmp_path / "train.parquet")
    for row in rows:  # the tiny tokenizer has no chat template: ask in text
        row["prompt"] = row["prompt"][0]["content"]
    batch = tokenize_prompts(rows, tokenizer, 32)
    assert batch.columns.keys() == {
        "prompt", "ground_truth", "uid", "data_source", "ability", "reward_model", "extra_info"
    }  # fmt: skip
    assert list(batch.columns)[:3] == ["prompt", "ground_truth", "uid"]
    assert batch["extra_info"][1] == rows[1]["extra_info"]
    twice = batch.repeat(2)
    assert [e["index"] for e in twice["extra_info"]] == [0, 0, 1, 1, 2, 2]
    joined = Batch.concat([batch[:1], batch[1:]])
    assert joined.equals(batch) and joined.union(batch).equals(batch)
    again = pickle.loads(pickle.dumps(twice))
    assert again.equals(twice) and list(again["reward_model"]) == list(twice["reward_model"])
    assert batch.unpad().equals(batch.pad_to_multiple(2).unpad())


def test_uid_column_and_names_that_would_shadow_batch_fields(tokenizer):
    rows = [{"prompt": "a", "ground_truth": "1", "uid": None}, {"prompt": "b", "ground_truth": "2", "uid": "x"}]
    assert list(tokenize_prompts(rows, tokenizer, 16)["uid"]) == ["0", "x"]
    for name, maker in (("scores", "reward"), ("input_ids", "tokenize_prompts"), ("is_padding", "tokenize_prompts")):
        with pytest.raises(PromptDataError, match=f"prompt column '{name}' has the name of a field '{maker}' adds"):
            tokenize_prompts([{"prompt": "a", "ground_truth": "1", name: 0}], tokenizer, 16)


def test_split_held_out_is_seeded_and_disjoint():
    rows = [{"prompt": f"q{i % 15}", "ground_truth": str(i)} for i in range(20)]  # q0..q4 asked twice
    train, held = split_held_out(rows, 0.25, seed=3)
    assert len(held) == 5 and (train, held) == split_held_out(rows, 0.25, seed=3)
    assert split_held_out(rows, 0.25, seed=4)[1] != held
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    held_ids = {r["ground_truth"] for r in held}
    duplicates = [r for r in rows if r["ground_truth"] not in held_ids and r["prompt"] in {h["prompt"] for h in held}]
    assert len(train) == 20 - 5 - len(duplicates)
    chats = [{"prompt": [{"role": "user", "content": "same"}], "ground_truth": str(i)} for i in range(4)]
    with pytest.raises(PromptDataError, match=r"leaves the training side empty.*data.eval_file"):
        split_held_out(chats, 0.5)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_split_held_out_refuses_a_fraction_outside_0_1(fraction):
    with pytest.raises(PromptDataError, match=rf"data.eval_fraction={fraction} must lie strictly between 0 and 1"):
        split_held_out([{"prompt": "a"}, {"prompt": "b"}], fraction)


def test_split_held_out_refuses_an_empty_held_out_side():
    rows = [{"prompt": f"q{i}"} for i in range(10)]
    with pytest.raises(PromptDataError, match=r"data.eval_fraction=0.01 of 10 rows leaves the held-out side empty"):
        split_held_out(rows, 0.01)


def test_rollout_rows_carry_extra_columns(tokenizer):
    rows = [
        {"prompt": "Q: 1+1=? A:", "ground_truth": "2", "data_source": "arith", "extra_info": {"index": 0, "tag": b"x"}},
        {"prompt": "Q: 2+2=? A:", "ground_truth": "4", "data_source": "arith", "extra_info": {"index": 1, "tag": None}},
    ]
    prompts = tokenize_prompts(rows, tokenizer, 16)
    responses = torch.tensor([tokenizer(" 2", add_special_tokens=False)["input_ids"]] * 2)
    batch = Batch(
        {
            "input_ids": torch.cat([prompts["input_ids"], responses], dim=1),
            "attention_mask": torch.cat([prompts["attention_mask"], torch.ones_like(responses)], dim=1),
            "responses": responses,
            "response_mask": torch.ones_like(responses),
            "scores": torch.tensor([1.0, 0.0]),
        },
        {**prompts.columns, "response_text": [" 2", " 2"], "messages": ["not this", "not this"]},
    )
    logged = rollout_rows(batch, tokenizer, iteration=3)
    assert logged[0]["data_source"] == "arith" and logged[1]["extra_info"] == {"index": 1, "tag": None}
    assert logged[0]["extra_info"] == {"index": 0, "tag": "b'x'"}  # json cannot write bytes: text
    assert logged[0]["prompt"] == "Q: 1+1=? A:" and logged[0]["response"] == " 2" and logged[0]["ground_truth"] == "2"
    assert "response_text" not in logged[0] and "messages" not in logged[0]  # never over its own keys
    json.dumps(logged)
