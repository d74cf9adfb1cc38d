"""Applications built on the project's decoding session (`mlx_redrafter.apps`).

chat: the terminal chat (`mlx-redrafter chat`), on `stream_generate`.
batcher: the continuous-batching decode worker, on `DecodingSession`.
server: the OpenAI-compatible HTTP server and chat page (`mlx-redrafter serve`).
loadtest: step cost by batch size and tree, and the server's load test.
"""
