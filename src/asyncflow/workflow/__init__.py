"""Workflows decide when weights move and how far rollout may run ahead of training.

`run.RLRun` owns a training run (set-up, the step loop, checkpoints, outputs); `pipeline` holds the
`sync`, `stream` and `async` workflows; `setup` builds a run's pieces from its config; `evaluation`,
`checkpoint`, `sft` and `compare` (`asyncflow bench`) do what they say.
"""
