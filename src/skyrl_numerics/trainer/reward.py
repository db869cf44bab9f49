"""A user's reward in the loop: ``--reward module:function`` or ``--reward path/to/file.py:function``.

The function takes the step's :class:`~skyrl_numerics.rollout.Rollout` (token ids, groups, the
sampling parameters) and returns one finite float per row (``len(rollout)``): the verifier of the
user's task. It is loaded once, before any engine starts; a module that does not import, a missing
function, or a return value of the wrong shape / type / a non-finite entry is an ``InputError``
naming the reward and the row. A file path is loaded with ``importlib.util.spec_from_file_location``
(nothing is added to ``sys.path``).
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from skyrl_numerics.errors import InputError


def load_reward(spec: str, *, field: str = "reward") -> Callable:
    """``"pkg.module:function"`` or ``"path/to/file.py:function"`` -> the function (or any
    callable: ``--env`` loads an environment factory the same way; ``field`` names it in errors)."""
    mod_name, sep, fn_name = str(spec).rpartition(":")
    if not sep or not mod_name or not fn_name.isidentifier():
        raise InputError(f"expected MODULE:FUNCTION or FILE.py:FUNCTION, got {spec!r}",
                         field=field)
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            if not path.is_file():
                raise InputError(f"{path} is not a file", field=field)
            loader_spec = importlib.util.spec_from_file_location(f"skyrl_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except InputError:
        raise
    except Exception as e:
        raise InputError(f"{mod_name} does not import: {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]}", field=field) from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise InputError(f"{mod_name} has no function {fn_name!r}", field=field)
    return fn


@dataclass(frozen=True)
class RewardTask:
    """The loop's task from a reward function (``run_loop(task=RewardTask(fn))``)."""
    fn: Callable
    name: str = "custom"

    def reward(self, rollout) -> np.ndarray:
        try:
            out = self.fn(rollout)
        except Exception as e:
            raise InputError(f"reward {self.name} failed: {type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]}", field="reward") from None
        arr = np.asarray(out)
        if arr.shape != (len(rollout),):
            raise InputError(f"reward {self.name} returned shape {arr.shape}; expected "
                             f"({len(rollout)},): one reward per row", field="reward")
        if arr.dtype.kind not in "fiub":
            raise InputError(f"reward {self.name} returned dtype {arr.dtype}, not numbers",
                             field="reward")
        arr = arr.astype(np.float64)
        bad = ~np.isfinite(arr)
        if bad.any():
            i = int(np.argmax(bad))
            raise InputError(f"reward {self.name} is {arr[i]} (not finite)", row=i, field="reward")
        return arr
