"""`nvidia-smi topo -m` and `nvidia-smi nvlink --status` in miniature, written against
nvidia-ml-py (pynvml) as such tools are: for every pair of GPUs, the closest common ancestor and
whether peer-to-peer traffic can go over NVLink, and for every GPU its active NVLink links.
Prints one JSON object. Run by tests/pynvml.rs against the emulator."""

import json

import pynvml

LEVELS = {
    pynvml.NVML_TOPOLOGY_INTERNAL: "X",
    pynvml.NVML_TOPOLOGY_SINGLE: "PIX",
    pynvml.NVML_TOPOLOGY_MULTIPLE: "PXB",
    pynvml.NVML_TOPOLOGY_HOSTBRIDGE: "PHB",
    pynvml.NVML_TOPOLOGY_NODE: "NODE",
    pynvml.NVML_TOPOLOGY_SYSTEM: "SYS",
}


def active_links(handle):
    """How many NVLink links are up; None where the GPU has no NVLink."""
    up = 0
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        try:
            if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                up += 1
        except pynvml.NVMLError_NotSupported:
            return None
        except pynvml.NVMLError_InvalidArgument:
            break
    return up


def main():
    pynvml.nvmlInit()
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        matrix = []
        nvlink = []
        for a in handles:
            matrix.append([LEVELS[pynvml.nvmlDeviceGetTopologyCommonAncestor(a, b)] for b in handles])
            nvlink.append(
                [
                    pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
                    == pynvml.NVML_P2P_STATUS_OK
                    for b in handles
                ]
            )
        print(
            json.dumps(
                {
                    "matrix": matrix,
                    "nvlink": nvlink,
                    "links": [active_links(h) for h in handles],
                }
            )
        )
    finally:
        pynvml.nvmlShutdown()


if __name__ == "__main__":
    main()
