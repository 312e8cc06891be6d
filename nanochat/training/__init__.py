"""
Training, from a model to its next checkpoint: the math every stage shares (recipe.py: the depth dial, schedules,
optimizers, one optimizer step), the optimizers (muon.py, adamw.py), the loop around a stage's step (loop.py), what
the chat stages share (stage.py, chat_data.py), the presets (presets.py), time
budgets for base_train and the whole speedrun (time_budget.py, pipeline_plan.py), a device batch that does not fit
(memory_fallback.py), and the miniseries (miniseries.py).
"""
