"""DataLoader workers forked while another thread is being denied memory.

torch initialises CUDA and holds --hold-gib. A background thread asks, again
and again, for more than the budget allows (alternately budget + 4 GiB and
just over what is left: budget - hold + 1 GiB), catching
torch.OutOfMemoryError, so that under the library it is inside its denial path
most of the time. Meanwhile the main thread iterates a DataLoader over a small
CPU dataset, num_workers=--workers, multiprocessing_context="fork",
timeout=--loader-timeout, for --epochs epochs (new workers each epoch). Every
batch is counted and summed. Then the thread is stopped and --after-gib is
allocated. Natively the same asks succeed (each is freed and the cache
emptied, so the driver is called every time).

A hang becomes an error in the JSON: an in-process watchdog (--watchdog-s)
prints the JSON so far and exits; faulthandler dumps every thread's stack a
little later and ends the process if even that could not run.
"""

import argparse
import faulthandler
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GiB, Sampler, checkpoint, emit, exc_text, run_case  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--budget-gib", type=float, default=8)
    p.add_argument("--hold-gib", type=float, default=2)
    p.add_argument("--after-gib", type=float, default=4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--loader-timeout", type=float, default=60)
    p.add_argument("--watchdog-s", type=float, default=100)
    p.add_argument("--ask-pause", type=float, default=0.002, help="seconds between two asks")
    return p.parse_args()


def body(res, args):
    phase = {"name": "start"}

    def fire():
        msg = "watchdog: still running after %ds (phase %s)" % (args.watchdog_s, phase["name"])
        res["error"] = msg if not res.get("error") else res["error"] + " | " + msg
        res["watchdog_fired"] = True
        checkpoint(res)
        emit(res)
        sys.stderr.flush()
        os._exit(3)

    timer = threading.Timer(args.watchdog_s, fire)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(args.watchdog_s + 15, exit=True)
    try:
        run(res, args, phase)
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()


def run(res, args, phase):
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    res["torch"] = torch.__version__
    OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    dev = torch.device("cuda", 0)
    smi = Sampler(res)

    phase["name"] = "hold"
    try:
        hold = torch.empty(int(args.hold_gib * GiB), dtype=torch.uint8, device=dev)
        hold.fill_(1)
        torch.cuda.synchronize()
        res["hold_ok"] = True
    except Exception as e:  # noqa: BLE001
        res["hold_ok"] = False
        res["hold_exc"] = exc_text(e)
        return
    smi.sample("holding")

    asks = [int((args.budget_gib + 4) * GiB), int((args.budget_gib - args.hold_gib + 1) * GiB)]
    res["ask_sizes"] = asks
    st = {"n": 0, "ok": 0, "oom": 0, "other": 0, "n_loader": 0, "oom_loader": 0, "other_exc": None}
    stop = threading.Event()
    loading = threading.Event()

    def asker():
        i = 0
        while not stop.is_set():
            size = asks[i % len(asks)]
            i += 1
            in_loader = loading.is_set()
            try:
                t = torch.empty(size, dtype=torch.uint8, device=dev)
                del t
                st["ok"] += 1
                torch.cuda.empty_cache()  # natively: call the driver again next time
            except OOM:
                st["oom"] += 1
                if in_loader:
                    st["oom_loader"] += 1
            except Exception as e:  # noqa: BLE001
                st["other"] += 1
                st["other_exc"] = exc_text(e, 300)
            st["n"] += 1
            if in_loader:
                st["n_loader"] += 1
            if args.ask_pause > 0:
                time.sleep(args.ask_pause)

    th = threading.Thread(target=asker, name="asker", daemon=True)
    th.start()
    time.sleep(0.5)  # let the thread get going before the first fork

    phase["name"] = "loader"
    n, d = args.samples, 16
    ds = TensorDataset(torch.arange(n * d, dtype=torch.float32).view(n, d), torch.arange(n, dtype=torch.int64))
    expected_batches = (n + args.batch - 1) // args.batch
    expected_sum = n * (n - 1) // 2
    res.update(epochs=args.epochs, workers=args.workers, batches_expected=expected_batches * args.epochs)
    seen, epochs_done, sums_ok = 0, 0, True
    res["loader_exc"] = None
    t0 = time.time()
    loading.set()
    try:
        for ep in range(args.epochs):
            dl = DataLoader(ds, batch_size=args.batch, shuffle=(ep % 2 == 1), num_workers=args.workers,
                            multiprocessing_context="fork", timeout=args.loader_timeout,
                            persistent_workers=False, pin_memory=False)
            count, total = 0, 0
            for xb, yb in dl:
                count += 1
                total += int(yb.sum())
                if xb.shape[1] != d:
                    sums_ok = False
            seen += count
            if count != expected_batches or total != expected_sum:
                sums_ok = False
            epochs_done += 1
            res["epochs_done"], res["batches_seen"] = epochs_done, seen
            checkpoint(res)
    except Exception as e:  # noqa: BLE001 - e.g. "DataLoader timed out after 60 seconds", a worker killed
        res["loader_exc"] = exc_text(e, 600)
        res["loader_exc_class"] = type(e).__name__
    loading.clear()
    res["loader_s"] = round(time.time() - t0, 2)
    res["epochs_done"], res["batches_seen"] = epochs_done, seen
    res["forks"] = epochs_done * args.workers
    res["batches_ok"] = (sums_ok and epochs_done == args.epochs and seen == expected_batches * args.epochs)
    res["asks_during_loader"] = st["n_loader"]
    res["asks_oom_during_loader"] = st["oom_loader"]
    checkpoint(res)

    phase["name"] = "stop-asker"
    stop.set()
    th.join(timeout=20)
    res["asker_stopped"] = not th.is_alive()
    res.update(asks=st["n"], asks_ok=st["ok"], asks_oom=st["oom"], asks_other=st["other"],
               asks_other_exc=st["other_exc"])
    smi.sample("after_loader")

    phase["name"] = "after"
    try:
        t = torch.empty(int(args.after_gib * GiB), dtype=torch.uint8, device=dev)
        t.fill_(1)
        torch.cuda.synchronize()
        res["after_ok"] = True
        smi.sample("after")
        del t
    except Exception as e:  # noqa: BLE001
        res["after_ok"] = False
        res["after_exc"] = exc_text(e, 600)
    del hold
    phase["name"] = "done"


def main():
    args = parse()
    run_case("dataloader_fork", args, lambda res: (res.update(budget_gib=args.budget_gib), body(res, args)))


if __name__ == "__main__":
    main()
