"""asyncflow: asynchronous, streaming RL post-training for language models.

Layers (imports point down only): cli/config -> workflow -> runtime -> workers ->
engines -> algos/rewards/models/data -> transfer, observe.
"""

__version__ = "0.1.0"
