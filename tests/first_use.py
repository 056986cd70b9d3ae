"""Which kernels a first step compiles: run in a fresh process (a kernel's compiled signatures
live as long as the process), it records every signature numba adds to one of colibri's
kernels after engine.layers.init returned, whether compiled or loaded from numba's cache.

    python first_use.py run ARGS...           colictl run ARGS in this process
    python first_use.py family ROOT FAM...    each family's tiny checkpoint (tests/hf_models.py)
                                              built in ROOT/FAM: init for its kinds, then a
                                              prompt, a decode step and a batch of both

The last line printed is JSON: {what: [signatures added after init]}.
"""

import json
import os
import sys

import numba.core.dispatcher as D

from colibri.engine import layers

added: list[str] = []
armed = [False]
_add = D.Dispatcher.add_overload


def add_overload(self, cres):
    if armed[0] and self.py_func.__module__.startswith("colibri."):
        f = self.py_func
        added.append(f"{f.__module__}.{f.__qualname__}{tuple(str(a) for a in cres.signature.args)}")
    return _add(self, cres)


D.Dispatcher.add_overload = add_overload
_init = layers.init


def init(*args, **kwargs):
    armed[0] = False
    _init(*args, **kwargs)
    armed[0] = True


init.done = _init.done
layers.init = init


def run(argv: list[str]) -> dict:
    from colibri.ctl.main import cli

    try:
        cli.main(["run", *argv], standalone_mode=False)
    except SystemExit:
        pass
    return {"run": added}


def families(root: str, names: list[str]) -> dict:
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from hf_models import CASES, build, load_model

    got = {}
    for fam in names:
        path = os.path.join(root, fam)
        build(fam, CASES[fam][0][0], path)
        model = load_model(path)
        layers.init(1, kinds=model.kernel_kinds())
        start = len(added)
        ids = np.arange(1, 8) % model.args.vocab_size
        a, b = model.new_cache(64), model.new_cache(64)
        model.forward(ids[:5], a)  # a prompt
        model.forward(ids[5:6], a)  # a decode step
        model.forward_batch([(ids[:3], b), (ids[6:7], a)])  # a batch of both
        model.forward_batch([(ids[3:4], b), (ids[:1], a)])  # a batch of decode steps
        got[fam] = added[start:]
        armed[0] = False
    return got


if __name__ == "__main__":
    out = run(sys.argv[2:]) if sys.argv[1] == "run" else families(sys.argv[2], sys.argv[3:])
    print(json.dumps(out))
