"""
A chat model behind HTTP (`python -m scripts.chat_web`) and in the terminal (chat_cli): a chat's messages and the
events of a reply (chat.py); the HTTP side: the app and its routes (serve.py, ui.html), the OpenAI protocol's
requests and replies (protocol.py), the defences against hostile load (guards.py); and the worker processes that
decode with the engine (workers.py, both sides of their pipe), sharing its decode steps between clients
(fair_share.py).
"""
