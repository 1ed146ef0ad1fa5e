"""cudabudget for Ray workers: each task's or actor's budget from what Ray gave it.

Installed in the workers' Python on every node (site-packages, with cudabudget-ray.pth
beside it), it is imported at each interpreter's start and does nothing unless the
process has cudabudget in LD_PRELOAD (`ray start` run with it, so every worker inherits
it). In such a process it waits for Ray's `ray._private.utils` to be imported and wraps
its `set_visible_accelerator_ids`, which each worker calls before every task and actor
it runs (after the task's resources are assigned, before the task's code); the wrapper
then sets the budget the library reads at the process's first CUDA call:

    resources={"cudabudget_gib": N}   CUDABUDGET_LIMIT=<N>Gi
    num_gpus=F, 0 < F < 1             CUDABUDGET_LIMIT=<F x 100>%  (of the GPU's memory,
                                      as the driver reports it; 0.25 -> 25.00%)
    whole GPUs, or none               no budget

The user's code names nothing. A worker started with a budget of its own
(`runtime_env={"env_vars": {"CUDABUDGET_LIMIT": ...}}`, `CUDABUDGET_LIMIT_<N>`, HAMi's
`CUDA_DEVICE_MEMORY_LIMIT*`) keeps it: this module then sets nothing.

The library reads its budget once per process, at the first CUDA call. A task whose
budget differs from the one an earlier task of the same worker process ran under, once
CUDA or NVML is loaded in it, is refused (a RuntimeError before the task's code: Ray
counts it as the worker's failure, replaces the worker and retries the task in a fresh
one, within the task's `max_retries`) instead of running under the earlier budget; so is
a budgeted task in a worker where the library is not loaded. Ray runs a task declared
with `@ray.remote(num_gpus=...)` in a fresh worker (`max_calls=1`) and each actor in a
worker of its own; give `max_calls=1` to a function whose share is set only with
`.options(...)` to spare the retry.

Tested with Ray 2.60.0. The wrapped function is Ray's internal API: with a Ray that has
none, a process with the library preloaded says so on stderr when it imports Ray.
"""

import importlib.abc
import importlib.util
import os
import sys

UTILS = "ray._private.utils"
RESOURCE = "cudabudget_gib"
LIMIT = "CUDABUDGET_LIMIT"
LIBRARY = "libcudabudget.so"


def own_budget(environ):
    """Whether `environ` holds a budget of its own (ours or HAMi's)."""
    return any(
        name == LIMIT or name.startswith(LIMIT + "_") or name.startswith("CUDA_DEVICE_MEMORY_LIMIT")
        for name in environ
    )


def budget_for(resources):
    """The budget for a task that Ray gave `resources` (its assigned resources), or None."""
    gib = resources.get(RESOURCE, 0)
    if gib > 0:
        # Ray counts resources in ten-thousandths.
        return f"{round(gib * 10000) / 10000:g}Gi"
    gpus = resources.get("GPU", 0)
    if 0 < gpus < 1:
        hundredths = max(round(gpus * 10000), 1)
        return f"{hundredths // 100}.{hundredths % 100:02d}%"
    return None


def loaded():
    """The file names of the shared objects mapped in this process."""
    names = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6:
                names.add(os.path.basename(fields[5].rstrip("\n")))
    return names


class Budgets:
    """What this worker process was started with and what it has set since."""

    def __init__(self, environ):
        self.own = own_budget(environ)
        self.set = None
        self.tasks = 0

    def apply(self, resources, environ):
        """Sets (or removes) the budget for a task that Ray gave `resources`; raises
        RuntimeError when it cannot be enforced in this process."""
        if self.own:
            return
        budget = budget_for(resources)
        earlier, self.tasks = self.tasks, self.tasks + 1
        if budget == self.set:
            return
        names = loaded()
        # Before its first task a worker has run no code but Ray's, which makes no CUDA call.
        cuda = earlier > 0 and any(n.startswith(("libcuda.so", "libnvidia-ml.so")) for n in names)
        if budget is not None and LIBRARY not in names:
            raise RuntimeError(
                f"cudabudget: this task's budget ({budget}) cannot be enforced: {LIBRARY} is not "
                "loaded in this Ray worker (is it in LD_PRELOAD of `ray start`, at a path that exists?)"
            )
        if budget is not None and cuda:
            raise RuntimeError(
                f"cudabudget: this task's budget ({budget}) cannot be enforced in this Ray worker: "
                f"it loaded CUDA for an earlier task (budget {self.set or 'none'}), and a process "
                "reads its budget once (Ray replaces the worker and retries the task within its "
                "max_retries; max_calls=1 avoids it)"
            )
        if cuda:
            # No budget asked for, in a process that may have read one: it keeps it.
            return
        if budget is None:
            environ.pop(LIMIT, None)
        else:
            environ[LIMIT] = budget
        self.set = budget


BUDGETS = Budgets(os.environ)


def wrap(utils):
    """Wraps `utils.set_visible_accelerator_ids`, which a worker calls before each task."""
    original = getattr(utils, "set_visible_accelerator_ids", None)
    if original is None:
        sys.stderr.write(
            "cudabudget_ray: this Ray has no ray._private.utils.set_visible_accelerator_ids; "
            "tasks get no budget from their resources\n"
        )
        return

    def set_visible_accelerator_ids(*args, **kwargs):
        result = original(*args, **kwargs)
        import ray

        BUDGETS.apply(ray.get_runtime_context().get_assigned_resources(), os.environ)
        return result

    set_visible_accelerator_ids.__wrapped__ = original
    utils.set_visible_accelerator_ids = set_visible_accelerator_ids


class Finder(importlib.abc.MetaPathFinder):
    """Finds Ray's utils module as the import system would, and wraps it once loaded."""

    def find_spec(self, name, path=None, target=None):
        if name != UTILS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            wrap(module)

        spec.loader.exec_module = exec_module
        return spec


def install():
    """Called by cudabudget-ray.pth at the interpreter's start: wraps Ray's utils when
    they are imported, in a process with the library in LD_PRELOAD."""
    if LIBRARY not in os.environ.get("LD_PRELOAD", ""):
        return
    if UTILS in sys.modules:
        wrap(sys.modules[UTILS])
    else:
        sys.meta_path.insert(0, Finder())
