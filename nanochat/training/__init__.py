"""
Training, from a model to its next checkpoint: recipe.py (the depth dial, the optimizers' setup, one optimizer step),
optim.py (Muon and AdamW, sharded across ranks, and their schedules), loop.py (what every stage does around its step),
stage.py, chat_data.py and chat_eval.py (what the chat stages share), presets.py, and time budgets for one run and the
whole speedrun (time_budget.py, pipeline_plan.py). The miniseries (scaling laws) is a tool: bench/miniseries.py.
"""
