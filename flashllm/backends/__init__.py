"""Built-in device backends; each registers through flashllm_register_backends."""
