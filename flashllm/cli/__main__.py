"""`python -m flashllm.cli` runs the flashllm command, as `python -m flashllm` does."""

from flashllm.cli import main

raise SystemExit(main())
