# SPDX-License-Identifier: Apache-2.0
"""CI regression guard: each step-path operation against its own baseline,
measured in the same short moecap_bench run, fails below a floor ratio.

    python3 bench/guard.py BUILD_DIR [--floor 0.5]

Runs moecap_bench (build it first: cmake --build BUILD_DIR --target
moecap_bench) over a few cases for about ten seconds and compares the median
CPU time per call: commit against copying the rows out and scattering them
(BM_Commit_Baseline), read against an element-wise gather, capture against
a strided slice copy; and commit against its floor, a memcpy of each
finished row to a fresh slot, timed call by call beside it by the monotonic
clock (BM_Commit_AgainstFloor's floor_over_commit: run as separate cases,
the two drift apart on a shared machine; the floor page-aligned on 2 MB
pages, as moecap's cache). On a loaded 2-core machine moecap is normally
8-22x the copy-out-and-scatter and the gather, 1.1-1.6x the memcpy floor,
and 2-3x the slice copy (the narrowest margin). The 0.5x floor is wide
(noisy shared machines pass) and narrow enough to catch a loss of several
times, like a second slow pass over every committed row (which made commit
0.3x of the copy-out-and-scatter).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

# (what, moecap case, baseline case); the rewrite of the rows before each
# commit (BM_Commit_Rewrite, same args) is taken out of moecap's commit.
PAIRS = [
    ("commit 4096 rows, random slots of 262,144, vs copy-out-and-scatter", "BM_Commit_Moecap/4096/1/262144",
     "BM_Commit_Baseline/4096/1/262144"),
    ("read 4096 tokens, vs an element-wise gather", "BM_Read_Moecap/4096", "BM_Read_Baseline/4096"),
    ("capture 16384 rows, vs a strided slice copy", "BM_Capture_Moecap/16384/32/4", "BM_Capture_Baseline/16384"),
]


# (what, case): cases that time moecap and its baseline call by call and
# report baseline / moecap as the counter floor_over_commit.
PAIRED = [
    ("commit 4096 rows, fresh random slots of 262,144, vs a memcpy per row",
     "BM_Commit_AgainstFloor/4096/2/262144"),
]


def rewrite_of(case):
    """The rewrite moecap's commit case does before each commit, or None."""
    kind = "BM_Commit_Moecap/"
    return "BM_Commit_Rewrite/" + case[len(kind):] if case.startswith(kind) else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", help="the CMake build folder holding bench/moecap_bench")
    parser.add_argument("--floor", type=float, default=0.5, help="fail below this baseline/moecap time ratio")
    args = parser.parse_args()
    exe = os.path.join(args.build, "bench", "moecap_bench")
    names = [n for _, ours, theirs in PAIRS for n in (ours, theirs)]
    names += sorted({rewrite_of(ours) for _, ours, _ in PAIRS if rewrite_of(ours)})
    names += [case for _, case in PAIRED]
    pattern = "^(" + "|".join(names) + ")$"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "guard.json")
        subprocess.run([exe, f"--benchmark_filter={pattern}", "--benchmark_min_time=0.05",
                        "--benchmark_repetitions=3", "--benchmark_report_aggregates_only=true",
                        f"--benchmark_out={out}", "--benchmark_out_format=json"],
                       check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            report = json.load(f)
    median, paired = {}, {}
    for b in report["benchmarks"]:
        if b.get("aggregate_name") == "median":
            median[b["run_name"]] = b["cpu_time"]  # wall time counts other jobs on a shared machine
            if "floor_over_commit" in b:
                paired[b["run_name"]] = b["floor_over_commit"]
    failed = False
    print(f"moecap bench guard: baseline time / moecap time, floor {args.floor}x")
    for what, ours, theirs in PAIRS:
        if ours not in median or theirs not in median:
            print(f"  {what}: case missing from the run ({ours} / {theirs})")
            failed = True
            continue
        mine, their = median[ours], median[theirs]
        for name in (ours, theirs):
            if rewrite_of(name) and rewrite_of(name) not in median:
                print(f"  {what}: case missing from the run ({rewrite_of(name)})")
                failed = True
        mine -= median.get(rewrite_of(ours), 0.0) if rewrite_of(ours) else 0.0
        their -= median.get(rewrite_of(theirs), 0.0) if rewrite_of(theirs) else 0.0
        ratio = their / max(mine, 1e-9)
        verdict = "ok" if ratio >= args.floor else "TOO SLOW"
        failed = failed or ratio < args.floor
        print(f"  {what}: {ratio:.2f}x ({verdict})")
    for what, case in PAIRED:
        if case not in paired:
            print(f"  {what}: case missing from the run ({case})")
            failed = True
            continue
        ratio = paired[case]
        verdict = "ok" if ratio >= args.floor else "TOO SLOW"
        failed = failed or ratio < args.floor
        print(f"  {what}: {ratio:.2f}x ({verdict})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
