"""
A chat model behind HTTP (`python -m scripts.chat_web`) and in the terminal (chat_cli): what both share (chat.py), the
OpenAI protocol (openai_api.py), the app, its UI and its defences against hostile load (serve.py, ui.html), and the
worker processes that decode with the engine (workers.py: both sides of their pipe and the typed messages between).
"""
