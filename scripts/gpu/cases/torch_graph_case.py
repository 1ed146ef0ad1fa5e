"""PyTorch CUDA graphs under a budget (the allocator backend comes from
PYTORCH_CUDA_ALLOC_CONF, set by the runner).

--mode capture : torch.cuda.graph captures a small computation that also
                 allocates inside the capture (a matmul chain plus an
                 --inner-mib tensor); replayed --replays times with new inputs,
                 each result compared with the eager computation. Then the graph
                 is dropped and --after-gib is allocated (reported only).
--mode compile : torch.compile(mode="reduce-overhead") of two Linear layers,
                 --steps inference steps, each compared with eager (finite,
                 allclose). A compile that cannot run (no triton, no C
                 compiler) is reported in compile_exc / compile_skip, never
                 raised: the judge decides SKIP when the native run fails too.

An in-process watchdog (--watchdog-s) reports a hang as an error in the JSON
and exits; faulthandler dumps every thread's stack to stderr a little later
and ends the process if even that did not run.
"""

import argparse
import faulthandler
import gc
import os
import re
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GiB, MiB, Sampler, checkpoint, emit, exc_text, run_case  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="capture", choices=["capture", "compile"])
    p.add_argument("--budget-gib", type=float, default=None, help="for the log only")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--inner-mib", type=int, default=512, help="tensor allocated inside the capture")
    p.add_argument("--replays", type=int, default=5)
    p.add_argument("--after-gib", type=float, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--watchdog-s", type=float, default=100)
    return p.parse_args()


def start_watchdog(res, seconds, phase):
    """After `seconds`, record the hang in res, print the JSON and exit(3).
    Returns a function that disarms it (call it before the JSON is printed)."""
    def fire():
        msg = "watchdog: still running after %ds (phase %s)" % (seconds, phase.get("name"))
        res["error"] = msg if not res.get("error") else res["error"] + " | " + msg
        res["watchdog_fired"] = True
        checkpoint(res)
        emit(res)
        sys.stderr.flush()
        os._exit(3)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()
    # Last resort when the GIL is held by a stuck thread: dump all stacks, exit.
    faulthandler.dump_traceback_later(seconds + 15, exit=True)

    def cancel():
        t.cancel()
        faulthandler.cancel_dump_traceback_later()
    return cancel


def mode_capture(res, args, phase):
    import torch
    res["torch"] = torch.__version__
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda", 0)
    smi = Sampler(res)
    try:
        res["backend"] = torch.cuda.get_allocator_backend()
    except Exception as e:  # noqa: BLE001
        res["backend"] = "unknown: " + exc_text(e)
    free, total = torch.cuda.mem_get_info(0)
    res["free_at_start"], res["total"] = free, total

    gen = torch.Generator(device="cpu").manual_seed(0)
    n = args.dim
    w1 = (torch.randn(n, n, generator=gen) / n ** 0.5).to(dev)
    w2 = (torch.randn(n, n, generator=gen) / n ** 0.5).to(dev)
    inner = int(args.inner_mib * MiB // 4)

    def f(a):
        h = torch.relu(a @ w1)  # allocations inside the capture
        big = torch.ones(inner, device=dev)  # a larger one
        big.mul_(0.5)
        return h @ w2 + big.mean()

    static_in = torch.randn(args.batch, n, generator=gen).to(dev)
    phase["name"] = "warm-up"
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            f(static_in)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()

    phase["name"] = "capture"
    g = torch.cuda.CUDAGraph()
    res["graph_ok"] = False
    try:
        with torch.cuda.graph(g):
            static_out = f(static_in)
        torch.cuda.synchronize()
        res["capture_ok"] = True
    except Exception as e:  # noqa: BLE001
        res["capture_ok"] = False
        res["capture_exc"] = exc_text(e, 800)
        res["capture_exc_class"] = type(e).__name__
        checkpoint(res)
        return
    smi.sample("after_capture")
    checkpoint(res)

    phase["name"] = "replay"
    diffs, ok = [], True
    try:
        for _ in range(args.replays):
            x = torch.randn(args.batch, n, generator=gen).to(dev)
            static_in.copy_(x)
            g.replay()
            torch.cuda.synchronize()
            ref = f(x)
            torch.cuda.synchronize()
            diffs.append(float((static_out - ref).abs().max().item()))
            # A replay that did not happen leaves the previous result: O(1) away, far past 1e-4.
            if not bool(torch.isfinite(static_out).all().item()) or not torch.allclose(static_out, ref,
                                                                                     rtol=1e-4, atol=1e-4):
                ok = False
        res["replays"] = len(diffs)
    except Exception as e:  # noqa: BLE001
        ok = False
        res["replay_exc"] = exc_text(e, 800)
        res["replay_exc_class"] = type(e).__name__
    res["replay_max_abs_diff"] = max(diffs) if diffs else None
    res["replay_ok"] = ok and len(diffs) == args.replays
    res["graph_ok"] = res["capture_ok"] and res["replay_ok"]
    smi.sample("after_replays")
    try:
        res["reserved_with_graph"] = torch.cuda.memory_reserved(0)
    except Exception:  # noqa: BLE001
        pass
    checkpoint(res)

    # Reported only: the graph's memory comes back.
    phase["name"] = "after"
    try:
        del static_out
        g.reset()
        del g
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        t = torch.empty(int(args.after_gib * GiB), dtype=torch.uint8, device=dev)
        t.fill_(1)
        torch.cuda.synchronize()
        res["after_ok"] = True
        smi.sample("after_graph")
        del t
    except Exception as e:  # noqa: BLE001
        res["after_ok"] = False
        res["after_exc"] = exc_text(e, 600)


SKIP_HINT = re.compile(r"C compiler|CC environment|Python\.h|gcc|g\+\+|clang|cc1|InvalidCxxCompiler|CppCompileError"
                       r"|[Tt]riton|ptxas|No such file or directory", re.S)


def mode_compile(res, args, phase):
    import torch
    res["torch"] = torch.__version__
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda", 0)
    smi = Sampler(res)
    try:
        res["backend"] = torch.cuda.get_allocator_backend()
    except Exception as e:  # noqa: BLE001
        res["backend"] = "unknown: " + exc_text(e)
    res["compile_ok"] = False
    try:
        import triton
        res["triton"] = getattr(triton, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        res["compile_skip"] = "triton not importable: " + exc_text(e)
        return
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).to(dev)
    model.eval()
    smi.sample("model_on_gpu")
    try:
        from torch._dynamo.utils import counters
        skips0 = int(counters["inductor"]["cudagraph_skips"])
    except Exception:  # noqa: BLE001
        counters, skips0 = None, 0

    phase["name"] = "compile"
    t0 = time.time()
    cm = torch.compile(model, mode="reduce-overhead")
    mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
    diffs, finite, close = [], True, True
    step = -1
    try:
        with torch.no_grad():
            for step in range(args.steps):
                x = torch.randn(64, 256, device=dev)
                if mark is not None:
                    mark()
                y = cm(x).clone()
                torch.cuda.synchronize()
                ref = model(x)
                torch.cuda.synchronize()
                finite = finite and bool(torch.isfinite(y).all().item())
                diffs.append(float((y - ref).abs().max().item()))
                close = close and torch.allclose(y, ref, rtol=1e-3, atol=1e-3)
                if step == 0:
                    res["first_step_s"] = round(time.time() - t0, 2)
                    checkpoint(res)
                del y
    except Exception as e:  # noqa: BLE001 - includes torch._dynamo BackendCompilerFailed
        text = exc_text(e, 1500)
        res["compile_exc"] = text
        res["compile_exc_class"] = type(e).__name__
        res["compile_failed_step"] = step
        m = SKIP_HINT.search(text)
        if m:
            res["compile_skip_hint"] = "toolchain? (%s)" % m.group(0)
    res["steps_done"] = len(diffs)
    res["compile_s"] = round(time.time() - t0, 2)
    res["finite"] = finite
    res["max_abs_diff"] = max(diffs) if diffs else None
    res["compile_ok"] = len(diffs) == args.steps and finite and close and "compile_exc" not in res
    if counters is not None:
        try:
            res["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"]) - skips0
        except Exception:  # noqa: BLE001
            pass
    smi.sample("after_steps")
    try:
        res["reserved"] = torch.cuda.memory_reserved(0)
    except Exception:  # noqa: BLE001
        pass


def main():
    args = parse()
    phase = {"name": "start"}

    def body(res):
        res["budget_gib"] = args.budget_gib
        cancel = start_watchdog(res, args.watchdog_s, phase)
        try:
            (mode_capture if args.mode == "capture" else mode_compile)(res, args, phase)
            phase["name"] = "done"
        finally:
            cancel()  # disarmed before run_case prints the JSON: one JSON line only

    run_case("torch_graph", args, body)


if __name__ == "__main__":
    main()
