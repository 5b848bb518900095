"""A headless run on a chat model (the tiny kit with ChatML, the shared Ray session): the
arithmetic_chat task's prompts go through the template, generation ends at <|im_end|>, the reward
reads the assistant's text, the rollout log shows the conversation, and every metrics row holds
each role's peak memory per process."""

import json

import pytest

from tests.chat_kit import END_OF_TURN, make_tiny_chat
from widgets.inspector import BatchInspector
from workbench.run.config import load_config
from workbench.run.runner import Runner


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, shared_session):
    model = make_tiny_chat(tmp_path_factory.mktemp("chat-kit") / "tiny-chat")
    out = tmp_path_factory.mktemp("chat-run")
    config = load_config(
        None,
        [
            f"model.path={model}",
            f"logging.output_dir={out}",
            "iterations=1",
            "algorithm.name=ppo",
            "data.task=arithmetic_chat",
            "data.held_out=harder",
            "data.train_size=16",
            "data.eval_size=4",
            "data.loader.batch_size=4",
            "data.loader.max_prompt_length=160",  # the kit's tokenizer spends ~100 tokens on the chat
            "sampling.n=2",
            "sampling.max_new_tokens=4",
            "actor.mini_batch_size=8",
            "actor.micro_batch_size=8",
            "critic.mini_batch_size=8",
            "critic.micro_batch_size=8",
            "actor.load.gradient_checkpointing=true",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.rollouts_every=1",
            "logging.rollout_rows=0",
            "evaluation.every=1",
            "evaluation.at_start=false",
            "checkpoint.every=0",
            "faults.max_recoveries=0",
        ],
    )
    batches = []
    result = Runner(config, session=shared_session, callbacks=[lambda algo, batch, m: batches.append(batch)]).run()
    return out, result, batches[0]


def test_the_rollout_log_shows_the_conversation_and_the_assistants_text(chat_run):
    out, _, _ = chat_run
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    for row in rows:
        user, assistant = row["messages"]  # no system line of the task's own
        assert user["role"] == "user" and user["content"].startswith("What is ")
        assert assistant == {"role": "assistant", "content": row["response"]}
        assert END_OF_TURN not in row["response"]  # the end of turn ends the response, it is not text
        assert row["prompt"].startswith("<|im_start|>") and row["prompt"].endswith("<|im_start|>assistant\n")


def test_rewards_read_the_assistants_text_and_the_inspector_shows_turns(chat_run):
    _, _, batch = chat_run
    from workbench.data.arithmetic_chat import score

    texts, truths = list(batch["response_text"]), list(batch["ground_truth"])
    assert batch["scores"].tolist() == [score(t, g) for t, g in zip(texts, truths)]
    html = BatchInspector(batch, sort="none").summary()
    assert "<b>user:</b> What is" in html and "<b>assistant:</b>" in html


def test_every_metrics_row_reports_each_roles_peak_memory_per_process(chat_run):
    _, result, _ = chat_run
    (row,) = result.history
    memory = {k: v for k, v in row.items() if k.startswith("perf/peak_rss_gib/")}
    assert set(memory) == {"perf/peak_rss_gib/actor/rank0", "perf/peak_rss_gib/critic/rank0"}
    assert all(0.05 < v < 64 for v in memory.values())  # GiB: a real process's resident peak
    assert "eval/score" in row
