"""
Training, from a model to its next checkpoint: the math every stage shares (recipe.py: the depth dial, the optimizers'
setup, one optimizer step), the optimizers (optim.py: Muon and AdamW, sharded across ranks, their schedules and one
update of both), the loop around a stage's step (loop.py: resume, checkpoints, evals, progress, logs, and a device
batch that does not fit), what the chat stages share (stage.py, chat_data.py; chat_eval.py: scoring a chat model on
tasks, for chat_eval and chat_rl), the presets (presets.py), and time budgets for one training run and the whole
speedrun (time_budget.py, pipeline_plan.py). The miniseries, which measures scaling laws from families of runs, is a
tool: bench/miniseries.py.
"""
