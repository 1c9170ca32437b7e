"""`tokenmill serve`: an OpenAI-compatible HTTP server over one shared engine loop (see docs/serve.md).

Kept import-free so that `tokenmill --help` does not load FastAPI; the app is in `tokenmill.serve.app`.
"""
