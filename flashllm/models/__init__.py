"""Model architectures, their layers, and the Hugging Face directory loader."""
