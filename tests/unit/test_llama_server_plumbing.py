"""The llama-server baseline's plumbing without llama.cpp: its command line, finding the binary, peak-memory reads."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashllm.bench.llamacpp_server import (
    ENV_VAR,
    LlamaServerPlan,
    LlamaServerUnavailable,
    find_llama_server,
    slot_context,
)
from flashllm.bench.peak_memory import peak_rss_bytes, process_tree, status_kib


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_command_gives_one_slot_per_request_and_context_for_all_of_them(tmp_path: Path) -> None:
    plan = LlamaServerPlan(tmp_path / "m.gguf", parallel=16, ctx_per_slot=256, threads=2,
                           extra_args=("--cache-ram", "0"))
    argv = plan.command(Path("/opt/llama-server"), 8123)
    assert argv[0] == "/opt/llama-server" and _flag(argv, "--model") == str(tmp_path / "m.gguf")
    assert _flag(argv, "--parallel") == "16" and _flag(argv, "--ctx-size") == str(16 * 256)
    assert _flag(argv, "--threads") == _flag(argv, "--threads-batch") == "2"
    assert (_flag(argv, "--host"), _flag(argv, "--port")) == ("127.0.0.1", "8123")
    assert argv[-2:] == ["--cache-ram", "0"]  # extra words last, so they override what came before
    with pytest.raises(ValueError, match="at least one slot"):
        LlamaServerPlan(tmp_path / "m.gguf", parallel=0, ctx_per_slot=256, threads=2).command(Path("x"), 1)


def test_slot_context_fits_the_longest_request() -> None:
    assert slot_context(240) == 256 and slot_context(256) == 256 and slot_context(257) == 512
    assert slot_context(240, requested=4096) == 4096
    with pytest.raises(ValueError, match="shorter than the longest request"):
        slot_context(300, requested=256)


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\necho version: 1\n")
    path.chmod(0o755)
    return path


def test_find_llama_server_order_flag_env_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHLLM_CACHE_DIR", str(tmp_path / "cache"))  # no helper build there
    flag, env = _executable(tmp_path / "flag-server"), _executable(tmp_path / "env-server")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    on_path = _executable(bindir / "llama-server")
    environ = {ENV_VAR: str(env), "PATH": str(bindir)}
    assert find_llama_server(flag, environ) == flag
    assert find_llama_server(None, environ) == env
    assert find_llama_server(None, {"PATH": str(bindir)}) == on_path
    with pytest.raises(LlamaServerUnavailable) as missing:
        find_llama_server(None, {"PATH": str(tmp_path / "empty")})
    message = str(missing.value)
    assert "\n" not in message and "python -m flashllm.bench.llamacpp_build" in message
    # a wrong explicit path is an error, not a reason to run some other binary
    (tmp_path / "not-exec").write_text("x")
    with pytest.raises(LlamaServerUnavailable, match="not an executable file"):
        find_llama_server(tmp_path / "not-exec", environ)
    with pytest.raises(LlamaServerUnavailable, match=ENV_VAR):
        find_llama_server(None, {ENV_VAR: str(tmp_path / "nowhere"), "PATH": str(bindir)})


def test_helper_build_is_found_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHLLM_CACHE_DIR", str(tmp_path))
    (tmp_path / "llama.cpp" / "bin").mkdir(parents=True)
    built = _executable(tmp_path / "llama.cpp" / "bin" / "llama-server")
    assert find_llama_server(None, {"PATH": str(tmp_path / "empty")}) == built


def test_if_missing_rebuilds_only_an_earlier_build_without_llama_quantize(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from flashllm.bench import llamacpp_build

    monkeypatch.setenv("FLASHLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv(ENV_VAR, raising=False)
    builds: list[Path] = []
    monkeypatch.setattr(llamacpp_build, "build", lambda source, work, jobs, version=None: builds.append(work) or work)
    assert llamacpp_build.main(["--if-missing"]) == 0 and len(builds) == 1  # nothing found: builds
    (tmp_path / "llama.cpp" / "bin").mkdir(parents=True)
    _executable(tmp_path / "llama.cpp" / "bin" / "llama-server")
    assert llamacpp_build.main(["--if-missing"]) == 0 and len(builds) == 2  # an old build without the quantizer
    _executable(tmp_path / "llama.cpp" / "bin" / "llama-quantize")
    assert llamacpp_build.main(["--if-missing"]) == 0 and len(builds) == 2  # both there: nothing to do
    elsewhere = _executable(tmp_path / "llama-server")
    monkeypatch.setenv(ENV_VAR, str(elsewhere))                             # the user's own: never rebuilt
    (tmp_path / "llama.cpp" / "bin" / "llama-quantize").unlink()
    assert llamacpp_build.main(["--if-missing"]) == 0 and len(builds) == 2


STATUS = "Name:\tpython3\nVmPeak:\t  900000 kB\nVmHWM:\t  123456 kB\nVmRSS:\t  100000 kB\nThreads:\t4\n"


def test_status_kib_reads_the_named_line() -> None:
    assert status_kib(STATUS) == 123456 and status_kib(STATUS, "VmRSS") == 100000
    assert status_kib("Name:\tkthreadd\nThreads:\t1\n") is None  # kernel threads have no VmHWM
    with pytest.raises(ValueError, match="expected 'VmHWM: <number> kB'"):
        status_kib("VmHWM:\t12 MB\n")


def _fake_proc(root: Path, tree: dict[int, list[int]], hwm_kib: dict[int, int]) -> Path:
    for pid, children in tree.items():
        task = root / str(pid) / "task" / str(pid)
        task.mkdir(parents=True)
        (task / "children").write_text(" ".join(map(str, children)))
        (root / str(pid) / "status").write_text(f"Name:\tp{pid}\nVmHWM:\t{hwm_kib[pid]} kB\n")
    return root


def test_peak_of_a_process_tree_on_a_fake_proc(tmp_path: Path) -> None:
    proc = _fake_proc(tmp_path, {10: [11, 12], 11: [13], 12: [], 13: []}, {10: 1000, 11: 200, 12: 30, 13: 4})
    assert process_tree(10, proc) == [10, 11, 12, 13]
    assert peak_rss_bytes(10, proc) == {"process": 1000 * 1024, "tree": 1234 * 1024}
    assert peak_rss_bytes(99, proc) is None  # gone


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_peak_of_a_live_process_is_its_high_water_mark_not_its_current_size() -> None:
    psutil = pytest.importorskip("psutil")
    # the child reports its resident size (psutil), touches 200 MiB, frees it and waits
    code = ("import psutil, sys; print(psutil.Process().memory_info().rss, flush=True); "
            "b = bytearray(200 << 20); del b; print('freed', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = int(child.stdout.readline())  # type: ignore[union-attr]
        assert child.stdout.readline().strip() == "freed"  # type: ignore[union-attr]
        peaks = peak_rss_bytes(child.pid)
        now = psutil.Process(child.pid).memory_info().rss
        assert peaks is not None and before + (200 << 20) - (8 << 20) <= peaks["process"] <= before + (216 << 20)
        assert now < peaks["process"] - (150 << 20)  # the peak stays after the memory went back
        assert child.pid in process_tree(os.getpid()) and process_tree(os.getpid())[0] == os.getpid()
    finally:
        child.communicate("")


# ---------------------------------------------------------------- bench serve --baseline, without servers


def _serve_args(*argv: str) -> argparse.Namespace:
    from flashllm.cli.bench import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", "serve", *argv])


def test_engines_pair_each_quant_type_with_each_gguf_type() -> None:
    from flashllm.bench.serve_compare import Engine, engines

    args = _serve_args("--baseline", "llama.cpp", "--quant-type", "none,weight_only_int8", "--gguf-type", "f32", "q8_0")
    assert engines(args) == [Engine("flashllm", "none"), Engine("flashllm", "weight_only_int8"),
                             Engine("llama.cpp", "f32"), Engine("llama.cpp", "q8_0")]
    assert [e.name for e in engines(_serve_args("--baseline", "llama.cpp"))] == ["flashllm[none]", "llama.cpp[f32]"]


def test_record_takes_medians_and_pairs_ratios_within_rounds() -> None:
    from flashllm.bench.serve_compare import MEDIAN_KEYS, Engine, _record, format_comparison, merge_records

    args = _serve_args("--shape", "qwen2.5-0.5b", "--baseline", "llama.cpp", "--max-concurrency", "4")
    flash, llama = Engine("flashllm", "none"), Engine("llama.cpp", "f32")

    def run(out: float, ttft: float) -> dict[str, float]:
        return {**dict.fromkeys(MEDIAN_KEYS, 1.0), "output_throughput": out, "p50_ttft_ms": ttft, "failed": 0}

    runs = {flash: [run(100, 5), run(90, 7), run(120, 6)], llama: [run(50, 9), run(45, 8), run(40, 10)]}
    commands = {flash: ["a"], llama: ["b"]}
    record = _record(args, Path("m"), [object()] * 8, [flash, llama], runs, commands)  # type: ignore[list-item]
    assert record["engines"]["flashllm[none]"]["median"]["output_throughput"] == 100
    assert record["engines"]["flashllm[none]"]["median"]["p50_ttft_ms"] == 6  # its own median, not the median run's
    assert record["engines"]["llama.cpp[f32]"]["median"]["output_throughput"] == 45
    # within rounds: 100/50, 90/45, 120/40 -> 2, 2, 3: median 2.0 (the ratio of the medians would be 100/45)
    assert record["output_throughput_speedups"]["flashllm[none] / llama.cpp[f32]"] == pytest.approx(2.0)
    assert record["max_concurrency"] == 4 and record["num_prompts"] == 8 and record["repeats"] == 3
    table = format_comparison(record)
    assert "flashllm[none]" in table and "2.00x" in table
    # three one-round commands merge into the same record
    singles = [_record(args, Path("m"), [object()] * 8, [flash, llama], {flash: [runs[flash][i]], llama: [runs[llama][i]]},
                       commands) for i in range(3)]  # type: ignore[list-item]
    merged = merge_records(singles)
    assert merged["output_throughput_speedups"] == record["output_throughput_speedups"] and merged["repeats"] == 3
    assert merged["engines"]["flashllm[none]"]["median"] == record["engines"]["flashllm[none]"]["median"]
    other = _record(_serve_args("--shape", "qwen2.5-0.5b", "--baseline", "llama.cpp", "--max-concurrency", "16"),
                    Path("m"), [object()] * 8, [flash, llama], runs, commands)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="max_concurrency"):
        merge_records([record, other])


def test_baseline_refuses_url_and_missing_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from flashllm.cli import main

    monkeypatch.setenv(ENV_VAR, str(tmp_path / "no-llama-server"))
    assert main(["bench", "serve", "--url", "http://127.0.0.1:1/v1", "--baseline", "llama.cpp"]) == 2
    assert "drop --url" in capsys.readouterr().err
    # a missing binary fails in one line before any model is loaded (this model directory does not exist)
    for mode in ("serve", "throughput"):
        assert main(["bench", mode, "--model", str(tmp_path / "m"), "--baseline", "llama.cpp"]) == 2
        err = capsys.readouterr().err.strip()
        assert "no-llama-server" in err and "not an executable file" in err and "\n" not in err


# ---------------------------------------------------------------- the build helper, without building


def test_build_helper_downloads_the_sdist_and_builds_only_llama_server_and_quantize(tmp_path: Path) -> None:
    from flashllm.bench.llamacpp_build import build_command, configure_command, download_command

    download = download_command(tmp_path, "0.3.36")
    assert download[1:4] == ["-m", "pip", "download"] and download[-1] == "llama-cpp-python==0.3.36"
    assert _flag(download, "--no-binary") == ":all:" and "--no-deps" in download  # source only, nothing else
    configure = configure_command(tmp_path / "src", tmp_path / "build")
    assert "-DBUILD_SHARED_LIBS=OFF" in configure and "-DLLAMA_CURL=OFF" in configure
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in configure  # nothing fetched while building
    assert build_command(tmp_path / "build", 2)[-5:] == ["--target", "llama-server", "llama-quantize", "--parallel", "2"]


def _sdist(path: Path, members: dict[str, bytes]) -> Path:
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_unpack_finds_the_vendored_source_and_refuses_escapes(tmp_path: Path) -> None:
    import tarfile

    from flashllm.bench.llamacpp_build import BuildError, unpack_vendored_source

    good = _sdist(tmp_path / "good.tar.gz", {"llama_cpp_python-1/vendor/llama.cpp/CMakeLists.txt": b"project(x)"})
    assert unpack_vendored_source(good, tmp_path / "a") == tmp_path / "a/llama_cpp_python-1/vendor/llama.cpp"
    empty = _sdist(tmp_path / "empty.tar.gz", {"llama_cpp_python-1/setup.py": b""})
    with pytest.raises(BuildError, match="no vendor/llama.cpp"):
        unpack_vendored_source(empty, tmp_path / "b")
    evil = _sdist(tmp_path / "evil.tar.gz", {"../escaped.txt": b"x"})
    with pytest.raises(tarfile.FilterError):
        unpack_vendored_source(evil, tmp_path / "c" / "d")
    assert not (tmp_path / "c" / "escaped.txt").exists()
