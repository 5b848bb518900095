import pytest

from workbench.planner import (
    MODEL_PRESETS,
    ModelSpec,
    NoMeshError,
    UnknownPresetError,
    Workload,
    cluster_preset,
    dataflow_preset,
    model_preset,
)


@pytest.mark.parametrize(
    "name,billions", [("llama2-7b", 6.74), ("llama2-13b", 13.02), ("llama2-34b", 33.7), ("llama2-70b", 68.98)]
)
def test_llama_param_counts_match_published_sizes(name, billions):
    assert model_preset(name).param_count / 1e9 == pytest.approx(billions, rel=0.01)


@pytest.mark.parametrize("size", ["1m", "10m", "30m"])
def test_tiny_presets_are_the_kits_models(size):
    from workbench.models import count_parameters, tiny_config, train_tokenizer

    tokenizer = train_tokenizer()
    kit = ModelSpec.from_hf_config(tiny_config(size, tokenizer), f"tiny-{size}")
    assert model_preset(f"tiny-{size}") == kit
    assert kit.param_count == count_parameters(size, tokenizer)


def test_value_head_drops_lm_head():
    m = model_preset("llama2-7b")
    v = m.as_value_model()
    assert v.value_head and v.param_count == m.param_count - m.vocab * m.hidden + m.hidden
    assert v.as_value_model() is v


def test_unknown_presets_list_the_known_ones():
    with pytest.raises(UnknownPresetError, match="llama2-7b") as e:
        model_preset("llama3-8b")
    assert set(e.value.known) == set(MODEL_PRESETS)
    with pytest.raises(UnknownPresetError, match="a100_80g, h100, h200, local"):
        cluster_preset("tpu")
    with pytest.raises(UnknownPresetError, match="grpo, ppo, reinforce_pp, remax, rloo, safe_rlhf"):
        dataflow_preset("dpo")


def test_cluster_presets_sizes():
    c = cluster_preset("a100_80g", 64)
    assert (c.n_nodes, c.devices_per_node, c.n_devices) == (8, 8, 64)
    assert c.intra_node_bandwidth == 600e9 and c.inter_node_bandwidth * 8 == 200e9
    assert cluster_preset("h200", n_nodes=2).device_memory == 141e9
    assert cluster_preset("a100_80g", 4).devices_per_node == 4
    local = cluster_preset("local")
    assert not local.calibrated and "UNCALIBRATED" in local.note


def test_cluster_size_no_mesh_covers():
    with pytest.raises(NoMeshError, match="12 is not covered") as e:
        cluster_preset("a100_80g", 12)
    assert 16 in e.value.valid and 4 in e.value.valid


def test_workload_defaults_are_the_paper_setting():
    wl = Workload()
    assert (wl.batch_size, wl.prompt_len, wl.max_new_tokens, wl.epochs, wl.mini_batches) == (
        1024,
        1024,
        1024,
        1,
        8,
    )
