"""Load tokenizers and models from local Hugging Face folders (or hub ids when online).

Local folders never touch the network (`local_files_only=True`), so offline runs do not stall on a hub
lookup (DeepSpeedExamples #511). Weights are read by transformers from safetensors (or its own safe
`torch.load(weights_only=True)` path for .bin files); `trust_remote_code` is only ever the user's choice.

A hub id is checked once before anything loads (`check_model_source`): huggingface_hub's downloads retry a failed
connection five times per file with backoff, so a name that is no folder, on a machine without network, waited
~50 s and then failed as "no usable tokenizer".
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from huggingface_hub import HfApi, constants, is_offline_mode, try_to_load_from_cache
from huggingface_hub.errors import HFValidationError, HfHubHTTPError, RepositoryNotFoundError
from safetensors import SafetensorError
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          GenerationConfig)

from rlhfkit.config.schema import LoadConfig
from rlhfkit.engine.storage import set_for_training
from rlhfkit.errors import ModelError
from rlhfkit.models.fetch import fetch_hint
from rlhfkit.run_files import final_dir

# what a folder that cannot be loaded raises: missing or unreadable files, bad configs, damaged weights
LOAD_ERRORS = (OSError, ValueError, SafetensorError)
# config.json key: how the folder's training rendered its rows ("chat" or "plain"); sft, rm, dpo and ppo write it
TEMPLATE_KEY = "rlhfkit_template"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}
# A folder holding none of these has no tokenizer (fast, sentencepiece, BPE vocab, or a config naming one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "vocab.txt")
# the one request that tells whether the hub has a model: long enough for a slow link, short enough to wait for
HUB_PROBE_TIMEOUT_S = 3


def _is_local(name: str) -> bool:
    """A local path, not a hub id: it exists, starts like a path, has more parts than a hub id's
    `namespace/name`, or its first part is a local folder (`runs/typo` where `runs/` exists). A mistyped local
    path is then reported as missing at once instead of being looked up on the hub."""
    parts = name.split("/")
    return (Path(name).exists() or name.startswith((".", "/", "~")) or "\\" in name or len(parts) > 2
            or (len(parts) == 2 and Path(parts[0]).is_dir()))


def _source_kwargs(name: str, opts: LoadConfig) -> dict:
    """Check a model/tokenizer source exists and build the common from_pretrained kwargs."""
    kwargs = {"trust_remote_code": opts.trust_remote_code}
    if _is_local(name):
        path = Path(name).expanduser()
        if not path.is_dir():
            raise ModelError(f"model folder '{name}' does not exist")
        kwargs["local_files_only"] = True
    elif is_offline_mode() and not _in_hub_cache(name):
        raise ModelError(f"'{name}' is not a folder, and HF_HUB_OFFLINE is set (the hub is not asked, and its cache "
                         f"has no copy){fetch_hint(None, name)}")
    return kwargs


def _in_hub_cache(name: str) -> bool:
    """A copy of hub model `name` is in huggingface_hub's cache (what transformers loads offline)."""
    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except HFValidationError:  # not a hub id at all
        return False


def check_model_source(key: str | None, name: str) -> None:
    """Before anything loads: ModelError naming config key `key` (None: a command's argument, `chat MODEL_DIR`)
    when `name` is neither a folder nor a model the hub gives. Offline (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE, as
    huggingface_hub reads them) a hub id must be in the hub's cache and nothing is asked; online one request
    (`HfApi.model_info`, which does not retry) tells an unreachable hub or an unknown name at once. Whatever the hub
    answers otherwise is left to transformers."""
    if _is_local(name):
        _source_kwargs(name, LoadConfig())  # a missing folder
        return
    setting = f"config key '{key}': " if key else ""
    cached = _in_hub_cache(name)
    if is_offline_mode():
        if not cached:
            raise ModelError(f"{setting}'{name}' is not a folder, and HF_HUB_OFFLINE is set (the hub is "
                             f"not asked, and its cache has no copy){fetch_hint(key, name)}")
        return
    try:
        HfApi().model_info(name, timeout=HUB_PROBE_TIMEOUT_S)
    except HFValidationError:
        raise ModelError(f"{setting}'{name}' is neither a folder nor a hub id (namespace/name)"
                         f"{fetch_hint(key, name)}") from None
    except RepositoryNotFoundError:
        raise ModelError(f"{setting}'{name}' is not a folder, and the hub ({constants.ENDPOINT}) has no "
                         f"model of that name (or it is private: log in with hf auth login){fetch_hint(key, name)}") \
            from None
    except HfHubHTTPError:  # the hub answered: loading says what it means
        return
    except Exception as exc:  # no answer (no network, refused, timed out): the downloads would retry and fail
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no answer'}"
        if cached:
            raise ModelError(f"{setting}'{name}' is in the hub's cache, but the hub ({constants.ENDPOINT}) "
                             f"is not reachable ({why}): put HF_HUB_OFFLINE=1 before the command to load the cached "
                             f"copy without waiting on retries") from None
        raise ModelError(f"{setting}'{name}' is not a folder, and the hub ({constants.ENDPOINT}) is not "
                         f"reachable ({why}; HF_HUB_OFFLINE=1 before the command skips it){fetch_hint(key, name)}") \
            from None


def load_tokenizer(name: str, opts: LoadConfig | None = None, padding_side: str = "right"):
    """Load a tokenizer and make sure it can pad.

    A tokenizer without a pad token gets `opts.pad_token` if set, else its EOS token. Padding with EOS is
    safe here because every consumer masks with the attention mask and finds the last real token from it,
    never by searching for the first pad id (TRL #2778, OpenRLHF #238).
    """
    opts = opts or LoadConfig()
    source = opts.tokenizer or name
    kwargs = _source_kwargs(source, opts)
    folder = Path(source).expanduser()
    if kwargs.get("local_files_only") and not (folder / "config.json").is_file() \
            and (final_dir(folder) / "config.json").is_file():
        raise ModelError(f"'{source}' is a run folder, not a model folder: pass '{final_dir(folder)}', the model the "
                         f"run exported")
    if kwargs.get("local_files_only") and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        # transformers' own error here is a confusing "Couldn't instantiate the backend tokenizer"
        raise ModelError(f"model folder '{source}' has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                         f"copy the tokenizer files of its base model there, or set load.tokenizer to a folder "
                         f"that has them")
    try:
        tok = AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelError(f"no usable tokenizer in '{source}': {str(exc).splitlines()[0]} "
                         f"(set load.tokenizer to a folder that has one)") from None
    # EOS first: without it responses could never end, and no pad fallback exists either
    if tok.eos_token_id is None:
        missing = "no EOS token" + (" and no pad token" if tok.pad_token is None else "")
        raise ModelError(f"tokenizer in '{source}' has {missing}: responses could never end; set eos_token in its "
                         f"tokenizer_config.json")
    if tok.pad_token is None:
        if opts.pad_token is not None:
            tok.add_special_tokens({"pad_token": opts.pad_token})
        else:
            tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    # rlhfkit encodes whole rows and cuts them to data.max_length itself: transformers' "Token indices sequence
    # length is longer than the specified maximum" (on the first long row) would warn of an error that never comes
    if isinstance(getattr(tok, "deprecation_warnings", None), dict):
        tok.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tok


def load_generation_config(name: str, opts: LoadConfig | None = None):
    """The folder's generation_config.json; without one, the generation config transformers derives from its
    config.json when it loads the model (whose `eos_token_id` may list an end-of-turn token too); None when
    neither can be read. Its `eos_token_id` lists the ids a chat model stops at, read before the model loads so
    that data is rendered to end where rollouts stop (`data.templates.end_token_ids`)."""
    kwargs = _source_kwargs(name, opts or LoadConfig())
    local = kwargs.get("local_files_only", False)
    try:
        return GenerationConfig.from_pretrained(name, local_files_only=local)
    except (OSError, ValueError):
        pass
    try:
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(name, **kwargs))
    except (OSError, ValueError):
        return None


def template_mode(mode: str, name: str, opts: LoadConfig | None, tokenizer) -> str:
    """`data.template` for training or chatting with the model in `name`: `mode`, except that `auto` follows the
    folder's recorded training when it was `plain` on a tokenizer that has a chat template (auto would render
    chat turns the model never saw)."""
    if mode != "auto" or not getattr(tokenizer, "chat_template", None):
        return mode
    try:
        config = AutoConfig.from_pretrained(name, **_source_kwargs(name, opts or LoadConfig()))
    except LOAD_ERRORS:
        return mode  # loading the model says what is wrong
    return "plain" if getattr(config, TEMPLATE_KEY, None) == "plain" else mode


def record_template(model, name: str) -> None:
    """Write how the rows were rendered into the model's config, exported into final/config.json."""
    from rlhfkit.lora import base_model

    setattr(base_model(model).config, TEMPLATE_KEY, name)


def _prepare(model, opts: LoadConfig, tokenizer=None):
    if opts.disable_dropout:
        disable_dropout(model)
    if tokenizer is not None:
        if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(len(tokenizer))
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
    if opts.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.24's name (the old one goes in v6)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        set_for_training(model.config, "use_cache", False)
    return model


def causal_lm_config(name: str, opts: LoadConfig | None = None):
    """The folder's config, refused when it is a reward model's or critic's: transformers would load one as a
    causal LM, dropping its score head and drawing a fresh LM head where the embeddings are untied."""
    try:
        config = AutoConfig.from_pretrained(name, **_source_kwargs(name, opts or LoadConfig()))
    except LOAD_ERRORS as exc:
        raise ModelError(f"cannot load a causal LM from '{name}': {_why(exc)}") from None
    scalar = [a for a in (getattr(config, "architectures", None) or []) if "SequenceClassification" in a]
    if scalar:
        raise ModelError(f"'{name}' is a reward model or critic (a scalar head: {scalar[0]}), not a causal LM: "
                         f"train or chat from an sft / dpo / ppo final/ folder or a base model")
    return config


def load_causal_lm(name: str, opts: LoadConfig | None = None, tokenizer=None):
    """An `AutoModelForCausalLM` in `opts.dtype`, dropout disabled when asked."""
    opts = opts or LoadConfig()
    kwargs = _source_kwargs(name, opts)
    config = causal_lm_config(name, opts)
    try:
        model = AutoModelForCausalLM.from_pretrained(name, config=config, dtype=DTYPES[opts.dtype], **kwargs)
    except LOAD_ERRORS as exc:
        raise ModelError(f"cannot load a causal LM from '{name}': {_why(exc)}") from None
    return _prepare(model, opts, tokenizer)


def has_trained_score_head(model) -> bool:
    """The folder `model` came from was a reward model (its config names a sequence-classification architecture),
    not a causal LM given a fresh head by `load_scalar_model`."""
    return any("SequenceClassification" in a for a in (model.config.architectures or []))


def load_scalar_model(name: str, opts: LoadConfig | None = None, tokenizer=None):
    """An `AutoModelForSequenceClassification` with one output: a reward model, or a critic.

    Starting from a causal LM folder gives a fresh score head (seeded by the caller; the model's `fresh_head`
    attribute is then True); starting from a reward-model folder reloads its trained head. A head with more than
    one output is refused.
    """
    opts = opts or LoadConfig()
    kwargs = _source_kwargs(name, opts)
    try:
        config = AutoConfig.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read a model config in '{name}': {str(exc).splitlines()[0]}") from None
    if getattr(config, "architectures", None) and any("SequenceClassification" in a for a in config.architectures):
        if config.num_labels != 1:
            raise ModelError(f"'{name}' has a {config.num_labels}-output score head (num_labels={config.num_labels} "
                             f"in its config.json); a reward model or critic needs exactly 1: train one with "
                             f"`rlhfkit rm`")
    fresh_head = not any("SequenceClassification" in a for a in (getattr(config, "architectures", None) or []))
    config.num_labels = 1
    if config.pad_token_id is None and tokenizer is not None:
        config.pad_token_id = tokenizer.pad_token_id
    try:
        # a fresh head is the intent here, not news: transformers' "score.weight MISSING" report is kept quiet
        with _transformers_quiet(fresh_head):
            model = AutoModelForSequenceClassification.from_pretrained(name, config=config,
                                                                       dtype=DTYPES[opts.dtype], **kwargs)
    except LOAD_ERRORS as exc:
        raise ModelError(f"cannot load a scalar-head model from '{name}': {_why(exc)}") from None
    model.fresh_head = fresh_head
    return _prepare(model, opts, tokenizer)


def _why(exc: Exception) -> str:
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, SafetensorError):
        return f"its safetensors weights are damaged or incomplete ({first}); copy or save the folder again"
    return first


@contextlib.contextmanager
def _transformers_quiet(quiet: bool):
    """transformers' logging at error level for the block (when `quiet`), then as it was."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    if quiet:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout: PPO's ratio pi/pi_old is only meaningful if both forwards are deterministic."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        # attention kernels take their dropout as a float attribute, not a Dropout module
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    for key in ("attention_dropout", "hidden_dropout", "dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop",
                "hidden_dropout_prob", "attention_probs_dropout_prob", "activation_dropout"):
        if isinstance(getattr(model.config, key, None), float):
            set_for_training(model.config, key, 0.0)
