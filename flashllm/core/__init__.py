"""The engine: sequences, block manager, scheduler, model runner, sampler; device-agnostic."""
