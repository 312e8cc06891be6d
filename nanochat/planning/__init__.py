"""
Planning a run to a wall-clock budget and to a card's memory (an add-on): the laws and the probe that pick a depth and
a number of steps (time_budget.py), the step's peak memory predicted without the card (memory_model.py), and the
whole speedrun planned at its start (pipeline_plan.py). Attached to the core by flags in -> flags out before a model
is built, and by a training-loop callback that sets the steps again from measured ones.
"""
