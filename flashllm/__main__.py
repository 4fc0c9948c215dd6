"""`python -m flashllm` runs the flashllm command."""

from flashllm.cli import main

raise SystemExit(main())
