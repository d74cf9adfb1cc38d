"""Applications built on `mlx_redrafter.stream_generate`: the chat app and the
OpenAI-compatible server (issue #6; not built yet)."""
