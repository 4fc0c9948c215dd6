"""Backend registry: plugins, backends, device selection, op resolution, capability matrix."""
