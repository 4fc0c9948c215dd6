"""Registered architectures as capability-page rows, and the page's entry point (it needs models and backends).

`python -m flashllm.models.catalog --write docs/capabilities.md` renders the committed page;
`--check docs/capabilities.md` exits 1 when it is stale (run by `nox -s lint`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from flashllm.models.registry import ModelRegistry
from flashllm.registry.matrix import ModelRow, render_markdown
from flashllm.registry.plugins import FlashPlugins, make_plugin_manager


def model_rows(plugins: FlashPlugins) -> list[ModelRow]:
    """One ModelRow per registered architecture name, sorted by name, from the class's declared attributes.

    Lazy "module:Class" targets are imported (model modules are cheap to import); one that fails to
    import becomes a row carrying the error instead of failing the whole listing.
    """
    targets = plugins.model_targets()
    registry = ModelRegistry.from_targets(targets)
    rows = []
    for architecture in sorted(targets):
        target = targets[architecture]
        name = target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"
        family = name.partition(":")[0].rsplit(".", 1)[-1]
        try:
            cls = registry.resolve(architecture)
        except (ImportError, AttributeError, TypeError) as exc:
            rows.append(ModelRow(architecture, name, family, error=f"failed to import: {exc}"))
            continue
        rows.append(ModelRow(
            architecture, name, family,
            required_ops=_names(cls, "required_ops") or (),
            attention_needs=_names(cls, "attention_needs") or (),
            weight_only=_names(cls, "weight_only_quant"),
            prequantized=_names(cls, "prequantized_methods"),
            tokenizer=_names(cls, "tokenizer_files"),
        ))
    return rows


def _names(cls: type, attribute: str) -> tuple[str, ...] | None:
    # a plugin's class need not subclass CausalLM: a missing attribute reads as "not declared"
    value: Any = getattr(cls, attribute, None)
    return None if value is None else tuple(str(v) for v in value)


def render_page() -> str:
    """The committed page: built-in backends and models only, whatever plugins are installed here."""
    plugins = make_plugin_manager(load_entry_points=False)
    return render_markdown(plugins, model_rows(plugins))


def main(argv: list[str] | None = None) -> int:
    """--write PATH renders the page; --check PATH exits 1 if the committed page is stale."""
    parser = argparse.ArgumentParser(prog="python -m flashllm.models.catalog", description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path, metavar="PATH")
    group.add_argument("--check", type=Path, metavar="PATH")
    args = parser.parse_args(argv)
    text = render_page()
    if args.write:
        args.write.write_text(text, encoding="utf-8")
        return 0
    current = args.check.read_text(encoding="utf-8") if args.check.exists() else ""
    if current != text:
        print(f"{args.check} is stale: run python -m flashllm.models.catalog --write {args.check}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
