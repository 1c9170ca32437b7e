"""Model file formats read without torch: a GGUF file's header (gguf_header) and its metadata as a
Hugging Face style config (gguf_config), and a safetensors file's header (safetensors_header).

The floor under `models` (loading, `tokenmill info`) and `plan`: it imports nothing else from
tokenmill, so the planner reads the same files the loader does, in the same way, without torch.
"""
