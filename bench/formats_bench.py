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

    PYTHONPATH=build/python <venv>/bin/python bench/formats_bench.py [--quick]
"""
import argparse

import numpy as np
import torch
from python_bench import per_call  # this folder's: the binding's bench times its calls the same way

from moecap.record import RoutedExperts

TOKENS, LAYERS, DENSE, TOP_K, EXPERTS = 4096, 61, 3, 8, 256


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
    ]
    print(f"moecap formats vs NumPy {np.__version__} / torch {torch.__version__}, one thread; {TOKENS} tokens, "
          f"{LAYERS} layers ({LAYERS - DENSE} routed), top-{TOP_K} of {EXPERTS}\n")
    print("| call | moecap | baseline | moecap / baseline |")
    print("|---|---|---|---|")
    for name, ours, theirs in cases:
        a, b = per_call(ours, min_time), per_call(theirs, min_time)
        print(f"| {name} | {a * 1e3:.2f} ms | {b * 1e3:.2f} ms | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
