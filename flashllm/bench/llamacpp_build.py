"""Build llama.cpp's `llama-server` from the source llama-cpp-python vendors: `python -m flashllm.bench.llamacpp_build`.

Steps: `pip download --no-deps --no-binary :all: llama-cpp-python[==VERSION]` (the sdist, which carries
llama.cpp under vendor/llama.cpp), unpack it, configure with cmake (Release, static libraries, no
network-fetching options, native CPU flags) and build only the llama-server and llama-quantize targets; the
binaries are copied to llamacpp_server.built_binary()'s directory
(<FLASHLLM_CACHE_DIR or ~/.cache/flashllm>/llama.cpp/bin/),
where `flashllm bench ... --baseline llama.cpp` finds it. Needs cmake and a C++17 compiler; on 2 cores
the build takes tens of minutes. --source DIR skips the download and builds an unpacked llama.cpp tree.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "llama-cpp-python"
# cmake options: a self-contained binary (static libraries), nothing fetched from the network while
# configuring or building (no curl/openssl model downloads, no prebuilt web UI), tuned for this CPU
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
                 "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF",
                 "-DLLAMA_USE_PREBUILT_UI=OFF")


class BuildError(RuntimeError):
    """A step failed; the message names it and what to do."""


def download_command(dest: Path, version: str | None = None) -> list[str]:
    """pip's command that fetches the llama-cpp-python source distribution (never a wheel) into `dest`."""
    spec = f"{PACKAGE}=={version}" if version else PACKAGE
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest", str(dest), spec]


def configure_command(source: Path, build: Path) -> list[str]:
    return ["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS]


def build_command(build: Path, jobs: int) -> list[str]:
    # llama-quantize too: the baselines session quantizes tiny GGUF files with llama.cpp's own quantizer
    return ["cmake", "--build", str(build), "--target", "llama-server", "llama-quantize", "--parallel", str(jobs)]


def unpack_vendored_source(sdist: Path, into: Path) -> Path:
    """Unpack the sdist (a .tar.gz) under `into` and return its vendor/llama.cpp directory.

    Members are checked by tarfile's "data" filter: no absolute paths, no parent-directory escapes,
    no device files or links pointing outside.
    """
    with tarfile.open(sdist, "r:gz") as archive:
        archive.extractall(into, filter="data")
    found = sorted(into.glob("*/vendor/llama.cpp/CMakeLists.txt"))
    if not found:
        raise BuildError(f"{sdist.name} has no vendor/llama.cpp/CMakeLists.txt; is it a llama-cpp-python sdist?")
    return found[0].parent


def _run(command: list[str], step: str) -> None:
    print("+ " + " ".join(command), flush=True)
    try:
        subprocess.run(command, check=True)
    except FileNotFoundError as exc:
        raise BuildError(f"{step}: {command[0]} is not installed; install it (e.g. apt-get install cmake g++) "
                         "and run again") from exc
    except subprocess.CalledProcessError as exc:
        raise BuildError(f"{step} failed with exit code {exc.returncode} (its output is above)") from exc


def build(source: Path | None, work: Path, jobs: int, version: str | None = None) -> Path:
    """Download (unless `source` is given), configure and build; returns the installed llama-server path."""
    from flashllm.bench.llamacpp_server import built_binary

    if source is None:
        download = work / "download"
        download.mkdir(parents=True, exist_ok=True)
        _run(download_command(download, version), "pip download")
        sdists = sorted(download.glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            raise BuildError(f"pip download left no llama_cpp_python-*.tar.gz in {download}")
        source = unpack_vendored_source(sdists[-1], work / "src")
    if not (source / "CMakeLists.txt").is_file():
        raise BuildError(f"{source} has no CMakeLists.txt; pass llama.cpp's source directory")
    build_dir = work / "build"
    _run(configure_command(source, build_dir), "cmake configure")
    _run(build_command(build_dir, jobs), "cmake build")
    binary = build_dir / "bin" / "llama-server"
    if not binary.is_file():
        raise BuildError(f"the build finished but left no {binary}")
    target = built_binary()
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(binary, target)
    quantize = build_dir / "bin" / "llama-quantize"
    if quantize.is_file():
        shutil.copy2(quantize, target.parent / quantize.name)
    return target


def _needs_build() -> bool:
    """--if-missing: whether to build. Not when a llama-server is found, except this helper's own earlier build
    that lacks llama-quantize beside it (builds from before the baselines session quantized files)."""
    from flashllm.bench.llamacpp_server import LlamaServerUnavailable, built_binary, find_llama_server

    try:
        found = find_llama_server()
    except LlamaServerUnavailable:
        return True
    if found == built_binary() and not (found.parent / "llama-quantize").is_file():
        print(f"found {found} without llama-quantize beside it; building both")
        return True
    print(f"found {found}; not building")
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashllm.bench.llamacpp_build",
                                     description="build llama.cpp's llama-server for `bench --baseline llama.cpp`")
    parser.add_argument("--source", type=Path, default=None, help="an unpacked llama.cpp source tree (no download)")
    parser.add_argument("--version", default=None, help="llama-cpp-python version to download (default: newest)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the download and build here")
    parser.add_argument("--if-missing", action="store_true",
                        help="do nothing when a llama-server is already found ($FLASHLLM_LLAMA_SERVER, PATH, an "
                             "earlier build of this helper that has llama-quantize too)")
    args = parser.parse_args(argv)
    if args.if_missing and not _needs_build():
        return 0
    try:
        if args.work_dir:
            target = build(args.source, args.work_dir, args.jobs, args.version)
        else:
            with tempfile.TemporaryDirectory(prefix="llamacpp-build-") as tmp:
                target = build(args.source, Path(tmp), args.jobs, args.version)
    except BuildError as exc:
        print(f"llamacpp_build: {exc}", file=sys.stderr)
        return 2
    print(f"built {target}; `flashllm bench ... --baseline llama.cpp` finds it there")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
