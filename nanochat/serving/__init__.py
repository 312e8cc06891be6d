"""
A chat model behind HTTP (`python -m scripts.chat_web`) and in the terminal (chat_cli): what both share (chat.py), the
OpenAI protocol (openai_api.py), the app and its UI (serve.py, ui.html), hostile load (server_guard.py), and the worker
processes that decode with the batching engine (workers.py from the server's side, worker_loop.py inside a worker).
"""
