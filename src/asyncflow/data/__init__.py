"""Datasets: the `Example` record, loaders (and an up-front validator) for JSONL/Parquet/HF dataset
folders, and built-in procedurally generated verifiable tasks. Imports nothing of asyncflow outside
this package."""

from asyncflow.data.files import iter_examples, load_examples, validate_data_file
from asyncflow.data.records import DatasetError, Example
from asyncflow.data.tasks import TASK_ALPHABET, TASKS, Task, countdown_reward, make_task

__all__ = [
    "DatasetError", "Example", "TASKS", "TASK_ALPHABET", "Task", "countdown_reward", "iter_examples",
    "load_examples", "make_task", "validate_data_file",
]
