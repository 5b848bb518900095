import pytest
import torch
from transformers import AutoTokenizer, BertConfig, LlamaForCausalLM, T5Config

from workbench.models import LoadConfig, ModelLoadError, load, load_tokenizer, resolve_dtype, save


def test_load_gives_eval_fp32_model_and_tokenizer(tiny_dir):
    lm = load(tiny_dir)
    assert isinstance(lm.model, LlamaForCausalLM) and not lm.model.training
    assert lm.model.dtype == torch.float32 and lm.fixes == []
    assert lm.tokenizer.pad_token == "<pad>"


def test_dtype_choice(tiny_dir):
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert load(tiny_dir, LoadConfig(dtype="bfloat16")).model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float32"):
        resolve_dtype("fp8")


def test_save_then_load_gives_identical_logits(tiny_dir, tmp_path):
    lm = load(tiny_dir)
    with torch.no_grad():  # change the weights so the test is not comparing to the init
        for p in lm.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    batch = lm.tokenizer(["Q: 12+7=? A: 19", "Q: 3*4=? A:"], return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = lm.model(**batch).logits
    out = save(lm.model, lm.tokenizer, tmp_path / "trained")
    again = load(out)
    with torch.no_grad():
        got = again.model(**batch).logits
    assert torch.equal(got, expected)
    assert again.tokenizer.get_vocab() == lm.tokenizer.get_vocab()


def test_missing_directory_is_named_with_a_remedy(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist.*make_tiny"):
        load(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="no config.json.*weights.bin"):
        load(tmp_path)


@pytest.mark.parametrize(
    "config, found",
    [
        (T5Config(architectures=["T5ForConditionalGeneration"]), "model_type='t5'"),
        # bert has an LM-head class, but this checkpoint is a classifier
        (BertConfig(architectures=["BertForSequenceClassification"]), "BertForSequenceClassification"),
    ],
)
def test_not_a_causal_lm_names_what_was_found(tmp_path, config, found):
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="not a causal language model") as info:
        load(tmp_path)
    assert found in str(info.value) and "ForCausalLM" in str(info.value)


def test_unknown_model_type_points_at_trust_remote_code(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "my_private_lm", "architectures": ["MyLM"]}')
    with pytest.raises(ModelLoadError, match="trust_remote_code=True"):
        load(tmp_path)


@pytest.fixture
def no_pad_dir(tiny_dir, tmp_path):
    """The tiny checkpoint with its tokenizer's pad token removed."""
    lm = load(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir, pad_token=None)
    assert tok.pad_token is None
    lm.model.config.pad_token_id = None
    lm.model.generation_config.pad_token_id = None
    return save(lm.model, tok, tmp_path / "nopad")


def test_missing_pad_token_fixed_with_eos_and_reported(no_pad_dir):
    with pytest.warns(UserWarning, match="no pad token"):
        lm = load(no_pad_dir)
    assert lm.tokenizer.pad_token == lm.tokenizer.eos_token == "</s>"
    assert lm.model.config.pad_token_id == lm.tokenizer.eos_token_id
    assert len(lm.fixes) == 1 and "eos" in lm.fixes[0]


def test_missing_pad_token_refused_with_the_fix_named(no_pad_dir):
    with pytest.raises(ModelLoadError, match="no pad token.*pad_token='eos'.*add_special_tokens"):
        load_tokenizer(no_pad_dir, LoadConfig(pad_token="refuse"))


def test_checkpoint_without_tokenizer_files(tiny_dir, tmp_path):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    with pytest.raises(ModelLoadError, match="tokenizer.*save_pretrained"):
        load(tmp_path)
