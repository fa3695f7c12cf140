"""Workflows decide when weights move and how far rollout may run ahead of training.

`run.RLRun` owns a training run (set-up, the step loop, checkpoints, outputs), built by `asyncflow.api` only;
`pipeline` holds the `sync`, `stream` and `async` workflows; `setup` builds a run's pieces from its config,
asking the config's environment and reward `kinds` what differs between them; `evaluation`, `checkpoint`, `sft`
and `compare` (`asyncflow bench`) do what they say.
"""
