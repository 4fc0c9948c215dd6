"""What --tokenizer means, said once for every command that builds an engine (generate, chat, serve, run-batch)."""

TOKENIZER_HELP = ("tokenizer directory (or GGUF file) to use instead of the model's: for a GGUF file whose vocabulary "
                  "flashllm cannot build, say, the source model's directory; the chat template stays the model's")
