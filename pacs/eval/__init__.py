"""Evaluating a policy on a task: the evaluation, its journal, its written outputs and presets."""
