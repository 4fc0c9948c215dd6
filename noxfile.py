"""nox sessions: the default test run, per-backend conformance, and lint."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = True

TORCH_CPU = "torch==2.13.0"  # a CPU build; other pins (ipex, xla) live in their own sessions
BACKENDS = ["reference", "cpu", "cuda"]


def _install(session: nox.Session, extras: str = "test") -> None:
    session.install(TORCH_CPU)
    session.install("-e", f".[{extras}]")


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The whole CPU test suite: what .ci/run and the README run."""
    _install(session, "test,serve,bench,cuda")  # cuda = triton, whose interpreter proves the kernels on CPU
    session.run("pytest", "-q", *session.posargs)


@nox.session(python="3.11")
@nox.parametrize("backend", BACKENDS)
def conformance(session: nox.Session, backend: str) -> None:
    """Every kernel of one backend against the reference; skips with the reason if unavailable."""
    _install(session)
    session.run("pytest", "-q", "tests/conformance", "-k", backend, *session.posargs, success_codes=[0, 5])


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff over the package and tests, and the capability page freshness check."""
    session.install("ruff")
    session.run("ruff", "check", "flashllm", "tests", "noxfile.py")
    _install(session)
    session.run("python", "-m", "flashllm.registry.matrix", "--check", "docs/capabilities.md")


@nox.session(python="3.11")
def ui(session: nox.Session) -> None:
    """The web UI in a real headless Chromium: needs Debian's chromium at /usr/bin/chromium
    (`apt-get install chromium`); playwright drives it and never downloads a browser."""
    _install(session, "test,serve,ui")
    session.install("playwright")
    session.run("pytest", "-q", "tests/ui", *session.posargs)


@nox.session(python="3.11")
def baselines(session: nox.Session) -> None:
    """The lm-eval adapter and the llama.cpp baseline (llama-cpp-python builds llama.cpp: minutes)."""
    _install(session, "test,bench,lm-eval,llamacpp")
    session.run("pytest", "-q", "tests/e2e/test_lm_eval_adapter.py", "tests/e2e/test_gguf_export.py",
                "tests/e2e/test_bench_llamacpp.py", *session.posargs)


@nox.session(python="3.11")
def plugin(session: nox.Session) -> None:
    """The third-party backend template, installed like a vendor's package (not editable): its own
    conformance and engine tests, then flashllm's generated conformance suite over its kernels."""
    _install(session)
    template = "examples/flashllm-backend-template"
    session.install(template)
    session.run("pytest", "-q", "--rootdir", template, f"{template}/tests", *session.posargs)
    session.run("pytest", "-q", "tests/conformance/test_kernels.py", "-k", "template", *session.posargs)


@nox.session(python="3.11")
def onnx(session: nox.Session) -> None:
    """Static-graph mode: `flashllm export --format onnx` and `--mode static` through onnxruntime (CPU)."""
    _install(session, "test,onnx")
    session.run("pytest", "-q", "tests/static", *session.posargs)


IPEX_PINS = ("torch==2.8.*", "intel-extension-for-pytorch==2.8.*")  # IPEX x.y runs only on torch x.y
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


@nox.session(python="3.11")
def ipex(session: nox.Session) -> None:
    """torch 2.8 + intel-extension-for-pytorch 2.8 (x86 CPU): the ipex kernels' conformance and a tiny Llama.

    torch's CPU index is tried as an extra index: its 2.8.0+cpu sorts above PyPI's 2.8.0, which on
    Linux is the CUDA build (about 3 GB with its nvidia wheels, runs on CPU too) and is what pip
    installs where that index is unreachable. flashllm's own pin (torch>=2.4) keeps the 2.8 build.
    """
    session.install(*IPEX_PINS, "--extra-index-url", TORCH_CPU_INDEX)
    session.install("-e", ".[test]")
    session.run("python", "-c", "import torch, intel_extension_for_pytorch as ipex; print('torch', torch.__version__, 'ipex', ipex.__version__)")
    session.run("pytest", "-q", "tests/conformance/test_kernels.py", "-k", "ipex", *session.posargs)
    session.run("pytest", "-q", "tests/backends/test_ipex.py", *session.posargs)
