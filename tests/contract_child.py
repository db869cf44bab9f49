"""The execution contract's process fields (kernels, ISA, versions) of a fresh Python process
with other environment variables: a trainer process whose kernel build differs, for real (used by
tests/core/test_contract.py and tests/e2e/test_contract_vllm.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

CODE = ("import json\nfrom skyrl_numerics.invariant import contract\n"
        "print('FIELDS ' + json.dumps(contract.process_fields()))\n")


def child_process_fields(**env) -> dict:
    """:func:`skyrl_numerics.invariant.contract.process_fields` of a fresh process with ``env``."""
    p = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("FIELDS "))[7:])
