"""
A chat model behind HTTP (`python -m scripts.chat_web`) and in the terminal (chat_cli): a chat's messages and the
events of a reply (chat.py), the HTTP side with the OpenAI API and the defences against hostile load (serve.py,
ui.html), and the worker processes that decode with the engine (workers.py, both sides of their pipe).
"""
