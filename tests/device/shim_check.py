"""PyTorch under libgpuslice.so with a 20 GiB slice (see shim.sh). Prints a table; exits 1 on FAIL."""
import sys
import time

import torch

GIB = 1 << 30
CAP = 20 * GIB
rows = []


def check(name, ok, detail):
    rows.append((name, "PASS" if ok else "FAIL", detail))


start = time.time()
free, total = torch.cuda.mem_get_info()
check("mem_get_info total = cap", total == CAP, f"total={total / GIB:.2f} GiB free={free / GIB:.2f} GiB")
check("context charged to the slice", 0 < CAP - free < 2 * GIB, f"taken before any tensor: {(CAP - free) / 2**20:.0f} MiB")

held = []
try:
    for _ in range(18):
        held.append(torch.empty(GIB, dtype=torch.uint8, device="cuda"))
    check("allocations under the cap", True, f"{len(held)} × 1 GiB")
except torch.cuda.OutOfMemoryError as e:
    check("allocations under the cap", False, f"OOM after {len(held)} GiB: {e}")

try:
    torch.empty(4 * GIB, dtype=torch.uint8, device="cuda")
    check("allocation past the cap raises OutOfMemoryError", False, "it succeeded")
except torch.cuda.OutOfMemoryError:
    check("allocation past the cap raises OutOfMemoryError", True, "4 GiB more refused")
del held
torch.cuda.empty_cache()
free_after, _ = torch.cuda.mem_get_info()
check("freed memory comes back", abs(free_after - free) < 64 * 2**20, f"free={free_after / GIB:.2f} GiB")

# A CUDA graph: capture a few kernels, replay them.
x = torch.randn(1 << 20, device="cuda")
y = torch.empty_like(x)
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    for _ in range(3):
        y.copy_(x * 2 + 1)
torch.cuda.current_stream().wait_stream(stream)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    y.copy_(x * 2 + 1)
x.fill_(1.0)
graph.replay()
torch.cuda.synchronize()
check("CUDA graph capture and replay", bool(torch.all(y == 3.0)), "y = 2x + 1 after replay")

width = max(len(r[0]) for r in rows)
for name, result, detail in rows:
    print(f"{name:<{width}}  {result}  {detail}")
print(f"({time.time() - start:.1f} s)")
sys.exit(0 if all(r[1] == "PASS" for r in rows) else 1)
