#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Turns moecap_bench's JSON (--benchmark_out) into docs/BENCHMARKS.md's tables:
each moecap case beside its baseline from the same run, as a ratio.

    python3 bench/report.py build/moecap_bench.json
"""
import json
import sys


def load(path):
    with open(path) as f:
        data = json.load(f)
    cases = {}
    for b in data["benchmarks"]:
        if b.get("error_occurred"):
            continue
        name = b.get("run_name", b["name"]).replace("/manual_time", "")
        # With --benchmark_repetitions the medians speak; single runs speak for themselves.
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        if b.get("run_type") == "iteration" and name in cases:
            continue
        cases[name] = b
    return data.get("context", {}), cases


def ns(b):
    """CPU time per iteration: on a shared machine wall time counts other jobs' time slices. A case
    that times itself (UseManualTime: GPU events around its replays) reports that time as real_time;
    its CPU time is the host's wait for a whole batch of replays."""
    scale = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}[b["time_unit"]]
    manual = b.get("run_name", b["name"]).endswith("/manual_time")
    return (b["real_time"] if manual else b["cpu_time"]) * scale


def rate(b):
    return b.get("items_per_second", 0.0)


def fmt_rate(r):
    return f"{r / 1e6:.1f} M"


def fmt_ns(t):
    return f"{t:.1f} ns" if t < 1e3 else f"{t / 1e3:.1f} µs"


SMALL, LARGE = 1 << 17, 1 << 18  # host slots of the commit cases


def host_rows(c):
    rows = []
    # Commit: against the framework's copy-and-scatter (baseline) and the floor,
    # a bare memcpy of each finished row to its slot (BM_Commit_MemcpyRows, or
    # paired with the commit call by call: BM_Commit_AgainstFloor).
    # Fresh slots: each commit to slots the commits just before did not use.
    for n, order, slots in ((4096, 0, SMALL), (512, 0, SMALL), (64, 0, SMALL), (4096, 1, SMALL), (512, 1, SMALL),
                            (64, 1, SMALL), (4096, 1, LARGE), (512, 1, LARGE), (64, 1, LARGE), (4096, 2, LARGE),
                            (512, 2, LARGE), (64, 2, LARGE)):
        key = f"{n}/{order}/{slots}"
        m, w = c.get(f"BM_Commit_Moecap/{key}"), c.get(f"BM_Commit_Rewrite/{key}")
        b, floor = c.get(f"BM_Commit_Baseline/{key}"), c.get(f"BM_Commit_MemcpyRows/{key}")
        if m and w and b and floor:
            # The rows' rewrite before each commit taken out of moecap's time and of the floor's.
            commit = n / max(ns(m) - ns(w), 1e-3) * 1e9
            bare = n / max(ns(floor) - ns(w), 1e-3) * 1e9
            against = bare / commit
            paired = c.get(f"BM_Commit_AgainstFloor/{key}")
            small_pages = ""
            if paired:  # the floor's ratio from the interleaved measurement, which drift does not skew
                bare = n / paired["floor_ns"] * 1e9
                against = paired["floor_over_commit"]
                small_pages = f"; into 4 KB pages {paired['small_pages_floor_over_commit']:.2f}x"
            kind = ("sequential slots", f"random slots of {slots:,}", f"fresh random slots of {slots:,}")[order]
            rows.append((f"commit {n} rows, {kind} (tokens/s)", fmt_rate(commit), fmt_rate(rate(b)),
                         f"{commit / rate(b):.1f}x; {against:.2f}x memcpy per row ({fmt_rate(bare)}){small_pages}"))
    for t in (128, 4096, 32768):
        m, b = c.get(f"BM_Read_Moecap/{t}"), c.get(f"BM_Read_Baseline/{t}")
        if m and b:
            rows.append((f"read {t} tokens into int32 (tokens/s)", fmt_rate(rate(m)), fmt_rate(rate(b)),
                         f"{rate(m) / rate(b):.1f}x"))
    for n in (1, 512, 4096, 16384):
        m, b = c.get(f"BM_Capture_Moecap/{n}/32/4"), c.get(f"BM_Capture_Baseline/{n}")
        if m and b:
            rows.append((f"capture {n} row(s), int32 -> int16 (time per call)", fmt_ns(ns(m)), fmt_ns(ns(b)),
                         f"{ns(b) / ns(m):.2f}x"))
    m, b = c.get("BM_Abi_CaptureThroughDlopen"), c.get("BM_Abi_CaptureDirectCpp")
    if m and b:
        rows.append(("capture 1 row through dlopen vs direct C++", fmt_ns(ns(m)), fmt_ns(ns(b)),
                     f"+{ns(m) - ns(b):.1f} ns"))
    return rows


def u8_device_rows(c):
    """The commit from a u8 device buffer (what an engine capturing through moecap_capture can hold for
    <= 255 experts) against the floor, paired call by call; times are medians per call (monotonic clock)."""
    rows = []
    for n, order, slots in ((4096, 0, SMALL), (512, 0, SMALL), (64, 0, SMALL), (4096, 1, LARGE), (512, 1, LARGE),
                            (64, 1, LARGE), (4096, 2, LARGE), (512, 2, LARGE), (64, 2, LARGE)):
        key = f"{n}/{order}/{slots}"
        i16, u8 = c.get(f"BM_Commit_AgainstFloor/{key}"), c.get(f"BM_Commit_AgainstFloor_U8Device/{key}")
        if u8:
            kind = ("sequential slots", f"random slots of {slots:,}", f"fresh random slots of {slots:,}")[order]
            before = f"{i16['floor_over_commit']:.2f}x" if i16 else "-"
            rows.append((f"commit {n} rows, {kind}", fmt_ns(u8["commit_ns"]), fmt_ns(u8["floor_ns"]),
                         f"{u8['floor_over_commit']:.2f}x", f"{u8['small_pages_floor_over_commit']:.2f}x", before))
    return rows


def narrowing_floor_rows(c):
    """What is left of the commit once narrowing and consuming are paid for: the int16 and u8 device
    buffers' commit beside a memcpy per row and two bare loops over device-width, slot-major rows (no
    transpose, no checks), paired call by call: each id narrowed into its slot, and narrowed then all ones
    written back over it (the consumption a commit cannot skip). With sequential slots the loops are the floor
    of a commit from a slot-major buffer; into fresh random slots they are slower than moecap, which requests
    the slots' rows ahead."""
    rows = []
    for case, what in (("", "int16"), ("_U8Device", "u8")):
        for n, order, slots in ((4096, 0, SMALL), (512, 0, SMALL), (64, 0, SMALL), (4096, 2, LARGE),
                                (512, 2, LARGE), (64, 2, LARGE)):
            b = c.get(f"BM_Commit_AgainstNarrowing{case}/{n}/{order}/{slots}")
            if b and "narrow_consume_floor_ns" in b:
                kind = ("sequential slots", "", f"fresh random slots of {slots:,}")[order]
                rows.append((f"{what} ids: commit {n} rows, {kind}", fmt_ns(b["commit_ns"]), fmt_ns(b["floor_ns"]),
                             fmt_ns(b["narrow_floor_ns"]), fmt_ns(b["narrow_consume_floor_ns"]),
                             f"{b['floor_over_commit']:.2f}x", f"{b['narrow_consume_floor_over_commit']:.2f}x"))
    return rows


def top_k_rows(c):
    """The commit at top-6 (DeepSeek-V2), top-4 (gpt-oss) and top-2 (Mixtral), at top-8 of 384 experts into
    u16 host ids (Kimi K2), at top-1 (Llama 4), at top-10 of 512 and top-12 of 768 into u16 (Qwen3-Next,
    LongCat-Flash), at top-3 of 64 (Step-3), and top-8 with bf16 routing weights, against its floor, paired call
    by call (int16 device buffer, 48 layers: 288-, 192-, 96-, 768-, 48-, 960-, 1152- and 144-byte host rows;
    with weights 384 bytes of ids and 768 of weights)."""
    rows = []
    for case, what in (("Top6", "top-6"), ("Top4", "top-4"), ("Top2", "top-2"), ("U16Host", "top-8 of 384, u16 ids"),
                       ("Top1", "top-1"), ("Top10U16Host", "top-10 of 512, u16 ids"),
                       ("Top12U16Host", "top-12 of 768, u16 ids"), ("Top3", "top-3"),
                       ("Bf16Weights", "top-8 with bf16 weights")):
        for n, order, slots in ((4096, 0, SMALL), (512, 0, SMALL), (64, 0, SMALL), (4096, 2, LARGE),
                                (512, 2, LARGE), (64, 2, LARGE)):
            b = c.get(f"BM_Commit_AgainstFloor_{case}/{n}/{order}/{slots}")
            if b:
                kind = ("sequential slots", "", f"fresh random slots of {slots:,}")[order]
                rows.append((f"{what}: commit {n} rows, {kind}", fmt_ns(b["commit_ns"]), fmt_ns(b["floor_ns"]),
                             f"{b['floor_over_commit']:.2f}x", f"{b['small_pages_floor_over_commit']:.2f}x"))
    return rows


def bytes_rate(b):
    return b.get("bytes_per_second", 0.0)


def fmt_bw(r):
    return f"{r / 1e9:.1f} GB/s"


LINK_BYTES = 64 << 20
ROW_BYTES = 48 * 8  # a committed u8 row in these cases
REPLAY_MODES = ((1, "capture node"), (2, "side branch"), (3, "kernel writes the view"))


def cuda_rows(c):
    rows = []
    link = c.get(f"BM_CudaLink_PinnedCopy/{LINK_BYTES}")
    if link:
        rows.append(("host link: pinned device-to-host copy of 64 MiB", fmt_bw(bytes_rate(link)), "", ""))
    for n in (64, 512, 4096, 16384):
        m, b = c.get(f"BM_CudaCommit_Direct/{n}"), c.get(f"BM_CudaCommit_Staged/{n}")
        same = c.get(f"BM_CudaLink_PinnedCopy/{n * ROW_BYTES}")
        if m and b:
            ratio = f"{rate(m) / rate(b):.1f}x"
            if link:
                ratio += f"; {bytes_rate(m) / bytes_rate(link):.0%} of the link"
            if same:
                ratio += f" ({bytes_rate(m) / bytes_rate(same):.0%} of a copy of its {n * ROW_BYTES} bytes)"
            rows.append((f"commit {n} rows to random slots (tokens/s)", fmt_rate(rate(m)), fmt_rate(rate(b)), ratio))
    for n in (64, 512, 4096):
        without = c.get(f"BM_CudaGraph_Replay/{n}/0")
        for mode, what in REPLAY_MODES:
            with_ = c.get(f"BM_CudaGraph_Replay/{n}/{mode}")
            if with_ and without:
                per_layer = (ns(with_) - ns(without)) / 48  # the one commit amortized over the 48 layers
                rows.append((f"graph replay, 48 MoE layers, {n} tokens: {what}", fmt_ns(ns(with_)),
                             fmt_ns(ns(without)), f"{per_layer / 1e3:+.2f} µs per MoE layer"))
    return rows


def memory_rows(c):
    rows = []
    for name, b in sorted(c.items()):
        if not name.startswith("BM_Memory/"):
            continue
        dp = name.split("/")[2]
        rows.append((b.get("label", ""), dp, f"{b['moecap_device_MiB']:.1f} / {b['moecap_host_MiB']:.0f} MiB",
                     f"{b['old_device_MiB']:.1f} / {b['old_host_MiB']:.0f} MiB"))
    return rows


def table(header, rows):
    if not rows:
        return ""
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def main():
    context, cases = load(sys.argv[1] if len(sys.argv) > 1 else "build/moecap_bench.json")
    print(f"<!-- {context.get('host_name', '?')}, {context.get('num_cpus', '?')} CPUs, {context.get('date', '?')} -->")
    print(table(("case", "moecap", "baseline", "ratio"), host_rows(cases)))
    print(table(("u8 device buffer: case", "commit", "memcpy per row", "x memcpy per row",
                 "x memcpy per row, 4 KB pages", "int16 device buffer"), u8_device_rows(cases)))
    print(table(("narrowing floors: case", "commit", "memcpy per row", "narrow per row", "narrow and consume per row",
                 "x memcpy per row", "x narrow and consume"), narrowing_floor_rows(cases)))
    print(table(("other top-k: case", "commit", "memcpy per row", "x memcpy per row", "x memcpy per row, 4 KB pages"),
                top_k_rows(cases)))
    print(table(("case (CUDA)", "moecap", "baseline", "ratio"), cuda_rows(cases)))
    print(table(("model", "dp", "moecap device / host", "int32, old sizing: device / host"), memory_rows(cases)))


if __name__ == "__main__":
    main()
