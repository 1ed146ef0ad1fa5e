"""A JAX inference service with JAX's default memory behaviour (it preallocates 75 %
of the memory it sees).

Run under cudabudget (the compose file does this through the image's entrypoint):
    CUDABUDGET_LIMIT=40Gi python3 jax_service.py

Under a 40 GiB budget XLA sizes its pool from the budget (30 GiB) instead of from the
card, which leaves the rest of the card to the other jobs. It then serves a jitted
model: SERVE_REQUESTS requests (default 0: until stopped), one every SERVE_INTERVAL
seconds (default 0.2).
"""

import os
import signal
import sys
import time

import jax
import jax.numpy as jnp

GIB = 1 << 30


def say(message):
    print(f"jax: {message}", flush=True)


@jax.jit
def serve(weights, requests):
    hidden = jnp.tanh(requests @ weights[0])
    return jax.nn.softmax(hidden @ weights[1], axis=-1)


def main():
    # As PID 1 of a container, Python has no default action for SIGTERM: stop cleanly.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    device = jax.devices()[0]
    if device.platform != "gpu":
        say(f"JAX found no GPU (platform {device.platform!r}); nothing to serve on")
        return 1
    stats = device.memory_stats() or {}
    say(
        f"{device.device_kind}: XLA's pool limit is {stats.get('bytes_limit', 0) / GIB:.1f} GiB; "
        f"CUDABUDGET_LIMIT={os.environ.get('CUDABUDGET_LIMIT')}"
    )

    requests_to_serve = int(os.environ.get("SERVE_REQUESTS", "0"))
    interval = float(os.environ.get("SERVE_INTERVAL", "0.2"))
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    weights = (
        jax.random.normal(keys[0], (4096, 4096)) / 64,
        jax.random.normal(keys[1], (4096, 1000)) / 64,
    )
    served = 0
    while requests_to_serve == 0 or served < requests_to_serve:
        batch = jax.random.normal(jax.random.fold_in(keys[2], served), (256, 4096))
        started = time.perf_counter()
        serve(weights, batch).block_until_ready()
        served += 1
        if served % 100 == 0 or served == requests_to_serve:
            in_use = (device.memory_stats() or {}).get("bytes_in_use", 0)
            say(
                f"served {served} requests, last in {(time.perf_counter() - started) * 1e3:.1f} ms, "
                f"{in_use / GIB:.2f} GiB in use"
            )
        time.sleep(interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
