#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Bytes per token of one request's routing in each wire form, measured on
the bytes each encoder writes (docs/CONSUMERS.md's record table).

    PYTHONPATH=build/python ~/.cache/moecap/venv/bin/python bench/record_sizes.py [layers top_k experts tokens]
"""
import base64
import sys

import numpy as np

from moecap.record import RoutedExperts


def main(layers=61, top_k=8, experts=256, tokens=4096):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, experts, size=(tokens, layers, top_k))
    weights = rng.random((tokens, layers, top_k), dtype=np.float32)
    r = RoutedExperts(ids, experts, weights=weights)
    ids_only = RoutedExperts(ids, experts)
    rows = [
        ("SGLang: base64 of int32 (the baseline)", len(ids_only.to_sglang())),
        ("vLLM OpenAI: base64 of np.save, uint8 up to 256 experts, else uint16", len(ids_only.to_vllm_openai())),
        ("SGLang newer: base64 of uint8 (no room for 'none')", len(base64.b64encode(ids.astype(np.uint8).tobytes()))
         if experts <= 256 else None),
        ("moecap record, plain ids", len(ids_only.to_bytes(packed=False))),
        ("moecap record, packed ids", len(ids_only.to_bytes(packed=True))),
        ("moecap record, packed ids, base64 (JSON field)", len(base64.b64encode(ids_only.to_bytes(packed=True)))),
        ("moecap record, packed ids + bf16 weights", len(r.to_bytes(weights="bf16"))),
    ]
    base = rows[0][1]
    print(f"{layers} layers, top-{top_k} of {experts} experts, a {tokens}-token request (header included)\n")
    print("| form | bytes per token | SGLang int32 base64 / this |")
    print("|---|---|---|")
    for name, size in rows:
        if size is not None:
            print(f"| {name} | {size / tokens:.1f} | {base / size:.2f}x |")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
