# SPDX-License-Identifier: Apache-2.0
"""One request's routing turned into what a trainer or a file holds, beside
the NumPy / torch code that writes the same array without moecap, in one
process, one thread: a markdown table of ratios (moecap's time over the
baseline's: 1x is as fast, below 1x faster).

4096 tokens of a 61-layer model whose layers 3-60 route, top-8 of 256
experts (DeepSeek-V3's shape), as a read returns them:
    to_bytes       RoutedExperts.to_bytes (moecap's record)  vs  int16 ids' tobytes()
    from_bytes     RoutedExperts.from_bytes                  vs  np.frombuffer(int16) -> int32
    to_vllm        uint8 [T, 61, 8], dense layers 0           vs  zeros + slice assign
    to_verl        int16 [1, width, 61, 8]                    vs  zeros + slice assign
    to_megatron    per-layer int64 [T, 8] tensors             vs  long().permute().contiguous().unbind()
    all_layers     int16 [T, 61, 8]                           vs  zeros + slice assign

and the engine's bookkeeping of a decode step of 256 running requests (one
token each), beside the slice assign of the step's slots into a [requests,
positions] int64 tensor that an engine keeps anyway (the table is made anew
every 512 steps, which the times include):
    append_step    RequestTable.append_step(rids, slots)     vs  req_to_token[reqs, pos] = slots
    append         RequestTable.append per request            vs  the same

    PYTHONPATH=build/python <venv>/bin/python bench/formats_bench.py [--quick]
"""
import argparse

import numpy as np
import torch
from python_bench import per_call  # this folder's: the binding's bench times its calls the same way

import moecap
from moecap.engine import RequestTable
from moecap.record import RoutedExperts

TOKENS, LAYERS, DENSE, TOP_K, EXPERTS = 4096, 61, 3, 8, 256
REQUESTS = 256


def decode_steps(per_request):
    """A decode step of REQUESTS requests into a RequestTable: all at once, or one append per request."""
    cap = moecap.Capturer(num_layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS, host_slots=1 << 18,
                          max_running_requests=REQUESTS, chunked_prefill_size=REQUESTS)
    rids = list(range(REQUESTS))
    slots = np.arange(REQUESTS, dtype=np.int64)
    state = {"table": None, "steps": 0}

    def step():
        if state["steps"] % 512 == 0:  # a fresh table: a run's millions of steps would hold GBs of slots
            state["table"] = RequestTable(cap)
            for rid in rids:
                state["table"].start(rid)
        state["steps"] += 1
        if per_request:
            for rid in rids:
                state["table"].append(rid, slots[rid:rid + 1])
        else:
            state["table"].append_step(rids, slots)
    return step


def duration(seconds):
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.1f} µs"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke test, not numbers to quote)")
    min_time = 0.02 if parser.parse_args().quick else 0.2
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, EXPERTS, size=(TOKENS, LAYERS - DENSE, TOP_K), dtype=np.int32)  # what a read returns
    routed = RoutedExperts(ids, EXPERTS, layers=range(DENSE, LAYERS), num_hidden_layers=LAYERS)
    as_tensor = torch.from_numpy(ids)
    packed, plain, raw = routed.to_bytes(), routed.to_bytes(packed=False), ids.astype(np.int16).tobytes()

    def placed(dtype, leading=()):
        out = np.zeros((*leading, TOKENS, LAYERS, TOP_K), dtype=dtype)
        out[..., DENSE:, :] = ids
        return out

    req_to_token = torch.zeros(REQUESTS, 8192, dtype=torch.int64)
    reqs, positions, step_slots = torch.arange(REQUESTS), torch.zeros(REQUESTS, dtype=torch.int64), torch.arange(REQUESTS)

    def assign_step():
        req_to_token[reqs, positions] = step_slots

    cases = [
        ("to_bytes (packed ids)", lambda: routed.to_bytes(), lambda: as_tensor.to(torch.int16).numpy().tobytes()),
        ("to_bytes (plain ids)", lambda: routed.to_bytes(packed=False),
         lambda: as_tensor.to(torch.int16).numpy().tobytes()),
        ("from_bytes (packed ids)", lambda: RoutedExperts.from_bytes(packed),
         lambda: np.frombuffer(raw, np.int16).astype(np.int32)),
        ("from_bytes (plain ids)", lambda: RoutedExperts.from_bytes(plain),
         lambda: np.frombuffer(raw, np.int16).astype(np.int32)),
        ("to_vllm", lambda: routed.to_vllm(), lambda: placed(np.uint8)),
        ("to_verl", lambda: routed.to_verl(1, 1, TOKENS), lambda: placed(np.int16, (1,))),
        ("to_megatron", lambda: routed.to_megatron(), lambda: as_tensor.long().permute(1, 0, 2).contiguous().unbind(0)),
        ("all_layers", lambda: routed.all_layers(), lambda: placed(np.int16)),
        (f"RequestTable.append_step, a decode step of {REQUESTS} requests", decode_steps(False), assign_step),
        ("RequestTable.append per request, the same step", decode_steps(True), assign_step),
    ]
    print(f"moecap formats vs NumPy {np.__version__} / torch {torch.__version__}, one thread; {TOKENS} tokens, "
          f"{LAYERS} layers ({LAYERS - DENSE} routed), top-{TOP_K} of {EXPERTS}\n")
    print("| call | moecap | baseline | moecap / baseline |")
    print("|---|---|---|---|")
    for name, ours, theirs in cases:
        a, b = per_call(ours, min_time), per_call(theirs, min_time)
        print(f"| {name} | {duration(a)} | {duration(b)} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
