"""The README and the docs/ pages against the code: links resolve, commands parse, flags exist.

Cheap checks (no model, no network, well under a second each) that keep the user's pages true:
- every relative link of the README and of docs/*.md names a file of the repository (a docs/ page's
  one inside docs/, all the site has), and a `page.md#anchor` link a heading of that page;
- every `flashllm ...` command written in a shell code block parses with the real argument parser
  (`python -m flashllm.llm ...` with the predictor's);
- every `--flag` written anywhere in the pages exists on some flashllm command, or is another
  tool's flag listed in OTHER_TOOLS_FLAGS; a `python benchmarks/....py --flag` span's flags are defined in
  that script or a module beside it that it imports;
- the predictor page's "not accepted" PaddleNLP flags are indeed refused by `flashllm predict`;
- the pages read as a product, not a lab notebook: no "team's", no ordinal session or pass entries;
  and so do the sources (flashllm/, its C kernels, benchmarks/, tests/, noxfile.py): no "team's", no
  ordinal sessions or GPU/CPU passes (a number there names its machine, as docs/benchmarks.md does).
"""

from __future__ import annotations

import argparse
import re
import shlex
import unicodedata
from pathlib import Path

import pytest

from flashllm.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console")
# Flags of other programs that the pages show (pip, curl, nox, torchrun, lm-eval, uv, ...).
OTHER_TOOLS_FLAGS = {
    "--nproc-per-node", "--nnodes", "--model_args", "--tasks", "--batch_size", "--extra-index-url",
    "--index-url", "--resolution", "--fail-with-body", "--rootdir", "--no-cache", "--strict", "--no-deps",
    "--write", "--check",  # python -m flashllm.models.catalog, the capability page's generator
}
# A table row of docs/offline.md whose flag flashllm refuses says so in these words.
REFUSED = "not accepted"

_FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")
_SCRIPT = re.compile(r"python (benchmarks/[\w/.-]+\.py)\b")  # a repository script run with its own flags
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*$", re.M)


def _prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return _FENCE.sub("", text)


def _slug(heading: str) -> str:
    """Python-Markdown's toc slug (what mkdocs builds anchors from), after removing inline markup."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    # Code spans keep their text as written (seq_length stays seq_length); outside them `*` and the
    # underscores that open or close emphasis are markup (intra-word ones are not, as in Markdown).
    parts = text.split("`")
    text = "".join(part if i % 2 else re.sub(r"\*+|(?<!\w)_+|_+(?!\w)", "", part) for i, part in enumerate(parts))
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in _HEADING.findall(_prose(page.read_text(encoding="utf-8")))}


def _links(page: Path) -> list[str]:
    return _LINK.findall(_prose(page.read_text(encoding="utf-8")))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists() or ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target}: no such file in the repository")
        elif page.parent == DOCS and DOCS not in dest.parents:
            # the site (mkdocs build --strict, the lint session) knows docs/ only; name a source in code instead
            broken.append(f"{target}: a docs/ page may link only within docs/")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: {dest.name} has no heading with anchor #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def _shell_lines(text: str) -> list[str]:
    """Each command line of the page's shell code blocks, continuation lines joined."""
    lines = []
    for info, body in _FENCE.findall(text):
        if info in SHELL_BLOCKS:
            lines.extend(line.strip() for line in body.replace("\\\n", " ").splitlines())
    return [line for line in lines if line]


def _flashllm_argvs(line: str) -> list[tuple[str, list[str]]]:
    """(program, argv) of each flashllm invocation on a shell line: `flashllm ...`,
    `python -m flashllm ...`, `torchrun ... -m flashllm ...` and `python -m flashllm.llm ...`."""
    found = []
    for segment in re.split(r"&&|\|\|?|;", line):
        try:
            words = shlex.split(segment, comments=True)
        except ValueError:
            continue
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value prefixes
            words = words[1:]
        if words and words[0] == "flashllm":
            found.append(("flashllm", words[1:]))
        elif "-m" in words and words.index("-m") + 1 < len(words):
            module = words[words.index("-m") + 1]
            rest = words[words.index("-m") + 2:]
            if module == "flashllm":
                found.append(("flashllm", rest))
            elif module == "flashllm.llm":
                found.append(("flashllm.llm", rest))
    return found


def _predictor_parser() -> argparse.ArgumentParser:
    from flashllm.cli.predict import configure

    parser = argparse.ArgumentParser(prog="python -m flashllm.llm")
    configure(parser)
    return parser


def _parse(program: str, argv: list[str]) -> str | None:
    """None when argv parses, else argparse's complaint."""
    parser = build_parser() if program == "flashllm" else _predictor_parser()
    parser.exit_on_error = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.exit_on_error = False
    try:
        parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        return str(exc) or "argparse exited"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_flashllm_commands_parse(page: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = []
    for line in _shell_lines(page.read_text(encoding="utf-8")):
        for program, argv in _flashllm_argvs(line):
            problem = _parse(program, argv)
            if problem is not None:
                err = capsys.readouterr().err.strip().splitlines()
                bad.append(f"{line!r}: {err[-1] if err else problem}")
    assert not bad, f"{page.relative_to(ROOT)}: commands that do not parse:\n" + "\n".join(bad)


def _all_flags(parser: argparse.ArgumentParser) -> set[str]:
    flags: set[str] = set()
    for action in parser._actions:
        flags.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _all_flags(sub)
    return flags


@pytest.fixture(scope="module")
def known_flags() -> set[str]:
    return _all_flags(build_parser()) | _all_flags(_predictor_parser()) | OTHER_TOOLS_FLAGS


def _script_sources(path: Path) -> str:
    """A script's text and that of the modules beside it that it imports (its harness's shared flags)."""
    text = path.read_text(encoding="utf-8")
    imported = re.findall(r"^(?:from|import) (\w+)", text, re.M)
    return "\n".join([text] + [(path.parent / f"{name}.py").read_text(encoding="utf-8") for name in imported
                               if (path.parent / f"{name}.py").is_file()])


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_flag_named_exists(page: Path, known_flags: set[str]) -> None:
    text = page.read_text(encoding="utf-8")
    named = set()
    for line in _prose(text).splitlines():
        if REFUSED not in line:
            for span in _INLINE_CODE.findall(line):
                script = _SCRIPT.match(span)
                if script is None:
                    named.update(_FLAG.findall(span))
                    continue
                # a benchmark script's own flags: its source or a module of its folder it imports defines each
                source = _script_sources(ROOT / script.group(1))
                missing = [flag for flag in _FLAG.findall(span) if f'"{flag}"' not in source]
                assert not missing, f"{page.relative_to(ROOT)}: {script.group(1)} has no flags {missing}"
    for line in _shell_lines(text):
        if line.startswith(("flashllm ", "python -m flashllm", "torchrun ")):
            named.update(_FLAG.findall(line.split("#", 1)[0]))
    unknown = sorted(named - known_flags)
    assert not unknown, (f"{page.relative_to(ROOT)} names flags no flashllm command has: {unknown}; fix the page, "
                         "or add another tool's flag to OTHER_TOOLS_FLAGS in this test")


def test_refused_predictor_flags_are_refused() -> None:
    rows = [line for line in (ROOT / "docs" / "offline.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("|") and REFUSED in line]
    assert rows, "docs/offline.md lists no refused PaddleNLP flags"
    parser_flags = _all_flags(_predictor_parser())
    for row in rows:
        for flag in _FLAG.findall(row.split("|")[1]):
            assert flag not in parser_flags, (f"flashllm predict now accepts {flag}: move its row in docs/offline.md "
                                              "out of the flags it refuses")


_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
             "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|twenty-\\w+")
_DIARY = re.compile(rf"\bteam's\b|\b(?:{_ORDINALS}) (?:session|pass)\b|\brun[0-9]+\.sh\b", re.I)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_are_not_a_lab_notebook(page: Path) -> None:
    hits = sorted({m.group(0) for m in _DIARY.finditer(page.read_text(encoding="utf-8"))})
    assert not hits, (f"{page.relative_to(ROOT)} reads like a lab notebook ({hits}): say what is true now, with "
                      "the command, commit, date and machine of any number; history belongs in commit messages")


# In code "a second pass" is an algorithm's, so the sources' check leaves bare passes alone.
_CODE_DIARY = re.compile(rf"\bteam's\b|\b(?:{_ORDINALS}) (?:session|(?:GPU|CPU) pass)\b|\brun[0-9]+\.sh\b", re.I)
SOURCE_SUFFIXES = (".py", ".c", ".h", ".sh")
SOURCES = sorted(p for top in ("flashllm", "benchmarks", "tests", "examples") for p in (ROOT / top).rglob("*")
                 if p.suffix in SOURCE_SUFFIXES and p.is_file() and p != Path(__file__).resolve())
SOURCES.append(ROOT / "noxfile.py")


def test_code_diary_pattern() -> None:
    """The sources' pattern catches the entries it is for and passes an algorithm's second pass."""
    entries = ["on the team's 2-core VM", "(twenty-third session)", "the eleventh GPU pass", "benchmarks/gpu/run7.sh",
               "sixteenth session, docs/benchmarks.md"]
    assert all(_CODE_DIARY.search(entry) for entry in entries)
    fine = ["the fp32 partial sums are added by a second pass", "one session of nox", "on `intel-2c`", "run_shares"]
    assert not any(_CODE_DIARY.search(line) for line in fine)


def test_sources_are_not_a_lab_notebook() -> None:
    assert len(SOURCES) > 100, f"only {len(SOURCES)} source files found under {ROOT}"
    hits = []
    for path in SOURCES:
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            hits.extend(f"{path.relative_to(ROOT)}:{number}: {m.group(0)}" for m in _CODE_DIARY.finditer(line))
    assert not hits, ("comments and docstrings that read like a lab notebook (say why the code is so, and name the "
                      "machine of a number as docs/benchmarks.md does; history belongs in commit messages):\n"
                      + "\n".join(hits))
