"""A PyTorch training job that needs most of its device-memory budget.

Run under cudabudget (the compose file does this through the image's entrypoint):
    CUDABUDGET_LIMIT=60Gi python3 trainer.py

It prints the memory the process sees (its budget, not the card), holds a working set
of TRAIN_WORKING_SET_GIB GiB (default 50) beside a small model it trains for
TRAIN_STEPS steps (default 2000; 0: until stopped, as a continuous fine-tuning service),
and at the end shows the budget at work: one allocation past it is refused with
torch.OutOfMemoryError before the card is touched.
Exit status: 0 when training finished and the budget held, 1 otherwise.
"""

import os
import signal
import sys
import time

import torch

GIB = 1 << 30


def say(message):
    print(f"trainer: {message}", flush=True)


def main():
    # As PID 1 of a container, Python has no default action for SIGTERM: stop cleanly.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if not torch.cuda.is_available():
        say("no CUDA device is visible; nothing to train on")
        return 1
    working_set_gib = float(os.environ.get("TRAIN_WORKING_SET_GIB", "50"))
    steps = int(os.environ.get("TRAIN_STEPS", "2000"))

    free, total = torch.cuda.mem_get_info()
    say(
        f"{torch.cuda.get_device_name()}: this process sees {total / GIB:.1f} GiB "
        f"({free / GIB:.1f} GiB free); CUDABUDGET_LIMIT={os.environ.get('CUDABUDGET_LIMIT')}"
    )

    try:
        # Stands in for what a real job keeps resident: activations, a replay buffer.
        working_set = torch.empty(int(working_set_gib * GIB), dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        say(f"a {working_set_gib:.0f} GiB working set does not fit in {total / GIB:.1f} GiB")
        return 1
    working_set.fill_(1)

    model = torch.nn.Sequential(
        torch.nn.Linear(4096, 8192),
        torch.nn.GELU(),
        torch.nn.Linear(8192, 4096),
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    started = time.monotonic()
    step = 0
    while steps == 0 or step < steps:
        step += 1
        batch = torch.randn(512, 4096, device="cuda")
        loss = (model(batch) - batch).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 200 == 0 or step == steps:
            say(
                f"step {step}/{steps or 'until stopped'} loss {loss.item():.4f} "
                f"reserved {torch.cuda.memory_reserved() / GIB:.1f} GiB "
                f"({time.monotonic() - started:.0f} s)"
            )

    # The budget at work: ask for more than is left of it.
    over = total - torch.cuda.memory_reserved() + GIB
    try:
        torch.empty(over, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        say(f"a {over / GIB:.1f} GiB allocation past the budget was refused, as it should be")
        return 0
    say(f"a {over / GIB:.1f} GiB allocation past the budget succeeded: no budget in force")
    return 1


if __name__ == "__main__":
    sys.exit(main())
