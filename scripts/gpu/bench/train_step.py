"""PyTorch training-step benchmark: a small transformer, bf16 autocast, AdamW.

Token embedding -> nn.TransformerEncoder (d_model 1024, 8 heads, 6 layers,
batch 32 x seq 512) -> vocabulary head -> cross-entropy. Warm-up 20 steps, then
100 timed steps; each step is timed on the host with torch.cuda.synchronize()
at its end (so allocator time on the CPU is inside the figure) and on the GPU
with CUDA events. The allocator backend comes from PYTORCH_CUDA_ALLOC_CONF.
Prints one JSON line.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cases"))
from common import preloaded  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    a = p.parse_args()
    res = {"bench": "train_step", "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
           "preloaded": preloaded(), "error": None}
    try:
        import torch
        import torch.nn as nn
        res["torch"] = torch.__version__
        torch.manual_seed(0)
        dev = torch.device("cuda", 0)

        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(a.vocab, a.d_model)
                layer = nn.TransformerEncoderLayer(a.d_model, nhead=8, dim_feedforward=4 * a.d_model,
                                                   dropout=0.1, batch_first=True, norm_first=True)
                self.enc = nn.TransformerEncoder(layer, num_layers=a.layers, enable_nested_tensor=False)
                self.head = nn.Linear(a.d_model, a.vocab)

            def forward(self, x):
                return self.head(self.enc(self.emb(x)))

        model = Model().to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loss_fn = nn.CrossEntropyLoss()
        x = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)
        y = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
                loss = loss_fn(out.float().view(-1, a.vocab), y.view(-1))
            loss.backward()
            opt.step()
            return loss

        for _ in range(a.warmup):
            step()
        torch.cuda.synchronize()
        host_ms, gpu_ms = [], []
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(a.steps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(a.steps)]
        t_all = time.perf_counter()
        for i in range(a.steps):
            t0 = time.perf_counter()
            starts[i].record()
            loss = step()
            ends[i].record()
            torch.cuda.synchronize()
            host_ms.append((time.perf_counter() - t0) * 1e3)
        res["total_s"] = time.perf_counter() - t_all
        gpu_ms = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        res["step_ms"] = statistics.median(host_ms)
        res["step_ms_min"] = min(host_ms)
        res["step_ms_max"] = max(host_ms)
        res["gpu_step_ms"] = statistics.median(gpu_ms)
        res["loss"] = float(loss)
        res["max_reserved"] = torch.cuda.max_memory_reserved()
        try:
            res["backend"] = torch.cuda.get_allocator_backend()
        except Exception:  # noqa: BLE001
            pass
    except BaseException as e:  # noqa: BLE001
        res["error"] = "%s: %s" % (type(e).__name__, " ".join(str(e).split())[:400])
    sys.stdout.write("\n" + json.dumps(res) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
