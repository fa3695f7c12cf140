"""Datasets: the `Example` record, loaders for JSONL/Parquet/HF dataset folders, and built-in
procedurally generated verifiable tasks. Imports nothing of asyncflow outside this package."""

from asyncflow.data.files import load_examples
from asyncflow.data.records import DatasetError, Example
from asyncflow.data.tasks import TASK_ALPHABET, TASKS, Task, countdown_reward, make_task

__all__ = [
    "DatasetError", "Example", "TASKS", "TASK_ALPHABET", "Task", "countdown_reward", "load_examples", "make_task",
]
