"""Rank processes (rank.py, weight_rank.py) driven one JSON line at a time: what the tests and
benchmarks/sglang.py share."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys

HERE = os.path.dirname(__file__)
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(HERE)), "tests"))
from checkout import checkout_env, free_port  # noqa: E402,F401  (tests/checkout.py; benchmarks/sglang.py takes free_port here)

# SGLang's timeouts, short enough for a test: heartbeats every 2 s (its minimum), a prefill
# missing 2 of them is dead; a room waits 20 s at most for its KV.
ENV = dict(SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL="2", SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE="2",
           SGLANG_DISAGGREGATION_WAITING_TIMEOUT="20", SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT="20")


class Rank:
    """A rank.py process: call(op, **fields) sends one command and returns its reply."""

    def __init__(self, role, port=None, script="rank.py", **opts):
        argv = [sys.executable, "-W", "ignore", os.path.join(HERE, script)]
        argv += [] if role is None else [role, "--port", str(port)]
        for k, v in opts.items():
            argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=checkout_env(**ENV))
        try:
            ready = self._line(300).get("ready")  # SGLang imports for a minute on a busy box
        except BaseException:
            self.close()  # nobody else holds this rank yet
            raise
        assert ready, f"{role} rank did not start"

    def _line(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"rank {self.proc.pid} did not answer within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"rank {self.proc.pid} exited ({self.proc.poll()})")
        return json.loads(line)

    def call(self, op, timeout=60, **fields):
        if op in ("bootstrap", "wait", "forget", "timed_send"):
            fields["timeout"] = timeout  # the rank bounds its own wait; we bound the reply
        self.proc.stdin.write(json.dumps(dict(op=op, **fields)) + "\n")
        self.proc.stdin.flush()
        reply = self._line(timeout + 10)
        assert "error" not in reply, f"{op}: {reply['error']}"
        return reply

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

