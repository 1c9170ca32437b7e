"""Embeddings: an encoder (or a pooled decoder) turns each input into one vector (`Embedder`), for
`/v1/embeddings` rows in jobs, the server and the Batch API."""
