"""Runtimes place workers. `InlineRuntime` (`inline.py`): every worker in this process, the rollout
loop on a thread; `RayRuntime` (`ray_runtime.py`): rollout replicas as Ray actors, the queue as Ray
actors. Both offer the same small surface to a workflow: `make_queue`, `weight_sync` (+ options),
`start_rollout`, `check`, `join`, `close`, and `scores_in_rollout` (where the reward worker runs).

Only the `ray*.py` modules import `ray`, and only when a Ray runtime is asked for.
"""
