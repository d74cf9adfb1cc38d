"""Applications built on the project's streaming generation (issue #6).

chat: the terminal chat (`mlx-redrafter chat`), on `stream_generate`.
batcher: the continuous-batching decode worker, on the token-level loop.
server: the OpenAI-compatible HTTP server and chat page (`mlx-redrafter serve`).
loadtest: step cost by batch size and beam shape, and the server's load test.
"""
