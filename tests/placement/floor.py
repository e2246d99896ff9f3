"""How well a trace's shares can pack at all: the idle capacity left on GPUs that host shares
when the shares that arrive by 100% are packed as tightly as possible.

At 100% arrived, what is unallocated equals the GPU of the refused pods, and it is at least the
idle capacity on GPUs that host shares. This solves the shares' bin packing exactly (an integer
program over packing patterns, one GPU = 1000 thousandths) and prints that idle capacity as a
share of the cluster's GPUs. The shares that arrive by 100% are the trace's, scaled by how much
of the cluster the trace asks for (the replay samples more pods from a trace that asks for
less, and stops early in one that asks for more).

It is a floor for a replay in which every arriving share is placed; a replay that refuses
shares (none fits any more) packs fewer and can end lower, so it is a yardstick, not a proof.
It ignores CPU, memory, whole-GPU tasks and the arrival order, which only make packing harder.

    pip install scipy numpy
    python3 tests/placement/floor.py ../shared/data/alibaba-gpu-v2023 [trace ...]

Not run in CI (it needs scipy); its figures are in the notes of issue 6.
"""
import collections
import csv
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

WHOLE = 1000


def patterns(sizes):
    """Every maximal way to fill one GPU with shares of these sizes (counts per size)."""
    out = []

    def fill(i, left, counts):
        if i == len(sizes):
            if any(counts) and all(left < s for s in sizes):
                out.append(counts[:])
            return
        for k in range(left // sizes[i], -1, -1):
            counts.append(k)
            fill(i + 1, left - k * sizes[i], counts)
            counts.pop()

    fill(0, WHOLE, [])
    return out


def floor(folder, trace):
    gpus = sum(int(n["gpu"]) for n in csv.DictReader(open(folder / "openb_node_list_gpu_node.csv")))
    pods = list(csv.DictReader(open(folder / f"openb_pod_list_{trace}.csv")))
    asked = sum(int(p["num_gpu"]) * int(p["gpu_milli"]) for p in pods) / WHOLE
    shares = collections.Counter(
        int(p["gpu_milli"]) for p in pods if int(p["num_gpu"]) == 1 and int(p["gpu_milli"]) < WHOLE
    )
    demand = {s: round(n * gpus / asked) for s, n in shares.items()}
    sizes = sorted(demand, reverse=True)
    a = np.array(patterns(sizes)).T
    need = np.array([demand[s] for s in sizes])
    best = milp(
        c=np.ones(a.shape[1]),
        constraints=LinearConstraint(a, lb=need, ub=np.inf),
        integrality=np.ones(a.shape[1]),
        bounds=Bounds(0, np.inf),
        options={"time_limit": 120},
    )
    used = sum(s * d for s, d in demand.items()) / WHOLE
    return best.fun, used, gpus, asked / gpus * 100


def main():
    folder = Path(sys.argv[1])
    traces = sys.argv[2:] or sorted(
        p.stem.removeprefix("openb_pod_list_") for p in folder.glob("openb_pod_list_*.csv")
    )
    print(f"{'trace':<12} {'trace asks %':>12} {'GPUs with shares':>16} {'share GPUs':>10} {'floor %':>8}")
    for t in traces:
        bins, used, gpus, asked = floor(folder, t)
        print(f"{t:<12} {asked:>12.1f} {bins:>16.0f} {used:>10.1f} {(bins - used) / gpus * 100:>8.2f}")


if __name__ == "__main__":
    main()
