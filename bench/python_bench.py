# SPDX-License-Identifier: Apache-2.0
"""Each step-path call of the Python binding beside the PyTorch code it
replaces, in one process, one thread: a markdown table of ratios.

    capture  moecap Capturer.capture       vs  buf[:n, layer].copy_(ids)          (int32 device buffer)
    commit   moecap Capturer.commit(slots) vs  cache[slots] = buf[:n]             (index_put, int32 cache)
    step     all layers' captures + commit vs  the same copies + index_put        (one engine step)
    read     moecap Capturer.read(out=)    vs  torch.index_select(cache, 0, slots, out=)
             (the same slots every call, their rows cached; and, without --quick,
             another request's slots every call, spread over the whole cache)

Model: 61 layers, top-8 of 256 experts (DeepSeek-V3; moecap stores u8), host
backend, a cache of 262,144 slots, random slots. Commit consumes the rows it
reads, so each commit (moecap's and torch's) is timed alone right after the
step's captures (untimed): it moves routing captured for it, in the caches
the captures leave, as in an engine. Also the binding's own cost: capture of
1 row minus the C call alone (borrowing done once). Run: cmake --build build --target bench, or
PYTHONPATH=build/python <venv>/bin/python bench/python_bench.py [--quick].
"""
import argparse
import statistics
import time

import torch

import moecap

LAYERS, TOP_K, EXPERTS, HOST_SLOTS, ROWS = 61, 8, 256, 1 << 18, 8192


def per_call(fn, min_time, repeats=5):
    """Median over `repeats` of seconds per call, each run at least min_time long."""
    fn()
    n = 1
    while True:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time / 10:
            break
        n *= 4
    n = max(1, int(n * min_time / max(elapsed, 1e-9) / 1.0))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - start) / n)
    return statistics.median(times)


def per_call_after(prepare, fn, min_time, repeats=5):
    """Median over `repeats` of seconds per call of fn alone, each call right
    after prepare() (untimed): a commit timed in the caches the step's
    captures leave, as in an engine."""
    prepare()
    fn()
    times = []
    for _ in range(repeats):
        spent, calls = 0.0, 0
        while spent < min_time or calls < 3:
            prepare()
            start = time.perf_counter()
            fn()
            spent += time.perf_counter() - start
            calls += 1
        times.append(spent / calls)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke test, not numbers to quote)")
    args = parser.parse_args()
    min_time = 0.02 if args.quick else 0.2
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)

    cap = moecap.Capturer(num_layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS, host_slots=HOST_SLOTS,
                          max_running_requests=256, chunked_prefill_size=ROWS)
    device_buffer = torch.zeros(ROWS, LAYERS, TOP_K, dtype=torch.int32)  # what an engine keeps without moecap
    host_cache = torch.zeros(HOST_SLOTS, LAYERS, TOP_K, dtype=torch.int32)
    rows = []

    for n in (1, 64, 512):
        ids = torch.randint(0, EXPERTS, (n, TOP_K), dtype=torch.int32, generator=gen)
        ours = per_call(lambda: cap.capture(7, ids), min_time)
        theirs = per_call(lambda: device_buffer[:n, 7].copy_(ids), min_time)
        rows.append((f"capture {n} row{'s' if n > 1 else ''}", f"{ours * 1e6:.2f} us", f"{theirs * 1e6:.2f} us",
                     theirs / ours, ">= 2x"))
        if n == 1:
            c_call = cap._time_capture(7, ids, max(1000, int(min_time / 1e-7)))
            overhead = ours - c_call

    device_buffer.copy_(torch.randint(0, EXPERTS, (ROWS, LAYERS, TOP_K), dtype=torch.int32, generator=gen))
    for n in (64, 512, 4096):
        slots = torch.randperm(HOST_SLOTS, generator=gen)[:n]
        layer_ids = [torch.randint(0, EXPERTS, (n, TOP_K), dtype=torch.int32, generator=gen) for _ in range(LAYERS)]

        def captures():
            for layer in range(LAYERS):
                cap.capture(layer, layer_ids[layer])

        def step():
            captures()
            cap.commit(slots)

        def torch_captures():
            for layer in range(LAYERS):
                device_buffer[:n, layer].copy_(layer_ids[layer])

        def torch_step():
            torch_captures()
            host_cache.index_put_((slots,), device_buffer[:n])

        ours_step = per_call(step, min_time)
        theirs_step = per_call(torch_step, min_time)
        ours_commit = per_call_after(captures, lambda: cap.commit(slots), min_time)
        theirs_commit = per_call_after(torch_captures, lambda: host_cache.index_put_((slots,), device_buffer[:n]),
                                       min_time)
        got = cap.read(slots[:1])
        assert int(got.min()) >= 0, "the timed commits stored no routing"
        rows.append((f"commit {n} rows, random slots", f"{n / ours_commit / 1e6:.2f} M tok/s",
                     f"{n / theirs_commit / 1e6:.2f} M tok/s", theirs_commit / ours_commit,
                     ">= 3x" if n == 4096 else ""))
        rows.append((f"engine step {n} rows ({LAYERS} captures + commit)", f"{ours_step * 1e6:.0f} us",
                     f"{theirs_step * 1e6:.0f} us", theirs_step / ours_step, ">= 2x"))

    for layer in range(LAYERS):  # real routing in the slots read
        cap.capture(layer, torch.randint(0, EXPERTS, (ROWS, TOP_K), dtype=torch.int32, generator=gen))
    cap.commit(torch.arange(ROWS))
    for n, target in ((128, ">= 1x"), (4096, ">= 4x")):
        slots = torch.randperm(ROWS, generator=gen)[:n]
        out_ours = torch.empty(n, LAYERS, TOP_K, dtype=torch.int32)
        out_theirs = torch.empty(n, LAYERS, TOP_K, dtype=torch.int32)
        ours = per_call(lambda: cap.read(slots, out=out_ours), min_time)
        theirs = per_call(lambda: torch.index_select(host_cache, 0, slots, out=out_theirs), min_time)
        rows.append((f"read {n} tokens", f"{n / ours / 1e6:.2f} M tok/s", f"{n / theirs / 1e6:.2f} M tok/s",
                     theirs / ours, target))

    # A finished request's slots, as an engine reads them: spread over the
    # whole cache and written long before, so not in any cache level. Every
    # call reads another 4096 slots of one permutation of all of them.
    if not args.quick:
        n = 4096
        for first in range(0, HOST_SLOTS, ROWS):
            for layer in range(LAYERS):
                cap.capture(layer, torch.randint(0, EXPERTS, (ROWS, TOP_K), dtype=torch.int32, generator=gen))
            cap.commit(torch.arange(first, first + ROWS))
        host_cache.random_(0, EXPERTS, generator=gen)
        walk = torch.randperm(HOST_SLOTS, generator=gen).split(n)
        out_ours = torch.empty(n, LAYERS, TOP_K, dtype=torch.int32)
        out_theirs = torch.empty(n, LAYERS, TOP_K, dtype=torch.int32)
        at = {"ours": 0, "theirs": 0}

        def read_ours():
            at["ours"] = (at["ours"] + 1) % len(walk)
            cap.read(walk[at["ours"]], out=out_ours)

        def read_theirs():
            at["theirs"] = (at["theirs"] + 1) % len(walk)
            torch.index_select(host_cache, 0, walk[at["theirs"]], out=out_theirs)

        ours, theirs = per_call(read_ours, min_time), per_call(read_theirs, min_time)
        rows.append((f"read {n} tokens, each call another request's slots of {HOST_SLOTS:,}",
                     f"{n / ours / 1e6:.2f} M tok/s", f"{n / theirs / 1e6:.2f} M tok/s", theirs / ours, ">= 4x"))
    cap.close()

    print(f"moecap Python binding vs torch {torch.__version__}, one thread; {LAYERS} layers, top-{TOP_K} of "
          f"{EXPERTS} experts, host backend")
    print()
    print("| call | moecap | torch | ratio | target |")
    print("|---|---|---|---|---|")
    for name, ours, theirs, ratio, target in rows:
        print(f"| {name} | {ours} | {theirs} | {ratio:.2f}x | {target} |")
    print()
    print(f"binding overhead per call (capture 1 row {rows[0][1]} minus the C call alone "
          f"{c_call * 1e6:.2f} us): {overhead * 1e6:.2f} us (target <= 2 us)")


if __name__ == "__main__":
    main()
