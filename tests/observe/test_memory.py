"""`descendants_peak_rss_mb`: what a rollout replica reports for the processes its engine started
(`memory/peak_rss_mb/rollout_R_engine`: vLLM's worker, which holds the weights and the KV cache)."""

from __future__ import annotations

import subprocess
import sys
import time

from asyncflow.observe.memory import descendants_peak_rss_mb


def test_the_peak_of_a_process_this_one_started_is_seen():
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(300 << 20); x[::4096] = b'1' * "
                              "len(x[::4096]); print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        time.sleep(0.1)
        assert descendants_peak_rss_mb() > 300
    finally:
        child.kill()
        child.wait()
