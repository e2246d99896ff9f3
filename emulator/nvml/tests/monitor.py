"""A GPU monitoring tool in the style of nvidia-smi and gpustat, written against nvidia-ml-py
(pynvml) as any such tool is: it loads libnvidia-ml.so.1 from the library path and asks about
every device. Each device (and each MIG device) becomes one JSON line; a field the device does
not support is null, as these tools print N/A. Run by tests/pynvml.rs against the emulator."""

import json

import pynvml


def maybe(call, *args):
    """The call's answer, or None where the device does not support it."""
    try:
        return call(*args)
    except pynvml.NVMLError_NotSupported:
        return None


def text(value):
    return value.decode() if isinstance(value, bytes) else value


def process_name(pid):
    try:
        return text(pynvml.nvmlSystemGetProcessName(pid))
    except pynvml.NVMLError:
        return None


def processes(handle):
    running = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    running += pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle)
    return [
        {"pid": p.pid, "memory": p.usedGpuMemory, "name": process_name(p.pid)}
        for p in running
    ]


def mps_processes(handle):
    """The pids with an MPS client's context on the device (`nvidia-smi` marks them M+C);
    None before Volta, where NVML has no such list."""
    try:
        return [p.pid for p in pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)]
    except pynvml.NVMLError_NotSupported:
        return None


def process_utilization(handle):
    """Per-process SM and memory use over the last sample period, as `nvidia-smi pmon` shows it:
    None where not supported, [] where no process ran (NVML says NOT_FOUND)."""
    try:
        samples = pynvml.nvmlDeviceGetProcessUtilization(handle, 0)
    except pynvml.NVMLError_NotSupported:
        return None
    except pynvml.NVMLError_NotFound:
        return []
    return [
        {"pid": s.pid, "sm": s.smUtil, "memory": s.memUtil, "stamped": s.timeStamp > 0}
        for s in samples
    ]


def memory(handle):
    m = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return {"total": m.total, "used": m.used, "free": m.free}


def device(index, handle):
    uuid = text(pynvml.nvmlDeviceGetUUID(handle))
    bus_id = text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
    # Tools that take a device on the command line find it again by UUID or bus id.
    by_uuid = pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid))
    by_bus = pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByPciBusId(bus_id))
    util = maybe(pynvml.nvmlDeviceGetUtilizationRates, handle)
    clock = lambda kind: maybe(pynvml.nvmlDeviceGetClockInfo, handle, kind)
    encoder = maybe(pynvml.nvmlDeviceGetEncoderUtilization, handle)
    mig = maybe(pynvml.nvmlDeviceGetMigMode, handle)
    bar1 = maybe(pynvml.nvmlDeviceGetBAR1MemoryInfo, handle)
    return {
        "index": index,
        "found_by": [by_uuid, by_bus],
        "name": text(pynvml.nvmlDeviceGetName(handle)),
        "uuid": uuid,
        "bus_id": bus_id,
        "serial": text(maybe(pynvml.nvmlDeviceGetSerial, handle)),
        "minor": pynvml.nvmlDeviceGetMinorNumber(handle),
        "brand": pynvml.nvmlDeviceGetBrand(handle),
        "architecture": maybe(pynvml.nvmlDeviceGetArchitecture, handle),
        "compute_capability": maybe(pynvml.nvmlDeviceGetCudaComputeCapability, handle),
        "vbios": text(maybe(pynvml.nvmlDeviceGetVbiosVersion, handle)),
        "persistence": pynvml.nvmlDeviceGetPersistenceMode(handle),
        "compute_mode": pynvml.nvmlDeviceGetComputeMode(handle),
        "pstate": pynvml.nvmlDeviceGetPerformanceState(handle),
        "ecc": maybe(pynvml.nvmlDeviceGetEccMode, handle),
        "ecc_uncorrected": maybe(
            pynvml.nvmlDeviceGetTotalEccErrors,
            handle,
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            pynvml.NVML_VOLATILE_ECC,
        ),
        "memory": memory(handle),
        "bar1_total": None if bar1 is None else bar1.bar1Total,
        "utilization": None if util is None else {"gpu": util.gpu, "memory": util.memory},
        "encoder": None if encoder is None else encoder[0],
        "temperature": maybe(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU),
        "fan": maybe(pynvml.nvmlDeviceGetFanSpeed, handle),
        "power": maybe(pynvml.nvmlDeviceGetPowerUsage, handle),
        "power_limit": maybe(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle),
        "clocks": {
            "graphics": clock(pynvml.NVML_CLOCK_GRAPHICS),
            "sm": clock(pynvml.NVML_CLOCK_SM),
            "memory": clock(pynvml.NVML_CLOCK_MEM),
            "max_sm": maybe(pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_SM),
        },
        "mig_mode": mig,
        "mig_devices": mig_devices(handle) if mig and mig[0] else [],
        "processes": processes(handle),
        "mps_processes": mps_processes(handle),
        "process_utilization": process_utilization(handle),
    }


def mig_devices(handle):
    found = []
    for i in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except pynvml.NVMLError_NotFound:
            continue
        found.append(
            {
                "name": text(pynvml.nvmlDeviceGetName(mig)),
                "uuid": text(pynvml.nvmlDeviceGetUUID(mig)),
                "memory": memory(mig),
                "utilization": maybe(pynvml.nvmlDeviceGetUtilizationRates, mig),
                "processes": processes(mig),
                "mps_processes": mps_processes(mig),
            }
        )
    return found


def main():
    pynvml.nvmlInit()
    try:
        print(
            json.dumps(
                {
                    "driver": text(pynvml.nvmlSystemGetDriverVersion()),
                    "nvml": text(pynvml.nvmlSystemGetNVMLVersion()),
                    "cuda": pynvml.nvmlSystemGetCudaDriverVersion_v2(),
                }
            )
        )
        for i in range(pynvml.nvmlDeviceGetCount()):
            print(json.dumps(device(i, pynvml.nvmlDeviceGetHandleByIndex(i))))
    finally:
        pynvml.nvmlShutdown()


if __name__ == "__main__":
    main()
