"""The start-up command of the benchmark, timed from inside: `import torch`, then the
first CUDA tensor (driver initialisation, context, cudart's entry points). Prints one
JSON line; run_bench.sh adds the wall time of the whole process."""
import json
import time

t0 = time.perf_counter()
import torch  # noqa: E402

t1 = time.perf_counter()
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
t2 = time.perf_counter()
print(json.dumps({"import_ms": (t1 - t0) * 1e3, "cuda_ms": (t2 - t1) * 1e3,
                  "in_process_ms": (t2 - t0) * 1e3}))
