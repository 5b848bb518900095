"""Load a local Hugging Face causal-LM directory (tokenizer + model), and save one back.

Everything is checked before weights are read, so a wrong path or a wrong kind of model
fails in a second with an error that says what was found and what to do:

- the directory must exist and hold a `config.json`;
- the config must describe a causal LM: its `model_type` must have an
  `AutoModelForCausalLM` class, and its `architectures` (if listed) must include one;
- the tokenizer must have a pad token, or get one by a fix the caller allowed
  (`pad_token="eos"`), and the fix is recorded in `LoadedModel.fixes`.

Saving goes through `save_pretrained`, so a trained model is a normal HF checkpoint.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from workbench import checks
from workbench.errors import ConfigError, WorkbenchError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")


class ModelLoadError(WorkbenchError):
    """A model or tokenizer directory cannot be used; the message names the remedy."""


@dataclass
class LoadConfig:
    """How to load a checkpoint directory."""

    dtype: str = "auto"
    """Parameter dtype: "float32", "bfloat16", "float16", or "auto" = float32 on CPU,
    bfloat16 on a GPU that supports it (float32 otherwise)."""
    device: str = "cpu"
    """Where the model's parameters go after loading."""
    trust_remote_code: bool = False
    """Run Python code shipped inside the checkpoint; only for checkpoints you trust."""
    pad_token: Literal["eos", "refuse"] = "eos"
    """When the tokenizer has no pad token: "eos" reuses the eos token as pad (masks, not
    token ids, then tell padding apart from a real eos), "refuse" raises."""
    attn_implementation: str | None = None
    """Passed to `from_pretrained` ("eager", "sdpa", ...); None keeps transformers' default."""
    compile: bool = False
    """Workers compile the model's forward (`torch.compile`, dynamic shapes) for training and
    scoring: on the 2-core CPU machine a training step takes ~17% less at 10M parameters and
    ~30% less at 1M. The first forwards of each kind (with and without gradients) compile
    first, a minute or more per process, so it pays in long runs. Generation is compiled on
    its own (HFRolloutConfig.compile). Trained models: DeepSpeed ZeRO-1/2 only."""
    gradient_checkpointing: bool = False
    """Trained models recompute each decoder layer's activations in the backward pass instead
    of keeping them (transformers' gradient_checkpointing_enable, non-reentrant): activation
    memory falls from every layer's to about one layer's, for roughly a third more compute per
    step. Only training forwards change; generation and no-grad scoring run as before."""
    compute_dtype: str = "auto"
    """dtype of a trained model's forwards and backwards, while its parameters and optimizer
    state stay in `dtype` (mixed precision): "bfloat16" (FSDP2 casts each layer's parameters
    as it gathers them and reduces gradients in fp32; DeepSpeed runs its bf16 mode), "float32",
    or "auto" = bfloat16 on a GPU that supports it, float32 on CPU. Workers check that their
    device runs bf16 matmuls before they build the engine."""

    def __post_init__(self):
        if not isinstance(self.dtype, torch.dtype):
            checks.one_of(
                "LoadConfig", "dtype", self.dtype, ("auto", *DTYPES), fix=f"use 'auto' or one of {sorted(DTYPES)}"
            )
        checks.one_of(
            "LoadConfig", "pad_token", self.pad_token, ("eos", "refuse"), fix="use 'eos' (reuse eos as pad) or 'refuse'"
        )
        if not isinstance(self.device, str) or not self.device:
            raise ConfigError("LoadConfig.device", self.device, "use a device name such as 'cpu' or 'cuda'")
        checks.of_type("LoadConfig", "compile", self.compile, bool, "use True or False")
        checks.of_type("LoadConfig", "gradient_checkpointing", self.gradient_checkpointing, bool, "use True or False")
        checks.one_of("LoadConfig", "compute_dtype", self.compute_dtype, COMPUTE_DTYPES)


@dataclass
class LoadedModel:
    """A model with its tokenizer and what was done to make them usable."""

    model: Any
    """The `PreTrainedModel` (eval mode)."""
    tokenizer: Any
    """The `PreTrainedTokenizerBase`, with a pad token."""
    path: Path
    """The directory it came from."""
    fixes: list[str] = field(default_factory=list)
    """Human-readable notes of fix-ups applied (e.g. eos used as pad)."""


def for_worker(cfg: LoadConfig, device: str | torch.device, trained: bool) -> LoadConfig:
    """`cfg` for a worker whose device is `device`: its models load there. A trained model keeps
    fp32 parameters under "auto" (the engines' master weights; they compute in bf16 on GPUs)."""
    dtype = "float32" if trained and cfg.dtype == "auto" else cfg.dtype
    return replace(cfg, device=str(device), dtype=dtype)


def compile_forward(model: torch.nn.Module, cfg: LoadConfig) -> torch.nn.Module:
    """`model`, its forward compiled in place when cfg.compile. In place (nn.Module.compile), so
    parameter names, checkpoints and tensors shared with a rollout copy stay as they are."""
    if cfg.compile:
        import torch._dynamo

        # Every model of a process (actor, reference, critic, reward), with and without gradients,
        # shares transformers' forward wrappers, so their graphs share one cache: past dynamo's
        # default limit of 8 it would silently fall back to eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        model.compile(dynamic=True)  # batches change length every iteration: one graph for all
    return model


def check_compiled_training(owner: str, cfg: LoadConfig, backend: str, zero_stage: int) -> None:
    """Compiled training forwards are wired for DeepSpeed ZeRO-1/2, whose engine calls the
    module as it is; FSDP2, ZeRO-3 and tensor parallelism hook into the forward itself."""
    if cfg.compile and not (backend == "deepspeed" and zero_stage < 3):
        raise ConfigError(
            f"{owner}.load.compile",
            True,
            f"compiled training runs with backend='deepspeed' and zero_stage 1 or 2 (here backend="
            f"{backend!r}, zero_stage={zero_stage}); use that backend, or compile=False",
        )


def check_training_precision(owner: str, cfg: LoadConfig, backend: str) -> None:
    """bf16 compute is wired into the FSDP2 and DeepSpeed engines; tensor parallelism trains in
    the parameters' dtype."""
    if cfg.compute_dtype == "bfloat16" and backend == "3d":
        raise ConfigError(
            f"{owner}.load.compute_dtype",
            "bfloat16",
            "backend='3d' computes in the parameters' dtype; use backend 'fsdp' or 'deepspeed' for bf16 "
            "compute, or load.dtype='bfloat16' for bf16 parameters",
        )


def training_dtype(cfg: LoadConfig, device: str | torch.device, owner: str = "LoadConfig") -> torch.dtype:
    """The dtype a trained model computes in on `device` (see LoadConfig.compute_dtype); a
    ConfigError when bfloat16 is asked of a device that cannot run it."""
    device = torch.device(device)
    if cfg.compute_dtype == "float32":
        return torch.float32
    if device.type == "cuda":
        supported = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        if cfg.compute_dtype == "auto" or supported:
            return torch.bfloat16 if supported else torch.float32
        raise ConfigError(
            f"{owner}.load.compute_dtype",
            "bfloat16",
            f"this GPU ({torch.cuda.get_device_name(device)}) has no bf16 support; use 'float32' or 'auto'",
        )
    if cfg.compute_dtype == "auto":
        return torch.float32  # the CPU path is the fp32 correctness reference
    if not cpu_runs_bf16():
        raise ConfigError(
            f"{owner}.load.compute_dtype",
            "bfloat16",
            f"torch {torch.__version__} cannot multiply bf16 matrices on this CPU; use 'float32' or 'auto'",
        )
    return torch.bfloat16


def cpu_runs_bf16() -> bool:
    """Whether a bf16 matmul runs here and agrees with fp32 (builds without bf16 kernels raise)."""
    a = torch.arange(16, dtype=torch.float32).reshape(4, 4) / 16
    try:
        product = (a.bfloat16() @ a.bfloat16()).float()
    except RuntimeError:
        return False
    return bool(torch.allclose(product, a @ a, rtol=2e-2, atol=1e-2))


def enable_gradient_checkpointing(model, cfg: LoadConfig, path: Path | str = "") -> None:
    """Turn on activation recomputation for training forwards when cfg asks (see LoadConfig)."""
    if not cfg.gradient_checkpointing:
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ModelLoadError(
            f"LoadConfig.gradient_checkpointing=True, but the {type(model).__name__} of {str(path)!r} does "
            f"not support gradient checkpointing in transformers; set gradient_checkpointing=False"
        )
    # Non-reentrant: works with FSDP2 and with inputs that do not require gradients (the
    # reentrant variant silently drops parameter gradients when no input requires grad).
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def resolve_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        on_gpu = torch.device(device).type == "cuda" and torch.cuda.is_available()
        return torch.bfloat16 if on_gpu and torch.cuda.is_bf16_supported() else torch.float32
    checks.one_of("LoadConfig", "dtype", dtype, DTYPES, fix=f"use 'auto' or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def check_directory(path: str | os.PathLike) -> Path:
    """The path as a Path, if it is a directory holding a config.json; else a ModelLoadError."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model directory {str(path)!r} does not exist. Point at a local Hugging Face "
            f"checkpoint directory (one with config.json), or make a tiny one with "
            f"workbench.models.make_tiny('1m', {str(path)!r}). Nothing is downloaded from a hub."
        )
    if not path.is_dir():
        raise ModelLoadError(f"{str(path)!r} is a file, not a model directory (a folder with config.json)")
    if not (path / "config.json").exists():
        found = sorted(os.listdir(path))[:10]
        raise ModelLoadError(
            f"{str(path)!r} is not a Hugging Face checkpoint: it has no config.json "
            f"(found {found}). Save models with model.save_pretrained(dir)."
        )
    return path


def load_config(path: str | os.PathLike, trust_remote_code: bool = False):
    """The checkpoint's config, checked to be a causal LM."""
    config = read_config(path, trust_remote_code)
    check_causal_lm(config, path)
    return config


def read_config(path: str | os.PathLike, trust_remote_code: bool = False):
    """The checkpoint's config, whatever its head (a causal LM, or a saved value model of one):
    what layout checks read its shapes from."""
    from transformers import AutoConfig

    path = check_directory(path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as error:  # unknown model_type, or custom code not trusted
        raise ModelLoadError(
            f"cannot read the config of {str(path)!r}: {error}\nIf this checkpoint ships its "
            f"own modelling code, pass LoadConfig(trust_remote_code=True) (only for code you trust)."
        ) from error
    return config


def check_causal_lm(config, path: Path | str = "") -> None:
    """Raise ModelLoadError unless `config` describes a model AutoModelForCausalLM can build."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    architectures = list(getattr(config, "architectures", None) or [])
    # A trusted checkpoint with its own code declares its causal-LM class in auto_map.
    remote = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    known = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or remote
    causal_arch = [a for a in architectures if a.endswith(("ForCausalLM", "LMHeadModel"))]
    if known and (not architectures or causal_arch):
        return
    examples = ", ".join(["llama", "qwen2", "mistral", "gpt2"])
    raise ModelLoadError(
        f"{str(path)!r} is not a causal language model: config.json has model_type={model_type!r} "
        f"and architectures={architectures}. Expected a model_type with an AutoModelForCausalLM "
        f"class (e.g. {examples}) and an architecture named *ForCausalLM or *LMHeadModel. "
        f"Use a decoder-only checkpoint, or workbench.models.make_tiny(...)."
    )


def load_tokenizer(path: str | os.PathLike, cfg: LoadConfig | None = None):
    """The tokenizer of a checkpoint directory, with a pad token (see LoadConfig.pad_token).

    Returns (tokenizer, fixes) where fixes lists what was changed.
    """
    from transformers import AutoTokenizer

    cfg = cfg or LoadConfig()
    path = check_directory(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, TypeError) as error:
        raise ModelLoadError(
            f"cannot load a tokenizer from {str(path)!r} ({error}). A checkpoint needs its "
            f"tokenizer files (tokenizer.json / tokenizer_config.json): save them with "
            f"tokenizer.save_pretrained(dir)."
        ) from error
    return tokenizer, ensure_pad_token(tokenizer, cfg.pad_token, path)


def ensure_pad_token(tokenizer, policy: Literal["eos", "refuse"] = "eos", path: Path | str = "") -> list[str]:
    """Give `tokenizer` a pad token if it lacks one and the policy allows; return the fixes."""
    if tokenizer.pad_token is not None:
        return []
    how_to_fix = (
        "Fix it with LoadConfig(pad_token='eos') (reuse eos as pad), or add a real pad token: "
        "tokenizer.add_special_tokens({'pad_token': '<pad>'}); model.resize_token_embeddings("
        "len(tokenizer)); then save both with save_pretrained."
    )
    checks.one_of("LoadConfig", "pad_token", policy, ("eos", "refuse"))
    if policy == "refuse":
        raise ModelLoadError(f"the tokenizer of {str(path)!r} has no pad token. {how_to_fix}")
    if tokenizer.eos_token is None:
        raise ModelLoadError(f"the tokenizer of {str(path)!r} has neither a pad nor an eos token. {how_to_fix}")
    tokenizer.pad_token = tokenizer.eos_token
    fix = (
        f"tokenizer of {str(path)!r} had no pad token: using eos {tokenizer.eos_token!r} "
        f"(id {tokenizer.eos_token_id}) as pad; padding is marked by attention masks"
    )
    warnings.warn(fix, stacklevel=3)
    return [fix]


def load(path: str | os.PathLike, cfg: LoadConfig | None = None) -> LoadedModel:
    """Tokenizer + causal LM from a local directory, checked first, in eval mode on cfg.device."""
    from transformers import AutoModelForCausalLM

    cfg = cfg or LoadConfig()
    path = check_directory(path)
    load_config(path, cfg.trust_remote_code)
    tokenizer, fixes = load_tokenizer(path, cfg)
    kwargs = {"attn_implementation": cfg.attn_implementation} if cfg.attn_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=resolve_dtype(cfg.dtype, cfg.device), trust_remote_code=cfg.trust_remote_code, **kwargs
    )
    model.to(cfg.device).eval()
    enable_gradient_checkpointing(model, cfg, path)
    # Generation and loss code read pad ids from the model; keep them in step with the tokenizer.
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return LoadedModel(model, tokenizer, path, fixes)


def save(model, tokenizer, path: str | os.PathLike) -> Path:
    """Write model (safetensors) and tokenizer as a normal Hugging Face checkpoint directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ---- driver-side checks: before any worker starts ------------------------------------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_checked: dict[tuple, int | None] = {}


def check_model_dir(
    path: str | os.PathLike, field: str, head: Literal["causal", "value"] = "causal", trust_remote_code: bool = False
) -> int | None:
    """On the driver, in well under a second: `path` exists, is a decoder-only causal LM (a
    saved value model of one, for head="value"), and holds its tokenizer. Returns the model's
    position limit (None when its config names none). `field` names the setting in errors."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ModelLoadError(f"{field}={path!r}: give the path of a local Hugging Face checkpoint directory")
    try:
        path = check_directory(path)
    except ModelLoadError as error:
        raise ModelLoadError(f"{field}: {error}") from None
    stamp = (str(path.resolve()), head, (path / "config.json").stat().st_mtime_ns)
    if stamp in _checked:
        return _checked[stamp]
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as error:
        raise ModelLoadError(f"{field}: cannot read the config of {str(path)!r}: {error}") from error
    model_type = getattr(config, "model_type", None)
    architectures = list(getattr(config, "architectures", None) or [])
    remote = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    decoder_only = remote or (
        model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES  # bert, roberta, ...: bidirectional
        and not getattr(config, "is_encoder_decoder", False)
    )
    heads = ("ForCausalLM", "LMHeadModel") + (("ForTokenClassification",) if head == "value" else ())
    if not decoder_only or (architectures and not any(a.endswith(heads) for a in architectures)):
        use = "an actor or reference" if head == "causal" else "a critic, reward or cost model"
        raise ModelLoadError(
            f"{field}={str(path)!r} is not a decoder-only causal language model (model_type="
            f"{model_type!r}, architectures={architectures}); {use} needs causal attention "
            f"(e.g. llama, qwen2, mistral, gpt2). An encoder such as BERT attends to later "
            f"tokens, so its log-probs/values would see the future. Use a decoder-only checkpoint "
            f"or workbench.models.make_tiny(...)."
        )
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{field}={str(path)!r} has no tokenizer (none of {list(TOKENIZER_FILES)}); save it "
            f"next to the weights with tokenizer.save_pretrained(dir)."
        )
    limit = next(
        (getattr(config, name) for name in POSITION_FIELDS if isinstance(getattr(config, name, None), int)), None
    )
    _checked[stamp] = limit
    return limit


def check_positions(limit: int | None, prompt_length: int, max_new_tokens: int, field: str, path: str) -> None:
    """Refuse prompts + responses longer than the model's positions (they would come back empty)."""
    if limit is not None and prompt_length + max_new_tokens > limit:
        raise ModelLoadError(
            f"prompts of {prompt_length} tokens + max_new_tokens={max_new_tokens} = "
            f"{prompt_length + max_new_tokens} exceed the {limit} positions of {field}={path!r}; "
            f"shorten the prompts (max_prompt_length) or lower SamplingConfig.max_new_tokens"
        )
