"""Model definitions and loaders (GGUF files, Hugging Face folders, hub ids)."""
