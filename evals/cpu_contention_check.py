"""Do the two sub-server processes slow each other down on this machine? Decode-step latency of the
CPU pair's models (1 torch thread, `profile_latency`) alone, then while a second process runs the
small model at batch 8 in a loop.

    .venv/bin/python evals/cpu_contention_check.py
"""
import multiprocessing as mp
import time


def ms(lat) -> dict:
    return {b: round(1000 * v, 1) for b, v in lat.table.items()}


def busy(stop) -> None:
    import torch
    torch.set_num_threads(1)
    from tokenrouter_sdk.models import default_pair
    from tokenrouter_sdk.planner.profile import profile_latency
    _, small, _ = default_pair()
    while not stop.is_set():
        profile_latency(small, (8,), steps=5, warmup=0, extend_tokens=0)


def main() -> None:
    import torch
    torch.set_num_threads(1)
    from tokenrouter_sdk.models import default_pair
    from tokenrouter_sdk.planner.profile import profile_latency
    large, small, _ = default_pair()
    print("large alone", ms(profile_latency(large, (1, 2, 8), steps=9, extend_tokens=0)), flush=True)
    print("small alone", ms(profile_latency(small, (1, 8), steps=9, extend_tokens=0)), flush=True)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    p = ctx.Process(target=busy, args=(stop,))
    p.start()
    time.sleep(8)  # the busy process has loaded its model
    print("large, small busy in another process", ms(profile_latency(large, (1, 2, 8), steps=9, extend_tokens=0)))
    print("small, small busy in another process", ms(profile_latency(small, (1, 8), steps=9, extend_tokens=0)))
    stop.set()
    p.join()


if __name__ == "__main__":
    main()
